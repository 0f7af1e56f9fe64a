// LazyEviction, lagged recurrence-aware eviction (docs/algorithms.md §5.3). Every cached token
// carries TS, the last decode step that hit it (softmax weight >= alpha), and MRI, its maximum
// recurrence interval (the longest gap between consecutive hits). Every `window` decode steps,
// when a sequence holds more than `budget` tokens, the cache keeps the budget − window tokens
// most likely to recur by the released code's score (lazy_counters.hpp) plus the `window` most
// recent; ties go to the lower position. Pads are never kept by a compression (the budget counts
// real tokens; a sequence over budget only by its pads keeps its real tokens), as in the other
// baselines (docs/algorithms.md §2.4).
//
// needs() == kNeedsQueries. Per decode step and layer, after the step's key/value is appended:
//   lazy.observe(obs);   // obs.layer, obs.kv, obs.queries [batch, q_heads, 1, head_dim]
//   if (lazy.should_compress(kv_of_layer_0)) for each layer: compact(kv, lazy.select(in, ctx));
// An observation of n > 1 queries is a prompt chunk: its tokens join with the current TS (0
// before the first decode step) and no hits are recorded, as the reference never observes the
// prefill. A decode observation (n == 1) advances the layer's step counter t and records hits:
// per KV head the weight is the max over its GQA group (scope kv_head), or the head's own with
// keys cached per query head (scope query_head, the reference's layout: kv_heads == q_heads).
// should_compress: t > 0, t % window == 0 and some sequence over budget; on a layer 0 that was
// never observed it reports over-budget alone so that select() refuses (it needs the counters).
// select() moves the counters along with the plan, so apply the plan (compact) before the
// layer's next observation; a cache whose lengths disagree with the counters raises
// kvsift::Error.
//
// Device views: staged to the host in this version (policy/device_staging.hpp), as H2O: observe()
// and select() copy the cache and queries they read to host memory and run the CPU reference.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/backend/cpu/attention_mass.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/config/lazy_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/limits.hpp"
#include "kvsift/policy/baselines/lazy_counters.hpp"
#include "kvsift/policy/device_staging.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

class LazyEviction final : public Policy {
 public:
  explicit LazyEviction(const LazyConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "lazy"; }
  const LazyConfig& config() const { return cfg_; }
  unsigned needs() const override { return kNeedsQueries; }

  bool should_compress(const KVCacheView& kv) const override {
    const std::vector<std::uint8_t> over = over_budget(kv);
    if (std::find(over.begin(), over.end(), 1) == over.end()) return false;
    if (layers_.empty() || !layers_[0].observed) return true;  // select() will say why not
    const std::int64_t t = layers_[0].step;
    return t > 0 && t % cfg_.window == 0;
  }

  // [batch] 1 where the sequence holds more than `budget` slots, as every score-based baseline
  // (cpu::sequences_over_budget); a compression then drops its pads (docs/algorithms.md §2.4).
  std::vector<std::uint8_t> over_budget(const KVCacheView& kv) const {
    return cpu::sequences_over_budget(kv, cfg_.budget);
  }

