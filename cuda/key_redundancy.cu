// Key redundancy on the GPU (docs/algorithms.md §1.2) without the S×S cosine matrix, through the
// column-sum identity of the §1.2 cost note:
//   sum_i C[i,j] = (sum_i k̂_i)·k̂_j − k̂_j·k̂_j − sum_{i: r_i = j} k̂_i·k̂_j.
// The kernels:
//   1. The one pass over the keys (key_pass.cu, launch_key_pass): per row the divisor
//      ||K_i|| + 1e-8 (0 for pads, steps 1 and 6; the exact readers divide by it, see UnitKeys),
//      the fp16 unit key the tensor-core search reads, and the chunk sums of step 3 below, all
//      from one read of each row with 16-byte accesses. When the layout does not allow them
//      (head_dim not a multiple of 8 or above 256, unaligned strides), the scalar kernels of this
//      file do the same (launch_key_rows_scalar): normalize_keys_kernel, or, for head_dim <= 256,
//      normalize_and_sum_kernel with 3 folded in.
//   2. last_match_kernel: for a tile of 64 rows, 64×64 cosine tiles from the sequence end
//      backwards; a row's first match is its last one, r_i (step 3), and the block stops as soon
//      as all its rows have matched. The spared cosine C[i, r_i] (and in faithful mode C[i, 0]
//      of unmatched rows) is added to its column in 64-bit fixed point: integer atomics are
//      exact, so the sum does not depend on the order blocks run in. (Or the tensor-core search
//      of key_redundancy_tc.cu, with identical results.)
//   3. unit_key_partial_sums_kernel: sum_i k̂_i over chunks of rows, in a fixed order (the
//      scalar fallback for head_dim > 256; the other paths fold it into step 1).
//   4. column_means_vec_kernel (16-byte reads; column_means_kernel for the other layouts):
//      rbar_j = (total·k̂_j − k̂_j·k̂_j − spared_j) / S (step 4), total = the chunk sums added in
//      chunk order (the second, fixed-order stage of the key sums), the two dot products taken on
//      the raw key and divided once. It reads the keys a second time: it needs the finished total.
//   5. redundancy_softmax_kernel: R = softmax(rbar) over all S (step 5), one block per (b, h).
// Steps 3–4 are spread over many blocks: at batch 1 one block per (b, h) would leave the GPU
// idle and be bound by memory latency.
#include <cuda_fp16.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "key_vec.cuh"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"
#include "rkv_kernels.cuh"
#include "tc_unit_images.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kWarps = kBlockThreads / 32;
constexpr int kRowTile = 64;   // rows of one cosine tile of the last-match search (4 per thread)
constexpr int kColTile = 64;   // columns of one cosine tile (4 per thread)
constexpr int kDimChunk = 32;  // head_dim slice staged in shared memory at a time
constexpr int kColumnsPerBlock = 64;          // columns of rbar per block of column_means_kernel
constexpr double kFixedScale = 4294967296.0;  // 2^32: cosines in [-1, 1] to 32.32 fixed point

struct KeyStrides {  // in elements
  std::int64_t h, s;
};

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ __forceinline__ void add_fixed(unsigned long long* sum, float x) {
  // Two's complement wrap-around makes the unsigned atomic a signed, exact, order-free sum.
  atomicAdd(sum,
            static_cast<unsigned long long>(__double2ll_rn(static_cast<double>(x) * kFixedScale)));
}

__device__ __forceinline__ float fixed_to_float(unsigned long long v) {
  return static_cast<float>(static_cast<double>(static_cast<long long>(v)) / kFixedScale);
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_down_sync(0xffffffffu, x, off);
  return x;  // complete in lane 0
}

