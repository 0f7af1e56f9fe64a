// RaaS's timestamp refresh and Quest page bounds on the GPU (docs/algorithms.md §5.4).
//
// Every kernel is one thread per output element with no cooperation between threads (no shared
// memory, no synchronisation, no atomics): each thread reads what it needs from global memory
// (neighbouring threads read the same score or neighbouring channels, which the caches serve) and
// writes only its own element.
//   - refresh (top half): thread (row, j) counts the units ranked above unit j under the CPU's
//     strict order (higher score first, the lower unit on equal scores) and stamps j when fewer
//     than ceil(n / 2) are: exactly the first ceil(n / 2) of std::partial_sort's order;
//   - key bounds: thread (row, page, channel) folds the page's tokens with std::min/std::max's
//     selection rules (coalesced across channels);
//   - page bounds: thread (row, page) runs cpu::raas::page_bounds's loops in its order.
// Compiled with -fmad=false (CMakeLists.txt), products pinned with __fmul_rn, sums __fadd_rn.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/raas_scoring.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    raas_refresh_kernel(const float* __restrict__ scores,        // [rows, pitch]
                        const std::int32_t* __restrict__ units,  // [batch]
                        std::int64_t kv_heads, std::int64_t pitch, bool top_half, float alpha,
                        std::int32_t t, std::int32_t* __restrict__ ts) {  // [rows, pitch]
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t row = blockIdx.y;
  const std::int64_t n = units[row / kv_heads];
  if (j >= n || n > pitch) return;  // units[b] > pitch is invalid input: nothing written
  const float* s = scores + row * pitch;
  const float sj = s[j];
  bool stamp;
  if (top_half) {
    const std::int64_t k = (n + 1) / 2;  // cpu::raas::top_half_count
    std::int64_t above = 0;
    for (std::int64_t i = 0; i < n && above < k; ++i) {
      const float si = s[i];
      above += (si != sj ? si > sj : i < j) ? 1 : 0;
    }
    stamp = above < k;
  } else {
    stamp = sj >= alpha;
  }
  if (stamp) ts[row * pitch + j] = t;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    raas_key_bounds_kernel(const T* __restrict__ keys,  // [rows, capacity, dim]
                           std::int64_t kv_heads, std::int64_t capacity, std::int64_t dim,
                           const std::int32_t* __restrict__ first,  // [batch]
                           const std::int32_t* __restrict__ count,  // [batch]
                           int page_size, std::int64_t max_pages,
                           float* __restrict__ kmin,    // [rows, max_pages, dim]
                           float* __restrict__ kmax) {  // [rows, max_pages, dim]
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t row = blockIdx.y;
  if (e >= max_pages * dim) return;
  const std::int64_t p = e / dim, c = e % dim, b = row / kv_heads;
  const std::int64_t n = count[b], f = first[b];
  if (p * page_size >= n) return;         // past the row's last page
  if (f < 0 || f + n > capacity) return;  // invalid input: nothing read or written
  const std::int64_t end = (p + 1) * page_size < n ? (p + 1) * page_size : n;
  const T* k = keys + (row * capacity + f) * dim + c;
  float lo = INFINITY, hi = -INFINITY;
  for (std::int64_t j = p * page_size; j < end; ++j) {
    const float x = to_float(k[j * dim]);
    lo = x < lo ? x : lo;  // std::min(lo, x)
    hi = hi < x ? x : hi;  // std::max(hi, x)
  }
  kmin[row * max_pages * dim + e] = lo;
  kmax[row * max_pages * dim + e] = hi;
}

__global__ void __launch_bounds__(kThreads)
    raas_page_bounds_kernel(const float* __restrict__ queries,  // [batch, q_heads, dim]
                            std::int64_t kv_heads, std::int64_t group, std::int64_t dim,
                            const float* __restrict__ kmin,          // [rows, max_pages, dim]
                            const float* __restrict__ kmax,          // [rows, max_pages, dim]
                            const std::int32_t* __restrict__ count,  // [batch]
                            int page_size, std::int64_t max_pages,
                            float* __restrict__ out) {  // [rows, max_pages]
  const std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t row = blockIdx.y;
  if (p >= max_pages) return;
  const std::int64_t b = row / kv_heads, h = row % kv_heads;
  if (p * page_size >= static_cast<std::int64_t>(count[b])) return;
  const float* lo = kmin + (row * max_pages + p) * dim;
  const float* hi = kmax + (row * max_pages + p) * dim;
  float best = -INFINITY;
  for (std::int64_t g = 0; g < group; ++g) {
    const float* q = queries + ((b * kv_heads + h) * group + g) * dim;
    float sum = 0.0f;
    for (std::int64_t c = 0; c < dim; ++c) {
      const float a = __fmul_rn(q[c], hi[c]), m = __fmul_rn(q[c], lo[c]);
      sum = __fadd_rn(sum, a < m ? m : a);  // std::max(q·kmax, q·kmin)
    }
    best = best < sum ? sum : best;  // std::max(best, sum)
  }
  out[row * max_pages + p] = best;
}

void check_rows(std::int64_t batch, std::int64_t kv_heads, const char* op) {
  KVSIFT_CHECK(batch >= 1 && kv_heads >= 1, op, ": batch (", batch, ") and kv_heads (", kv_heads,
               ") must be >= 1");
  KVSIFT_CHECK(batch * kv_heads <= 65535, op, ": batch · kv_heads (", batch * kv_heads,
               ") exceeds 65535 rows per launch");
}

unsigned blocks_for(std::int64_t n, const char* op) {
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  KVSIFT_CHECK(blocks >= 1 && blocks <= std::numeric_limits<int>::max(), op, ": ", n,
               " elements a row cannot be launched");
  return static_cast<unsigned>(blocks);
}

}  // namespace

