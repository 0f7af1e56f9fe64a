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

#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/backend/cpu/sentence_scores.hpp"
#include "kvsift/config/sentence_scorer_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/segment_table.hpp"

namespace kvsift {

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
    const std::vector<std::uint8_t> over = cpu::sequences_over_budget(kv, cfg_.rkv.budget);
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
