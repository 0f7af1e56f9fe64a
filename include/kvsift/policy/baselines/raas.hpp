// RaaS, reasoning-aware attention sparsity (docs/algorithms.md §5.4): every decode unit (a token,
// or a page of `page_size` decode tokens) carries a timestamp, one per (layer, sequence, KV head,
// unit). Each decode step stamps the units the step's query uses most with the step t (the top
// half by score, or every unit whose weight reaches alpha); a compression evicts the units with
// the oldest timestamps until the sequence holds at most `budget` real tokens. The prompt is
// pinned: never evicted, counted in the budget, given no timestamp and not ranked. The newest
// `window` tokens and, in page mode, every page not yet complete are never evicted. Ties (equal
// scores, equal timestamps) go to the lower unit. The math is backend/cpu/raas_scores.hpp.
//
// needs() == kNeedsQueries. Per step and layer, after the step's key/value is appended:
//   raas.observe(obs);   // obs.layer, obs.kv, obs.queries [batch, q_heads, n, head_dim]
//   if (raas.should_compress(kv_of_layer_0)) for each layer: compact(kv, raas.select(in, ctx));
// Observations of n > 1 queries before the first decode step are the prompt (its slots pinned,
// left pads included until a compression drops them); afterwards one query per step (n == 1):
// the step counter t advances (the first decode step is t = 1), the new token joins a new unit
// (token mode, or page mode when the last page is complete) or the partial last page, and that
// unit's timestamp becomes t; then the units are scored with the step's queries (token mode: max
// over the KV head's GQA group of the softmax weight over every real cached token; page mode:
// max over the group of Quest's bound) and refreshed. Decode tokens must be real (a pad mask
// may mark only prompt slots).
// should_compress: a sequence holds budget + buffer slots (buffer 1: every step over budget, the
// paper's one eviction per step). select() drops the pads of every sequence over budget and
// evicts the oldest evictable units of each KV head (as many per head: token mode the excess,
// page mode ceil(excess / page_size) pages), and moves the timestamps along with the plan, so
// apply the plan (compact) before the layer's next observation; a cache whose lengths disagree
// with the timestamps raises kvsift::Error. A prompt that leaves no room (pinned prompt plus the
// protected newest tokens above the budget) is kept whole with the protected tokens and every
// other decode unit evicted: that sequence stays over budget.
//
// Device views: staged to the host in this version (policy/device_staging.hpp), as H2O and
// LazyEviction: observe() and select() copy what they read to host memory and run the CPU
// reference.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/backend/cpu/attention_mass.hpp"
#include "kvsift/backend/cpu/fp32_rows.hpp"
#include "kvsift/backend/cpu/raas_scores.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/config/raas_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/limits.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/device_staging.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

