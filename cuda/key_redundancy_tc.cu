// Tensor-core last-match search of R-KV's key redundancy (docs/algorithms.md §1.2 step 3 and its
// cost note), selected by RKVConfig::tensor_core_search. It finds, for every row i, the same
//   r_i = max{ j != i : C[i,j] > threshold }
// as last_match_kernel in key_redundancy.cu, bit for bit, and spares the same fp32 cosines.
//
// How: 256×64 tiles of the cosine matrix are computed on the tensor cores from fp16 copies of
// the unit keys (written once by the normalisation as the tiles' byte images, tc_unit_images.cuh;
// fp32 accumulate), from the sequence end
// backwards, and a block of 256 rows stops once each of its rows has its answer. On Hopper
// (sm_90a code: CMakeLists.txt adds it to this file) each warpgroup multiplies its 128 rows by
// wgmma from shared memory; elsewhere each warp its 32 rows by ldmatrix + mma.sync m16n8k16.
// Both give the same fp32 accumulations up to the hardware's summation order, which the margin
// below covers, and the same answers (tests/cuda/test_redundancy_tc_cuda.cpp, run on both). C is
// symmetric, so in the worst case (no row matches) each tile pair is computed once, not twice:
// phase 1 searches the columns right of a block's rows and hands each column its last match among
// those rows; phase 2 searches what is left of the lower triangle (details above
// last_match_tc_kernel). A low-precision cosine c̃ decides on its own only when it is clearly away
// from the threshold t:
//   c̃ > t + m: a match;   c̃ <= t − m: no match;   otherwise: recomputed in exact fp32
// with the fp32 path's arithmetic (a sequential fmaf chain over d = 0 .. D−1 from 0.0f), whose
// comparison is final. Most of those pairs never run the chain: a cheap fp32 cosine within a
// proven m_f ≈ 9.2e-6 of the chain's value (cosine_filter.cuh) decides all farther from t.
// The spared cosine C[i, r_i] (and, faithful, C[i, 0]) is always recomputed with the chain
// (spare_kernel, after the search), so the fixed-point column sums are identical too.
//
// Why fp16 and not bf16: a unit key's channels lie in [−1, 1], where fp16's 11 significant bits
// lose nothing to range, so the rounding term of m is 2^-10 instead of bf16's 2^-7 — a margin
// ~7.6× narrower, and ~7.6× fewer exact re-checks on keys whose cosines crowd the threshold (real
// keys share a head direction). The tensor cores run both types at the same rate.
//
// The bound m (tc_cosine_margin below). Let u, v be the fp32 unit keys (||u||, ||v|| <= 1 + 2^-10:
// the normalisation's own rounding is ~D·2^-25 relative for D <= 4096), A = Σ_d |u_d v_d| <= N²
// with N² = 1.002, and c32 the fp32 path's value.
//   1. fp16 rounding (unit roundoff 2^-11) of x·(1/den), itself within 2^-22 relative of the fp32
//      u_d = x/den (two roundings): ū_d = u_d(1 + α_d) + η_d, |α_d| <= 2^-11 + 2^-21, and below
//      fp16's normal range (|u_d| < 2^-14) an absolute |η_d| <= 2^-25. Per channel
//      |ū_d v̄_d − u_d v_d| <= (2α + α²)|u_d v_d| + η(1 + α)(|u_d| + |v_d|) + η², so
//      |ū·v̄ − u·v| <= (2^-10 + 2^-20 + 2^-21)·A + D·2^-23 (|u_d|, |v_d| <= N: generous).
//   2. tensor-core accumulation: products of two fp16 are exact in fp32; however the hardware
//      orders, aligns and truncates the D additions, each term is hit by at most two roundings of
//      at most 2^-23 relative to a partial sum bounded by P = Σ|ū_d v̄_d| <= (1 + 2^-11)²·A (+ the
//      η terms, covered by the 1.01 below), so the error is <= 2·D·2^-23·P = D·2^-22·P (Higham's
//      recursive-summation bound with RZ's 2^-23 and every term counted twice: deliberately
//      generous).
//   3. the fp32 path itself: |c32 − u·v| <= D·2^-24·A·(1 + D·2^-24) (fma chain, one rounding per
//      step).
// m = N²·[(2^-10 + 2^-20 + 2^-21) + D·2^-22·(1 + 2^-11)²·1.01 + D·2^-24·1.01] + D·2^-23 + 2^-100,
// then t ± m is rounded outwards to float. D = 128: m ≈ 0.001034 (bf16 copies needed 0.00788), so
// random keys (cosines ~ N(0, 1/D)) are almost never rechecked; NaN cosines fail both comparisons,
// as they fail c32 > t.
//
// Scope: head_dim <= 128 and a multiple of 4 (the images hold 64 or 128 channels, zero past it);
// other head_dims use the fp32 path (tc_search_supported()).
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "bulk_copy.cuh"
#include "cosine_filter.cuh"
#include "key_vec.cuh"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"
#include "mma.cuh"
#include "rkv_kernels.cuh"
#include "tc_unit_images.cuh"
#include "wgmma.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kTcThreads = 256;              // 8 warps
constexpr int kTcWarpRows = 32;              // rows per warp: two m16 tiles
constexpr int kTcRowTile = 8 * kTcWarpRows;  // 256 rows per block: one per thread
constexpr int kTcColTile = 64;               // columns per tile: eight n8 tiles per warp
constexpr int kTcTilesPerRowTile = kTcRowTile / kTcColTile;  // 4
constexpr int kTcMaxDim = 128;                               // head_dim of the staged fp16 rows
constexpr int kTcKSteps = kTcMaxDim / 16;
constexpr int kTcHalfDim = 64;  // channels per staged row piece: 128 bytes, one swizzle row
constexpr int kTcHalves = kTcMaxDim / kTcHalfDim;
// Phase 1's deferred re-checks (resolve_deferred): room for this many pairs a block (4 KiB), a
// resolution once half of it is taken; a pair that finds it full is re-checked where it is found.
constexpr int kTcPairSlots = 512;
constexpr int kTcColumnPair = 1 << 8;  // tag of a column's pair; a row's tag is its row (< 256)
static_assert(kTcRowTile == kTcThreads, "one thread per row for the tile bookkeeping");
static_assert(kTcLengthQuantum % kTcRowTile == 0, "every row tile lies inside the images");

