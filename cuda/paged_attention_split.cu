// Split-sequence (flash-decoding) decode attention over the device Continuous Thinking table
// (docs/algorithms.md §3.4), with dequantization fused into the tensor-core MMAs.
//
// Grid (splits, KV heads, batch), 4 warps per CTA, and no block-wide barrier after the setup:
// each warp is its own split. Warp w of CTA split s walks the 32-slot tiles s·4·T + w + 4·i,
// i < T (T = tiles per warp, interleaved so the CTA's four warps read neighbouring blocks).
// The tiles' bytes are double-buffered: while the warp multiplies tile i, cp.async copies the
// still-compressed codes and scales of tile i + 1 (4.5 KB for NVFP4 at head_dim 128) into the
// warp's other shared-memory stage, so the warp never waits on a global load it has just issued
// (the register-direct kernel it replaces loaded each k-chunk's codes just before multiplying
// them and spent a third of its cycles waiting on L1TEX, bench/RESULTS.md run 32). The tiles'
// descriptions (frame, live bits, format) are read 32 at a time, one per lane, and broadcast.
// Per tile (one or two 16-slot groups sg of one block, one format) the warp
//   1. computes S = Q·Kᵀ for the whole GQA group with mma.m16n8k16 (rows 0-7: the query heads'
//      high halves, rows 8-15: their low halves, so the query is represented to ~2^-22), the
//      B fragments built in registers from the key codes in its stage,
//   2. runs the online softmax per query head in registers (4 lanes per head),
//   3. accumulates O += P·V with P again split into high and low halves, the B fragments built
//      in registers from the value codes.
// Only compressed bytes go through shared memory (never decoded tiles): 45 KB per CTA at
// head_dim 128 and ≤ 128 registers per thread, 4 CTAs per SM.
// Finally the CTA's four warps fold their (max, sum, acc) per query head into one partial through
// shared memory (combine_cta_partials), and merge_kernel combines the CTAs' partials. Reading each
// KV tile once for all G query heads is what makes GQA cheap.
//
// Fragment mapping (PTX ISA, mma.m16n8k16 .f16: lane = 4g + t; A a0 = A[g][2t, 2t+1],
// a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]; B b0 = B[2t, 2t+1][g],
// b1 = B[2t+8, 2t+9][g]; C c0, c1 = row g cols 2t, 2t+1, c2, c3 = row g+8 the same). The k index
// of a product may be permuted if A and B agree, its n index if the consumer agrees:
//   S = Q·Kᵀ per 16-slot group, k-chunk kc (channels kc·16 .. + 15):
//     k-permutation π: k = 2t, 2t+1, 2t+8, 2t+9 <-> channel kc·16 + 4t + 0, 1, 2, 3, so lane
//     (g, t) holds the four contiguous key groups (sg, kc·16 + 4t + j), j < 4;
//     n-tile 0 column g <-> slot 2g, n-tile 1 column g <-> slot 2g + 1: lane (g, t) needs byte g
//     (NVFP4: slots 2g low nibble, 2g + 1 high) or nibble g (ternary) of each of those groups.
//     C: lane (g, t) ends with head g's logits at slots 4t + i, i = 2·(column − 2t) + n-tile.
//   O = P·V per 16-slot group: k-permutation ρ: k = 2t, 2t+1, 2t+8, 2t+9 <-> slot 4t + 0, 1, 2, 3,
//     so P's A fragment is the lane's own four logits' weights (no shuffle);
//     n-tile j (< D/8) column n <-> channel σ(j, n) = n·D/8 + j, so lane (g, t) needs channels
//     [g·D/8, (g+1)·D/8) of slots 4t .. 4t+3: D/8 contiguous codes of each of its four slots,
//     and across the warp every value code of the group is loaded exactly once.
//     C: lane (g, t), n-tile j: c0 + c2 = head g at channel σ(j, 2t) = (D/4)·t + j, c1 + c3 at
//     σ(j, 2t+1) = (D/4)·t + D/8 + j: the lane writes channels [(D/4)·t, (D/4)·(t+1)).
//
// Exactness of the 16-bit operands (why the MMAs lose nothing on the K/V side):
//   - NVFP4: code (E2M1, 2 significant bits) × block scale (E4M3, 4 bits) has ≤ 6 significant
//     bits and is a multiple of 2^-10, so code · scale · 2^-14 is an exact fp16 number (normal or
//     subnormal). The bit trick (e2m1_bytes, e2m1_pair) produces code · 2^-14 exactly; the E4M3
//     scale is exact in fp16, and the one __hmul2 by it is exact by the bound above. The factor
//     2^14 / g (g the NVFP4 global factor) is applied to the fp32 logits and folded into P.
//   - ternary: c × E4M3 α is produced exactly by one fused multiply-add (ternary_bits,
//     ternary_scaled).
//   - the query and P are the only rounded operands: each is split into an fp16 high half and the
//     fp16 rounding of the remainder (split16, ~22 significant bits together); the products and
//     sums are fp32 in the tensor cores. Logits, softmax and the partials are fp32.
//   - FP8 and f32 blocks do not reach this kernel (split_kernel_takes): the batch falls back to
//     the tiled kernel.
//   - staged tokens (16-bit keys and values waiting for their 16-token group, §3.4) never enter
//     the MMAs: bf16 staging is not exact in the fp16 MMA path. merge_kernel computes their
//     logits and P·V in fp32 on CUDA cores (at most 3 · 16 tokens per KV head) while the split
//     kernel still runs (it is that kernel's programmatic dependent) and folds them in after the
//     CTAs' partials.
// Evicted and never-written slots get weight exactly 0: their logits are replaced by −inf (a
// stale key only reaches its own column of S), and their value codes and scales are zeroed before
// decoding, so that stale codes (possibly a NaN scale) never meet a zero weight in the MMA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "mma.cuh"
#include "paged_batch_refs.cuh"

