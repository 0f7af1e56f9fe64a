// The one pass over the keys of R-KV's key redundancy (docs/algorithms.md §1.2 steps 1, 4 and 6):
// everything that needs only one key row at a time, produced while each row is read once.
//   denom    ||K_i|| + 1e-8 per row, 0 for a pad (the UnitKeys contract of rkv_kernels.cuh);
//   unit16   the fp16 (RNE) unit key k̂_i = K_i · (1 / denom) the tensor-core search reads, in
//            its tile images (tc_unit_images.cuh): zero past head_dim, zero rows for pads and
//            from `length` to the end of the region;
//   partial  sums of k̂_i over chunks of kKeySumRows rows, per (sequence, head) — the first
//            stage of sum_i k̂_i, which column_means_kernel finishes by adding the chunks in
//            order (a fixed-order, atomic-free two-stage reduction: run-to-run deterministic);
//   logits   optionally, the window logits of §1.1 (GQA max of q·k / sqrt(D), pads −1e9) for the
//            16-bit layouts the tensor-core logits take: bit for bit gqa_logits_mma_kernel's
//            (window_importance.cu), which then does not run — one read of the keys less.
// The arithmetic per row is that of normalize_and_sum_kernel (fmaf of x², sqrtf + 1e-8, x ·
// __frcp_rn(den)); only the order of the head_dim-term sum of squares and of the row sums
// differs (within the tolerance of R, docs in key_redundancy.cu). Exact consumers (the fp32
// search, the tensor-core search's re-checks) divide by the stored denom, so the fp32 and the
// tensor-core searches stay bit-identical to each other.
//
// Why it is fast: the scalar kernels it replaces read 2-byte channels one warp per row with one
// row in flight per warp (latency bound, ~10x the copy time). Here a group of G lanes reads a row
// as 16-byte vectors, each thread issues the loads of up to 8 rows before using any, and the fp16
// copy leaves as 16-byte stores: the pass moves its bytes at close to device-copy speed.
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "key_vec.cuh"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"
#include "mma.cuh"
#include "rkv_kernels.cuh"
#include "tc_unit_images.cuh"

