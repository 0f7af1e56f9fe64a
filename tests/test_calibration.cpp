// ThinKV threshold calibration (docs/algorithms.md §3.1): Silverman's rule by hand, the binned KDE
// against the direct KDE formula, mode/valley finding on hand-made densities, and synthetic
// trimodal mixtures whose true valleys are found numerically (the oracle) to within 0.02;
// unimodal and bimodal data are rejected with a clear error.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/thinkv/sparsity_calibration.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;

namespace {
struct Mixture {
  double weight[3], mean[3], sd[3];
};

double mixture_pdf(const Mixture& m, double x) {
  double f = 0;
  for (int i = 0; i < 3; ++i) {
    f += m.weight[i] * std::exp(-0.5 * std::pow((x - m.mean[i]) / m.sd[i], 2)) / m.sd[i];
  }
  return f;
}

// Oracle: the true valley, the minimum of the mixture density between two means (fine scan).
double true_valley(const Mixture& m, double from, double to) {
  double best_x = from, best_f = std::numeric_limits<double>::infinity();
  for (double x = from; x <= to; x += 1e-5) {
    const double f = mixture_pdf(m, x);
    if (f < best_f) best_f = f, best_x = x;
  }
  return best_x;
}

// Samples of the mixture restricted to [0, 1] (sparsities are fractions).
std::vector<double> draw(const Mixture& m, int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> pick(0.0, 1.0);
  std::normal_distribution<double> gauss(0.0, 1.0);
  std::vector<double> out;
  while (static_cast<int>(out.size()) < n) {
    const double r = pick(rng);
    const int c = r < m.weight[0] ? 0 : r < m.weight[0] + m.weight[1] ? 1 : 2;
    const double x = m.mean[c] + m.sd[c] * gauss(rng);
    if (x >= 0.0 && x <= 1.0) out.push_back(x);
  }
  return out;
}

const Mixture kMixtures[] = {
    {{0.4, 0.4, 0.2}, {0.25, 0.55, 0.85}, {0.06, 0.06, 0.05}},
    {{0.3, 0.5, 0.2}, {0.2, 0.5, 0.8}, {0.05, 0.07, 0.05}},
    {{0.2, 0.6, 0.2}, {0.15, 0.45, 0.75}, {0.04, 0.08, 0.06}},
};
const Mixture kUnimodal{{1.0, 0.0, 0.0}, {0.5, 0.5, 0.5}, {0.1, 0.1, 0.1}};
const Mixture kBimodal{{0.5, 0.5, 0.0}, {0.3, 0.7, 0.7}, {0.07, 0.07, 0.07}};
}  // namespace

TEST_CASE("Silverman's rule by hand", "[calibration]") {
  // 0..4: sd = sqrt(2.5) = 1.581, IQR = 3 - 1 = 2 -> 2 / 1.34 = 1.493 is the smaller spread.
  CHECK_THAT(silverman_bandwidth({0, 1, 2, 3, 4}),
             WithinAbs(0.9 * (2 / 1.34) * std::pow(5, -0.2), 1e-12));
  // IQR 0 (most samples equal): the standard deviation alone.
  const std::vector<double> spiky{1, 1, 1, 1, 1, 1, 1, 5};
  const double sd = std::sqrt((7 * 0.25 + 3.5 * 3.5) / 7.0);  // mean 1.5
  CHECK_THAT(silverman_bandwidth(spiky), WithinAbs(0.9 * sd * std::pow(8, -0.2), 1e-12));
  REQUIRE_THROWS_WITH(silverman_bandwidth({0.5}), Contains("at least 2 samples, got 1"));
}

