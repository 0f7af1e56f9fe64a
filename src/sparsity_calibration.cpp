// ThinKV threshold calibration (docs/algorithms.md §3.1): binned Gaussian KDE, mode counting, the
// bandwidth search for a stable trimodal range, and the layer ranking. See
// sparsity_calibration.hpp and docs/thinkv.md.
#include "kvsift/policy/thinkv/sparsity_calibration.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

void CalibrationConfig::validate() const {
  KVSIFT_CHECK(grid_points >= 16 && grid_points <= kMaxCalibrationGridPoints,
               "CalibrationConfig: grid_points must be in [16, ", kMaxCalibrationGridPoints,
               "], got ", grid_points);
  KVSIFT_CHECK(stability_ratio >= 1.0, "CalibrationConfig: stability_ratio must be >= 1, got ",
               stability_ratio);
  KVSIFT_CHECK(min_valley_depth >= 0.0 && min_valley_depth < 1.0,
               "CalibrationConfig: min_valley_depth must lie in [0, 1), got ", min_valley_depth);
  KVSIFT_CHECK(top_layers >= 1, "CalibrationConfig: top_layers must be >= 1, got ", top_layers);
  KVSIFT_CHECK(min_prompt_fraction > 0.0 && min_prompt_fraction <= 1.0,
               "CalibrationConfig: min_prompt_fraction must lie in (0, 1], got ",
               min_prompt_fraction);
  KVSIFT_CHECK(min_samples >= 2, "CalibrationConfig: min_samples must be >= 2, got ", min_samples);
}

namespace {

constexpr double kPi = 3.14159265358979323846;

// Samples linearly binned onto the grid: each sample splits its unit weight between the two
// nearest grid points. Kept once per (prompt, layer) and reused for every bandwidth tried.
class BinnedSamples {
 public:
  BinnedSamples(const std::vector<double>& samples, int grid_points)
      : weights_(grid_points, 0.0), n_(static_cast<double>(samples.size())) {
    const double last = grid_points - 1;
    for (double x : samples) {
      const double pos = std::clamp(x, 0.0, 1.0) * last;
      const int i = std::min(static_cast<int>(pos), grid_points - 2);
      const double frac = pos - i;
      weights_[i] += 1.0 - frac;
      weights_[i + 1] += frac;
    }
  }

  std::vector<double> density(double bandwidth) const {
    const int g = static_cast<int>(weights_.size());
    const double step = 1.0 / (g - 1);
    std::vector<double> kernel(g);  // φ_h at grid distance k
    const double norm = 1.0 / (n_ * bandwidth * std::sqrt(2.0 * kPi));
    for (int k = 0; k < g; ++k) {
      const double u = k * step / bandwidth;
      kernel[k] = norm * std::exp(-0.5 * u * u);
    }
    std::vector<double> f(g, 0.0);
    for (int j = 0; j < g; ++j) {
      if (weights_[j] == 0.0) continue;
      for (int i = 0; i < g; ++i) f[i] += weights_[j] * kernel[std::abs(i - j)];
    }
    return f;
  }

  int modes(double bandwidth) const {
    return static_cast<int>(density_shape(density(bandwidth)).modes.size());
  }

 private:
  std::vector<double> weights_;  // [grid_points]
  double n_;
};

double quantile(std::vector<double> sorted_copy, double q) {
  std::sort(sorted_copy.begin(), sorted_copy.end());
  const double pos = q * (sorted_copy.size() - 1);
  const std::size_t i = static_cast<std::size_t>(pos);
  const double frac = pos - i;
  if (i + 1 >= sorted_copy.size()) return sorted_copy.back();
  return sorted_copy[i] * (1.0 - frac) + sorted_copy[i + 1] * frac;
}

// Relative depth of the valley between two modes: how far below the lower mode it dips.
double relative_depth(const std::vector<double>& f, int left_mode, int valley, int right_mode) {
  const double lower = std::min(f[left_mode], f[right_mode]);
  return lower > 0.0 ? (lower - f[valley]) / lower : 0.0;
}

}  // namespace

double silverman_bandwidth(const std::vector<double>& samples) {
  const double n = static_cast<double>(samples.size());
  KVSIFT_CHECK(samples.size() >= 2, "silverman_bandwidth: need at least 2 samples, got ",
               samples.size());
  double mean = 0.0;
  for (double x : samples) mean += x;
  mean /= n;
  double var = 0.0;
  for (double x : samples) var += (x - mean) * (x - mean);
  const double sd = std::sqrt(var / (n - 1.0));
  const double iqr = quantile(samples, 0.75) - quantile(samples, 0.25);
  const double spread = iqr > 0.0 ? std::min(sd, iqr / 1.34) : sd;
  return 0.9 * spread * std::pow(n, -0.2);
}