// One warp per (b, h, i): the norm's divisor ||K|| + 1e-8 (0 for a pad), with the CPU reference's
// arithmetic. Only for head_dim > 256, beyond the tensor-core search, so it writes no fp16 copy.
template <class T>
__global__ void __launch_bounds__(kBlockThreads)
    normalize_keys_kernel(StepBases keys,  // per layer [batch, kv_heads, capacity, head_dim]
                          KeyStrides ks,
                          const std::uint8_t* __restrict__ valid,  // [batch, capacity] or nullptr
                          std::int64_t capacity, int kv_heads, int length, int head_dim,
                          std::int64_t rows,            // sequences * kv_heads * length
                          float* __restrict__ denom) {  // [sequences, kv_heads, length]
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (r >= rows) return;  // whole warps leave; no block barrier follows
  const int lane = threadIdx.x % 32;
  const int i = static_cast<int>(r % length);
  const std::int64_t bh = r / length;
  const int z = static_cast<int>(bh / kv_heads), h = static_cast<int>(bh % kv_heads);
  const int b = z % keys.batch;  // the padding mask is per sequence, shared by the layers
  const T* k = keys.seq<const T>(z) + h * ks.h + i * ks.s;
  if (valid != nullptr && valid[b * capacity + i] == 0) {
    if (lane == 0) denom[r] = 0.0f;  // a pad: a zero key
    return;
  }
  float sq = 0.0f;
  for (int d = lane; d < head_dim; d += 32) {
    const float x = to_float(k[d]);
    sq = fmaf(x, x, sq);
  }
  for (int off = 16; off > 0; off /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, off);
  const float den = sqrtf(sq) + 1e-8f;  // the butterfly leaves the same sum in every lane
  if (lane == 0) denom[r] = den;
}

// normalize_keys_kernel and unit_key_partial_sums_kernel in one pass, for head_dim <= 256 (every
// channel of a row in registers): grid (chunks, kv_heads, sequences); warp w normalises rows w,
// w + 8, ... of its chunk with the same arithmetic as normalize_keys_kernel and adds the unit
// keys up in the order unit_key_partial_sums_kernel uses, while the keys are read once.
constexpr int kFusedMaxDim = kBlockThreads;  // 8 channels per lane
template <class T>
__global__ void __launch_bounds__(kBlockThreads)
    normalize_and_sum_kernel(StepBases keys,  // per layer [batch, kv_heads, capacity, head_dim]
                             KeyStrides ks,
                             const std::uint8_t* __restrict__ valid,  // [batch, capacity] or null
                             std::int64_t capacity, int length, int head_dim,
                             float* __restrict__ denom,      // [sequences, kv_heads, length]
                             __half* __restrict__ unit16,    // tc_unit_images.cuh, or null
                             float* __restrict__ partial) {  // [sequences, kv_heads, chunks, D]
  constexpr int kPerLane = kFusedMaxDim / 32;
  __shared__ float warp_sums[kWarps][kFusedMaxDim];
  const int z = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y, chunk = blockIdx.x;
  const int b = z % keys.batch;  // the padding mask is per sequence, shared by the layers
  const std::int64_t bh = static_cast<std::int64_t>(z) * kv_heads + h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = chunk * kKeySumRows, last = min(length, first + kKeySumRows);
  const T* kbase = keys.seq<const T>(z) + h * ks.h;
  const int halves = tc_image_halves(head_dim);
  __half* const head16 =
      unit16 != nullptr ? unit16 + bh * tc_head_elements(length, head_dim) : nullptr;
  float acc[kPerLane];
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) acc[m] = 0.0f;
  for (int i = first + warp; i < last; i += kWarps) {
    const std::int64_t r = bh * length + i;
    const bool pad = valid != nullptr && valid[b * capacity + i] == 0;
    float x[kPerLane];
    float sq = 0.0f;
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int d = lane + 32 * m;
      x[m] = (!pad && d < head_dim) ? to_float(kbase[i * ks.s + d]) : 0.0f;
      if (d < head_dim) sq = fmaf(x[m], x[m], sq);
    }
    for (int off = 16; off > 0; off /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    const float den = sqrtf(sq) + 1e-8f;
    if (lane == 0) denom[r] = pad ? 0.0f : den;
    // x·(1/den): within 1 ulp of the reference's x/den, for the sums (tolerance) and the fp16
    // copy (its bound in key_redundancy_tc.cu allows for it); the exact re-checks divide.
    const float inv = __frcp_rn(den);
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int d = lane + 32 * m;
      // Pads: zero keys (§1.2 step 6). Rounded product and sum, as in key_pass.cu: the sums may
      // not depend on whether the fp16 copy is stored.
      const float v = pad ? 0.0f : __fmul_rn(x[m], inv);
      if (d < head_dim) acc[m] = __fadd_rn(acc[m], v);
      if (head16 != nullptr && d < kTcImageChannels * halves)
        head16[tc_chunk_offset(i, d / 8, halves) + d % 8] =
            __float2half_rn(d < head_dim ? v : 0.0f);
    }
  }
  if (head16 != nullptr && chunk == gridDim.x - 1)
    zero_tc_padding(head16, length, halves, threadIdx.x, kBlockThreads);
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) warp_sums[warp][lane + 32 * m] = acc[m];
  __syncthreads();
  const int d = threadIdx.x;
  if (d < head_dim) {
    float t = 0.0f;
    for (int w = 0; w < kWarps; ++w) t += warp_sums[w][d];
    partial[(bh * gridDim.x + chunk) * head_dim + d] = t;
  }
}

