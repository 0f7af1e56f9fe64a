// SentenceScorer: SkipKV's eviction score (SkipKV eq. 6 as implemented, docs/algorithms.md §2.4)
//   S_t = λ·a_t − (1−λ)·R_t − Σ_{redundant sentences i mapped over t} λ_i
// with a, R the R-KV window importance and key redundancy (§1.1, §1.2, padding handled there),
// and the per-(sequence, KV head) top-(budget − W) selection plus the window of §1.3.
// Because λ_i ≥ τ ≈ 0.95 while token scores are ~1e-3, a redundant sentence still mapped in a
// head is evicted there before anything else, and whole.
//
// Left padding (batched decoding) has two modes:
//   faithful  the reference: pads score +100, so they are force-kept and eat budget (why batch
//             grouping, §2.6, helps);
//   exclude   the default (our choice, §2.4): pads are never kept and not counted, so a
//             compressed sequence keeps min(budget, real tokens) whatever the batch looks like.
// Both keep pads at the same positions in every head of a sequence, as compact() requires: in
// faithful mode every head scores every pad exactly 100 (far above any real score, which is
// below λ ≤ 1) and ties break by lower index, in exclude mode no head keeps any.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/config/options.hpp"
#include "kvsift/config/sentence_scorer_config.hpp"

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
  RKVScores r = rkv_scores(kv, queries, cfg.rkv_config(), active);
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

// The scorer object of DESIGN.md: configuration validated once, then score / plan per call.
class SentenceScorer {
 public:
  explicit SentenceScorer(const SentenceScorerConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  const SentenceScorerConfig& config() const { return cfg_; }

  // All intermediates, for every sequence in `active` ([batch] or nullptr: all).
  SentenceScores scores(const KVCacheView& kv, const TensorView& queries,
                        const SentencePenalties& penalties,
                        const std::uint8_t* active = nullptr) const {
    return cpu::sentence_scores(kv, queries, cfg_, penalties, active);
  }

  // Scores only the sequences over budget and plans; the others keep everything.
  //   kv.keys  [batch, kv_heads, capacity, head_dim];  queries [batch, q_heads, window, head_dim]
  KeepPlan select(const KVCacheView& kv, const TensorView& queries,
                  const SentencePenalties& penalties) const {
    kv.validate();
    const std::vector<std::uint8_t> over = cpu::sequences_over_budget(kv, cfg_.budget);
    bool any = false;
    for (std::uint8_t o : over) any = any || o != 0;
    if (!any) return KeepPlan::keep_all(kv);
    const SentenceScores s = scores(kv, queries, penalties, over.data());
    return plan_sentence_scores(kv, s.score, cfg_);
  }

 private:
  SentenceScorerConfig cfg_;
};

}  // namespace kvsift
