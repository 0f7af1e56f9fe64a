// ThoughtClassifier: ThinKV's thought decomposition (docs/algorithms.md §3.1). Every decode step the
// engine reports the attention sparsity of the calibrated layers L*; their mean is the step's
// sparsity. Every `refresh` (τ = 128) steps the mean sparsity of the interval just finished labels
// the NEXT interval (our choice; the paper is ambiguous): s < θ1 → E, θ1 ≤ s < θ2 → R, s ≥ θ2 → T.
// Before the first refresh the label is R. One classifier per sequence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/config/thought_type.hpp"

namespace kvsift {

struct ThoughtClassifierConfig {
  // Thresholds θ1 < θ2 in [0, 1]. They are model-specific and have no default: run
  // `kvsift calibrate` (calibrate_thresholds) and copy its output here.
  float theta1 = std::numeric_limits<float>::quiet_NaN();
  float theta2 = std::numeric_limits<float>::quiet_NaN();
  int refresh = 128;        // τ: decode steps per label (§4)
  std::vector<int> layers;  // L*: the calibrated layers; empty = average every layer observed

  void validate() const {
    KVSIFT_CHECK(theta1 >= 0.0f && theta1 <= 1.0f && theta2 >= 0.0f && theta2 <= 1.0f,
                 "ThoughtClassifierConfig: thresholds must lie in [0, 1], got theta1 = ", theta1,
                 ", theta2 = ", theta2, " (calibrate them with `kvsift calibrate`)");
    KVSIFT_CHECK(theta1 < theta2, "ThoughtClassifierConfig: theta1 (", theta1,
                 ") must be < theta2 (", theta2, ")");
    KVSIFT_CHECK(refresh > 0, "ThoughtClassifierConfig: refresh must be > 0, got ", refresh);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      KVSIFT_CHECK(layers[i] >= 0, "ThoughtClassifierConfig: layers[", i, "] = ", layers[i],
                   " is negative");
      for (std::size_t j = 0; j < i; ++j) {
        KVSIFT_CHECK(layers[j] != layers[i], "ThoughtClassifierConfig: layer ", layers[i],
                     " is listed twice");
      }
    }
  }
};

// The static rule of §3.1 (sparsity(T) > sparsity(R) > sparsity(E)).
inline ThoughtType classify_sparsity(float sparsity, float theta1, float theta2) {
  if (sparsity < theta1) return ThoughtType::execution;
  if (sparsity < theta2) return ThoughtType::reasoning;
  return ThoughtType::transition;
}

class ThoughtClassifier {
 public:
  explicit ThoughtClassifier(ThoughtClassifierConfig config) : config_(std::move(config)) {
    config_.validate();
  }

  const ThoughtClassifierConfig& config() const { return config_; }
  ThoughtType classify(float sparsity) const {
    return classify_sparsity(sparsity, config_.theta1, config_.theta2);
  }
  bool uses_layer(int layer) const {
    return config_.layers.empty() ||
           std::find(config_.layers.begin(), config_.layers.end(), layer) != config_.layers.end();
  }

  // Reports one layer's sparsity for the current step; layers outside L* are ignored. Returns
  // whether it was used.
  bool observe_layer(int layer, float sparsity) {
    KVSIFT_CHECK(sparsity >= 0.0f && sparsity <= 1.0f, "ThoughtClassifier: sparsity of layer ",
                 layer, " is ", sparsity, ", outside [0, 1]");
    if (!uses_layer(layer)) return false;
    KVSIFT_CHECK(std::find(seen_.begin(), seen_.end(), layer) == seen_.end(),
                 "ThoughtClassifier: layer ", layer, " reported twice in step ", steps_);
    seen_.push_back(layer);
    step_sum_ += sparsity;
    return true;
  }

  // Closes the step: its sparsity is the mean over the observed L* layers (all of L* must have
  // been reported). Returns the label of the interval this step belongs to; label() afterwards
  // is the label of the next step (different only right after a refresh).
  ThoughtType end_step() {
    KVSIFT_CHECK(!seen_.empty(), "ThoughtClassifier: step ", steps_,
                 " ended with no layer observed");
    KVSIFT_CHECK(config_.layers.empty() || seen_.size() == config_.layers.size(),
                 "ThoughtClassifier: step ", steps_, " observed ", seen_.size(), " of the ",
                 config_.layers.size(), " calibrated layers");
    last_step_sparsity_ = static_cast<float>(step_sum_ / static_cast<double>(seen_.size()));
    interval_sum_ += last_step_sparsity_;
    seen_.clear();
    step_sum_ = 0.0;
    const ThoughtType this_step = label_;
    ++steps_;
    if (steps_ % config_.refresh == 0) {
      last_interval_sparsity_ = static_cast<float>(interval_sum_ / config_.refresh);
      label_ = classify(last_interval_sparsity_);
      interval_sum_ = 0.0;
    }
    return this_step;
  }

  ThoughtType label() const { return label_; }  // label of the next step's interval
  std::int64_t steps() const { return steps_; }
  float last_step_sparsity() const { return last_step_sparsity_; }
  // Mean sparsity of the last finished interval (NaN before the first refresh).
  float last_interval_sparsity() const { return last_interval_sparsity_; }

 private:
  ThoughtClassifierConfig config_;
  ThoughtType label_ = ThoughtType::reasoning;
  std::int64_t steps_ = 0;
  std::vector<int> seen_;
  double step_sum_ = 0.0;
  double interval_sum_ = 0.0;
  float last_step_sparsity_ = std::numeric_limits<float>::quiet_NaN();
  float last_interval_sparsity_ = std::numeric_limits<float>::quiet_NaN();
};

}  // namespace kvsift
