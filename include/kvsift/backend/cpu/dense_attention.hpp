// Exact decode attention of one KV head's query group over dense K/V rows: softmax(q·Kᵀ/√D)·V,
// fp32 in and out, double accumulation. The reference the quantizers' attention() uses
// (docs/algorithms.md §5.1–5.2): they dequantize a KV head's tokens once and attend with every
// query head of its GQA group. No Eigen, host code.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift {

// n == 0 gives zero outputs (nothing to attend to).
inline void dense_decode_attention(const float* queries,  // [group, head_dim]
                                   std::int64_t group,
                                   const float* keys,    // [n, head_dim]
                                   const float* values,  // [n, head_dim]
                                   std::int64_t n, std::int64_t head_dim,
                                   float* out) {  // [group, head_dim]
  KVSIFT_CHECK(group >= 1 && head_dim >= 1 && n >= 0, "dense_decode_attention: group (", group,
               ") and head_dim (", head_dim, ") must be >= 1 and n (", n, ") >= 0");
  const double root = std::sqrt(static_cast<double>(head_dim));
  std::vector<double> score(static_cast<std::size_t>(n));
  for (std::int64_t g = 0; g < group; ++g) {
    const float* q = queries + g * head_dim;
    float* o = out + g * head_dim;
    double mx = -INFINITY;
    for (std::int64_t t = 0; t < n; ++t) {
      double acc = 0.0;
      for (std::int64_t d = 0; d < head_dim; ++d) acc += double(q[d]) * keys[t * head_dim + d];
      score[t] = acc / root;
      mx = std::fmax(mx, score[t]);
    }
    double z = 0.0;
    for (double& x : score) z += (x = std::exp(x - mx));
    for (std::int64_t d = 0; d < head_dim; ++d) {
      double acc = 0.0;
      for (std::int64_t t = 0; t < n; ++t) acc += score[t] * values[t * head_dim + d];
      o[d] = n > 0 ? static_cast<float>(acc / z) : 0.0f;
    }
  }
}

}  // namespace kvsift
