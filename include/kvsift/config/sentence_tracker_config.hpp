// SkipKV's sentence-tracking config (docs/algorithms.md §2.1-2.2): the token ids that split and
// label sentences, the hidden width and τ. Eigen-free; validate() is in src/sentence_tracker.cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace kvsift {

// The token ids that drive segmentation. SkipKV takes the *last* token id of each string.
struct SentenceTokens {
  std::vector<std::int32_t> delimiters;  // end a sentence: "\n" ".\n" ")\n" "\n\n" ".\n\n" ...
  std::vector<std::int32_t> keywords;    // make a sentence "check": "Alternatively" "Wait" "again"

  // DeepSeek-R1-Distill-Qwen (Qwen2 vocabulary); ids from shared/data/README.md.
  static SentenceTokens r1_qwen() {
    return {{198, 624, 340, 271, 382, 692, 1939}, {92014, 14190, 32771}};
  }
  // DeepSeek-R1-Distill-Llama-8B (Llama-3.1 vocabulary).
  static SentenceTokens r1_llama() {
    return {{198, 627, 340, 271, 382, 696, 1980}, {93114, 14524, 33871}};
  }

  // Non-empty delimiters, ids >= 0, and no id both a delimiter and a keyword (a token that ends
  // a sentence cannot also label the next one; the host's sets are wrong if they overlap).
  void validate() const;
};

struct SentenceTrackerConfig {
  SentenceTokens tokens = SentenceTokens::r1_qwen();
  // Width of the hidden states given per token (final-norm last-layer output). 0: segmentation
  // only, observe() takes no hidden states and triggers find no redundancy.
  std::int64_t hidden_size = 0;
  float tau = 0.95f;  // PSS threshold τ (docs/algorithms.md §4); marks need PSS > τ

  void validate() const;
};

}  // namespace kvsift