namespace kvsift::cuda {
namespace {

using detail::PagedHeadLayout;
using detail::PagedLayouts;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileSlots = 32;
constexpr int kMaxGroup = 8;  // query heads per KV head (MMA rows 0-7)
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Meta word of a block, as uploaded: BlockFormat | thought type << 4.
constexpr int kFormatNvfp4 = static_cast<int>(BlockFormat::nvfp4);
constexpr int kFormatTernary = static_cast<int>(BlockFormat::ternary);

// Four 8×8 b16 matrices from shared memory, transposed: lane l supplies the row address of matrix
// l / 8 and receives, of each matrix M, M[2(l%4)][l/4] (low half) and M[2(l%4)+1][l/4] (high):
// the B fragment of mma.m16n8k16 when the operand is stored k-major ([k][n]).
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Asks L2 to fetch the 128-byte line holding `p` (no register is held for it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ std::uint32_t h2_bits(__half2 h) {
  return *reinterpret_cast<const std::uint32_t*>(&h);
}
__device__ __forceinline__ __half2 bits_h2(std::uint32_t u) {
  return *reinterpret_cast<const __half2*>(&u);
}
__device__ __forceinline__ std::uint32_t b2_bits(__nv_bfloat162 h) {
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

// x split into a 16-bit high part and the 16-bit rounding of the remainder (x − hi exact in
// fp32): hi + lo carries ~22 significant bits.
template <bool kBf16>
__device__ __forceinline__ void split16(float x0, float x1, std::uint32_t& hi, std::uint32_t& lo) {
  if constexpr (kBf16) {
    const __nv_bfloat16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
    hi = b2_bits(__halves2bfloat162(h0, h1));
    lo = b2_bits(__floats2bfloat162_rn(x0 - __bfloat162float(h0), x1 - __bfloat162float(h1)));
  } else {
    const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
    hi = h2_bits(__halves2half2(h0, h1));
    lo = h2_bits(__floats2half2_rn(x0 - __half2float(h0), x1 - __half2float(h1)));
  }
}

// --- register-direct fragment builders (mapping: see the file comment) --------------------------

// The E2M1 codes of x as E5M2 bytes, each in its code's byte: an E2M1 code s|e1 e0|m becomes the
// byte s|000|e1 e0|m|0, which as the high byte of an fp16 number (low byte 0) is, with the e/m bits
// at fp16 bits 11..9, the number 2^(e−15)(1 + m/2) (e > 0) or m · 2^-15 (e = 0): the E2M1 value
// times 2^-14. lo holds the low nibble of each byte, hi the high one. Seven operations for eight
// codes; a pair then costs one byte permutation (e2m1_pair) instead of two shifts and two masks.
struct E2m1Bytes {
  std::uint32_t lo, hi;
};
__device__ __forceinline__ E2m1Bytes e2m1_bytes(std::uint32_t x) {
  return {((x << 4) & 0x80808080u) | ((x << 1) & 0x0e0e0e0eu),
          (x & 0x80808080u) | ((x >> 3) & 0x0e0e0e0eu)};
}

// Nibbles k and k + 4 of the x that e came from (k < 4: nibble k of each 16-bit half) as the fp16
// pair (code_k, code_k+4) · 2^-14, code_k in the low half: bytes k / 2 and k / 2 + 2 of lo (k
// even) or hi (k odd) moved to the high bytes of the two halves.
__device__ __forceinline__ std::uint32_t e2m1_pair(const E2m1Bytes& e, int k) {
  return __byte_perm(k & 1 ? e.hi : e.lo, 0u, k < 2 ? 0x2404u : 0x3414u);
}

// 2-bit fields k and k + 8 of flipped = codes ^ 0xaaaaaaaa (ternary, two's complement) in bits
// 9..8 of the mantissa of 4.0: flipping each code's high bit gives f = c + 2 in [1, 3], and the
// fp16 pair is (4 + f) exactly. (The invalid code 10 would decode as −2 here and as 0 on the CPU;
// no encoder writes it, and never-written slots are masked.) The mask and the exponent are one LOP3
// with the exponent in a register.
__device__ __forceinline__ std::uint32_t ternary_bits(std::uint32_t flipped, int k) {
  const std::uint32_t f = k < 4 ? flipped << (8 - 2 * k) : flipped >> (2 * k - 8);
  std::uint32_t r;
  asm("lop3.b32 %0, %1, 0x03000300, %2, 0xea;" : "=r"(r) : "r"(f), "r"(0x44004400u));
  return r;  // (f & 0x03000300) | 0x44004400
}

// c · α from ternary_bits' (4 + c + 2) and the pair (α, −6α): (4 + f) · α − 6α is exact before
// rounding (α, an E4M3 scale, has 4 significant bits, 6α at most 6), so the fused multiply-add
// returns c · α exactly: the value the former (1024 + f − 1026) · α produced, in one instruction
// instead of a subtraction and a multiplication (a zero may now be +0 where that gave −0).
__device__ __forceinline__ std::uint32_t ternary_scaled(std::uint32_t bits, __half2 alpha,
                                                        __half2 minus6alpha) {
  return h2_bits(__hfma2(bits_h2(bits), alpha, minus6alpha));
}
__device__ __forceinline__ __half2 minus6(__half2 alpha) {
  return __hmul2(alpha, __float2half2_rn(-6.0f));  // exact: 6α has ≤ 6 significant bits
}

// The two E4M3 bytes in the low 16 bits of x as fp16 (byte 0 in the low half): exact.
__device__ __forceinline__ __half2 e4m3x2(std::uint32_t x) {
  return __half2(
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), __NV_E4M3));
}

// Loads from a warp's shared-memory stage (split_stage_tile copied the tile there).
__device__ __forceinline__ std::uint32_t lds_u32(const std::uint8_t* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}

// kBytes (2, 4, 8 or 16, aligned to that) bytes at p as little-endian words, w[0] first.
template <int kBytes>
__device__ __forceinline__ void lds_words(const std::uint8_t* p,
                                          std::uint32_t (&w)[(kBytes + 3) / 4]) {
  if constexpr (kBytes == 2) {
    w[0] = *reinterpret_cast<const unsigned short*>(p);
  } else if constexpr (kBytes == 4) {
    w[0] = lds_u32(p);
  } else if constexpr (kBytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x;
    w[1] = v.y;
  } else {
    static_assert(kBytes == 16, "value codes per lane and slot");
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  }
}

// B fragments of S = Q·Kᵀ for one k-chunk of one 16-slot group: lane (g, t) reads the key groups
// of channels c0 + j, j < 4 (c0 = kc·16 + 4t), whose codes start at `codes` and whose 4 scale
// bytes (contiguous, channel c0 + j in byte j) are `scales`. Out: kb[0], kb[2] = b0, b1 of n-tile
// 0 (slot 2g), kb[1], kb[3] = b0, b1 of n-tile 1 (slot 2g + 1); b0 = (channel c0, c0 + 1), b1 =
// (c0 + 2, c0 + 3), the lower channel in the low half (π in the file comment).
template <bool kNvfp4>
__device__ __forceinline__ void key_fragments(const std::uint8_t* codes, std::uint32_t scales,
                                              int g, std::uint32_t (&kb)[4]) {
  // x: one word whose pair fields (k, k + 4) for NVFP4 nibbles / (k, k + 8) for ternary 2-bit
  // fields are, for k = 0, 1, 2, 3: (ch0, ch1) at slot 2g, (ch0, ch1) at 2g + 1, (ch2, ch3) at 2g,
  // (ch2, ch3) at 2g + 1, i.e. bytes [ch0, ch2, ch1, ch3] of the slot pair (2g, 2g + 1).
  std::uint32_t x;
  if constexpr (kNvfp4) {
    // Group (8 bytes) of channel c0 + j at codes + 8j; byte g (slot 2g low nibble, 2g + 1 high)
    // lies in its word g / 4, at byte g % 4. The 8 lanes of one t read the same 32 bytes.
    const std::uint8_t* p = codes + 4 * (g >> 2);
    const std::uint32_t w0 = lds_u32(p), w1 = lds_u32(p + 8), w2 = lds_u32(p + 16),
                        w3 = lds_u32(p + 24);
    const unsigned sel = (g & 3) | (((g & 3) + 4) << 4);  // [a.byte(g%4), b.byte(g%4)]
    x = __byte_perm(__byte_perm(w0, w2, sel), __byte_perm(w1, w3, sel), 0x5410);
  } else {
    // Group (4 bytes, slot i at bits 2i) of channel c0 + j is word j of these 16 bytes; slots
    // 2g, 2g + 1 are nibble g: byte g / 2, nibble g % 2.
    const uint4 w = *reinterpret_cast<const uint4*>(codes);
    const unsigned sel = (g >> 1) | (((g >> 1) + 4) << 4);
    const std::uint32_t z =  // bytes [ch0, ch2, ch1, ch3] holding the wanted nibbles
        __byte_perm(__byte_perm(w.x, w.z, sel), __byte_perm(w.y, w.w, sel), 0x5410);
    const std::uint32_t zm = (z >> (4 * (g & 1))) & 0x0f0f0f0fu;
    // bits 0-3: ch0 (fields 0, 1), 4-7: ch2 (fields 2, 3), 16-19: ch1 (8, 9), 20-23: ch3 (10, 11);
    // bits 8-15 and 24-31 hold leftovers that no field k, k + 8 (k < 4) reads.
    x = (zm | (zm >> 4)) ^ 0xaaaaaaaau;
  }
  const __half2 s01 = e4m3x2(scales), s23 = e4m3x2(scales >> 16);
  if constexpr (kNvfp4) {
    const E2m1Bytes e = e2m1_bytes(x);
#pragma unroll
    for (int k = 0; k < 4; ++k)  // exact: see the file comment
      kb[k] = h2_bits(__hmul2(bits_h2(e2m1_pair(e, k)), k < 2 ? s01 : s23));
  } else {
    const __half2 n01 = minus6(s01), n23 = minus6(s23);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      kb[k] = ternary_scaled(ternary_bits(x, k), k < 2 ? s01 : s23, k < 2 ? n01 : n23);
  }
}

// 2^x on the special-function unit alone. exp2f adds a rescaling for results under 2^-126 (five
// more instructions per weight); a softmax weight that small next to the running max's 1 is
// flushed to 0 here, and 2^−inf = 0 makes a dead slot's weight 0 without a test.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The online-softmax update of one tile, both kernels: x holds this lane's 8 logits of MMA row
// g = lane / 4 in log2 units (−inf: dead slot), tmax their maximum; the 4 lanes of a quad hold
// one head's tile. Writes the weights p (0 for dead slots and padding heads), updates the running
// max m2 and sum l, and rescales the accumulator acc unless no lane's max moved (r = 1 exactly:
// skipping is exact, and once the maxima settle most tiles skip it).
template <int D>
__device__ __forceinline__ void online_softmax_tile(const float (&x)[8], float tmax, bool real_head,
                                                    float& m2, float& l, float (&p)[8],
                                                    float (&acc)[D / 8][4]) {
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
  const float m_new = fmaxf(m2, tmax);  // finite: the tile has a live slot
  const float r = ex2_ftz(m2 - m_new);  // 0 on the first live tile (m2 = −inf)
  float psum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float e = ex2_ftz(x[i] - m_new);  // 0 for a dead slot (x = −inf)
    p[i] = real_head ? e : 0.0f;
    psum += p[i];
  }
  psum += __shfl_xor_sync(0xffffffffu, psum, 1);
  psum += __shfl_xor_sync(0xffffffffu, psum, 2);
  l = l * r + psum;
  m2 = m_new;
  if (__any_sync(0xffffffffu, r != 1.0f)) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      acc[j][0] *= r;
      acc[j][1] *= r;
      acc[j][2] *= r;
      acc[j][3] *= r;
    }
  }
}

// Softmax and P·V of a tile of the dense kernel (bf16). x: this lane's logits in log2 units
// (−inf: dead slot), x[2·nt + j] at slot nt·8 + 2t + j of MMA row g = lane / 4, tmax their
// maximum. Updates the running max m2, sum l and accumulator acc (C fragments of P·V: rows g and
// g + 8 hold P_hi·V and P_lo·V).
template <int D>
__device__ __forceinline__ void softmax_pv_tile(const float (&x)[8], float tmax, int n,
                                                const __nv_bfloat16* sV,  // [32][D + 8]
                                                bool real_head, int lane, float& m2, float& l,
                                                float (&acc)[D / 8][4]) {
  constexpr int kVPitch = D + 8;
  float p[8];
  online_softmax_tile<D>(x, tmax, real_head, m2, l, p, acc);
  // O += P·V: A = P (rows g: high halves, g + 8: low halves), k-step ks = slots ks·16 .. + 15.
  const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1), lcol = 8 * (lane >> 4);
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    if (ks * 16 >= n) break;
    std::uint32_t pa[4];
    split16<true>(p[4 * ks], p[4 * ks + 1], pa[0], pa[1]);
    split16<true>(p[4 * ks + 2], p[4 * ks + 3], pa[2], pa[3]);
#pragma unroll
    for (int cp = 0; cp < D / 16; ++cp) {
      std::uint32_t bv[4];
      ldmatrix_x4_trans(bv, sV + (ks * 16 + lrow) * kVPitch + cp * 16 + lcol);
      detail::mma_16816<detail::Half16::bf16>(acc[2 * cp], pa, bv[0], bv[1]);
      detail::mma_16816<detail::Half16::bf16>(acc[2 * cp + 1], pa, bv[2], bv[3]);
    }
  }
}

// One warp's partial: rows [row0, row0 + G) of part_acc [.., D] and part_ml [.., 2]. acc · inv
// is in value units; a head without a live slot writes (−inf, 0) and no acc.
template <int D>
__device__ __forceinline__ void write_partial(float* part_acc, float* part_ml, std::int64_t row0,
                                              int g, int G, int t, float inv, float m2, float l,
                                              const float (&acc)[D / 8][4]) {
  if (g >= G) return;
  const std::int64_t row = row0 + g;
  if (l > 0.0f) {
    float* dst = part_acc + row * D;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const float2 o = make_float2((acc[i][0] + acc[i][2]) * inv, (acc[i][1] + acc[i][3]) * inv);
      *reinterpret_cast<float2*>(dst + i * 8 + 2 * t) = o;
    }
  }
  if (t == 0) {
    part_ml[row * 2] = l > 0.0f ? m2 * kLn2 : -INFINITY;
    part_ml[row * 2 + 1] = l;
  }
}

// Shared memory that combine_cta_partials needs: the four warps' partials of up to kMaxGroup heads.
template <int D>
constexpr std::size_t cta_partial_bytes() {
  return static_cast<std::size_t>(kWarps) * kMaxGroup * (D + 2) * sizeof(float);
}

// The CTA's one partial per query head, from the four its warps wrote into `cta` (their rows
// warp·G + g of [kWarps·G, D] accumulators, then [kWarps·G, 2] (max, sum), as write_partial and
// write_split_partial lay them out): rows [row0, row0 + G) of part_acc, part_ml. Thread (g, d)
// folds the warps in warp order (a fixed order: the same result on every run). Writing one
// partial per CTA instead of one per warp quarters the partials the merge reads: at batch 1 the
// merge, not the tiles, was the bulk of the time (bench/RESULTS.md run 81). All threads call this
// after a barrier that follows their last read of whatever `cta` overlays.
template <int D>
__device__ void combine_cta_partials(const float* cta, int G, float* part_acc, float* part_ml,
                                     std::int64_t row0) {
  __syncthreads();  // every warp's partial is in `cta`
  const float* ml = cta + kWarps * G * D;
  for (int p = threadIdx.x; p < G * D; p += kThreads) {
    const int g = p / D, d = p % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (ml[(w * G + g) * 2 + 1] > 0.0f) m = fmaxf(m, ml[(w * G + g) * 2]);
    }
    float acc = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float l = ml[(w * G + g) * 2 + 1];
      if (l > 0.0f) {  // a warp without a live slot wrote no accumulator
        const float e = expf(ml[(w * G + g) * 2] - m);
        acc += cta[(w * G + g) * D + d] * e;
        sum += l * e;
      }
    }
    part_acc[(row0 + g) * D + d] = acc;
    if (d == 0) {
      part_ml[(row0 + g) * 2] = sum > 0.0f ? m : -INFINITY;
      part_ml[(row0 + g) * 2 + 1] = sum;
    }
  }
}