namespace kvsift::cuda::detail {

bool key_rows_vectorizable(const StepView& step) {
  const KVCacheView& kv = step.first();
  const std::int64_t esz = static_cast<std::int64_t>(dtype_size(kv.dtype()));
  const std::int64_t d = kv.head_dim();
  if (d % kVecChannels != 0 || d > kVecMaxDim) return false;
  const auto& st = kv.keys.stride;
  if ((st[0] * esz) % 16 != 0 || (st[1] * esz) % 16 != 0 || (st[2] * esz) % 16 != 0) return false;
  for (int l = 0; l < step.n_layers; ++l)
    if (reinterpret_cast<std::uintptr_t>(step.layers[l].keys.data) % 16 != 0) return false;
  return true;
}

namespace {

// The window logits folded into the pass (launch_key_pass with window_logits): the chunk's raw
// 16-bit keys are staged in shared memory as they stream through registers, and after the chunk
// the 8 warps multiply them with the group's window queries on tensor cores, warp w taking keys
// 16w .. 16w + 15 of the chunk with exactly the fragments, k-step order and fp32 accumulation of
// gqa_logits_mma_kernel (window_importance.cu), so the logits are bit for bit the same.
struct WindowLogitArgs {
  StepBases queries;      // per layer [batch, q_heads, window, head_dim]
  std::int64_t q_h, q_w;  // elements between query heads and between window rows
  int group, window, n;   // n = length − window keys get logits
  float scale;            // 1 / sqrt(head_dim), the host's float expression
  float* logits;          // [sequences, kv_heads, window, n]
};

constexpr int kLogitMaxRows = 64;              // group · window (mma_logits_supported)
constexpr int kLogitMaxDim = 128;              // head_dim (idem)
constexpr int kLogitPitch = kLogitMaxDim + 8;  // b16 per staged row: 272 B (ldmatrix: no
                                               // bank conflicts)
constexpr int kDotPitch = kKeySumRows + 4;     // fp32 per row of dot products
struct LogitShared {
  std::uint16_t k[kKeySumRows][kLogitPitch];    // the chunk's raw keys; then the dot products
  std::uint16_t q[kLogitMaxRows][kLogitPitch];  // the group's window queries, row g·W + w
};
static_assert(kLogitMaxRows * kDotPitch * sizeof(float) <= sizeof(LogitShared::k),
              "the fp32 dot products fit in the staged keys' bytes");
static_assert(kBlockThreads / 32 * 16 == kKeySumRows, "8 warps × 16 keys cover a chunk");

// The chunk's logits from the staged keys and queries (after a barrier that completed them):
// rows [first, min(last, n)) of L[w][j] = max_g (q_{g,w} · k_j) · scale, pads kPadLogit.
template <class T>
__device__ __forceinline__ void window_logits(LogitShared& ls, const WindowLogitArgs& la, int first,
                                              int last, int k_steps, int b, std::int64_t bh,
                                              const std::uint8_t* __restrict__ valid,
                                              std::int64_t capacity) {
  constexpr Half16 kType = std::is_same<T, bf16_t>::value ? Half16::bf16 : Half16::f16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m_tiles = (la.group * la.window + 15) / 16;
  const int end = min(last, la.n);            // keys of this chunk that get logits
  const bool busy = first + warp * 16 < end;  // warp-uniform: its 16 keys hold one that counts
  float acc[kLogitMaxRows / 16][2][4] = {};
  // steps, tiles: ints, or std::integral_constant for the R-KV shape, whose loops then become
  // straight-line code in which each k-step's fragment loads overlap the previous multiplies (with
  // run-time counts every step waited on its ldmatrix: bench/RESULTS.md runs 96 and 99).
  const auto multiply = [&](auto steps, auto tiles) {
#pragma unroll
    for (int k = 0; k < kLogitMaxDim / 16; ++k) {
      if (k >= steps) break;  // block-uniform
      std::uint32_t bf[4];    // n tile 0: bf[0], bf[1]; n tile 1: bf[2], bf[3]
      const int m = lane / 8;
      ldmatrix_x4(bf, &ls.k[warp * 16 + (m / 2) * 8 + lane % 8][k * 16 + (m % 2) * 8]);
#pragma unroll
      for (int mt = 0; mt < kLogitMaxRows / 16; ++mt) {
        if (mt >= tiles) break;  // block-uniform
        std::uint32_t a[4];
        ldmatrix_x4(a, &ls.q[mt * 16 + lane % 16][k * 16 + (lane / 16) * 8]);
        mma_16816<kType>(acc[mt][0], a, bf[0], bf[1]);
        mma_16816<kType>(acc[mt][1], a, bf[2], bf[3]);
      }
    }
  };
  if (busy) {
    if (k_steps == kLogitMaxDim / 16 && m_tiles == 2)  // head_dim 113 .. 128, group · window 32
      multiply(std::integral_constant<int, kLogitMaxDim / 16>{}, std::integral_constant<int, 2>{});
    else
      multiply(k_steps, m_tiles);
  }
  __syncthreads();  // every warp is done with ls.k: its bytes now hold the dot products
  auto dots = reinterpret_cast<float(*)[kDotPitch]>(&ls.k[0][0]);
  if (busy) {
#pragma unroll
    for (int mt = 0; mt < kLogitMaxRows / 16; ++mt) {
      if (mt >= m_tiles) break;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q)
          dots[mt * 16 + g + (q / 2) * 8][warp * 16 + nt * 8 + 2 * t + q % 2] = acc[mt][nt][q];
    }
  }
  __syncthreads();
  float* out = la.logits + bh * la.window * la.n;
  for (int e = threadIdx.x; e < la.window * kKeySumRows; e += kBlockThreads) {
    const int w = e / kKeySumRows, jl = e % kKeySumRows, j = first + jl;
    if (j >= end) continue;
    float best = dots[w][jl];  // GQA max (§1.1 step 1): rows g·W + w
    for (int gi = 1; gi < la.group; ++gi) best = fmaxf(best, dots[gi * la.window + w][jl]);
    // max_g(x_g) * scale == max_g(x_g * scale) exactly, scale > 0 and rounding is monotone.
    float v = best * la.scale;
    if (valid != nullptr && valid[b * capacity + j] == 0) v = kPadLogit;
    out[static_cast<std::int64_t>(w) * la.n + j] = v;
  }
}

// Grid (key_sum_chunks(length), kv_heads, sequences), kBlockThreads threads: block (chunk, h, z)
// owns rows [chunk · kKeySumRows, +kKeySumRows) of (z, h). Group g (G lanes) reads rows g, g +
// kGroups, ... of the chunk; lane c of the group holds channels 8c .. 8c + 7.
// kLogits: also the window logits (above); then T is 16-bit, head_dim <= 128 and the dynamic
// shared memory holds a LogitShared.
template <class T, int G, bool kLogits>
__global__ void __launch_bounds__(kBlockThreads)
    key_pass_kernel(StepBases keys,         // per layer [batch, kv_heads, capacity, head_dim]
                    std::int64_t stride_h,  // elements between heads
                    std::int64_t stride_s,  // elements between slots
                    const std::uint8_t* __restrict__ valid,  // [batch, capacity] or nullptr
                    std::int64_t capacity, int length, int head_dim,
                    float* __restrict__ denom,    // [sequences, kv_heads, length]
                    __half* __restrict__ unit16,  // per (z, h): tc_head_elements, or nullptr
                    float* __restrict__ partial,  // [sequences, kv_heads, chunks, head_dim]
                    WindowLogitArgs la) {
  static_assert(!kLogits || (sizeof(T) == 2 && G <= 16), "logits: 16-bit keys, head_dim <= 128");
  static_assert(G >= 2 && G <= 32 && (G & (G - 1)) == 0, "G: a power of two lanes per row");
  constexpr int kGroups = kBlockThreads / G;                     // rows the block reads at once
  constexpr int kIters = (kKeySumRows + kGroups - 1) / kGroups;  // rows per group and chunk
  constexpr int kBatchCap = sizeof(T) == 4 ? 4 : 8;              // 32 registers of raw words
  constexpr int kBatch = kIters < kBatchCap ? kIters : kBatchCap;
  static_assert(kIters % kBatch == 0, "whole batches of rows");
  __shared__ __align__(16) float sums[kGroups * kVecChannels * G];  // [group][channel]

  const int z = blockIdx.z, h = blockIdx.y, kv_heads = gridDim.y, chunk = blockIdx.x;
  const int b = z % keys.batch;  // the padding mask is per sequence, shared by the layers
  const std::int64_t bh = static_cast<std::int64_t>(z) * kv_heads + h;
  const int g = static_cast<int>(threadIdx.x) / G, c = static_cast<int>(threadIdx.x) % G;
  const int vectors = head_dim / kVecChannels, image_chunks = 8 * tc_image_halves(head_dim);
  const int first = chunk * kKeySumRows, last = min(length, first + kKeySumRows);
  const T* kbase = keys.seq<const T>(z) + h * stride_h;
  __half* const head16 =
      unit16 != nullptr ? unit16 + bh * tc_head_elements(length, head_dim) : nullptr;

  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  LogitShared& ls = *reinterpret_cast<LogitShared*>(dynamic_shared);  // kLogits only
  [[maybe_unused]] const int k_chunks =
      (head_dim + 15) / 16 * 2;  // 16-byte chunks of a staged row: whole k16 steps
  if constexpr (kLogits) {
    // The group's window queries, rows padded to whole m16 tiles and chunks to whole k16 steps
    // with zeros, as gqa_logits_mma_kernel stages them; by cp.async, so the key loads below are
    // issued without waiting for these (waited for before the barrier at the end).
    const int q_rows = la.group * la.window, q_rows_padded = (q_rows + 15) / 16 * 16;
    const T* qbase = la.queries.seq<const T>(z) + static_cast<std::int64_t>(h) * la.group * la.q_h;
    for (int e = threadIdx.x; e < q_rows_padded * k_chunks; e += kBlockThreads) {
      const int r = e / k_chunks, cc = e % k_chunks;
      const bool inside = r < q_rows && cc < vectors;
      const T* src =  // a mapped address even when nothing is read (zero fill)
          inside ? qbase + (r / la.window) * la.q_h + (r % la.window) * la.q_w + cc * kVecChannels
                 : qbase;
      cp_async16(&ls.q[r][cc * kVecChannels], src, inside);
    }
    cp_async_commit();
  }

  float acc[kVecChannels];
#pragma unroll
  for (int k = 0; k < kVecChannels; ++k) acc[k] = 0.0f;

  for (int it0 = 0; it0 < kIters; it0 += kBatch) {
    // All loads of the batch first (independent, in flight together), then the arithmetic.
    RawVec<T> raw[kBatch];
    bool pad[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = first + g + (it0 + u) * kGroups;
      const bool row_in = i < last;
      raw[u] = (row_in && c < vectors) ? load_vec(kbase + i * stride_s, c) : zero_vec<T>();
      pad[u] = row_in && valid != nullptr && valid[b * capacity + i] == 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = first + g + (it0 + u) * kGroups;
      if constexpr (kLogits) {  // raw bits, zeros past the sequence and past head_dim
        if (c < k_chunks)
          *reinterpret_cast<uint4*>(&ls.k[i - first][c * kVecChannels]) = raw[u].w[0];
      }
      float x[kVecChannels];
      unpack_vec(raw[u], x);
      if (pad[u]) {  // a pad is a zero key (§1.2 step 6), whatever its memory holds
#pragma unroll
        for (int k = 0; k < kVecChannels; ++k) x[k] = 0.0f;
      }
      float sq = 0.0f;
#pragma unroll
      for (int k = 0; k < kVecChannels; ++k) sq = fmaf(x[k], x[k], sq);
      sq = group_sum<G>(sq);  // every lane of the group: the same bits
      const float den = sqrtf(sq) + 1e-8f;
      // x·(1/den): within 1 ulp of the reference's x/den, for the sums (tolerance) and the fp16
      // copy (its bound in key_redundancy_tc.cu allows for it); the exact re-checks divide.
      const float inv = __frcp_rn(den);
      float v[kVecChannels];
#pragma unroll
      for (int k = 0; k < kVecChannels; ++k) {
        // 0 for pads, rows past the chunk and lanes past head_dim. Rounded product and sum, never
        // contracted into an fma: the sums must not depend on whether the fp16 copy is stored
        // (the tensor-core and fp32 searches share them; one contraction moved 78 sums by an ulp).
        v[k] = __fmul_rn(x[k], inv);
        acc[k] = __fadd_rn(acc[k], v[k]);
      }
      if (i >= last) continue;  // no barrier or shuffle follows inside this loop
      const std::int64_t r = bh * length + i;
      if (c == 0) denom[r] = pad[u] ? 0.0f : den;
      if (head16 != nullptr) {  // lanes past head_dim write the zero channels of the image
        uint4 out = make_uint4(0, 0, 0, 0);  // (explicitly: 0 · inv is NaN when a key is)
        if (c < vectors) {
          __half2* o = reinterpret_cast<__half2*>(&out);
#pragma unroll
          for (int k = 0; k < kVecChannels / 2; ++k)
            o[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
        }
        for (int cc = c; cc < image_chunks; cc += G) {  // G >= vectors: chunks past c are zero
          *reinterpret_cast<uint4*>(head16 + tc_chunk_offset(i, cc, image_chunks / 8)) = out;
          out = make_uint4(0, 0, 0, 0);
        }
      }
    }
  }

  if (head16 != nullptr && chunk == gridDim.x - 1)
    zero_tc_padding(head16, length, image_chunks / 8, threadIdx.x, kBlockThreads);

  // Second stage inside the block: the group sums of each channel, added in group order.
  float4* mine = reinterpret_cast<float4*>(&sums[(g * G + c) * kVecChannels]);
  mine[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  mine[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  if constexpr (kLogits) cp_async_wait<0>();  // this thread's query copies have landed
  __syncthreads();  // sums, and with kLogits the staged keys and queries, complete
  float* out = partial + (bh * gridDim.x + chunk) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += kBlockThreads) {
    float t = 0.0f;
    for (int q = 0; q < kGroups; ++q) t += sums[q * G * kVecChannels + d];
    out[d] = t;
  }
  if constexpr (kLogits)
    window_logits<T>(ls, la, first, last, k_chunks / 2, b, bh, valid, capacity);
}

// The pass for lane groups of G, with the window logits when `la.logits` is set (the caller
// checked mma_logits_supported; G <= 16 and 16-bit storage follow from it).
template <class T, int G>
void launch_pass(const StepView& step, int length, float* denom, __half* unit16, float* partial,
                 const WindowLogitArgs& la, cudaStream_t stream) {
  const KVCacheView& kv = step.first();
  const int head_dim = static_cast<int>(kv.head_dim());
  const dim3 grid(static_cast<unsigned>(key_sum_chunks(length)),
                  static_cast<unsigned>(kv.kv_heads()), static_cast<unsigned>(step.sequences()));
  auto launch = [&](auto kernel, int shared_bytes) {
    kernel<<<grid, kBlockThreads, shared_bytes, stream>>>(
        key_bases(step), kv.keys.stride[1], kv.keys.stride[2], kv.valid_mask, kv.capacity(), length,
        head_dim, denom, unit16, partial, la);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  };
  if constexpr (sizeof(T) == 2 && G <= 16) {
    if (la.logits != nullptr) {
      // Above the 48 KiB default with the static part: the opt-in (per device, cheap to repeat).
      constexpr int kShared = static_cast<int>(sizeof(LogitShared));
      KVSIFT_CUDA_CHECK(cudaFuncSetAttribute(key_pass_kernel<T, G, true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, kShared));
      return launch(key_pass_kernel<T, G, true>, kShared);
    }
  }
  launch(key_pass_kernel<T, G, false>, 0);
}

}  // namespace

bool launch_key_pass(const StepView& step, int length, float* denom, void* unit16, float* partial,
                     cudaStream_t stream, float* window_logits, bool* logits_written) {
  if (logits_written != nullptr) *logits_written = false;
  if (!key_rows_vectorizable(step)) return false;
  if (reinterpret_cast<std::uintptr_t>(unit16) % 16 != 0) return false;  // null is aligned
  const KVCacheView& kv = step.first();
  require_unit16_scope(unit16, static_cast<int>(kv.head_dim()));
  if (step.sequences() == 0 || kv.kv_heads() == 0 || length <= 0) return true;  // nothing to do
  // The window logits too, when their tensor-core path applies and some key gets one.
  WindowLogitArgs la{};
  if (window_logits != nullptr && step.queries != nullptr) {
    const TensorView& q = step.queries[0];
    const int group = static_cast<int>(q.shape[1] / kv.kv_heads());
    const int window = static_cast<int>(q.shape[2]);
    if (length > window && mma_logits_supported(step, group, window)) {
      la.queries = query_bases(step);
      la.q_h = q.stride[1];
      la.q_w = q.stride[2];
      la.group = group;
      la.window = window;
      la.n = length - window;
      // The same float expression as launch_window_importance (and the CPU reference).
      la.scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim()));
      la.logits = window_logits;
    }
  }
  auto* u16 = static_cast<__half*>(unit16);
  const int g = vec_group_lanes(static_cast<int>(kv.head_dim()));
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    switch (g) {
      case 2:
        return launch_pass<T, 2>(step, length, denom, u16, partial, la, stream);
      case 4:
        return launch_pass<T, 4>(step, length, denom, u16, partial, la, stream);
      case 8:
        return launch_pass<T, 8>(step, length, denom, u16, partial, la, stream);
      case 16:
        return launch_pass<T, 16>(step, length, denom, u16, partial, la, stream);
      default:
        return launch_pass<T, 32>(step, length, denom, u16, partial, la, stream);
    }
  });
  if (logits_written != nullptr) *logits_written = la.logits != nullptr;
  return true;
}

}  // namespace kvsift::cuda::detail
