// Window attention importance on the GPU (docs/algorithms.md §1.1, R-KV defaults: GQA max on raw
// logits, softmax over the tokens before the window, mean over the window, max pooling).
//
// Two kernels, because the softmax of a window row needs the whole row:
//   1. L[b,h,w,j] = max_g (q_{hG+g,w} · k_j) / sqrt(D) for a tile of keys, pads set to −1e9, by
//      gqa_logits_mma_kernel (16-bit storage: tensor cores, the common case) or gqa_logits_kernel
//      (fp32 storage and the shapes the first does not take: fp32 FMAs, each thread owning 8
//      (g, w) query rows × 4 keys in registers, keys staged transposed in shared memory).
//      When the R-KV scoring's one pass over the keys (key_pass.cu) already wrote them, with
//      gqa_logits_mma_kernel's very arithmetic, this step is skipped (logits_ready).
//   2. window_softmax_pool_kernel: one block per (b, h) row: softmax statistics per window row,
//      the window mean A, then the max pool (edges: over the entries that exist).
#include <cmath>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"
#include "mma.cuh"
#include "rkv_kernels.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kWarps = kBlockThreads / 32;
constexpr int kKeyTile = 128;  // keys per block: one warp spans the tile, 4 keys a lane
constexpr int kDimChunk = 16;  // head_dim slice staged in shared memory at a time
constexpr int kRowSlots = 8;   // query rows (g, w) a thread accumulates at once
constexpr int kKeyTilePitch = kKeyTile + 4;  // keeps every transposed row 16-byte aligned