std::vector<double> binned_gaussian_kde(const std::vector<double>& samples, double bandwidth,
                                        int grid_points) {
  KVSIFT_CHECK(!samples.empty(), "binned_gaussian_kde: no samples");
  KVSIFT_CHECK(bandwidth > 0.0 && std::isfinite(bandwidth),
               "binned_gaussian_kde: bandwidth must be positive, got ", bandwidth);
  KVSIFT_CHECK(grid_points >= 2, "binned_gaussian_kde: grid_points must be >= 2, got ",
               grid_points);
  return BinnedSamples(samples, grid_points).density(bandwidth);
}

DensityShape density_shape(const std::vector<double>& f) {
  DensityShape shape;
  if (f.empty()) return shape;
  const double peak = *std::max_element(f.begin(), f.end());
  const double tol = 1e-7 * peak;
  // A hysteresis walk: a maximum is confirmed once the density falls `tol` below it, a minimum
  // once it rises `tol` above it. phase 0: undecided, +1: rising, -1: falling.
  int phase = 0, hi = 0, lo = 0;
  for (int i = 1; i < static_cast<int>(f.size()); ++i) {
    if (phase >= 0) {
      if (f[i] > f[hi]) hi = i;
      if (f[i] < f[hi] - tol) {
        shape.modes.push_back(hi);
        phase = -1;
        lo = i;
        continue;
      }
    }
    if (phase <= 0) {
      if (f[i] < f[lo]) lo = i;
      if (f[i] > f[lo] + tol) {
        if (phase == -1) shape.valleys.push_back(lo);
        phase = 1;
        hi = i;
      }
    }
  }
  if (phase == 1) shape.modes.push_back(hi);  // still rising at the right edge
  if (phase == 0) shape.modes.push_back(hi);  // flat within tolerance: one mode
  return shape;
}

TrimodalFit fit_trimodal(const std::vector<double>& samples, const CalibrationConfig& config) {
  config.validate();
  TrimodalFit fit;
  if (static_cast<int>(samples.size()) < config.min_samples) {
    fit.reason =
        detail::concat("only ", samples.size(), " samples (min_samples ", config.min_samples, ")");
    return fit;
  }
  fit.silverman = silverman_bandwidth(samples);
  if (!(fit.silverman > 0.0)) {
    fit.reason = "the samples have no spread";
    return fit;
  }
  const BinnedSamples binned(samples, config.grid_points);
  const double smallest = 1.0 / (config.grid_points - 1);  // below the grid step the KDE is aliased
  const double largest = 4.0;                              // far wider than [0, 1]

  // Bracket h3 (the largest bandwidth with >= 3 modes) starting from Silverman's h, then bisect
  // in log space. The Gaussian kernel's mode count only falls as h grows (Silverman 1981), so
  // the bracket is well defined.
  double lo = fit.silverman, hi = fit.silverman;
  if (binned.modes(fit.silverman) >= 3) {
    do {
      lo = hi;
      hi *= 2.0;
    } while (hi < largest && binned.modes(hi) >= 3);
    if (hi >= largest && binned.modes(largest) >= 3) {
      fit.reason = "3 or more modes at every bandwidth";
      return fit;
    }
  } else {
    do {
      hi = lo;
      lo *= 0.5;
    } while (lo > smallest && binned.modes(lo) < 3);
    if (lo <= smallest) {
      lo = smallest;
      const int m = binned.modes(smallest);
      if (m < 3) {
        fit.reason = detail::concat("only ", m, " mode", m == 1 ? "" : "s",
                                    " even at the smallest bandwidth");
        return fit;
      }
    }
  }
  while (hi / lo > 1.001) {
    const double mid = std::sqrt(lo * hi);
    (binned.modes(mid) >= 3 ? lo : hi) = mid;
  }
  fit.max_bandwidth = lo;
  const int at_h3 = binned.modes(lo);
  const int at_low_end = binned.modes(lo / config.stability_ratio);
  if (at_h3 != 3 || at_low_end != 3) {
    fit.reason = detail::concat("no stable 3-mode bandwidth range (", at_low_end,
                                " modes at h = ", lo / config.stability_ratio, ", ", at_h3,
                                " at h = ", lo, ")");
    return fit;
  }
  fit.bandwidth = binned.modes(fit.silverman) == 3 ? fit.silverman : lo / config.stability_ratio;
  const std::vector<double> f = binned.density(fit.bandwidth);
  const DensityShape shape = density_shape(f);
  const double step = 1.0 / (config.grid_points - 1);
  const double d1 = relative_depth(f, shape.modes[0], shape.valleys[0], shape.modes[1]);
  const double d2 = relative_depth(f, shape.modes[1], shape.valleys[1], shape.modes[2]);
  fit.theta1 = shape.valleys[0] * step;
  fit.theta2 = shape.valleys[1] * step;
  fit.valley_depth = std::min(d1, d2);
  if (fit.valley_depth < config.min_valley_depth) {
    fit.reason = detail::concat("a valley is only ", fit.valley_depth, " deep (min_valley_depth ",
                                config.min_valley_depth, ")");
    return fit;
  }
  fit.trimodal = true;
  return fit;
}

