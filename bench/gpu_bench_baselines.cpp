// Throughput of the baselines' GPU kernels (docs/algorithms.md §5.1–§5.3) against a
// cudaMemcpyAsync device-to-device copy of the bf16 KV tensor measured in the same run:
//   KIVI    keys (per channel over G = 32 tokens) and values (per token over G = 32 channels),
//           2 and 4 bits: cuda::asym_quantize of the bf16 tensor, cuda::asym_dequantize to bf16
//   PM-KVQ  Q16 and Q2 (bf16 arithmetic, G = 128): quantize, dequantize (real backend's bf16
//           formula), and the exact right shift 16 → 2 bits (cuda::pmkvq_requantize)
//   Lazy    cuda::lazy_observe (one decode step's weights of every query head, GQA 4) and
//           cuda::lazy_scores over the same cache, int32 counters
//   RaaS    cuda::raas_refresh (top half) over token units and over pages of 16, and page mode's
//           cuda::raas_page_key_bounds (bf16 keys) and cuda::raas_page_bounds (GQA 4)
// Default size: 64 sequences × 8 KV heads × 4096 tokens × 128 dims (one layer's keys, bf16,
// 512 MiB), q_heads = 32.
//
// Bytes counted = bytes read + bytes written (scales and zero points fp32, 4 B each):
//   quantize    bf16 input + packed words + scales + zeros
//   dequantize  packed words + scales + zeros + bf16 output
//   ERS         16-bit words + 2-bit words + scales read and written
//   observe     weights [batch, q_heads, tokens] fp32 + TS/MRI read and written (+ lengths)
//   scores      TS/MRI read + scores written
//   refresh     scores read once + timestamps read and written (12 B a unit; the top-half rank
//               count re-reads a row's scores from cache, O(units²) work a row)
//   key bounds  bf16 keys read + min/max written (8 B a page channel)
//   Quest       min/max read + queries + one fp32 bound a page written
//   copy        bf16 tensor read + written (2 × tensor bytes)
// GB/s = bytes / median time (10^9 bytes); "vs copy" = kernel GB/s / copy GB/s (1.0: streams as
// fast as a plain copy). Median of kReps launches after kWarmup, CUDA events.
//
// Usage: gpu_bench_baselines [sequences] [kv_heads] [tokens] [head_dim]
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/asym_quant.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/lazy_scoring.hpp"
#include "kvsift/backend/cuda/raas_scoring.hpp"
#include "kvsift/core/dtype.hpp"

using namespace kvsift;
using bench::DeviceArray;

namespace {

constexpr int kWarmup = 3, kReps = 20;

// Deterministic N(0,1)-like bf16 values with a few outliers (sum of uniforms; fast setup).
std::vector<bf16_t> make_values(std::size_t n) {
  std::vector<bf16_t> v(n);
  std::uint64_t s = 0x9e3779b97f4a7c15ull;
  auto uniform = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(s >> 40) / 16777216.0f;
  };
  for (std::size_t i = 0; i < n; ++i) {
    float x = uniform() + uniform() + uniform() + uniform() - 2.0f;
    if (i % 997 == 0) x *= 40.0f;
    v[i] = from_float<bf16_t>(x);
  }
  return v;
}

