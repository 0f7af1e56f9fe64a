// Attention sparsity of one decode step (ThinKV, docs/algorithms.md §3.1): the fraction of keys whose
// softmax weight is below 1% of the row's largest, i.e. logit_j < max_logit + ln(0.01). Computed
// from the step's queries and the cache (q·k / sqrt(D), GQA: query head q reads KV head q / G), or
// from an attention row the engine already has. Averaged over query heads; the average over the
// calibrated layers is the ThoughtClassifier's job.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

// A key is "sparse" when its weight is below this fraction of the row's largest weight (§3.1).
inline constexpr float kSparsityRatio = 0.01f;

// Sparsity of a row of attention probabilities: count(p_j < 0.01 · max p) / n.
// probs: [n] (any non-negative weights: the ratio test does not need them normalised).
inline float sparsity_from_probabilities(const float* probs, std::int64_t n) {
  KVSIFT_CHECK(n > 0 && probs != nullptr, "sparsity_from_probabilities: empty row (n=", n, ")");
  float max_p = 0.0f;
  for (std::int64_t j = 0; j < n; ++j) {
    KVSIFT_CHECK(std::isfinite(probs[j]) && probs[j] >= 0.0f,
                 "sparsity_from_probabilities: ", "probs[", j, "] = ", probs[j],
                 " is not a finite non-negative weight");
    max_p = std::fmax(max_p, probs[j]);
  }
  KVSIFT_CHECK(max_p > 0.0f, "sparsity_from_probabilities: every weight of the row is 0");
  const float cut = kSparsityRatio * max_p;
  std::int64_t sparse = 0;
  for (std::int64_t j = 0; j < n; ++j) sparse += probs[j] < cut ? 1 : 0;
  return static_cast<float>(sparse) / static_cast<float>(n);
}

// The same test in logit space: count(logit_j < max_logit + ln 0.01) / n. logits: [n].
inline float sparsity_from_logits(const float* logits, std::int64_t n) {
  KVSIFT_CHECK(n > 0 && logits != nullptr, "sparsity_from_logits: empty row (n=", n, ")");
  float max_l = -INFINITY;
  for (std::int64_t j = 0; j < n; ++j) {
    KVSIFT_CHECK(!std::isnan(logits[j]), "sparsity_from_logits: logits[", j, "] is NaN");
    max_l = std::fmax(max_l, logits[j]);
  }
  KVSIFT_CHECK(std::isfinite(max_l), "sparsity_from_logits: the largest logit is ", max_l);
  const float cut = max_l + std::log(kSparsityRatio);
  std::int64_t sparse = 0;
  for (std::int64_t j = 0; j < n; ++j) sparse += logits[j] < cut ? 1 : 0;
  return static_cast<float>(sparse) / static_cast<float>(n);
}

namespace detail {
template <class QT, class KT>
float mean_head_sparsity(const KVCacheView& kv, const TensorView& queries, std::int64_t b,
                         std::int64_t query_row) {
  const std::int64_t q_heads = queries.shape[1], dim = kv.head_dim();
  const std::int64_t group = q_heads / kv.kv_heads();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  std::vector<float> logits;
  std::vector<float> q(dim);
  double total = 0.0;
  for (std::int64_t qh = 0; qh < q_heads; ++qh) {
    const QT* qp = queries.rank == 4 ? queries.ptr<QT>(b, qh, query_row) : queries.ptr<QT>(b, qh);
    for (std::int64_t d = 0; d < dim; ++d) q[d] = to_float(qp[d]);
    const std::int64_t h = qh / group;
    logits.clear();
    for (std::int32_t j = 0; j < kv.length(b); ++j) {
      if (!kv.is_valid(b, j)) continue;  // left pads are not keys of this sequence
      const KT* kp = kv.keys.ptr<KT>(b, h, j);
      float dot = 0.0f;
      for (std::int64_t d = 0; d < dim; ++d) dot += q[d] * to_float(kp[d]);
      logits.push_back(dot * scale);
    }
    KVSIFT_CHECK(!logits.empty(), "attention_sparsity: sequence ", b, " has no valid keys");
    total += sparsity_from_logits(logits.data(), static_cast<std::int64_t>(logits.size()));
  }
  return static_cast<float>(total / static_cast<double>(q_heads));
}
}  // namespace detail

