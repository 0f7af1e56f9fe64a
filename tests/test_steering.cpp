// Adaptive steering (docs/algorithms.md §2.5): the SEAL labeller on hand sentences, the vector
// build against hand means, safetensors round trips, α updates, gating, and h += α·v in f32 and
// bf16.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/policy/skipkv/sentence_tracker.hpp"
#include "kvsift/policy/skipkv/steering.hpp"

using namespace kvsift;

namespace {
std::string temp_path(const char* name) {
  return std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/kvsift_skip_" +
         name + ".safetensors";
}
const std::int32_t kThink = 151648, kEndThink = 151649, kNN = 271, kDotNN = 382, kWord = 1000;
}  // namespace

TEST_CASE("SEAL labeller: reflection, transition, execution", "[seal]") {
  CHECK(label_thought("Wait, that gives 12, not 14.") == ThoughtKind::reflection);
  CHECK(label_thought("  Wait maybe") == ThoughtKind::reflection);  // leading space ignored
  CHECK(label_thought("Let me verify the sum.") == ThoughtKind::reflection);
  CHECK(label_thought("I should make sure x > 0.") == ThoughtKind::reflection);
  CHECK(label_thought("Hmm, hold on.") == ThoughtKind::reflection);
  CHECK(label_thought("So that's correct.") == ThoughtKind::reflection);
  CHECK(label_thought("So it's incorrect.") == ThoughtKind::reflection);
  CHECK(label_thought("Let me check with n = 2.") == ThoughtKind::reflection);
  CHECK(label_thought("That seems right.") == ThoughtKind::reflection);
  CHECK(label_thought("I need to think again about it.") == ThoughtKind::reflection);
  // Reflection wins over transition when both match.
  CHECK(label_thought("Wait, another way is to factor.") == ThoughtKind::reflection);
  CHECK(label_thought("Alternatively, use symmetry.") == ThoughtKind::transition);
  CHECK(label_thought("Let's think differently.") == ThoughtKind::transition);
  CHECK(label_thought("There is another way.") == ThoughtKind::transition);
  CHECK(label_thought("A cleaner approach: induction.") == ThoughtKind::transition);
  CHECK(label_thought("Use the method of residues.") == ThoughtKind::transition);
  CHECK(label_thought("The solution set is empty.") == ThoughtKind::transition);
  CHECK(label_thought("A better strategy helps.") == ThoughtKind::transition);
  CHECK(label_thought("This technique works.") == ThoughtKind::transition);
  CHECK(label_thought("So 3 + 4 = 7.") == ThoughtKind::execution);
  CHECK(label_thought("wait, lower case does not start a reflection") == ThoughtKind::execution);
  CHECK(label_thought("Compute the Alternatively-free sum") == ThoughtKind::execution);
  CHECK(label_thought("") == ThoughtKind::execution);
  CHECK(std::string(thought_kind_name(ThoughtKind::transition)) == "transition");

  const auto parts = split_thoughts("First step.\n\nWait, check.\n\n\n\n  \n\nAlternatively x.");
  REQUIRE(parts.size() == 3);
  CHECK(parts[0] == "First step.");
  CHECK(parts[1] == "Wait, check.");
  CHECK(parts[2] == "Alternatively x.");
  CHECK(label_thought(parts[1]) == ThoughtKind::reflection);
}