struct KeyStrides {  // in elements
  std::int64_t h, s;
};
struct QueryStrides {  // in elements
  std::int64_t h, w, d;
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
    gqa_logits_kernel(StepBases keys,  // per layer [batch, kv_heads, capacity, head_dim]
                      KeyStrides ks,
                      StepBases queries,  // per layer [batch, q_heads, window, head_dim]
                      QueryStrides qs,
                      const std::uint8_t* __restrict__ valid,  // [batch, capacity] or nullptr
                      std::int64_t capacity, int group, int window, int head_dim, int n,
                      int group_slots, float scale,
                      float* __restrict__ logits) {  // [sequences, kv_heads, window, n]
  __shared__ __align__(16) float key_t[kDimChunk][kKeyTilePitch];
  __shared__ float query_s[kWarps][kRowSlots][kDimChunk];
  const int z = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y;
  const int b = z % keys.batch;  // the padding mask is per sequence, shared by the layers
  const int j0 = blockIdx.x * kKeyTile;
  const int warp = threadIdx.x / 32, quad = threadIdx.x % 32;
  const int w_slots = kRowSlots / group_slots;
  const T* kbase = keys.seq<const T>(z) + h * ks.h;
  const T* qbase = queries.seq<const T>(z) + static_cast<std::int64_t>(h) * group * qs.h;
  float* out = logits + (static_cast<std::int64_t>(z) * kv_heads + h) * window * n;

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

// Tensor-core logits for 16-bit storage. A product of two bf16 (or two f16) values is exact in
// fp32 and mma.sync accumulates in fp32, so these logits differ from the fp32 FMA chain of
// gqa_logits_kernel (and of the CPU reference) only by summation order, ~1e-7 relative: far inside
// the 1e-4 parity tolerance of the scores. One block: 64 keys of one (sequence, KV head) against
// all G·W <= 64 window rows of the group (row r = g·W + w); warp w multiplies keys 16w .. 16w + 15.
// The dot products then go through shared memory (over the key tile's bytes) for the GQA max.
constexpr int kMmaThreads = 128;
constexpr int kMmaKeyTile = 64;
constexpr int kMmaMaxRows = 64;
constexpr int kMmaMaxDim = 128;
constexpr int kMmaPitch = kMmaMaxDim + 8;  // b16 per staged row: 272 B, ldmatrix conflict-free
constexpr int kMmaDotPitch = kMmaKeyTile + 4;
static_assert(kMmaMaxRows * kMmaDotPitch * 4 <= kMmaKeyTile * kMmaPitch * 2,
              "the fp32 dot products fit in the key tile's bytes");

// Rows [0, n_rows) of 16-bit values, 8 per 16-byte chunk, into `dst` [rows][kMmaPitch] up to
// `chunks_padded` chunks; rows and chunks past the data are zero. row_ptr(r) is the row's start.
template <class RowPtr>
__device__ __forceinline__ void stage_rows(std::uint16_t (*dst)[kMmaPitch], int rows_padded,
                                           int n_rows, int chunks, int chunks_padded,
                                           RowPtr row_ptr) {
  for (int e = threadIdx.x; e < rows_padded * chunks_padded; e += kMmaThreads) {
    const int r = e / chunks_padded, c = e % chunks_padded;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < n_rows && c < chunks) v = reinterpret_cast<const uint4*>(row_ptr(r))[c];
    *reinterpret_cast<uint4*>(&dst[r][c * 8]) = v;
  }
}

template <class T>
__global__ void __launch_bounds__(kMmaThreads)
    gqa_logits_mma_kernel(StepBases keys,  // per layer [batch, kv_heads, capacity, head_dim]
                          KeyStrides ks,
                          StepBases queries,  // per layer [batch, q_heads, window, head_dim]
                          QueryStrides qs,
                          const std::uint8_t* __restrict__ valid,  // [batch, capacity] or nullptr
                          std::int64_t capacity, int group, int window, int head_dim, int n,
                          float scale,
                          float* __restrict__ logits) {  // [sequences, kv_heads, window, n]
  constexpr Half16 kType = std::is_same<T, bf16_t>::value ? Half16::bf16 : Half16::f16;
  __shared__ __align__(16) std::uint16_t q_s[kMmaMaxRows][kMmaPitch];
  __shared__ __align__(16) std::uint16_t k_s[kMmaKeyTile][kMmaPitch];
  const int z = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y;
  const int b = z % keys.batch;  // the padding mask is per sequence, shared by the layers
  const int j0 = blockIdx.x * kMmaKeyTile;
  const int rows = group * window, m_tiles = (rows + 15) / 16, k_steps = (head_dim + 15) / 16;
  const T* kbase = keys.seq<const T>(z) + h * ks.h;
  const T* qbase = queries.seq<const T>(z) + static_cast<std::int64_t>(h) * group * qs.h;
  stage_rows(q_s, m_tiles * 16, rows, head_dim / 8, k_steps * 2,
             [&](int r) { return qbase + (r / window) * qs.h + (r % window) * qs.w; });
  stage_rows(k_s, kMmaKeyTile, min(kMmaKeyTile, n - j0), head_dim / 8, k_steps * 2,
             [&](int r) { return kbase + static_cast<std::int64_t>(j0 + r) * ks.s; });
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float acc[kMmaMaxRows / 16][2][4] = {};
  for (int k = 0; k < k_steps; ++k) {
    std::uint32_t bf[4];  // n tile 0: bf[0], bf[1]; n tile 1: bf[2], bf[3]
    const int m = lane / 8;
    ldmatrix_x4(bf, &k_s[warp * 16 + (m / 2) * 8 + lane % 8][k * 16 + (m % 2) * 8]);
#pragma unroll
    for (int mt = 0; mt < kMmaMaxRows / 16; ++mt) {
      if (mt >= m_tiles) break;  // block-uniform
      std::uint32_t a[4];
      ldmatrix_x4(a, &q_s[mt * 16 + lane % 16][k * 16 + (lane / 16) * 8]);
      mma_16816<kType>(acc[mt][0], a, bf[0], bf[1]);
      mma_16816<kType>(acc[mt][1], a, bf[2], bf[3]);
    }
  }
  __syncthreads();  // every warp is done with k_s: its bytes now hold the dot products
  auto dots = reinterpret_cast<float(*)[kMmaDotPitch]>(&k_s[0][0]);
#pragma unroll
  for (int mt = 0; mt < kMmaMaxRows / 16; ++mt) {
    if (mt >= m_tiles) break;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        dots[mt * 16 + g + (q / 2) * 8][warp * 16 + nt * 8 + 2 * t + q % 2] = acc[mt][nt][q];
  }
  __syncthreads();
  float* out = logits + (static_cast<std::int64_t>(z) * kv_heads + h) * window * n;
  for (int e = threadIdx.x; e < window * kMmaKeyTile; e += kMmaThreads) {
    const int w = e / kMmaKeyTile, jl = e % kMmaKeyTile, j = j0 + jl;
    if (j >= n) continue;
    float best = dots[w][jl];  // GQA max (§1.1 step 1): rows g·W + w
    for (int gi = 1; gi < group; ++gi) best = fmaxf(best, dots[gi * window + w][jl]);
    // max_g(x_g) * scale == max_g(x_g * scale) exactly, scale > 0 and rounding is monotone.
    float v = best * scale;
    if (valid != nullptr && valid[b * capacity + j] == 0) v = kPadLogit;
    out[static_cast<std::int64_t>(w) * n + j] = v;
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

bool mma_logits_supported(const StepView& step, int group, int window) {
  const KVCacheView& kv = step.first();
  const TensorView& q = step.queries[0];
  const std::int64_t d = kv.head_dim();
  bool ok = kv.dtype() != DType::f32 && group * window <= kMmaMaxRows && d <= kMmaMaxDim &&
            d % 8 == 0 && q.stride[3] == 1 && kv.keys.stride[1] % 8 == 0 &&
            kv.keys.stride[2] % 8 == 0 && q.stride[1] % 8 == 0 && q.stride[2] % 8 == 0;
  for (int l = 0; l < step.n_layers; ++l) {
    ok = ok && reinterpret_cast<std::uintptr_t>(step.layers[l].keys.data) % 16 == 0 &&
         reinterpret_cast<std::uintptr_t>(step.queries[l].data) % 16 == 0 &&
         (kv.keys.stride[0] * 2) % 16 == 0 && (q.stride[0] * 2) % 16 == 0;
  }
  return ok;
}

void launch_window_importance(const StepView& step, int length, int kernel, float* logits,
                              float* pre_pool, float* importance, cudaStream_t stream,
                              bool logits_ready) {
  const KVCacheView& kv = step.first();
  const TensorView& queries = step.queries[0];
  const int sequences = step.sequences(), kv_heads = static_cast<int>(kv.kv_heads());
  const int head_dim = static_cast<int>(kv.head_dim());
  const int group = static_cast<int>(queries.shape[1] / kv.kv_heads());
  const int window = static_cast<int>(queries.shape[2]);
  const int n = length - window;
  const int group_slots = pow2_at_least(group) < kRowSlots ? pow2_at_least(group) : kRowSlots;
  // The same float expression as the CPU reference, so both scale by the identical value.
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const KeyStrides ks{kv.keys.stride[1], kv.keys.stride[2]};
  const QueryStrides qs{queries.stride[1], queries.stride[2], queries.stride[3]};
  const dim3 grid(static_cast<unsigned>((n + kKeyTile - 1) / kKeyTile),
                  static_cast<unsigned>(kv_heads), static_cast<unsigned>(sequences));
  const StepBases kb = key_bases(step), qb = query_bases(step);
  if (logits_ready) {
    // The one key pass wrote them (key_pass.cu), with this file's tensor-core arithmetic.
  } else if (mma_logits_supported(step, group, window)) {
    const dim3 mma_grid(static_cast<unsigned>((n + kMmaKeyTile - 1) / kMmaKeyTile),
                        static_cast<unsigned>(kv_heads), static_cast<unsigned>(sequences));
    auto launch = [&](auto tag) {
      using T = decltype(tag);
      gqa_logits_mma_kernel<T><<<mma_grid, kMmaThreads, 0, stream>>>(
          kb, ks, qb, qs, kv.valid_mask, kv.capacity(), group, window, head_dim, n, scale, logits);
    };
    if (kv.dtype() == DType::bf16)
      launch(bf16_t{});
    else
      launch(f16_t{});
  } else {
    KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
      gqa_logits_kernel<T>
          <<<grid, kBlockThreads, 0, stream>>>(kb, ks, qb, qs, kv.valid_mask, kv.capacity(), group,
                                               window, head_dim, n, group_slots, scale, logits);
    });
  }
  KVSIFT_CUDA_CHECK(cudaGetLastError());
  const std::size_t stats_bytes = 2 * static_cast<std::size_t>(window) * sizeof(float);
  window_softmax_pool_kernel<<<static_cast<unsigned>(sequences * kv_heads), kBlockThreads,
                               stats_bytes, stream>>>(logits, window, n, kernel, pre_pool,
                                                      importance);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvsift::cuda::detail