// The query of one KV head's group as MMA A fragments (rows g: high halves, g + 8: low halves,
// per head scaled by a power of two sQs[g] so that the 16-bit halves neither overflow nor lose
// bits to subnormals) at sQa[kc·32 + lane]: bf16 in the natural k order (kBf16, the dense kernel)
// or fp16 in the k order π of the file comment (the paged kernel). All threads of the CTA call
// this.
template <int D, bool kBf16>
__device__ void setup_query(const float* q,  // [G, D]
                            int G, float* sQf, float* sQs, uint4* sQa) {
  constexpr int kChunks = D / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < G * D; i += kThreads) sQf[i] = q[i];
  __syncthreads();
  for (int g = warp; g < kMaxGroup; g += kWarps) {
    float mx = 0.0f;
    if (g < G) {
      for (int c = lane; c < D; c += 32) mx = fmaxf(mx, fabsf(sQf[g * D + c]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) {
      int e = 0;
      if (mx > 0.0f && isfinite(mx)) frexpf(mx, &e);  // mx < 2^e
      sQs[g] = ldexpf(1.0f, 13 - e);                  // scaled max < 2^13
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kChunks * 32; idx += kThreads) {
    const int kc = idx / 32, l = idx % 32, g = l / 4, t = l % 4;
    // k = 2t, 2t + 1, 2t + 8, 2t + 9 of chunk kc: channels kc·16 + 2t + {0, 1, 8, 9} (natural,
    // the dense kernel's ldmatrix B fragments) or kc·16 + 4t + {0, 1, 2, 3} (π, the paged kernel's
    // register-built B fragments).
    const int c0 = kc * 16 + (kBf16 ? 2 * t : 4 * t), c2 = kBf16 ? c0 + 8 : c0 + 2;
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (g < G) {
      const float s = sQs[g];
      const float* qg = sQf + g * D;
      x[0] = qg[c0] * s;
      x[1] = qg[c0 + 1] * s;
      x[2] = qg[c2] * s;
      x[3] = qg[c2 + 1] * s;
    }
    uint4 f;
    split16<kBf16>(x[0], x[1], f.x, f.y);  // a0: row g (hi), a1: row g + 8 (lo)
    split16<kBf16>(x[2], x[3], f.z, f.w);  // a2, a3: the same, columns + 8
    sQa[kc * 32 + l] = f;
  }
  __syncthreads();
}

struct SplitArgs {
  detail::PagedBatchRefs t;  // the table and the batch
  int tiles_per_block, group, tiles_per_warp, parts;
  float softmax_scale;
  const float* query;  // [batch, kv_heads · group, D]
  float* part_acc;     // [batch, kv_heads, parts, group, D]
  float* part_ml;      // [batch, kv_heads, parts, group, 2]: max (natural log units), sum
};

// A warp's shared-memory stage holds one tile's bytes as split_stage_tile copies them, at fixed
// offsets (NVFP4's sizes, the larger format's; a ternary tile uses the first part of each):
// key codes of the tile's ≤ 2 groups (2 · D · 8 B), their key scales (2 · D), the value codes of
// its ≤ 32 slots (32 · D / 2) and their value scales (32 · D / 16).
template <int D>
struct SplitStage {
  static constexpr int key_scales = 16 * D, value_codes = 18 * D, value_scales = 34 * D;
  static constexpr int bytes = 36 * D;
};
constexpr int kSplitStages = 2;  // per warp: the tile being multiplied and the next in flight

template <int D>
constexpr std::size_t split_shared_bytes(int group) {
  return static_cast<std::size_t>((D / 16) * 32) * 16 +                           // sQa
         static_cast<std::size_t>(group) * D * 4 + kMaxGroup * 4 +                // sQf, sQs
         static_cast<std::size_t>(kWarps) * kSplitStages * SplitStage<D>::bytes;  // stages
}

// Head dims the register-direct kernel takes: lane g's value codes of a slot (D/8 channels) are
// whole 2-, 4-, 8- or 16-byte loads in both formats. 16 and 32 take the tiled kernel.
bool split_head_dim_supported(std::int64_t d) { return d == 64 || d == 128 || d == 256; }

// S = Q·Kᵀ of a tile's 16-slot groups (s[sg][nt]: the C fragment of n-tile nt, slots 2·col + nt,
// of group sg; zero for a group skipped): codes and scales of the warp's stage from
// kcodes / kscales on (this lane's offsets included), qa the lane's query A fragments. kAllLive:
// the tile has two groups, both with a live slot, so no chunk tests which to skip (the test,
// warp-uniform, cost a branch, a warp sync and a NOP per chunk and group: ~48 instructions of a
// tile's ~1,255, bench/RESULTS.md run 88).
template <int D, bool kNvfp4, bool kAllLive>
__device__ __forceinline__ void key_logits(const std::uint8_t* kcodes, const std::uint8_t* kscales,
                                           const uint4* qa, int g, int ngroups,
                                           const unsigned (&glive)[2], float (&s)[2][2][4]) {
  constexpr int kCodeBytes = kNvfp4 ? 8 : 4;  // per group
#pragma unroll
  for (int sg = 0; sg < 2; ++sg)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[sg][nt][0] = s[sg][nt][1] = s[sg][nt][2] = s[sg][nt][3] = 0.0f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    const uint4 av = qa[kc * 32];
    const std::uint32_t afr[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
    for (int sg = 0; sg < 2; ++sg) {
      if (!kAllLive && (sg >= ngroups || glive[sg] == 0)) continue;  // warp-uniform
      std::uint32_t kb[4];
      key_fragments<kNvfp4>(kcodes + (sg * D + kc * 16) * kCodeBytes,
                            lds_u32(kscales + sg * D + kc * 16), g, kb);
      detail::mma_16816<detail::Half16::f16>(s[sg][0], afr, kb[0], kb[2]);
      detail::mma_16816<detail::Half16::f16>(s[sg][1], afr, kb[1], kb[3]);
    }
  }
}

// One tile (n = 16 or 32 slots, format NVFP4 or ternary) of one warp from its shared-memory
// stage `st` (SplitStage): S, online softmax, O += P·V, every MMA operand built in registers from
// the codes (file comment). qa: this lane's query A fragments, [D/16] at stride 32. live: bit s =
// slot s of the tile is live. kfac: logit scale (log2 units), vfac: P scale (file comment).
template <int D, bool kNvfp4>
__device__ __forceinline__ void split_tile(const std::uint8_t* st, int n, unsigned live,
                                           const uint4* qa, float kfac, float vfac, bool real_head,
                                           int g, int t, float& m2, float& l,
                                           float (&acc)[D / 8][4]) {
  using Stage = SplitStage<D>;
  constexpr int kCodeBytes = kNvfp4 ? 8 : 4;            // per group
  constexpr int kVBytes = kNvfp4 ? D / 16 : D / 32;     // lane's codes of one slot
  constexpr int kVWords = (kVBytes + 3) / 4;            //
  constexpr int kVScales = D >= 256 ? 2 : 1;            // lane's value groups of one slot
  constexpr int kPairWords = kNvfp4 ? D / 32 : D / 64;  // slot-pair words per B column set
  constexpr int kTilesPerWord = kNvfp4 ? 4 : 8;         // n-tiles per slot-pair word
  static_assert(kPairWords * kTilesPerWord == D / 8, "n-tiles");
  const int ngroups = n / 16;
  unsigned glive[2];  // live bits of group sg's 16 slots
  glive[0] = live & 0xffffu;
  glive[1] = live >> 16;
  const unsigned lane_live = live >> (4 * t);  // bit 16·sg + i: slot 16·sg + 4t + i is live

  // 1. S = Q·Kᵀ: s[sg][nt] is the C fragment of n-tile nt (slots 2·col + nt) of group sg.
  float s[2][2][4];
  const std::uint8_t* kcodes = st + 4 * t * kCodeBytes;
  const std::uint8_t* kscales = st + Stage::key_scales + 4 * t;
  if (ngroups == 2 && glive[0] != 0 && glive[1] != 0) {  // warp-uniform; the usual tile
    key_logits<D, kNvfp4, true>(kcodes, kscales, qa, g, ngroups, glive, s);
  } else {
    key_logits<D, kNvfp4, false>(kcodes, kscales, qa, g, ngroups, glive, s);
  }

  // 2. Logits (log2 units) of head g at slots 16·sg + 4t + i: n-tile i % 2, column 2t + i / 2;
  // x[4·sg + i].
  float x[8], tmax = -INFINITY;
#pragma unroll
  for (int sg = 0; sg < 2; ++sg) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float v = (s[sg][i & 1][i >> 1] + s[sg][i & 1][2 + (i >> 1)]) * kfac;
      x[4 * sg + i] = ((lane_live >> (16 * sg + i)) & 1u) ? v : -INFINITY;
      tmax = fmaxf(tmax, x[4 * sg + i]);
    }
  }
  float p[8];
  online_softmax_tile<D>(x, tmax, real_head, m2, l, p, acc);

  // 3. O += P·V per group: A = P (k-order ρ: a0/a1 = slots 4t, 4t + 1, a2/a3 = 4t + 2, 4t + 3;
  // rows g: high halves, g + 8: low halves), B column n of n-tile j = channel n·D/8 + j.
  const std::uint8_t* vcodes = st + Stage::value_codes + g * kVBytes;
  const std::uint8_t* vscales = st + Stage::value_scales + (g * D) / 128;
#pragma unroll
  for (int sg = 0; sg < 2; ++sg) {
    if (sg >= ngroups || glive[sg] == 0) continue;  // warp-uniform
    std::uint32_t pa[4];
    split16<false>(p[4 * sg] * vfac, p[4 * sg + 1] * vfac, pa[0], pa[1]);
    split16<false>(p[4 * sg + 2] * vfac, p[4 * sg + 3] * vfac, pa[2], pa[3]);
    // Codes of channels [g·D/8, (g + 1)·D/8) of slot s: bytes s·8·kVBytes + g·kVBytes of the
    // value codes (a slot's D/16 groups are contiguous, channel order within); their scale(s):
    // value group s·D/16 + g·D/128 (and the next one for D = 256).
    std::uint32_t vc[4][kVWords], vs[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int slot = 16 * sg + 4 * t + i;
      lds_words<kVBytes>(vcodes + slot * 8 * kVBytes, vc[i]);
      const std::uint8_t* sp = vscales + slot * (D / 16);
      vs[i] = kVScales == 2 ? *reinterpret_cast<const unsigned short*>(sp) : *sp;
      if (!((lane_live >> (16 * sg + i)) & 1u)) {  // dead slot: stale codes never enter
#pragma unroll
        for (int w = 0; w < kVWords; ++w) vc[i][w] = 0;
        vs[i] = 0;
      }
    }
#pragma unroll
    for (int m = 0; m < kPairWords; ++m) {
      // Pair words of slots (4t, 4t + 1) -> b0 and (4t + 2, 4t + 3) -> b1: bytes [A.b0, A.b1,
      // B.b0, B.b1] (or b2, b3) of the code word, so that pair field k holds (A, B) at lane code
      // index m·kTilesPerWord + k, i.e. the channel of n-tile j = m·kTilesPerWord + k.
      const unsigned sel = (m & 1) ? 0x7632u : 0x5410u;
      std::uint32_t x0 = __byte_perm(vc[0][m / 2], vc[1][m / 2], sel);
      std::uint32_t x1 = __byte_perm(vc[2][m / 2], vc[3][m / 2], sel);
      if (!kNvfp4) {
        x0 ^= 0xaaaaaaaau;
        x1 ^= 0xaaaaaaaau;
      }
      const int q = (m * kTilesPerWord) / 16;  // which of the lane's value groups
      const unsigned ssel = q | ((q + 4) << 4);
      const __half2 s0 = e4m3x2(__byte_perm(vs[0], vs[1], ssel));
      const __half2 s1 = e4m3x2(__byte_perm(vs[2], vs[3], ssel));
      if constexpr (kNvfp4) {
        const E2m1Bytes e0 = e2m1_bytes(x0), e1 = e2m1_bytes(x1);
#pragma unroll
        for (int k = 0; k < kTilesPerWord; ++k) {
          detail::mma_16816<detail::Half16::f16>(acc[m * kTilesPerWord + k], pa,
                                                 h2_bits(__hmul2(bits_h2(e2m1_pair(e0, k)), s0)),
                                                 h2_bits(__hmul2(bits_h2(e2m1_pair(e1, k)), s1)));
        }
      } else {
        const __half2 n0 = minus6(s0), n1 = minus6(s1);
#pragma unroll
        for (int k = 0; k < kTilesPerWord; ++k) {
          detail::mma_16816<detail::Half16::f16>(acc[m * kTilesPerWord + k], pa,
                                                 ternary_scaled(ternary_bits(x0, k), s0, n0),
                                                 ternary_scaled(ternary_bits(x1, k), s1, n1));
        }
      }
    }
  }
}

