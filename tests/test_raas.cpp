// The RaaS policy (docs/algorithms.md §5.4): hand-worked streams in token and page mode whose
// timestamps and eviction order are worked out in the comments; properties over random ragged,
// left-padded GQA streams in both modes (the prompt is never evicted, a sequence holds at most
// `budget` tokens after each step, every evicted unit has the minimum timestamp among the
// evictable ones); a prompt longer than the budget; the error paths.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/baselines/raas.hpp"
#include "kvsift/policy/registry.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// One layer: cache [batch, kv_heads, cap, dim] fp32 with a pad mask, the generation position of
// every slot tracked per (sequence, head).
struct Stream {
  std::int64_t batch, heads, group, cap, dim;
  std::vector<float> keys, values;
  std::vector<std::int32_t> len;
  std::vector<std::uint8_t> mask;
  std::vector<std::vector<std::int32_t>> pos;  // [b * heads + h][slot]
  std::vector<std::int32_t> generated;         // [b] positions handed out

  Stream(std::int64_t b, std::int64_t h, std::int64_t g, std::int64_t c, std::int64_t d)
      : batch(b),
        heads(h),
        group(g),
        cap(c),
        dim(d),
        keys(std::size_t(b * h * c * d)),
        values(keys.size()),
        len(std::size_t(b), 0),
        mask(std::size_t(b * c), 1),
        pos(std::size_t(b * h)),
        generated(std::size_t(b), 0) {}
  KVCacheView view() {
    return make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, batch, heads,
                              cap, dim, len.data(), mask.data());
  }
  float* key(std::int64_t b, std::int64_t h, std::int64_t slot) {
    return &keys[std::size_t(((b * heads + h) * cap + slot) * dim)];
  }
  // Appends one token to sequence b (a pad when `pad`), key(h) giving head h's key.
  template <class F>
  void append(std::int64_t b, bool pad, F key_of_head) {
    const std::int32_t slot = len[std::size_t(b)];
    for (std::int64_t h = 0; h < heads; ++h) {
      std::memcpy(key(b, h, slot), key_of_head(h), std::size_t(dim) * sizeof(float));
      pos[std::size_t(b * heads + h)].push_back(generated[std::size_t(b)]);
    }
    mask[std::size_t(b * cap + slot)] = pad ? 0 : 1;
    ++len[std::size_t(b)], ++generated[std::size_t(b)];
  }
  void apply(const KeepPlan& plan) {
    compact(view(), plan);
    for (std::int64_t r = 0; r < batch * heads; ++r) {
      std::vector<std::int32_t> kept;
      for (std::int64_t i = 0; i < plan.row_size(r / heads, r % heads); ++i)
        kept.push_back(pos[std::size_t(r)][std::size_t(plan.row(r / heads, r % heads)[i])]);
      pos[std::size_t(r)] = kept;
    }
  }
  // Observes `n` queries [batch, heads * group, n, dim] of layer 0.
  void observe(Policy& p, std::vector<float>& q, std::int64_t n) {
    Observation obs;
    obs.layer = 0;
    obs.kv = view();
    obs.queries =
        TensorView::contiguous(q.data(), DType::f32, Device::cpu, {batch, heads * group, n, dim});
    p.observe(obs);
  }
};

// The hand-worked streams: batch 1, one head, dim 2, a two-token prompt p0 = p1 = [0, 0] at
// positions 0 and 1 observed as one prompt chunk, decode token d_t at position t + 1. A step
// appends d_t (key k[t - 1]), observes q_t (q[t - 1]) and compresses when the trigger says so.
// Returns the kept positions after every step; `ts` gets the timestamps after every step.
std::vector<std::vector<std::int32_t>> run_hand_stream(RaaS& raas,
                                                       const std::vector<std::vector<float>>& k,
                                                       const std::vector<std::vector<float>>& q,
                                                       std::vector<std::vector<std::int32_t>>& ts) {
  Stream s(1, 1, 1, 16, 2);
  const float zero[2] = {0, 0};
  s.append(0, false, [&](std::int64_t) { return zero; });
  s.append(0, false, [&](std::int64_t) { return zero; });
  std::vector<float> q_prompt = {0, 0, 0, 0};  // [1, 1, 2, 2]
  s.observe(raas, q_prompt, 2);
  std::vector<std::vector<std::int32_t>> kept;
  for (std::size_t t = 0; t < k.size(); ++t) {
    s.append(0, false, [&](std::int64_t) { return k[t].data(); });
    std::vector<float> qt = q[t];
    s.observe(raas, qt, 1);
    if (raas.should_compress(s.view())) s.apply(raas.select({0, s.view(), TensorView{}}));
    kept.push_back(s.pos[0]);
    ts.push_back(*raas.timestamps(0, 0, 0));
  }
  return kept;
}

