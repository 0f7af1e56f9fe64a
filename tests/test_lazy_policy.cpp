// The LazyEviction Policy (docs/algorithms.md §5.3) driven like an engine over the golden lazy_*
// streams: scope query_head (keys repeated to the query heads, the reference's layout), the
// prompt not observed, one observation per decode step, compaction whenever should_compress says.
// Its kept positions and TS/MRI at every eviction and at the end must equal the golden ones; plus
// hand-worked GQA and padding cases and the error paths.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "catch.hpp"
#include "golden_lazy.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/baselines/lazy_eviction.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// One layer, batch 1, cache [1, heads, capacity, D] fp32, positions tracked per head.
struct MiniEngine {
  std::int64_t heads, cap, dim;
  std::vector<float> keys;
  std::vector<std::int32_t> len{0};
  std::vector<std::vector<std::int32_t>> pos;  // [heads][slot]
  MiniEngine(std::int64_t h, std::int64_t c, std::int64_t d)
      : heads(h), cap(c), dim(d), keys(std::size_t(h * c * d)), pos(std::size_t(h)) {}
  KVCacheView view() {
    return make_kv_cache_view(keys.data(), keys.data(), DType::f32, Device::cpu, 1, heads, cap, dim,
                              len.data(), nullptr);
  }
  // Appends one token: row(h) gives head h's key.
  template <class F>
  void append(std::int32_t position, F row) {
    for (std::int64_t h = 0; h < heads; ++h) {
      std::memcpy(&keys[std::size_t((h * cap + len[0]) * dim)], row(h), std::size_t(dim) * 4);
      pos[std::size_t(h)].push_back(position);
    }
    ++len[0];
  }
  void apply(const KeepPlan& plan) {
    // compact() with keys == values moves the shared buffer twice; use a values copy.
    std::vector<float> values = keys;
    compact(make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, 1, heads, cap,
                               dim, len.data(), nullptr),
            plan);
    for (std::int64_t h = 0; h < heads; ++h) {
      std::vector<std::int32_t> kept;
      for (std::int64_t i = 0; i < plan.row_size(0, h); ++i)
        kept.push_back(pos[std::size_t(h)][std::size_t(plan.row(0, h)[i])]);
      pos[std::size_t(h)] = kept;
    }
  }
};

std::vector<std::int32_t> as_i32(const std::vector<std::int64_t>& v) {
  return std::vector<std::int32_t>(v.begin(), v.end());
}

}  // namespace