// One warp's partial of the paged kernel: lane (g, t) holds head g at channels
// [(D/4)·t, (D/4)·(t + 1)): acc[j][0] + acc[j][2] at (D/4)·t + j, acc[j][1] + acc[j][3] at
// (D/4)·t + D/8 + j (file comment). Rows [row0, row0 + G) of part_acc [.., D], part_ml [.., 2].
template <int D>
__device__ __forceinline__ void write_split_partial(float* part_acc, float* part_ml,
                                                    std::int64_t row0, int g, int G, int t,
                                                    float inv, float m2, float l,
                                                    const float (&acc)[D / 8][4]) {
  if (g >= G) return;
  const std::int64_t row = row0 + g;
  if (l > 0.0f) {
    float* dst = part_acc + row * D + (D / 4) * t;
#pragma unroll
    for (int j = 0; j < D / 8; j += 4) {
      *reinterpret_cast<float4*>(dst + j) =
          make_float4((acc[j][0] + acc[j][2]) * inv, (acc[j + 1][0] + acc[j + 1][2]) * inv,
                      (acc[j + 2][0] + acc[j + 2][2]) * inv, (acc[j + 3][0] + acc[j + 3][2]) * inv);
      *reinterpret_cast<float4*>(dst + D / 8 + j) =
          make_float4((acc[j][1] + acc[j][3]) * inv, (acc[j + 1][1] + acc[j + 1][3]) * inv,
                      (acc[j + 2][1] + acc[j + 2][3]) * inv, (acc[j + 3][1] + acc[j + 3][3]) * inv);
    }
  }
  if (t == 0) {
    part_ml[row * 2] = l > 0.0f ? m2 * kLn2 : -INFINITY;
    part_ml[row * 2 + 1] = l;
  }
}

// What a warp needs of one of its tiles: live bits (0: skip it), format, the byte offset in
// storage of the tile's block's section for this KV head, and the tile's first slot in its block
// and slot count.
struct SplitTileRef {
  unsigned live = 0;
  int nvfp4 = 0;
  long long offset = 0;
  int start = 0, n = 0;
};

// The description of tile `it` of the warp whose first unit is u_first (unit u_first + 4·it of
// the sequence whose blocks start at `begin`), or a dead one past `tiles`.
__device__ __forceinline__ SplitTileRef split_tile_ref(const SplitArgs& a, int begin, int u_first,
                                                       int it, int tiles, int h) {
  SplitTileRef r;
  if (it >= tiles) return r;
  const int u = u_first + it * kWarps;
  const int blk = begin + u / a.tiles_per_block, start = (u % a.tiles_per_block) * kTileSlots;
  const int n = min(kTileSlots, a.t.block_size - start);
  const std::int64_t frame = a.t.frames[blk];
  const std::uint64_t word =
      a.t.masks[(frame * a.t.kv_heads + h) * a.t.mask_words + start / 64];  // free bit = 1
  r.live = ~static_cast<unsigned>(word >> (start % 64)) & (n == 32 ? 0xffffffffu : 0xffffu);
  r.nvfp4 = (a.t.meta[blk] & 0xf) == kFormatNvfp4;  // else ternary (split_kernel_takes)
  const std::int64_t head_bytes = r.nvfp4 ? a.t.layouts.by_format[kFormatNvfp4].head_bytes
                                          : a.t.layouts.by_format[kFormatTernary].head_bytes;
  r.offset = a.t.frame_offsets[frame] + h * head_bytes;
  r.start = start;
  r.n = n;
  return r;
}

// Copies `groups` (1 or 2) × kGroupBytes contiguous bytes from src to dst in 16-byte cp.async
// chunks, lane-strided; the trip count is a constant, so the copies are predicated, not looped.
template <int kGroupBytes>
__device__ __forceinline__ void stage_section(std::uint8_t* dst, const std::uint8_t* src,
                                              int groups, int lane) {
  static_assert(kGroupBytes % 16 == 0, "16-byte chunks");
  constexpr int kStride = 32 * 16;
#pragma unroll
  for (int i = 0; i < (2 * kGroupBytes + kStride - 1) / kStride; ++i) {
    const int c = lane * 16 + i * kStride;
    if (c < groups * kGroupBytes) detail::cp_async16(dst + c, src + c, true);
  }
}

// Issues the cp.async copies of tile r's bytes into the warp's stage `st` (SplitStage layout):
// four contiguous runs of 16-byte chunks (every section offset and length is a multiple of 16),
// per 16-slot group: key codes D · 8 (NVFP4) or D · 4 (ternary) bytes, key scales D, value codes
// D · 8 or D · 4, value scales D.
template <int D, bool kNvfp4>
__device__ __forceinline__ void split_stage_format(std::uint8_t* st, const SplitArgs& a,
                                                   const SplitTileRef& r, int lane) {
  using Stage = SplitStage<D>;
  constexpr int kCodeBytes = kNvfp4 ? 8 : 4;  // per group of 16 codes
  const PagedHeadLayout& L = a.t.layouts.by_format[kNvfp4 ? kFormatNvfp4 : kFormatTernary];
  const std::uint8_t* base = a.t.storage + r.offset;
  const std::int64_t g0 = r.start / 16;  // the tile's first group in the block
  const int groups = r.n / 16;
  stage_section<D * kCodeBytes>(st, base + g0 * D * kCodeBytes, groups, lane);
  stage_section<D>(st + Stage::key_scales, base + L.key_scales + g0 * D, groups, lane);
  stage_section<D * kCodeBytes>(st + Stage::value_codes, base + L.value_codes + g0 * D * kCodeBytes,
                                groups, lane);
  stage_section<D>(st + Stage::value_scales, base + L.value_scales + g0 * D, groups, lane);
}

