// One R-KV or SkipKV compression step on the GPU (score + select + plan download +
// kvsift::cuda::compact) at R1-Llama-8B attention: 32 query / 8 KV heads, head_dim 128, bf16,
// budget 1024, S = budget + 128 (the decode trigger, docs/algorithms.md §1.3), batch 1, 8, 32, 64.
// SkipKV (§2.4) adds the sentence penalties: every (sequence, KV head) has a redundant 24-token
// sentence every 120 tokens (λ_i 0.01 .. 0.1), uploaded inside the timed selection, as an engine
// uploads a step's fresh penalties.
//
// Prints per layer: scoring+selection (device time, CUDA events), plan download (host wall time),
// compaction (device time, including its host-side plan checks), the whole layer (host wall time),
// the layer times 32 layers, and the ratio to the HBM floor: reading K, V and the window queries
// once and writing the kept K, V once, at the device-to-device copy bandwidth measured in the same
// run.
//
// Two key distributions bracket the redundancy search (§1.2 cost note): "random" keys almost never
// reach cosine 0.5, so every row scans the whole sequence (the worst case); "clustered" keys share
// a direction per head, so nearly every row finds its last match in the first tile it sees.
// Each is run with the fp32 last-match search and with RKVConfig::tensor_core_search (bf16
// mma.sync tiles plus exact fp32 re-checks near the threshold; identical results): column "search".
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/sentence_scoring.hpp"
#include "kvsift/core/dtype.hpp"

using namespace kvsift;
using bench::DeviceArray;
using bench::median;

namespace {

constexpr int kQHeads = 32, kKVHeads = 8, kHeadDim = 128, kBudget = 1024, kWindow = 8;
constexpr int kSeq = kBudget + 128, kLayers = 32, kWarmup = 3, kReps = 20;

// Cheap deterministic standard-normal-ish values (sum of uniforms), so setup stays fast at B=64.
struct Noise {
  std::uint64_t s = 0x9e3779b97f4a7c15ull;
  float uniform() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(s >> 40) / 16777216.0f;
  }
  float normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7320508f; }
};

// One sequence's heads [kKVHeads, kSeq, kHeadDim], copied to every sequence of the batch.
std::vector<bf16_t> make_sequence(bool clustered, Noise& noise) {
  std::vector<bf16_t> out(static_cast<std::size_t>(kKVHeads) * kSeq * kHeadDim);
  for (int h = 0; h < kKVHeads; ++h) {
    std::vector<float> common(kHeadDim);
    for (auto& x : common) x = clustered ? 2.0f * noise.normal() : 0.0f;
    for (int i = 0; i < kSeq; ++i)
      for (int d = 0; d < kHeadDim; ++d)
        out[(static_cast<std::size_t>(h) * kSeq + i) * kHeadDim + d] =
            from_float<bf16_t>(noise.normal() + common[d]);
  }
  return out;
}

// SkipKV's penalties for every (sequence, KV head): a redundant sentence [lo, lo + 23] every 120
// tokens, λ_i cycling through 0.01 .. 0.1.
cuda::SentencePenaltyCsr bench_penalties(int batch) {
  std::vector<std::vector<PenaltyRange>> per_row(static_cast<std::size_t>(batch) * kKVHeads);
  for (auto& row : per_row)
    for (int lo = 0, i = 0; lo + 23 < kSeq - kWindow; lo += 120, ++i)
      row.push_back(PenaltyRange{lo, lo + 23, 0.01f * static_cast<float>(1 + i % 10)});
  return cuda::build_penalty_csr(per_row, batch, kKVHeads);
}