// Per-sequence sparsity of one layer at one decode step, averaged over query heads.
// kv: the layer's cache (host memory); queries: [batch, q_heads, head_dim] the step's post-RoPE
// queries, or [batch, q_heads, W, head_dim] of which the last row (the newest query) is used.
// Returns [batch].
inline std::vector<float> attention_sparsity(const KVCacheView& kv, const TensorView& queries) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cpu && queries.device == Device::cpu,
               "attention_sparsity: this is the CPU reference; cache and queries must be in host "
               "memory");
  KVSIFT_CHECK(queries.data != nullptr && (queries.rank == 3 || queries.rank == 4),
               "attention_sparsity: queries must be [batch, q_heads, head_dim] or [batch, q_heads, "
               "W, head_dim], got rank ",
               queries.rank);
  const int dim_axis = queries.rank - 1;
  KVSIFT_CHECK(queries.shape[0] == kv.batch() && queries.shape[dim_axis] == kv.head_dim(),
               "attention_sparsity: queries ", queries.shape_string(), " do not match the cache ",
               kv.keys.shape_string());
  KVSIFT_CHECK(queries.stride[dim_axis] == 1, "attention_sparsity: queries' head_dim must be ",
               "contiguous, got stride ", queries.stride[dim_axis]);
  const std::int64_t q_heads = queries.shape[1];
  KVSIFT_CHECK(q_heads > 0 && q_heads % kv.kv_heads() == 0, "attention_sparsity: q_heads (",
               q_heads, ") must be a positive multiple of kv_heads (", kv.kv_heads(), ")");
  KVSIFT_CHECK(queries.rank == 3 || queries.shape[2] > 0,
               "attention_sparsity: the query window is empty");
  const std::int64_t query_row = queries.rank == 4 ? queries.shape[2] - 1 : 0;
  std::vector<float> out(kv.batch());
  KVSIFT_DISPATCH_DTYPE(queries.dtype, QT, [&] {
    KVSIFT_DISPATCH_DTYPE(kv.dtype(), KT, [&] {
      for (std::int64_t b = 0; b < kv.batch(); ++b) {
        out[b] = detail::mean_head_sparsity<QT, KT>(kv, queries, b, query_row);
      }
    });
  });
  return out;
}

// Per-sequence sparsity from attention rows the engine computed: probs [batch, q_heads, seq] f32
// in host memory; sequence b uses its first lengths[b] entries ([batch]); valid_mask
// [batch, seq] (optional, 1 = real token) drops left pads. Returns [batch].
inline std::vector<float> attention_sparsity_from_probabilities(
    const TensorView& probs, const std::int32_t* lengths,
    const std::uint8_t* valid_mask = nullptr) {
  KVSIFT_CHECK(probs.data != nullptr && probs.rank == 3 && probs.dtype == DType::f32 &&
                   probs.device == Device::cpu,
               "attention_sparsity_from_probabilities: probs must be host f32 [batch, q_heads, "
               "seq], got rank ",
               probs.rank, " dtype ", dtype_name(probs.dtype));
  KVSIFT_CHECK(lengths != nullptr, "attention_sparsity_from_probabilities: lengths must be set");
  const std::int64_t batch = probs.shape[0], q_heads = probs.shape[1], seq = probs.shape[2];
  KVSIFT_CHECK(q_heads > 0, "attention_sparsity_from_probabilities: q_heads is 0");
  std::vector<float> out(batch), row;
  for (std::int64_t b = 0; b < batch; ++b) {
    KVSIFT_CHECK(lengths[b] > 0 && lengths[b] <= seq,
                 "attention_sparsity_from_probabilities: ", "lengths[", b, "] = ", lengths[b],
                 " outside [1, seq = ", seq, "]");
    double total = 0.0;
    for (std::int64_t qh = 0; qh < q_heads; ++qh) {
      row.clear();
      for (std::int32_t j = 0; j < lengths[b]; ++j) {
        if (valid_mask == nullptr || valid_mask[b * seq + j] != 0) {
          row.push_back(*probs.ptr<float>(b, qh, j));
        }
      }
      total += sparsity_from_probabilities(row.data(), static_cast<std::int64_t>(row.size()));
    }
    out[b] = static_cast<float>(total / static_cast<double>(q_heads));
  }
  return out;
}

}  // namespace kvsift