using Positions = std::vector<std::int32_t>;
using Stamps = std::vector<std::int32_t>;

}  // namespace

TEST_CASE("RaaS token mode: a hand-worked stream", "[raas]") {
  // Budget 5 (the 2 pinned prompt tokens + 3 decode tokens), window 1, buffer 1: a step that
  // brings the cache to 6 evicts one decode token. The softmax over a step's cache is monotone in
  // q . k, so the top-half ranking of the decode tokens is that of their dot products (the prompt
  // keys only change the normalisation). Top half of m units = ceil(m / 2), ties to the lower.
  RaasConfig cfg;
  cfg.budget = 5, cfg.window = 1, cfg.buffer = 1;
  RaaS raas(cfg);
  const std::vector<std::vector<float>> k = {{1, 0}, {0, 1},   {-1, 0}, {0, -1},
                                             {1, 1}, {-1, -1}, {0, 1}};  // d1 .. d7
  const std::vector<std::vector<float>> q = {{1, 0},  {1, 0}, {-1, 0}, {1, 0},
                                             {0, -1}, {1, 0}, {0, 1}};  // q1 .. q7
  std::vector<Stamps> ts;
  const std::vector<Positions> kept = run_hand_stream(raas, k, q, ts);
  // t1: d1 joins with ts 1; one unit, top 1 = d1 -> [d1 1].
  CHECK(ts[0] == Stamps{1});
  // t2: d2 joins with 2. q2 . (d1, d2) = (1, 0): top 1 = d1 -> [d1 2, d2 2].
  CHECK(ts[1] == Stamps{2, 2});
  // t3: d3 joins with 3. q3 . (d1, d2, d3) = (-1, 0, 1): top 2 = d3, d2 -> [2, 3, 3].
  CHECK(ts[2] == Stamps{2, 3, 3});
  CHECK(kept[2] == Positions{0, 1, 2, 3, 4});
  // t4: d4 joins with 4. q4 . (d1..d4) = (1, 0, -1, 0): top 2 = d1, then d2 (ties d4, lower) ->
  // [4, 4, 3, 4]. Cache 6 > 5: the evictable units are d1..d3 (d4 is the window); the oldest is
  // d3 (ts 3): evicted. -> decode d1 d2 d4 [4, 4, 4].
  CHECK(kept[3] == Positions{0, 1, 2, 3, 5});
  CHECK(ts[3] == Stamps{4, 4, 4});
  // t5: d5 joins with 5. q5 . (d1, d2, d4, d5) = (0, -1, 1, -1): top 2 = d4, d1 ->
  // [5, 4, 5, 5]. Evictable d1 d2 d4; oldest d2 (4): evicted. -> d1 d4 d5 [5, 5, 5].
  CHECK(kept[4] == Positions{0, 1, 2, 5, 6});
  CHECK(ts[4] == Stamps{5, 5, 5});
  // t6: d6 joins with 6. q6 . (d1, d4, d5, d6) = (1, 0, 1, -1): top 2 = d1, d5 (tie, both) ->
  // [6, 5, 6, 6]. Evictable d1 d4 d5; oldest d4 (5): evicted. -> d1 d5 d6 [6, 6, 6].
  CHECK(kept[5] == Positions{0, 1, 2, 6, 7});
  CHECK(ts[5] == Stamps{6, 6, 6});
  // t7: d7 joins with 7. q7 . (d1, d5, d6, d7) = (0, 1, -1, 1): top 2 = d5, d7 -> [6, 7, 6, 7].
  // Evictable d1 d5 d6; d1 and d6 tie at 6, the lower goes: d1. -> d5 d6 d7 [7, 6, 7].
  CHECK(kept[6] == Positions{0, 1, 6, 7, 8});
  CHECK(ts[6] == Stamps{7, 6, 7});
  // Eviction order d3, d2, d4, d1; the prompt (positions 0, 1) stayed.
}