void run(int batch, bool clustered, bool tensor_core, bool skipkv, double bandwidth,
         cudaStream_t stream) {
  const std::size_t cache_elems = static_cast<std::size_t>(batch) * kKVHeads * kSeq * kHeadDim;
  DeviceArray<bf16_t> keys(cache_elems), values(cache_elems);
  DeviceArray<bf16_t> queries(static_cast<std::size_t>(batch) * kQHeads * kWindow * kHeadDim);
  Noise noise;
  const std::vector<bf16_t> seq_k = make_sequence(clustered, noise);
  const std::vector<bf16_t> seq_v = make_sequence(false, noise);
  std::vector<bf16_t> q(queries.size());
  for (auto& x : q) x = from_float<bf16_t>(noise.normal());
  const std::size_t seq_bytes = seq_k.size() * sizeof(bf16_t);
  for (int b = 0; b < batch; ++b) {
    KVSIFT_CUDA_CHECK(
        cudaMemcpy(keys.get() + b * seq_k.size(), seq_k.data(), seq_bytes, cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(values.get() + b * seq_v.size(), seq_v.data(), seq_bytes,
                                 cudaMemcpyHostToDevice));
  }
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(queries.get(), q.data(), q.size() * sizeof(bf16_t), cudaMemcpyHostToDevice));

  std::vector<std::int32_t> lengths(batch, kSeq);
  const KVCacheView kv = make_kv_cache_view(keys.get(), values.get(), DType::bf16, Device::cuda,
                                            batch, kKVHeads, kSeq, kHeadDim, lengths.data());
  const TensorView qv = TensorView::contiguous(queries.get(), DType::bf16, Device::cuda,
                                               {batch, kQHeads, kWindow, kHeadDim});
  SentenceScorerConfig skip_cfg;
  skip_cfg.rkv.budget = kBudget;
  skip_cfg.rkv.window = kWindow;
  skip_cfg.rkv.tensor_core_search = tensor_core;
  const RKVConfig cfg = skip_cfg.rkv;
  const cuda::SentencePenaltyCsr csr = bench_penalties(batch);
  DeviceArray<char> penalty_ws(cuda::sentence_penalty_workspace_bytes(csr));
  DeviceArray<char> ws(skipkv ? cuda::skipkv_workspace_bytes(kv, qv, skip_cfg)
                              : cuda::rkv_workspace_bytes(kv, qv, cfg));
  DeviceArray<std::int32_t> slots(static_cast<std::size_t>(batch) * kKVHeads * kBudget);

  cudaEvent_t e0, e1, e2, e3;
  for (cudaEvent_t* e : {&e0, &e1, &e2, &e3}) KVSIFT_CUDA_CHECK(cudaEventCreate(e));
  std::vector<float> t_select, t_plan, t_compact, t_total;
  DeviceArray<char> compact_ws(std::size_t(batch) * kKVHeads * (kBudget * 4 + 64) + (1 << 20));
  for (int r = 0; r < kWarmup + kReps; ++r) {
    std::fill(lengths.begin(), lengths.end(), kSeq);  // compact() shortened them last time
    // Each stage ends with a synchronisation, so the host intervals attribute time cleanly:
    // selection (device work plus launch overhead), the plan download, the compaction.
    const auto h0 = std::chrono::steady_clock::now();
    KVSIFT_CUDA_CHECK(cudaEventRecord(e0, stream));
    if (skipkv) {
      const cuda::SentencePenaltiesDevice pen =
          cuda::upload_sentence_penalties(csr, penalty_ws.get(), penalty_ws.size(), stream);
      cuda::skipkv_select(kv, qv, skip_cfg, pen, slots.get(), nullptr, ws.get(), ws.size(), stream);
    } else {
      cuda::rkv_select(kv, qv, cfg, slots.get(), nullptr, ws.get(), ws.size(), stream);
    }
    KVSIFT_CUDA_CHECK(cudaEventRecord(e1, stream));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(e1));
    const auto h1 = std::chrono::steady_clock::now();
    const KeepPlan plan = cuda::download_keep_plan(kv, slots.get(), kBudget, kWindow, stream);
    const auto h2 = std::chrono::steady_clock::now();
    KVSIFT_CHECK(cuda::compact_workspace_bytes(plan) <= compact_ws.size(),
                 "bench: compact workspace too small");
    KVSIFT_CUDA_CHECK(cudaEventRecord(e2, stream));
    cuda::compact(kv, plan, compact_ws.get(), compact_ws.size(), stream);
    KVSIFT_CUDA_CHECK(cudaEventRecord(e3, stream));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(e3));
    const auto h3 = std::chrono::steady_clock::now();
    float sel = 0, cmp = 0;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&sel, e0, e1));
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&cmp, e2, e3));
    using ms = std::chrono::duration<float, std::milli>;
    if (r >= kWarmup) {
      t_select.push_back(sel);
      t_plan.push_back(ms(h2 - h1).count());
      t_compact.push_back(cmp);
      t_total.push_back(ms(h3 - h0).count());
    }
  }
  for (cudaEvent_t e : {e0, e1, e2, e3}) KVSIFT_CUDA_CHECK(cudaEventDestroy(e));

  const double elem = 2.0;  // bf16
  const double cache_bytes = static_cast<double>(cache_elems) * elem;
  const double kept_bytes = static_cast<double>(batch) * kKVHeads * kBudget * kHeadDim * elem;
  const double query_bytes = static_cast<double>(q.size()) * elem;
  const double floor_ms = (2 * cache_bytes + query_bytes + 2 * kept_bytes) / bandwidth * 1e3;
  const float layer = median(t_total);
  std::printf("%-7s %-9s %-6s %5d %10.3f %10.3f %10.3f %10.3f %12.2f %9.3f %8.1fx\n",
              skipkv ? "skipkv" : "rkv", clustered ? "clustered" : "random",
              tensor_core ? "tc" : "fp32", batch, median(t_select), median(t_plan),
              median(t_compact), layer, layer * kLayers, floor_ms, layer / floor_ms);
}

}  // namespace

// Usage: gpu_bench_rkv [batch ...] (default 1 8 32 64).
int main(int argc, char** argv) {
  std::vector<int> batches;
  for (int i = 1; i < argc; ++i) batches.push_back(std::atoi(argv[i]));
  if (batches.empty()) batches = {1, 8, 32, 64};
  if (!bench::cuda_device_present()) return 0;
  cudaDeviceProp prop{};
  KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));
  // Device-to-device copy bandwidth (bytes read + written per second) on a 1 GiB buffer.
  const double bw = bench::d2d_copy_bandwidth(std::size_t(1) << 30, stream, kWarmup, kReps);
  std::printf(
      "R-KV / SkipKV step on %s: Hq %d / Hkv %d, head_dim %d, bf16, budget %d, S %d, window %d\n",
      prop.name, kQHeads, kKVHeads, kHeadDim, kBudget, kSeq, kWindow);
  std::printf("device-to-device copy bandwidth: %.0f GB/s (read + write)\n", bw * 1e-9);
  std::printf("median of %d reps after %d warm-up; ms per layer unless noted\n", kReps, kWarmup);
  std::printf("%-7s %-9s %-6s %5s %10s %10s %10s %10s %12s %9s %9s\n", "policy", "keys", "search",
              "batch", "score+sel", "plan(host)", "compact", "layer", "32 layers", "HBM floor",
              "ratio");
  for (int batch : batches)
    KVSIFT_CHECK(batch >= 1, "gpu_bench_rkv: batch must be >= 1, got ", batch);
  for (bool clustered : {false, true})
    for (bool tensor_core : {false, true})
      for (int batch : batches) run(batch, clustered, tensor_core, false, bw, stream);
  for (bool clustered : {false, true})  // SkipKV with the search the engine would pick
    for (int batch : batches) run(batch, clustered, true, true, bw, stream);
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
