// ThinKVSchedule: the decisions of the ThinKV pipeline (docs/algorithms.md §3) for one sequence
// that never look at K/V — the thought classifier (§3.1), TBE's segments and demotions (§3.3),
// and the per-step bookkeeping of which layers already have their token and their new segment.
// Where the K/V live is the driver's business: ThinKV keeps them in host ThoughtBlockTables,
// cuda::DeviceThinKV in device tables. Both drive one schedule per sequence, so the two pipelines
// take the same decisions by construction.
//
// Per decode step the driver calls, for every layer, opens_segment() (open the table's segment
// with label() when true, then segment_opened()) and appended() once its token is written; then
// end_step(), whose EvictionStep lists the demotions to apply to every (layer, KV head).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "kvsift/config/thinkv_config.hpp"
#include "kvsift/config/thought_type.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/thinkv/segment_evictor.hpp"
#include "kvsift/policy/thinkv/thought_classifier.hpp"

namespace kvsift {

class ThinKVSchedule {
 public:
  // `config` must be valid (ThinKVConfig::validate()).
  explicit ThinKVSchedule(const ThinKVConfig& config)
      : num_layers_(config.num_layers),
        refresh_(config.refresh),
        evictor_config_(config.evictor_config()),
        classifier_(config.classifier_config()),
        appended_(static_cast<std::size_t>(config.num_layers), false),
        opened_(appended_) {}

  // --- decode start ----------------------------------------------------------------------------
  bool started() const { return evictor_.has_value(); }
  // TBE's bookkeeping begins with the prompt (every layer holds `prompt_length` tokens) as
  // segment 0.
  void start(std::int32_t prompt_length) { evictor_.emplace(evictor_config_, prompt_length); }

  // --- one decode step -------------------------------------------------------------------------
  // Whether `layer`'s token of this step opens a new segment (every `refresh` steps, once: a
  // retry after a failed write must not open it twice). Throws when the layer already has its
  // token for this step.
  bool opens_segment(int layer) const {
    KVSIFT_CHECK(!appended_[static_cast<std::size_t>(layer)], "ThinKV::append: layer ", layer,
                 " already has its token for step ", steps_, "; call end_step() first");
    return steps_ % refresh_ == 0 && !opened_[static_cast<std::size_t>(layer)];
  }
  void segment_opened(int layer) { opened_[static_cast<std::size_t>(layer)] = true; }
  void appended(int layer) { appended_[static_cast<std::size_t>(layer)] = true; }

  // Throws unless every layer has its token for this step.
  void check_complete() const {
    for (int l = 0; l < num_layers_; ++l) {
      KVSIFT_CHECK(appended_[static_cast<std::size_t>(l)], "ThinKV::end_step: layer ", l,
                   " has no token for step ", steps_, " (append every layer once per step)");
    }
  }

  // Closes the step: checks that every layer has its token, labels the step (throwing, with
  // nothing changed, when an L* layer was not observed), runs TBE and counts the step. The
  // returned changes are the driver's to apply to every (layer, KV head).
  EvictionStep end_step() {
    check_complete();
    return finish_step(classifier_.end_step());
  }
  // The same for a step whose sparsities the driver reports later
  // (ThoughtClassifier::end_step_deferred: not the step that closes a refresh interval). TBE's
  // decisions need only the label, which the step already has.
  EvictionStep end_step_deferred() {
    check_complete();
    return finish_step(classifier_.end_step_deferred());
  }
  // Whether the step now open closes a refresh interval (its sparsities cannot be deferred).
  bool closes_interval() const { return classifier_.closes_interval(); }

  // --- state -----------------------------------------------------------------------------------
  ThoughtClassifier& classifier() { return classifier_; }
  const ThoughtClassifier& classifier() const { return classifier_; }
  ThoughtType label() const { return classifier_.label(); }  // type of the next decode token
  std::int64_t steps() const { return steps_; }              // decode steps ended
  // TBE's segments; valid once started().
  const SegmentEvictor& evictor() const {
    KVSIFT_CHECK(started(), "ThinKV: decoding has not started");
    return *evictor_;
  }
  const EvictionCounter& eviction_counter() const { return counter_; }

 private:
  EvictionStep finish_step(ThoughtType step_label) {
    EvictionStep step = evictor_->append_token(step_label);
    counter_.record_step(step, num_layers_);
    appended_.assign(appended_.size(), false);
    opened_.assign(opened_.size(), false);
    ++steps_;
    return step;
  }

  int num_layers_;
  int refresh_;
  SegmentEvictorConfig evictor_config_;
  ThoughtClassifier classifier_;
  std::optional<SegmentEvictor> evictor_;  // created at the first decode append
  std::vector<bool> appended_;             // [num_layers] this step's token is in
  std::vector<bool> opened_;               // [num_layers] this step opened the layer's segment
  std::int64_t steps_ = 0;
  EvictionCounter counter_;
};

}  // namespace kvsift