TEST_CASE("LazyEviction policy reproduces the golden streams", "[lazy][golden][policy]") {
  for (const char* name : {"lazy_fp32_gqa", "lazy_fp16", "lazy_fp16_long"}) {
    INFO("case " << name);
    const SafetensorsFile f =
        SafetensorsFile::load(test::golden_path(std::string(name) + ".safetensors"));
    const lazy::Case c = lazy::load_case(f);
    const std::int64_t Hq = c.shape.q_heads, group = Hq / c.shape.kv_heads, D = c.shape.head_dim,
                       P = c.shape.prefill, N = c.shape.steps;
    LazyConfig cfg = c.cfg;  // scope query_head, counters as the dtype
    LazyEviction policy(cfg);
    MiniEngine e(Hq, P + N, D);
    for (std::int64_t p = 0; p < P; ++p)
      e.append(std::int32_t(p), [&](std::int64_t h) {
        return &c.prefill_keys[std::size_t(((h / group) * P + p) * D)];
      });
    const std::vector<std::int64_t> g_steps = f.get("evict_steps").to_i64();
    const std::vector<std::int64_t> g_kept = f.get("kept_pos").to_i64();
    const std::vector<float> g_kts = f.get("kept_ts").to_f32(), g_kmri = f.get("kept_mri").to_f32();
    const std::int64_t K = f.get("kept_pos").shape[2];
    std::size_t e_idx = 0;
    for (std::int64_t t = 1; t <= N; ++t) {
      e.append(std::int32_t(P + t - 1), [&](std::int64_t h) {
        return &c.decode_keys[std::size_t(((h / group) * N + t - 1) * D)];
      });
      std::vector<float> q(std::size_t(Hq * D));
      for (std::int64_t h = 0; h < Hq; ++h)
        std::memcpy(&q[std::size_t(h * D)], &c.decode_queries[std::size_t((h * N + t - 1) * D)],
                    std::size_t(D) * 4);
      Observation obs;
      obs.layer = 0;
      obs.kv = e.view();
      obs.queries = TensorView::contiguous(q.data(), DType::f32, Device::cpu, {1, Hq, 1, D});
      policy.observe(obs);
      if (!policy.should_compress(e.view())) continue;
      REQUIRE(e_idx < g_steps.size());
      REQUIRE(g_steps[e_idx] == t);
      const KeepPlan plan = policy.select({0, e.view(), TensorView{}});
      e.apply(plan);
      for (std::int64_t h = 0; h < Hq; ++h) {
        INFO("step " << t << " head " << h);
        const std::size_t base = std::size_t((std::int64_t(e_idx) * Hq + h) * K);
        std::vector<std::int32_t> want =
            as_i32(std::vector<std::int64_t>(g_kept.begin() + base, g_kept.begin() + base + K));
        REQUIRE(e.pos[std::size_t(h)] == want);
        const lazy::Row* row = policy.counters(0, 0, h);
        REQUIRE(row != nullptr);
        for (std::int64_t i = 0; i < K; ++i) {
          REQUIRE(float(row->ts[std::size_t(i)]) == g_kts[base + std::size_t(i)]);
          REQUIRE(float(row->mri[std::size_t(i)]) == g_kmri[base + std::size_t(i)]);
        }
      }
      ++e_idx;
    }
    CHECK(e_idx == g_steps.size());
    const std::vector<std::int64_t> fpos = f.get("final_pos").to_i64();
    const std::vector<float> fts = f.get("final_ts").to_f32();
    const std::int64_t F = f.get("final_pos").shape[1];
    for (std::int64_t h = 0; h < Hq; ++h) {
      std::vector<std::int32_t> want;
      for (std::int64_t i = 0; i < F; ++i)
        if (fpos[std::size_t(h * F + i)] >= 0)
          want.push_back(std::int32_t(fpos[std::size_t(h * F + i)]));
      CHECK(e.pos[std::size_t(h)] == want);
      const lazy::Row* row = policy.counters(0, 0, h);
      for (std::size_t i = 0; i < want.size(); ++i)
        CHECK(float(row->ts[i]) == fts[std::size_t(h * F) + i]);
    }
  }
}

TEST_CASE("LazyEviction kv_head scope: a token is hit when any query head of its group hits it",
          "[lazy][policy]") {
  // One KV head, two query heads, D = 2. Keys: token 0 = (10, 0), token 1 = (0, 10), token 2 = 0.
  // Query head 0 = (1, 0) looks at token 0, query head 1 = (0, 1) at token 1; alpha = 0.3.
  // softmax of (10/√2, 0, 0) puts ~0.9985 on token 0 and ~7e-4 on the others: head 0 hits only
  // token 0, head 1 only token 1, so under max over the group both tokens are hit and token 2 not.
  LazyConfig cfg;
  cfg.budget = 3, cfg.window = 1, cfg.alpha = 0.3f;
  LazyEviction policy(cfg);
  MiniEngine e(1, 8, 2);
  const float k[3][2] = {{10, 0}, {0, 10}, {0, 0}};
  for (int p = 0; p < 3; ++p) e.append(p, [&](std::int64_t) { return k[p]; });
  float q[4] = {1, 0, 0, 1};  // [1, 2, 1, 2]
  Observation obs;
  obs.layer = 0;
  obs.kv = e.view();
  obs.queries = TensorView::contiguous(q, DType::f32, Device::cpu, {1, 2, 1, 2});
  policy.observe(obs);
  const lazy::Row* row = policy.counters(0, 0, 0);
  REQUIRE(row != nullptr);
  CHECK(row->ts == std::vector<std::int32_t>{1, 1, 0});   // step 1 hit tokens 0 and 1
  CHECK(row->mri == std::vector<std::int32_t>{1, 1, 0});  // gap 1 − 0
  // Over budget (4 > 3) at step 2 (2 % 1 == 0): the window keeps token 3, the top 2 of the
  // candidates 0..2 by score are 0 and 1 (MRI 1) over token 2 (MRI 0, score 0).
  const float k3[2] = {0, 0};
  e.append(3, [&](std::int64_t) { return k3; });
  obs.kv = e.view();
  policy.observe(obs);
  REQUIRE(policy.should_compress(e.view()));
  const KeepPlan plan = policy.select({0, e.view(), TensorView{}});
  e.apply(plan);
  CHECK(e.pos[0] == std::vector<std::int32_t>{0, 1, 3});
  CHECK(policy.counters(0, 0, 0)->ts.size() == 3);
}

