// Top-k selection shared by the score-based policies (R-KV, SnapKV, H2O, StreamingLLM):
// docs/algorithms.md §1.3. Per (sequence, KV head), keep the `budget − window` highest scores before
// the window (ties: lower index first), plus the last `window` tokens; kept slots sorted ascending.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/config/scoring.hpp"

namespace kvsift {

namespace cpu {

// Slots to keep out of the n candidates [0, n) before the window: the first `sink` valid ones,
// then the `k` highest `scores` among the remaining valid ones (ties: lower index first), sorted
// ascending into `out`. `valid` [n] or nullptr; pads (valid == 0) are never kept. `scores` may be
// nullptr when k == 0.
inline void top_k_slots(const float* scores, std::int32_t n, const std::uint8_t* valid, int sink,
                        int k, std::vector<std::int32_t>& out) {
  out.clear();
  std::vector<std::int32_t> rest;
  for (std::int32_t j = 0; j < n; ++j) {
    if (valid != nullptr && !valid[j]) continue;
    if (static_cast<int>(out.size()) < sink) {
      out.push_back(j);
    } else {
      rest.push_back(j);
    }
  }
  const std::size_t take =
      std::min<std::size_t>(static_cast<std::size_t>(std::max(k, 0)), rest.size());
  if (take == 0) {
    rest.clear();
  } else if (take < rest.size()) {
    KVSIFT_CHECK(scores != nullptr, "top_k_slots: scores are required to choose ", take, " of ",
                 rest.size());
    auto higher = [scores](std::int32_t a, std::int32_t b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    };
    std::nth_element(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(take), rest.end(),
                     higher);
    rest.resize(take);
    std::sort(rest.begin(), rest.end());
  }
  out.insert(out.end(), rest.begin(), rest.end());
}

// Sequences to compress this step: [batch] 1 where S_b > budget. At S_b <= budget selection is a
// no-op (docs/algorithms.md §1.3), so those are neither scored nor compacted.
inline std::vector<std::uint8_t> sequences_over_budget(const KVCacheView& kv, int budget) {
  std::vector<std::uint8_t> over(static_cast<std::size_t>(kv.batch()));
  for (std::int64_t b = 0; b < kv.batch(); ++b) over[b] = kv.length(b) > budget ? 1 : 0;
  return over;
}

// The plan of a score-based policy. `scores` [batch, kv_heads, capacity] holds count(b) >= S_b −
// window candidates of every sequence over budget (nullptr: no scores, only sinks and window,
// StreamingLLM). A sequence at or below the budget keeps everything; any other keeps its sinks,
// the top `budget − window − sink` scored valid tokens and the last `window` tokens. With a
// padding mask pads are never kept when a sequence is compressed (the default of docs/algorithms.md
// §2.4, our choice for the baselines too: every head then agrees on the pads, and the budget
// counts real tokens); a sequence with at most `budget` real tokens keeps exactly those.
// Throws kvsift::Error for NaN scores, naming the position.
inline KeepPlan plan_from_scores(const KVCacheView& kv, const ScoreTensor* scores,
                                 const TopKSelection& sel) {
  sel.validate();
  const std::int64_t batch = kv.batch(), heads = kv.kv_heads();
  std::vector<std::int32_t> source(kv.lengths, kv.lengths + batch), kept(source);
  std::vector<std::vector<std::int32_t>> rows(static_cast<std::size_t>(batch * heads));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int32_t s = source[b];
    std::vector<std::int32_t>* first = nullptr;
    for (std::int64_t h = 0; h < heads; ++h) {
      std::vector<std::int32_t>& row = rows[b * heads + h];
      if (s <= sel.budget) {
        row.resize(s);
        for (std::int32_t j = 0; j < s; ++j) row[j] = j;
        continue;
      }
      const std::int32_t n = s - sel.window;
      const float* sc = nullptr;
      if (scores != nullptr) {
        KVSIFT_CHECK(
            scores->batch() == batch && scores->kv_heads() == heads && scores->count(b) >= n,
            "plan_from_scores: scores [", scores->batch(), ", ", scores->kv_heads(), "] with ",
            scores->count(b), " entries for sequence ", b, " do not cover [", batch, ", ", heads,
            "] x ", n, " candidates");
        sc = scores->row(b, h);
        for (std::int32_t j = 0; j < n; ++j)
          KVSIFT_CHECK(!std::isnan(sc[j]), "plan_from_scores: score is NaN at [", b, ", ", h, ", ",
                       j, "]");
      }
      const std::uint8_t* valid = kv.valid_mask ? kv.valid_mask + b * kv.capacity() : nullptr;
      if (valid != nullptr && std::count(valid, valid + s, std::uint8_t{0}) >= s - sel.budget) {
        // Pads are dropped, and without them the sequence fits the budget: keep every real token.
        row.clear();
        for (std::int32_t j = 0; j < s; ++j)
          if (valid[j]) row.push_back(j);
        continue;
      }
      top_k_slots(sc, n, valid, sel.sink, sel.budget - sel.window - sel.sink, row);
      for (std::int32_t j = n; j < s; ++j) row.push_back(j);
      if (first == nullptr) first = &row;
      KVSIFT_CHECK(row.size() == first->size(), "plan_from_scores: heads of sequence ", b,
                   " keep different counts (", first->size(), " vs ", row.size(), ")");
    }
    kept[b] = static_cast<std::int32_t>(rows[b * heads].size());
  }
  KeepPlan plan(batch, heads, kv.capacity(), source, kept, sel.window);
  for (const auto& row : rows) plan.append_row(row);
  return plan;
}

// The select() of a policy that scores and then plans with plan_from_scores (R-KV, SnapKV):
// validates the cache, and if no sequence is over `sel.budget` keeps everything without scoring
// (docs/algorithms.md §1.3: selection is then a no-op); otherwise `score(over)` scores the sequences
// marked in the [batch] mask `over` and returns a ScoreTensor [batch, kv_heads, capacity], from
// which the plan is made (the others keep everything).
template <class ScoreOverBudget>
KeepPlan select_scored_over_budget(const KVCacheView& kv, const TopKSelection& sel,
                                   ScoreOverBudget&& score) {
  kv.validate();
  const std::vector<std::uint8_t> over = sequences_over_budget(kv, sel.budget);
  if (std::find(over.begin(), over.end(), 1) == over.end()) return KeepPlan::keep_all(kv);
  const ScoreTensor scores = score(over.data());
  return plan_from_scores(kv, &scores, sel);
}

}  // namespace cpu
}  // namespace kvsift