void raas_refresh(const float* scores, const std::int32_t* units, std::int64_t batch,
                  std::int64_t kv_heads, std::int64_t pitch, RaasRefreshRule rule, float alpha,
                  std::int32_t t, std::int32_t* ts, cudaStream_t stream) {
  const char* op = "cuda::raas_refresh";
  check_rows(batch, kv_heads, op);
  KVSIFT_CHECK(pitch >= 1, op, ": pitch (", pitch, ") must be >= 1");
  KVSIFT_CHECK(scores != nullptr && units != nullptr && ts != nullptr, op,
               ": scores, units and ts must be non-null");
  KVSIFT_CHECK(rule == RaasRefreshRule::top_half || rule == RaasRefreshRule::alpha, op,
               ": unknown refresh rule ", static_cast<int>(rule));
  const dim3 grid(blocks_for(pitch, op), static_cast<unsigned>(batch * kv_heads));
  raas_refresh_kernel<<<grid, kThreads, 0, stream>>>(
      scores, units, kv_heads, pitch, rule == RaasRefreshRule::top_half, alpha, t, ts);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void raas_page_key_bounds(const TensorView& keys, const std::int32_t* first,
                          const std::int32_t* count, int page_size, std::int64_t max_pages,
                          float* kmin, float* kmax, cudaStream_t stream) {
  const char* op = "cuda::raas_page_key_bounds";
  keys.validate("cuda::raas_page_key_bounds keys");
  KVSIFT_CHECK(keys.device == Device::cuda && keys.data != nullptr, op,
               ": keys must be non-null device memory");
  KVSIFT_CHECK(keys.rank == 4 && keys.is_contiguous(), op,
               ": keys must be a contiguous [batch, kv_heads, capacity, dim] tensor, got shape ",
               keys.shape_string());
  const std::int64_t batch = keys.shape[0], kv_heads = keys.shape[1];
  const std::int64_t capacity = keys.shape[2], dim = keys.shape[3];
  check_rows(batch, kv_heads, op);
  KVSIFT_CHECK(capacity >= 1 && dim >= 1, op, ": keys shape ", keys.shape_string(),
               " must have capacity and dim >= 1");
  KVSIFT_CHECK(page_size >= 1, op, ": page_size (", page_size, ") must be >= 1");
  KVSIFT_CHECK(max_pages >= 1, op, ": max_pages (", max_pages, ") must be >= 1");
  KVSIFT_CHECK(first != nullptr && count != nullptr && kmin != nullptr && kmax != nullptr, op,
               ": first, count, kmin and kmax must be non-null");
  const dim3 grid(blocks_for(max_pages * dim, op), static_cast<unsigned>(batch * kv_heads));
  KVSIFT_DISPATCH_DTYPE(keys.dtype, T, [&] {
    raas_key_bounds_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(keys.data),
                                                             kv_heads, capacity, dim, first, count,
                                                             page_size, max_pages, kmin, kmax);
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void raas_page_bounds(const float* queries, std::int64_t batch, std::int64_t q_heads,
                      std::int64_t kv_heads, std::int64_t dim, const float* kmin, const float* kmax,
                      const std::int32_t* count, int page_size, std::int64_t max_pages, float* out,
                      cudaStream_t stream) {
  const char* op = "cuda::raas_page_bounds";
  check_rows(batch, kv_heads, op);
  KVSIFT_CHECK(q_heads >= kv_heads && q_heads % kv_heads == 0, op, ": q_heads (", q_heads,
               ") must be a multiple of kv_heads (", kv_heads, ")");
  KVSIFT_CHECK(dim >= 1, op, ": dim (", dim, ") must be >= 1");
  KVSIFT_CHECK(page_size >= 1, op, ": page_size (", page_size, ") must be >= 1");
  KVSIFT_CHECK(max_pages >= 1, op, ": max_pages (", max_pages, ") must be >= 1");
  KVSIFT_CHECK(queries != nullptr && kmin != nullptr && kmax != nullptr && count != nullptr &&
                   out != nullptr,
               op, ": queries, kmin, kmax, count and out must be non-null");
  const dim3 grid(blocks_for(max_pages, op), static_cast<unsigned>(batch * kv_heads));
  raas_page_bounds_kernel<<<grid, kThreads, 0, stream>>>(
      queries, kv_heads, q_heads / kv_heads, dim, kmin, kmax, count, page_size, max_pages, out);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvsift::cuda