CalibrationResult calibrate_thresholds(const float* sparsity, std::int64_t prompts,
                                       std::int64_t layers, std::int64_t steps,
                                       const CalibrationConfig& config) {
  config.validate();
  KVSIFT_CHECK(prompts > 0 && layers > 0 && steps > 0, "calibrate_thresholds: need a non-empty ",
               "[prompts, layers, steps] tensor, got [", prompts, ", ", layers, ", ", steps, "]");
  KVSIFT_CHECK(sparsity != nullptr, "calibrate_thresholds: sparsity is null");
  {
    const std::int64_t grid2 = static_cast<std::int64_t>(config.grid_points) * config.grid_points;
    const std::int64_t pairs =
        checked_mul(prompts, layers, "calibrate_thresholds: prompts * layers");
    KVSIFT_CHECK(pairs <= kMaxCalibrationWork / grid2, "calibrate_thresholds: ", prompts,
                 " prompts x ", layers, " layers x grid_points² (", config.grid_points,
                 "²) exceeds the work bound kMaxCalibrationWork = ", kMaxCalibrationWork,
                 "; use fewer prompts or a smaller grid");
    checked_mul(pairs, steps, "calibrate_thresholds: prompts * layers * steps");
  }

  CalibrationResult result;
  int qualifying = 0;
  std::string example_reason;
  std::vector<double> samples;
  for (std::int64_t l = 0; l < layers; ++l) {
    LayerCalibration layer;
    layer.layer = static_cast<int>(l);
    double depth = 0.0, t1 = 0.0, t2 = 0.0;
    std::vector<TrimodalFit> fits;
    for (std::int64_t p = 0; p < prompts; ++p) {
      samples.clear();
      const float* row = sparsity + (p * layers + l) * steps;
      for (std::int64_t s = 0; s < steps; ++s) {
        if (std::isnan(row[s])) continue;  // padding
        KVSIFT_CHECK(row[s] >= 0.0f && row[s] <= 1.0f, "calibrate_thresholds: sparsity[", p, ", ",
                     l, ", ", s, "] = ", row[s], " is outside [0, 1]");
        samples.push_back(row[s]);
      }
      if (static_cast<int>(samples.size()) < config.min_samples) continue;
      ++layer.prompts_with_data;
      const TrimodalFit fit = fit_trimodal(samples, config);
      if (!fit.trimodal) {
        if (example_reason.empty()) {
          example_reason = detail::concat("layer ", l, ", prompt ", p, ": ", fit.reason);
        }
        continue;
      }
      ++layer.prompts_trimodal;
      depth += fit.valley_depth;
      t1 += fit.theta1;
      t2 += fit.theta2;
    }
    if (layer.prompts_trimodal > 0) {
      layer.valley_depth = depth / layer.prompts_trimodal;
      layer.theta1 = t1 / layer.prompts_trimodal;
      layer.theta2 = t2 / layer.prompts_trimodal;
      layer.qualifies =
          layer.prompts_trimodal >= config.min_prompt_fraction * layer.prompts_with_data;
    }
    if (layer.qualifies) ++qualifying;
    result.per_layer.push_back(layer);
  }
  KVSIFT_CHECK(qualifying > 0,
               "calibrate_thresholds: no layer's sparsity distribution has exactly 3 ",
               "stable modes across ", prompts, " prompt(s) x ", layers,
               " layer(s), so thought thresholds cannot be placed",
               example_reason.empty() ? std::string(" (no (prompt, layer) had enough samples)")
                                      : " (e.g. " + example_reason + ")");
  std::vector<LayerCalibration> ranked;
  for (const auto& layer : result.per_layer) {
    if (layer.qualifies) ranked.push_back(layer);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.valley_depth > b.valley_depth;  // deepest first; equal depths keep layer order
  });
  for (std::size_t i = 0; i < ranked.size() && static_cast<int>(i) < config.top_layers; ++i) {
    result.layers.push_back(ranked[i].layer);
  }
  std::sort(result.layers.begin(), result.layers.end());
  // θ1, θ2: averaged over the trimodal (prompt, layer) pairs of L* only (§3.1), not over every
  // qualifying layer: the selected layers are the ones whose valleys are trusted.
  double sum1 = 0.0, sum2 = 0.0;
  std::int64_t pairs = 0;
  for (int l : result.layers) {
    const LayerCalibration& layer = result.per_layer[static_cast<std::size_t>(l)];
    sum1 += layer.theta1 * layer.prompts_trimodal;
    sum2 += layer.theta2 * layer.prompts_trimodal;
    pairs += layer.prompts_trimodal;
  }
  result.theta1 = sum1 / static_cast<double>(pairs);
  result.theta2 = sum2 / static_cast<double>(pairs);
  return result;
}

}  // namespace kvsift