// Shared memory of one block (dynamic: 105 KiB with the alignment slack, two blocks per SM): the
// block's rows once, the column tiles double-buffered (the next one arrives during the current
// multiply). Channels 0–63 and 64–127 of the rows are stored apart, as 128-byte rows with the
// 128-byte swizzle (wgmma.cuh): the layout wgmma reads, conflict-free for ldmatrix, and the
// layout of the tile images in global memory (tc_unit_images.cuh), so a tile is copied as is.
struct TcShared {
  alignas(1024) __half rows[kTcHalves][kTcRowTile * kTcHalfDim];  // by row slot (tc_row_slot)
  alignas(1024) __half cols[2][kTcHalves][kTcColTile * kTcHalfDim];
  std::uint64_t landed[2];    // bulk copies: phase completes when cols[b] (first: + rows) landed
  int match[kTcRowTile];      // final r_i of the tile's rows; -1 while still searching
  int cand[kTcRowTile];       // best match known so far of a row still searching
  int tile_best[kTcRowTile];  // last match inside the current column tile, -1: none
  int2 pairs[kTcPairSlots];   // phase 1's deferred re-checks: {j, row or row | kTcColumnPair}
  int pair_count;             // pairs offered since the last resolution (past the slots: full)
  unsigned char pending[kTcRowTile];  // 1: the row has a deferred pair not resolved yet
  // Offers of one tile, read after its barrier: kOffered, kCrowded. Three sets, tiles in turn:
  // thread 0 clears the next tile's set before this tile's barrier, when every thread has read it
  // (two barriers ago) and none can write it yet (after this barrier).
  int offer_flags[3];
};
static_assert(kTcColTile == kTcImageRows && kTcHalfDim == kTcImageChannels,
              "a column tile is one tile image");

// The shared-memory slot of row r (0 .. 255) of a block. Warpgroup wg's two m64 products cover
// slots 128wg + 64mt .. + 63, of which warp w's fragments hold slots + 16w .. + 16w + 15; storing
// row 128wg + 32w + 16mt + k in slot 128wg + 64mt + 16w + k gives warp 4wg + w the rows
// 32(4wg + w) .. + 31, two m16 tiles, exactly as the mma.sync path has them.
__device__ __forceinline__ int tc_row_slot(int r) {
  return (r & ~127) | (((r >> 4) & 1) << 6) | (((r >> 5) & 3) << 4) | (r & 15);
}

// Address of channels 8·chunk .. 8·chunk + 7 of row `slot` in a tile stored as kTcHalves
// swizzled regions of kRows rows each.
template <int kRows>
__device__ __forceinline__ __half* tc_chunk(__half (&tile)[kTcHalves][kRows * kTcHalfDim], int slot,
                                            int chunk) {
  return tile[chunk / 8] + swizzle128_offset(slot, chunk % 8) / sizeof(__half);
}

// The copies of the tile images (tc_unit_images.cuh) into shared memory. From sm_90 on, one
// thread issues bulk copies that complete on an mbarrier (bulk_copy.cuh) and the block waits for
// its phase: a column tile is one contiguous copy, the block's rows 16-row pieces, each to its
// slot (tc_row_slot moves rows in whole 16-row pieces and keeps r % 8, the swizzle's phase).
// Before sm_90 (and with KVSIFT_TC_SYNC_COPIES, to test that code on Hopper) every thread copies
// 16-byte chunks and a block barrier ends the copy.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(KVSIFT_TC_SYNC_COPIES)
#define KVSIFT_TC_BULK_COPIES 1
#else
#define KVSIFT_TC_BULK_COPIES 0
#endif

// One (b, h) region of tile images.
struct TcImages {
  const __half* head;
  int halves;  // tc_image_halves(head_dim)
  __device__ unsigned tile_bytes() const {
    return static_cast<unsigned>(halves * kTcImageRows * kTcImageChannels * sizeof(__half));
  }
  __device__ const __half* tile(int jt) const {
    return head + static_cast<std::int64_t>(jt) * halves * kTcImageRows * kTcImageChannels;
  }
};

#if KVSIFT_TC_BULK_COPIES
// Thread 0: column tile jt into cols[buf], and with kRows the block's rows i0 .. i0 + 255 too,
// all counted on landed[buf]. The caller knows no thread still reads those buffers.
template <bool kRows>
__device__ __forceinline__ void issue_tile_copies(TcShared& sm, const TcImages& im, int i0, int jt,
                                                  int buf) {
  constexpr unsigned kPieceRows = 16;
  const unsigned piece = kPieceRows * kTcHalfDim * sizeof(__half);
  fence_proxy_async_shared();  // after the reads of the buffers it overwrites (ldmatrix)
  mbarrier_arrive_expect_tx(&sm.landed[buf],
                            im.tile_bytes() * (kRows ? 1 + kTcRowTile / kTcColTile : 1));
  if constexpr (kRows) {
    for (int q = 0; q < kTcRowTile / static_cast<int>(kPieceRows); ++q)
      for (int h = 0; h < im.halves; ++h)
        bulk_copy_to_shared(&sm.rows[h][tc_row_slot(q * kPieceRows) * kTcHalfDim],
                            im.head + tc_row_offset(i0 + q * kPieceRows, h, im.halves), piece,
                            &sm.landed[buf]);
  }
  bulk_copy_to_shared(sm.cols[buf], im.tile(jt), im.tile_bytes(), &sm.landed[buf]);
}
#else
// Every thread: its share of column tile jt into cols[buf], and with `rows` of the block's rows.
__device__ __forceinline__ void copy_tile_sync(TcShared& sm, const TcImages& im, int i0, int jt,
                                               int buf, bool rows) {
  const int chunks = 8 * im.halves;
  if (rows)
    for (int e = threadIdx.x; e < kTcRowTile * chunks; e += kTcThreads) {
      const int r = e / chunks, c = e % chunks;
      *reinterpret_cast<uint4*>(tc_chunk<kTcRowTile>(sm.rows, tc_row_slot(r), c)) =
          *reinterpret_cast<const uint4*>(im.head + tc_chunk_offset(i0 + r, c, im.halves));
    }
  const uint4* src = reinterpret_cast<const uint4*>(im.tile(jt));
  uint4* dst = reinterpret_cast<uint4*>(sm.cols[buf]);
  for (int e = threadIdx.x; e < static_cast<int>(im.tile_bytes() / sizeof(uint4)); e += kTcThreads)
    dst[e] = src[e];
}
#endif
constexpr double kTcFixedScale = 4294967296.0;  // must equal key_redundancy.cu's kFixedScale