TEST_CASE("LazyEviction errors name the problem", "[lazy][policy][errors]") {
  LazyConfig cfg;
  cfg.budget = 3, cfg.window = 1;
  LazyEviction policy(cfg);
  MiniEngine e(1, 8, 2);
  const float k[2] = {1, 0};
  for (int p = 0; p < 5; ++p) e.append(p, [&](std::int64_t) { return k; });
  // Never observed: the trigger fires so that select() says what is missing.
  REQUIRE(policy.should_compress(e.view()));
  REQUIRE_THROWS_WITH(policy.select({0, e.view(), TensorView{}}),
                      Contains("needs observe()") && Contains("layer 0"));
  Observation obs;
  obs.layer = 0;
  obs.kv = e.view();
  REQUIRE_THROWS_WITH(policy.observe(obs), Contains("no queries") && Contains("layer 0"));
  float q[2] = {1, 0};
  obs.queries = TensorView::contiguous(q, DType::f32, Device::cpu, {1, 1, 1, 2});
  policy.observe(obs);
  // Three tokens appended without observing them: the counters refuse.
  for (int p = 5; p < 8; ++p) e.append(p, [&](std::int64_t) { return k; });
  obs.kv = e.view();
  REQUIRE_THROWS_WITH(policy.observe(obs),
                      Contains("holds 8 tokens but its counters expect 5 + at most 1"));
  LazyConfig qh = cfg;
  qh.scope = LazyScope::query_head;
  LazyEviction per_query(qh);
  float q2[4] = {1, 0, 0, 1};
  obs.queries = TensorView::contiguous(q2, DType::f32, Device::cpu, {1, 2, 1, 2});
  REQUIRE_THROWS_WITH(per_query.observe(obs),
                      Contains("scope query_head") && Contains("kv_heads 1 and q_heads 2"));
}

TEST_CASE("LazyEviction fires every window steps over budget, never on the prompt",
          "[lazy][policy]") {
  LazyConfig cfg;
  cfg.budget = 4, cfg.window = 3;
  LazyEviction policy(cfg);
  MiniEngine e(1, 32, 2);
  const float k[2] = {1, 0};
  float q[2] = {0, 1};
  for (int p = 0; p < 6; ++p) e.append(p, [&](std::int64_t) { return k; });
  // The prompt (6 > 4 tokens) observed as one chunk of 6 queries: step 0, no trigger.
  std::vector<float> prompt_q(12, 0.0f);
  Observation obs;
  obs.layer = 0;
  obs.kv = e.view();
  obs.queries = TensorView::contiguous(prompt_q.data(), DType::f32, Device::cpu, {1, 1, 6, 2});
  policy.observe(obs);
  CHECK(policy.step(0) == 0);
  CHECK_FALSE(policy.should_compress(e.view()));
  obs.queries = TensorView::contiguous(q, DType::f32, Device::cpu, {1, 1, 1, 2});
  for (int t = 1; t <= 6; ++t) {
    e.append(5 + t, [&](std::int64_t) { return k; });
    obs.kv = e.view();
    policy.observe(obs);
    INFO("step " << t);
    CHECK(policy.should_compress(e.view()) == (t % 3 == 0));
    if (t % 3 == 0) {
      const KeepPlan plan = policy.select({0, e.view(), TensorView{}});
      CHECK(plan.kept_length(0) == 4);
      e.apply(plan);
    }
  }
  // At budget (4 tokens) on a trigger step: nothing to do.
  CHECK(e.len[0] == 4);
  CHECK_FALSE(policy.should_compress(e.view()));
}
