// ThinKV TBE survivor selection on the GPU (docs/algorithms.md §3.3): deterministic k-means over
// segments of 128 tokens keeping 64 (the first demotion, R[0] = 64), per (layer, KV head) at
// R1-Llama-8B / R1-Qwen-7B-like shapes: 28 layers x 8 KV heads = 224 problems per segment,
// head_dim 128, bf16 keys read in place from per-layer caches. One kmeans_select launch covers
// `segments` x 224 problems.
//
// Prints the median device time (CUDA events) of >= 20 launches after warm-up, per launch and per
// problem, and checks the first problems against the CPU reference (kvsift::kmeans_select), whose
// single-thread time per problem is printed for comparison.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/kmeans_select.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/backend/cpu/kmeans_select.hpp"

using namespace kvsift;
using bench::DeviceArray;

namespace {

constexpr int kLayers = 28, kKVHeads = 8, kHeadDim = 128, kSegment = 128, kKeep = 64;
constexpr int kMaxSegments = 8, kCapacity = kSegment * kMaxSegments;
constexpr int kWarmup = 3, kReps = 25, kCpuChecked = 4;

}  // namespace

int main() {
  if (!bench::cuda_device_present()) return 77;
  // Per layer one cache [batch 1, kv_heads 8, capacity 1024, head_dim 128] of bf16 keys.
  const std::size_t layer_elems = static_cast<std::size_t>(kKVHeads) * kCapacity * kHeadDim;
  std::vector<bf16_t> host(layer_elems * kLayers);
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (bf16_t& x : host) x = from_float<bf16_t>(normal(rng));
  DeviceArray<bf16_t> keys(host.size());
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(keys.get(), host.data(), host.size() * sizeof(bf16_t), cudaMemcpyHostToDevice));
  std::vector<std::int32_t> lengths(1, kCapacity);

  std::vector<cuda::KMeansProblem> all;  // segment-major: segment s, layer l, head h
  for (int s = 0; s < kMaxSegments; ++s)
    for (int l = 0; l < kLayers; ++l) {
      const KVCacheView kv = make_kv_cache_view(
          keys.get() + l * layer_elems, keys.get() + l * layer_elems, DType::bf16, Device::cuda, 1,
          kKVHeads, kCapacity, kHeadDim, lengths.data());
      for (int h = 0; h < kKVHeads; ++h)
        all.push_back(cuda::kmeans_problem_from_cache(kv, 0, h, s * kSegment, kSegment, kKeep));
    }
  DeviceArray<std::int32_t> out(all.size() * kKeep);
  const std::size_t ws_bytes = cuda::kmeans_select_workspace_bytes(all.size());
  DeviceArray<char> ws(ws_bytes);
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));
  const KMeansSelectConfig cfg{};

  // Correctness spot check against the CPU reference, and its time per problem.
  cuda::kmeans_select(all.data(), kCpuChecked, kHeadDim, DType::bf16, cfg, out.get(), kKeep,
                      ws.get(), ws_bytes, stream);
  std::vector<std::int32_t> got(static_cast<std::size_t>(kCpuChecked) * kKeep);
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(got.data(), out.get(), got.size() * sizeof(std::int32_t),
                                    cudaMemcpyDeviceToHost, stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  int mismatched = 0;
  const auto cpu_begin = std::chrono::steady_clock::now();
  for (int p = 0; p < kCpuChecked; ++p) {  // problems 0..3: segment 0, layer 0, heads 0..3
    std::vector<float> seg(static_cast<std::size_t>(kSegment) * kHeadDim);
    for (int i = 0; i < kSegment; ++i)
      for (int d = 0; d < kHeadDim; ++d)
        seg[i * kHeadDim + d] =
            to_float(host[(static_cast<std::size_t>(p) * kCapacity + i) * kHeadDim + d]);
    const std::vector<std::int32_t> ref = kmeans_select(seg.data(), kSegment, kHeadDim, kKeep, cfg);
    mismatched += !std::equal(ref.begin(), ref.end(), got.begin() + p * kKeep);
  }
  const double cpu_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - cpu_begin)
          .count() /
      kCpuChecked;
  std::printf(
      "kmeans_select 128 -> 64 tokens, head_dim 128, bf16, 28 layers x 8 KV heads per "
      "segment\n");
  std::printf(
      "CPU reference: %.0f us per problem (single thread); GPU vs CPU on %d problems: "
      "%s\n\n",
      cpu_us, kCpuChecked, mismatched == 0 ? "identical" : "MISMATCH");
  std::printf("%9s %9s %14s %14s\n", "segments", "problems", "us/launch", "us/problem");
  for (int segments : {1, 2, 4, 8}) {
    const std::int64_t problems = static_cast<std::int64_t>(segments) * kLayers * kKVHeads;
    const double us =
        1000.0 * bench::median_ms(
                     [&] {
                       cuda::kmeans_select(all.data(), problems, kHeadDim, DType::bf16, cfg,
                                           out.get(), kKeep, ws.get(), ws_bytes, stream);
                     },
                     stream, kWarmup, kReps);
    std::printf("%9d %9lld %14.1f %14.2f\n", segments, static_cast<long long>(problems), us,
                us / static_cast<double>(problems));
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return mismatched == 0 ? 0 : 1;
}