// Same conversion as key_redundancy.cu's add_fixed: 32.32 fixed point, exact order-free sum.
__device__ __forceinline__ void tc_add_fixed(unsigned long long* sum, float x) {
  atomicAdd(
      sum, static_cast<unsigned long long>(__double2ll_rn(static_cast<double>(x) * kTcFixedScale)));
}

// C[i, j] exactly as last_match_kernel computes it: acc = fmaf(k̂_i[d], k̂_j[d], acc), d ascending
// from 0.0f (its zero padding past head_dim only adds +0, which cannot change a comparison or a
// spared value). Each k̂[d] is the reference's quotient K[d] / den, bit for bit, from one
// reciprocal per row (quotient_rn.cuh) instead of a division per channel, and `vectorized` rows
// (key_rows_vectorizable) are read 8 channels per 16-byte load: a re-check holds up its whole
// block at the next barrier, so its latency is what structured keys pay (bench/RESULTS.md, run
// 67). A call, not inlined: inlined, the vector path pushes the kernel's live fragments past its
// 128 registers (ptxas, mma.sync code before the swizzled layout: 52–188 B of spills in the
// tile loop; as a call, 28–88 B and a stack frame the re-checks alone touch). Now, as a call:
// 24–108 B in the wgmma code the H200 runs, 232–284 B in the mma.sync code kept for other GPUs,
// whose swizzled ldmatrix addresses cost registers; that code is checked (run 79), not tuned.
template <class T>
__device__ __noinline__ float exact_cosine(const UnitRow<T>& ui, const UnitRow<T>& uj, int head_dim,
                                           bool vectorized) {
  const float yi = 1.0f / ui.den, yj = 1.0f / uj.den;
  float acc = 0.0f;
  if (vectorized) {
#pragma unroll 2
    for (int c = 0; c < head_dim / kVecChannels; ++c) {
      float a[kVecChannels], b[kVecChannels];
      unpack_vec<T>(load_vec<T>(ui.k, c), a);
      unpack_vec<T>(load_vec<T>(uj.k, c), b);
#pragma unroll
      for (int e = 0; e < kVecChannels; ++e)
        acc = fmaf(ui.unit_channel(a[e], yi), uj.unit_channel(b[e], yj), acc);
    }
    return acc;
  }
#pragma unroll 4
  for (int d = 0; d < head_dim; ++d)
    acc = fmaf(ui.unit_channel(to_float(ui.k[d]), yi), uj.unit_channel(to_float(uj.k[d]), yj), acc);
  return acc;
}

// UnitRow::unit_channel of 8 channels x of one row: quotient_rn's arithmetic for all 8 with no
// branch between them, so that their latencies overlap, and the per-channel unit_channel (with
// its division) only for a vector holding a channel outside quotient_rn's range (zero, tiny,
// huge, NaN). The same bits as unit_channel channel by channel. Channel by channel, each
// quotient behind its own range branch, one exact cosine took 20,000-33,000 cycles with its rows
// already in cache (bench/RESULTS.md run 126).
// The range test is made once for the vector: for y > 0, |RN(x·y)| = RN(|x|·y) does not decrease
// with |x|, so every channel is in range iff the smallest |x| and its quotient are >= 2^-80 and
// the largest |x|'s quotient is <= 2^80. The smallest and largest |x| are taken on the bit
// patterns (as unsigned integers they order non-negative floats, and NaN above infinity), so a
// NaN channel makes the largest a NaN and fails the test, as it fails quotient_rn's; y <= 0 or
// NaN (a zero, infinite or NaN norm) fails it too. Against a test per channel: spare_kernel
// 126 -> 116 µs with structured keys at batch 64 (run 129).
template <class T>
__device__ __forceinline__ void unit_channels(const UnitRow<T>& u, float y,
                                              const float (&x)[kVecChannels],
                                              float (&out)[kVecChannels]) {
  unsigned lo = 0xffffffffu, hi = 0;
#pragma unroll
  for (int e = 0; e < kVecChannels; ++e) {
    const unsigned a = __float_as_uint(x[e]) & 0x7fffffffu;  // |x|
    lo = min(lo, a);
    hi = max(hi, a);
    const float q = __fmul_rn(x[e], y);
    out[e] = fmaf(fmaf(-q, u.den, x[e]), y, q);
  }
  const float lo_x = __uint_as_float(lo), hi_x = __uint_as_float(hi);
  if (u.den != 0.0f && lo_x >= 0x1p-80f && __fmul_rn(lo_x, y) >= 0x1p-80f &&
      __fmul_rn(hi_x, y) <= 0x1p80f)
    return;
#pragma unroll
  for (int e = 0; e < kVecChannels; ++e) out[e] = u.unit_channel(x[e], y);
}