template <int D>
__device__ __forceinline__ void split_stage_tile(std::uint8_t* st, const SplitArgs& a,
                                                 const SplitTileRef& r, int lane) {
  if (r.live == 0) return;
  if (r.nvfp4) {
    split_stage_format<D, true>(st, a, r, lane);
  } else {
    split_stage_format<D, false>(st, a, r, lane);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, D >= 256 ? 2 : 4) split_decode_kernel(SplitArgs a) {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim (split_head_dim_supported)");
  using Stage = SplitStage<D>;
  constexpr int kChunks = D / 16;  // 16-channel MMA k-steps of Q·Kᵀ
  extern __shared__ __align__(16) std::uint8_t smem[];
  uint4* sQa = reinterpret_cast<uint4*>(smem);  // [kChunks][32 lanes] fp16 A fragments (π)
  float* sQf = reinterpret_cast<float*>(sQa + kChunks * 32);  // [G, D] the query, fp32
  float* sQs = sQf + a.group * D;                             // [kMaxGroup] 2^e per head
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  cudaTriggerProgrammaticLaunchCompletion();  // the merge may start (launch_merge)
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, G = a.group;
  const int H = a.t.kv_heads;
  // --- this warp's run of tiles -----------------------------------------------------------------
  const int g = lane / 4, t = lane % 4;  // MMA row (query head) and column pair of this lane
  const int begin = a.t.block_begin[b];
  const int units = (a.t.block_begin[b + 1] - begin) * a.tiles_per_block;

  // Tile it of this warp is unit u_first + 4·it. Its description (live bits, format, byte offset of
  // its head's section) is read 32 tiles at a time, lane j holding tile 32c + j's, and broadcast
  // from there; its bytes are copied into stage it % 2 by cp.async while tile it − 1 is multiplied,
  // so a warp never waits on a global load it has just issued.
  std::uint8_t* stages = smem + split_shared_bytes<D>(G) -
                         static_cast<std::size_t>(kWarps - warp) * kSplitStages * Stage::bytes;
  const int u_first = split * kWarps * a.tiles_per_warp + warp;
  const int tiles = max(0, min(a.tiles_per_warp, (units - u_first + kWarps - 1) / kWarps));
  SplitTileRef mine;               // this lane's tile of the current run of 32
  const auto tile = [&](int it) {  // tile it's description; it < tiles, it / 32 the loaded run
    SplitTileRef r;
    r.live = __shfl_sync(0xffffffffu, mine.live, it % 32);
    r.offset = __shfl_sync(0xffffffffu, mine.offset, it % 32);
    // format and first slot in one shuffle (recomputing the slot costs an integer division)
    const int packed = __shfl_sync(0xffffffffu, mine.nvfp4 | (mine.start << 1), it % 32);
    r.nvfp4 = packed & 1;
    r.start = packed >> 1;
    r.n = min(kTileSlots, a.t.block_size - r.start);  // 16 or 32 (block_size % 16 == 0)
    return r;
  };
  if (tiles > 0) mine = split_tile_ref(a, begin, u_first, lane, tiles, h);
  SplitTileRef cur;
  if (tiles > 0) {
    cur = tile(0);
    split_stage_tile<D>(stages, a, cur, lane);
  }
  detail::cp_async_commit();
  // The first tile's chain of dependent loads (block list, frame, mask, its bytes) is in flight
  // while the query is set up.
  const float* q = a.query + (static_cast<std::int64_t>(b) * H + h) * G * D;

  setup_query<D, false>(q, G, sQf, sQs, sQa);

  const float gf = a.t.global_factors[h];
  const float conv_nvfp4 = 16384.0f / gf;  // NVFP4 16-bit value × this = dequantized value
  int pe = 0;
  frexpf(fmaxf(conv_nvfp4, 1.0f), &pe);
  const float pexp = ldexpf(1.0f, 15 - pe);  // P' = p · conv · pexp < 2^15 for every format
  const float qinv = g < G ? 1.0f / sQs[g] : 0.0f;
  const uint4* qa = sQa + lane;

  float m2 = -INFINITY, l = 0.0f;  // running max (log2 units) and sum of this lane's head
  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  for (int it = 0; it < tiles; ++it) {
    if ((it + 1) % 32 == 0 && it + 1 < tiles)
      mine = split_tile_ref(a, begin, u_first, it + 1 + lane, tiles, h);
    SplitTileRef next;
    if (it + 1 < tiles) {
      next = tile(it + 1);
      split_stage_tile<D>(stages + ((it + 1) % kSplitStages) * Stage::bytes, a, next, lane);
    }
    detail::cp_async_commit();   // possibly empty: one group per iteration keeps the count
    detail::cp_async_wait<1>();  // tile it's group has landed (for this lane)
    __syncwarp();                // ... and for every lane
    const std::uint8_t* st = stages + (it % kSplitStages) * Stage::bytes;
    if (cur.live != 0) {
      if (cur.nvfp4) {
        split_tile<D, true>(st, cur.n, cur.live, qa, conv_nvfp4 * qinv * a.softmax_scale * kLog2e,
                            conv_nvfp4 * pexp, g < G, g, t, m2, l, acc);
      } else {
        split_tile<D, false>(st, cur.n, cur.live, qa, qinv * a.softmax_scale * kLog2e, pexp, g < G,
                             g, t, m2, l, acc);
      }
    }
    __syncwarp();  // every lane is done with stage it % 2 before tile it + 2 is copied into it
    cur = next;
  }

  static_assert(cta_partial_bytes<D>() <= kWarps * kSplitStages * Stage::bytes, "cta overlay");
  detail::cp_async_wait<0>();
  __syncthreads();  // every warp is done with its stages and the query, which `cta` overlays
  float* cta = reinterpret_cast<float*>(smem);
  write_split_partial<D>(cta, cta + kWarps * G * D, warp * G, g, G, t, 1.0f / pexp, m2, l, acc);
  combine_cta_partials<D>(cta, G, a.part_acc, a.part_ml,
                          ((static_cast<std::int64_t>(b) * H + h) * a.parts + split) * G);
}

// --- the dense baseline: the same split-sequence design over a contiguous bf16 cache -----------

struct DenseArgs {
  const bf16_t* keys;    // [batch, kv_heads, tokens, D]
  const bf16_t* values;  // [batch, kv_heads, tokens, D]
  std::int64_t tokens;
  int kv_heads, group, tiles_per_warp, parts;
  float softmax_scale;
  const float* query;  // [batch, kv_heads · group, D]
  float* part_acc;     // [batch, kv_heads, parts, group, D]
  float* part_ml;      // [batch, kv_heads, parts, group, 2]
};

template <int D>
constexpr std::size_t dense_shared_bytes(int group) {
  return static_cast<std::size_t>((D / 16) * 32) * 16 +                    // sQa (bf16)
         static_cast<std::size_t>(group) * D * 4 + kMaxGroup * 4 +         // sQf, sQs
         static_cast<std::size_t>(kWarps) * 2 * kTileSlots * (D + 8) * 2;  // sK, sV
}

// Grid (splits, KV heads, batch), 4 warps: per 32-token tile, cp.async copies the K and V rows
// into the warp's shared tiles (slot-major, both), then the same MMAs, softmax and partials as
// the paged kernel (K here is read with a non-transposed ldmatrix).
template <int D>
__global__ void __launch_bounds__(kThreads, 2) dense_split_kernel(DenseArgs a) {
  constexpr int kChunks = D / 16, kPitch = D + 8, kRowChunks = D / 8;
  extern __shared__ __align__(16) std::uint8_t smem[];
  uint4* sQa = reinterpret_cast<uint4*>(smem);  // [kChunks][32 lanes] bf16 A fragments
  float* sQf = reinterpret_cast<float*>(sQa + kChunks * 32);
  float* sQs = sQf + a.group * D;
  __nv_bfloat16* sAll = reinterpret_cast<__nv_bfloat16*>(sQs + kMaxGroup);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __nv_bfloat16* sK = sAll + static_cast<std::size_t>(warp) * 2 * kTileSlots * kPitch;
  __nv_bfloat16* sV = sK + kTileSlots * kPitch;
  cudaTriggerProgrammaticLaunchCompletion();  // the merge may start (launch_merge)
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, G = a.group, H = a.kv_heads;
  setup_query<D, true>(a.query + (static_cast<std::int64_t>(b) * H + h) * G * D, G, sQf, sQs, sQa);

  const int g = lane / 4, t = lane % 4;
  const float qinv = g < G ? 1.0f / sQs[g] : 0.0f;
  const std::int64_t head0 = (static_cast<std::int64_t>(b) * H + h) * a.tokens;
  const int units = static_cast<int>((a.tokens + kTileSlots - 1) / kTileSlots);
  float m2 = -INFINITY, l = 0.0f;
  float acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  const int u_first = split * kWarps * a.tiles_per_warp + warp;
  for (int it = 0; it < a.tiles_per_warp; ++it) {
    const int u = u_first + it * kWarps;
    if (u >= units) break;
    const std::int64_t first = static_cast<std::int64_t>(u) * kTileSlots;
    const std::int64_t left = a.tokens - first;
    const int n = left < kTileSlots ? static_cast<int>(left) : kTileSlots;
    if (it + 1 < a.tiles_per_warp && u + kWarps < units) {  // L2 prefetch of the next tile
      const std::int64_t first2 = first + kWarps * kTileSlots;
      const std::int64_t bytes = std::min<std::int64_t>(kTileSlots, a.tokens - first2) * D * 2;
      const std::int64_t row0 = (head0 + first2) * D;
      for (std::int64_t off = lane * 128; off < bytes; off += 32 * 128) {
        prefetch_l2(reinterpret_cast<const std::uint8_t*>(a.keys + row0) + off);
        prefetch_l2(reinterpret_cast<const std::uint8_t*>(a.values + row0) + off);
      }
    }
    for (int c = lane; c < kTileSlots * kRowChunks; c += 32) {
      const int s = c / kRowChunks, ch = c % kRowChunks;
      const bool valid = s < n;  // rows past the end are zero-filled
      const std::int64_t off = valid ? (head0 + first + s) * D + ch * 8 : 0;
      detail::cp_async16(sK + s * kPitch + ch * 8, a.keys + off, valid);
      detail::cp_async16(sV + s * kPitch + ch * 8, a.values + off, valid);
    }
    detail::cp_async_commit();
    detail::cp_async_wait<0>();
    __syncwarp();
    float sacc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) sacc[i][0] = sacc[i][1] = sacc[i][2] = sacc[i][3] = 0.0f;
    const uint4* qa = sQa + lane;  // bf16 fragments
    const int j = lane >> 3, r = lane & 7;
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc) {
      const uint4 av = qa[kc * 32];
      const std::uint32_t afr[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        if (np * 16 >= n) break;
        std::uint32_t bk[4];
        detail::ldmatrix_x4(bk, sK + (np * 16 + r + 8 * (j >> 1)) * kPitch + kc * 16 + 8 * (j & 1));
        detail::mma_16816<detail::Half16::bf16>(sacc[2 * np], afr, bk[0], bk[1]);
        detail::mma_16816<detail::Half16::bf16>(sacc[2 * np + 1], afr, bk[2], bk[3]);
      }
    }
    const unsigned live = n == 32 ? 0xffffffffu : ((1u << n) - 1u);
    const float kfac = qinv * a.softmax_scale * kLog2e;
    float x2[8], tmax = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int s = nt * 8 + 2 * t + jj;
        const float x = ((live >> s) & 1u) ? (sacc[nt][jj] + sacc[nt][2 + jj]) * kfac : -INFINITY;
        x2[2 * nt + jj] = x;
        tmax = fmaxf(tmax, x);
      }
    }
    softmax_pv_tile<D>(x2, tmax, n, sV, g < G, lane, m2, l, acc);
    __syncwarp();
  }
  static_assert(cta_partial_bytes<D>() <= kWarps * 2 * kTileSlots * kPitch * 2, "cta overlay");
  __syncthreads();  // every warp is done with its tiles and the query, which `cta` overlays
  float* cta = reinterpret_cast<float*>(smem);
  write_partial<D>(cta, cta + kWarps * G * D, warp * G, g, G, t, 1.0f, m2, l, acc);
  combine_cta_partials<D>(cta, G, a.part_acc, a.part_ml,
                          ((static_cast<std::int64_t>(b) * H + h) * a.parts + split) * G);
}

// --- the merge: the CTAs' partials and the staged tokens, one CTA per (KV head, sequence) ------

// out = Σ_p acc_p·e^{m_p − m} / Σ_p l_p·e^{m_p − m} over the parts p of combine_cta_partials and,
// for the paged table, the sequence's staged tokens (16-bit keys and values waiting for their
// 16-token group, §3.4: at most 16 per thought type), whose logits and weighted values are
// computed here in fp32 on CUDA cores. They are folded in here rather than in a kernel of their
// own: at batch 1 a launch is microseconds (bench/RESULTS.md run 81). Zero without a live slot.
struct MergeArgs {
  const float* part_acc = nullptr;  // [batch, kv_heads, parts, group, D]
  const float* part_ml = nullptr;   // [batch, kv_heads, parts, group, 2]: max (natural log), sum
  int kv_heads = 0, group = 0, parts = 0, head_dim = 0;
  float* out = nullptr;  // [batch, kv_heads · group, D]
  // The staged tokens; masks == nullptr: none (the dense baseline).
  const PagedStaging* keys = nullptr;     // [max_sequences, 3, kv_heads, 16, D]
  const PagedStaging* values = nullptr;   // [max_sequences, 3, kv_heads, 16, D]
  const std::uint32_t* masks = nullptr;   // [max_sequences, 3, kv_heads] bit r: row r is staged
  const std::int32_t* seq_ids = nullptr;  // [batch]
  float softmax_scale = 1.0f;
  const float* query = nullptr;  // [batch, kv_heads · group, D]
};

