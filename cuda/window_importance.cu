// Window attention importance on the GPU (ALGORITHMS.md §1.1, R-KV defaults: GQA max on raw
// logits, softmax over the tokens before the window, mean over the window, max pooling).
//
// Two kernels, because the softmax of a window row needs the whole row:
//   1. gqa_logits_kernel: L[b,h,w,j] = max_g (q_{hG+g,w} · k_j) / sqrt(D) for a tile of keys, pads
//      set to −1e9. Each thread owns 8 (g, w) query rows × 4 keys in registers, so the GQA max
//      never leaves the thread; keys are staged transposed in shared memory in head_dim slices.
//   2. window_softmax_pool_kernel: one block per (b, h) row: softmax statistics per window row,
//      the window mean A, then the max pool (edges: over the entries that exist).
#include <cmath>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"
#include "rkv_kernels.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kWarps = kBlockThreads / 32;
constexpr int kKeyTile = 128;  // keys per block: one warp spans the tile, 4 keys a lane
constexpr int kDimChunk = 16;  // head_dim slice staged in shared memory at a time
constexpr int kRowSlots = 8;   // query rows (g, w) a thread accumulates at once
constexpr int kKeyTilePitch = kKeyTile + 4;  // keeps every transposed row 16-byte aligned
constexpr float kPadLogit = -1e9f;           // ALGORITHMS.md §1.1 step 5

struct KeyStrides {  // in elements
  std::int64_t b, h, s;
};
struct QueryStrides {  // in elements
  std::int64_t b, h, w, d;
};

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// One block scores keys [j0, j0 + kKeyTile) of one (b, h) against every window query of the
// group. A warp handles `w_slots` window positions; a thread's slot r is query head
// g0 + r % group_slots at window position (warp's first) + r / group_slots. group_slots is the
// power of two >= G (capped at 8), so the max over a window's slots is a register tree.
template <class T>
__global__ void __launch_bounds__(kBlockThreads)
    gqa_logits_kernel(const T* __restrict__ keys,  // [batch, kv_heads, capacity, head_dim]
                      KeyStrides ks,
                      const T* __restrict__ queries,  // [batch, q_heads, window, head_dim]
                      QueryStrides qs,
                      const std::uint8_t* __restrict__ valid,  // [batch, capacity] or nullptr
                      std::int64_t capacity, int group, int window, int head_dim, int n,
                      int group_slots, float scale,
                      float* __restrict__ logits) {  // [batch, kv_heads, window, n]
  __shared__ __align__(16) float key_t[kDimChunk][kKeyTilePitch];
  __shared__ float query_s[kWarps][kRowSlots][kDimChunk];
  const int b = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y;
  const int j0 = blockIdx.x * kKeyTile;
  const int warp = threadIdx.x / 32, quad = threadIdx.x % 32;
  const int w_slots = kRowSlots / group_slots;
  const T* kbase = keys + b * ks.b + h * ks.h;
  const T* qbase = queries + b * qs.b + static_cast<std::int64_t>(h) * group * qs.h;
  float* out = logits + (static_cast<std::int64_t>(b) * kv_heads + h) * window * n;

  for (int w_lo = 0; w_lo < window; w_lo += kWarps * w_slots) {
    float best[kRowSlots][4];
#pragma unroll
    for (int r = 0; r < kRowSlots; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) best[r][c] = -INFINITY;

    for (int g0 = 0; g0 < group; g0 += group_slots) {
      float acc[kRowSlots][4];
#pragma unroll
      for (int r = 0; r < kRowSlots; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;

      for (int d0 = 0; d0 < head_dim; d0 += kDimChunk) {
        __syncthreads();  // the previous slice is no longer read
        for (int e = threadIdx.x; e < kKeyTile * kDimChunk; e += kBlockThreads) {
          const int key = e / kDimChunk, d = e % kDimChunk, j = j0 + key;
          key_t[d][key] = (j < n && d0 + d < head_dim) ? to_float(kbase[j * ks.s + d0 + d]) : 0.0f;
        }
        for (int e = threadIdx.x; e < kWarps * kRowSlots * kDimChunk; e += kBlockThreads) {
          const int d = e % kDimChunk, r = (e / kDimChunk) % kRowSlots;
          const int wi = e / (kDimChunk * kRowSlots);
          const int w = w_lo + wi * w_slots + r / group_slots, g = g0 + r % group_slots;
          query_s[wi][r][d] = (w < window && g < group && d0 + d < head_dim)
                                  ? to_float(qbase[g * qs.h + w * qs.w + (d0 + d) * qs.d])
                                  : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int d = 0; d < kDimChunk; ++d) {
          const float4 k4 = *reinterpret_cast<const float4*>(&key_t[d][quad * 4]);
#pragma unroll
          for (int r = 0; r < kRowSlots; ++r) {
            const float q = query_s[warp][r][d];  // one address per warp: a broadcast
            acc[r][0] = fmaf(q, k4.x, acc[r][0]);
            acc[r][1] = fmaf(q, k4.y, acc[r][1]);
            acc[r][2] = fmaf(q, k4.z, acc[r][2]);
            acc[r][3] = fmaf(q, k4.w, acc[r][3]);
          }
        }
      }
      // Slots past the last query head are not heads: they must not win the max.
#pragma unroll
      for (int r = 0; r < kRowSlots; ++r)
        if (g0 + r % group_slots >= group)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] = -INFINITY;
            // GQA max over the group's heads (§1.1 step 1): a tree inside each aligned run of
            // slots.
#pragma unroll
      for (int s = 1; s < kRowSlots; s *= 2) {
        if (s < group_slots) {
#pragma unroll
          for (int r = 0; r + s < kRowSlots; ++r)
            if (r % (2 * s) == 0)
#pragma unroll
              for (int c = 0; c < 4; ++c) acc[r][c] = fmaxf(acc[r][c], acc[r + s][c]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRowSlots; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) best[r][c] = fmaxf(best[r][c], acc[r][c]);
    }

#pragma unroll
    for (int r = 0; r < kRowSlots; ++r) {
      if (r % group_slots != 0) continue;
      const int w = w_lo + warp * w_slots + r / group_slots;
      if (w >= window) continue;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = j0 + quad * 4 + c;
        if (j >= n) continue;
        // max_g(x_g) * scale == max_g(x_g * scale) exactly, scale > 0 and rounding is monotone.
        float v = best[r][c] * scale;
        if (valid != nullptr && valid[b * capacity + j] == 0) v = kPadLogit;
        out[static_cast<std::int64_t>(w) * n + j] = v;
      }
    }
  }
}

// One block per (b, h): P = softmax of each window row over j < n, A = mean_w P (written to
// `pre_pool`), then a = maxpool(A). `pre_pool` is written and read back by the same block after a
// barrier, so it is deliberately not a __restrict__ const pointer (no read-only cache path).
__global__ void __launch_bounds__(kBlockThreads)
    window_softmax_pool_kernel(const float* __restrict__ logits,  // [rows, window, n]
                               int window, int n, int kernel,
                               float* pre_pool,                   // [rows, n]
                               float* __restrict__ importance) {  // [rows, n]
  using Reduce = cub::BlockReduce<float, kBlockThreads>;
  __shared__ typename Reduce::TempStorage reduce_tmp;
  extern __shared__ float stats[];  // [2 * window]: row max, then row sum of exponentials
  const std::int64_t row = blockIdx.x;
  const float* l = logits + row * window * n;
  float* pre = pre_pool + row * n;
  for (int w = 0; w < window; ++w) {
    const float* lw = l + static_cast<std::int64_t>(w) * n;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += kBlockThreads) m = fmaxf(m, lw[j]);
    m = Reduce(reduce_tmp).Reduce(m, MaxOp{});
    if (threadIdx.x == 0) stats[w] = m;
    __syncthreads();  // stats[w] visible, reduce_tmp free again
    m = stats[w];
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += kBlockThreads) s += expf(lw[j] - m);
    s = Reduce(reduce_tmp).Sum(s);
    if (threadIdx.x == 0) stats[window + w] = s;
    __syncthreads();
  }
  for (int j = threadIdx.x; j < n; j += kBlockThreads) {
    float a = 0.0f;
    for (int w = 0; w < window; ++w)
      a += expf(l[static_cast<std::int64_t>(w) * n + j] - stats[w]) / stats[window + w];
    pre[j] = a / static_cast<float>(window);
  }
  __syncthreads();  // the whole of A is written before any thread pools over its neighbours
  const int half = kernel / 2;
  float* a_out = importance + row * n;
  for (int j = threadIdx.x; j < n; j += kBlockThreads) {
    const int lo = max(0, j - half), hi = min(n - 1, j + half);
    float v = pre[lo];
    for (int i = lo + 1; i <= hi; ++i) v = fmaxf(v, pre[i]);
    a_out[j] = v;
  }
}

