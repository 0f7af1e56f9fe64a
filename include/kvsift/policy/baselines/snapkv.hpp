// SnapKV (docs/algorithms.md §1.4): the window importance a of §1.1 alone, with SnapKV's own defaults
// (window 32, kernel 5, average pooling, attention summed over the window). For grouped-query
// attention the group's logits are averaged (our choice: SnapKV itself is multi-head only).
// Same trigger and prefill use as R-KV (see rkv.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/backend/cpu/window_importance.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/policy.hpp"

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

class SnapKV final : public Policy {
 public:
  explicit SnapKV(const SnapKVConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "snapkv"; }
  const SnapKVConfig& config() const { return cfg_; }

  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.budget, cfg_.buffer);
  }

  // Scores and plans the sequences over budget; the others keep everything.
  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    (void)ctx;
    return cpu::select_scored_over_budget(in.kv, cfg_.selection(), [&](const std::uint8_t* over) {
      return cpu::window_importance(in.kv, in.window_queries, cfg_.importance_config(), over);
    });
  }

 private:
  SnapKVConfig cfg_;
};

}  // namespace kvsift