// The merge of partials alone; the paged path then adds its staged tokens.
MergeArgs merge_args(const float* part_acc, const float* part_ml, int kv_heads, int group,
                     int parts, int head_dim, float* out) {
  MergeArgs a;
  a.part_acc = part_acc;
  a.part_ml = part_ml;
  a.kv_heads = kv_heads;
  a.group = group;
  a.parts = parts;
  a.head_dim = head_dim;
  a.out = out;
  return a;
}

constexpr int kStagedRows = kPagedThoughtTypes * 16;
constexpr int kMergeUnroll = 8;  // partial rows a lane has in flight (the merge is latency-bound)

// The staged rows of one (KV head, sequence), in shared memory: their count n, their rows
// srow[k < n] in order, the weights sx[g][k] = e^{x − sm[g]} of their logits x,
// sl[g] = Σ_k sx[g][k] and the weighted values sv[g][d] = Σ_k sx[g][k] · v_k[d].
struct StagedRows {
  float sx[kMaxGroup][kStagedRows];
  float sm[kMaxGroup], sl[kMaxGroup];
  float sv[kMaxGroup][256];  // head_dim <= 256
  int srow[kStagedRows];
  int n;
};

// Row index in staged_keys / staged_values of staged row r (thought type r / 16, row r % 16) of
// KV head h of the sequence whose streams start at stream0 (= slot · 3 · kv_heads).
__device__ __forceinline__ std::int64_t staged_row(std::int64_t stream0, int r, int H, int h) {
  return (stream0 + static_cast<std::int64_t>(r / 16) * H + h) * 16 + r % 16;
}

// Fills `s` for KV head h of sequence b: the logits (warp w takes rows w, w + 4, ...: its lanes
// load the row's channels, coalesced, and reduce the G logits by shuffles), their weights and the
// weighted values. All threads call this. It reads only the query and the staging, never the
// split kernel's partials, so merge_kernel runs it before waiting for that kernel.
__device__ void staged_tokens(const MergeArgs& a, int h, int b, std::int64_t stream0,
                              StagedRows& s) {
  const int G = a.group, D = a.head_dim, H = a.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* q = a.query + (static_cast<std::int64_t>(b) * H + h) * G * D;  // [G, D]
  if (threadIdx.x == 0) {
    int n = 0;
    for (int t = 0; t < kPagedThoughtTypes; ++t) {
      const std::uint32_t mask = a.masks[stream0 + static_cast<std::int64_t>(t) * H + h];
      for (int r = 0; r < 16; ++r) {
        if ((mask >> r) & 1u) s.srow[n++] = t * 16 + r;
      }
    }
    s.n = n;
  }
  __syncthreads();
  const int n = s.n;
  for (int k = warp; k < n; k += kWarps) {
    const PagedStaging* kr = a.keys + staged_row(stream0, s.srow[k], H, h) * D;
    float dot[kMaxGroup] = {};
    for (int c = lane; c < D; c += 32) {
      const float kv = to_float(kr[c]);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < G) dot[g] += q[g * D + c] * kv;
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= G) break;  // G is the same for the whole warp: no padding head is reduced
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
      if (lane == 0) s.sx[g][k] = dot[g] * a.softmax_scale;
    }
  }
  __syncthreads();
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    float m = -INFINITY;
    for (int k = 0; k < n; ++k) m = fmaxf(m, s.sx[g][k]);
    float l = 0.0f;
    for (int k = 0; k < n; ++k) {
      const float x = s.sx[g][k];
      const float w = x > -INFINITY ? expf(x - m) : 0.0f;  // a finite x implies a finite max
      s.sx[g][k] = w;
      l += w;
    }
    s.sm[g] = m;
    s.sl[g] = l;
  }
  __syncthreads();
  // sv: warp w takes the query heads w, w + 4, ..., lane j channels 4j .. 4j + 3 (+ 128), the rows
  // in order (a fixed summation order).
  for (int g = warp; g < G; g += kWarps) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int d = 4 * lane + 128 * j;
      if (d >= D) break;
      float4 sv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
      for (int k = 0; k < n; ++k) {
        const float w = s.sx[g][k];
        const PagedStaging* vr = a.values + staged_row(stream0, s.srow[k], H, h) * D + d;
        sv.x += w * to_float(vr[0]);
        sv.y += w * to_float(vr[1]);
        sv.z += w * to_float(vr[2]);
        sv.w += w * to_float(vr[3]);
      }
      *reinterpret_cast<float4*>(&s.sv[g][d]) = sv;
    }
  }
  __syncthreads();
}

// Grid (kv_heads, batch), kThreads threads; warp w merges query heads w, w + 4, ... of its KV
// head. Lane j takes the parts j, j + 32, ... for the max and, 32 parts at a time, computes its
// part's weight e^{m_p − m} once and adds l_p times it to its share of the denominator; the
// weights are then broadcast by shuffles while every lane sums acc_p over its channels 4j.. 4j + 3
// (+ 128), kMergeUnroll rows loaded before they are used, in part order, the staged tokens last:
// a fixed order, so the result is the same on every run. Every part's accumulator was written
// (combine_cta_partials writes zeros where no slot was live), so no load reads stale memory.
__global__ void __launch_bounds__(kThreads) merge_kernel(MergeArgs a) {
  __shared__ StagedRows staged;
  const int h = blockIdx.x, b = blockIdx.y, G = a.group, D = a.head_dim, H = a.kv_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  std::int64_t stream0 = 0;
  int n = 0;
  if (a.masks != nullptr) {  // the same for the whole grid: the barriers inside are uniform
    stream0 = static_cast<std::int64_t>(a.seq_ids[b]) * kPagedThoughtTypes * H;
    staged_tokens(a, h, b, stream0, staged);
    n = staged.n;
  }
  // The partials are the split kernel's: launched as its programmatic dependent (launch_merge),
  // this kernel may start while that one still runs; the staged tokens above overlap it.
  cudaGridDependencySynchronize();
  for (int g = warp; g < G; g += kWarps) {
    const std::int64_t first = (static_cast<std::int64_t>(b) * H + h) * a.parts * G + g;
    const auto ml = [&](int p, int i) {
      return a.part_ml[(first + static_cast<std::int64_t>(p) * G) * 2 + i];
    };
    float m = -INFINITY;
    for (int p = lane; p < a.parts; p += 32) {
      if (ml(p, 1) > 0.0f) m = fmaxf(m, ml(p, 0));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const bool has_staged = n > 0 && staged.sl[g] > 0.0f;
    if (has_staged) m = fmaxf(m, staged.sm[g]);
    float denom = 0.0f;
    float4 acc[2] = {};  // channels 4·lane .. + 3 and 128 + 4·lane .. + 3 (head_dim <= 256)
    for (int c0 = 0; c0 < a.parts; c0 += 32) {
      const int cn = min(32, a.parts - c0);
      const float l = lane < cn ? ml(c0 + lane, 1) : 0.0f;
      const float wl = l > 0.0f ? expf(ml(c0 + lane, 0) - m) : 0.0f;  // 0 past cn
      denom += l * wl;
      const float* src = a.part_acc + (first + static_cast<std::int64_t>(c0) * G) * D;
      for (int k0 = 0; k0 < cn; k0 += kMergeUnroll) {  // k0 + u < 32: lane k0 + u's weight
        float4 x[kMergeUnroll][2];
#pragma unroll
        for (int u = 0; u < kMergeUnroll; ++u) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int d = 4 * lane + 128 * j;
            x[u][j] = k0 + u < cn && d < D
                          ? *reinterpret_cast<const float4*>(
                                src + static_cast<std::int64_t>(k0 + u) * G * D + d)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int u = 0; u < kMergeUnroll; ++u) {
          const float w = __shfl_sync(0xffffffffu, wl, k0 + u);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            acc[j].x += x[u][j].x * w;
            acc[j].y += x[u][j].y * w;
            acc[j].z += x[u][j].z * w;
            acc[j].w += x[u][j].w * w;
          }
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, o);
    if (has_staged) {
      const float ws = expf(staged.sm[g] - m);
      denom += staged.sl[g] * ws;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int d = 4 * lane + 128 * j;
        if (d >= D) break;
        const float4 sv = *reinterpret_cast<const float4*>(&staged.sv[g][d]);
        acc[j].x += sv.x * ws;
        acc[j].y += sv.y * ws;
        acc[j].z += sv.z * ws;
        acc[j].w += sv.w * ws;
      }
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    float* o = a.out + ((static_cast<std::int64_t>(b) * H + h) * G + g) * D;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int d = 4 * lane + 128 * j;
      if (d >= D) break;
      *reinterpret_cast<float4*>(o + d) =
          make_float4(acc[j].x * inv, acc[j].y * inv, acc[j].z * inv, acc[j].w * inv);
    }
  }
}

// The merge is launched as the split kernel's programmatic dependent (CUDA programming guide,
// "Programmatic Dependent Launch"): the split kernels allow it at their start, so at batch 1 the
// merge's launch, its staged tokens and the split kernel's tiles overlap instead of following each
// other (the merge waits for the partials with cudaGridDependencySynchronize).
void launch_merge(const MergeArgs& args, std::int64_t batch, cudaStream_t stream) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(args.kv_heads), static_cast<unsigned>(batch));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KVSIFT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, merge_kernel, args));
}

struct SplitPlan {
  int tiles_per_block = 1, tiles_per_warp = 1, splits = 1, parts = 1;
};

SplitPlan plan_split(const DevicePagedTable& table, const PagedBatch& batch,
                     const DecodeAttentionConfig& cfg) {
  SplitPlan p;
  const ThoughtBlockTableConfig& tc = table.config();
  p.tiles_per_block = (tc.block_size + kTileSlots - 1) / kTileSlots;
  const std::int64_t max_units = static_cast<std::int64_t>(batch.max_blocks) * p.tiles_per_block;
  const std::int64_t total = batch.total_blocks * p.tiles_per_block * tc.kv_heads;
  const std::int64_t warps = static_cast<std::int64_t>(cfg.target_ctas) * kWarps;
  const std::int64_t per_warp =
      std::max<std::int64_t>(cfg.min_tiles_per_warp, (total + warps - 1) / warps);
  p.tiles_per_warp = static_cast<int>(std::min<std::int64_t>(per_warp, 1 << 30));
  const std::int64_t per_cta = static_cast<std::int64_t>(p.tiles_per_warp) * kWarps;
  p.splits = static_cast<int>(std::max<std::int64_t>(1, (max_units + per_cta - 1) / per_cta));
  p.parts = p.splits;  // one partial per CTA (combine_cta_partials)
  return p;
}

// Head dims of the dense baseline kernel.
bool head_dim_supported(std::int64_t d) {
  return d == 16 || d == 32 || d == 64 || d == 128 || d == 256;
}

