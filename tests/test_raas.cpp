// The RaaS policy (docs/algorithms.md §5.4): hand-worked streams in token and page mode whose
// timestamps and eviction order are worked out in the comments; properties over random ragged,
// left-padded GQA streams in both modes (the prompt is never evicted, a sequence holds at most
// `budget` tokens after each step, every evicted unit has the minimum timestamp among the
// evictable ones); a prompt longer than the budget; the error paths.
#include <algorithm>
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