// Rows [first, first + kRows) x channels [d0, d0 + kDimChunk) of the unit keys of (sequence,
// head) bh, transposed into `dst`; entries past the sequence or head_dim are 0. Consecutive
// threads read consecutive channels.
template <int kRows, class T>
__device__ __forceinline__ void stage_tile(float (*dst)[kRows + 4], const UnitHead<T>& u, int first,
                                           int length, int d0, int head_dim) {
  for (int e = threadIdx.x; e < kRows * kDimChunk; e += kBlockThreads) {
    const int t = e / kDimChunk, d = e % kDimChunk, i = first + t;
    dst[d][t] = (i < length && d0 + d < head_dim) ? u.row(i)[d0 + d] : 0.0f;
  }
}

// Grid (row tiles, kv_heads, batch). Thread (ty, tx) owns rows kRowsPerThread·ty.. and columns
// 4tx..4tx+3 of each tile. (128-row tiles measured 5% faster at batch 64 on an H200 but 15%
// slower at batch 1, where 64-row tiles give twice the blocks.)
template <class T>
__global__ void __launch_bounds__(kBlockThreads)
    last_match_kernel(UnitKeys unit, int length, int head_dim, float threshold, bool faithful,
                      unsigned long long* __restrict__ spared) {  // [batch, kv_heads, length]
  constexpr int kRowsPerThread = kRowTile / 16, kColsPerThread = kColTile / 16;
  static_assert(kRowsPerThread % 4 == 0 && kColsPerThread == 4, "float4 shared loads");
  __shared__ __align__(16) float rows_t[kDimChunk][kRowTile + 4];
  __shared__ __align__(16) float cols_t[kDimChunk][kColTile + 4];
  __shared__ int match[kRowTile];      // r_i of the tile's rows; -1 while still searching
  __shared__ int tile_best[kRowTile];  // last match inside the current column tile, -1: none
  const int b = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y;
  const int i0 = blockIdx.x * kRowTile;
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const std::int64_t bh = static_cast<std::int64_t>(b) * kv_heads + h;
  unsigned long long* sp = spared + bh * length;
  const UnitHead<T> head = unit_head<T>(unit, bh);
  if (threadIdx.x < kRowTile) {
    match[threadIdx.x] =
        i0 + static_cast<int>(threadIdx.x) < length ? -1 : length;  // past end: done
    tile_best[threadIdx.x] = -1;
  }
  for (int jt = (length - 1) / kColTile; jt >= 0; --jt) {
    const int j0 = jt * kColTile;
    float acc[kRowsPerThread][kColsPerThread];
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) acc[r][c] = 0.0f;
    for (int d0 = 0; d0 < head_dim; d0 += kDimChunk) {
      __syncthreads();  // previous slice consumed (and, the first time, match[] initialised)
      stage_tile<kRowTile>(rows_t, head, i0, length, d0, head_dim);
      stage_tile<kColTile>(cols_t, head, j0, length, d0, head_dim);
      __syncthreads();
#pragma unroll
      for (int d = 0; d < kDimChunk; ++d) {
        float av[kRowsPerThread];
#pragma unroll
        for (int r = 0; r < kRowsPerThread; r += 4) {
          const float4 a = *reinterpret_cast<const float4*>(&rows_t[d][ty * kRowsPerThread + r]);
          av[r] = a.x, av[r + 1] = a.y, av[r + 2] = a.z, av[r + 3] = a.w;
        }
        const float4 c = *reinterpret_cast<const float4*>(&cols_t[d][tx * kColsPerThread]);
        const float cv[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
          for (int q = 0; q < kColsPerThread; ++q) acc[r][q] = fmaf(av[r], cv[q], acc[r][q]);
      }
    }
    // The last column of this tile above the threshold, per still-open row (max is order-free).
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = ty * kRowsPerThread + r, i = i0 + row;
      if (match[row] >= 0) continue;
#pragma unroll
      for (int c = kColsPerThread - 1; c >= 0; --c) {
        const int j = j0 + tx * kColsPerThread + c;
        if (j < length && j != i && acc[r][c] > threshold) {
          atomicMax(&tile_best[row], j);
          break;
        }
      }
    }
    __syncthreads();
    // The owner of (i, r_i) spares that cosine; faithful mode spares C[i, 0] of unmatched rows.
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = ty * kRowsPerThread + r, i = i0 + row;
      if (match[row] >= 0) continue;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        const int j = j0 + tx * kColsPerThread + c;
        if (j >= length) continue;
        if (tile_best[row] == j) {
          add_fixed(&sp[j], acc[r][c]);
        } else if (faithful && j == 0 && tile_best[row] < 0 && i != 0) {
          add_fixed(&sp[0], acc[r][c]);  // j == 0: this is the last tile, the row never matched
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < kRowTile) {
      if (match[threadIdx.x] < 0 && tile_best[threadIdx.x] >= 0)
        match[threadIdx.x] = tile_best[threadIdx.x];
      tile_best[threadIdx.x] = -1;
    }
    // Early exit: every row of the tile has found its last match.
    if (__syncthreads_and(threadIdx.x >= kRowTile || match[threadIdx.x] >= 0)) break;
  }
}

