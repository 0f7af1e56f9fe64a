// ThoughtClassifier: ThinKV's thought decomposition (docs/algorithms.md §3.1). Every decode step
// the engine reports the attention sparsity of the calibrated layers L*; their mean is the step's
// sparsity. Every `refresh` (τ = 128) steps the mean sparsity of the interval just finished labels
// the NEXT interval (our choice; the paper is ambiguous): s < θ1 → E, θ1 ≤ s < θ2 → R, s ≥ θ2 → T.
// Before the first refresh the label is R. One classifier per sequence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/config/thought_type.hpp"
#include "kvsift/core/error.hpp"

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
  // is the label of the next step (different only right after a refresh). Every deferred step
  // must be settled first.
  ThoughtType end_step() {
    KVSIFT_CHECK(pending_ == 0, "ThoughtClassifier: step ", steps_, " ends with ", pending_,
                 " deferred steps not settled (settle_step)");
    close_step_sums();
    const ThoughtType this_step = label_;
    ++steps_;
    if (steps_ % config_.refresh == 0) {
      last_interval_sparsity_ = static_cast<float>(interval_sum_ / config_.refresh);
      label_ = classify(last_interval_sparsity_);
      interval_sum_ = 0.0;
    }
    return this_step;
  }

  // --- deferred observation --------------------------------------------------------------------
  // For a driver that reads the sparsities asynchronously (cuda::DeviceThinKV): a step's label
  // is its interval's, which only the step closing the interval changes, so the other steps can
  // end before their sparsities are known. end_step_deferred() ends such a step (nothing may be
  // observed in it, and it must not close an interval); settle_step() reports the oldest deferred
  // step's sparsities later, in the order they were observed, with exactly the sums of
  // observe_layer + end_step. The closing step is observed and ended as usual, after every
  // deferred step is settled.
  ThoughtType end_step_deferred() {
    KVSIFT_CHECK(seen_.empty(), "ThoughtClassifier: step ", steps_,
                 " has observed layers; end it with end_step()");
    KVSIFT_CHECK(!closes_interval(), "ThoughtClassifier: step ", steps_,
                 " closes a refresh interval; observe it and end it with end_step()");
    ++pending_;
    ++steps_;
    return label_;
  }
  //   layers, sparsity  [n] the step's observations, in observation order
  // Throws, changing nothing, on a value outside [0, 1] (NaN included) or a layer set that
  // end_step would refuse.
  void settle_step(const int* layers, const float* sparsity, int n) {
    const std::int64_t step = steps_ - pending_;  // the oldest deferred step
    KVSIFT_CHECK(pending_ > 0, "ThoughtClassifier: settle_step without a deferred step");
    KVSIFT_CHECK(seen_.empty(), "ThoughtClassifier: settle_step while step ", steps_,
                 " has observed layers");
    std::vector<int> used;
    for (int i = 0; i < n; ++i) {
      KVSIFT_CHECK(sparsity[i] >= 0.0f && sparsity[i] <= 1.0f, "ThoughtClassifier: step ", step,
                   ": sparsity of layer ", layers[i], " is ", sparsity[i], ", outside [0, 1]");
      if (!uses_layer(layers[i])) continue;
      KVSIFT_CHECK(std::find(used.begin(), used.end(), layers[i]) == used.end(),
                   "ThoughtClassifier: layer ", layers[i], " reported twice in step ", step);
      used.push_back(layers[i]);
    }
    KVSIFT_CHECK(!used.empty() && (config_.layers.empty() || used.size() == config_.layers.size()),
                 "ThoughtClassifier: step ", step, " observed ", used.size(), " of the ",
                 config_.layers.size(), " calibrated layers");
    for (int i = 0; i < n; ++i) observe_layer(layers[i], sparsity[i]);
    close_step_sums();
    --pending_;
  }
  std::int64_t pending_steps() const { return pending_; }  // deferred, not yet settled
  // Whether the step now open closes a refresh interval (it cannot be deferred).
  bool closes_interval() const { return (steps_ + 1) % config_.refresh == 0; }

  ThoughtType label() const { return label_; }  // label of the next step's interval
  std::int64_t steps() const { return steps_; }
  float last_step_sparsity() const { return last_step_sparsity_; }
  // Mean sparsity of the last finished interval (NaN before the first refresh).
  float last_interval_sparsity() const { return last_interval_sparsity_; }

 private:
  // The step's mean over its observed layers into the interval's sum (end_step, settle_step).
  void close_step_sums() {
    KVSIFT_CHECK(!seen_.empty(), "ThoughtClassifier: step ", steps_,
                 " ended with no layer observed");
    KVSIFT_CHECK(config_.layers.empty() || seen_.size() == config_.layers.size(),
                 "ThoughtClassifier: step ", steps_, " observed ", seen_.size(), " of the ",
                 config_.layers.size(), " calibrated layers");
    last_step_sparsity_ = static_cast<float>(step_sum_ / static_cast<double>(seen_.size()));
    interval_sum_ += last_step_sparsity_;
    seen_.clear();
    step_sum_ = 0.0;
  }

  ThoughtClassifierConfig config_;
  ThoughtType label_ = ThoughtType::reasoning;
  std::int64_t steps_ = 0;
  std::vector<int> seen_;
  double step_sum_ = 0.0;
  double interval_sum_ = 0.0;
  float last_step_sparsity_ = std::numeric_limits<float>::quiet_NaN();
  float last_interval_sparsity_ = std::numeric_limits<float>::quiet_NaN();
  std::int64_t pending_ = 0;  // deferred steps not yet settled
};

}  // namespace kvsift
