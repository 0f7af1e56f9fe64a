// Key redundancy (R-KV), docs/algorithms.md §1.2: a token whose key is, on average, similar to many
// other keys is redundant. Column means of the key cosine matrix, after sparing each token's most
// recent near-duplicate, softmaxed over the sequence.
//
// Main path: the O(S·D) column-sum identity of the §1.2 cost note,
//   sum_i C[i,j] = (sum_i k̂_i)·k̂_j − k̂_j·k̂_j − sum_{i: r_i = j} k̂_i·k̂_j,
// with r_i (the last j with C[i,j] > threshold) found by a block search from the sequence end that
// drops every row as soon as its match is found. The S×S matrix is never stored.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cpu/fp32_rows.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/config/options.hpp"
#include "kvsift/config/scoring.hpp"

namespace kvsift {

namespace cpu {

namespace detail {

// Columns examined per block of the last-match search: large enough for an efficient matrix
// product, small enough that rows matched near the end stop early.
inline constexpr std::int64_t kRedundancySearchBlock = 128;

// r[i] = max{ j != i : k̂_i·k̂_j > threshold }, or -1 when row i has no match. `kn` [S, D] holds
// the normalized keys. Blocks of columns are visited from the end, so a row leaves the search at
// its first (i.e. last-positioned) match.
inline void last_matches(const RowMatrix& kn, float threshold, std::vector<std::int64_t>& r) {
  const std::int64_t s = kn.rows();
  r.assign(static_cast<std::size_t>(s), -1);
  // Rows still searching. A zero row (a zeroed pad key) has cosine exactly 0 with every key, so
  // with a threshold >= 0 it can never match: it skips the search instead of scanning all S.
  std::vector<std::int64_t> open;
  open.reserve(static_cast<std::size_t>(s));
  for (std::int64_t i = 0; i < s; ++i) {
    if (threshold < 0.0f || kn.row(i).squaredNorm() > 0.0f) open.push_back(i);
  }
  RowMatrix rows(static_cast<std::int64_t>(open.size()), kn.cols());  // [open.size(), D]
  for (std::size_t o = 0; o < open.size(); ++o) rows.row(o) = kn.row(open[o]);
  for (std::int64_t hi = s; hi > 0 && !open.empty(); hi -= kRedundancySearchBlock) {
    const std::int64_t lo = std::max<std::int64_t>(0, hi - kRedundancySearchBlock);
    const RowMatrix c = rows * kn.middleRows(lo, hi - lo).transpose();  // [open, hi - lo]
    std::vector<std::int64_t> still_open;
    still_open.reserve(open.size());
    for (std::size_t o = 0; o < open.size(); ++o) {
      const std::int64_t i = open[o];
      for (std::int64_t j = hi - 1; j >= lo; --j) {
        if (j != i && c(static_cast<std::int64_t>(o), j - lo) > threshold) {
          r[i] = j;
          break;
        }
      }
      if (r[i] < 0) still_open.push_back(i);
    }
    if (still_open.size() != open.size()) {
      RowMatrix kept(static_cast<std::int64_t>(still_open.size()), kn.cols());
      for (std::size_t o = 0; o < still_open.size(); ++o) kept.row(o) = kn.row(still_open[o]);
      rows.swap(kept);
      open.swap(still_open);
    }
  }
}

// One (b, h): `k` [S, D] raw keys (pads already zeroed). Writes R[0, S) = softmax(rbar).
inline void redundancy_row(RowMatrix& k, const KeyRedundancyConfig& cfg, float* out) {
  const std::int64_t s = k.rows();
  if (s == 0) return;
  // Step 1: k̂ = K / (||K|| + 1e-8); a zeroed pad key stays zero.
  const Eigen::VectorXf norms = k.rowwise().norm();
  for (std::int64_t i = 0; i < s; ++i) k.row(i) /= norms[i] + 1e-8f;
  std::vector<std::int64_t> r;
  last_matches(k, cfg.threshold, r);
  // Step 2-4 via the column-sum identity: total·k̂_j, minus the diagonal, minus spared entries.
  const Eigen::RowVectorXf total = k.colwise().sum();
  Eigen::VectorXf colsum = k * total.transpose();
  colsum -= k.rowwise().squaredNorm();
  for (std::int64_t i = 0; i < s; ++i) {
    if (r[i] >= 0) {
      colsum[r[i]] -= k.row(i).dot(k.row(r[i]));
    } else if (cfg.mode == RedundancyMode::faithful && i != 0) {
      // The reference's fallback r_i = 0 zeroes C[i, 0] (C[0, 0] is the diagonal, already 0).
      colsum[0] -= k.row(i).dot(k.row(0));
    }
  }
  // Step 4-5: rbar = column mean over all S rows, R = softmax(rbar).
  Eigen::Map<Eigen::VectorXf> rr(out, s);
  rr = colsum / static_cast<float>(s);
  rr = (rr.array() - rr.maxCoeff()).exp().matrix();
  rr /= rr.sum();
}

template <class T>
void redundancy_full_impl(const KVCacheView& kv, const KeyRedundancyConfig& cfg,
                          const std::uint8_t* active, ScoreTensor& out) {
  RowMatrix k;
  for (std::int64_t b = 0; b < kv.batch(); ++b) {
    if (active != nullptr && !active[b]) continue;
    const std::int64_t s = kv.length(b);
    for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
      load_rows<T>(kv.keys, b, h, s, "keys", k);
      // Step 6: pad keys are zeroed before normalization, so their cosines are 0.
      for (std::int64_t j = 0; j < s; ++j)
        if (!kv.is_valid(b, j)) k.row(j).setZero();
      redundancy_row(k, cfg, out.row(b, h));
    }
    out.set_count(b, static_cast<std::int32_t>(s));
  }
}

}  // namespace detail

// Redundancy over all S_b tokens, R[b, h, j] = softmax_j(rbar) for j < S_b (window included).
//   kv.keys  [batch, kv_heads, capacity, head_dim], any storage dtype
//   active   [batch] or nullptr: sequences to score (others get count 0)
// Throws kvsift::Error for NaN/infinite keys.
inline ScoreTensor redundancy_full(const KVCacheView& kv, const KeyRedundancyConfig& cfg,
                                   const std::uint8_t* active = nullptr) {
  cfg.validate();
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cpu, "CPU scorer: keys must be in host memory");
  ScoreTensor out(kv.batch(), kv.kv_heads(), kv.capacity());
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T,
                        [&] { detail::redundancy_full_impl<T>(kv, cfg, active, out); });
  return out;
}

// Drops the last `window` entries of every scored sequence of a full-length score: the §1.2 step
// 5 slice (the softmax is over all S and is not renormalized, as in the reference).
inline ScoreTensor slice_window(ScoreTensor full, int window) {
  KVSIFT_CHECK(window >= 0, "slice_window: window must be >= 0, got ", window);
  for (std::int64_t b = 0; b < full.batch(); ++b) {
    const std::int32_t s = full.count(b);
    if (s == 0) continue;  // not scored
    KVSIFT_CHECK(s >= window, "key redundancy: window (", window, ") exceeds length of sequence ",
                 b, " (", s, ")");
    for (std::int64_t h = 0; h < full.kv_heads(); ++h)
      std::fill(full.row(b, h) + (s - window), full.row(b, h) + s, 0.0f);
    full.set_count(b, s - window);
  }
  return full;
}

// The window-sliced redundancy R[b, h, j], j < S_b - W (docs/algorithms.md §1.2 step 5).
inline ScoreTensor key_redundancy(const KVCacheView& kv, const KeyRedundancyConfig& cfg, int window,
                                  const std::uint8_t* active = nullptr) {
  return slice_window(redundancy_full(kv, cfg, active), window);
}

}  // namespace cpu
}  // namespace kvsift
