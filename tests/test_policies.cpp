// Property tests of every baseline policy over random shapes and dtypes: plans validate, the
// window survives, compressed rows hold exactly `budget`, sequences under budget are untouched,
// compaction keeps exactly the planned rows bit for bit; plus configs' and inputs' error paths.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/baselines/full_kv.hpp"
#include "kvsift/policy/baselines/h2o.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/baselines/snapkv.hpp"
#include "kvsift/policy/baselines/streaming_llm.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "random_cache.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using kvsift_test::OwnedTensor;
using kvsift_test::RandomCache;

namespace {

struct Scenario {
  DType dtype;
  int batch, kv_heads, group, capacity, dim, window, budget;
  std::vector<int> lengths;
  std::vector<int> pads;  // empty: no padding mask
};

Scenario random_scenario(std::mt19937& rng) {
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Scenario s;
  s.dtype = dtypes[pick(0, 2)];
  s.batch = pick(1, 3);
  s.kv_heads = pick(1, 3);
  s.group = pick(1, 4);
  s.dim = 8 * pick(1, 4);
  s.window = pick(2, 8);
  s.budget = pick(2 * s.window + 6, 48);
  s.capacity = s.budget + pick(1, 60);
  for (int b = 0; b < s.batch; ++b) {
    // Some sequences under budget (a no-op), some at, some over.
    const int kind = pick(0, 3);
    s.lengths.push_back(kind == 0 ? pick(s.window, s.budget) : pick(s.budget, s.capacity));
  }
  if (pick(0, 2) == 0)
    for (int b = 0; b < s.batch; ++b) s.pads.push_back(pick(0, 5));
  return s;
}

// The scenario's knobs as each method's JSON config (sinks only for StreamingLLM).
std::string config_for(const std::string& name, const Scenario& s) {
  nlohmann::json j = {{"budget", s.budget}, {"window", s.window}, {"buffer", 16}, {"kernel", 3}};
  if (name == "streaming") j["sink"] = 2;
  return filter_config(name, j.dump());
}

// The methods that plan over the engine's cache (cache-owning ones have no select()).
std::vector<std::string> planning_methods() {
  std::vector<std::string> names;
  for (const MethodInfo& m : registered_methods())
    if (!m.owns_cache) names.emplace_back(m.name);
  return names;
}

// Runs one policy on one scenario and checks every plan property, then compaction.
void check_policy(const std::string& name, const Scenario& s, std::mt19937& rng) {
  INFO("policy " << name << ", dtype " << dtype_name(s.dtype) << ", batch " << s.batch
                 << ", kv_heads " << s.kv_heads << ", G " << s.group << ", D " << s.dim << ", W "
                 << s.window << ", budget " << s.budget);
  RandomCache c(s.dtype, s.batch, s.kv_heads, s.capacity, s.dim, rng);
  for (int b = 0; b < s.batch; ++b) c.lengths[b] = s.lengths[b];
  if (!s.pads.empty()) c.left_pad(s.pads);
  OwnedTensor q(s.dtype, s.batch, s.kv_heads * s.group, s.window, s.dim);
  q.randomize(rng);
  std::unique_ptr<Policy> p = make_policy(name, config_for(name, s));
  REQUIRE(p->name() == name);
  StepInputs in{0, c.view(), q.view()};
  Observation layer_obs;
  layer_obs.layer = 0;
  layer_obs.kv = in.kv;
  layer_obs.queries = in.window_queries;
  p->observe(layer_obs);  // H2O accumulates; the others ignore it
  if (auto* skipkv = dynamic_cast<SkipKV*>(p.get())) {
    // SkipKV must have observed every cached position: the pads, then the real tokens (id 0, no
    // delimiter: one open sentence, so no penalty and R-KV's plan properties must hold).
    for (int b = 0; b < s.batch; ++b) {
      const int pads = s.pads.empty() ? 0 : std::min(s.pads[b], s.lengths[b]);
      skipkv->add_padding(b, pads);
      skipkv->observe(b, std::vector<std::int32_t>(s.lengths[b] - pads, 0));
    }
  }
  const KeepPlan plan = p->select(in);
  plan.validate();
  plan.check_matches(in.kv);

  const RandomCache before = c;
  bool any_pads_kept = false;
  for (int b = 0; b < s.batch; ++b) {
    const int len = s.lengths[b];
    const int pads = s.pads.empty() ? 0 : std::min(s.pads[b], len);
    for (int h = 0; h < s.kv_heads; ++h) {
      const std::int32_t* row = plan.row(b, h);
      const std::int64_t n = plan.row_size(b, h);
      if (name == "fullkv" || len <= s.budget) {
        REQUIRE(n == len);  // no-op: keep_all semantics
        for (int i = 0; i < len; ++i) REQUIRE(row[i] == i);
        continue;
      }
      // Pads are never kept, so a padded sequence keeps budget tokens only when enough real
      // tokens exist.
      REQUIRE(n == std::min(s.budget, len - pads));
      for (int k = 0; k < s.window; ++k) REQUIRE(row[n - s.window + k] == len - s.window + k);
      for (std::int64_t i = 0; i < n; ++i) any_pads_kept |= !c.valid(b, row[i]);
      if (name == "streaming") {
        const int sink = std::min(2, len - pads);
        for (int i = 0; i < sink; ++i) REQUIRE(row[i] == pads + i);
        for (std::int64_t i = sink; i < n; ++i) REQUIRE(row[i] == len - (n - i));
      }
    }
  }
  CHECK_FALSE(any_pads_kept);

  compact(c.view(), plan);
  const std::size_t row_bytes = s.dim * dtype_size(s.dtype);
  for (int b = 0; b < s.batch; ++b) {
    REQUIRE(c.lengths[b] == plan.kept_length(b));
    for (int h = 0; h < s.kv_heads; ++h)
      for (std::int64_t i = 0; i < plan.row_size(b, h); ++i) {
        const std::int32_t slot = plan.row(b, h)[i];
        const std::size_t dst = c.keys.index(b, h, i, 0) * dtype_size(s.dtype);
        const std::size_t src = before.keys.index(b, h, slot, 0) * dtype_size(s.dtype);
        REQUIRE(std::memcmp(&c.keys.bytes[dst], &before.keys.bytes[src], row_bytes) == 0);
        REQUIRE(std::memcmp(&c.values.bytes[dst], &before.values.bytes[src], row_bytes) == 0);
      }
  }
}

}  // namespace

