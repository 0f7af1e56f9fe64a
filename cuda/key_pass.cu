// The one pass over the keys of R-KV's key redundancy (docs/algorithms.md §1.2 steps 1, 4 and 6):
// everything that needs only one key row at a time, produced while each row is read once.
//   denom    ||K_i|| + 1e-8 per row, 0 for a pad (the UnitKeys contract of rkv_kernels.cuh);
//   unit16   the bf16 (RNE) unit key k̂_i = K_i · (1 / denom) the tensor-core search reads,
//            zero-padded to tc_row_pitch(head_dim) channels, zero rows for pads;
//   partial  sums of k̂_i over chunks of kKeySumRows rows, per (sequence, head) — the first
//            stage of sum_i k̂_i, which column_means_kernel finishes by adding the chunks in
//            order (a fixed-order, atomic-free two-stage reduction: run-to-run deterministic).
// The arithmetic per row is that of normalize_and_sum_kernel (fmaf of x², sqrtf + 1e-8, x ·
// __frcp_rn(den)); only the order of the head_dim-term sum of squares and of the row sums
// differs (within the tolerance of R, docs in key_redundancy.cu). Exact consumers (the fp32
// search, the tensor-core search's re-checks) divide by the stored denom, so the fp32 and the
// tensor-core searches stay bit-identical to each other.
//
// Why it is fast: the scalar kernels it replaces read 2-byte channels one warp per row with one
// row in flight per warp (latency bound, ~10x the copy time). Here a group of G lanes reads a row
// as 16-byte vectors, each thread issues the loads of up to 8 rows before using any, and the bf16
// copy leaves as 16-byte stores: the pass moves its bytes at close to device-copy speed.
#include <cuda_bf16.h>

#include <cstdint>

#include "key_vec.cuh"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"
#include "rkv_kernels.cuh"

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

// Grid (key_sum_chunks(length), kv_heads, sequences), kBlockThreads threads: block (chunk, h, z)
// owns rows [chunk · kKeySumRows, +kKeySumRows) of (z, h). Group g (G lanes) reads rows g, g +
// kGroups, ... of the chunk; lane c of the group holds channels 8c .. 8c + 7.
template <class T, int G>
__global__ void __launch_bounds__(kBlockThreads)
    key_pass_kernel(StepBases keys,         // per layer [batch, kv_heads, capacity, head_dim]
                    std::int64_t stride_h,  // elements between heads
                    std::int64_t stride_s,  // elements between slots
                    const std::uint8_t* __restrict__ valid,  // [batch, capacity] or nullptr
                    std::int64_t capacity, int length, int head_dim,
                    float* __restrict__ denom,           // [sequences, kv_heads, length]
                    __nv_bfloat16* __restrict__ unit16,  // [.., length, pitch16] or nullptr
                    int pitch16,
                    float* __restrict__ partial) {  // [sequences, kv_heads, chunks, head_dim]
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
  const int vectors = head_dim / kVecChannels, pitch_vectors = pitch16 / kVecChannels;
  const int first = chunk * kKeySumRows, last = min(length, first + kKeySumRows);
  const T* kbase = keys.seq<const T>(z) + h * stride_h;

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
      // x·(1/den): within 1 ulp of the reference's x/den, for the sums (tolerance) and the bf16
      // copy (its bound in key_redundancy_tc.cu allows for it); the exact re-checks divide.
      const float inv = __frcp_rn(den);
      float v[kVecChannels];
#pragma unroll
      for (int k = 0; k < kVecChannels; ++k) {
        v[k] = x[k] * inv;  // 0 for pads, rows past the chunk and lanes past head_dim
        acc[k] += v[k];
      }
      if (i >= last) continue;  // no barrier or shuffle follows inside this loop
      const std::int64_t r = bh * length + i;
      if (c == 0) denom[r] = pad[u] ? 0.0f : den;
      if (unit16 != nullptr && c < pitch_vectors) {  // lanes past head_dim write the zero padding
        uint4 out = make_uint4(0, 0, 0, 0);          // (explicitly: 0 · inv is NaN when a key is)
        if (c < vectors) {
          __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
          for (int k = 0; k < kVecChannels / 2; ++k)
            o[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
        }
        *reinterpret_cast<uint4*>(unit16 + r * pitch16 + c * kVecChannels) = out;
      }
    }
  }

  // Second stage inside the block: the group sums of each channel, added in group order.
  float4* mine = reinterpret_cast<float4*>(&sums[(g * G + c) * kVecChannels]);
  mine[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  mine[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  __syncthreads();
  float* out = partial + (bh * gridDim.x + chunk) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += kBlockThreads) {
    float t = 0.0f;
    for (int q = 0; q < kGroups; ++q) t += sums[q * G * kVecChannels + d];
    out[d] = t;
  }
}

template <class T, int G>
void launch_pass(const StepView& step, int length, float* denom, __nv_bfloat16* unit16,
                 float* partial, cudaStream_t stream) {
  const KVCacheView& kv = step.first();
  const int head_dim = static_cast<int>(kv.head_dim());
  const dim3 grid(static_cast<unsigned>(key_sum_chunks(length)),
                  static_cast<unsigned>(kv.kv_heads()), static_cast<unsigned>(step.sequences()));
  key_pass_kernel<T, G><<<grid, kBlockThreads, 0, stream>>>(
      key_bases(step), kv.keys.stride[1], kv.keys.stride[2], kv.valid_mask, kv.capacity(), length,
      head_dim, denom, unit16, tc_row_pitch(head_dim), partial);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool launch_key_pass(const StepView& step, int length, float* denom, void* unit16, float* partial,
                     cudaStream_t stream) {
  if (!key_rows_vectorizable(step)) return false;
  if (reinterpret_cast<std::uintptr_t>(unit16) % 16 != 0) return false;  // null is aligned
  const KVCacheView& kv = step.first();
  if (step.sequences() == 0 || kv.kv_heads() == 0 || length <= 0) return true;  // nothing to do
  auto* u16 = static_cast<__nv_bfloat16*>(unit16);
  const int g = vec_group_lanes(static_cast<int>(kv.head_dim()));
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    switch (g) {
      case 2:
        return launch_pass<T, 2>(step, length, denom, u16, partial, stream);
      case 4:
        return launch_pass<T, 4>(step, length, denom, u16, partial, stream);
      case 8:
        return launch_pass<T, 8>(step, length, denom, u16, partial, stream);
      case 16:
        return launch_pass<T, 16>(step, length, denom, u16, partial, stream);
      default:
        return launch_pass<T, 32>(step, length, denom, u16, partial, stream);
    }
  });
  return true;
}

}  // namespace kvsift::cuda::detail