// exact_cosine's value with the loads of both rows issued eight vectors at a time (two trips to
// memory for 16-bit keys of head_dim 128 instead of eight), for spare_kernel, which has
// registers to spare for them. exact_cosine keeps its own loop: inside the search, both the
// batched loads and unit_channels slowed the tile loop more than they saved (runs 124, 127).
template <class T>
__device__ __forceinline__ float exact_cosine_batched(const UnitRow<T>& ui, const UnitRow<T>& uj,
                                                      int head_dim, bool vectorized) {
  constexpr int kBatch = sizeof(T) == 4 ? 4 : 8;  // 64 registers of words either way
  if (!vectorized) return exact_cosine(ui, uj, head_dim, false);
  const float yi = 1.0f / ui.den, yj = 1.0f / uj.den;
  const int vectors = head_dim / kVecChannels;
  float acc = 0.0f;
  for (int c0 = 0; c0 < vectors; c0 += kBatch) {
    RawVec<T> ra[kBatch], rb[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      if (c0 + q < vectors) {
        ra[q] = load_vec<T>(ui.k, c0 + q);
        rb[q] = load_vec<T>(uj.k, c0 + q);
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      if (c0 + q >= vectors) break;
      float a[kVecChannels], b[kVecChannels], ua[kVecChannels], ub[kVecChannels];
      unpack_vec<T>(ra[q], a);
      unpack_vec<T>(rb[q], b);
      unit_channels(ui, yi, a, ua);
      unit_channels(uj, yj, b, ub);
#pragma unroll
      for (int e = 0; e < kVecChannels; ++e) acc = fmaf(ua[e], ub[e], acc);
    }
  }
  return acc;
}

// The thresholds of one search: t, the tensor-core band t ∓ m and the filter's band t ∓ m_f.
struct TcBands {
  float threshold;
  float below, above;  // tensor-core cosines: <= below no match, > above a match
  CosineBand filter;   // cosine_filter.cuh
};

// exact_cosine(ui, uj) > threshold, decided by the cheap fp32 cosine of cosine_filter.cuh
// wherever its bound allows (all but the pairs within ~1e-5 of the threshold) and by the exact
// chain otherwise. A call for the same register reason as exact_cosine.
template <class T>
__device__ __noinline__ bool exceeds_threshold(const UnitRow<T>& ui, const UnitRow<T>& uj,
                                               int head_dim, bool vectorized, float threshold,
                                               CosineBand band) {
  if (cosine_filter_applies(ui.den, uj.den)) {
    FilterDot dot;
    if (vectorized) {
#pragma unroll 4
      for (int c = 0; c < head_dim / kVecChannels; ++c) {
        float a[kVecChannels], b[kVecChannels];
        unpack_vec<T>(load_vec<T>(ui.k, c), a);
        unpack_vec<T>(load_vec<T>(uj.k, c), b);
        dot.add8(a, b);
      }
    } else {
      for (int d0 = 0; d0 < head_dim; d0 += kFilterLanes) {
        float a[kFilterLanes], b[kFilterLanes];  // zero past head_dim: adds +0, as the bound allows
#pragma unroll
        for (int e = 0; e < kFilterLanes; ++e) {
          const bool inside = d0 + e < head_dim;
          a[e] = inside ? to_float(ui.k[d0 + e]) : 0.0f;
          b[e] = inside ? to_float(uj.k[d0 + e]) : 0.0f;
        }
        dot.add8(a, b);
      }
    }
    const int decided = cosine_filter_decides(dot.cosine(1.0f / ui.den, 1.0f / uj.den), band);
    if (decided != 0) return decided > 0;
  }
  return exact_cosine(ui, uj, head_dim, vectorized) > threshold;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// acc = the warpgroup's 128 rows (two m64 halves, descriptor `rows` of the first) times the 64
// columns of descriptor `cols`, over kSteps k steps of 16 channels: one straight run of wgmma,
// with no branch between them and the accumulators fenced on both sides, so that ptxas keeps them
// in flight together instead of waiting for each before the next. Every other descriptor is the
// two bases advanced by a compile-time offset (wgmma_desc_advance).
template <int kSteps>
__device__ __forceinline__ void tc_multiply_wgmma(float (&acc)[2][8][4], std::uint64_t rows,
                                                  std::uint64_t cols) {
  constexpr unsigned kHalfRows = kTcRowTile * kTcHalfDim * sizeof(__half);
  constexpr unsigned kHalfCols = kTcColTile * kTcHalfDim * sizeof(__half);
  constexpr unsigned kHalfM = 64 * kTcHalfDim * sizeof(__half);  // 64 rows: one m64 product
  float(&a0)[32] = reinterpret_cast<float(&)[32]>(acc[0]);
  float(&a1)[32] = reinterpret_cast<float(&)[32]>(acc[1]);
  wgmma_fence_operands(a0);
  wgmma_fence_operands(a1);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const unsigned k_at = (ks % 4) * 32u;  // 16 channels = 32 bytes a step within a half
    const std::uint64_t b = wgmma_desc_advance(cols, (ks / 4) * kHalfCols + k_at);
    const std::uint64_t a = wgmma_desc_advance(rows, (ks / 4) * kHalfRows + k_at);
    if (ks == 0) {  // resolved at compile time: the first step overwrites the accumulators
      wgmma_m64n64k16_f16<false>(a0, a, b);
      wgmma_m64n64k16_f16<false>(a1, wgmma_desc_advance(a, kHalfM), b);
    } else {
      wgmma_m64n64k16_f16<true>(a0, a, b);
      wgmma_m64n64k16_f16<true>(a1, wgmma_desc_advance(a, kHalfM), b);
    }
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(a0);
  wgmma_fence_operands(a1);
}
#endif

// Which column tile a search visits next, at or below `jt` (−1: none left). Phase 1 visits the
// tiles from the sequence end down to the block's own rows (j >= i0); phase 2 the tiles left of
// them (j < i0), skipping those whose transposed results phase 1 already posted: tile jt lies in
// row tile jt / 4, whose phase-1 block computed our columns iff it reached down to ours.
__device__ __forceinline__ int next_column_tile(int jt, bool upper, int own_first,
                                                const int* reached) {
  if (upper) return jt >= own_first ? jt : -1;
  while (jt >= 0 && reached[jt / kTcTilesPerRowTile] <= own_first) --jt;
  return jt;
}

// Row (0 .. 255, in the block) of a warp's fragment row r = 2·mt + half held by lane group g: row
// g (+8) of m tile mt (mma.sync's layout, which both multiplies use).
__device__ __forceinline__ int tc_fragment_row(int warp, int g, int r) {
  return warp * kTcWarpRows + (r / 2) * 16 + g + (r % 2) * 8;
}

constexpr int kOffered = 1;  // offer_flags: a pair offered this tile
constexpr int kCrowded = 2;  // ... and the list half full or more

// Phase 1 offers a pair it cannot decide from the tensor-core cosine to the block's list instead
// of re-checking it at once; true if it took it (a free slot among the first `slots`).
__device__ __forceinline__ bool defer_pair(TcShared& sm, int slots, int j, int tag, int flag_set) {
  const int slot = atomicAdd(&sm.pair_count, 1);
  atomicOr(&sm.offer_flags[flag_set], 2 * (slot + 1) >= slots ? kOffered | kCrowded : kOffered);
  if (slot >= slots) return false;
  sm.pairs[slot] = make_int2(j, tag);
  return true;
}

// The first `pairs` deferred re-checks, resolved by all the block's threads at once (pair e by
// thread e % 256), so their loads' latency is paid once for the lot, not pair after pair by one
// lane while its block waits at the tile barrier (a re-check took ~8,800 cycles there,
// bench/RESULTS.md run 129). A row's pair {j, row} that exceeds the threshold raises match[row]
// to j: a pair is deferred only above the row's certain matches, and atomicMax keeps the highest
// success. A column's pair {j, row | kTcColumnPair} posts row i0 + row to best[j] unless a row
// at or above it is posted already. The caller synchronises the block before and after.
template <class T>
__device__ __forceinline__ void resolve_deferred(TcShared& sm, int pairs, int i0, UnitHead<T> uh,
                                                 int head_dim, bool vectorized, TcBands bands,
                                                 int* best) {
  for (int e = static_cast<int>(threadIdx.x); e < pairs; e += kTcThreads) {
    const int2 p = sm.pairs[e];
    const int row = p.y & (kTcRowTile - 1), i = i0 + row, j = p.x;
    const bool column = (p.y & kTcColumnPair) != 0;
    if (column && i <= *static_cast<volatile int*>(&best[j])) continue;
    if (!exceeds_threshold(uh.row(i), uh.row(j), head_dim, vectorized, bands.threshold,
                           bands.filter))
      continue;
    if (column) {
      atomicMax(&best[j], i);
    } else {
      atomicMax(&sm.match[row], j);
    }
  }
}

// Grid (row tiles, kv_heads, sequences), 256 threads; launched twice.
//   Phase 1 (upper): row tile I against the column tiles right of and over its own rows, from the
//     sequence end down, stopping once every row has matched. A row's first match is final
//     (r_i >= i0 beats anything left of i0). Column tiles wholly right of the rows also give their
//     columns' matches among our rows, C[j, i] = C[i, j] (the fp32 chain is symmetric: fmaf(a, b,
//     c) = fmaf(b, a, c)), posted to best[j] with atomicMax; reached[I] records how far down I
//     went. Pairs needing the exact re-check are deferred (defer_pair) while the block has room:
//     a row with one is "pending" and searches on for a certain match below it; once every row
//     has matched or is pending (or the list is half full, or the tiles end) the block resolves
//     them together (resolve_deferred), and rows whose pairs all failed search on.
//   Phase 2 (lower): rows without a match >= i0 search the column tiles left of i0, from i0 down;
//     tiles some phase-1 block covered are not recomputed (their matches are already in best[]).
//     A row is answered once its best known match lies in a tile at or above the current one.
//     Then best[] becomes r_i, and spare_kernel adds the spared cosines.
// Warp w owns rows 32w .. 32w + 31 of the tile against all 64 columns of the staged tile, in
// mma.sync's fragment layout on both paths (tc_row_slot); wgmma reads both operands from shared
// memory, mma.sync takes them through ldmatrix, and the next column tile is copied in while this
// one is multiplied. The wgmma path is 5–8 % faster on random keys (run 78): the multiply is not
// what bounds this kernel, its latency between barriers is (run 75's profile), so a tile has one
// block barrier: a warp's rows are its own (their bookkeeping needs only __syncwarp), columns'
// matches go to best[] by global atomics, and the copies are waited for on an mbarrier. Two CTAs
// per SM (128 registers a thread): one CTA with the registers it would like (150–168) is 25–35 %
// slower (bench/RESULTS.md, run 73).
template <class T>
__global__ void __launch_bounds__(kTcThreads, 2) last_match_tc_kernel(
    UnitKeys unit,                      // the unit keys in fp32, for the exact re-checks
    const __half* __restrict__ unit16,  // tc_head_elements(length, head_dim) per (b, h)
    int length, int head_dim, TcBands bands, bool upper,
    bool vectorized,            // key_rows_vectorizable: 16-byte re-check loads
    int* __restrict__ best,     // [sequences, kv_heads, length], −1 at start
    int* __restrict__ reached,  // [sequences, kv_heads, gridDim.x]
    int pair_slots) {           // phase 1's deferral room, <= kTcPairSlots (0: none)
  extern __shared__ __align__(16) unsigned char tc_shared_bytes[];
  // The swizzle works on shared addresses: the tiles start on a 1024-byte boundary.
  const unsigned shared_base = static_cast<unsigned>(__cvta_generic_to_shared(tc_shared_bytes));
  TcShared& sm = *reinterpret_cast<TcShared*>(tc_shared_bytes + ((1024u - shared_base) & 1023u));
  int* const match = sm.match;
  int* const cand = sm.cand;
  int* const tile_best = sm.tile_best;
  const int b = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y;
  const int i0 = blockIdx.x * kTcRowTile, own_first = i0 / kTcColTile;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  const std::int64_t bh = static_cast<std::int64_t>(b) * kv_heads + h;
  const TcImages im{unit16 + bh * tc_head_elements(length, head_dim), tc_image_halves(head_dim)};
  [[maybe_unused]] const int ksteps = (head_dim + 15) / 16;  // mma.sync: k steps with channels
  int* bbase = best + bh * length;
  const int* rbase = reached + bh * gridDim.x;
  const UnitHead<T> uh = unit_head<T>(unit, bh);  // fp32 rows for the exact re-checks

  {
    const int i = i0 + tid;
    const int known = (!upper && i < length) ? bbase[i] : -1;  // phase 2: phase 1's results
    // Done: past the end, or (phase 2) matched at or right of i0 in phase 1, which is final.
    match[tid] = i >= length ? length : (known >= i0 ? known : -1);
    cand[tid] = known;
    tile_best[tid] = -1;
    sm.pending[tid] = 0;
    if (tid < 3) sm.offer_flags[tid] = 0;
    if (tid == 0) sm.pair_count = 0;
  }
  const bool defer = upper && pair_slots > 0;
  int flag_set = 0;         // offer_flags[flag_set]: this tile's
  bool unresolved = false;  // pairs deferred since the last resolution (the same in every thread)
#if KVSIFT_TC_BULK_COPIES
  if (tid == 0) {
    mbarrier_init(&sm.landed[0], 1);
    mbarrier_init(&sm.landed[1], 1);
    fence_mbarrier_init();
  }
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Warpgroup: rows 128wg .. 128wg + 127 of the block. Taken from lane 0 so that the compiler
  // knows it is the same across the warp and can keep the descriptors below in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  const bool wg_has_rows = i0 + wg * 4 * kTcWarpRows < length;
  // The descriptors of the warpgroup's rows and of column buffer 0, built once.
  const std::uint64_t rows_desc =
      wgmma_desc_sw128(static_cast<unsigned>(__cvta_generic_to_shared(sm.rows)) +
                       wg * 4 * kTcWarpRows * kTcHalfDim * sizeof(__half));
  const std::uint64_t cols0_desc =
      wgmma_desc_sw128(static_cast<unsigned>(__cvta_generic_to_shared(sm.cols[0])));
#else
  const bool warp_has_rows = i0 + warp * kTcWarpRows < length;
#endif
  const int n_col_tiles = (length + kTcColTile - 1) / kTcColTile;
  int jt = next_column_tile(upper ? n_col_tiles - 1 : own_first - 1, upper, own_first, rbase);
  int last_done = n_col_tiles;  // phase 1: the lowest column tile computed
  // match[] and the barriers visible to all; phase 2 blocks whose rows all matched in phase 1
  // search nothing.
  if (__syncthreads_and(match[tid] >= 0) && !upper) jt = -1;
#if KVSIFT_TC_BULK_COPIES
  if (jt >= 0 && tid == 0) issue_tile_copies<true>(sm, im, i0, jt, 0);
  unsigned parity = 0;     // bit b: the parity of landed[b]'s next phase
  bool in_flight = false;  // a copy into cols[buf] was issued and is not waited for
#else
  bool rows_staged = false;
#endif
  int buf = 0;

  while (jt >= 0) {
    const int j0 = jt * kTcColTile;
    // Phase 1, columns wholly right of the rows: also find each column's last matching row.
    const bool transposed = upper && jt >= own_first + kTcTilesPerRowTile;
    const int next = next_column_tile(jt - 1, upper, own_first, rbase);
#if KVSIFT_TC_BULK_COPIES
    // cols[buf ^ 1] was last read before the barrier that ended the previous iteration.
    if (next >= 0 && tid == 0) issue_tile_copies<false>(sm, im, i0, next, buf ^ 1);
    in_flight = next >= 0;
    mbarrier_wait(&sm.landed[buf], (parity >> buf) & 1u);  // tile jt (the first time: the rows)
    parity ^= 1u << buf;
#else
    copy_tile_sync(sm, im, i0, jt, buf, !rows_staged);
    rows_staged = true;
    __syncthreads();  // tile jt (the first time: the rows) visible to all
#endif

    // A warp multiplies when its rows still search or (transposed tiles) all its real rows count.
    const bool open = __any_sync(0xffffffffu, match[warp * kTcWarpRows + lane] < 0);
    float acc[2][8][4];
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // wgmma: the four warps of a warpgroup multiply together, when any of them would.
    bool wg_open = false;
#pragma unroll
    for (int w = 0; w < 4; ++w) wg_open |= match[(wg * 4 + w) * kTcWarpRows + lane] < 0;
    const bool multiply = wg_has_rows && (__any_sync(0xffffffffu, wg_open) || transposed);
    if (multiply) {
      const std::uint64_t cols_desc = wgmma_desc_advance(cols0_desc, buf * sizeof(sm.cols[0]));
      if (im.halves == 2) {  // block-uniform: both halves staged
        tc_multiply_wgmma<kTcKSteps>(acc, rows_desc, cols_desc);
      } else {
        tc_multiply_wgmma<kTcKSteps / 2>(acc, rows_desc, cols_desc);
      }
    }
#else
    const bool multiply = warp_has_rows && (open || transposed);
    if (multiply) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < kTcKSteps; ++ks) {
        if (ks >= ksteps) break;  // warp-uniform
        std::uint32_t bf[4][4];   // n tiles 2p, 2p + 1: {b0, b1} each
        const int m = lane / 8;
#pragma unroll
        for (int p = 0; p < 4; ++p)
          ldmatrix_x4(bf[p], tc_chunk<kTcColTile>(sm.cols[buf], p * 16 + (m / 2) * 8 + lane % 8,
                                                  ks * 2 + m % 2));
        std::uint32_t af[2][4];  // a0 row g, a1 row g + 8, a2/a3 the same rows 8 channels on
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          ldmatrix_x4(af[mt], tc_chunk<kTcRowTile>(
                                  sm.rows, tc_row_slot(warp * kTcWarpRows + mt * 16 + lane % 16),
                                  ks * 2 + lane / 16));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
            mma_16816<Half16::f16>(acc[mt][nt], af[mt], bf[nt / 2][(nt % 2) * 2],
                                   bf[nt / 2][(nt % 2) * 2 + 1]);
      }
    }
#endif
    // The warp's own diagonal C[i, i] ≈ 1 is never a match (j != i) but lies above t − m: left
    // in, it sent the warp through the rows' bookkeeping on its diagonal tile while the block's
    // other warps waited at the barrier (random keys, batch 64: phase 1 450 -> 280 µs without it,
    // bench/RESULTS.md runs 123, 128). The warp's 32 rows lie inside one 64-column tile.
    if (multiply && j0 / kTcColTile == (i0 + warp * kTcWarpRows) / kTcColTile) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int i = i0 + tc_fragment_row(warp, g, 2 * mt + q / 2);
            if (j0 + nt * 8 + 2 * t + q % 2 == i) acc[mt][nt][q] = -INFINITY;
          }
    }
    // Nothing in the warp's 32×64 tile above t − m (random keys: almost every tile) decides or
    // needs a re-check, so both bookkeeping passes below are skipped (fmaxf drops NaN, which
    // cannot match anyway).
    bool near = false;
    if (multiply) {
      // Eight independent chains, then their maximum: the same value as one chain (fmaxf is
      // exact and drops NaN in any order), 11 dependent steps instead of 64 before the barrier.
      float top[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) top[c] = -INFINITY;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int q = 0; q < 4; ++q) top[nt] = fmaxf(top[nt], acc[mt][nt][q]);