TEST_CASE("every policy plans valid, budget-sized, window-keeping, compactable plans",
          "[policies][property]") {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 25; ++trial) {
    const Scenario s = random_scenario(rng);
    for (const std::string& name : planning_methods())
      if (name != "raas")  // pins the observed prompt, whatever the budget: tests/test_raas.cpp
        check_policy(name, s, rng);
  }
}

TEST_CASE("should_compress fires at budget + buffer", "[policies]") {
  std::mt19937 rng(4);
  RandomCache c(DType::f32, 2, 1, 64, 8, rng);
  for (const std::string& name : planning_methods()) {
    if (name == "lazy") continue;  // triggered by the step count: tests/test_lazy_policy.cpp
    INFO(name);
    std::unique_ptr<Policy> p =
        make_policy(name, filter_config(name, R"({"budget": 40, "buffer": 16, "window": 8})"));
    c.lengths = {55, 30};
    CHECK_FALSE(p->should_compress(c.view()));
    c.lengths = {30, 56};
    CHECK(p->should_compress(c.view()) == (name != "fullkv"));
  }
}

TEST_CASE("R-KV selects the top scores with ties to the lower index", "[policies][rkv]") {
  // Identical keys and zero queries: every score is equal, so the tie rule alone decides.
  std::mt19937 rng(8);
  RandomCache c(DType::f32, 1, 2, 40, 4, rng);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 40; ++j)
      for (int d = 0; d < 4; ++d) c.keys.set(c.keys.index(0, h, j, d), d == 0 ? 1.0f : 0.0f);
  OwnedTensor q(DType::f32, 1, 2, 8, 4);
  RKVConfig cfg;
  cfg.budget = 20;
  cfg.sink = 3;
  RKV p(cfg);
  const KeepPlan plan = p.select({0, c.view(), q.view()});
  for (int h = 0; h < 2; ++h) {
    std::vector<std::int32_t> expect;
    for (int j = 0; j < 12; ++j) expect.push_back(j);   // 3 sinks + 9 ties, lowest first
    for (int j = 32; j < 40; ++j) expect.push_back(j);  // window
    CHECK(std::vector<std::int32_t>(plan.row(0, h), plan.row(0, h) + 20) == expect);
  }
}

