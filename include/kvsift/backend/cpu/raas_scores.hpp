// RaaS's per-step scoring math (docs/algorithms.md §5.4) on plain fp32 arrays, one cache row (one
// sequence, one KV head) at a time. Eigen-free host code: the RaaS policy
// (policy/baselines/raas.hpp) calls exactly these functions, and a device kernel is checked
// against them, so their signatures and arithmetic order are part of the contract:
//   - token mode: a unit is one token; its score is the max over the KV head's GQA group of the
//     softmax weight the step's query gives it (token_scores);
//   - page mode: a unit is a page of `page_size` consecutive tokens; its score is the max over the
//     group of Quest's upper bound on the query-key product, sum_c max(q_c * Kmax_c, q_c * Kmin_c)
//     over the page's elementwise key min/max (page_key_bounds, page_bounds). The bound is left
//     unscaled (no 1/sqrt(D)): only its order matters;
//   - each step the top half of the units by score, ceil(n / 2) of them (ties: the lower unit),
//     get timestamp t (refresh_top_half), or, in the absolute-alpha mode, every unit whose score
//     reaches alpha (refresh_above);
//   - an eviction removes the evictable unit with the oldest timestamp (ties: the lower unit)
//     (oldest_unit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace kvsift::cpu::raas {

// How many units the top-half refresh stamps among n: ceil(n / 2), so a single unit is stamped.
inline std::int64_t top_half_count(std::int64_t n) { return (n + 1) / 2; }

// Token mode. out[j] = max over g of softmax_j(q_g . k_j / sqrt(dim)), the softmax over the valid
// slots only; invalid slots (pads) get 0. fp32 throughout: logits as a dot product accumulated in
// index order, softmax with the row max subtracted.
//   q      [group, dim]  the step's queries of the KV head's group of query heads
//   keys   [n, dim]      the row's cached keys, slot order
//   valid  [n]           1 for a real token, 0 for a pad; nullptr: all valid
//   out    [n]
inline void token_scores(const float* q, int group, const float* keys, const std::uint8_t* valid,
                         std::int64_t n, int dim, float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  std::vector<float> logits(static_cast<std::size_t>(n));
  std::fill(out, out + n, 0.0f);
  for (int g = 0; g < group; ++g) {
    const float* qg = q + static_cast<std::int64_t>(g) * dim;
    float top = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = 0; j < n; ++j) {
      if (valid != nullptr && !valid[j]) continue;
      const float* kj = keys + j * dim;
      float dot = 0.0f;
      for (int c = 0; c < dim; ++c) dot += qg[c] * kj[c];
      logits[std::size_t(j)] = dot * scale;
      top = std::max(top, logits[std::size_t(j)]);
    }
    float sum = 0.0f;
    for (std::int64_t j = 0; j < n; ++j) {
      if (valid != nullptr && !valid[j]) continue;
      logits[std::size_t(j)] = std::exp(logits[std::size_t(j)] - top);
      sum += logits[std::size_t(j)];
    }
    for (std::int64_t j = 0; j < n; ++j) {
      if (valid != nullptr && !valid[j]) continue;
      out[j] = std::max(out[j], logits[std::size_t(j)] / sum);
    }
  }
}

// Page mode. The elementwise min and max of the keys of each page: page p covers tokens
// [p * page_size, min((p + 1) * page_size, n)), so the last page may be partial.
//   keys  [n, dim]      the tokens to page (all real: RaaS pages only decode tokens)
//   kmin  [pages, dim]  pages = ceil(n / page_size)
//   kmax  [pages, dim]
inline void page_key_bounds(const float* keys, std::int64_t n, int dim, int page_size, float* kmin,
                            float* kmax) {
  const std::int64_t pages = (n + page_size - 1) / page_size;
  for (std::int64_t p = 0; p < pages; ++p) {
    float* lo = kmin + p * dim;
    float* hi = kmax + p * dim;
    std::fill(lo, lo + dim, std::numeric_limits<float>::infinity());
    std::fill(hi, hi + dim, -std::numeric_limits<float>::infinity());
    const std::int64_t end = std::min(n, (p + 1) * page_size);
    for (std::int64_t j = p * page_size; j < end; ++j)
      for (int c = 0; c < dim; ++c) {
        lo[c] = std::min(lo[c], keys[j * dim + c]);
        hi[c] = std::max(hi[c], keys[j * dim + c]);
      }
  }
}

// Page mode. out[p] = max over g of sum_c max(q_gc * kmax_pc, q_gc * kmin_pc) (Quest's bound on
// q_g . k for every key k of page p), the sum accumulated in channel order.
//   q     [group, dim]
//   kmin  [pages, dim]
//   kmax  [pages, dim]
//   out   [pages]
inline void page_bounds(const float* q, int group, const float* kmin, const float* kmax,
                        std::int64_t pages, int dim, float* out) {
  for (std::int64_t p = 0; p < pages; ++p) {
    float best = -std::numeric_limits<float>::infinity();
    for (int g = 0; g < group; ++g) {
      const float* qg = q + static_cast<std::int64_t>(g) * dim;
      float sum = 0.0f;
      for (int c = 0; c < dim; ++c)
        sum += std::max(qg[c] * kmax[p * dim + c], qg[c] * kmin[p * dim + c]);
      best = std::max(best, sum);
    }
    out[p] = best;
  }
}

// The top-half refresh: the top_half_count(n) units with the highest scores (equal scores: the
// lower unit first) get ts = t. Returns how many were stamped.
//   scores  [n]
//   ts      [n]  updated in place
inline std::int64_t refresh_top_half(const float* scores, std::int64_t n, std::int32_t t,
                                     std::int32_t* ts) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  const std::int64_t k = top_half_count(n);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](std::int64_t a, std::int64_t b) {
                      return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
                    });
  for (std::int64_t i = 0; i < k; ++i) ts[order[std::size_t(i)]] = t;
  return k;
}

// The absolute-alpha refresh (token mode): every unit with score >= alpha gets ts = t. Returns
// how many were stamped.
//   scores  [n]
//   ts      [n]  updated in place
inline std::int64_t refresh_above(const float* scores, std::int64_t n, float alpha, std::int32_t t,
                                  std::int32_t* ts) {
  std::int64_t k = 0;
  for (std::int64_t j = 0; j < n; ++j)
    if (scores[j] >= alpha) ts[j] = t, ++k;
  return k;
}

// The unit an eviction removes: the evictable unit with the smallest timestamp, the lower unit on
// equal timestamps; -1 when none is evictable.
//   ts         [n]
//   evictable  [n]  1 where the unit may be evicted
inline std::int64_t oldest_unit(const std::int32_t* ts, const std::uint8_t* evictable,
                                std::int64_t n) {
  std::int64_t best = -1;
  for (std::int64_t j = 0; j < n; ++j)
    if (evictable[j] && (best < 0 || ts[j] < ts[best])) best = j;
  return best;
}

}  // namespace kvsift::cpu::raas