// Partial sums of k̂ over chunks of kKeySumRows rows: grid (chunks, kv_heads, batch). Warp w
// sums rows w, w + 8, ... of the chunk for 32 × 8 channels per pass (lane + 32·m), then the 8 warp
// sums are added in warp order, so the result does not depend on scheduling.
template <class T>
__global__ void __launch_bounds__(kBlockThreads) unit_key_partial_sums_kernel(
    UnitKeys unit, int length, int head_dim,
    float* __restrict__ partial) {              // [batch, kv_heads, chunks, head_dim]
  constexpr int kPerLane = kBlockThreads / 32;  // channels per lane and pass
  __shared__ float warp_sums[kWarps][kBlockThreads];
  const int b = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y, chunk = blockIdx.x;
  const int chunks = gridDim.x;
  const std::int64_t bh = static_cast<std::int64_t>(b) * kv_heads + h;
  float* out = partial + (bh * chunks + chunk) * head_dim;
  const UnitHead<T> head = unit_head<T>(unit, bh);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = chunk * kKeySumRows, last = min(length, first + kKeySumRows);
  for (int d_base = 0; d_base < head_dim; d_base += kBlockThreads) {
    float acc[kPerLane];
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) acc[m] = 0.0f;
    for (int i = first + warp; i < last; i += kWarps) {
      const UnitRow<T> row = head.row(i);
#pragma unroll
      for (int m = 0; m < kPerLane; ++m) {
        const int d = d_base + lane + 32 * m;
        if (d < head_dim) acc[m] += row[d];
      }
    }
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) warp_sums[warp][lane + 32 * m] = acc[m];
    __syncthreads();
    const int d = d_base + static_cast<int>(threadIdx.x);
    if (d < head_dim) {
      float t = 0.0f;
      for (int w = 0; w < kWarps; ++w) t += warp_sums[w][threadIdx.x];
      out[d] = t;
    }
    __syncthreads();  // warp_sums is rewritten by the next pass
  }
}

