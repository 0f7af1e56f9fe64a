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
//      Its blocks stay resident and loop over tiles of 64 rows, each tile loaded while the one
//      before is worked on (bench/RESULTS.md runs 121–122).
//   5. redundancy_softmax_kernel: R = softmax(rbar) over all S (step 5), one block per (b, h).
// Steps 3–4 are spread over many blocks: at batch 1 one block per (b, h) would leave the GPU
// idle and be bound by memory latency.
#include <cuda_fp16.h>

#include <algorithm>
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

// column_means_kernel with 16-byte row reads (key_vec.cuh; the host checked the alignment). The
// rows are cut into tiles of one (sequence, head), tile t = bh · tiles_per_head + k holding rows
// k·tile .. k·tile + tile − 1 of head bh; the grid is as many blocks as fit on the GPU at once, and
// block b takes a contiguous run of tiles, loading the next tile's rows before it works on the
// current one. One block per tile (the earlier layout) spent most of its life in latency chains
// (launch, the loads, the total, the sums, the stores) with nothing else of its own in flight: the
// kernel read the keys at about half the copy bandwidth (bench/RESULTS.md runs 85, 120).
// Group g (G lanes) takes rows g, g + kGroups, ... of a tile, lane c channels 8c .. 8c + 7; the dot
// products are summed per lane then across the group (another order than column_means_kernel's,
// same tolerance) by group_sum_scatter: with every lane summing every row (group_sum), the
// shuffles and additions outnumbered the products and took the issue slots the loads needed
// (run 122: SM throughput 58 % -> 52 %, DRAM 63 % -> 76 %).
constexpr int kVecTileRows = 64;  // rows of a tile (at least one per group)

template <class T, int G>
struct ColumnTile {
  static constexpr int kGroups = kBlockThreads / G;
  static constexpr int kPer = kVecTileRows > kGroups ? kVecTileRows / kGroups : 1;  // rows a group
  static constexpr int kRows = kGroups * kPer;
  static constexpr int kLanesPerRow = G / kPer;  // lanes left holding a row's sums
  static_assert(G % kPer == 0, "a group's rows end on whole sets of its lanes");
  // The rows' key vectors and, for the lane that finishes a row (lane c finishes row
  // c / kLanesPerRow if kLanesPerRow divides c), its divisor and spared sum, all issued before
  // any is used.
  RawVec<T> raw[kPer];
  float den;
  unsigned long long sp;
};

// The sums over the G lanes of a group of n (dot, sq) pairs, with group_sum's additions in its
// order (levels G/2, G/4, .., 1, each lane adding its partner's value to its own), so with the
// same bits, but scattered: while a lane holds several pairs it keeps half of them and sends the
// other half, so a level exchanges half as many values. At the end lane c holds pair
// c / (G / n) in dot[0], sq[0]. For n = 4 rows at G = 16: 10 shuffles a lane instead of 32.
template <int G, int n>
__device__ __forceinline__ void group_sum_scatter(float (&dot)[n], float (&sq)[n], int c) {
  int m = n;  // pairs still held: a compile-time count once unrolled
#pragma unroll
  for (int off = G / 2; off > 0; off /= 2) {
    if (m > 1) {
      const bool upper = (c & off) != 0;  // keeps the upper half of the pairs
#pragma unroll
      for (int i = 0; i < n / 2; ++i) {
        if (i >= m / 2) break;
        const float send_d = upper ? dot[i] : dot[i + m / 2];
        const float send_s = upper ? sq[i] : sq[i + m / 2];
        const float keep_d = upper ? dot[i + m / 2] : dot[i];
        const float keep_s = upper ? sq[i + m / 2] : sq[i];
        dot[i] = keep_d + __shfl_xor_sync(0xffffffffu, send_d, off);
        sq[i] = keep_s + __shfl_xor_sync(0xffffffffu, send_s, off);
      }
      m /= 2;
    } else {
      dot[0] += __shfl_xor_sync(0xffffffffu, dot[0], off);
      sq[0] += __shfl_xor_sync(0xffffffffu, sq[0], off);
    }
  }
}