TEST_CASE(
    "the vector is mean(execution) - mean(non-execution), and round-trips through "
    "safetensors",
    "[vector]") {
  SteeringVectorBuilder builder(3);
  const float e1[3] = {1, 2, 3};  // with the bf16 row (3, 2, 1): mean (2, 2, 2)
  const float r1[3] = {0, 0, 4};
  const float t1[3] = {1, 1, -1};  // with r1 and the bf16 row (-1, 2, 0): mean (0, 1, 1)
  builder.add(ThoughtKind::execution, e1);
  REQUIRE_THROWS_WITH(builder.build(20, "m"),
                      Catch::Matchers::Contains("have 1 execution and 0 non-execution"));
  builder.add(ThoughtKind::reflection, r1);
  builder.add(ThoughtKind::transition, t1);
  // Two samples at once, as bf16 rows of a [2, 3] view (exact in bf16).
  std::vector<bf16_t> rows = {from_float<bf16_t>(3),  from_float<bf16_t>(2), from_float<bf16_t>(1),
                              from_float<bf16_t>(-1), from_float<bf16_t>(2), from_float<bf16_t>(0)};
  builder.add(ThoughtKind::execution,
              TensorView::contiguous(rows.data(), DType::bf16, Device::cpu, {1, 3}));
  builder.add(ThoughtKind::transition,
              TensorView::contiguous(rows.data() + 3, DType::bf16, Device::cpu, {1, 3}));
  CHECK(builder.execution_count() == 2);
  CHECK(builder.non_execution_count() == 3);
  const SteeringVector v = builder.build(20, "DeepSeek-R1-Distill-Qwen-7B");
  CHECK(v.values == std::vector<float>{2.0f, 1.0f, 1.0f});
  CHECK(v.layer == 20);

  const std::string path = temp_path("vector");
  v.save(path);
  const SteeringVector back = SteeringVector::load(path);
  CHECK(back.values == v.values);
  CHECK(back.layer == 20);
  CHECK(back.model == "DeepSeek-R1-Distill-Qwen-7B");
  const auto raw = SafetensorsFile::load(path);
  CHECK(raw.get("steering_vector", {3}).dtype == StDType::f32);
  CHECK(raw.metadata().at("layer") == "20");

  // Files that are not steering vectors are rejected by name.
  SafetensorsFile wrong_rank;
  const float m[4] = {1, 2, 3, 4};
  wrong_rank.put_f32("steering_vector", {2, 2}, m);
  wrong_rank.metadata()["layer"] = "20";
  wrong_rank.save(path);
  REQUIRE_THROWS_WITH(SteeringVector::load(path), Catch::Matchers::Contains("got rank 2"));
  SafetensorsFile no_layer;
  no_layer.put_f32("steering_vector", {4}, m);
  no_layer.save(path);
  REQUIRE_THROWS_WITH(SteeringVector::load(path), Catch::Matchers::Contains("no 'layer'"));
  no_layer.metadata()["layer"] = "twenty";
  no_layer.save(path);
  REQUIRE_THROWS_WITH(
      SteeringVector::load(path),
      Catch::Matchers::Contains("layer metadata: expected an integer, got 'twenty'"));
  no_layer.metadata()["layer"] = "4294967316";  // wraps to 20 through a 32-bit cast
  no_layer.save(path);
  REQUIRE_THROWS_WITH(SteeringVector::load(path),
                      Catch::Matchers::Contains("'4294967316' is out of range"));
  SafetensorsFile other;
  other.put_f32("vec", {4}, m);
  other.save(path);
  REQUIRE_THROWS_WITH(SteeringVector::load(path), Catch::Matchers::Contains("steering_vector"));
  std::remove(path.c_str());

  REQUIRE_THROWS_WITH(SteeringVectorBuilder(0), Catch::Matchers::Contains("hidden_size (0)"));
  std::vector<float> four(8);
  REQUIRE_THROWS_WITH(
      builder.add(ThoughtKind::execution,
                  TensorView::contiguous(four.data(), DType::f32, Device::cpu, {2, 4})),
      Catch::Matchers::Contains("hidden is [2, 4], expected [samples, 3]"));
}

TEST_CASE("strength follows α0 + γ·N_o at triggers; gating needs <think> and a \\n\\n token",
          "[controller]") {
  SteeringVector v{{1.0f, -2.0f, 0.5f, 0.0f}, 20, "toy"};
  SteeringController c(SteeringConfig::r1_qwen_7b(), v, 2);
  CHECK(c.strength(0) == 1.25f);
  CHECK_FALSE(c.gated(0));
  c.observe(0, {kWord, kNN});  // a boundary, but before <think>
  CHECK_FALSE(c.gated(0));
  c.observe(0, {kThink, kWord});
  CHECK_FALSE(c.gated(0));  // inside, but the last token is no boundary
  c.observe(0, {kDotNN});
  CHECK(c.gated(0));
  CHECK_FALSE(c.gated(1));
  c.observe(0, {kWord, kEndThink, kNN});
  CHECK_FALSE(c.gated(0));  // after </think>

  // N_o from a tracker: two check sentences ("Wait" = 14190 in R1-Qwen); α moves only when the
  // host calls update_strength at a trigger.
  SentenceTracker tracker(SentenceTrackerConfig{SentenceTokens::r1_qwen(), 0, 0.95f});
  tracker.observe({14190, kWord, kNN, kWord, kNN, 92014, kDotNN, 14190});
  CHECK(tracker.check_count() == 2);
  CHECK(c.strength(1) == 1.25f);
  c.update_strength(1, tracker.check_count());
  CHECK(c.strength(1) == 1.25f + 0.02f * 2);
  c.reset(1);
  CHECK(c.strength(1) == 1.25f);

  CHECK(SteeringConfig::r1_qwen_14b().layer == 35);
  CHECK(SteeringConfig::r1_llama_8b().layer == 20);
  // The gate's ids are the full paragraph-break lists (test_steering_cadence.cpp checks them
  // against the data set); the four "\n\n" delimiters are among them.
  for (std::int32_t id : {271, 382, 696, 1980}) {
    const auto& ids = SteeringConfig::r1_llama_8b().boundary;
    CHECK(std::find(ids.begin(), ids.end(), id) != ids.end());
  }
}

