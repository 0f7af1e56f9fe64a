// kvsift::cuda::kmeans_select: ThinKV's deterministic k-means token selection (docs/algorithms.md §3.3,
// rules in backend/cpu/kmeans_select.hpp) for many problems at once, one thread block per problem: a
// problem is one segment of one (layer, KV head), n <= 128 keys of head_dim <= 256, K <= 64.
//
// Same indices as kvsift::kmeans_select on the keys widened to fp32. Every floating-point value
// the CPU reference compares is computed here with the same operations in the same order:
// squared distances summed over head_dim in index order with separately rounded products and sums
// (no FMA), cluster sums accumulated over points in index order, centroids divided with IEEE
// division, and every argmin/argmax resolving ties to the lower index. The one documented
// difference: the CPU reference throws on a non-finite key; here that problem's output row is
// filled with kNonFiniteKeySlot. Results also match only while no sum overflows fp32 (|key| well
// below 1e18), which real post-RoPE keys never approach.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/backend/cpu/kmeans_select.hpp"

namespace kvsift::cuda {

inline constexpr int kKMeansMaxPoints = 128;   // n per problem (a 128-token segment, §3.3)
inline constexpr int kKMeansMaxDim = 256;      // head_dim
inline constexpr int kKMeansMaxClusters = 64;  // K (the largest retention target, §3.3)

// Output slot values after a problem's min(n, k) sorted indices.
inline constexpr std::int32_t kKMeansUnusedSlot = -1;
// Fills the whole output row of a problem whose keys contain a NaN or an infinity.
inline constexpr std::int32_t kNonFiniteKeySlot = -2;

// One selection problem: rows points[i * row_stride + d], i < n, d < dim, in device memory.
struct KMeansProblem {
  const void* points = nullptr;  // device, row 0; dtype as passed to kmeans_select()
  std::int64_t row_stride = 0;   // elements between consecutive rows (>= dim)
  std::int32_t n = 0;            // rows, 0..kKMeansMaxPoints
  std::int32_t k = 1;            // survivors wanted, 1..kKMeansMaxClusters (k >= n keeps all)
};

// The problem for tokens [start, start + n) of (sequence b, KV head h) of a device cache.
inline KMeansProblem kmeans_problem_from_cache(const KVCacheView& kv, std::int64_t b,
                                               std::int64_t h, std::int64_t start, std::int32_t n,
                                               std::int32_t k) {
  KVSIFT_CHECK(b >= 0 && b < kv.batch() && h >= 0 && h < kv.kv_heads() && start >= 0 && n >= 0 &&
                   start + n <= kv.capacity(),
               "kmeans_problem_from_cache: sequence ", b, ", head ", h, ", tokens [", start, ", ",
               start + n, ") outside the cache ", kv.keys.shape_string());
  const std::int64_t esz = static_cast<std::int64_t>(dtype_size(kv.dtype()));
  KMeansProblem p;
  p.points = static_cast<const char*>(kv.keys.data) + kv.keys.offset(b, h, start) * esz;
  p.row_stride = kv.keys.stride[2];
  p.n = n;
  p.k = k;
  return p;
}

// Device scratch for `num_problems` problems (their descriptors).
std::size_t kmeans_select_workspace_bytes(std::int64_t num_problems);

// Solves every problem, one block each, and writes out[p * out_stride + j]: the min(n_p, k_p)
// chosen row indices of problem p ascending, then kKMeansUnusedSlot up to out_stride (or the
// whole row kNonFiniteKeySlot, see above).
//   problems    host array [num_problems] (copied into the workspace on `stream`)
//   dtype       storage dtype of every problem's points (f32, f16 or bf16)
//   out         device [num_problems, out_stride] int32, out_stride >= max_p min(n_p, k_p)
// Validates on the host and throws kvsift::Error naming the problem and value; nothing is
// enqueued then.
void kmeans_select(const KMeansProblem* problems, std::int64_t num_problems, std::int64_t dim,
                   DType dtype, const KMeansSelectConfig& config, std::int32_t* out,
                   std::int64_t out_stride, void* workspace, std::size_t workspace_bytes,
                   cudaStream_t stream);

inline void kmeans_select(const std::vector<KMeansProblem>& problems, std::int64_t dim, DType dtype,
                          const KMeansSelectConfig& config, std::int32_t* out,
                          std::int64_t out_stride, void* workspace, std::size_t workspace_bytes,
                          cudaStream_t stream) {
  kmeans_select(problems.data(), static_cast<std::int64_t>(problems.size()), dim, dtype, config,
                out, out_stride, workspace, workspace_bytes, stream);
}

// kmeans_select in two halves, for a caller that copies the descriptors to the device itself
// (from pinned memory, so that enqueueing many launches never waits for the stream):
// kmeans_select_bounds validates the problems and out_stride as kmeans_select does and returns the
// launch's bounds; kmeans_select_uploaded solves `num_problems` descriptors already in device
// memory, each within those bounds (kmeans_select_bounds of the same problems).
struct KMeansBounds {
  int max_points = 1;    // the largest n of a problem with k < n (shared memory per block)
  int max_clusters = 1;  // the largest k of such a problem
};
KMeansBounds kmeans_select_bounds(const KMeansProblem* problems, std::int64_t num_problems,
                                  std::int64_t dim, std::int64_t out_stride);
//   problems  device [num_problems]; out device [num_problems, out_stride] int32
void kmeans_select_uploaded(const KMeansProblem* problems, std::int64_t num_problems,
                            std::int64_t dim, DType dtype, const KMeansSelectConfig& config,
                            KMeansBounds bounds, std::int32_t* out, std::int64_t out_stride,
                            cudaStream_t stream);

}  // namespace kvsift::cuda
