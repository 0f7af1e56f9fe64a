// Where the fp16 unit keys of the tensor-core search live (written by the key pass, read by
// cuda/key_redundancy_tc.cu): not as rows of `length` but as the byte images of the search's
// shared-memory tiles, so that a tile reaches shared memory as one contiguous bulk copy (Hopper's
// cp.async.bulk) with no per-thread address arithmetic (bench/RESULTS.md run 89: the per-thread
// copies were 169 of a warp's 715 instructions per column tile).
//
// One head's region: tiles of 64 rows; each tile holds `halves` (1 for head_dim <= 64, else 2)
// images of 64 rows × 64 channels (128 bytes a row) with wgmma.cuh's 128-byte swizzle, channels
// 0–63 first, zero past head_dim. The region holds tc_padded_length(length) rows, whole row tiles
// of the search (256 rows), the rows from `length` on zero, so no copy leaves the buffer and no
// stale bytes reach the tensor cores. The layout is checked on the host, without a GPU, by
// tests/cuda/host_tc_unit_images.cpp.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace kvsift::cuda::detail {

inline constexpr int kTcImageRows = 64;       // rows of one tile image (a column tile)
inline constexpr int kTcImageChannels = 64;   // channels of one image row: 128 bytes
inline constexpr int kTcLengthQuantum = 256;  // a row tile of the search

KVSIFT_HOST_DEVICE constexpr int tc_image_halves(int head_dim) { return head_dim > 64 ? 2 : 1; }
KVSIFT_HOST_DEVICE constexpr int tc_padded_length(int length) {
  return (length + kTcLengthQuantum - 1) / kTcLengthQuantum * kTcLengthQuantum;
}
// Elements (fp16) of one head's region.
KVSIFT_HOST_DEVICE constexpr std::int64_t tc_head_elements(int length, int head_dim) {
  return static_cast<std::int64_t>(tc_padded_length(length)) * kTcImageChannels *
         tc_image_halves(head_dim);
}
// Elements of one tile image (all its halves): the bytes of a column tile / 2.
KVSIFT_HOST_DEVICE constexpr int tc_tile_elements(int head_dim) {
  return kTcImageRows * kTcImageChannels * tc_image_halves(head_dim);
}
// Element offset, inside one head's region, of the start of row i's 128 bytes in half `half`.
KVSIFT_HOST_DEVICE constexpr std::int64_t tc_row_offset(int i, int half, int halves) {
  return ((static_cast<std::int64_t>(i / kTcImageRows) * halves + half) * kTcImageRows +
          i % kTcImageRows) *
         kTcImageChannels;
}
// Element offset of channels 8·chunk .. 8·chunk + 7 of row i (chunk < 8 · halves).
KVSIFT_HOST_DEVICE constexpr std::int64_t tc_chunk_offset(int i, int chunk, int halves) {
  return tc_row_offset(i, chunk / 8, halves) + ((chunk % 8) ^ (i % 8)) * 8;  // swizzle128_offset
}

#if defined(__CUDACC__)
// Rows [length, tc_padded_length(length)) of one head's region set to zero by threads
// `thread` = 0 .. threads − 1 of the caller.
__device__ __forceinline__ void zero_tc_padding(__half* __restrict__ head, int length, int halves,
                                                int thread, int threads) {
  const int chunks = 8 * halves, rows = tc_padded_length(length) - length;
  for (int e = thread; e < rows * chunks; e += threads)
    *reinterpret_cast<uint4*>(head + tc_chunk_offset(length + e / chunks, e % chunks, halves)) =
        make_uint4(0, 0, 0, 0);
}
#endif

}  // namespace kvsift::cuda::detail
