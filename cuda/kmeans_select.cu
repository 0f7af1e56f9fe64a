// Deterministic k-means token selection (ThinKV TBE, docs/algorithms.md §3.3), one block per problem.
//
// Why the indices equal the CPU reference's (src/kmeans_select.cpp): every float it compares is
// reproduced with the same operations in the same order, and every parallel search is a
// lexicographic (value, index) reduction, which picks exactly the element a sequential
// "strictly better replaces" scan picks:
//   - squared distances: one thread runs the whole sum over d = 0..dim−1 with __fsub_rn /
//     __fmul_rn / __fadd_rn (nvcc would otherwise fuse t·t + s into an FMA, rounding once);
//   - cluster sums: the thread owning channel d adds the points in index order, then divides
//     with IEEE division (__fdiv_rn) by the float count;
//   - nearest centroid: (distance, centroid) minimum with NaN read as +inf, which is the scan's
//     "d < best_d starting from +inf, else centroid 0";
//   - seeding, reseeding and survivor choice: (value, row) maximum/minimum over eligible rows.
//
// Shared memory holds the points and centroids in fp32 with an odd row stride, so a thread per
// row walking its row hits 32 different banks.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/kmeans_select.hpp"
#include "kvsift/backend/cuda/workspace.hpp"

namespace kvsift::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 8;  // centroids whose survivor distances are computed together

// Where each array lives in dynamic shared memory, for at most `points` rows of `dim` channels and
// `clusters` centroids. Computed identically on host (size) and device (carving).
struct SharedLayout {
  int row_stride;  // dim rounded up to odd
  std::size_t points, centroids, chunk, nearest, distance, assignment, counts, reseed, flags, bytes;

  __host__ __device__ SharedLayout(int max_points, int dim, int clusters) {
    row_stride = dim | 1;
    std::size_t at = 0;
    auto put = [&](std::size_t bytes) {
      const std::size_t here = at;
      at += (bytes + 15) / 16 * 16;
      return here;
    };
    points = put(sizeof(float) * max_points * row_stride);
    centroids = put(sizeof(float) * clusters * row_stride);
    chunk = put(sizeof(float) * kChunk * max_points);
    nearest = put(sizeof(float) * max_points);
    distance = put(sizeof(float) * max_points);
    assignment = put(sizeof(int) * max_points);
    counts = put(sizeof(int) * clusters);
    reseed = put(sizeof(int) * clusters);
    flags = put(3 * max_points);  // chosen, used-for-reseed, taken
    bytes = at;
  }
};

