// ThinKV path on the GPU (docs/algorithms.md §3.4): decode attention over the device Continuous
// Thinking table (R4 E4 T2 blocks of 32 slots, 50 % of each KV head's tokens evicted by mask
// bits) against dense bf16 attention over the same retained tokens gathered contiguously. Both
// kernels are kvsift::cuda's (the same split-KV kernel body with two tile loaders), same run.
// 8 KV heads, 32 query heads, head_dim 128, sequence lengths 4K / 16K / 32K (default).
//
// Prints per length: median µs of each (CUDA events, 50 reps after 5 warm-up), the bytes each
// reads (paged: the storage of every block in every head, the masks and the page table; dense: the
// retained K and V in bf16) and the effective GB/s, the largest |paged − dense| output difference
// (bf16 rounding of the dense copy), the device append cost, and "bytes moved by an eviction":
// the number of pool bytes that differ before and after the eviction kernel (FNV-1a checksums of
// the whole pool are printed too). It must be 0: eviction only sets mask bits.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/paged/thought_block_table.hpp"

using namespace kvsift;
using bench::DeviceArray;

namespace {

constexpr int kKVHeads = 8, kQHeads = 32, kHeadDim = 128, kBlock = 32, kSegment = 128;
constexpr int kWarmup = 5, kReps = 50;

std::uint64_t fnv1a(const std::vector<std::uint8_t>& bytes) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

void run(int tokens, cudaStream_t stream) {
  ThoughtBlockTableConfig cfg;  // R4 E4 T2 by default
  cfg.kv_heads = kKVHeads;
  cfg.head_dim = kHeadDim;
  cfg.block_size = kBlock;
  cfg.num_blocks = tokens / kBlock + 8;  // one partly filled block per type at most, plus slack
  ThoughtBlockTable cpu(cfg);
  const cuda::PagedTableSizes sizes = cuda::paged_table_sizes(cfg, 1);
  DeviceArray<std::uint8_t> storage(static_cast<std::size_t>(sizes.storage_bytes));
  DeviceArray<std::uint64_t> masks(static_cast<std::size_t>(sizes.mask_bytes / 8));
  DeviceArray<std::uint32_t> sealed(static_cast<std::size_t>(sizes.sealed_bytes / 4));
  DeviceArray<float> staging(static_cast<std::size_t>(sizes.staging_bytes / 4));
  DeviceArray<float> factors(kKVHeads);
  cuda::DevicePagedTable dev(cfg, 1,
                             cuda::PagedTableMemory{storage.get(), masks.get(), sealed.get(),
                                                    staging.get(), factors.get()});
  dev.initialize(stream);

  // Append the sequence: segments of 128 tokens with random thought types, batches of 128.
  std::mt19937 rng(1234 + tokens);
  std::normal_distribution<float> normal;
  const int seq = cpu.create_sequence();
  const std::size_t row = static_cast<std::size_t>(kKVHeads) * kHeadDim;
  std::vector<bf16_t> batch_k, batch_v;
  DeviceArray<bf16_t> dk(kSegment * row), dv(kSegment * row);
  double append_ms = 0;
  std::vector<float> k(row), v(row);
  std::vector<SlotAddress> where(kKVHeads);
  for (int t = 0; t < tokens; ++t) {
    if (t % kSegment == 0) cpu.open_segment(seq, static_cast<ThoughtType>(rng() % 3));
    for (std::size_t i = 0; i < row; ++i) {
      const bf16_t kb = from_float<bf16_t>(2.0f * normal(rng)),
                   vb = from_float<bf16_t>(normal(rng));
      batch_k.push_back(kb);
      batch_v.push_back(vb);
      k[i] = to_float(kb);
      v[i] = to_float(vb);
    }
    cpu.append(seq, k.data(), v.data(), kKVHeads, kHeadDim, where.data());
    dev.record_append(cpu, seq, where.data());
    if (dev.pending_tokens() == kSegment || t + 1 == tokens) {
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dk.get(), batch_k.data(), batch_k.size() * 2,
                                        cudaMemcpyHostToDevice, stream));
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dv.get(), batch_v.data(), batch_v.size() * 2,
                                        cudaMemcpyHostToDevice, stream));
      DeviceArray<std::uint8_t> ws(dev.append_workspace_bytes());
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto h0 = std::chrono::steady_clock::now();
      dev.append(dk.get(), dv.get(), DType::bf16, ws.get(), ws.size(), stream);
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      append_ms +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
      batch_k.clear();
      batch_v.clear();
    }
  }

  // Evict exactly half of each head's tokens (a random half per head): mask bits only.
  std::vector<std::uint8_t> pool(static_cast<std::size_t>(sizes.storage_bytes));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  KVSIFT_CUDA_CHECK(cudaMemcpy(pool.data(), storage.get(), pool.size(), cudaMemcpyDeviceToHost));
  const std::vector<std::uint8_t> before = pool;
  float evict_ms = 0;
  bench::EventPair evict_events;
  for (int h = 0; h < kKVHeads; ++h) {
    std::vector<ResidentToken> live = cpu.resident_tokens(seq, h);
    std::shuffle(live.begin(), live.end(), rng);
    live.resize(live.size() / 2);
    std::vector<SlotAddress> victims;
    for (const ResidentToken& t : live) {
      cpu.evict(seq, h, t.address);
      victims.push_back(t.address);
    }
    DeviceArray<std::uint8_t> ws(dev.evict_workspace_bytes(victims.size()));
    evict_ms += evict_events.time_ms(
        [&] { dev.evict(seq, h, victims, ws.get(), ws.size(), stream); }, stream);
  }
  KVSIFT_CUDA_CHECK(cudaMemcpy(pool.data(), storage.get(), pool.size(), cudaMemcpyDeviceToHost));
  std::int64_t moved = 0;
  for (std::size_t i = 0; i < pool.size(); ++i) moved += pool[i] != before[i];

  // The retained tokens gathered contiguously in bf16 for the dense baseline: [H, n, D].
  const std::int64_t n = cpu.live_tokens(seq, 0);
  std::vector<bf16_t> dense_k(static_cast<std::size_t>(kKVHeads * n * kHeadDim)),
      dense_v(dense_k.size());
  std::vector<float> bk(static_cast<std::size_t>(kBlock) * kHeadDim), bv(bk.size());
  for (int h = 0; h < kKVHeads; ++h) {
    std::int64_t j = 0;
    for (std::int32_t b = 0; b < cpu.num_blocks(seq); ++b) {
      cpu.dequantize_block(seq, b, h, bk.data(), bv.data());
      const std::uint64_t* free = cpu.free_mask(seq, b, h);
      for (int s = 0; s < kBlock; ++s) {
        if ((free[s / 64] >> (s % 64)) & 1u) continue;
        for (int d = 0; d < kHeadDim; ++d) {
          const std::size_t o = static_cast<std::size_t>((h * n + j) * kHeadDim + d);
          dense_k[o] = from_float<bf16_t>(bk[static_cast<std::size_t>(s * kHeadDim + d)]);
          dense_v[o] = from_float<bf16_t>(bv[static_cast<std::size_t>(s * kHeadDim + d)]);
        }
        ++j;
      }
    }
    KVSIFT_CHECK(j == n, "bench: head ", h, " keeps ", j, " tokens, head 0 keeps ", n);
  }
  DeviceArray<bf16_t> ddk(dense_k.size()), ddv(dense_v.size());
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(ddk.get(), dense_k.data(), dense_k.size() * 2, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(ddv.get(), dense_v.data(), dense_v.size() * 2, cudaMemcpyHostToDevice));

  std::vector<float> q(static_cast<std::size_t>(kQHeads) * kHeadDim);
  for (float& x : q) x = normal(rng);
  DeviceArray<float> dq(q.size()), out_paged(q.size()), out_dense(q.size());
  KVSIFT_CUDA_CHECK(cudaMemcpy(dq.get(), q.data(), q.size() * 4, cudaMemcpyHostToDevice));
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  DeviceArray<std::uint8_t> ws_paged(
      cuda::paged_decode_attention_workspace_bytes(dev, seq, kQHeads));
  DeviceArray<std::uint8_t> ws_dense(
      cuda::dense_decode_attention_workspace_bytes(kKVHeads, n, kQHeads, kHeadDim));
  const float paged_ms = bench::median_ms(
      [&] {
        cuda::paged_decode_attention(dev, seq, dq.get(), kQHeads, kHeadDim, scale, out_paged.get(),
                                     ws_paged.get(), ws_paged.size(), stream);
      },
      stream, kWarmup, kReps);
  const float dense_ms = bench::median_ms(
      [&] {
        cuda::dense_decode_attention_bf16(ddk.get(), ddv.get(), kKVHeads, n, dq.get(), kQHeads,
                                          kHeadDim, scale, out_dense.get(), ws_dense.get(),
                                          ws_dense.size(), stream);
      },
      stream, kWarmup, kReps);
  std::vector<float> op(q.size()), od(q.size());
  KVSIFT_CUDA_CHECK(cudaMemcpy(op.data(), out_paged.get(), op.size() * 4, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(od.data(), out_dense.get(), od.size() * 4, cudaMemcpyDeviceToHost));
  float max_diff = 0;
  for (std::size_t i = 0; i < op.size(); ++i)
    max_diff = std::max(max_diff, std::fabs(op[i] - od[i]));

  double paged_bytes = 0;
  for (std::int32_t b = 0; b < cpu.num_blocks(seq); ++b) {
    paged_bytes += static_cast<double>(cpu.block_storage(seq, b).size());
  }
  paged_bytes += static_cast<double>(cpu.num_blocks(seq)) * kKVHeads * (8 + 4) +  // mask, sealed
                 cpu.num_blocks(seq) * 8.0;                                       // page table
  const double dense_bytes = 2.0 * kKVHeads * static_cast<double>(n) * kHeadDim * 2;
  std::printf(
      "%6d %7lld %6d %10.1f %9.2f %8.1f %10.1f %9.2f %8.1f %7.4f %9.2f %10.1f %6lld  %016llx "
      "%016llx\n",
      tokens, static_cast<long long>(n), cpu.num_blocks(seq), paged_ms * 1e3, paged_bytes / 1e6,
      paged_bytes / (paged_ms * 1e-3) / 1e9, dense_ms * 1e3, dense_bytes / 1e6,
      dense_bytes / (dense_ms * 1e-3) / 1e9, max_diff, append_ms * 1e3 / tokens, evict_ms * 1e3,
      static_cast<long long>(moved), static_cast<unsigned long long>(fnv1a(before)),
      static_cast<unsigned long long>(fnv1a(pool)));
}

}  // namespace

// Usage: gpu_bench_paged_attention [tokens ...] (default 4096 16384 32768).
int main(int argc, char** argv) {
  std::vector<int> lengths;
  for (int i = 1; i < argc; ++i) lengths.push_back(std::atoi(argv[i]));
  if (lengths.empty()) lengths = {4096, 16384, 32768};
  if (!bench::cuda_device_present()) return 0;
  cudaDeviceProp prop{};
  KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));
  std::printf(
      "CT paged decode attention on %s: R4 E4 T2, block %d, Hkv %d / Hq %d, head_dim %d, 50%% "
      "evicted per head; dense = bf16 over the same retained tokens\n",
      prop.name, kBlock, kKVHeads, kQHeads, kHeadDim);
  std::printf("%6s %7s %6s %10s %9s %8s %10s %9s %8s %7s %9s %10s %6s  %-16s %-16s\n", "tokens",
              "kept", "blocks", "paged_us", "paged_MB", "GB/s", "dense_us", "dense_MB", "GB/s",
              "maxdiff", "app_us/tk", "evict_us", "moved", "fnv_before", "fnv_after");
  for (int t : lengths) run(t, stream);
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
