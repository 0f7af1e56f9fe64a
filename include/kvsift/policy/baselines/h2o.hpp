// H2O, heavy-hitter oracle (docs/algorithms.md §1.4): every KV head accumulates the softmax
// attention its group's query heads give each token over the decode steps; a compression keeps the
// top budget − recent tokens by that sum plus the `recent` most recent tokens.
//
// H2O is stateful (needs() == kNeedsQueries in accumulated mode). Per decode step and layer, after
// the step's key/value is appended:
//   h2o.observe(obs);          // obs.layer, obs.kv, obs.queries [batch, q_heads, n, head_dim]
//   if (h2o.should_compress(kv)) { auto plan = h2o.select({layer, kv, q}, ctx); compact(kv, plan,
//   ctx); }
// (observe_step(StepInputs) is the same with in.window_queries as the step's queries.)
// select() moves each layer's accumulator along with the plan, so the plan must be applied
// (compact, or the engine's own remapping) before the next observation of that layer; a cache
// whose lengths disagree with what the accumulator observed raises kvsift::Error, and so does a
// select() over budget for a layer that was never observed (it would silently keep only the
// most recent tokens, i.e. behave like StreamingLLM).
// SkipKV's variant (mode last_query_shared) keeps no state: at select() it scores with the last
// row of in.window_queries, heads averaged, one kept set for all heads.
//
// Device views: staged to the host in this version (policy/device_staging.hpp): observe() and
// select() copy the cache and queries they read to host memory and run the CPU reference, so the
// plans are those of the same cache in host memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvsift/backend/cpu/attention_mass.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/config/h2o_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/limits.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/device_staging.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

class H2O final : public Policy {
 public:
  explicit H2O(const H2OConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "h2o"; }
  const H2OConfig& config() const { return cfg_; }

  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.budget, cfg_.buffer);
  }

  unsigned needs() const override {
    return cfg_.mode == H2OMode::accumulated ? kNeedsQueries : kNeedsNothing;
  }

  // Per-layer observations (obs.layer >= 0 with obs.queries) feed that layer's accumulator;
  // step-level ones (layer -1) carry nothing H2O reads.
  void observe(const Observation& obs) override {
    if (obs.layer < 0 || cfg_.mode != H2OMode::accumulated) return;
    KVSIFT_CHECK(obs.queries.data != nullptr, "H2O::observe: layer ", obs.layer,
                 " observation has no queries; H2O needs the step's queries [batch, q_heads, n, "
                 "head_dim] of every layer");
    observe_step({obs.layer, obs.kv, obs.queries});
  }

  // Adds the attention of in.window_queries ([batch, q_heads, steps, head_dim], the last `steps`
  // queries, their keys already cached) to the accumulator of in.layer. No-op in
  // last_query_shared mode. Since the layer's last observation the cache may have grown by at
  // most `steps` tokens (observe every step) and never shrunk except by a plan from select().
  void observe_step(const StepInputs& in) {
    if (cfg_.mode != H2OMode::accumulated) return;
    in.kv.validate();
    if (in.kv.device() != Device::cpu) {
      HostStaging staging(ExecContext{});
      observe_step({in.layer, staging.cache(in.kv), staging.tensor(in.window_queries)});
      return;
    }
    const bool fresh = accumulator(in.layer) == nullptr;
    cpu::ScoreTensor& acc = accumulator_for(in.layer, in.kv);
    const std::int64_t steps = in.window_queries.rank == 4 ? in.window_queries.shape[2] : 0;
    for (std::int64_t b = 0; b < in.kv.batch(); ++b) {
      KVSIFT_CHECK(in.kv.length(b) >= acc.count(b), "H2O::observe: layer ", in.layer, " sequence ",
                   b, " holds ", in.kv.length(b), " tokens but its accumulator ", acc.count(b),
                   " (was the cache changed without a plan from select?)");
      KVSIFT_CHECK(fresh || in.kv.length(b) <= acc.count(b) + steps, "H2O::observe: layer ",
                   in.layer, " sequence ", b, " holds ", in.kv.length(b),
                   " tokens but its accumulator expects at most ", acc.count(b), " + ", steps,
                   " (a plan from select() not applied, or a decode step not observed)");
    }
    cpu::accumulate_attention(in.kv, in.window_queries, acc);
  }

  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    in.kv.validate();
    if (in.kv.device() != Device::cpu) {
      HostStaging staging(ctx);
      StepInputs host{in.layer, staging.cache(in.kv), staging.tensor(in.window_queries)};
      return select(host, ExecContext{});
    }
    const std::vector<std::uint8_t> over = cpu::sequences_over_budget(in.kv, cfg_.budget);
    if (std::find(over.begin(), over.end(), 1) == over.end()) return KeepPlan::keep_all(in.kv);
    if (cfg_.mode == H2OMode::last_query_shared) {
      const cpu::ScoreTensor s = cpu::last_query_attention(in.kv, in.window_queries, over.data());
      return cpu::plan_from_scores(in.kv, &s, cfg_.selection());
    }
    KVSIFT_CHECK(accumulator(in.layer) != nullptr,
                 "H2O needs observe() with the step's queries every decode step (Observation "
                 "{layer, kv, queries [batch, q_heads, n, head_dim]}); layer ",
                 in.layer,
                 " is over budget but was never observed, so its plan would keep only "
                 "the most recent tokens");
    cpu::ScoreTensor& acc = accumulator_for(in.layer, in.kv);
    for (std::int64_t b = 0; b < in.kv.batch(); ++b)
      KVSIFT_CHECK(acc.count(b) == in.kv.length(b), "H2O::select: layer ", in.layer, " sequence ",
                   b, " holds ", in.kv.length(b), " tokens but its accumulator observed ",
                   acc.count(b), " (a plan from select() not applied, or a step not observed)");
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
