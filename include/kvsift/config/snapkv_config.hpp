// SnapKV's config (docs/algorithms.md §1.4): the window importance of §1.1 with SnapKV's own
// defaults (window 32, kernel 5, average pooling, attention summed over the window). Eigen-free.
#pragma once

#include "kvsift/config/options.hpp"
#include "kvsift/config/scoring.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

struct SnapKVConfig {
  int budget = 1024;
  int window = 32;  // SnapKV's observation window
  int buffer = 128;
  int kernel = 5;  // SnapKV's pooling kernel
  Pooling pooling = Pooling::avg;
  WindowReduce reduction = WindowReduce::sum;
  GqaReduce gqa = GqaReduce::mean;
  int sink = 0;

  void validate() const {
    KVSIFT_CHECK(window >= 1, "SnapKVConfig: window must be >= 1, got ", window);
    KVSIFT_CHECK(sink >= 0, "SnapKVConfig: sink must be >= 0, got ", sink);
    KVSIFT_CHECK(budget > window + sink, "SnapKVConfig: budget (", budget,
                 ") must exceed window + sink (", window, " + ", sink, ")");
    KVSIFT_CHECK(buffer >= window, "SnapKVConfig: buffer (", buffer, ") must be >= window (",
                 window, ")");
    importance_config().validate();
  }
  WindowImportanceConfig importance_config() const {
    return {window, kernel, gqa, pooling, reduction};
  }
  TopKSelection selection() const { return {budget, window, sink}; }
};

}  // namespace kvsift