template <class T, int G>
__global__ void __launch_bounds__(kBlockThreads) column_means_vec_kernel(
    StepBases keys,                                 // per layer [batch, kv_heads, capacity, D]
    std::int64_t stride_h, std::int64_t stride_s,   // elements
    const float* __restrict__ denom,                // [sequences, kv_heads, length]
    const unsigned long long* __restrict__ spared,  // [sequences, kv_heads, length]
    const float* __restrict__ partial,              // [sequences, kv_heads, chunks, head_dim]
    int chunks, int length, int head_dim, int kv_heads, int tiles_per_head, int tiles,
    float* __restrict__ rbar) {  // [sequences, kv_heads, length]
  using Tile = ColumnTile<T, G>;
  constexpr int kGroups = Tile::kGroups, kPer = Tile::kPer;
  __shared__ __align__(16) float total[kVecMaxDim];  // sum_i k̂_i of head `total_bh`
  const int g = static_cast<int>(threadIdx.x) / G, c = static_cast<int>(threadIdx.x) % G;
  const int vectors = head_dim / kVecChannels;
  const auto head_of = [&](int t) { return static_cast<std::int64_t>(t / tiles_per_head); };
  const auto row_of = [&](int t, int u) {
    return (t % tiles_per_head) * Tile::kRows + g + u * kGroups;
  };
  const auto load = [&](int t, Tile& tile) {
    const std::int64_t bh = head_of(t);
    const T* kbase =
        keys.seq<const T>(static_cast<int>(bh / kv_heads)) + (bh % kv_heads) * stride_h;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int j = row_of(t, u);
      tile.raw[u] = (j < length && c < vectors) ? load_vec(kbase + j * stride_s, c) : zero_vec<T>();
    }
    const int j = row_of(t, c / Tile::kLanesPerRow);
    const bool mine = c % Tile::kLanesPerRow == 0 && j < length;
    tile.den = mine ? denom[bh * length + j] : 0.0f;
    tile.sp = mine ? spared[bh * length + j] : 0ull;
  };
  // Block b's tiles: [t_begin, t_end), contiguous, so its head changes at most a few times.
  const int t_begin = static_cast<int>(static_cast<std::int64_t>(blockIdx.x) * tiles / gridDim.x);
  const int t_end = static_cast<int>(static_cast<std::int64_t>(blockIdx.x + 1) * tiles / gridDim.x);
  std::int64_t total_bh = -1;
  float tot[kVecChannels];  // this lane's 8 channels of the total (zeros past head_dim)
  const auto work = [&](int t, const Tile& tile) {
    const std::int64_t bh = head_of(t);
    if (bh != total_bh) {  // the same for the whole block
      __syncthreads();     // every lane has its copy of the previous head's total
      const float* part = partial + bh * chunks * head_dim;
      for (int d = threadIdx.x; d < head_dim; d += kBlockThreads)
        total[d] = chunk_total(part, chunks, head_dim, d);
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kVecChannels; ++k)
        tot[k] = c < vectors ? total[c * kVecChannels + k] : 0.0f;
      total_bh = bh;
    }
    float dot[kPer], sq[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      float x[kVecChannels];
      unpack_vec(tile.raw[u], x);
      dot[u] = 0.0f;
      sq[u] = 0.0f;
#pragma unroll
      for (int k = 0; k < kVecChannels; ++k) {
        dot[u] = fmaf(x[k], tot[k], dot[u]);
        sq[u] = fmaf(x[k], x[k], sq[u]);
      }
    }
    group_sum_scatter<G>(dot, sq, c);
    const int j = row_of(t, c / Tile::kLanesPerRow);
    if (c % Tile::kLanesPerRow == 0 && j < length) {
      // As column_means_kernel: k̂_j·total = (K_j·total) / den_j, k̂_j·k̂_j = (K_j·K_j) / den_j².
      const float dj = tile.den;
      const float own = dj == 0.0f ? 0.0f : dot[0] / dj - sq[0] / (dj * dj);
      rbar[bh * length + j] = (own - fixed_to_float(tile.sp)) / static_cast<float>(length);
    }
  };
  // Two tiles in registers, each loaded while the other is worked on.
  Tile a, b;
  if (t_begin < t_end) load(t_begin, a);
  for (int t = t_begin; t < t_end; t += 2) {
    if (t + 1 < t_end) load(t + 1, b);
    work(t, a);
    if (t + 2 < t_end) load(t + 2, a);
    if (t + 1 < t_end) work(t + 1, b);
  }
}

// Blocks of `kernel` (kBlockThreads threads, static shared memory) resident on the current
// device at once.
template <class Kernel>
int resident_blocks(Kernel kernel) {
  int device = 0, sms = 0, per_sm = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  KVSIFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KVSIFT_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, 0));
  return sms * (per_sm > 0 ? per_sm : 1);
}

template <class T, int G>
void launch_column_means_vec(const StepView& step, int length, const float* denom,
                             const unsigned long long* spared, const float* partial, float* rbar,
                             cudaStream_t stream) {
  const KVCacheView& kv = step.first();
  const int kv_heads = static_cast<int>(kv.kv_heads());
  const int tiles_per_head = (length + ColumnTile<T, G>::kRows - 1) / ColumnTile<T, G>::kRows;
  const std::int64_t tiles =
      static_cast<std::int64_t>(step.sequences()) * kv_heads * tiles_per_head;
  KVSIFT_CHECK(tiles <= INT32_MAX, "column means: ", tiles, " tiles of ", ColumnTile<T, G>::kRows,
               " rows exceed the 32-bit tile index");
  const auto kernel = column_means_vec_kernel<T, G>;
  const int blocks = static_cast<int>(std::min<std::int64_t>(tiles, resident_blocks(kernel)));
  kernel<<<blocks, kBlockThreads, 0, stream>>>(
      key_bases(step), kv.keys.stride[1], kv.keys.stride[2], denom, spared, partial,
      key_sum_chunks(length), length, static_cast<int>(kv.head_dim()), kv_heads, tiles_per_head,
      static_cast<int>(tiles), rbar);
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