// rbar_j = (total·k̂_j − k̂_j·k̂_j − spared_j) / S for kColumnsPerBlock columns: grid (column
// blocks, kv_heads, batch). total = sum of the partial sums in chunk order; one warp per column.
template <class T>
__global__ void __launch_bounds__(kBlockThreads)
    column_means_kernel(UnitKeys unit,
                        const unsigned long long* __restrict__ spared,  // [batch, kv_heads, length]
                        const float* __restrict__ partial,  // [batch, kv_heads, chunks, head_dim]
                        int chunks, int length, int head_dim,
                        float* __restrict__ rbar) {  // [batch, kv_heads, length]
  extern __shared__ float total[];                   // [head_dim]: sum_i k̂_i
  const int b = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y;
  const std::int64_t bh = static_cast<std::int64_t>(b) * kv_heads + h;
  const unsigned long long* sp = spared + bh * length;
  const float* part = partial + bh * chunks * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += kBlockThreads) {
    float t = 0.0f;
    for (int c = 0; c < chunks; ++c) t += part[c * head_dim + d];
    total[d] = t;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j0 = blockIdx.x * kColumnsPerBlock, j1 = min(length, j0 + kColumnsPerBlock);
  const UnitHead<T> head = unit_head<T>(unit, bh);
  for (int j = j0 + warp; j < j1; j += kWarps) {
    // k̂_j·total = (K_j·total) / den_j and k̂_j·k̂_j = (K_j·K_j) / den_j²: one division per row
    // instead of one per channel (a few float roundings away from dividing first, well inside
    // the 1e-4 parity tolerance of R).
    const UnitRow<T> row = head.row(j);
    float dot = 0.0f, sq = 0.0f;
    for (int d = lane; d < head_dim; d += 32) {
      const float x = to_float(row.k[d]);
      dot = fmaf(x, total[d], dot);
      sq = fmaf(x, x, sq);
    }
    dot = warp_sum(dot);
    sq = warp_sum(sq);
    if (lane == 0) {
      const float own = row.den == 0.0f ? 0.0f : dot / row.den - sq / (row.den * row.den);
      rbar[bh * length + j] = (own - fixed_to_float(sp[j])) / static_cast<float>(length);
    }
  }
}

// The sum of the chunk partials of channel d, in chunk order (the order column_means_kernel
// uses, so both produce the same total), four loads in flight at a time.
__device__ __forceinline__ float chunk_total(const float* __restrict__ part, int chunks,
                                             int head_dim, int d) {
  float t = 0.0f;
  int c = 0;
  for (; c + 4 <= chunks; c += 4) {
    const float p0 = part[c * head_dim + d], p1 = part[(c + 1) * head_dim + d];
    const float p2 = part[(c + 2) * head_dim + d], p3 = part[(c + 3) * head_dim + d];
    t += p0;
    t += p1;
    t += p2;
    t += p3;
  }
  for (; c < chunks; ++c) t += part[c * head_dim + d];
  return t;
}