TEST_CASE("H2O accumulates attention and follows the cache through compaction", "[policies][h2o]") {
  std::mt19937 rng(6);
  const int group = 3, heads = 2, cap = 60;
  RandomCache c(DType::bf16, 2, heads, cap, 16, rng);
  c.lengths = {50, 58};
  H2OConfig cfg;
  cfg.budget = 30;
  cfg.recent = 10;
  H2O h2o(cfg);
  // Two single-step observations: each step's softmax rows sum to 1 per query head, so a head's
  // accumulator sums to G per step.
  for (int step = 0; step < 2; ++step) {
    OwnedTensor q(DType::bf16, 2, heads * group, 1, 16);
    q.randomize(rng);
    h2o.observe_step({0, c.view(), q.view()});
  }
  const cpu::ScoreTensor acc = *h2o.accumulator(0);
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < heads; ++h) {
      double sum = 0.0;
      for (int j = 0; j < c.lengths[b]; ++j) sum += acc.at(b, h, j);
      CHECK(std::fabs(sum - 2.0 * group) < 1e-4);
    }
  const KeepPlan plan = h2o.select({0, c.view(), TensorView{}});
  plan.validate();
  // Every kept non-recent token outscores every dropped one.
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < heads; ++h) {
      const std::int32_t* row = plan.row(b, h);
      std::vector<bool> kept(cap, false);
      for (int i = 0; i < 30; ++i) kept[row[i]] = true;
      float min_kept = 1e9f, max_dropped = -1.0f;
      for (int j = 0; j < c.lengths[b] - 10; ++j) {
        if (kept[j]) {
          min_kept = std::min(min_kept, acc.at(b, h, j));
        } else {
          max_dropped = std::max(max_dropped, acc.at(b, h, j));
        }
      }
      CHECK(min_kept >= max_dropped);
      // The accumulator moved with the plan.
      for (int i = 0; i < 30; ++i) CHECK(h2o.accumulator(0)->at(b, h, i) == acc.at(b, h, row[i]));
    }
  compact(c.view(), plan);
  // Observing a shrunken cache without its plan applied would be caught.
  c.lengths[0] = 5;
  OwnedTensor q(DType::bf16, 2, heads * group, 1, 16);
  REQUIRE_THROWS_WITH(h2o.observe_step({0, c.view(), q.view()}), Contains("accumulator"));
}

TEST_CASE("H2O last-query mode keeps one set for all heads", "[policies][h2o]") {
  std::mt19937 rng(12);
  RandomCache c(DType::f16, 1, 4, 50, 8, rng);
  OwnedTensor q(DType::f16, 1, 8, 4, 8);
  q.randomize(rng, 3.0f);
  H2OConfig cfg;
  cfg.budget = 24;
  cfg.mode = H2OMode::last_query_shared;
  H2O h2o(cfg);
  const KeepPlan plan = h2o.select({0, c.view(), q.view()});
  plan.validate();
  for (int h = 1; h < 4; ++h)
    CHECK(std::equal(plan.row(0, 0), plan.row(0, 0) + 24, plan.row(0, h)));
}

TEST_CASE("configs reject bad values with messages naming them", "[policies][errors]") {
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"budget": 8, "window": 8})"),
                      Contains("budget (8)") && Contains("window"));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"budget": 64, "kernel": 6})"),
                      Contains("kernel") && Contains("6"));
  REQUIRE_THROWS_WITH(make_policy("snapkv", R"({"budget": 64, "kernel": 6})"),
                      Contains("kernel") && Contains("6"));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"budget": 64, "buffer": 4})"),
                      Contains("buffer (4)") && Contains("window (8)"));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"mix_lambda": 1.5})"),
                      Contains("mix_lambda") && Contains("1.5"));
  REQUIRE_THROWS_WITH(make_policy("streaming", R"({"budget": 64, "sink": 64})"),
                      Contains("budget (64)") && Contains("sink (64)"));
  H2OConfig h;
  h.budget = 16;
  h.recent = 16;
  REQUIRE_THROWS_WITH(H2O(h), Contains("recent (16)"));
  REQUIRE_THROWS_WITH(make_policy("quest"), Contains("'quest'") && Contains("rkv") &&
                                                Contains("fullkv") && Contains("h2o") &&
                                                Contains("skipkv"));
}

