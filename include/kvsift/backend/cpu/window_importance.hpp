// Window attention importance (SnapKV / R-KV "attention" term), docs/algorithms.md §1.1: how much the
// last W queries attend to every earlier token, GQA-reduced on raw logits, softmaxed over the
// tokens before the window, reduced over the window and 1-d pooled.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/backend/cpu/fp32_rows.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "kvsift/config/options.hpp"
#include "kvsift/config/scoring.hpp"

namespace kvsift {

namespace cpu {

// The logit given to a left-pad key before the GQA reduction (docs/algorithms.md §1.1 step 5).
inline constexpr float kPadLogit = -1e9f;

namespace detail {

// In place pooling of x[0, n): kernel k, stride 1, padding k/2. Max pooling runs over the entries
// that exist (PyTorch's max_pool1d pads with -inf); average pooling divides by k at the edges too,
// as SnapKV's avg_pool1d does (count_include_pad=True, zero padding).
inline void pool1d(float* x, std::int64_t n, int kernel, Pooling pooling) {
  if (kernel == 1 || n == 0) return;
  const std::int64_t half = kernel / 2;
  std::vector<float> src(x, x + n);
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t lo = std::max<std::int64_t>(0, j - half);
    const std::int64_t hi = std::min<std::int64_t>(n - 1, j + half);
    if (pooling == Pooling::max) {
      x[j] = *std::max_element(src.begin() + lo, src.begin() + hi + 1);
    } else {
      float sum = 0.0f;
      for (std::int64_t i = lo; i <= hi; ++i) sum += src[i];
      x[j] = sum / static_cast<float>(kernel);
    }
  }
}

// One (b, h): `q` [G * W, D] the group's queries in (g, w) order, `k` [n, D] the keys before the
// window, `valid` [n] or nullptr. Writes a[0, n).
inline void importance_row(const RowMatrix& q, const RowMatrix& k, std::int64_t group,
                           std::int64_t window, const std::uint8_t* valid,
                           const WindowImportanceConfig& cfg, float* a) {
  const std::int64_t n = k.rows();
  if (n == 0) return;  // S == W: nothing before the window to score
  const float scale = 1.0f / std::sqrt(static_cast<float>(k.cols()));
  // [G * W, n] = Q Kᵀ / sqrt(D): one matrix product per KV head.
  RowMatrix logits = (q * k.transpose()) * scale;
  if (valid != nullptr) {
    for (std::int64_t j = 0; j < n; ++j)
      if (!valid[j]) logits.col(j).setConstant(kPadLogit);
  }
  Eigen::Map<Eigen::VectorXf> acc(a, n);
  acc.setZero();
  Eigen::RowVectorXf row(n);
  for (std::int64_t w = 0; w < window; ++w) {
    // GQA reduction over the group's heads g (rows g * W + w), before the softmax.
    row = logits.row(w);
    for (std::int64_t g = 1; g < group; ++g) {
      if (cfg.gqa == GqaReduce::max) {
        row = row.cwiseMax(logits.row(g * window + w));
      } else {
        row += logits.row(g * window + w);
      }
    }
    if (cfg.gqa == GqaReduce::mean) row /= static_cast<float>(group);
    const float m = row.maxCoeff();
    row = (row.array() - m).exp().matrix();
    row /= row.sum();
    acc += row.transpose();
  }
  if (cfg.reduction == WindowReduce::mean) acc /= static_cast<float>(window);
  pool1d(a, n, cfg.kernel, cfg.pooling);
}

template <class T>
void window_importance_impl(const KVCacheView& kv, const RowMatrix& queries, std::int64_t q_heads,
                            const WindowImportanceConfig& cfg, const std::uint8_t* active,
                            ScoreTensor& out) {
  const std::int64_t hkv = kv.kv_heads(), group = q_heads / hkv, w = cfg.window;
  RowMatrix k, q(group * w, kv.head_dim());
  for (std::int64_t b = 0; b < kv.batch(); ++b) {
    if (active != nullptr && !active[b]) continue;
    const std::int64_t n = kv.length(b) - w;
    const std::uint8_t* valid = kv.valid_mask ? kv.valid_mask + b * kv.capacity() : nullptr;
    for (std::int64_t h = 0; h < hkv; ++h) {
      load_rows<T>(kv.keys, b, h, n, "keys", k);
      // Rows of queries are in (b, q, w) order; the group of KV head h is q in [h*G, (h+1)*G).
      q = queries.middleRows((b * q_heads + h * group) * w, group * w);
      importance_row(q, k, group, w, valid, cfg, out.row(b, h));
    }
    out.set_count(b, static_cast<std::int32_t>(n));
  }
}

}  // namespace detail

// Window importance a[b, h, j] for j < S_b - W (docs/algorithms.md §1.1).
//   kv.keys   [batch, kv_heads, capacity, head_dim], post-RoPE, any storage dtype
//   queries   [batch, q_heads, window, head_dim], the last W decode queries (post-RoPE)
//   active    [batch] or nullptr: sequences to score (others get count 0), e.g. those over budget
// Returns [batch, kv_heads, capacity] with count(b) = S_b - W. Throws kvsift::Error for a shape
// mismatch, an active sequence shorter than the window, or a NaN/infinity in keys or queries.
inline ScoreTensor window_importance(const KVCacheView& kv, const TensorView& queries,
                                     const WindowImportanceConfig& cfg,
                                     const std::uint8_t* active = nullptr) {
  cfg.validate();
  kv.validate();
  check_window_queries(kv, queries, cfg.window);
  for (std::int64_t b = 0; b < kv.batch(); ++b) {
    if (active != nullptr && !active[b]) continue;
    KVSIFT_CHECK(kv.length(b) >= cfg.window, "window importance: window (", cfg.window,
                 ") exceeds length of sequence ", b, " (", kv.length(b), ")");
  }
  ScoreTensor out(kv.batch(), kv.kv_heads(), kv.capacity());
  const RowMatrix q = load_queries(queries);
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    detail::window_importance_impl<T>(kv, q, queries.shape[1], cfg, active, out);
  });
  return out;
}

}  // namespace cpu
}  // namespace kvsift