// column_means_kernel with 16-byte row reads (key_vec.cuh; the host checked the alignment):
// grid (column blocks of kVecColumns, kv_heads, sequences). Group g (G lanes) takes columns g,
// g + kGroups, ... of the block, lane c channels 8c .. 8c + 7; the dot products are summed per
// lane then across the group (another order than column_means_kernel's, same tolerance).
constexpr int kVecColumns = 128;  // columns of rbar per block
template <class T, int G>
__global__ void __launch_bounds__(kBlockThreads) column_means_vec_kernel(
    StepBases keys,                                 // per layer [batch, kv_heads, capacity, D]
    std::int64_t stride_h, std::int64_t stride_s,   // elements
    const float* __restrict__ denom,                // [sequences, kv_heads, length]
    const unsigned long long* __restrict__ spared,  // [sequences, kv_heads, length]
    const float* __restrict__ partial,              // [sequences, kv_heads, chunks, head_dim]
    int chunks, int length, int head_dim,
    float* __restrict__ rbar) {  // [sequences, kv_heads, length]
  constexpr int kGroups = kBlockThreads / G;
  constexpr int kIters = (kVecColumns + kGroups - 1) / kGroups;
  constexpr int kBatchCap = sizeof(T) == 4 ? 4 : 8;
  constexpr int kBatch = kIters < kBatchCap ? kIters : kBatchCap;
  static_assert(kIters % kBatch == 0, "whole batches of rows");
  __shared__ __align__(16) float total[kVecMaxDim];  // sum_i k̂_i
  const int z = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y;
  const std::int64_t bh = static_cast<std::int64_t>(z) * kv_heads + h;
  const int g = static_cast<int>(threadIdx.x) / G, c = static_cast<int>(threadIdx.x) % G;
  const int vectors = head_dim / kVecChannels;
  const T* kbase = keys.seq<const T>(z) + h * stride_h;
  const int j0 = blockIdx.x * kVecColumns, j1 = min(length, j0 + kVecColumns);
  // A batch of rows: their key vectors and, for the lane that finishes each row (lane u % G of
  // the group finishes row u of the batch), its divisor and spared sum, all issued before any is
  // used. Loaded one row at a time after the row's dot products, on lane 0 alone, with lane 0 then
  // dividing row after row, these were most of the kernel's stalls (ncu, bench/RESULTS.md run 85).
  constexpr int kRowsPerLane = (kBatch + G - 1) / G;
  RawVec<T> raw[kBatch];
  float den[kRowsPerLane];
  unsigned long long sp[kRowsPerLane];
  const auto row_of = [&](int it0, int u) { return j0 + g + (it0 + u) * kGroups; };
  const auto load_batch = [&](int it0) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int j = row_of(it0, u);
      raw[u] = (j < j1 && c < vectors) ? load_vec(kbase + j * stride_s, c) : zero_vec<T>();
    }
#pragma unroll
    for (int k = 0; k < kRowsPerLane; ++k) {
      const int u = c + k * G, j = row_of(it0, u);
      const bool mine = u < kBatch && j < j1;
      den[k] = mine ? denom[bh * length + j] : 0.0f;
      sp[k] = mine ? spared[bh * length + j] : 0ull;
    }
  };
  load_batch(0);  // in flight while the chunk sums are added
  const float* part = partial + bh * chunks * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += kBlockThreads)
    total[d] = chunk_total(part, chunks, head_dim, d);
  __syncthreads();
  // This lane's 8 channels of the total (zeros past head_dim: those lanes read zero keys).
  float tot[kVecChannels];
#pragma unroll
  for (int k = 0; k < kVecChannels; ++k) tot[k] = c < vectors ? total[c * kVecChannels + k] : 0.0f;
