// SkipKV's config (docs/algorithms.md §2, defaults §4): the eviction score's config, the trigger's
// buffer, the sentence tracker's config and steering, each embedded rather than re-declared.
// Eigen-free.
#pragma once

#include <cstdint>

#include "kvsift/config/sentence_scorer_config.hpp"
#include "kvsift/config/sentence_tracker_config.hpp"
#include "kvsift/config/steering_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/limits.hpp"

namespace kvsift {

struct SkipKVConfig {
  // Sequences (one SentenceTracker each). 0: as many as observe() / add_padding() name before
  // the first select() (for hosts that create the policy by name, before the batch is known).
  std::int64_t batch = 1;
  std::int64_t layers = 0;    // decoder layers; 0: any layer index >= 0 is accepted
  std::int64_t kv_heads = 0;  // KV heads per layer; 0: taken from the first cache seen
  // Eviction (§2.4): the R-KV knobs (budget, window, buffer = the trigger, kernel, λ, threshold,
  // redundancy, GQA) in scorer.rkv, and the pad mode.
  SentenceScorerConfig scorer;
  // Sentences (§2.1-2.2): delimiter and keyword ids, hidden_size (0: no embeddings), τ.
  SentenceTrackerConfig sentences;
  // Steering (§2.5): α0, γ, the steered layer and the gate's token ids.
  SteeringConfig steering;

  void validate() const {
    KVSIFT_CHECK(batch >= 0,
                 "SkipKVConfig: batch must be >= 0 (0: from the sequences observed), got ", batch);
    KVSIFT_CHECK(layers >= 0 && layers <= kMaxLayers, "SkipKVConfig: layers must be in [0, ",
                 kMaxLayers, "] (0: any), got ", layers);
    KVSIFT_CHECK(kv_heads >= 0, "SkipKVConfig: kv_heads must be >= 0 (0: from the cache), got ",
                 kv_heads);
    scorer.validate();
    sentences.validate();
    steering.validate();
  }
};

}  // namespace kvsift