TEST_CASE("RaaS page mode: a hand-worked stream with Quest's bound", "[raas]") {
  // Pages of 2 decode tokens, budget 6 (2 pinned prompt tokens + 4 decode tokens), window 0,
  // buffer 1: a step that brings the cache to 7 evicts ceil(1 / 2) = 1 complete page. A page's
  // score is max over the group (one head here) of sum_c max(q_c Kmax_c, q_c Kmin_c).
  RaasConfig cfg;
  cfg.budget = 6, cfg.window = 0, cfg.buffer = 1, cfg.unit = RaasUnit::page, cfg.page_size = 2;
  RaaS raas(cfg);
  const std::vector<std::vector<float>> k = {{1, 0}, {0, 1},  {-1, 0}, {0, -1},
                                             {2, 2}, {-2, 0}, {0, 3}};  // d1 .. d7
  const std::vector<std::vector<float>> q = {{1, 0}, {1, 0},  {-1, 0}, {1, 1},
                                             {1, 1}, {0, -1}, {0, 1}};  // q1 .. q7
  std::vector<Stamps> ts;
  const std::vector<Positions> kept = run_hand_stream(raas, k, q, ts);
  // t1: d1 opens P0 = {d1} with ts 1; one unit, stamped 1.
  CHECK(ts[0] == Stamps{1});
  // t2: d2 joins P0, which takes ts 2; one unit, stamped 2. P0: Kmin [0, 0], Kmax [1, 1].
  CHECK(ts[1] == Stamps{2});
  // t3: d3 opens P1 = {d3} with 3. q3 = [-1, 0]: P0 max(-1, 0) + max(0, 0) = 0; P1 (Kmin = Kmax
  // = [-1, 0]) 1 + 0 = 1; top 1 = P1 -> [2, 3].
  CHECK(ts[2] == Stamps{2, 3});
  // t4: d4 joins P1 (ts 4); P1: Kmin [-1, -1], Kmax [0, 0]. q4 = [1, 1]: P0 1 + 1 = 2; P1
  // max(0, -1) + max(0, -1) = 0; top 1 = P0 -> [4, 4]. Cache 6: no trigger.
  CHECK(ts[3] == Stamps{4, 4});
  CHECK(kept[3] == Positions{0, 1, 2, 3, 4, 5});
  // t5: d5 opens P2 = {d5} with 5. q5 = [1, 1]: P0 2, P1 0, P2 2 + 2 = 4; top 2 = P2, P0 ->
  // [5, 4, 5]. Cache 7 > 6: evictable P0, P1 (P2 is partial); the oldest is P1 (4): d3 and d4
  // evicted. -> P0 P2 [5, 5].
  CHECK(kept[4] == Positions{0, 1, 2, 3, 6});
  CHECK(ts[4] == Stamps{5, 5});
  // t6: d6 joins P2 (ts 6); P2: Kmin [-2, 0], Kmax [2, 2]. q6 = [0, -1]: P0 0 + max(-1, 0) = 0;
  // P2 0 + max(-2, 0) = 0; tie, top 1 = P0 (lower) -> [6, 6]. Cache 6: no trigger.
  CHECK(ts[5] == Stamps{6, 6});
  CHECK(kept[5] == Positions{0, 1, 2, 3, 6, 7});
  // t7: d7 opens P3 = {d7} with 7. q7 = [0, 1]: P0 0 + 1 = 1; P2 0 + 2 = 2; P3 (Kmin = Kmax =
  // [0, 3]) 3; top 2 = P3, P2 -> [6, 7, 7]. Cache 7: evictable P0, P2; the oldest is P0 (6): d1
  // and d2 evicted. -> P2 P3 [7, 7].
  CHECK(kept[6] == Positions{0, 1, 6, 7, 8});
  CHECK(ts[6] == Stamps{7, 7});
  // Eviction order: page {d3, d4}, then page {d1, d2}.
}

