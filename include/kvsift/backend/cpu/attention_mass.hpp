// Softmax attention mass that decode queries give each cached token: H2O's accumulated
// "heavy hitter" statistic (docs/algorithms.md §1.4) and SkipKV's last-query variant.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>

#include "kvsift/backend/cpu/fp32_rows.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/window_importance.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache_view.hpp"

namespace kvsift::cpu {

namespace detail {

// Softmax over [0, n) of one logit row in place; entries at and after `n` are zeroed.
inline void softmax_prefix(Eigen::Ref<Eigen::RowVectorXf> row, std::int64_t n) {
  if (n <= 0) {
    row.setZero();
    return;
  }
  auto head = row.head(n);
  head = (head.array() - head.maxCoeff()).exp().matrix();
  head /= head.sum();
  row.tail(row.size() - n).setZero();
}

// [G * steps, S] attention rows of one (b, h): query step t of `steps` sees slots
// j < S − (steps − 1 − t) (causal: the steps' own keys are the last cache entries); pads get
// kPadLogit.
template <class T>
RowMatrix step_attention(const KVCacheView& kv, const RowMatrix& queries, std::int64_t q_heads,
                         std::int64_t steps, std::int64_t b, std::int64_t h, RowMatrix& k) {
  const std::int64_t s = kv.length(b), group = q_heads / kv.kv_heads();
  load_rows<T>(kv.keys, b, h, s, "keys", k);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim()));
  RowMatrix p =
      (queries.middleRows((b * q_heads + h * group) * steps, group * steps) * k.transpose()) *
      scale;
  for (std::int64_t j = 0; j < s; ++j)
    if (!kv.is_valid(b, j)) p.col(j).setConstant(kPadLogit);
  for (std::int64_t r = 0; r < p.rows(); ++r) {
    const std::int64_t t = r % steps;
    softmax_prefix(p.row(r), s - (steps - 1 - t));
  }
  return p;
}

inline void check_step_queries(const KVCacheView& kv, const TensorView& queries) {
  kv.validate();
  KVSIFT_CHECK(queries.rank == 4 && queries.shape[2] >= 1,
               "step queries must be [batch, q_heads, steps >= 1, head_dim], got ",
               queries.shape_string());
  check_window_queries(kv, queries, queries.shape[2]);
  for (std::int64_t b = 0; b < kv.batch(); ++b)
    KVSIFT_CHECK(kv.length(b) >= queries.shape[2], "step queries: ", queries.shape[2],
                 " steps exceed length of sequence ", b, " (", kv.length(b), ")");
}

}  // namespace detail

// H2O: acc[b, h, j] += sum over the steps and the group's query heads of softmax attention to j.
//   queries [batch, q_heads, steps, head_dim], the last `steps` decode queries, whose own keys are
//           the last `steps` cache entries (one decode step: steps = 1)
//   acc     [batch, kv_heads, capacity], count(b) raised to S_b
inline void accumulate_attention(const KVCacheView& kv, const TensorView& queries,
                                 ScoreTensor& acc) {
  detail::check_step_queries(kv, queries);
  KVSIFT_CHECK(acc.batch() == kv.batch() && acc.kv_heads() == kv.kv_heads() &&
                   acc.capacity() == kv.capacity(),
               "accumulate_attention: accumulator [", acc.batch(), ", ", acc.kv_heads(), ", ",
               acc.capacity(), "] does not match the cache ", kv.keys.shape_string());
  const RowMatrix q = load_queries(queries);
  const std::int64_t steps = queries.shape[2];
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    RowMatrix k;
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      const std::int64_t s = kv.length(b);
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
        const RowMatrix p = detail::step_attention<T>(kv, q, queries.shape[1], steps, b, h, k);
        Eigen::Map<Eigen::RowVectorXf>(acc.row(b, h), s) += p.colwise().sum();
      }
      if (acc.count(b) < s) acc.set_count(b, static_cast<std::int32_t>(s));
    }
  });
}

// SkipKV's H2O variant: the attention of the last query row only, averaged over all query heads,
// one score vector per sequence copied into every KV head's row (so every head keeps the same
// set). Returns [batch, kv_heads, capacity] with count(b) = S_b.
inline ScoreTensor last_query_attention(const KVCacheView& kv, const TensorView& queries,
                                        const std::uint8_t* active = nullptr) {
  detail::check_step_queries(kv, queries);
  ScoreTensor out(kv.batch(), kv.kv_heads(), kv.capacity());
  const RowMatrix q = load_queries(queries);
  const std::int64_t steps = queries.shape[2], q_heads = queries.shape[1];
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    RowMatrix k;
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      if (active != nullptr && !active[b]) continue;
      const std::int64_t s = kv.length(b), group = q_heads / kv.kv_heads();
      Eigen::RowVectorXf mean = Eigen::RowVectorXf::Zero(s);
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
        const RowMatrix p = detail::step_attention<T>(kv, q, q_heads, steps, b, h, k);
        for (std::int64_t g = 0; g < group; ++g) mean += p.row(g * steps + steps - 1);
      }
      mean /= static_cast<float>(q_heads);
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h)
        Eigen::Map<Eigen::RowVectorXf>(out.row(b, h), s) = mean;
      out.set_count(b, static_cast<std::int32_t>(s));
    }
  });
  return out;
}

}  // namespace kvsift::cpu
