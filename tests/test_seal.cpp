// SEAL as a configuration of the steering controller (docs/algorithms.md §5.5): the preset's
// fields are the spec's, the update is exactly α·v on the gated rows and nothing elsewhere (values
// worked out by hand), the strength stays α0 whatever the check sentences, and the SkipKV JSON
// config reaches it through "steering": {"preset": "seal", "model": ...}.
#include <cstdint>
#include <memory>
#include <vector>

#include "catch.hpp"
#include "kvsift/config/steering_config.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "kvsift/policy/skipkv/steering.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

TEST_CASE("SEAL presets: gamma 0, alpha0 1, layer 20 for 7B/8B and 35 for 14B", "[seal]") {
  const SteeringConfig q7 = seal_steering_config(SteeringModel::r1_qwen_7b);
  const SteeringConfig l8 = seal_steering_config(SteeringModel::r1_llama_8b);
  const SteeringConfig q14 = seal_steering_config(SteeringModel::r1_qwen_14b);
  for (const SteeringConfig* c : {&q7, &l8, &q14}) {
    CHECK(c->preset == SteeringPreset::seal);
    CHECK(c->gamma == 0.0f);
    CHECK(c->alpha0 == 1.0f);
    c->validate();
  }
  CHECK(q7.layer == 20);
  CHECK(l8.layer == 20);
  CHECK(q14.layer == 35);
  // The gate: <think> ids and every "\n\n" token of the model's vocabulary (565 in Qwen's, 588 in
  // Llama-3.1's, "\n\n" itself is 271 in both).
  CHECK(q7.think_start == std::vector<std::int32_t>{151648});
  CHECK(q7.think_end == std::vector<std::int32_t>{151649});
  CHECK(q14.think_start == std::vector<std::int32_t>{151648});
  CHECK(l8.think_start == std::vector<std::int32_t>{128013});
  CHECK(l8.think_end == std::vector<std::int32_t>{128014});
  CHECK(q7.boundary.size() == 565);
  CHECK(q14.boundary.size() == 565);
  CHECK(l8.boundary.size() == 588);
  CHECK(q7.boundary.front() == 271);
  CHECK(l8.boundary.front() == 271);
  // SkipKV's own preset differs only in the strength rule.
  const SteeringConfig skip =
      SteeringConfig::from_preset(SteeringPreset::skipkv, SteeringModel::r1_qwen_14b);
  CHECK(skip.preset == SteeringPreset::skipkv);
  CHECK(skip.gamma == 0.02f);
  CHECK(skip.alpha0 == 1.25f);
  CHECK(skip.layer == 35);
}

TEST_CASE("SEAL adds exactly alpha0 * v to the last position of gated rows, nothing elsewhere",
          "[seal]") {
  SteeringConfig cfg = seal_steering_config(SteeringModel::r1_qwen_7b);
  cfg.alpha0 = 1.25f;
  SteeringVector v;
  v.values = {0.5f, -1.0f, 2.0f, 0.25f};
  v.layer = 20;
  SteeringController seal(cfg, v, 3);
  // Sequence 0: inside <think>, last token "\n\n" (271): gated. Sequence 1: inside <think>, last
  // token not a paragraph break. Sequence 2: a paragraph break outside <think>.
  seal.observe(0, {151648, 1000, 271});
  seal.observe(1, {151648, 271, 1000});
  seal.observe(2, {1000, 271});
  CHECK(seal.gated(0));
  CHECK_FALSE(seal.gated(1));
  CHECK_FALSE(seal.gated(2));
  // Check sentences do not change a constant strength: α = α0 + 0 · 7.
  seal.update_strength(0, 7);
  CHECK(seal.strength(0) == 1.25f);

  std::vector<float> h(3 * 2 * 4, 1.0f);  // [batch 3, seq 2, hidden 4]
  const TensorView hv = TensorView::contiguous(h.data(), DType::f32, Device::cpu, {3, 2, 4});
  CHECK(seal.apply(19, hv) == 0);  // not the steered layer
  CHECK(h == std::vector<float>(24, 1.0f));
  CHECK(seal.apply(20, hv) == 1);
  // Row (0, last): 1 + 1.25 * [0.5, -1, 2, 0.25] = [1.625, -0.25, 3.5, 1.3125] (exact in fp32).
  std::vector<float> want(24, 1.0f);
  want[4] = 1.625f, want[5] = -0.25f, want[6] = 3.5f, want[7] = 1.3125f;
  CHECK(h == want);
}

TEST_CASE("the SkipKV JSON config reaches SEAL through steering.preset", "[seal][config]") {
  auto steering_of = [](const char* json) {
    std::unique_ptr<Policy> p = make_policy("skipkv", json);
    return dynamic_cast<SkipKV&>(*p).config().steering;
  };
  const SteeringConfig s14 =
      steering_of(R"({"steering": {"preset": "seal", "model": "r1-qwen-14b"}})");
  CHECK(s14.preset == SteeringPreset::seal);
  CHECK(s14.layer == 35);
  CHECK(s14.gamma == 0.0f);
  CHECK(s14.alpha0 == 1.0f);
  // Explicit keys override the preset's fields, whatever their order in the JSON.
  const SteeringConfig s8 =
      steering_of(R"({"steering": {"alpha0": 1.25, "model": "r1-llama-8b", "preset": "seal"}})");
  CHECK(s8.alpha0 == 1.25f);
  CHECK(s8.gamma == 0.0f);
  CHECK(s8.layer == 20);
  CHECK(s8.think_start == std::vector<std::int32_t>{128013});
  CHECK(s8.boundary.size() == 588);
  // A model alone keeps SkipKV's adaptive strength.
  const SteeringConfig a = steering_of(R"({"steering": {"model": "r1-qwen-14b"}})");
  CHECK(a.preset == SteeringPreset::skipkv);
  CHECK(a.gamma == 0.02f);
  CHECK(a.layer == 35);

  REQUIRE_THROWS_WITH(
      make_policy("skipkv", R"({"steering": {"preset": "seal", "gamma": 0.02}})"),
      Contains("preset seal has a constant strength, so gamma must be 0, got 0.02"));
  REQUIRE_THROWS_WITH(make_policy("skipkv", R"({"steering": {"preset": "sael"}})"),
                      Contains("'preset' must be one of skipkv, seal") && Contains("sael"));
  REQUIRE_THROWS_WITH(make_policy("skipkv", R"({"steering": {"model": "r1-qwen-32b"}})"),
                      Contains("'model' must be one of r1-qwen-7b, r1-llama-8b, r1-qwen-14b") &&
                          Contains("r1-qwen-32b"));
}
