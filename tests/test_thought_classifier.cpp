// ThoughtClassifier (ThinKV, docs/algorithms.md §3.1): the θ rule at its boundaries, the τ refresh
// that labels the NEXT interval, R before the first refresh, and averaging over L*.
#include <limits>
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

TEST_CASE("deferred steps, settled before the interval closes, give the synchronous labels",
          "[thought]") {
  // Two L* layers, refresh 5, three intervals of sparsities chosen so the labels go E, T, R.
  // `sync` observes every step; `deferred` ends steps 0-3 of each interval unobserved and reports
  // them at step 4, as cuda::DeviceThinKV does. Equal labels after every step and a bit-equal
  // interval mean show the replay does the same sums in the same order.
  const std::vector<int> layers = {3, 7};
  ThoughtClassifier sync(config(0.3f, 0.7f, 5, layers)), deferred(config(0.3f, 0.7f, 5, layers));
  const std::vector<std::vector<float>> interval_values = {
      {0.1f, 0.2f, 0.05f, 0.3f, 0.15f, 0.1f, 0.2f, 0.25f, 0.1f, 0.0f},
      {0.9f, 0.8f, 0.75f, 0.95f, 0.7f, 0.85f, 0.8f, 0.9f, 1.0f, 0.65f},
      {0.5f, 0.4f, 0.45f, 0.55f, 0.6f, 0.35f, 0.5f, 0.5f, 0.4f, 0.6f}};
  for (const std::vector<float>& v : interval_values) {
    for (int s = 0; s < 5; ++s) {
      const float a = v[2 * s], b = v[2 * s + 1];
      sync.observe_layer(3, a);
      sync.observe_layer(7, b);
      const ThoughtType want = sync.end_step();
      ThoughtType got;
      if (s < 4) {
        got = deferred.end_step_deferred();
      } else {
        for (int k = 0; k < 4; ++k) {
          const float obs[2] = {v[2 * k], v[2 * k + 1]};
          deferred.settle_step(layers.data(), obs, 2);
        }
        CHECK(deferred.pending_steps() == 0);
        deferred.observe_layer(3, a);
        deferred.observe_layer(7, b);
        got = deferred.end_step();
        CHECK(deferred.last_step_sparsity() == sync.last_step_sparsity());
        CHECK(deferred.last_interval_sparsity() == sync.last_interval_sparsity());
      }
      CHECK(got == want);
      CHECK(deferred.label() == sync.label());
      CHECK(deferred.steps() == sync.steps());
    }
  }
  CHECK(sync.label() == R);  // the third interval's mean, 0.485, lies between θ1 and θ2
}

TEST_CASE("deferred steps: the errors, and nothing changes on one", "[thought]") {
  ThoughtClassifier c(config(0.3f, 0.7f, 3, {0}));
  c.observe_layer(0, 0.5f);
  CHECK_THROWS_WITH(c.end_step_deferred(), Contains("has observed layers"));
  c.end_step();                                                                     // step 0
  c.end_step_deferred();                                                            // step 1
  CHECK_THROWS_WITH(c.end_step_deferred(), Contains("closes a refresh interval"));  // step 2
  c.observe_layer(0, 0.5f);
  CHECK_THROWS_WITH(c.end_step(), Contains("deferred steps not settled"));
  const int layer = 0;
  const float nan = std::numeric_limits<float>::quiet_NaN(), bad = 1.5f;
  ThoughtClassifier d(config(0.3f, 0.7f, 3, {0}));
  CHECK_THROWS_WITH(d.settle_step(&layer, &bad, 1), Contains("without a deferred step"));
  d.end_step_deferred();
  CHECK_THROWS_WITH(d.settle_step(&layer, &nan, 1), Contains("outside [0, 1]"));
  CHECK_THROWS_WITH(d.settle_step(&layer, &bad, 0), Contains("observed 0 of the 1"));
  CHECK(d.pending_steps() == 1);  // the refused reports changed nothing
  const float ok = 0.9f;
  d.settle_step(&layer, &ok, 1);
  CHECK(d.pending_steps() == 0);
  CHECK(d.last_step_sparsity() == 0.9f);
}