#pragma unroll
      for (int w = 4; w > 0; w /= 2)
#pragma unroll
        for (int c = 0; c < w; ++c) top[c] = fmaxf(top[c], top[c + w]);
      near = __any_sync(0xffffffffu, top[0] > bands.below);
    }
    // Rows: each thread holds 4 rows × 16 columns: row g (+8) of each m tile, columns 8nt + 2t
    // (+1). Bit 16r + 2nt + c of row_uncertain (r = 2mt + half): that column of row r lies within
    // m of the threshold, above the row's certain match in this tile.
    unsigned long long row_uncertain = 0;
    if (near && open) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = tc_fragment_row(warp, g, 2 * mt + half), i = i0 + row;
          if (match[row] >= 0) continue;
          int found = -1;          // largest certain match among this thread's columns
          unsigned uncertain = 0;  // bit 2nt + c: within m of the threshold, above `found`
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int j = j0 + nt * 8 + 2 * t + c;
              const float v = acc[mt][nt][half * 2 + c];
              if (j >= length || j == i) continue;
              if (v > bands.above) {
                found = j;  // ascending j: the last one wins
                uncertain = 0;
              } else if (v > bands.below) {
                uncertain |= 1u << (nt * 2 + c);
              }
            }
          row_uncertain |= static_cast<unsigned long long>(uncertain) << (16 * (mt * 2 + half));
          if (found >= 0) atomicMax(&tile_best[row], found);
        }
    }
    // Columns (transposed tiles): the last certain row per column among the warp's rows, posted
    // to best[] (atomicMax: the other warps and blocks post theirs too). Bit 8nt + 4c + 2mt + half
    // of col_uncertain: row (mt, half) of column (nt, c) needs a re-check.
    unsigned long long col_uncertain = 0;
    if (transposed && near) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int cl = nt * 8 + 2 * t + c;
          int found = -1;
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // rows ascending
              const int i = i0 + tc_fragment_row(warp, g, 2 * mt + half);
              const float v = acc[mt][nt][half * 2 + c];
              if (i >= length || j0 + cl >= length) continue;
              const int shift = nt * 8 + c * 4;
              if (v > bands.above) {
                found = i;
                col_uncertain &= ~(0xfull << shift);
              } else if (v > bands.below) {
                col_uncertain |= 1ull << (shift + 2 * mt + half);
              }
            }
          // Max over the 8 lanes holding this column (lane bits 2..4).
          for (int off = 4; off < 32; off *= 2)
            found = max(found, __shfl_xor_sync(0xffffffffu, found, off));
          if (g == 0 && found >= 0) atomicMax(&bbase[j0 + cl], found);
        }
    }
    // Re-check uncertain rows above their column's best known so far in exact fp32, highest
    // first; a column is settled by its first success (or by a row at or below its best).
    while (col_uncertain != 0) {
      const int bit = 63 - __clzll(col_uncertain);
      const int nt = bit / 8, c = (bit / 4) % 2, r = bit % 4;  // r = 2·mt + half
      const int cl = nt * 8 + 2 * t + c, j = j0 + cl;
      const int row = tc_fragment_row(warp, g, r), i = i0 + row;
      bool settled = i <= *static_cast<volatile int*>(&bbase[j]);
      // Deferred: the rows below it still count until it is resolved (transposed: phase 1 only).
      if (!settled && !(defer && defer_pair(sm, pair_slots, j, row | kTcColumnPair, flag_set)) &&
          exceeds_threshold(uh.row(i), uh.row(j), head_dim, vectorized, bands.threshold,
                            bands.filter)) {
        atomicMax(&bbase[j], i);
        settled = true;
      }
      col_uncertain &= settled ? ~(0xfull << (bit & ~3)) : ~(1ull << bit);
    }
    // Re-check each row's uncertain columns in exact fp32, highest first, until one exceeds the
    // threshold (phase 1: deferred while there is room). After the columns' pass, where the
    // accumulators are dead, so that fewer values stay live across the calls.
    while (row_uncertain != 0) {
      const int bit = 63 - __clzll(row_uncertain);
      const int r = bit / 16, k = bit % 16;  // r = 2·mt + half, k = 2nt + c
      const int row = tc_fragment_row(warp, g, r), j = j0 + (k / 2) * 8 + 2 * t + k % 2;
      bool settled = false;
      if (defer && defer_pair(sm, pair_slots, j, row, flag_set)) {
        sm.pending[row] = 1;
      } else if (exceeds_threshold(uh.row(i0 + row), uh.row(j), head_dim, vectorized,
                                   bands.threshold, bands.filter)) {
        atomicMax(&tile_best[row], j);
        settled = true;
      }
      row_uncertain &= settled ? ~(0xffffull << (bit & ~15)) : ~(1ull << bit);
    }
    // tile_best of the warp's rows complete (only this warp's lanes wrote them).
    __syncwarp();
    // A row is answered once its best known match lies in this tile or above: every tile from
    // here to i0 (or the end) is accounted for, computed here or covered by phase 1.
    if (match[tid] < 0) {
      const int c = max(cand[tid], tile_best[tid]);
      if (c >= j0) {
        match[tid] = c;
      } else {
        cand[tid] = c;
      }
    }
    tile_best[tid] = -1;
    const int next_set = flag_set == 2 ? 0 : flag_set + 1;
    if (defer && tid == 0) sm.offer_flags[next_set] = 0;
    // Also: every thread is done with cols[buf] and cols[buf ^ 1] may be refilled.
    bool all_done = __syncthreads_and(match[tid] >= 0 || sm.pending[tid]);
    if (defer) {
      const int flags = sm.offer_flags[flag_set];  // the same in every thread
      flag_set = next_set;
      unresolved |= (flags & kOffered) != 0;
      // Resolved once no row can go on without it (or the tiles end, or the list is half full).
      if (unresolved && (all_done || next < 0 || (flags & kCrowded))) {
        // Every thread is here, so pair_count holds still until the barrier below.
        resolve_deferred<T>(sm, min(sm.pair_count, pair_slots), i0, uh, head_dim, vectorized, bands,
                            bbase);
        __syncthreads();  // every success posted; every thread has read pair_count
        if (tid == 0) sm.pair_count = 0;
        sm.pending[tid] = 0;
        unresolved = false;
        all_done = __syncthreads_and(match[tid] >= 0);
      }
    }
    last_done = jt;
    buf ^= 1;
    jt = all_done ? -1 : next;
  }
