// H2O, heavy-hitter oracle (docs/algorithms.md §1.4): every KV head accumulates the softmax
// attention its group's query heads give each token over the decode steps; a compression keeps the
// top budget − recent tokens by that sum plus the `recent` most recent tokens.
//
// H2O is stateful. Per decode step and layer, after the step's key/value is appended:
//   h2o.observe_step({layer, kv, step_queries});   // step_queries [batch, q_heads, 1, head_dim]
//   if (h2o.should_compress(kv)) { auto plan = h2o.select({layer, kv, q}); compact(kv, plan); }
// select() moves each layer's accumulator along with the plan, so the plan must be applied
// (compact, or the engine's own remapping) before the next observe_step of that layer.
// SkipKV's variant (mode last_query_shared) keeps no state: at select() it scores with the last
// row of in.window_queries, heads averaged, one kept set for all heads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvsift/backend/cpu/attention_mass.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/config/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/limits.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

struct H2OConfig {
  int budget = 1024;
  int recent = -1;  // most recent tokens always kept; -1: budget / 2 (H2O's default)
  int buffer = 128;
  H2OMode mode = H2OMode::accumulated;

  int recent_tokens() const { return recent < 0 ? budget / 2 : recent; }
  void validate() const {
    KVSIFT_CHECK(budget >= 2, "H2OConfig: budget must be >= 2, got ", budget);
    KVSIFT_CHECK(recent >= -1, "H2OConfig: recent must be >= 0 (or -1 for budget / 2), got ",
                 recent);
    KVSIFT_CHECK(recent_tokens() >= 1 && recent_tokens() < budget, "H2OConfig: recent (",
                 recent_tokens(), ") must be in [1, budget = ", budget, ")");
    KVSIFT_CHECK(buffer >= 1, "H2OConfig: buffer must be >= 1, got ", buffer);
  }
  TopKSelection selection() const { return {budget, recent_tokens(), 0}; }
};

class H2O final : public Policy {
 public:
  explicit H2O(const H2OConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "h2o"; }
  const H2OConfig& config() const { return cfg_; }

  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.budget, cfg_.buffer);
  }

  // Adds the attention of in.window_queries ([batch, q_heads, steps, head_dim], the last `steps`
  // queries, their keys already cached) to the accumulator of in.layer. No-op in
  // last_query_shared mode.
  void observe_step(const StepInputs& in) {
    if (cfg_.mode != H2OMode::accumulated) return;
    in.kv.validate();
    cpu::ScoreTensor& acc = accumulator_for(in.layer, in.kv);
    for (std::int64_t b = 0; b < in.kv.batch(); ++b)
      KVSIFT_CHECK(in.kv.length(b) >= acc.count(b), "H2O::observe_step: layer ", in.layer,
                   " sequence ", b, " holds ", in.kv.length(b), " tokens but its accumulator ",
                   acc.count(b), " (was the cache changed without a plan from select?)");
    cpu::accumulate_attention(in.kv, in.window_queries, acc);
  }

  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    (void)ctx;
    in.kv.validate();
    const std::vector<std::uint8_t> over = cpu::sequences_over_budget(in.kv, cfg_.budget);
    if (std::find(over.begin(), over.end(), 1) == over.end()) return KeepPlan::keep_all(in.kv);
    if (cfg_.mode == H2OMode::last_query_shared) {
      const cpu::ScoreTensor s = cpu::last_query_attention(in.kv, in.window_queries, over.data());
      return cpu::plan_from_scores(in.kv, &s, cfg_.selection());
    }
    cpu::ScoreTensor& acc = accumulator_for(in.layer, in.kv);
    // Tokens never observed (e.g. the prompt) have accumulated nothing.
    for (std::int64_t b = 0; b < in.kv.batch(); ++b)
      if (acc.count(b) < in.kv.length(b)) acc.set_count(b, in.kv.length(b));
    KeepPlan plan = cpu::plan_from_scores(in.kv, &acc, cfg_.selection());
    follow_plan(plan, acc);
    return plan;
  }

  // The accumulator of `layer` ([batch, kv_heads, capacity]), nullptr before its first use.
  const cpu::ScoreTensor* accumulator(int layer) const {
    return layer >= 0 && layer < static_cast<int>(acc_.size()) && acc_[layer].batch() > 0
               ? &acc_[layer]
               : nullptr;
  }
  void reset() { acc_.clear(); }

 private:
  cpu::ScoreTensor& accumulator_for(int layer, const KVCacheView& kv) {
    KVSIFT_CHECK(layer >= 0 && layer < kMaxLayers, "H2O: layer ", layer,
                 " outside [0, kMaxLayers = ", kMaxLayers, ")");
    if (layer >= static_cast<int>(acc_.size())) acc_.resize(layer + 1);
    cpu::ScoreTensor& acc = acc_[layer];
    if (acc.batch() == 0) acc = cpu::ScoreTensor(kv.batch(), kv.kv_heads(), kv.capacity());
    KVSIFT_CHECK(acc.batch() == kv.batch() && acc.kv_heads() == kv.kv_heads() &&
                     acc.capacity() == kv.capacity(),
                 "H2O: layer ", layer, " accumulator is [", acc.batch(), ", ", acc.kv_heads(), ", ",
                 acc.capacity(), "], the cache is ", kv.keys.shape_string(),
                 " (call reset() for a new cache)");
    return acc;
  }

  // Moves the accumulator the way compact() moves the rows: kept slot i takes slot plan[i]'s sum.
  static void follow_plan(const KeepPlan& plan, cpu::ScoreTensor& acc) {
    for (std::int64_t b = 0; b < plan.batch(); ++b) {
      const std::int32_t kept = plan.kept_length(b);
      for (std::int64_t h = 0; h < plan.kv_heads(); ++h) {
        float* row = acc.row(b, h);
        const std::int32_t* slots = plan.row(b, h);
        for (std::int32_t i = 0; i < kept; ++i) row[i] = row[slots[i]];  // slots[i] >= i
        std::fill(row + kept, row + acc.capacity(), 0.0f);
      }
      acc.set_count(b, kept);
    }
  }

  H2OConfig cfg_;
  std::vector<cpu::ScoreTensor> acc_;  // [layer]
};

}  // namespace kvsift