TEST_CASE("binned KDE matches the direct KDE formula", "[calibration]") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0.1, 0.9);
  std::vector<double> x(200);
  for (auto& v : x) v = u(rng);
  const int G = 512;
  const double h = 0.04;
  const auto f = binned_gaussian_kde(x, h, G);
  REQUIRE(f.size() == static_cast<std::size_t>(G));
  double peak = 0, integral = 0;
  for (int i = 0; i < G; ++i) {
    const double t = double(i) / (G - 1);
    double direct = 0;
    for (double s : x) direct += std::exp(-0.5 * std::pow((t - s) / h, 2));
    direct /= x.size() * h * std::sqrt(2 * 3.14159265358979323846);
    peak = std::max(peak, direct);
    CHECK_THAT(f[i], WithinAbs(direct, 2e-3 * 3.0));
    integral += f[i] / (G - 1) * ((i == 0 || i == G - 1) ? 0.5 : 1.0);
  }
  CHECK(peak < 3.0);                           // the absolute tolerance above is ~1e-3 of the peak
  CHECK_THAT(integral, WithinAbs(1.0, 1e-3));  // samples lie well inside [0, 1]
}

TEST_CASE("density_shape finds modes, boundary modes and the valleys between", "[calibration]") {
  auto shape = density_shape({0, 1, 2, 1, 0, 1, 3, 1});
  CHECK(shape.modes == std::vector<int>{2, 6});
  CHECK(shape.valleys == std::vector<int>{4});
  shape = density_shape({3, 2, 1, 2});  // maxima on both edges
  CHECK(shape.modes == std::vector<int>{0, 3});
  CHECK(shape.valleys == std::vector<int>{2});
  shape = density_shape({0, 1, 1, 1, 0});  // a plateau is one mode
  CHECK(shape.modes == std::vector<int>{1});
  CHECK(shape.valleys.empty());
  shape = density_shape({0, 1, 1 - 1e-9, 1, 0});  // a ripple below 1e-7 of the peak
  CHECK(shape.modes.size() == 1);
  shape = density_shape({2, 2, 2});
  CHECK(shape.modes.size() == 1);
  shape = density_shape({1, 5, 1, 4, 1, 3, 2});
  CHECK(shape.modes == std::vector<int>{1, 3, 5});
  CHECK(shape.valleys == std::vector<int>{2, 4});
}

TEST_CASE("trimodal mixtures: thresholds within 0.02 of the true valleys", "[calibration]") {
  for (const Mixture& m : kMixtures) {
    const double v1 = true_valley(m, m.mean[0], m.mean[1]);
    const double v2 = true_valley(m, m.mean[1], m.mean[2]);
    for (unsigned seed : {11u, 12u, 13u}) {
      const TrimodalFit fit = fit_trimodal(draw(m, 3000, seed));
      INFO("means " << m.mean[0] << " " << m.mean[1] << " " << m.mean[2] << " seed " << seed
                    << " reason '" << fit.reason << "'");
      REQUIRE(fit.trimodal);
      CHECK_THAT(fit.theta1, WithinAbs(v1, 0.02));
      CHECK_THAT(fit.theta2, WithinAbs(v2, 0.02));
      CHECK(fit.max_bandwidth >= fit.bandwidth);
      CHECK(fit.valley_depth > 0.2);
    }
  }
}

TEST_CASE("unimodal and bimodal samples are not trimodal", "[calibration]") {
  for (unsigned seed : {21u, 22u, 23u}) {
    for (const Mixture* m : {&kUnimodal, &kBimodal}) {
      const TrimodalFit fit = fit_trimodal(draw(*m, 3000, seed));
      CHECK_FALSE(fit.trimodal);
      CHECK_FALSE(fit.reason.empty());
    }
  }
  CHECK_THAT(fit_trimodal(std::vector<double>(100, 0.5)).reason, Contains("no spread"));
  CHECK_THAT(fit_trimodal({0.1, 0.2}).reason, Contains("only 2 samples"));
}