#if KVSIFT_TC_BULK_COPIES
  // A prefetch issued before an early exit lands before the block ends (buf: flipped above).
  if (in_flight) mbarrier_wait(&sm.landed[buf], (parity >> buf) & 1u);
#endif

  const int i = i0 + tid;
  if (upper) {
    if (tid == 0) reached[bh * gridDim.x + blockIdx.x] = last_done;
    if (i < length && match[tid] >= 0) atomicMax(&bbase[i], match[tid]);
    return;
  }
  // Phase 2: every tile accounted for, a row still searching has its answer in cand (or none).
  if (i < length) bbase[i] = match[tid] >= 0 ? match[tid] : cand[tid];
}

// After both phases: row i spares C[i, r_i] (faithful: C[i, 0] when it has no match and i != 0),
// added to that column's fixed-point sum with the fp32 path's value, one row a thread. Phase 2
// used to end with these cosines, each block waiting for its 256: on structured keys, where
// nearly every row spares one, that was 96 % of phase 2 (bench/RESULTS.md run 123), and any
// faster version of it inside the search reshaped the search's registers and slowed its tile
// loop (runs 124, 127). Here phase 2 with structured keys takes 41 µs instead of 277, and this
// kernel 126 (run 128, batch 64 / 1024 on an H100).
template <class T>
__global__ void __launch_bounds__(kTcThreads)
    spare_kernel(UnitKeys unit, int length, int head_dim, bool faithful, bool vectorized,
                 const int* __restrict__ best,  // [sequences, kv_heads, length]: r_i or −1
                 unsigned long long* __restrict__ spared) {  // [sequences, kv_heads, length]
  const int i = static_cast<int>(blockIdx.x) * kTcThreads + static_cast<int>(threadIdx.x);
  if (i >= length) return;
  const std::int64_t bh = static_cast<std::int64_t>(blockIdx.z) * gridDim.y + blockIdx.y;
  const int r = best[bh * length + i];
  const int column = r >= 0 ? r : (faithful && i != 0 ? 0 : -1);
  if (column < 0) return;
  const UnitHead<T> uh = unit_head<T>(unit, bh);
  tc_add_fixed(&spared[bh * length + column],
               exact_cosine_batched(uh.row(i), uh.row(column), head_dim, vectorized));
}