namespace {

// The scores of a step's decode units, computed here in double from the cache (an oracle
// independent of raas_scores.hpp): token mode max over the group of the softmax weight over the
// real tokens, page mode max over the group of sum_c max(q_c Kmax_c, q_c Kmin_c).
std::vector<double> oracle_scores(Stream& s, const RaasConfig& cfg, const std::vector<float>& q,
                                  std::int64_t b, std::int64_t h, std::int64_t first_decode) {
  const std::int64_t len = s.len[std::size_t(b)], d = s.dim;
  const std::int64_t unit = cfg.unit_tokens(), decode = len - first_decode;
  const std::int64_t units = (decode + unit - 1) / unit;
  std::vector<double> out(std::size_t(units), -1e300);
  for (std::int64_t g = 0; g < s.group; ++g) {
    const float* qg = &q[std::size_t(((b * s.heads + h) * s.group + g) * d)];
    if (cfg.unit == RaasUnit::token) {
      std::vector<double> logit(static_cast<std::size_t>(len));
      double top = -1e300, sum = 0;
      for (std::int64_t j = 0; j < len; ++j) {
        if (!s.mask[std::size_t(b * s.cap + j)]) continue;
        double dot = 0;
        for (std::int64_t c = 0; c < d; ++c) dot += double(qg[c]) * s.key(b, h, j)[c];
        logit[std::size_t(j)] = dot / std::sqrt(double(d));
        top = std::max(top, logit[std::size_t(j)]);
      }
      for (std::int64_t j = 0; j < len; ++j)
        if (s.mask[std::size_t(b * s.cap + j)]) sum += std::exp(logit[std::size_t(j)] - top);
      for (std::int64_t u = 0; u < units; ++u)
        out[std::size_t(u)] = std::max(out[std::size_t(u)],
                                       std::exp(logit[std::size_t(first_decode + u)] - top) / sum);
    } else {
      for (std::int64_t u = 0; u < units; ++u) {
        double bound = 0;
        for (std::int64_t c = 0; c < d; ++c) {
          double lo = 1e300, hi = -1e300;
          for (std::int64_t j = u * unit; j < std::min(decode, (u + 1) * unit); ++j) {
            lo = std::min(lo, double(s.key(b, h, first_decode + j)[c]));
            hi = std::max(hi, double(s.key(b, h, first_decode + j)[c]));
          }
          bound += std::max(qg[c] * hi, qg[c] * lo);
        }
        out[std::size_t(u)] = std::max(out[std::size_t(u)], bound);
      }
    }
  }
  return out;
}

// A random ragged, left-padded GQA stream (3 sequences, 2 KV heads, group 2) under `cfg`; checks
// every step the properties of docs/algorithms.md §5.4. Returns the number of compressions.
int check_random_stream(const RaasConfig& cfg, std::uint32_t seed, int steps) {
  const std::vector<int> prompt = {10, 6, 3};  // real prompt tokens, left-padded to 10 slots
  constexpr int kWidth = 10;
  Stream s(3, 2, 2, kWidth + steps, 8);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(8);
  auto random_key = [&](std::int64_t) {
    for (float& x : k) x = 2.0f * normal(rng);
    return k.data();
  };
  for (std::int64_t b = 0; b < 3; ++b)
    for (int j = 0; j < kWidth; ++j) s.append(b, j < kWidth - prompt[std::size_t(b)], random_key);
  RaaS raas(cfg);
  std::vector<float> q(std::size_t(3 * 4 * kWidth * 8));
  for (float& x : q) x = normal(rng);
  s.observe(raas, q, kWidth);
  const std::int64_t unit = cfg.unit_tokens();
  int compressions = 0;
  for (int t = 1; t <= steps; ++t) {
    for (std::int64_t b = 0; b < 3; ++b) s.append(b, false, random_key);
    q.assign(std::size_t(3 * 4 * 8), 0.0f);
    for (float& x : q) x = normal(rng);
    s.observe(raas, q, 1);
    for (std::int64_t b = 0; b < 3; ++b)
      for (std::int64_t h = 0; h < 2; ++h) {
        INFO("step " << t << " b " << b << " h " << h);
        // The decode tokens follow the prompt slots: positions >= kWidth.
        const std::vector<std::int32_t>& pos = s.pos[std::size_t(b * 2 + h)];
        const std::int64_t first =
            std::find_if(pos.begin(), pos.end(), [](std::int32_t p) { return p >= kWidth; }) -
            pos.begin();
        const Stamps ts = *raas.timestamps(0, b, h);
        const std::vector<double> sc = oracle_scores(s, cfg, q, b, h, first);
        REQUIRE(ts.size() == sc.size());
        // The refresh: the newest unit and the top ceil(m / 2) by score carry t, nothing else.
        const std::int64_t m = std::int64_t(ts.size());
        const std::int64_t stamped = std::count(ts.begin(), ts.end(), t);
        CHECK(ts.back() == t);
        CHECK((stamped == (m + 1) / 2 || stamped == (m + 1) / 2 + 1));
        for (std::int64_t u = 0; u + 1 < m; ++u)
          for (std::int64_t v = 0; v < m; ++v)
            if (ts[std::size_t(u)] == t && ts[std::size_t(v)] != t)
              CHECK(sc[std::size_t(u)] >= sc[std::size_t(v)] - 1e-5 * std::abs(sc[std::size_t(v)]));
      }
    if (!raas.should_compress(s.view())) {
      for (std::int64_t b = 0; b < 3; ++b) CHECK(s.len[std::size_t(b)] < cfg.budget + cfg.buffer);
      continue;
    }
    ++compressions;
    std::vector<Stamps> before_ts;
    const std::vector<std::vector<std::int32_t>> before_pos = s.pos;
    for (std::int64_t r = 0; r < 6; ++r) before_ts.push_back(*raas.timestamps(0, r / 2, r % 2));
    std::vector<int> real_before(3, 0);
    for (std::int64_t b = 0; b < 3; ++b)
      for (int i = 0; i < s.len[std::size_t(b)]; ++i)
        real_before[std::size_t(b)] += s.mask[std::size_t(b * s.cap + i)];
    const KeepPlan plan = raas.select({0, s.view(), TensorView{}});
    plan.validate();
    plan.check_matches(s.view());
    s.apply(plan);
    for (std::int64_t b = 0; b < 3; ++b) {
      int real = 0;
      for (int i = 0; i < s.len[std::size_t(b)]; ++i) real += s.mask[std::size_t(b * s.cap + i)];
      const bool compressed = plan.kept_length(b) < plan.source_length(b);
      if (compressed) {
        CHECK(real == s.len[std::size_t(b)]);  // no pad survives
        CHECK(real <= cfg.budget);             // size <= budget after the step
        // No more evicted than needed; a sequence over budget only by its pads keeps every real
        // token.
        if (real_before[std::size_t(b)] > cfg.budget)
          CHECK(real > cfg.budget - unit);
        else
          CHECK(real == real_before[std::size_t(b)]);
      }
      for (std::int64_t h = 0; h < 2; ++h) {
        INFO("step " << t << " b " << b << " h " << h);
        const std::vector<std::int32_t>& now = s.pos[std::size_t(b * 2 + h)];
        // The prompt is pinned: every real prompt position is still resident.
        for (int p = kWidth - prompt[std::size_t(b)]; p < kWidth; ++p)
          CHECK(std::count(now.begin(), now.end(), p) == 1);
        // Units of the cache before the plan, in decode order; evicted ones have the minimum
        // timestamp among the evictable ones (ties: the lower unit), whole units go.
        const std::vector<std::int32_t>& old = before_pos[std::size_t(b * 2 + h)];
        std::vector<std::int32_t> dec;
        for (std::int32_t p : old)
          if (p >= kWidth) dec.push_back(p);
        const Stamps& ts = before_ts[std::size_t(b * 2 + h)];
        const std::int64_t n = std::int64_t(dec.size()), units = (n + unit - 1) / unit;
        REQUIRE(std::int64_t(ts.size()) == units);
        std::vector<int> gone(static_cast<std::size_t>(units)), evictable(gone);
        for (std::int64_t u = 0; u < units; ++u) {
          int missing = 0, size = 0;
          for (std::int64_t j = u * unit; j < std::min(n, (u + 1) * unit); ++j, ++size)
            missing += std::count(now.begin(), now.end(), dec[std::size_t(j)]) == 0;
          CHECK((missing == 0 || missing == size));
          gone[std::size_t(u)] = missing > 0;
          evictable[std::size_t(u)] = (u + 1) * unit <= n - cfg.window;
        }
        for (std::int64_t e = 0; e < units; ++e) {
          if (!gone[std::size_t(e)]) continue;
          CHECK(evictable[std::size_t(e)]);
          for (std::int64_t u = 0; u < units; ++u)
            if (evictable[std::size_t(u)] && !gone[std::size_t(u)])
              CHECK((ts[std::size_t(e)] < ts[std::size_t(u)] ||
                     (ts[std::size_t(e)] == ts[std::size_t(u)] && e < u)));
        }
      }
    }
    for (std::int64_t b = 0; b < 3; ++b) {
      CHECK(s.len[std::size_t(b)] < cfg.budget + cfg.buffer);
      if (cfg.buffer == 1) CHECK(s.len[std::size_t(b)] <= cfg.budget);
    }
  }
  return compressions;
}

}  // namespace

