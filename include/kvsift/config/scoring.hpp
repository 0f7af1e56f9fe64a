// The token-scoring building blocks' configs (docs/algorithms.md §1): window importance, key
// redundancy and the top-k selection. Eigen-free, shared by the CPU and CUDA backends.
#pragma once

#include <cmath>

#include "kvsift/config/options.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

struct WindowImportanceConfig {
  int window = 8;                               // W: observation-window queries
  int kernel = 7;                               // pooling kernel, odd
  GqaReduce gqa = GqaReduce::max;               // R-KV default
  Pooling pooling = Pooling::max;               // R-KV default (SnapKV: avg)
  WindowReduce reduction = WindowReduce::mean;  // R-KV default (SnapKV: sum)

  void validate() const {
    KVSIFT_CHECK(window >= 1, "WindowImportanceConfig: window must be >= 1, got ", window);
    KVSIFT_CHECK(kernel >= 1 && kernel % 2 == 1,
                 "WindowImportanceConfig: kernel must be odd and >= 1, got ", kernel);
  }
};

struct KeyRedundancyConfig {
  float threshold = 0.5f;  // cosine above which two keys are near-duplicates (strictly greater)
  RedundancyMode mode = RedundancyMode::sound;

  void validate() const {
    KVSIFT_CHECK(std::isfinite(threshold) && threshold >= -1.0f && threshold <= 1.0f,
                 "KeyRedundancyConfig: threshold must be in [-1, 1], got ", threshold);
  }
};

struct TopKSelection {
  int budget = 1024;  // tokens per (sequence, KV head) after compression
  int window = 8;     // most recent tokens, always kept
  int sink = 0;       // first (valid) tokens, always kept; counted in the budget

  void validate() const {
    KVSIFT_CHECK(window >= 0 && sink >= 0, "TopKSelection: window (", window, ") and sink (", sink,
                 ") must be >= 0");
    // StreamingLLM's plan is all sinks and window (budget == window + sink); policies that choose
    // by score require budget > window + sink in their own configs.
    KVSIFT_CHECK(budget >= window + sink && budget > 0, "TopKSelection: budget (", budget,
                 ") must be positive and at least window + sink (", window, " + ", sink, ")");
  }
};

}  // namespace kvsift