struct Row {
  double copy_gbs;
  void print(const char* name, double bytes, double ms) const {
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    std::printf("%-34s | %9.3f %9.0f %8.2f\n", name, ms, gbs, gbs / copy_gbs);
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (!bench::cuda_device_present()) return 77;
  const std::int64_t seqs = argc > 1 ? std::atoll(argv[1]) : 64;
  const std::int64_t kv_heads = argc > 2 ? std::atoll(argv[2]) : 8;
  const std::int64_t tokens = argc > 3 ? std::atoll(argv[3]) : 4096;
  const std::int64_t dim = argc > 4 ? std::atoll(argv[4]) : 128;
  const std::int64_t q_heads = kv_heads * 4, slabs = seqs * kv_heads;
  const std::size_t n = static_cast<std::size_t>(slabs * tokens * dim);
  const double tensor_bytes = static_cast<double>(n) * sizeof(bf16_t);

  cudaDeviceProp prop;
  KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));

  DeviceArray<bf16_t> x(n), y(n);
  {
    const std::vector<bf16_t> host = make_values(n);
    KVSIFT_CUDA_CHECK(cudaMemcpy(x.get(), host.data(), tensor_bytes, cudaMemcpyHostToDevice));
  }
  const TensorView xv =
      TensorView::contiguous(x.get(), DType::bf16, Device::cuda, {slabs, tokens, dim});
  const TensorView yv =
      TensorView::contiguous(y.get(), DType::bf16, Device::cuda, {slabs, tokens, dim});

  const double copy_ms = bench::d2d_copy_ms(
      y.get(), x.get(), static_cast<std::size_t>(tensor_bytes), stream, kWarmup, kReps);
  const Row row{2.0 * tensor_bytes / (copy_ms * 1e-3) / 1e9};
  std::printf(
      "%s, bf16 [%lld seqs, %lld kv heads, %lld tokens, %lld dims] (%.1f MiB), median of "
      "%d after %d warm-up\n",
      prop.name, static_cast<long long>(seqs), static_cast<long long>(kv_heads),
      static_cast<long long>(tokens), static_cast<long long>(dim), tensor_bytes / (1 << 20), kReps,
      kWarmup);
  std::printf("D2D copy: %.3f ms, %.0f GB/s (read + write)\n\n", copy_ms, row.copy_gbs);
  std::printf("%-34s | %9s %9s %8s\n", "kernel", "ms", "GB/s", "vs copy");

  // Packed storage large enough for every layout below: 16-bit words are one word a code.
  DeviceArray<std::uint16_t> words16(n), words2(n / 8 + 1);
  // Groups of G = 32 along either axis, a partial last group a unit included.
  const std::size_t max_groups = n / 32 + static_cast<std::size_t>(slabs * (dim + tokens)) + 1;
  DeviceArray<float> scales(max_groups), zeros(max_groups);
  auto time_codec = [&](cuda::DeviceAsymPacked q, const char* qname, const char* dname,
                        cuda::AsymDequantMode mode) {
    q.words = words16.get();
    q.scales = scales.get();
    q.zeros = zeros.get();
    const double packed = static_cast<double>(q.word_bytes() + 8 * q.num_groups());
    row.print(
        qname, tensor_bytes + packed,
        bench::median_ms([&] { cuda::asym_quantize(xv, q, stream); }, stream, kWarmup, kReps));
    row.print(dname, packed + tensor_bytes,
              bench::median_ms([&] { cuda::asym_dequantize(q, mode, yv, stream); }, stream, kWarmup,
                               kReps));
  };
  for (int bits : {2, 4}) {
    char qn[64], dn[64];
    std::snprintf(qn, sizeof qn, "KIVI-%d keys quantize", bits);
    std::snprintf(dn, sizeof dn, "KIVI-%d keys dequantize", bits);
    time_codec(cuda::kivi_keys_layout(bits, 32, slabs, tokens, dim), qn, dn,
               cuda::AsymDequantMode::f32);
    std::snprintf(qn, sizeof qn, "KIVI-%d values quantize", bits);
    std::snprintf(dn, sizeof dn, "KIVI-%d values dequantize", bits);
    time_codec(cuda::kivi_values_layout(bits, 32, slabs, tokens, dim), qn, dn,
               cuda::AsymDequantMode::f32);
  }
  for (int bits : {2, 16}) {  // Q16 last: the ERS below shifts its words
    char qn[64], dn[64];
    std::snprintf(qn, sizeof qn, "PM-KVQ Q%d quantize", bits);
    std::snprintf(dn, sizeof dn, "PM-KVQ Q%d dequantize (bf16)", bits);
    time_codec(cuda::pmkvq_layout(bits, true, 128, slabs, tokens, dim), qn, dn,
               cuda::AsymDequantMode::pmkvq_bf16);
  }
  {
    // ERS 16 → 2 of the Q16 words just produced (scales updated in place, one per 128 codes).
    const cuda::DeviceAsymPacked q16 = cuda::pmkvq_layout(16, true, 128, slabs, tokens, dim);
    const std::int64_t count = static_cast<std::int64_t>(n), groups = q16.num_groups();
    const double bytes = 2.0 * count + count / 4.0 + 8.0 * groups;
    row.print("PM-KVQ ERS 16 -> 2 bits", bytes,
              bench::median_ms(
                  [&] {
                    cuda::pmkvq_requantize(words16.get(), 16, count, words2.get(), 2, scales.get(),
                                           groups, stream);
                  },
                  stream, kWarmup, kReps));
  }
  {
    // LazyEviction at the same cache size: int32 counters [seqs, kv_heads, tokens].
    const std::size_t cells = static_cast<std::size_t>(slabs * tokens);
    DeviceArray<std::int32_t> ts(cells), mri(cells), lengths(static_cast<std::size_t>(seqs));
    DeviceArray<float> probs(static_cast<std::size_t>(seqs * q_heads * tokens)), lazy_scores(cells);
    KVSIFT_CUDA_CHECK(cudaMemsetAsync(ts.get(), 0, cells * 4, stream));
    KVSIFT_CUDA_CHECK(cudaMemsetAsync(mri.get(), 0, cells * 4, stream));
    // Uniform weights 1/tokens (a valid softmax row); lengths = tokens, no new tokens.
    {
      std::vector<float> p(probs.size(), 1.0f / static_cast<float>(tokens));
      KVSIFT_CUDA_CHECK(
          cudaMemcpy(probs.get(), p.data(), p.size() * sizeof(float), cudaMemcpyHostToDevice));
      const std::vector<std::int32_t> len(static_cast<std::size_t>(seqs),
                                          static_cast<std::int32_t>(tokens));
      KVSIFT_CUDA_CHECK(
          cudaMemcpy(lengths.get(), len.data(), len.size() * 4, cudaMemcpyHostToDevice));
    }
    const cuda::LazyDeviceCounters c{ts.get(), mri.get(), seqs, kv_heads, tokens};
    const double observe_bytes = 4.0 * static_cast<double>(probs.size()) + 16.0 * cells;
    row.print("Lazy observe (TS/MRI update)", observe_bytes,
              bench::median_ms(
                  [&] {
                    cuda::lazy_observe(c, probs.get(), q_heads, lengths.get(), lengths.get(),
                                       nullptr, 0, 1, 1e-4f, LazyCounters::int32, stream);
                  },
                  stream, kWarmup, kReps));
    row.print("Lazy scores", 12.0 * cells,
              bench::median_ms(
                  [&] {
                    cuda::lazy_scores(c, lengths.get(), 128, 1000, LazyCounters::int32,
                                      lazy_scores.get(), stream);
                  },
                  stream, kWarmup, kReps));
  }
  {
    // RaaS: one timestamp per unit, scores of every unit (tokens, then pages of 16).
    const int page = 16;
    const std::int64_t pages = (tokens + page - 1) / page;
    const std::size_t cells = static_cast<std::size_t>(slabs * tokens);
    DeviceArray<float> unit_scores(cells), qs(static_cast<std::size_t>(seqs * q_heads * dim));
    DeviceArray<std::int32_t> ts(cells), units(static_cast<std::size_t>(seqs)),
        zero(static_cast<std::size_t>(seqs));
    {
      std::vector<float> sc(cells);
      std::uint64_t st = 12345;
      for (float& v : sc) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        v = static_cast<float>(st >> 40) / 16777216.0f;
      }
      KVSIFT_CUDA_CHECK(
          cudaMemcpy(unit_scores.get(), sc.data(), cells * 4, cudaMemcpyHostToDevice));
      const std::vector<float> q(qs.size(), 0.01f);
      KVSIFT_CUDA_CHECK(cudaMemcpy(qs.get(), q.data(), q.size() * 4, cudaMemcpyHostToDevice));
      const std::vector<std::int32_t> n(static_cast<std::size_t>(seqs),
                                        static_cast<std::int32_t>(tokens));
      KVSIFT_CUDA_CHECK(cudaMemcpy(units.get(), n.data(), n.size() * 4, cudaMemcpyHostToDevice));
      KVSIFT_CUDA_CHECK(cudaMemset(zero.get(), 0, zero.size() * 4));
    }
    row.print("RaaS refresh top half (tokens)", 12.0 * cells,
              bench::median_ms(
                  [&] {
                    cuda::raas_refresh(unit_scores.get(), units.get(), seqs, kv_heads, tokens,
                                       cuda::RaasRefreshRule::top_half, 0.0f, 7, ts.get(), stream);
                  },
                  stream, kWarmup, kReps));
    {
      const std::vector<std::int32_t> n(static_cast<std::size_t>(seqs),
                                        static_cast<std::int32_t>(pages));
      KVSIFT_CUDA_CHECK(cudaMemcpy(units.get(), n.data(), n.size() * 4, cudaMemcpyHostToDevice));
    }
    row.print("RaaS refresh top half (pages)", 12.0 * slabs * pages,
              bench::median_ms(
                  [&] {
                    cuda::raas_refresh(unit_scores.get(), units.get(), seqs, kv_heads, pages,
                                       cuda::RaasRefreshRule::top_half, 0.0f, 7, ts.get(), stream);
                  },
                  stream, kWarmup, kReps));
    {
      const std::vector<std::int32_t> n(static_cast<std::size_t>(seqs),
                                        static_cast<std::int32_t>(tokens));
      KVSIFT_CUDA_CHECK(cudaMemcpy(units.get(), n.data(), n.size() * 4, cudaMemcpyHostToDevice));
    }
    const std::size_t bound_cells = static_cast<std::size_t>(slabs * pages * dim);
    DeviceArray<float> kmin(bound_cells), kmax(bound_cells),
        bounds(static_cast<std::size_t>(slabs * pages));
    const TensorView keys =
        TensorView::contiguous(x.get(), DType::bf16, Device::cuda, {seqs, kv_heads, tokens, dim});
    row.print("RaaS page key bounds (bf16 keys)", tensor_bytes + 8.0 * bound_cells,
              bench::median_ms(
                  [&] {
                    cuda::raas_page_key_bounds(keys, zero.get(), units.get(), page, pages,
                                               kmin.get(), kmax.get(), stream);
                  },
                  stream, kWarmup, kReps));
    row.print("RaaS Quest page bounds", 8.0 * bound_cells + 4.0 * qs.size() + 4.0 * slabs * pages,
              bench::median_ms(
                  [&] {
                    cuda::raas_page_bounds(qs.get(), seqs, q_heads, kv_heads, dim, kmin.get(),
                                           kmax.get(), units.get(), page, pages, bounds.get(),
                                           stream);
                  },
                  stream, kWarmup, kReps));
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