__device__ float load_as_float(const void* base, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::f16:
      return to_float(static_cast<const f16_t*>(base)[i]);
    case DType::bf16:
      return to_float(static_cast<const bf16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

// fp32 squared distance in the CPU reference's order and rounding.
__device__ float squared_distance(const float* a, const float* b, int dim) {
  float s = 0.0f;
  for (int d = 0; d < dim; ++d) {
    const float t = __fsub_rn(a[d], b[d]);
    s = __fadd_rn(s, __fmul_rn(t, t));
  }
  return s;
}

// Lexicographic preference: a larger (kLargest) or smaller value, then the lower index.
template <bool kLargest>
__device__ bool preferred(float v, int i, float best_v, int best_i) {
  if (v != best_v) return kLargest ? v > best_v : v < best_v;
  return i < best_i;
}

// Called by one whole warp: the eligible row i < n (taken[i] == 0) with the largest/smallest
// values[i], ties to the lower row. Values are never NaN here. Every caller then has lane 0 set
// taken[winner], which the lane owning that row read in the scan: the closing __syncwarp orders
// every lane's reads before any write after the return (the shuffles exchange registers only and
// are no memory barrier under independent thread scheduling).
template <bool kLargest>
__device__ int warp_arg_best(const float* values, const std::uint8_t* taken, int n) {
  const int lane = threadIdx.x % 32;
  float best_v = kLargest ? -INFINITY : INFINITY;
  int best_i = INT_MAX;
  for (int i = lane; i < n; i += 32) {
    if (!taken[i] && preferred<kLargest>(values[i], i, best_v, best_i)) {
      best_v = values[i];
      best_i = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best_v, o);
    const int i = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (preferred<kLargest>(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  __syncwarp();
  return best_i;
}

__global__ void __launch_bounds__(kThreads)
    kmeans_select_kernel(const KMeansProblem* __restrict__ problems, int dim, DType dtype,
                         int max_iterations, int max_points, int max_clusters,
                         std::int32_t* __restrict__ out, std::int64_t out_stride) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int flag;       // non-finite key seen / an assignment changed
  __shared__ int broadcast;  // a row chosen by warp 0
  const KMeansProblem prob = problems[blockIdx.x];
  std::int32_t* row_out = out + static_cast<std::int64_t>(blockIdx.x) * out_stride;
  const int n = prob.n, k = prob.k, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  if (k >= n) {  // keep every row, as the CPU reference does before looking at the values
    for (std::int64_t j = tid; j < out_stride; j += kThreads) {
      row_out[j] = j < n ? static_cast<std::int32_t>(j) : kKMeansUnusedSlot;
    }
    return;
  }

  const SharedLayout lay(max_points, dim, max_clusters);
  const int ps = lay.row_stride;
  float* P = reinterpret_cast<float*>(smem + lay.points);     // [n, ps]
  float* C = reinterpret_cast<float*>(smem + lay.centroids);  // [k, ps]
  float* chunk = reinterpret_cast<float*>(smem + lay.chunk);  // [kChunk, n]
  float* nearest = reinterpret_cast<float*>(smem + lay.nearest);
  float* distance = reinterpret_cast<float*>(smem + lay.distance);
  int* assignment = reinterpret_cast<int*>(smem + lay.assignment);
  int* counts = reinterpret_cast<int*>(smem + lay.counts);
  int* reseed = reinterpret_cast<int*>(smem + lay.reseed);
  std::uint8_t* chosen = smem + lay.flags;
  std::uint8_t* used = chosen + max_points;
  std::uint8_t* taken = used + max_points;

  // ---- load (fp32 widening is exact) and reject non-finite keys
  if (tid == 0) flag = 0;
  __syncthreads();
  for (int e = tid; e < n * dim; e += kThreads) {
    const int i = e / dim, d = e % dim;
    const float x = load_as_float(prob.points, dtype, i * prob.row_stride + d);
    if (!isfinite(x)) flag = 1;
    P[i * ps + d] = x;
  }
  for (int i = tid; i < n; i += kThreads) {
    chosen[i] = i == 0;
    assignment[i] = -1;
    taken[i] = 0;
  }
  __syncthreads();
  if (flag != 0) {
    for (std::int64_t j = tid; j < out_stride; j += kThreads) row_out[j] = kNonFiniteKeySlot;
    return;
  }

  // ---- farthest-point seeding from row 0
  for (int d = tid; d < dim; d += kThreads) C[d] = P[d];
  for (int i = tid; i < n; i += kThreads) nearest[i] = squared_distance(P + i * ps, P, dim);
  __syncthreads();
  for (int s = 1; s < k; ++s) {
    if (warp == 0) {
      const int best = warp_arg_best<true>(nearest, chosen, n);
      if (lane == 0) {
        broadcast = best;
        chosen[best] = 1;
      }
    }
    __syncthreads();
    const int seed = broadcast;
    for (int d = tid; d < dim; d += kThreads) C[s * ps + d] = P[seed * ps + d];
    for (int i = tid; i < n; i += kThreads) {
      const float dist = squared_distance(P + i * ps, P + seed * ps, dim);
      if (dist < nearest[i]) nearest[i] = dist;  // std::min(nearest, dist)
    }
    __syncthreads();  // `broadcast` and `nearest` are rewritten next round
  }

  // ---- Lloyd iterations
  for (int iter = 0; iter < max_iterations; ++iter) {
    if (tid == 0) flag = 0;
    __syncthreads();
    // Nearest centroid: a warp takes two rows, each lane centroids lane and lane + 32 of both.
    for (int i0 = warp * 2; i0 < n; i0 += kWarps * 2) {
      const int i1 = min(i0 + 1, n - 1);
      const int c0 = lane, c1 = lane + 32;
      const float* p0 = P + i0 * ps;
      const float* p1 = P + i1 * ps;
      const float* q0 = C + min(c0, k - 1) * ps;
      const float* q1 = C + min(c1, k - 1) * ps;
      float s00 = 0.0f, s01 = 0.0f, s10 = 0.0f, s11 = 0.0f;
      for (int d = 0; d < dim; ++d) {
        const float a0 = p0[d], a1 = p1[d], b0 = q0[d], b1 = q1[d];
        const float t00 = __fsub_rn(a0, b0), t01 = __fsub_rn(a0, b1);
        const float t10 = __fsub_rn(a1, b0), t11 = __fsub_rn(a1, b1);
        s00 = __fadd_rn(s00, __fmul_rn(t00, t00));
        s01 = __fadd_rn(s01, __fmul_rn(t01, t01));
        s10 = __fadd_rn(s10, __fmul_rn(t10, t10));
        s11 = __fadd_rn(s11, __fmul_rn(t11, t11));
      }
      float row_d[2] = {s00, s10}, row_d1[2] = {s01, s11};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // Candidates of this lane: (d, c0) and (d1, c1); invalid centroids never win.
        float best_d = c0 < k ? (isnan(row_d[r]) ? INFINITY : row_d[r]) : INFINITY;
        int best_c = c0 < k ? c0 : INT_MAX;
        if (c1 < k) {
          const float v = isnan(row_d1[r]) ? INFINITY : row_d1[r];
          if (preferred<false>(v, c1, best_d, best_c)) {
            best_d = v;
            best_c = c1;
          }
        }
        for (int o = 16; o > 0; o >>= 1) {
          const float v = __shfl_xor_sync(0xffffffffu, best_d, o);
          const int c = __shfl_xor_sync(0xffffffffu, best_c, o);
          if (preferred<false>(v, c, best_d, best_c)) {
            best_d = v;
            best_c = c;
          }
        }
        const int i = r == 0 ? i0 : i0 + 1;
        if (lane == 0 && i < n) {
          if (assignment[i] != best_c) flag = 1;
          assignment[i] = best_c;
          distance[i] = best_d;
        }
      }
    }
    __syncthreads();
    if (flag == 0) break;  // every thread read `flag` before the next write (after 3 barriers)
    // Cluster sizes, and per channel the sums over points in index order.
    for (int c = tid; c < k; c += kThreads) {
      int count = 0;
      for (int i = 0; i < n; ++i) count += assignment[i] == c;
      counts[c] = count;
    }
    for (int d = tid; d < dim; d += kThreads) {
      for (int c = 0; c < k; ++c) C[c * ps + d] = 0.0f;
      for (int i = 0; i < n; ++i) {
        float* sum = C + assignment[i] * ps + d;
        *sum = __fadd_rn(*sum, P[i * ps + d]);
      }
    }
    __syncthreads();
    // Empty clusters, in index order, take the worst-served row not yet used for a reseed.
    if (warp == 0) {
      for (int i = lane; i < n; i += 32) used[i] = 0;
      __syncwarp();
      for (int c = 0; c < k; ++c) {
        if (counts[c] != 0) continue;
        const int far = warp_arg_best<true>(distance, used, n);
        if (lane == 0) {
          used[far] = 1;
          reseed[c] = far;
        }
        __syncwarp();
      }
    }
    __syncthreads();
    for (int d = tid; d < dim; d += kThreads) {
      for (int c = 0; c < k; ++c) {
        C[c * ps + d] = counts[c] > 0 ? __fdiv_rn(C[c * ps + d], static_cast<float>(counts[c]))
                                      : P[reseed[c] * ps + d];
      }
    }
    __syncthreads();
  }

  // ---- survivors: centroids in index order each take the nearest row not yet taken
  for (int c0 = 0; c0 < k; c0 += kChunk) {
    const int m = min(kChunk, k - c0);
    for (int e = tid; e < m * n; e += kThreads) {
      const int cc = e / n, i = e % n;
      chunk[cc * n + i] = squared_distance(P + i * ps, C + (c0 + cc) * ps, dim);
    }
    __syncthreads();
    if (warp == 0) {
      for (int cc = 0; cc < m; ++cc) {
        const int best = warp_arg_best<false>(chunk + cc * n, taken, n);
        if (lane == 0) taken[best] = 1;
        __syncwarp();
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    std::int64_t j = 0;
    for (int i = 0; i < n; ++i) {
      if (taken[i]) row_out[j++] = i;
    }
    for (; j < out_stride; ++j) row_out[j] = kKMeansUnusedSlot;
  }
}

}  // namespace

std::size_t kmeans_select_workspace_bytes(std::int64_t num_problems) {
  KVSIFT_CHECK(num_problems >= 0, "kmeans_select_workspace_bytes: num_problems=", num_problems,
               " is negative");
  return align_up(static_cast<std::size_t>(num_problems) * sizeof(KMeansProblem));
}

KMeansBounds kmeans_select_bounds(const KMeansProblem* problems, std::int64_t num_problems,
                                  std::int64_t dim, std::int64_t out_stride) {
  KVSIFT_CHECK(num_problems >= 0 && num_problems <= 0x7fffffff,
               "cuda::kmeans_select: num_problems=", num_problems, " outside [0, 2^31)");
  KVSIFT_CHECK(problems != nullptr || num_problems == 0,
               "cuda::kmeans_select: problems is null for num_problems=", num_problems);
  KVSIFT_CHECK(dim >= 1 && dim <= kKMeansMaxDim, "cuda::kmeans_select: dim=", dim, " outside [1, ",
               kKMeansMaxDim, "]");
  KVSIFT_CHECK(out_stride >= 0, "cuda::kmeans_select: out_stride=", out_stride, " is negative");
  KMeansBounds bounds;
  for (std::int64_t p = 0; p < num_problems; ++p) {
    const KMeansProblem& q = problems[p];
    KVSIFT_CHECK(q.n >= 0 && q.n <= kKMeansMaxPoints, "cuda::kmeans_select: problem ", p,
                 " has n=", q.n, " outside [0, ", kKMeansMaxPoints, "]");
    KVSIFT_CHECK((q.k >= 1 || q.n == 0) && q.k <= kKMeansMaxClusters,
                 "cuda::kmeans_select: problem ", p, " has k=", q.k, " outside [1, ",
                 kKMeansMaxClusters, "] (n=", q.n, ")");
    KVSIFT_CHECK(q.n == 0 || (q.points != nullptr && q.row_stride >= dim),
                 "cuda::kmeans_select: problem ", p, " has points=", q.points,
                 " row_stride=", q.row_stride, " (need non-null and row_stride >= dim=", dim, ")");
    KVSIFT_CHECK(std::min(q.n, q.k) <= out_stride, "cuda::kmeans_select: problem ", p, " keeps ",
                 std::min(q.n, q.k), " rows but out_stride=", out_stride);
    if (q.k < q.n) {
      bounds.max_points = std::max(bounds.max_points, q.n);
      bounds.max_clusters = std::max(bounds.max_clusters, q.k);
    }
  }
  return bounds;
}

void kmeans_select_uploaded(const KMeansProblem* problems, std::int64_t num_problems,
                            std::int64_t dim, DType dtype, const KMeansSelectConfig& config,
                            KMeansBounds bounds, std::int32_t* out, std::int64_t out_stride,
                            cudaStream_t stream) {
  config.validate();
  KVSIFT_CHECK(num_problems >= 0 && num_problems <= 0x7fffffff,
               "cuda::kmeans_select: num_problems=", num_problems, " outside [0, 2^31)");
  KVSIFT_CHECK(dim >= 1 && dim <= kKMeansMaxDim, "cuda::kmeans_select: dim=", dim, " outside [1, ",
               kKMeansMaxDim, "]");
  KVSIFT_CHECK(bounds.max_points >= 1 && bounds.max_points <= kKMeansMaxPoints &&
                   bounds.max_clusters >= 1 && bounds.max_clusters <= kKMeansMaxClusters,
               "cuda::kmeans_select: bounds (", bounds.max_points, " points, ", bounds.max_clusters,
               " clusters) outside [1, ", kKMeansMaxPoints, "] x [1, ", kKMeansMaxClusters, "]");
  if (num_problems == 0) return;
  KVSIFT_CHECK(problems != nullptr && (out != nullptr || out_stride == 0),
               "cuda::kmeans_select: problems or out is null");
  const SharedLayout lay(bounds.max_points, static_cast<int>(dim), bounds.max_clusters);
  if (lay.bytes > 48 * 1024) {
    int device = 0, optin = 0;
    KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
    KVSIFT_CUDA_CHECK(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    KVSIFT_CHECK(lay.bytes <= static_cast<std::size_t>(optin), "cuda::kmeans_select: ", lay.bytes,
                 " bytes of shared memory needed, the device allows ", optin);
    KVSIFT_CUDA_CHECK(cudaFuncSetAttribute(kmeans_select_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(lay.bytes)));
  }
  kmeans_select_kernel<<<static_cast<unsigned>(num_problems), kThreads, lay.bytes, stream>>>(
      problems, static_cast<int>(dim), dtype, config.max_iterations, bounds.max_points,
      bounds.max_clusters, out, out_stride);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void kmeans_select(const KMeansProblem* problems, std::int64_t num_problems, std::int64_t dim,
                   DType dtype, const KMeansSelectConfig& config, std::int32_t* out,
                   std::int64_t out_stride, void* workspace, std::size_t workspace_bytes,
                   cudaStream_t stream) {
  config.validate();
  const KMeansBounds bounds = kmeans_select_bounds(problems, num_problems, dim, out_stride);
  KVSIFT_CHECK(out != nullptr || num_problems == 0 || out_stride == 0,
               "cuda::kmeans_select: out is null");
  WorkspaceCarver carve(workspace, workspace_bytes, "cuda::kmeans_select");
  auto* d_problems = carve.take<KMeansProblem>(static_cast<std::size_t>(num_problems));
  if (num_problems == 0) return;
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_problems, problems,
                                    static_cast<std::size_t>(num_problems) * sizeof(KMeansProblem),
                                    cudaMemcpyHostToDevice, stream));
  kmeans_select_uploaded(d_problems, num_problems, dim, dtype, config, bounds, out, out_stride,
                         stream);
}

}  // namespace kvsift::cuda