template <int D>
void launch_split(const SplitArgs& args, const SplitPlan& plan, int kv_heads, int batch,
                  cudaStream_t stream) {
  // 45 KB at D = 128 and group 8; D = 256 needs 90 KB, above the 48 KB default.
  const std::size_t smem = split_shared_bytes<D>(args.group);
  if (smem > 48 * 1024) {
    static thread_local int device_done = -1;  // once per device (as launch_dense)
    int device = 0;
    KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
    if (device != device_done) {
      KVSIFT_CUDA_CHECK(cudaFuncSetAttribute(split_decode_kernel<D>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(split_shared_bytes<D>(kMaxGroup))));
      device_done = device;
    }
  }
  const dim3 grid(static_cast<unsigned>(plan.splits), static_cast<unsigned>(kv_heads),
                  static_cast<unsigned>(batch));
  split_decode_kernel<D><<<grid, kThreads, smem, stream>>>(args);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void check_common(const char* fn, const DevicePagedTable& table, std::int64_t q_heads,
                  std::int64_t head_dim, float softmax_scale, const float* query, float* out) {
  const ThoughtBlockTableConfig& tc = table.config();
  KVSIFT_CHECK(head_dim == tc.head_dim, fn, ": query head_dim (", head_dim,
               ") differs from the table's head_dim (", tc.head_dim, ")");
  KVSIFT_CHECK(q_heads > 0 && q_heads % tc.kv_heads == 0, fn, ": q_heads (", q_heads,
               ") must be a positive multiple of kv_heads (", tc.kv_heads, ")");
  KVSIFT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0.0f, fn, ": softmax_scale (",
               softmax_scale, ") must be finite and > 0");
  KVSIFT_CHECK(query != nullptr && out != nullptr, fn, ": query and out must not be null");
  KVSIFT_CHECK(table.pending_tokens() == 0, fn, ": ", table.pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
}

std::size_t split_partial_bytes(const DevicePagedTable& table, const PagedBatch& batch,
                                std::int64_t q_heads, const DecodeAttentionConfig& cfg) {
  const SplitPlan plan = plan_split(table, batch, cfg);
  const std::size_t rows = static_cast<std::size_t>(batch.batch) *
                           static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(plan.parts);
  return align_up(rows * static_cast<std::size_t>(table.config().head_dim) * sizeof(float)) +
         align_up(rows * 2 * sizeof(float));
}

// Formats the split kernel reads. f32 blocks are not 16-bit numbers. FP8 blocks run bf16 MMAs
// whose query and P halves carry only ~2^-16 (fp16's carry ~2^-22): on the H200 a pure-FP8 table
// with f32 inputs missed the CPU reference by 1.6e-4 relative (the test allows 1.2e-4), so FP8
// blocks take the tiled kernel until that path gets a third split.
bool split_kernel_takes(BlockFormat f) { return f != BlockFormat::f32 && f != BlockFormat::fp8; }

// Per-sequence fallback: the tiled kernel's workspace, the largest over the batch.
std::size_t tiled_bytes(const DevicePagedTable& table, const PagedBatch& batch,
                        std::int64_t q_heads, const DecodeAttentionConfig& cfg) {
  std::size_t need = 0;
  for (std::int32_t s : batch.host_seq_ids) {
    need = std::max(need, paged_decode_attention_tiled_workspace_bytes(table, s, q_heads, cfg));
  }
  return need;
}

}  // namespace

std::size_t paged_batch_bytes(const DevicePagedTable& table, const std::int32_t* seqs,
                              std::int32_t batch) {
  KVSIFT_CHECK(batch >= 1 && seqs != nullptr, "cuda::paged_batch_bytes: batch (", batch,
               ") must be >= 1 with a non-null sequence list");
  std::size_t blocks = 0;
  for (std::int32_t i = 0; i < batch; ++i) {
    blocks += static_cast<std::size_t>(table.num_blocks(seqs[i]));
  }
  const std::size_t n = static_cast<std::size_t>(batch);
  return 2 * align_up(std::max<std::size_t>(blocks, 1) * 4) + align_up((n + 1) * 4) +
         align_up(n * 4);
}

namespace {

// describe_paged_batch's fields in one walk over the batch's blocks; with `frames`, `meta` and
// `begin` also the page tables themselves, as upload_paged_batch copies them.
PagedBatch walk_paged_batch(const DevicePagedTable& table, const std::int32_t* seqs,
                            std::int32_t batch, std::vector<std::int32_t>* frames,
                            std::vector<std::int32_t>* meta, std::vector<std::int32_t>* begin) {
  KVSIFT_CHECK(batch >= 1 && batch <= 65535 && seqs != nullptr,
               "cuda::describe_paged_batch: batch (", batch,
               ") must be in [1, 65535] with a non-null sequence list");
  PagedBatch out;
  out.batch = batch;
  out.host_seq_ids.assign(seqs, seqs + batch);
  if (begin != nullptr) begin->assign(static_cast<std::size_t>(batch) + 1, 0);
  for (std::int32_t i = 0; i < batch; ++i) {
    const std::int32_t s = seqs[i], nb = table.num_blocks(s);
    out.max_blocks = std::max(out.max_blocks, nb);
    out.total_blocks += nb;
    for (std::int32_t k = 0; k < nb; ++k) {
      const BlockFormat f = table.format_of_block(s, k);
      out.has_f32_blocks = out.has_f32_blocks || !split_kernel_takes(f);
      if (frames == nullptr) continue;
      frames->push_back(table.frame_of(s, k));
      meta->push_back(static_cast<std::int32_t>(f) |
                      (static_cast<std::int32_t>(table.type_of_block(s, k)) << 4));
    }
    if (begin != nullptr)
      (*begin)[static_cast<std::size_t>(i) + 1] = static_cast<std::int32_t>(out.total_blocks);
  }
  return out;
}

}  // namespace

PagedBatch describe_paged_batch(const DevicePagedTable& table, const std::int32_t* seqs,
                                std::int32_t batch) {
  return walk_paged_batch(table, seqs, batch, nullptr, nullptr, nullptr);
}