// Which multiply the loaded code of this file has (see tc_search_uses_wgmma).
__global__ void tc_variant_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

}  // namespace

bool tc_search_uses_wgmma() {
  int* d = nullptr;
  int h = 0;
  KVSIFT_CUDA_CHECK(cudaMalloc(&d, sizeof(int)));
  tc_variant_kernel<<<1, 1>>>(d);
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t copied = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(d);
  KVSIFT_CUDA_CHECK(launched);
  KVSIFT_CUDA_CHECK(copied);
  return h == 1;
}

int tc_row_tiles(int length) { return (length + kTcRowTile - 1) / kTcRowTile; }

bool tc_search_supported(int head_dim) {
  return head_dim >= 4 && head_dim <= kTcMaxDim && head_dim % 4 == 0;
}

double tc_cosine_margin(int head_dim) {
  const double n2 = 1.002;  // (1 + 2^-10)² bounds ||u||·||v|| of fp32-normalised keys
  const double d = head_dim;
  const double rounding = std::ldexp(1.0, -10) + std::ldexp(1.0, -20) + std::ldexp(1.0, -21);
  const double subnormals = d * std::ldexp(1.0, -23);  // fp16 channels below 2^-14
  const double grow = (1.0 + std::ldexp(1.0, -11)) * (1.0 + std::ldexp(1.0, -11));
  const double tc_sum = d * std::ldexp(1.0, -22) * grow * 1.01;
  const double fp32_sum = d * std::ldexp(1.0, -24) * 1.01;
  return n2 * (rounding + tc_sum + fp32_sum) + subnormals + std::ldexp(1.0, -100);
}

