// ThoughtClassifier (ThinKV, docs/algorithms.md §3.1): the θ rule at its boundaries, the τ refresh
// that labels the NEXT interval, R before the first refresh, and averaging over L*.
#include <vector>

#include "catch.hpp"
#include "kvsift/policy/thinkv/thought_classifier.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;

namespace {
constexpr ThoughtType R = ThoughtType::reasoning;
constexpr ThoughtType E = ThoughtType::execution;
constexpr ThoughtType T = ThoughtType::transition;

ThoughtClassifierConfig config(float t1, float t2, int refresh, std::vector<int> layers = {}) {
  ThoughtClassifierConfig c;
  c.theta1 = t1;
  c.theta2 = t2;
  c.refresh = refresh;
  c.layers = std::move(layers);
  return c;
}

ThoughtType step(ThoughtClassifier& c, float s) {
  c.observe_layer(0, s);
  return c.end_step();
}
}  // namespace

TEST_CASE("thought types: importance and names", "[thought]") {
  CHECK(importance(R) == 2);
  CHECK(importance(E) == 1);
  CHECK(importance(T) == 0);
  CHECK(thought_type_name(R) == "R");
  CHECK(thought_type_name(E) == "E");
  CHECK(thought_type_name(T) == "T");
}

TEST_CASE("s < θ1 -> E, θ1 <= s < θ2 -> R, s >= θ2 -> T", "[thought]") {
  CHECK(classify_sparsity(0.0f, 0.3f, 0.7f) == E);
  CHECK(classify_sparsity(0.29f, 0.3f, 0.7f) == E);
  CHECK(classify_sparsity(0.3f, 0.3f, 0.7f) == R);
  CHECK(classify_sparsity(0.69f, 0.3f, 0.7f) == R);
  CHECK(classify_sparsity(0.7f, 0.3f, 0.7f) == T);
  CHECK(classify_sparsity(1.0f, 0.3f, 0.7f) == T);
}

TEST_CASE("labels change only at a refresh, and label the next interval", "[thought]") {
  ThoughtClassifier c(config(0.3f, 0.7f, 4));
  CHECK(c.label() == R);  // before the first refresh
  // Interval 0 (mean 0.1): its own steps are R; it makes interval 1 E.
  for (float s : {0.05f, 0.15f, 0.1f}) CHECK(step(c, s) == R);
  CHECK(c.label() == R);
  CHECK(step(c, 0.1f) == R);
  CHECK(c.label() == E);
  CHECK_THAT(c.last_interval_sparsity(), WithinAbs(0.1, 1e-6));
  // Interval 1 (mean 0.85, above θ2) is labelled E, makes interval 2 T.
  for (float s : {0.9f, 0.8f, 0.95f, 0.75f}) CHECK(step(c, s) == E);
  CHECK(c.label() == T);
  // Interval 2 (mean 0.5) is T, makes interval 3 R; one step of 0.0 inside does not matter.
  for (float s : {0.0f, 0.7f, 0.6f, 0.7f}) CHECK(step(c, s) == T);
  CHECK(c.label() == R);
  CHECK(c.steps() == 12);
}

TEST_CASE("default refresh of 128 steps", "[thought]") {
  ThoughtClassifierConfig cfg = config(0.2f, 0.6f, 128);
  ThoughtClassifier c(cfg);
  for (int i = 0; i < 127; ++i) CHECK(step(c, 0.9f) == R);
  CHECK(c.label() == R);
  CHECK(step(c, 0.9f) == R);
  CHECK(c.label() == T);
  CHECK(step(c, 0.1f) == T);
}

TEST_CASE("the step sparsity is the mean over the calibrated layers", "[thought]") {
  ThoughtClassifier c(config(0.25f, 0.35f, 1, {2, 5}));
  CHECK_FALSE(c.observe_layer(0, 1.0f));  // not in L*: ignored
  CHECK(c.observe_layer(5, 0.4f));
  CHECK(c.observe_layer(2, 0.2f));
  c.end_step();
  CHECK_THAT(c.last_step_sparsity(), WithinAbs(0.3, 1e-6));
  CHECK(c.label() == R);  // 0.3 in [0.25, 0.35); with layer 0 included it would be 0.533 -> T

  c.observe_layer(2, 0.5f);
  REQUIRE_THROWS_WITH(c.observe_layer(2, 0.5f), Contains("layer 2 reported twice"));
  REQUIRE_THROWS_WITH(c.end_step(), Contains("observed 1 of the 2 calibrated layers"));

  ThoughtClassifier all(config(0.25f, 0.35f, 1));
  REQUIRE_THROWS_WITH(all.end_step(), Contains("no layer observed"));
  all.observe_layer(0, 0.1f);
  all.observe_layer(7, 0.3f);
  all.end_step();
  CHECK_THAT(all.last_step_sparsity(), WithinAbs(0.2, 1e-6));
  CHECK(all.label() == E);
  REQUIRE_THROWS_WITH(all.observe_layer(1, 1.5f), Contains("sparsity of layer 1 is 1.5"));
}

TEST_CASE("ThoughtClassifierConfig validation names the values", "[thought][errors]") {
  REQUIRE_THROWS_WITH(ThoughtClassifier(ThoughtClassifierConfig{}), Contains("calibrate"));
  REQUIRE_THROWS_WITH(config(0.6f, 0.4f, 128).validate(),
                      Contains("theta1 (0.6) must be < theta2 (0.4)"));
  REQUIRE_THROWS_WITH(config(0.5f, 0.5f, 128).validate(), Contains("theta1 (0.5)"));
  REQUIRE_THROWS_WITH(config(-0.1f, 0.5f, 128).validate(), Contains("theta1 = -0.1"));
  REQUIRE_THROWS_WITH(config(0.1f, 1.5f, 128).validate(), Contains("theta2 = 1.5"));
  REQUIRE_THROWS_WITH(config(0.1f, 0.5f, 0).validate(), Contains("refresh must be > 0, got 0"));
  REQUIRE_THROWS_WITH(config(0.1f, 0.5f, 128, {3, -1}).validate(), Contains("layers[1] = -1"));
  REQUIRE_THROWS_WITH(config(0.1f, 0.5f, 128, {3, 4, 3}).validate(),
                      Contains("layer 3 is listed twice"));
}
