// SkipKV's eq. 6 score and its plan on the CPU (docs/algorithms.md §2.4): the R-KV score of
// backend/cpu/rkv_scores.hpp minus the redundant sentences' penalties, and the pad modes.
#pragma once

#include <cstdint>
#include <utility>

#include "kvsift/backend/cpu/rkv_scores.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/config/options.hpp"
#include "kvsift/config/sentence_scorer_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/segment_table.hpp"

namespace kvsift {

// The score the SkipKV reference gives a pad token (it replaces the pad's computed score).
inline constexpr float kFaithfulPadScore = 100.0f;

// Every intermediate of the eq. 6 score, [batch, kv_heads, capacity] each.
struct SentenceScores {
  cpu::ScoreTensor importance;       // a, count S_b − W
  cpu::ScoreTensor redundancy_full;  // R over all S_b tokens, count S_b
  cpu::ScoreTensor redundancy;       // R without the window, count S_b − W
  // λ·a − (1−λ)·R − Σ λ_i, count S_b − W. Faithful mode: pads hold kFaithfulPadScore. Exclude
  // mode: pads keep their computed value; the selection, not the score, leaves them out.
  cpu::ScoreTensor score;
};

namespace cpu {

// Eq. 6 scores of the sequences marked in `active` ([batch] or nullptr: all).
//   kv.keys    [batch, kv_heads, capacity, head_dim], post-RoPE; kv.valid_mask optional
//   queries    [batch, q_heads, window, head_dim]
//   penalties  [batch * kv_heads] lists of (lo, hi, λ) in cache slots, or empty
// A range counts only while lo < hi < S_b (add_sentence_penalty, as the reference tests it).
inline SentenceScores sentence_scores(const KVCacheView& kv, const TensorView& queries,
                                      const SentenceScorerConfig& cfg,
                                      const SentencePenalties& penalties,
                                      const std::uint8_t* active = nullptr) {
  cfg.validate();
  const std::int64_t batch = kv.batch(), heads = kv.kv_heads();
  KVSIFT_CHECK(penalties.empty() || static_cast<std::int64_t>(penalties.size()) == batch * heads,
               "sentence_scores: penalties has ", penalties.size(),
               " lists, expected 0 or batch * kv_heads = ", batch, " * ", heads);
  RKVScores r = rkv_scores(kv, queries, cfg.rkv, active);
  SentenceScores s{std::move(r.importance), std::move(r.redundancy_full), std::move(r.redundancy),
                   std::move(r.score)};
  for (std::int64_t b = 0; b < batch; ++b) {
    if (active != nullptr && !active[b]) continue;
    const std::int32_t n = s.score.count(b);
    for (std::int64_t h = 0; h < heads; ++h) {
      float* row = s.score.row(b, h);
      if (!penalties.empty()) add_sentence_penalty(row, n, kv.length(b), penalties[b * heads + h]);
      if (cfg.pad_mode == PadMode::faithful) {
        for (std::int32_t j = 0; j < n; ++j)
          if (!kv.is_valid(b, j)) row[j] = kFaithfulPadScore;
      }
    }
  }
  return s;
}

}  // namespace cpu

// The plan for eq. 6 scores (§1.3 selection): a sequence at or below the budget keeps
// everything; any other keeps its `budget − W` best scored tokens plus the last W, sorted.
//   faithful  pads compete with their +100 score, so they are kept first and count;
//   exclude   pads are never kept and the sequence keeps min(budget, real tokens).
// Throws kvsift::Error for NaN scores.
inline KeepPlan plan_sentence_scores(const KVCacheView& kv, const cpu::ScoreTensor& score,
                                     const SentenceScorerConfig& cfg) {
  cfg.validate();
  if (cfg.pad_mode == PadMode::exclude) return cpu::plan_from_scores(kv, &score, cfg.selection());
  // Faithful: selection blind to the mask, so pads are ordinary (top-scoring) candidates.
  KVCacheView unmasked = kv;
  unmasked.valid_mask = nullptr;
  return cpu::plan_from_scores(unmasked, &score, cfg.selection());
}

}  // namespace kvsift