TEST_CASE("policies reject mismatched shapes and NaN inputs", "[policies][errors]") {
  std::mt19937 rng(21);
  RandomCache c(DType::f32, 1, 2, 40, 8, rng);
  const std::string o = R"({"budget": 24, "window": 8})";
  for (const std::string& name : {"rkv", "snapkv"}) {
    INFO(name);
    std::unique_ptr<Policy> p = make_policy(name, o);
    OwnedTensor wrong_dim(DType::f32, 1, 4, 8, 16);
    REQUIRE_THROWS_WITH(p->select({0, c.view(), wrong_dim.view()}),
                        Contains("head_dim (16)") && Contains("(8)"));
    OwnedTensor wrong_heads(DType::f32, 1, 3, 8, 8);
    REQUIRE_THROWS_WITH(p->select({0, c.view(), wrong_heads.view()}),
                        Contains("q_heads (3)") && Contains("kv_heads (2)"));
    OwnedTensor q(DType::f32, 1, 4, 8, 8);
    q.randomize(rng);
    q.set(q.index(0, 3, 7, 7), std::nanf(""));
    REQUIRE_THROWS_WITH(p->select({0, c.view(), q.view()}), Contains("queries"));
  }
  OwnedTensor q(DType::f32, 1, 4, 8, 8);
  RandomCache nan_keys = c;
  nan_keys.keys.set(nan_keys.keys.index(0, 0, 2, 1), std::nanf(""));
  REQUIRE_THROWS_WITH(make_policy("rkv", o)->select({0, nan_keys.view(), q.view()}),
                      Contains("keys") && Contains("[0, 0, 2, 1]"));
  // Window longer than a sequence: the scorers refuse rather than read before slot 0.
  c.lengths[0] = 6;
  RKVConfig cfg;
  cfg.budget = 24;
  REQUIRE_THROWS_WITH(cpu::rkv_scores(c.view(), q.view(), cfg),
                      Contains("window (8)") && Contains("(6)"));
}

TEST_CASE("make_policy(\"skipkv\") reads SkipKVConfig from JSON", "[policies][skipkv]") {
  std::unique_ptr<Policy> p = make_policy(
      "skipkv", R"({"budget": 48, "window": 6, "buffer": 20, "kernel": 5, "mix_lambda": 0.3,
                    "threshold": 0.7, "hidden_size": 12, "steering": {"alpha0": 1.0}})");
  auto* skipkv = dynamic_cast<SkipKV*>(p.get());
  REQUIRE(skipkv != nullptr);
  const SkipKVConfig& c = skipkv->config();
  CHECK(c.scorer.rkv.budget == 48);
  CHECK(c.scorer.rkv.window == 6);
  CHECK(c.scorer.rkv.buffer == 20);
  CHECK(c.scorer.rkv.kernel == 5);
  CHECK(c.scorer.rkv.mix_lambda == 0.3f);
  CHECK(c.scorer.rkv.threshold == 0.7f);
  CHECK(c.sentences.hidden_size == 12);
  CHECK(c.steering.alpha0 == 1.0f);
  CHECK(c.steering.gamma == 0.02f);  // untouched default
  CHECK(c.batch == 0);               // sized by the sequences observed
  CHECK(c.sentences.tau == 0.95f);
  CHECK(p->needs() == (kNeedsTokens | kNeedsHidden));
  // Sized from what it observes: sequence 2 makes a batch of 3; hidden states are [1, 12].
  REQUIRE(skipkv->batch() == 0);
  std::vector<float> hidden(12, 0.5f);
  const std::int32_t token = 5;
  skipkv->observe(2, &token, 1,
                  TensorView::contiguous(hidden.data(), DType::f32, Device::cpu, {1, 12}));
  CHECK(skipkv->batch() == 3);
  CHECK(skipkv->tracker(2).position() == 1);
  // The default width (0) is segmentation only: hidden states are refused.
  std::unique_ptr<Policy> plain = make_policy("skipkv");
  CHECK(plain->needs() == kNeedsTokens);
  REQUIRE_THROWS_WITH(
      dynamic_cast<SkipKV&>(*plain).observe(
          0, &token, 1, TensorView::contiguous(hidden.data(), DType::f32, Device::cpu, {1, 12})),
      Contains("hidden"));
  REQUIRE_THROWS_WITH(make_policy("skipkv", R"({"hidden_size": -3})"),
                      Contains("hidden_size (-3)"));
  REQUIRE_THROWS_WITH(make_policy("skipkv", R"({"window": 6, "buffer": 4})"),
                      Contains("buffer (4)") && Contains("window (6)"));
}