  void observe(const Observation& obs) override {
    if (obs.layer < 0) return;  // step-level: tokens and hidden states, nothing LazyEviction reads
    KVSIFT_CHECK(obs.queries.data != nullptr, "LazyEviction::observe: layer ", obs.layer,
                 " observation has no queries; LazyEviction needs the step's queries [batch, "
                 "q_heads, n, head_dim] of every layer");
    obs.kv.validate();
    if (obs.kv.device() != Device::cpu) {
      HostStaging staging(ExecContext{});
      Observation host = obs;
      host.kv = staging.cache(obs.kv);
      host.queries = staging.tensor(obs.queries);
      observe(host);
      return;
    }
    const KVCacheView& kv = obs.kv;
    cpu::detail::check_step_queries(kv, obs.queries);
    const std::int64_t q_heads = obs.queries.shape[1], n = obs.queries.shape[2];
    KVSIFT_CHECK(cfg_.scope != LazyScope::query_head || q_heads == kv.kv_heads(),
                 "LazyEviction (scope query_head): the cache must hold one head per query head, "
                 "got kv_heads ",
                 kv.kv_heads(), " and q_heads ", q_heads);
    Layer& L = layer(obs.layer, kv);
    const bool fresh = !L.observed;
    for (std::int64_t b = 0; b < kv.batch(); ++b)
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
        const lazy::Row& row = L.rows[std::size_t(b * kv.kv_heads() + h)];
        KVSIFT_CHECK(fresh || (kv.length(b) >= row.size() && kv.length(b) <= row.size() + n),
                     "LazyEviction::observe: layer ", obs.layer, " sequence ", b, " holds ",
                     kv.length(b), " tokens but its counters expect ", row.size(), " + at most ", n,
                     " (a plan from select() not applied, or a decode step not observed)");
      }
    L.observed = true;
    // New tokens start at the current step: 0 before decoding, t − 1 for the token of step t.
    const std::int32_t start = lazy::counter_of_step(cfg_.counters, L.step);
    for (std::int64_t b = 0; b < kv.batch(); ++b)
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h)
        lazy::append_tokens(L.rows[std::size_t(b * kv.kv_heads() + h)], kv.length(b), start);
    if (n != 1) return;  // a prompt chunk: the reference records no hits for the prefill
    ++L.step;
    const cpu::RowMatrix q = cpu::load_queries(obs.queries);
    std::vector<std::uint8_t> hit;
    KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
      cpu::RowMatrix k;
      for (std::int64_t b = 0; b < kv.batch(); ++b)
        for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
          // [group, S] this step's softmax rows of the group's query heads; pads get weight 0.
          const cpu::RowMatrix p = cpu::detail::step_attention<T>(kv, q, q_heads, 1, b, h, k);
          const std::int64_t s = kv.length(b);
          hit.assign(std::size_t(s), 0);
          for (std::int64_t j = 0; j < s; ++j)
            hit[std::size_t(j)] = kv.is_valid(b, j) && p.col(j).maxCoeff() >= cfg_.alpha;
          lazy::record_hits(L.rows[std::size_t(b * kv.kv_heads() + h)], hit.data(), L.step,
                            cfg_.counters);
        }
    });
  }

  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    in.kv.validate();
    if (in.kv.device() != Device::cpu) {
      HostStaging staging(ctx);
      return select(StepInputs{in.layer, staging.cache(in.kv), staging.tensor(in.window_queries)},
                    ExecContext{});
    }
    const KVCacheView& kv = in.kv;
    const std::vector<std::uint8_t> over = over_budget(kv);
    if (std::find(over.begin(), over.end(), 1) == over.end()) return KeepPlan::keep_all(kv);
    KVSIFT_CHECK(in.layer >= 0 && in.layer < static_cast<int>(layers_.size()) &&
                     layers_[std::size_t(in.layer)].observed,
                 "LazyEviction needs observe() with the step's queries every decode step "
                 "(Observation {layer, kv, queries [batch, q_heads, 1, head_dim]}); layer ",
                 in.layer, " is over budget but was never observed, so it has no TS/MRI counters");
    Layer& L = layers_[std::size_t(in.layer)];
    KVSIFT_CHECK(L.batch == kv.batch() && L.kv_heads == kv.kv_heads(),
                 "LazyEviction::select: layer ", in.layer, " counters are for batch ", L.batch,
                 ", kv_heads ", L.kv_heads, ", the cache is ", kv.keys.shape_string(),
                 " (call reset() for a new cache)");
    // Per row: the budget − window highest-scoring real candidates (all but the `window` most
    // recent slots; ties: the lower slot) plus the window; rows of sequences within budget keep
    // everything.
    std::vector<std::int32_t> source(kv.lengths, kv.lengths + kv.batch()), kept(source);
    std::vector<std::vector<std::int32_t>> rows(std::size_t(kv.batch() * kv.kv_heads()));
    std::vector<float> sc;
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      const std::int32_t s = kv.length(b);
      const std::uint8_t* valid = kv.valid_mask ? kv.valid_mask + b * kv.capacity() : nullptr;
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
        const lazy::Row& row = L.rows[std::size_t(b * kv.kv_heads() + h)];
        KVSIFT_CHECK(row.size() == s, "LazyEviction::select: layer ", in.layer, " sequence ", b,
                     " holds ", s, " tokens but its counters ", row.size(),
                     " (a plan from select() not applied, or a step not observed)");
        std::vector<std::int32_t>& out = rows[std::size_t(b * kv.kv_heads() + h)];
        if (!over[std::size_t(b)]) {
          for (std::int32_t j = 0; j < s; ++j) out.push_back(j);
          continue;
        }
        if (valid != nullptr && std::count(valid, valid + s, std::uint8_t{0}) >= s - cfg_.budget) {
          // Without its pads the sequence fits the budget: keep every real token.
          for (std::int32_t j = 0; j < s; ++j)
            if (valid[j]) out.push_back(j);
          continue;
        }
        const std::int32_t n = s - cfg_.window;
        sc.resize(std::size_t(n));
        for (std::int32_t j = 0; j < n; ++j)
          sc[std::size_t(j)] =
              lazy::score(row.ts[std::size_t(j)], row.mri[std::size_t(j)], L.step, cfg_.counters);
        cpu::top_k_slots(sc.data(), n, valid, 0, cfg_.budget - cfg_.window, out);
        for (std::int32_t j = n; j < s; ++j) out.push_back(j);
      }
      kept[std::size_t(b)] = std::int32_t(rows[std::size_t(b * kv.kv_heads())].size());
    }
    KeepPlan plan(kv.batch(), kv.kv_heads(), kv.capacity(), source, kept, cfg_.window);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      plan.append_row(rows[r]);
      lazy::follow(L.rows[r], rows[r]);
    }
    return plan;
  }

  // The counters of (layer, b, h): TS and MRI per cached slot; nullptr before the layer's first
  // observation.
  const lazy::Row* counters(int layer, std::int64_t b, std::int64_t h) const {
    if (layer < 0 || layer >= static_cast<int>(layers_.size()) ||
        !layers_[std::size_t(layer)].observed)
      return nullptr;
    const Layer& L = layers_[std::size_t(layer)];
    return &L.rows[std::size_t(b * L.kv_heads + h)];
  }
  // Decode steps observed by `layer` (its step counter t).
  std::int64_t step(int layer) const {
    return layer >= 0 && layer < static_cast<int>(layers_.size()) ? layers_[std::size_t(layer)].step
                                                                  : 0;
  }
  void reset() { layers_.clear(); }

  std::vector<std::pair<std::string, std::string>> summary() const override {
    return {{"decode_steps", std::to_string(step(0))}};
  }

 private:
  struct Layer {
    bool observed = false;
    std::int64_t step = 0, batch = 0, kv_heads = 0;
    std::vector<lazy::Row> rows;  // [batch * kv_heads]
  };

  Layer& layer(int l, const KVCacheView& kv) {
    KVSIFT_CHECK(l >= 0 && l < kMaxLayers, "LazyEviction: layer ", l,
                 " outside [0, kMaxLayers = ", kMaxLayers, ")");
    if (l >= static_cast<int>(layers_.size())) layers_.resize(std::size_t(l) + 1);
    Layer& L = layers_[std::size_t(l)];
    if (!L.observed) {
      L.batch = kv.batch(), L.kv_heads = kv.kv_heads();
      L.rows.assign(std::size_t(kv.batch() * kv.kv_heads()), lazy::Row{});
    }
    KVSIFT_CHECK(L.batch == kv.batch() && L.kv_heads == kv.kv_heads(), "LazyEviction: layer ", l,
                 " counters are for batch ", L.batch, ", kv_heads ", L.kv_heads, ", the cache is ",
                 kv.keys.shape_string(), " (call reset() for a new cache)");
    return L;
  }

  LazyConfig cfg_;
  std::vector<Layer> layers_;
};

}  // namespace kvsift