TEST_CASE("apply adds α_b·v at the last position of gated rows only, f32 and bf16", "[apply]") {
  SteeringVector v{{1.0f, -2.0f, 0.5f}, 20, "toy"};
  SteeringController c(SteeringConfig{}, v, 3);
  for (int b = 0; b < 3; ++b) c.observe(b, {kThink, kWord});
  c.observe(0, {kNN});
  c.observe(2, {kDotNN});
  c.update_strength(2, 10);  // α = 1.25 + 0.2 = 1.45

  SECTION("f32") {
    std::vector<float> h(3 * 2 * 3, 1.0f);  // [batch 3, seq 2, hidden 3]
    auto view = TensorView::contiguous(h.data(), DType::f32, Device::cpu, {3, 2, 3});
    CHECK(c.apply(19, view) == 0);  // another layer: untouched
    CHECK(h == std::vector<float>(18, 1.0f));
    CHECK(c.apply(20, view) == 2);
    for (int b = 0; b < 3; ++b) {
      for (int k = 0; k < 3; ++k) {
        INFO("b " << b << " k " << k);
        CHECK(h[(b * 2 + 0) * 3 + k] == 1.0f);  // earlier positions untouched
        const float alpha = b == 0 ? 1.25f : 1.45f;
        const float expected = b == 1 ? 1.0f : 1.0f + alpha * v.values[k];
        CHECK(h[(b * 2 + 1) * 3 + k] == expected);
      }
    }
  }
  SECTION("bf16 rounds the fp32 sum to nearest even") {
    // α·v chosen so the exact sums sit on and just past a bf16 halfway point near 1.
    const float tie = std::ldexp(1.0f, -8);  // 1 + 2^-8: halfway between 1 and 1 + 2^-7
    const float alpha = 1.25f;
    SteeringVector w{{tie / alpha, (tie + std::ldexp(1.0f, -12)) / alpha, -3.0f}, 20, "toy"};
    SteeringController d(SteeringConfig{}, w, 1);
    d.observe(0, {kThink, kNN});
    std::vector<bf16_t> h(2 * 3, from_float<bf16_t>(1.0f));  // [1, 2, 3]
    REQUIRE(d.apply(20, TensorView::contiguous(h.data(), DType::bf16, Device::cpu, {1, 2, 3})) ==
            1);
    CHECK(h[3].bits == 0x3f80);  // tie -> even: 1.0
    CHECK(h[4].bits == 0x3f81);  // past the tie: 1 + 2^-7
    CHECK(h[5].bits == 0xc030);  // 1 - 3.75 = -2.75 = -1.375 * 2^1, exact
    CHECK(h[0].bits == 0x3f80);
  }
}

TEST_CASE("steering rejects wrong sizes, layers and token sets with clear errors", "[errors]") {
  SteeringVector v{{1.0f, 2.0f}, 20, "toy"};
  SteeringController c(SteeringConfig{}, v, 1);
  std::vector<float> h(1 * 1 * 3);
  REQUIRE_THROWS_WITH(
      c.apply(20, TensorView::contiguous(h.data(), DType::f32, Device::cpu, {1, 1, 3})),
      Catch::Matchers::Contains("steering vector has 2 values, hidden size is 3"));
  std::vector<float> h2(2 * 1 * 2);
  REQUIRE_THROWS_WITH(
      c.apply(20, TensorView::contiguous(h2.data(), DType::f32, Device::cpu, {2, 1, 2})),
      Catch::Matchers::Contains("hidden has batch 2, the controller tracks 1"));
  REQUIRE_THROWS_WITH(
      c.apply(20, TensorView::contiguous(h2.data(), DType::f32, Device::cpu, {2, 2})),
      Catch::Matchers::Contains("must be [batch, seq, hidden]"));
  REQUIRE_THROWS_WITH(c.strength(1), Catch::Matchers::Contains("sequence 1 outside [0, 1)"));
  REQUIRE_THROWS_WITH(c.update_strength(0, -1), Catch::Matchers::Contains("check_sentences (-1)"));
  REQUIRE_THROWS_WITH(SteeringController(SteeringConfig::r1_qwen_14b(), v, 1),
                      Catch::Matchers::Contains("built for layer 20, the config steers layer 35"));
  REQUIRE_THROWS_WITH(SteeringController(SteeringConfig{}, SteeringVector{{}, 20, ""}, 1),
                      Catch::Matchers::Contains("no values"));
  REQUIRE_THROWS_WITH(SteeringController(SteeringConfig{}, SteeringVector{{NAN}, 20, ""}, 1),
                      Catch::Matchers::Contains("value[0] = nan"));
  SteeringConfig cfg;
  cfg.boundary.clear();
  REQUIRE_THROWS_WITH(SteeringController(cfg, v, 1), Catch::Matchers::Contains("boundary"));
  cfg = SteeringConfig{};
  cfg.think_end = {kThink};
  REQUIRE_THROWS_WITH(SteeringController(cfg, v, 1),
                      Catch::Matchers::Contains("151648 is both think_start and think_end"));
  cfg = SteeringConfig{};
  cfg.alpha0 = INFINITY;
  REQUIRE_THROWS_WITH(SteeringController(cfg, v, 1), Catch::Matchers::Contains("alpha0 (inf)"));
  REQUIRE_THROWS_WITH(SteeringController(SteeringConfig{}, v, 0),
                      Catch::Matchers::Contains("batch (0)"));
}
