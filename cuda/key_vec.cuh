// 16-byte accesses to key rows, shared by the one-pass key kernel (cuda/key_pass.cu), the
// vectorised column means (cuda/key_redundancy.cu) and the exact re-checks of the tensor-core
// search (cuda/key_redundancy_tc.cu). Internal to cuda/*.cu, not installed.
//
// A row of head_dim channels is read as head_dim / 8 vectors of 8 channels: one 16-byte load for
// 16-bit storage, two for f32. The lanes of a group of G (a power of two, G >= the vectors of a
// row) own one row, lane c its channels 8c .. 8c + 7, so a warp reads 32 / G whole rows with
// consecutive lanes on consecutive 16-byte words (coalesced). The host checks that every access
// is 16-byte aligned (key_rows_vectorizable) and falls back to the scalar kernels otherwise.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kvsift/core/dtype.hpp"
#include "rkv_kernels.cuh"

namespace kvsift::cuda::detail {

inline constexpr int kVecChannels = 8;  // channels per vector
inline constexpr int kVecMaxDim = 256;  // 32 vectors: one row per warp at most

// Lanes per row for head_dim channels (head_dim <= kVecMaxDim): the smallest power of two >= the
// vectors of a row, at least 2 (the bf16 copy's rows are zero-padded to 16 channels, 2 vectors).
inline int vec_group_lanes(int head_dim) {
  const int pitch_vectors = (head_dim + 15) / 16 * 2;
  int g = 2;
  while (g < pitch_vectors) g *= 2;
  return g;
}

// The raw 16-byte words of one vector (two for f32), loaded as early as possible so that many
// loads are in flight before the first is used.
template <class T>
struct RawVec {
  uint4 w[sizeof(T) == 4 ? 2 : 1];
};

// Loads channels 8c .. 8c + 7 of `row`; requires a 16-byte aligned row.
template <class T>
__device__ __forceinline__ RawVec<T> load_vec(const T* row, int c) {
  RawVec<T> r;
  const uint4* p = reinterpret_cast<const uint4*>(row + c * kVecChannels);
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(r.w) / sizeof(uint4)); ++q) r.w[q] = __ldg(p + q);
  return r;
}

template <class T>
__device__ __forceinline__ RawVec<T> zero_vec() {
  RawVec<T> r;
#pragma unroll
  for (int q = 0; q < static_cast<int>(sizeof(r.w) / sizeof(uint4)); ++q)
    r.w[q] = make_uint4(0, 0, 0, 0);
  return r;
}

// The 8 channels as fp32, with to_float's exact conversion.
template <class T>
__device__ __forceinline__ void unpack_vec(const RawVec<T>& r, float (&x)[kVecChannels]) {
  if constexpr (sizeof(T) == 4) {
    const float* f = reinterpret_cast<const float*>(r.w);
#pragma unroll
    for (int k = 0; k < kVecChannels; ++k) x[k] = f[k];
  } else {
    const std::uint32_t* u = reinterpret_cast<const std::uint32_t*>(r.w);
#pragma unroll
    for (int k = 0; k < kVecChannels / 2; ++k) {
      x[2 * k] = to_float(T{static_cast<std::uint16_t>(u[k] & 0xffffu)});
      x[2 * k + 1] = to_float(T{static_cast<std::uint16_t>(u[k] >> 16)});
    }
  }
}

// Sum of `x` over the G lanes of a group (aligned groups of G consecutive lanes). Every lane of
// the group ends with the same bits: a butterfly adds the same two values in both lanes of each
// pair, and fp32 addition is commutative. All 32 lanes must call it.
template <int G>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = G / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

}  // namespace kvsift::cuda::detail