#pragma unroll
  for (int it0 = 0; it0 < kIters; it0 += kBatch) {
    if (it0 > 0) load_batch(it0);
    float dot[kBatch], sq[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      float x[kVecChannels];
      unpack_vec(raw[u], x);
      dot[u] = 0.0f;
      sq[u] = 0.0f;
#pragma unroll
      for (int k = 0; k < kVecChannels; ++k) {
        dot[u] = fmaf(x[k], tot[k], dot[u]);
        sq[u] = fmaf(x[k], x[k], sq[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {  // every lane of the group gets every row's sums
      dot[u] = group_sum<G>(dot[u]);
      sq[u] = group_sum<G>(sq[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int j = row_of(it0, u);
      if (u % G != c || j >= j1) continue;
      // As column_means_kernel: k̂_j·total = (K_j·total) / den_j, k̂_j·k̂_j = (K_j·K_j) / den_j².
      const float dj = den[u / G];
      const float own = dj == 0.0f ? 0.0f : dot[u] / dj - sq[u] / (dj * dj);
      rbar[bh * length + j] = (own - fixed_to_float(sp[u / G])) / static_cast<float>(length);
    }
  }
}

template <class T, int G>
void launch_column_means_vec(const StepView& step, int length, const float* denom,
                             const unsigned long long* spared, const float* partial, float* rbar,
                             cudaStream_t stream) {
  const KVCacheView& kv = step.first();
  const dim3 grid(static_cast<unsigned>((length + kVecColumns - 1) / kVecColumns),
                  static_cast<unsigned>(kv.kv_heads()), static_cast<unsigned>(step.sequences()));
  column_means_vec_kernel<T, G><<<grid, kBlockThreads, 0, stream>>>(
      key_bases(step), kv.keys.stride[1], kv.keys.stride[2], denom, spared, partial,
      key_sum_chunks(length), length, static_cast<int>(kv.head_dim()), rbar);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

// R = softmax(rbar) over all S, in place, one block per (b, h) (§1.2 step 5). The row is read
// back after barriers by the same block, so it is not a read-only pointer.
__global__ void __launch_bounds__(kBlockThreads)
    redundancy_softmax_kernel(int length, float* redundancy) {  // [batch * kv_heads, length]
  using Reduce = cub::BlockReduce<float, kBlockThreads>;
  __shared__ typename Reduce::TempStorage reduce_tmp;
  __shared__ float stat;
  float* out = redundancy + static_cast<std::int64_t>(blockIdx.x) * length;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < length; j += kBlockThreads) m = fmaxf(m, out[j]);
  m = Reduce(reduce_tmp).Reduce(m, MaxOp{});
  if (threadIdx.x == 0) stat = m;
  __syncthreads();
  m = stat;
  float s = 0.0f;
  for (int j = threadIdx.x; j < length; j += kBlockThreads) s += expf(out[j] - m);
  s = Reduce(reduce_tmp).Sum(s);
  __syncthreads();  // every thread has read `stat` as the max before it becomes the sum
  if (threadIdx.x == 0) stat = s;
  __syncthreads();
  s = stat;
  for (int j = threadIdx.x; j < length; j += kBlockThreads) out[j] = expf(out[j] - m) / s;
}

}  // namespace

UnitKeys unit_keys_of(const StepView& step, int length, const float* denom) {
  const KVCacheView& kv = step.first();
  return UnitKeys{
      key_bases(step), kv.keys.stride[1], kv.keys.stride[2], denom, static_cast<int>(kv.kv_heads()),
      length};
}

void launch_key_rows_scalar(const StepView& step, int length, float* denom, void* unit16,
                            float* partial, cudaStream_t stream) {
  const KVCacheView& kv = step.first();
  const int batch = step.sequences(), kv_heads = static_cast<int>(kv.kv_heads());
  const int head_dim = static_cast<int>(kv.head_dim());
  const std::int64_t rows = static_cast<std::int64_t>(batch) * kv_heads * length;
  require_unit16_scope(unit16, head_dim);
  if (rows == 0) return;
  const KeyStrides ks{kv.keys.stride[1], kv.keys.stride[2]};
  const UnitKeys unit = unit_keys_of(step, length, denom);
  const dim3 grid(static_cast<unsigned>(key_sum_chunks(length)), static_cast<unsigned>(kv_heads),
                  static_cast<unsigned>(batch));
  auto* u16 = static_cast<__half*>(unit16);
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    if (head_dim <= kFusedMaxDim) {  // normalisation and key sums in one kernel
      normalize_and_sum_kernel<T><<<grid, kBlockThreads, 0, stream>>>(
          unit.keys, ks, kv.valid_mask, kv.capacity(), length, head_dim, denom, u16, partial);
      KVSIFT_CUDA_CHECK(cudaGetLastError());
      return;
    }
    normalize_keys_kernel<T>
        <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kBlockThreads, 0, stream>>>(
            unit.keys, ks, kv.valid_mask, kv.capacity(), kv_heads, length, head_dim, rows, denom);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
    unit_key_partial_sums_kernel<T>
        <<<grid, kBlockThreads, 0, stream>>>(unit, length, head_dim, partial);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  });
}

void launch_column_means(const StepView& step, int length, const float* denom,
                         const unsigned long long* spared, const float* partial, float* rbar,
                         bool vectorized, cudaStream_t stream) {
  const KVCacheView& kv = step.first();
  const int batch = step.sequences(), kv_heads = static_cast<int>(kv.kv_heads());
  const int head_dim = static_cast<int>(kv.head_dim());
  if (static_cast<std::int64_t>(batch) * kv_heads * length == 0) return;
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    if (vectorized) {
      switch (vec_group_lanes(head_dim)) {
        case 2:
          return launch_column_means_vec<T, 2>(step, length, denom, spared, partial, rbar, stream);
        case 4:
          return launch_column_means_vec<T, 4>(step, length, denom, spared, partial, rbar, stream);
        case 8:
          return launch_column_means_vec<T, 8>(step, length, denom, spared, partial, rbar, stream);
        case 16:
          return launch_column_means_vec<T, 16>(step, length, denom, spared, partial, rbar, stream);
        default:
          return launch_column_means_vec<T, 32>(step, length, denom, spared, partial, rbar, stream);
      }
    }
    const UnitKeys unit = unit_keys_of(step, length, denom);
    const dim3 grid(static_cast<unsigned>((length + kColumnsPerBlock - 1) / kColumnsPerBlock),
                    static_cast<unsigned>(kv_heads), static_cast<unsigned>(batch));
    const std::size_t total_bytes = static_cast<std::size_t>(head_dim) * sizeof(float);
    column_means_kernel<T><<<grid, kBlockThreads, total_bytes, stream>>>(
        unit, spared, partial, key_sum_chunks(length), length, head_dim, rbar);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  });
}