namespace {
// [prompts, layers, steps] with NaN padding: prompt p has steps - 250 p valid entries.
std::vector<float> make_tensor(const std::vector<Mixture>& layer_mix, int prompts, int steps) {
  const int layers = static_cast<int>(layer_mix.size());
  std::vector<float> t(static_cast<std::size_t>(prompts) * layers * steps,
                       std::numeric_limits<float>::quiet_NaN());
  for (int p = 0; p < prompts; ++p) {
    for (int l = 0; l < layers; ++l) {
      const auto x = draw(layer_mix[l], steps - 250 * p, 1000u + 37u * p + l);
      for (std::size_t s = 0; s < x.size(); ++s) {
        t[(static_cast<std::size_t>(p) * layers + l) * steps + s] = static_cast<float>(x[s]);
      }
    }
  }
  return t;
}

Mixture trimodal_with_sd(double sd) { return {{0.35, 0.4, 0.25}, {0.2, 0.5, 0.8}, {sd, sd, sd}}; }
}  // namespace

TEST_CASE("calibrate_thresholds: averaged thresholds and the 4 deepest-valley layers",
          "[calibration]") {
  // Layers 0 and 1 have no three thought types; layers 2-6 do, with valleys the deeper the
  // narrower the components: by depth 5 (sd .045) > 3 (.05) > 6 (.055) > 4 (.06) > 2 (.075).
  const std::vector<double> sds{0.075, 0.05, 0.06, 0.045, 0.055};
  std::vector<Mixture> mix{kUnimodal, kBimodal};
  for (double sd : sds) mix.push_back(trimodal_with_sd(sd));
  const int prompts = 3, steps = 3000;
  const auto t = make_tensor(mix, prompts, steps);
  const CalibrationResult r = calibrate_thresholds(t.data(), prompts, 7, steps);

  REQUIRE(r.per_layer.size() == 7);
  CHECK_FALSE(r.per_layer[0].qualifies);
  CHECK_FALSE(r.per_layer[1].qualifies);
  for (int l = 2; l < 7; ++l) {
    CHECK(r.per_layer[l].qualifies);
    CHECK(r.per_layer[l].prompts_trimodal == 3);
    CHECK(r.per_layer[l].prompts_with_data == 3);
  }
  CHECK(r.layers == std::vector<int>{3, 4, 5, 6});
  // Oracle: the mean of the layers' true valleys (every qualifying layer has 3 trimodal prompts).
  double v1 = 0, v2 = 0;
  for (double sd : sds) {
    const Mixture m = trimodal_with_sd(sd);
    v1 += true_valley(m, 0.2, 0.5) / sds.size();
    v2 += true_valley(m, 0.5, 0.8) / sds.size();
  }
  CHECK_THAT(r.theta1, WithinAbs(v1, 0.02));
  CHECK_THAT(r.theta2, WithinAbs(v2, 0.02));
  CHECK(r.theta1 < r.theta2);

  CalibrationConfig two;
  two.top_layers = 2;
  CHECK(calibrate_thresholds(t.data(), prompts, 7, steps, two).layers == std::vector<int>{3, 5});
}

TEST_CASE("calibrate_thresholds rejects data without three modes", "[calibration][errors]") {
  const auto uni = make_tensor({kUnimodal, kUnimodal}, 2, 2000);
  REQUIRE_THROWS_WITH(calibrate_thresholds(uni.data(), 2, 2, 2000),
                      Contains("no layer's sparsity distribution has exactly 3 stable modes") &&
                          Contains("2 prompt(s) x 2 layer(s)") && Contains("layer 0, prompt 0"));
  const auto bi = make_tensor({kBimodal}, 3, 2000);
  REQUIRE_THROWS_AS(calibrate_thresholds(bi.data(), 3, 1, 2000), Error);
  const std::vector<float> all_nan(2 * 3 * 10, std::numeric_limits<float>::quiet_NaN());
  REQUIRE_THROWS_WITH(calibrate_thresholds(all_nan.data(), 2, 3, 10), Contains("enough samples"));
}

