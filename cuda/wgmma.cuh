// Warpgroup tensor-core helpers for Hopper's arch-specific target (sm_90a): wgmma.mma_async with
// both operands read from shared memory through matrix descriptors (PTX ISA, "Asynchronous
// warpgroup level matrix multiply-accumulate": the descriptor format, the 128-byte swizzle and
// the m64nNk16 register fragments). Compiled only where __CUDA_ARCH_FEAT_SM90_ALL is defined;
// the kernels keep an mma.sync path for every other target.
//
// Operand layout used here: K-major tiles of fp16 rows, 64 channels (128 bytes) per row, with the
// 128-byte swizzle: in each 1024-byte atom of 8 rows, 16-byte chunk c of row r is stored at chunk
// c ^ (r % 8). Atoms are 1024-byte aligned and follow each other every 8 rows (stride 1024 B).
#pragma once

#include <cstdint>

namespace kvsift::cuda::detail {

// Byte offset of channels 8·chunk .. 8·chunk + 7 of row `row` in a 128-byte-swizzled region of
// 64-channel rows.
__host__ __device__ constexpr std::uint32_t swizzle128_offset(int row, int chunk) {
  return static_cast<std::uint32_t>(row) * 128u +
         (static_cast<std::uint32_t>(chunk ^ (row & 7)) << 4);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Descriptor of a K-major, 128-byte-swizzled operand starting at shared address `addr` (the
// tile's first row, advanced by 32 bytes per k step of 16 channels): start address >> 4 in bits
// 0–13, leading-dimension offset 1 (unused by swizzled K-major layouts), stride 1024 B >> 4 in
// bits 32–45 (one atom of 8 rows), base offset 0 (atoms 1024-byte aligned), layout 1 = 128-byte
// swizzle in bits 62–63.
__device__ __forceinline__ std::uint64_t wgmma_desc_sw128(std::uint32_t addr) {
  return static_cast<std::uint64_t>((addr & 0x3ffffu) >> 4) | (std::uint64_t{1} << 16) |
         (std::uint64_t{1024 >> 4} << 32) | (std::uint64_t{1} << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) further on in shared memory. Exact
// without the masking of wgmma_desc_sw128: a CTA's shared window is below 256 KiB, so the start
// address field (address >> 4, 14 bits) cannot carry into the fields above it. One add instead of
// the mask, shift and merge of a descriptor built from scratch (bench/RESULTS.md run 89: those
// were ~13 instructions per wgmma of the search, between the wgmma).
__device__ __forceinline__ std::uint64_t wgmma_desc_advance(std::uint64_t desc,
                                                            std::uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Orders this thread's register and shared-memory accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses to the accumulators across the wgmma that own them.
template <int kN>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64×64] = A[64×16]·B[64×16]ᵀ (+ D when kAccumulate), fp16 inputs, fp32 accumulate, both
// operands K-major in shared memory. Thread (warp w of the warpgroup, lane l) holds d[4·n + q] =
// D[16w + l/4 + 8·(q/2), 8n + 2·(l%4) + q%2]: per warp the m16n8 fragments of mma.sync, eight n
// tiles wide.
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n64k16_f16(float (&d)[32], std::uint64_t a,
                                                    std::uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "n"(kAccumulate ? 1 : 0));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace kvsift::cuda::detail
