// Offline calibration of ThinKV's thought thresholds θ1 < θ2 and calibrated layers L*
// (docs/algorithms.md §3.1) from per-step attention sparsities of calibration prompts. For every
// (prompt, layer): a Gaussian KDE on a grid over [0, 1]; the layer's KDE qualifies when it has
// exactly 3 modes over a stable bandwidth range; the density minima between adjacent modes are the
// thresholds. Implemented in src/sparsity_calibration.cpp; docs/thinkv.md explains the choices.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace kvsift {

// Resource bounds of calibrate_thresholds (docs/thinkv.md): one KDE evaluation costs
// grid_points² operations and a (prompt, layer) fit runs a few dozen of them, so the grid and the
// total work prompts · layers · grid_points² are capped (an error, not minutes of CPU; at the
// default grid of 512 the work cap allows 65,536 (prompt, layer) pairs).
inline constexpr int kMaxCalibrationGridPoints = 4096;
inline constexpr std::int64_t kMaxCalibrationWork = std::int64_t{1} << 34;

struct CalibrationConfig {
  int grid_points = 512;  // KDE evaluation points over [0, 1], in [16, kMaxCalibrationGridPoints]
  // "Stable": exactly 3 modes at the largest 3-mode bandwidth h3 AND at h3 / stability_ratio, i.e.
  // (modes only merge as the bandwidth grows) over the whole range [h3 / ratio, h3] (our choice).
  double stability_ratio = 1.5;
  // Both valleys must be at least this deep, relative to the lower neighbouring mode, at the
  // bandwidth the thresholds are read at: shallower dips are noise, not thought types (our choice).
  double min_valley_depth = 0.05;
  int top_layers = 4;                // |L*| (4 in the paper)
  double min_prompt_fraction = 0.5;  // a layer qualifies when trimodal on this share of prompts
  int min_samples = 16;              // fewer finite samples: the (prompt, layer) pair is skipped

  // Throws kvsift::Error naming the value.
  void validate() const;
};

// Silverman's rule of thumb: 0.9 · min(sd, IQR / 1.34) · n^(-1/5) (sd alone when IQR is 0).
double silverman_bandwidth(const std::vector<double>& samples);

// Gaussian KDE of `samples` at grid_points equally spaced points x_i = i / (grid_points - 1).
// Samples are linearly binned onto the grid first (the standard binned KDE), so one evaluation
// costs grid_points² operations whatever the sample count. Returns [grid_points] densities.
std::vector<double> binned_gaussian_kde(const std::vector<double>& samples, double bandwidth,
                                        int grid_points);

// Modes (local maxima, boundary maxima included) and the valleys between adjacent modes of a
// density sampled on a grid, as grid indices. Differences below 1e-7 of the peak are treated as
// flat, so floating-point ripples in the tails are not modes.
struct DensityShape {
  std::vector<int> modes;    // ascending
  std::vector<int> valleys;  // valleys[i] lies between modes[i] and modes[i + 1]: the minimum
};
DensityShape density_shape(const std::vector<double>& density);

// The trimodal analysis of one (prompt, layer).
struct TrimodalFit {
  bool trimodal = false;
  std::string reason;          // why not, when !trimodal
  double silverman = 0.0;      // h_S, the search's starting bandwidth
  double max_bandwidth = 0.0;  // h3: the largest bandwidth with >= 3 modes
  double bandwidth = 0.0;  // where the valleys are read: h_S if it gives 3 modes, else h3 / ratio
  double theta1 = std::numeric_limits<double>::quiet_NaN();  // the two valley locations
  double theta2 = std::numeric_limits<double>::quiet_NaN();
  double valley_depth = 0.0;  // the shallower valley's depth, relative to its lower mode
};
TrimodalFit fit_trimodal(const std::vector<double>& samples, const CalibrationConfig& config = {});

struct LayerCalibration {
  int layer = 0;
  int prompts_with_data = 0;  // prompts with at least min_samples finite samples
  int prompts_trimodal = 0;
  bool qualifies = false;
  double valley_depth = 0.0;  // mean over its trimodal prompts: the ranking key for L*
  double theta1 = std::numeric_limits<double>::quiet_NaN();  // means over its trimodal prompts
  double theta2 = std::numeric_limits<double>::quiet_NaN();
};

struct CalibrationResult {
  double theta1 = 0.0;  // averaged over the trimodal (prompt, layer) pairs of L* (§3.1)
  double theta2 = 0.0;
  std::vector<int> layers;  // L*: the qualifying layers with the deepest valleys, ascending
  std::vector<LayerCalibration> per_layer;  // [layers]
};

// sparsity: [prompts, layers, steps] per-step sparsities in [0, 1]; NaN marks padding (prompts
// generate different numbers of steps). Throws kvsift::Error when no layer qualifies (data
// without three modes), naming a representative reason, and for values outside [0, 1].
CalibrationResult calibrate_thresholds(const float* sparsity, std::int64_t prompts,
                                       std::int64_t layers, std::int64_t steps,
                                       const CalibrationConfig& config = {});

}  // namespace kvsift