TEST_CASE("RaaS properties on random ragged, padded GQA streams, token and page mode",
          "[raas][property]") {
  RaasConfig cfg;
  cfg.budget = 24, cfg.window = 4;
  SECTION("token mode, one eviction per step") { CHECK(check_random_stream(cfg, 1, 90) > 40); }
  SECTION("token mode, buffer 6") {
    cfg.buffer = 6;
    CHECK(check_random_stream(cfg, 2, 90) > 5);
  }
  SECTION("page mode, pages of 4") {
    cfg.unit = RaasUnit::page, cfg.page_size = 4, cfg.window = 3;
    CHECK(check_random_stream(cfg, 3, 90) > 10);
  }
  SECTION("page mode, pages of 16 (the paper's), window 0") {
    cfg.unit = RaasUnit::page, cfg.budget = 48, cfg.window = 0;
    CHECK(check_random_stream(cfg, 4, 110) > 2);
  }
}

TEST_CASE("RaaS absolute-alpha refresh stamps the units whose weight reaches alpha", "[raas]") {
  // All keys zero: every real token gets weight 1 / (cached tokens). Prompt p0 p1, then d1 at t1
  // (3 tokens: weights 1/3) and d2 at t2 (4 tokens: weights 1/4).
  for (const float alpha : {0.25f, 0.3f}) {
    RaasConfig cfg;
    cfg.budget = 8, cfg.window = 1, cfg.refresh = RaasRefresh::alpha, cfg.alpha = alpha;
    RaaS raas(cfg);
    std::vector<Stamps> ts;
    run_hand_stream(raas, {{0, 0}, {0, 0}}, {{1, 1}, {1, 1}}, ts);
    CHECK(ts[0] == Stamps{1});  // d1: new (1/3 >= alpha either way)
    // t2: d1's weight 1/4 reaches 0.25 (stamped 2) but not 0.3 (keeps 1); d2 is new.
    CHECK(ts[1] == (alpha == 0.25f ? Stamps{2, 2} : Stamps{1, 2}));
  }
}