class RaaS final : public Policy {
 public:
  explicit RaaS(const RaasConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "raas"; }
  const RaasConfig& config() const { return cfg_; }
  unsigned needs() const override { return kNeedsQueries; }

  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.budget, cfg_.buffer);
  }

  void observe(const Observation& obs) override {
    if (obs.layer < 0) return;  // step-level: tokens and hidden states, nothing RaaS reads
    KVSIFT_CHECK(obs.queries.data != nullptr, "RaaS::observe: layer ", obs.layer,
                 " observation has no queries; RaaS needs the step's queries [batch, q_heads, n, "
                 "head_dim] of every layer");
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
    const std::int64_t n = obs.queries.shape[2];
    Layer& L = layer(obs.layer, kv);
    if (!L.observed) {
      // The first observation: everything cached before this step's tokens is the prompt (all of
      // it when the observation is a prompt chunk).
      for (std::int64_t b = 0; b < kv.batch(); ++b)
        L.prompt[std::size_t(b)] = kv.length(b) - (n == 1 ? 1 : 0);
      L.observed = true;
      if (n != 1) return;
    } else {
      for (std::int64_t b = 0; b < kv.batch(); ++b)
        KVSIFT_CHECK(kv.length(b) == L.prompt[std::size_t(b)] + L.decode[std::size_t(b)] + n,
                     "RaaS::observe: layer ", obs.layer, " sequence ", b, " holds ", kv.length(b),
                     " tokens but its timestamps expect ",
                     L.prompt[std::size_t(b)] + L.decode[std::size_t(b)], " + ", n,
                     " (a plan from select() not applied, or a step not observed)");
      if (n != 1) {
        KVSIFT_CHECK(L.step == 0, "RaaS::observe: layer ", obs.layer, " got ", n,
                     " queries after decode step ", L.step,
                     "; RaaS observes a prompt, then one query per decode step");
        for (std::int64_t b = 0; b < kv.batch(); ++b) L.prompt[std::size_t(b)] += n;
        return;
      }
    }
    for (std::int64_t b = 0; b < kv.batch(); ++b)  // checked before any state changes
      KVSIFT_CHECK(kv.is_valid(b, kv.length(b) - 1), "RaaS::observe: layer ", obs.layer,
                   " sequence ", b, " decode token at slot ", kv.length(b) - 1,
                   " is masked as a pad; RaaS allows pads only in the prompt");
    ++L.step;
    const auto t = static_cast<std::int32_t>(L.step);
    const int unit = cfg_.unit_tokens();
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      const bool new_unit = L.decode[std::size_t(b)] % unit == 0;
      ++L.decode[std::size_t(b)];
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
        std::vector<std::int32_t>& ts = L.ts[std::size_t(b * kv.kv_heads() + h)];
        if (new_unit)
          ts.push_back(t);
        else
          ts.back() = t;  // a token joining the partial page renews it
      }
    }
    score_and_refresh(L, kv, obs.queries);
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
    const std::vector<std::uint8_t> over = cpu::sequences_over_budget(kv, cfg_.budget);
    if (std::find(over.begin(), over.end(), 1) == over.end()) return KeepPlan::keep_all(kv);
    KVSIFT_CHECK(in.layer >= 0 && in.layer < static_cast<int>(layers_.size()) &&
                     layers_[std::size_t(in.layer)].observed,
                 "RaaS needs observe() with the step's queries every decode step (Observation "
                 "{layer, kv, queries [batch, q_heads, 1, head_dim]}); layer ",
                 in.layer, " is over budget but was never observed, so it has no timestamps");
    Layer& L = layers_[std::size_t(in.layer)];
    KVSIFT_CHECK(L.batch == kv.batch() && L.kv_heads == kv.kv_heads(), "RaaS::select: layer ",
                 in.layer, " timestamps are for batch ", L.batch, ", kv_heads ", L.kv_heads,
                 ", the cache is ", kv.keys.shape_string(), " (call reset() for a new cache)");
    const std::int64_t H = kv.kv_heads();
    const int unit = cfg_.unit_tokens();
    std::vector<std::int32_t> source(kv.lengths, kv.lengths + kv.batch()), kept(source);
    std::vector<std::vector<std::int32_t>> rows(std::size_t(kv.batch() * H));
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      const std::int32_t s = kv.length(b);
      const std::int64_t prompt = L.prompt[std::size_t(b)], decode = L.decode[std::size_t(b)];
      KVSIFT_CHECK(s == prompt + decode, "RaaS::select: layer ", in.layer, " sequence ", b,
                   " holds ", s, " tokens but its timestamps ", prompt + decode,
                   " (a plan from select() not applied, or a step not observed)");
      if (!over[std::size_t(b)]) {
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int32_t j = 0; j < s; ++j) rows[std::size_t(b * H + h)].push_back(j);
        continue;
      }
      std::vector<std::int32_t> prompt_slots;  // the pinned real prompt tokens; pads dropped
      for (std::int32_t j = 0; j < prompt; ++j)
        if (kv.is_valid(b, j)) prompt_slots.push_back(j);
      const std::int64_t excess =
          static_cast<std::int64_t>(prompt_slots.size()) + decode - cfg_.budget;
      const std::int64_t wanted = excess <= 0 ? 0 : (excess + unit - 1) / unit;
      const std::int64_t units = (decode + unit - 1) / unit;
      // Evictable: complete units none of whose tokens is among the newest `window`.
      std::vector<std::uint8_t> evictable(std::size_t(units), 0);
      std::int64_t n_evictable = 0;
      for (std::int64_t u = 0; u < units; ++u)
        n_evictable += evictable[std::size_t(u)] = (u + 1) * unit <= decode - cfg_.window;
      // A prompt too long for the budget stays whole, with the protected newest tokens: the
      // sequence then holds more than `budget` (our choice: the pinned prompt is never evicted
      // and an engine's decode must not fail on a long prompt).
      const std::int64_t evict = std::min(wanted, n_evictable);
      for (std::int64_t h = 0; h < H; ++h) {
        std::vector<std::int32_t>& ts = L.ts[std::size_t(b * H + h)];
        std::vector<std::uint8_t> may = evictable, gone(std::size_t(units), 0);
        for (std::int64_t e = 0; e < evict; ++e) {
          const std::int64_t u = cpu::raas::oldest_unit(ts.data(), may.data(), units);
          may[std::size_t(u)] = 0;
          gone[std::size_t(u)] = 1;
        }
        std::vector<std::int32_t>& out = rows[std::size_t(b * H + h)];
        out = prompt_slots;
        std::vector<std::int32_t> kept_ts;
        for (std::int64_t u = 0; u < units; ++u) {
          if (gone[std::size_t(u)]) continue;
          kept_ts.push_back(ts[std::size_t(u)]);
          for (std::int64_t j = u * unit; j < std::min(decode, (u + 1) * unit); ++j)
            out.push_back(static_cast<std::int32_t>(prompt + j));
        }
        ts = std::move(kept_ts);
      }
      kept[std::size_t(b)] = static_cast<std::int32_t>(rows[std::size_t(b * H)].size());
      L.prompt[std::size_t(b)] = static_cast<std::int64_t>(prompt_slots.size());
      L.decode[std::size_t(b)] = kept[std::size_t(b)] - L.prompt[std::size_t(b)];
    }
    KeepPlan plan(kv.batch(), H, kv.capacity(), source, kept, cfg_.window);
    for (const std::vector<std::int32_t>& r : rows) plan.append_row(r);
    return plan;
  }

  // The timestamps of (layer, b, h), one per decode unit in cache order; nullptr before the
  // layer's first observation.
  const std::vector<std::int32_t>* timestamps(int layer, std::int64_t b, std::int64_t h) const {
    if (layer < 0 || layer >= static_cast<int>(layers_.size()) ||
        !layers_[std::size_t(layer)].observed)
      return nullptr;
    const Layer& L = layers_[std::size_t(layer)];
    return &L.ts[std::size_t(b * L.kv_heads + h)];
  }
  // Pinned prompt slots of sequence b in `layer` (its pads included until a compression).
  std::int64_t prompt_slots(int layer, std::int64_t b) const {
    return layer >= 0 && layer < static_cast<int>(layers_.size()) &&
                   layers_[std::size_t(layer)].observed
               ? layers_[std::size_t(layer)].prompt[std::size_t(b)]
               : 0;
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
    std::vector<std::int64_t> prompt, decode;   // [batch] pinned prompt slots, decode tokens
    std::vector<std::vector<std::int32_t>> ts;  // [batch * kv_heads][unit]
  };

  Layer& layer(int l, const KVCacheView& kv) {
    KVSIFT_CHECK(l >= 0 && l < kMaxLayers, "RaaS: layer ", l,
                 " outside [0, kMaxLayers = ", kMaxLayers, ")");
    if (l >= static_cast<int>(layers_.size())) layers_.resize(std::size_t(l) + 1);
    Layer& L = layers_[std::size_t(l)];
    if (!L.observed) {
      L.batch = kv.batch(), L.kv_heads = kv.kv_heads();
      L.prompt.assign(std::size_t(kv.batch()), 0);
      L.decode.assign(std::size_t(kv.batch()), 0);
      L.ts.assign(std::size_t(kv.batch() * kv.kv_heads()), {});
    }
    KVSIFT_CHECK(L.batch == kv.batch() && L.kv_heads == kv.kv_heads(), "RaaS: layer ", l,
                 " timestamps are for batch ", L.batch, ", kv_heads ", L.kv_heads,
                 ", the cache is ", kv.keys.shape_string(), " (call reset() for a new cache)");
    return L;
  }

  // Scores every decode unit of every (sequence, KV head) with the step's query (n == 1) and
  // stamps the refreshed ones with the step.
  void score_and_refresh(Layer& L, const KVCacheView& kv, const TensorView& queries) {
    const cpu::RowMatrix q = cpu::load_queries(queries);  // [batch * q_heads, head_dim]
    const std::int64_t q_heads = queries.shape[1], group = q_heads / kv.kv_heads();
    const int dim = static_cast<int>(kv.head_dim());
    const auto t = static_cast<std::int32_t>(L.step);
    std::vector<float> scores, kmin, kmax;
    KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
      cpu::RowMatrix k;  // [S, head_dim]
      for (std::int64_t b = 0; b < kv.batch(); ++b) {
        const std::int64_t s = kv.length(b), prompt = L.prompt[std::size_t(b)];
        const std::int64_t decode = L.decode[std::size_t(b)];
        const std::uint8_t* valid = kv.valid_mask ? kv.valid_mask + b * kv.capacity() : nullptr;
        for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
          cpu::load_rows<T>(kv.keys, b, h, s, "keys", k);
          const float* qg = q.data() + (b * q_heads + h * group) * dim;  // [group, head_dim]
          std::vector<std::int32_t>& ts = L.ts[std::size_t(b * kv.kv_heads() + h)];
          const std::int64_t units = static_cast<std::int64_t>(ts.size());
          const float* unit_scores = nullptr;  // [units]
          if (cfg_.unit == RaasUnit::token) {
            scores.resize(std::size_t(s));
            cpu::raas::token_scores(qg, int(group), k.data(), valid, s, dim, scores.data());
            unit_scores = scores.data() + prompt;
          } else {
            kmin.resize(std::size_t(units * dim));
            kmax.resize(std::size_t(units * dim));
            scores.resize(std::size_t(units));
            cpu::raas::page_key_bounds(k.data() + prompt * dim, decode, dim, cfg_.page_size,
                                       kmin.data(), kmax.data());
            cpu::raas::page_bounds(qg, int(group), kmin.data(), kmax.data(), units, dim,
                                   scores.data());
            unit_scores = scores.data();
          }
          if (cfg_.refresh == RaasRefresh::top_half)
            cpu::raas::refresh_top_half(unit_scores, units, t, ts.data());
          else
            cpu::raas::refresh_above(unit_scores, units, cfg_.alpha, t, ts.data());
        }
      }
    });
  }

  RaasConfig cfg_;
  std::vector<Layer> layers_;
};

}  // namespace kvsift
