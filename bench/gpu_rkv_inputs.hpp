// Device-side helpers of bench/gpu_bench_rkv.cpp (kernels in gpu_rkv_inputs.cu): seeded,
// deterministic key generators that run on the GPU (so a 35 GB cache is written in milliseconds
// and can be regenerated between repetitions instead of kept as a pristine copy), and the bf16
// mma.sync throughput that the search's compute floor is measured against.
// Benchmarks only: these launchers synchronise and are not part of the library.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvsift::bench {

// i.i.d. N(0, 1) bf16 values: dst[e] for e < n, a pure function of (seed, e).
//   dst  device, n bf16 (raw 16-bit storage)
void fill_normal_bf16(void* dst, std::size_t n, std::uint64_t seed, cudaStream_t stream);

// Parameters of the "structured" keys (fill_structured_keys_bf16). Per (sequence, KV head) slab:
//   a ~ U[mag_min, mag_max], g ~ N(0, I_D)           (the slab's shared direction, per-element
//                                                      RMS 1, so |a·g| ≈ a·sqrt(D))
//   base_i = a·g + n_i,  n_i ~ N(0, I_D)              (two base rows: cosine ≈ a² / (a² + 1))
//   row i  = base_i, or, with probability dup_fraction (i > 0): base_j + dup_noise·m_i for an
//            earlier non-duplicate row j (uniform in [0, i), stepped back to a non-duplicate),
//            m_i ~ N(0, I_D): cosine with row j ≈ 1 / sqrt(1 + dup_noise² / (a² + 1)) > 0.99.
struct StructuredKeys {
  float mag_min = 0.5f;
  float mag_max = 3.0f;
  float dup_fraction = 0.2f;
  float dup_noise = 0.1f;
};

// Structured keys of a contiguous cache [batch, kv_heads, seq, head_dim] bf16 (see above); a pure
// function of (params, seed, element index), so a regenerated cache is bit-identical.
//   keys  device [batch, kv_heads, seq, head_dim]
void fill_structured_keys_bf16(void* keys, std::int64_t batch, std::int64_t kv_heads,
                               std::int64_t seq, std::int64_t head_dim,
                               const StructuredKeys& params, std::uint64_t seed,
                               cudaStream_t stream);

// Reads `bytes` (a multiple of 16) of `buf` once, so that the L2 cache holds clean lines of `buf`
// and nothing of what ran before: the "cold cache" between repetitions. Reading, not writing,
// keeps the timed work that follows free of dirty-line write-backs. `sink` (device, one
// uint32) receives a value only in the impossible case that keeps the reads alive.
void read_flush(const void* buf, std::size_t bytes, std::uint32_t* sink, cudaStream_t stream);

// Throughput in FLOP/s of bf16 mma.sync.m16n8k16 with fp32 accumulation (the instruction of the
// tensor-core redundancy search), operands in registers: every SM busy with independent
// accumulator chains, median of `reps` timed launches after `warmup`. An upper bound of what any
// mma.sync kernel can reach; Hopper's wgmma (cuBLAS) peak is higher.
double mma_sync_peak_flops(cudaStream_t stream, int warmup, int reps);

}  // namespace kvsift::bench
