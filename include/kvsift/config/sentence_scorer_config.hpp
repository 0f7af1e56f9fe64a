// SkipKV's eviction-score config (docs/algorithms.md §2.4), shared by the CPU reference and the
// CUDA backend.
#pragma once

#include "kvsift/config/options.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

struct SentenceScorerConfig {
  int budget = 1024;        // tokens per (sequence, KV head) after a compression
  int window = 8;           // observation window W, always kept
  int kernel = 7;           // max-pooling kernel of the importance (odd)
  float mix_lambda = 0.1f;  // λ of λ·a − (1−λ)·R
  float threshold = 0.5f;   // key-redundancy cosine threshold
  RedundancyMode redundancy = RedundancyMode::sound;  // faithful: the reference's column-0 quirk
  GqaReduce gqa = GqaReduce::max;
  PadMode pad_mode = PadMode::exclude;
  // CUDA-backend option, passed on to RKVConfig::tensor_core_search (see there).
  bool tensor_core_search = true;

  void validate() const {
    KVSIFT_CHECK(window >= 1, "SentenceScorerConfig: window must be >= 1, got ", window);
    KVSIFT_CHECK(budget > window, "SentenceScorerConfig: budget (", budget,
                 ") must exceed window (", window, ")");
    KVSIFT_CHECK(mix_lambda >= 0.0f && mix_lambda <= 1.0f,
                 "SentenceScorerConfig: mix_lambda must be in [0, 1], got ", mix_lambda);
    rkv_config().validate();  // kernel, threshold
  }

  // The R-KV part of the score (§1.3) is computed by the R-KV scorer itself, not re-implemented.
  RKVConfig rkv_config() const {
    RKVConfig c;
    c.budget = budget;
    c.window = window;
    c.buffer = window;  // the trigger is not the scorer's business
    c.kernel = kernel;
    c.mix_lambda = mix_lambda;
    c.threshold = threshold;
    c.sink = 0;
    c.redundancy = redundancy;
    c.gqa = gqa;
    c.tensor_core_search = tensor_core_search;
    return c;
  }
  TopKSelection selection() const { return {budget, window, 0}; }
};

}  // namespace kvsift
