// Staging of stored rows (f32 / f16 / bf16) into fp32 Eigen matrices: every CPU scorer does its
// math in fp32 (docs/algorithms.md, notation), so this is the one place where storage formats meet it.
// Non-finite inputs are rejected here, with the tensor's name and the element's coordinates.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <string>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cpu {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Copies rows [0, n) of head (b, h) of a 4-d view with T storage into `out` ([n, head_dim], fp32).
// `what` names the tensor in the error raised for a NaN or infinity.
template <class T>
void load_rows(const TensorView& t, std::int64_t b, std::int64_t h, std::int64_t n,
               const char* what, RowMatrix& out) {
  const std::int64_t d = t.shape[3];
  out.resize(n, d);
  for (std::int64_t j = 0; j < n; ++j) {
    const T* src = t.ptr<T>(b, h, j);
    float* dst = out.data() + j * d;
    for (std::int64_t k = 0; k < d; ++k) {
      const float x = to_float(src[k]);
      KVSIFT_CHECK(std::isfinite(x), what, " contain a non-finite value (", x, ") at [", b, ", ", h,
                   ", ", j, ", ", k, "]");
      dst[k] = x;
    }
  }
}

// Queries [batch, q_heads, window, head_dim] of any dtype and strides, as fp32
// [batch * q_heads * window, head_dim] rows in (b, q, w) order.
inline RowMatrix load_queries(const TensorView& q) {
  RowMatrix out(q.shape[0] * q.shape[1] * q.shape[2], q.shape[3]);
  KVSIFT_DISPATCH_DTYPE(q.dtype, T, [&] {
    std::int64_t r = 0;
    for (std::int64_t b = 0; b < q.shape[0]; ++b)
      for (std::int64_t h = 0; h < q.shape[1]; ++h)
        for (std::int64_t w = 0; w < q.shape[2]; ++w, ++r)
          for (std::int64_t k = 0; k < q.shape[3]; ++k) {
            const float x = to_float(q.ptr<T>(b, h, w)[k * q.stride[3]]);
            KVSIFT_CHECK(std::isfinite(x), "queries contain a non-finite value (", x, ") at [", b,
                         ", ", h, ", ", w, ", ", k, "]");
            out(r, k) = x;
          }
  });
  return out;
}

// Checks that `queries` ([batch, q_heads, window, head_dim]) fits the cache: host memory, same
// batch and head_dim, q_heads a multiple of kv_heads, `window` rows.
inline void check_window_queries(const KVCacheView& kv, const TensorView& queries,
                                 std::int64_t window) {
  KVSIFT_CHECK(kv.device() == Device::cpu && queries.device == Device::cpu,
               "CPU scorer: keys and queries must be in host memory");
  KVSIFT_CHECK(queries.data != nullptr, "queries: no data (null pointer)");
  KVSIFT_CHECK(queries.rank == 4, "queries must be [batch, q_heads, window, head_dim], got rank ",
               queries.rank);
  KVSIFT_CHECK(queries.shape[0] == kv.batch(), "queries batch (", queries.shape[0],
               ") != keys batch (", kv.batch(), ")");
  KVSIFT_CHECK(queries.shape[3] == kv.head_dim(), "queries head_dim (", queries.shape[3],
               ") != keys head_dim (", kv.head_dim(), ")");
  KVSIFT_CHECK(queries.shape[1] > 0 && queries.shape[1] % kv.kv_heads() == 0, "queries q_heads (",
               queries.shape[1], ") must be a positive multiple of kv_heads (", kv.kv_heads(), ")");
  KVSIFT_CHECK(queries.shape[2] == window, "queries hold ", queries.shape[2],
               " window rows, config window is ", window);
}

}  // namespace kvsift::cpu