bool launch_key_redundancy(const StepView& step, int length, float threshold, bool faithful,
                           float* denom, void* unit16, int* tc_reached, unsigned long long* spared,
                           float* partial, float* redundancy, cudaStream_t stream,
                           float* window_logits) {
  const KVCacheView& kv = step.first();
  // Every kernel after the normalisation works on [sequences, kv_heads, ...] rows.
  const int batch = step.sequences(), kv_heads = static_cast<int>(kv.kv_heads());
  const int head_dim = static_cast<int>(kv.head_dim());
  const std::int64_t rows = static_cast<std::int64_t>(batch) * kv_heads * length;
  const UnitKeys unit = unit_keys_of(step, length, denom);
  const bool vectorized = key_rows_vectorizable(step);
  KVSIFT_CUDA_CHECK(
      cudaMemsetAsync(spared, 0, static_cast<std::size_t>(rows) * sizeof(*spared), stream));
  // Norms, the fp16 copy and the key sums: the one pass of key_pass.cu when the layout allows
  // its 16-byte accesses (the common case), the scalar kernels otherwise.
  bool logits_written = false;
  if (!launch_key_pass(step, length, denom, unit16, partial, stream, window_logits,
                       &logits_written))
    launch_key_rows_scalar(step, length, denom, unit16, partial, stream);
  if (unit16 != nullptr) {  // the tensor-core search: same r_i and spared sums, faster
    // r_i go to `redundancy` as scratch (int-sized), written for real further down.
    launch_last_match_tc(unit, kv.dtype(), unit16, batch, kv_heads, length, head_dim, threshold,
                         faithful, vectorized, spared, reinterpret_cast<int*>(redundancy),
                         tc_reached, stream);
  } else {
    KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
      const dim3 grid(static_cast<unsigned>((length + kRowTile - 1) / kRowTile),
                      static_cast<unsigned>(kv_heads), static_cast<unsigned>(batch));
      last_match_kernel<T>
          <<<grid, kBlockThreads, 0, stream>>>(unit, length, head_dim, threshold, faithful, spared);
      KVSIFT_CUDA_CHECK(cudaGetLastError());
    });
  }
  launch_column_means(step, length, denom, spared, partial, redundancy, vectorized, stream);
  redundancy_softmax_kernel<<<static_cast<unsigned>(batch * kv_heads), kBlockThreads, 0, stream>>>(
      length, redundancy);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
  return logits_written;
}

}  // namespace kvsift::cuda::detail