TEST_CASE("RaaS keeps a prompt longer than the budget whole, with the window", "[raas]") {
  // Budget 8, window 2, a 10-token prompt: every compression keeps the prompt and the 2 newest
  // decode tokens; the sequence stays over budget (docs/algorithms.md §5.4, our choice).
  RaasConfig cfg;
  cfg.budget = 8, cfg.window = 2;
  RaaS raas(cfg);
  Stream s(1, 1, 1, 32, 2);
  const float key[2] = {0.5f, -1.0f};
  for (int j = 0; j < 10; ++j) s.append(0, false, [&](std::int64_t) { return key; });
  std::vector<float> q(20, 0.1f);
  s.observe(raas, q, 10);
  for (int t = 1; t <= 5; ++t) {
    s.append(0, false, [&](std::int64_t) { return key; });
    std::vector<float> qt = {1, 0};
    s.observe(raas, qt, 1);
    REQUIRE(raas.should_compress(s.view()));
    s.apply(raas.select({0, s.view(), TensorView{}}));
    Positions want = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    for (int p = std::max(10, 9 + t - 1); p <= 9 + t; ++p) want.push_back(p);
    CHECK(s.pos[0] == want);
  }
}

TEST_CASE("RaaS config and input errors name the field and value", "[raas][errors]") {
  auto bad = [](auto edit) {
    RaasConfig c;
    edit(c);
    return c;
  };
  REQUIRE_THROWS_WITH(bad([](RaasConfig& c) { c.window = -1; }).validate(),
                      Contains("window must be >= 0, got -1"));
  REQUIRE_THROWS_WITH(bad([](RaasConfig& c) { c.buffer = 0; }).validate(),
                      Contains("buffer must be >= 1, got 0"));
  REQUIRE_THROWS_WITH(bad([](RaasConfig& c) { c.page_size = 0; }).validate(),
                      Contains("page_size must be >= 1, got 0"));
  REQUIRE_THROWS_WITH(bad([](RaasConfig& c) { c.budget = 8; }).validate(),
                      Contains("budget (8) must exceed window + tokens per unit - 1 (8"));
  REQUIRE_THROWS_WITH(bad([](RaasConfig& c) { c.unit = RaasUnit::page, c.budget = 23; }).validate(),
                      Contains("budget (23)") && Contains("(23: window 8, unit page of 16)"));
  REQUIRE_THROWS_WITH(bad([](RaasConfig& c) { c.alpha = 0; }).validate(),
                      Contains("alpha must be in (0, 1], got 0"));
  REQUIRE_THROWS_WITH(bad([](RaasConfig& c) {
                        c.unit = RaasUnit::page, c.refresh = RaasRefresh::alpha;
                      }).validate(),
                      Contains("refresh alpha needs unit token") && Contains("got unit page"));
  REQUIRE_THROWS_WITH(make_policy("raas", R"({"unit": "block"})"),
                      Contains("'unit' must be one of token, page") && Contains("block"));
  REQUIRE_THROWS_WITH(make_policy("raas", R"({"refresh": "half"})"),
                      Contains("'refresh' must be one of top_half, alpha") && Contains("half"));
  REQUIRE_THROWS_WITH(make_policy("raas", R"({"budget": 4})"), Contains("budget (4)"));

  RaasConfig cfg;
  cfg.budget = 6, cfg.window = 1;
  Stream s(1, 1, 1, 16, 2);
  const float key[2] = {1, 0};
  for (int j = 0; j < 7; ++j) s.append(0, false, [&](std::int64_t) { return key; });
  {
    RaaS raas(cfg);
    Observation obs;
    obs.layer = 0;
    obs.kv = s.view();
    REQUIRE_THROWS_WITH(raas.observe(obs), Contains("layer 0") && Contains("has no queries"));
    REQUIRE_THROWS_WITH(raas.select({0, s.view(), TensorView{}}),
                        Contains("needs observe()") && Contains("layer 0"));
  }
  RaaS raas(cfg);
  std::vector<float> q(14, 0.5f);
  s.len[0] = 4;
  s.observe(raas, q, 4);  // a 4-token prompt
  s.len[0] = 5;
  std::vector<float> q1 = {1, 0};
  s.observe(raas, q1, 1);  // decode step 1
  s.len[0] = 7;
  REQUIRE_THROWS_WITH(s.observe(raas, q, 2),
                      Contains("got 2 queries after decode step 1") && Contains("one query"));
  s.len[0] = 7;  // 5 known + 1 new expected: 7 means a step was missed
  REQUIRE_THROWS_WITH(s.observe(raas, q1, 1),
                      Contains("holds 7 tokens but its timestamps expect 5 + 1"));
  REQUIRE_THROWS_WITH(raas.select({0, s.view(), TensorView{}}),
                      Contains("holds 7 tokens but its timestamps 5") && Contains("not applied"));
  s.len[0] = 6;
  s.mask[5] = 0;
  REQUIRE_THROWS_WITH(s.observe(raas, q1, 1),
                      Contains("decode token at slot 5 is masked as a pad"));
  Stream wide(1, 2, 1, 16, 2);
  wide.len[0] = 6;
  REQUIRE_THROWS_WITH(wide.observe(raas, q, 1),
                      Contains("timestamps are for batch 1, kv_heads 1") && Contains("reset()"));
}