PagedBatch paged_batch_image(const DevicePagedTable& table, const std::int32_t* seqs,
                             std::int32_t batch, void* workspace, std::size_t workspace_bytes,
                             std::vector<std::uint8_t>& image) {
  const char* fn = "cuda::paged_batch_image";
  std::vector<std::int32_t> frames, meta, begin;
  PagedBatch out = walk_paged_batch(table, seqs, batch, &frames, &meta, &begin);
  const std::size_t need = paged_batch_bytes(table, seqs, batch);
  KVSIFT_CHECK(workspace_bytes >= need, fn, ": workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  WorkspaceCarver carver(workspace, workspace_bytes, fn);
  const std::size_t nb = std::max<std::size_t>(frames.size(), 1);
  std::int32_t* d_frames = carver.take<std::int32_t>(nb);
  std::int32_t* d_meta = carver.take<std::int32_t>(nb);
  std::int32_t* d_begin = carver.take<std::int32_t>(begin.size());
  std::int32_t* d_seqs = carver.take<std::int32_t>(static_cast<std::size_t>(batch));
  // The four arrays at their carved offsets in one host image of the region.
  const auto offset = [&](const std::int32_t* p) {
    return static_cast<std::size_t>(reinterpret_cast<const std::uint8_t*>(p) -
                                    reinterpret_cast<const std::uint8_t*>(d_frames));
  };
  image.resize(offset(d_seqs) + static_cast<std::size_t>(batch) * 4);
  const auto put = [&](const std::int32_t* dst, const std::vector<std::int32_t>& src) {
    if (!src.empty()) std::memcpy(image.data() + offset(dst), src.data(), src.size() * 4);
  };
  put(d_frames, frames);
  put(d_meta, meta);
  put(d_begin, begin);
  put(d_seqs, out.host_seq_ids);
  out.frames = d_frames;
  out.meta = d_meta;
  out.block_begin = d_begin;
  out.seq_ids = d_seqs;
  return out;
}

PagedBatch upload_paged_batch(const DevicePagedTable& table, const std::int32_t* seqs,
                              std::int32_t batch, void* workspace, std::size_t workspace_bytes,
                              cudaStream_t stream) {
  const char* fn = "cuda::upload_paged_batch";
  KVSIFT_CHECK(table.pending_tokens() == 0, fn, ": ", table.pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  std::vector<std::uint8_t> image;
  PagedBatch out = paged_batch_image(table, seqs, batch, workspace, workspace_bytes, image);
  KVSIFT_CUDA_CHECK(
      cudaMemcpyAsync(workspace, image.data(), image.size(), cudaMemcpyHostToDevice, stream));
  return out;
}

bool paged_split_kernel_applies(const DevicePagedTable& table, const PagedBatch& batch,
                                std::int64_t q_heads) {
  const ThoughtBlockTableConfig& tc = table.config();
  const std::int64_t group = q_heads / tc.kv_heads;
  return !batch.has_f32_blocks && group >= 1 && group <= kMaxGroup &&
         split_head_dim_supported(tc.head_dim);
}

std::size_t paged_decode_attention_batch_workspace_bytes(const DevicePagedTable& table,
                                                         const PagedBatch& batch,
                                                         std::int64_t q_heads,
                                                         const DecodeAttentionConfig& cfg) {
  cfg.validate();
  if (!paged_split_kernel_applies(table, batch, q_heads)) {
    return tiled_bytes(table, batch, q_heads, cfg);
  }
  return split_partial_bytes(table, batch, q_heads, cfg);
}

void paged_decode_attention_batch(const DevicePagedTable& table, const PagedBatch& batch,
                                  const float* query, std::int64_t q_heads, std::int64_t head_dim,
                                  float softmax_scale, float* out, void* workspace,
                                  std::size_t workspace_bytes, cudaStream_t stream,
                                  const DecodeAttentionConfig& cfg) {
  cfg.validate();
  const char* fn = "cuda::paged_decode_attention_batch";
  check_common(fn, table, q_heads, head_dim, softmax_scale, query, out);
  KVSIFT_CHECK(batch.batch >= 1 && batch.block_begin != nullptr &&
                   batch.host_seq_ids.size() == static_cast<std::size_t>(batch.batch),
               fn, ": the batch (", batch.batch, " sequences) was not uploaded");
  const std::size_t need = paged_decode_attention_batch_workspace_bytes(table, batch, q_heads, cfg);
  KVSIFT_CHECK(workspace_bytes >= need, fn, ": workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  const ThoughtBlockTableConfig& tc = table.config();
  if (!paged_split_kernel_applies(table, batch, q_heads)) {
    const std::int64_t stride = q_heads * head_dim;
    for (std::int32_t i = 0; i < batch.batch; ++i) {
      paged_decode_attention_tiled(table, batch.host_seq_ids[static_cast<std::size_t>(i)],
                                   query + i * stride, q_heads, head_dim, softmax_scale,
                                   out + i * stride, workspace, workspace_bytes, stream, cfg);
    }
    return;
  }
  const SplitPlan plan = plan_split(table, batch, cfg);
  KVSIFT_CHECK(plan.splits <= std::numeric_limits<int>::max() / kWarps, fn, ": ", plan.splits,
               " splits are too many");
  WorkspaceCarver carver(workspace, workspace_bytes, fn);
  const std::size_t rows = static_cast<std::size_t>(batch.batch) *
                           static_cast<std::size_t>(q_heads) * static_cast<std::size_t>(plan.parts);
  float* part_acc = carver.take<float>(rows * static_cast<std::size_t>(head_dim));
  float* part_ml = carver.take<float>(rows * 2);
  const PagedTableMemory& m = table.memory();
  SplitArgs args;
  args.t = detail::paged_batch_refs(table, batch);
  args.tiles_per_block = plan.tiles_per_block;
  args.group = static_cast<int>(q_heads / tc.kv_heads);
  args.tiles_per_warp = plan.tiles_per_warp;
  args.parts = plan.parts;
  args.softmax_scale = softmax_scale;
  args.query = query;
  args.part_acc = part_acc;
  args.part_ml = part_ml;
  switch (head_dim) {  // split_head_dim_supported
    case 64:
      launch_split<64>(args, plan, tc.kv_heads, batch.batch, stream);
      break;
    case 128:
      launch_split<128>(args, plan, tc.kv_heads, batch.batch, stream);
      break;
    default:
      launch_split<256>(args, plan, tc.kv_heads, batch.batch, stream);
      break;
  }
  MergeArgs merge = merge_args(part_acc, part_ml, tc.kv_heads, args.group, plan.parts,
                               static_cast<int>(head_dim), out);
  merge.keys = m.staged_keys;
  merge.values = m.staged_values;
  merge.masks = m.staged_masks;
  merge.seq_ids = batch.seq_ids;
  merge.softmax_scale = softmax_scale;
  merge.query = query;
  launch_merge(merge, batch.batch, stream);
}

// --- the single-sequence entry point: the split kernel where it applies -------------------------

std::size_t paged_decode_attention_workspace_bytes(const DevicePagedTable& table, std::int32_t seq,
                                                   std::int64_t q_heads,
                                                   const DecodeAttentionConfig& cfg) {
  cfg.validate();
  // The batch view needs no device memory to be described: build it host-side only.
  PagedBatch view;
  view.batch = 1;
  view.host_seq_ids = {seq};
  view.max_blocks = table.num_blocks(seq);
  view.total_blocks = view.max_blocks;
  for (std::int32_t k = 0; k < view.max_blocks; ++k) {
    view.has_f32_blocks = view.has_f32_blocks || !split_kernel_takes(table.format_of_block(seq, k));
  }
  const std::size_t tiled = paged_decode_attention_tiled_workspace_bytes(table, seq, q_heads, cfg);
  if (q_heads <= 0 || q_heads % table.config().kv_heads != 0 ||
      !paged_split_kernel_applies(table, view, q_heads)) {
    return tiled;
  }
  return paged_batch_bytes(table, &seq, 1) + split_partial_bytes(table, view, q_heads, cfg);
}

void paged_decode_attention(const DevicePagedTable& table, std::int32_t seq, const float* query,
                            std::int64_t q_heads, std::int64_t head_dim, float softmax_scale,
                            float* out, void* workspace, std::size_t workspace_bytes,
                            cudaStream_t stream, const DecodeAttentionConfig& cfg) {
  cfg.validate();
  const char* fn = "cuda::paged_decode_attention";
  check_common(fn, table, q_heads, head_dim, softmax_scale, query, out);
  KVSIFT_CHECK(head_dim <= 256 && head_dim % 16 == 0, fn, ": head_dim (", head_dim,
               ") must be a multiple of 16 in [16, 256]");
  const std::size_t need = paged_decode_attention_workspace_bytes(table, seq, q_heads, cfg);
  KVSIFT_CHECK(workspace_bytes >= need, fn, ": workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  const std::size_t view_bytes = paged_batch_bytes(table, &seq, 1);
  bool split = workspace_bytes >= view_bytes;
  if (split) {
    PagedBatch probe;
    probe.batch = 1;
    probe.host_seq_ids = {seq};
    for (std::int32_t k = 0; k < table.num_blocks(seq); ++k) {
      probe.has_f32_blocks =
          probe.has_f32_blocks || !split_kernel_takes(table.format_of_block(seq, k));
    }
    split = paged_split_kernel_applies(table, probe, q_heads);
  }
  if (!split) {
    paged_decode_attention_tiled(table, seq, query, q_heads, head_dim, softmax_scale, out,
                                 workspace, workspace_bytes, stream, cfg);
    return;
  }
  const PagedBatch view = upload_paged_batch(table, &seq, 1, workspace, view_bytes, stream);
  std::uint8_t* rest = static_cast<std::uint8_t*>(workspace) + view_bytes;
  paged_decode_attention_batch(table, view, query, q_heads, head_dim, softmax_scale, out, rest,
                               workspace_bytes - view_bytes, stream, cfg);
}

// --- dense baseline ------------------------------------------------------------------------------

namespace {

SplitPlan plan_dense(std::int64_t batch, std::int64_t kv_heads, std::int64_t tokens,
                     const DecodeAttentionConfig& cfg) {
  SplitPlan p;
  const std::int64_t units = (tokens + kTileSlots - 1) / kTileSlots;
  const std::int64_t warps = static_cast<std::int64_t>(cfg.target_ctas) * kWarps;
  const std::int64_t per_warp = std::max<std::int64_t>(
      cfg.min_tiles_per_warp, (batch * kv_heads * units + warps - 1) / warps);
  p.tiles_per_warp = static_cast<int>(std::min<std::int64_t>(per_warp, 1 << 30));
  const std::int64_t per_cta = static_cast<std::int64_t>(p.tiles_per_warp) * kWarps;
  p.splits = static_cast<int>(std::max<std::int64_t>(1, (units + per_cta - 1) / per_cta));
  p.parts = p.splits;
  return p;
}

template <int D>
void launch_dense(const DenseArgs& args, const SplitPlan& plan, int batch, cudaStream_t stream) {
  const std::size_t smem = dense_shared_bytes<D>(args.group);
  // Once per instantiation, device and size: the attribute call costs host time that would
  // otherwise show up between the events of a microsecond-scale launch.
  static thread_local int device_done = -1;
  static thread_local std::size_t smem_done = 0;
  int device = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  if (device != device_done || smem > smem_done) {
    KVSIFT_CUDA_CHECK(cudaFuncSetAttribute(dense_split_kernel<D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
    device_done = device;
    smem_done = smem;
  }
  const dim3 grid(static_cast<unsigned>(plan.splits), static_cast<unsigned>(args.kv_heads),
                  static_cast<unsigned>(batch));
  dense_split_kernel<D><<<grid, kThreads, smem, stream>>>(args);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

std::size_t dense_split_decode_attention_workspace_bytes(std::int64_t batch, std::int64_t kv_heads,
                                                         std::int64_t tokens, std::int64_t q_heads,
                                                         std::int64_t head_dim,
                                                         const DecodeAttentionConfig& cfg) {
  cfg.validate();
  KVSIFT_CHECK(batch >= 1 && kv_heads >= 1 && tokens >= 0,
               "cuda::dense_split_decode_attention: batch (", batch, ") and kv_heads (", kv_heads,
               ") must be >= 1 and tokens (", tokens, ") >= 0");
  const SplitPlan plan = plan_dense(batch, kv_heads, tokens, cfg);
  const std::size_t rows = static_cast<std::size_t>(batch * q_heads * plan.parts);
  return align_up(rows * static_cast<std::size_t>(head_dim) * sizeof(float)) +
         align_up(rows * 2 * sizeof(float));
}

void dense_split_decode_attention_bf16(const bf16_t* keys, const bf16_t* values, std::int64_t batch,
                                       std::int64_t kv_heads, std::int64_t tokens,
                                       const float* query, std::int64_t q_heads,
                                       std::int64_t head_dim, float softmax_scale, float* out,
                                       void* workspace, std::size_t workspace_bytes,
                                       cudaStream_t stream, const DecodeAttentionConfig& cfg) {
  const char* fn = "cuda::dense_split_decode_attention_bf16";
  const std::size_t need =
      dense_split_decode_attention_workspace_bytes(batch, kv_heads, tokens, q_heads, head_dim, cfg);
  KVSIFT_CHECK(q_heads > 0 && q_heads % kv_heads == 0 && q_heads / kv_heads <= kMaxGroup, fn,
               ": q_heads (", q_heads, ") must be a multiple of kv_heads (", kv_heads,
               ") with at most ", kMaxGroup, " query heads per KV head");
  KVSIFT_CHECK(head_dim_supported(head_dim), fn, ": head_dim (", head_dim,
               ") must be 16, 32, 64, 128 or 256");
  KVSIFT_CHECK(batch <= 65535 && kv_heads <= 65535, fn, ": batch (", batch, ") and kv_heads (",
               kv_heads, ") must be <= 65535");
  KVSIFT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0.0f, fn, ": softmax_scale (",
               softmax_scale, ") must be finite and > 0");
  KVSIFT_CHECK(query != nullptr && out != nullptr && (tokens == 0 || (keys && values)), fn,
               ": query, out, keys and values must not be null");
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(keys) % 16 == 0 &&
                   reinterpret_cast<std::uintptr_t>(values) % 16 == 0,
               fn, ": keys and values must be 16-byte aligned");
  KVSIFT_CHECK(workspace_bytes >= need, fn, ": workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  const SplitPlan plan = plan_dense(batch, kv_heads, tokens, cfg);
  WorkspaceCarver carver(workspace, workspace_bytes, fn);
  const std::size_t rows = static_cast<std::size_t>(batch * q_heads * plan.parts);
  DenseArgs args;
  args.keys = keys;
  args.values = values;
  args.tokens = tokens;
  args.kv_heads = static_cast<int>(kv_heads);
  args.group = static_cast<int>(q_heads / kv_heads);
  args.tiles_per_warp = plan.tiles_per_warp;
  args.parts = plan.parts;
  args.softmax_scale = softmax_scale;
  args.query = query;
  args.part_acc = carver.take<float>(rows * static_cast<std::size_t>(head_dim));
  args.part_ml = carver.take<float>(rows * 2);
  const int nb = static_cast<int>(batch);
  switch (head_dim) {
    case 16:
      launch_dense<16>(args, plan, nb, stream);
      break;
    case 32:
      launch_dense<32>(args, plan, nb, stream);
      break;
    case 64:
      launch_dense<64>(args, plan, nb, stream);
      break;
    case 128:
      launch_dense<128>(args, plan, nb, stream);
      break;
    default:
      launch_dense<256>(args, plan, nb, stream);
      break;
  }
  launch_merge(merge_args(args.part_acc, args.part_ml, args.kv_heads, args.group, plan.parts,
                          static_cast<int>(head_dim), out),
               batch, stream);
}

}  // namespace kvsift::cuda