int pow2_at_least(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

}  // namespace

void launch_window_importance(const KVCacheView& kv, const TensorView& queries, int length,
                              int kernel, float* logits, float* pre_pool, float* importance,
                              cudaStream_t stream) {
  const int batch = static_cast<int>(kv.batch()), kv_heads = static_cast<int>(kv.kv_heads());
  const int head_dim = static_cast<int>(kv.head_dim());
  const int group = static_cast<int>(queries.shape[1] / kv.kv_heads());
  const int window = static_cast<int>(queries.shape[2]);
  const int n = length - window;
  const int group_slots = pow2_at_least(group) < kRowSlots ? pow2_at_least(group) : kRowSlots;
  // The same float expression as the CPU reference, so both scale by the identical value.
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const KeyStrides ks{kv.keys.stride[0], kv.keys.stride[1], kv.keys.stride[2]};
  const QueryStrides qs{queries.stride[0], queries.stride[1], queries.stride[2], queries.stride[3]};
  const dim3 grid(static_cast<unsigned>((n + kKeyTile - 1) / kKeyTile),
                  static_cast<unsigned>(kv_heads), static_cast<unsigned>(batch));
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    gqa_logits_kernel<T><<<grid, kBlockThreads, 0, stream>>>(
        static_cast<const T*>(kv.keys.data), ks, static_cast<const T*>(queries.data), qs,
        kv.valid_mask, kv.capacity(), group, window, head_dim, n, group_slots, scale, logits);
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
  const std::size_t stats_bytes = 2 * static_cast<std::size_t>(window) * sizeof(float);
  window_softmax_pool_kernel<<<static_cast<unsigned>(batch * kv_heads), kBlockThreads, stats_bytes,
                               stream>>>(logits, window, n, kernel, pre_pool, importance);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvsift::cuda::detail