TEST_CASE("calibration input and config errors name the values", "[calibration][errors]") {
  std::vector<float> t(1 * 1 * 20, 0.5f);
  t[3] = 1.5f;
  REQUIRE_THROWS_WITH(calibrate_thresholds(t.data(), 1, 1, 20),
                      Contains("sparsity[0, 0, 3] = 1.5 is outside [0, 1]"));
  REQUIRE_THROWS_WITH(calibrate_thresholds(t.data(), 0, 1, 20), Contains("[0, 1, 20]"));
  // Work bound: 2^34 / 512² = 65,536 (prompt, layer) pairs at the default grid; one more layer
  // per prompt is refused before any KDE runs (the data pointer is never read).
  REQUIRE_THROWS_WITH(calibrate_thresholds(t.data(), 65536, 2, 20),
                      Contains("exceeds the work bound kMaxCalibrationWork"));
  CalibrationConfig c;
  c.grid_points = 8;
  REQUIRE_THROWS_WITH(c.validate(), Contains("grid_points must be in [16, 4096], got 8"));
  c.grid_points = 100000000;  // `calibrate --grid 1e8` ran for minutes
  REQUIRE_THROWS_WITH(c.validate(), Contains("grid_points must be in [16, 4096], got 100000000"));
  c = {};
  c.stability_ratio = 0.5;
  REQUIRE_THROWS_WITH(c.validate(), Contains("stability_ratio must be >= 1, got 0.5"));
  c = {};
  c.top_layers = 0;
  REQUIRE_THROWS_WITH(c.validate(), Contains("top_layers must be >= 1, got 0"));
  c = {};
  c.min_prompt_fraction = 0;
  REQUIRE_THROWS_WITH(c.validate(), Contains("min_prompt_fraction"));
  c = {};
  c.min_valley_depth = 1.0;
  REQUIRE_THROWS_WITH(c.validate(), Contains("min_valley_depth"));
  REQUIRE_THROWS_WITH(binned_gaussian_kde({0.5}, 0.0, 64), Contains("bandwidth must be positive"));
}

TEST_CASE("calibrate_thresholds: theta1, theta2 come from the layers of L* only", "[calibration]") {
  // docs/algorithms.md §3.1: the thresholds are averaged over prompts and over the selected layers
  // L*, not over every qualifying layer. Layers 0-1 are narrow (deep valleys, selected with
  // top_layers = 2); layers 2-4 are wider (shallower valleys, qualifying but not selected) and
  // shifted 0.1 lower, so averaging them in would move both thresholds by about 0.06.
  auto shifted = [](double sd, double shift) {
    return Mixture{{0.35, 0.4, 0.25}, {0.2 - shift, 0.5 - shift, 0.8 - shift}, {sd, sd, sd}};
  };
  const std::vector<Mixture> mix{shifted(0.045, 0.0), shifted(0.05, 0.0), shifted(0.075, 0.1),
                                 shifted(0.08, 0.1), shifted(0.075, 0.1)};
  const int prompts = 3, steps = 3000;
  const auto t = make_tensor(mix, prompts, steps);
  CalibrationConfig cfg;
  cfg.top_layers = 2;
  const CalibrationResult r = calibrate_thresholds(t.data(), prompts, 5, steps, cfg);
  for (int l = 0; l < 5; ++l) CHECK(r.per_layer[l].qualifies);
  REQUIRE(r.layers == std::vector<int>{0, 1});
  // Oracle: the mean of L*'s true valleys.
  double v1 = 0, v2 = 0;
  for (int l : r.layers) {
    v1 += true_valley(mix[l], 0.2, 0.5) / 2;
    v2 += true_valley(mix[l], 0.5, 0.8) / 2;
  }
  CHECK_THAT(r.theta1, WithinAbs(v1, 0.02));
  CHECK_THAT(r.theta2, WithinAbs(v2, 0.02));
}