void require_unit16_scope(const void* unit16, int head_dim) {
  KVSIFT_CHECK(unit16 == nullptr || tc_search_supported(head_dim),
               "the fp16 unit keys are only written for the tensor-core search's head_dims "
               "(<= 128, multiples of 4); head_dim = ",
               head_dim);
}

std::int64_t tc_unit16_count(std::int64_t heads, int length, int head_dim) {
  return heads * tc_head_elements(length, head_dim);
}

std::int64_t tc_unit16_index(std::int64_t bh, int i, int d, int length, int head_dim) {
  return bh * tc_head_elements(length, head_dim) +
         tc_chunk_offset(i, d / 8, tc_image_halves(head_dim)) + d % 8;
}

void launch_last_match_tc(const UnitKeys& unit, DType dtype, const void* unit16, int batch,
                          int kv_heads, int length, int head_dim, float threshold, bool faithful,
                          bool vectorized, unsigned long long* spared, int* match, int* reached,
                          cudaStream_t stream, int pair_slots) {
  const int slots = pair_slots < 0 ? kTcPairSlots : pair_slots;
  KVSIFT_CHECK(slots <= kTcPairSlots, "pair_slots = ", pair_slots, " exceeds the search's ",
               kTcPairSlots);
  if (length <= 0 || batch <= 0 || kv_heads <= 0) return;
  const CosineBand tc = outward_band(threshold, tc_cosine_margin(head_dim));
  const TcBands bands{threshold, tc.below, tc.above, cosine_filter_band(threshold, head_dim)};
  const dim3 grid(static_cast<unsigned>(tc_row_tiles(length)), static_cast<unsigned>(kv_heads),
                  static_cast<unsigned>(batch));
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(
      match, 0xff, static_cast<std::size_t>(batch) * kv_heads * length * sizeof(int), stream));
  // Above the 48 KiB default: the kernel's dynamic shared memory needs the opt-in (per device,
  // cheap to repeat).
  constexpr int kSharedBytes = static_cast<int>(sizeof(TcShared)) + 1024;  // + alignment slack
  KVSIFT_DISPATCH_DTYPE(dtype, T, [&] {
    KVSIFT_CUDA_CHECK(cudaFuncSetAttribute(
        last_match_tc_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
    for (bool upper : {true, false}) {
      last_match_tc_kernel<T><<<grid, kTcThreads, kSharedBytes, stream>>>(
          unit, static_cast<const __half*>(unit16), length, head_dim, bands, upper, vectorized,
          match, reached, slots);
      KVSIFT_CUDA_CHECK(cudaGetLastError());
    }
    // One thread a row: the search's grid, whose row tiles are kTcThreads rows.
    spare_kernel<T><<<grid, kTcThreads, 0, stream>>>(unit, length, head_dim, faithful, vectorized,
                                                     match, spared);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace kvsift::cuda::detail
