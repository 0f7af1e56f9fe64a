// ThinKV TBE survivor selection (docs/algorithms.md §3.3): kmeans_select on one segment of one
// (layer, KV head): n post-RoPE keys of head_dim 128 down to the schedule's next target. A
// 28-layer x 4-KV-head model (R1-Qwen-7B) runs this 112 times per demoted segment.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kvsift/backend/cpu/kmeans_select.hpp"

namespace {
std::vector<float> random_keys(std::int64_t n, std::int64_t dim) {
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> keys(n * dim);
  for (auto& x : keys) x = g(rng);
  return keys;
}

// Args: segment tokens n, target k (128 -> 64 is a first demotion, 64 -> 32 the second, ...).
void BM_KMeansSelect(benchmark::State& state) {
  const std::int64_t n = state.range(0), k = state.range(1), dim = 128;
  const std::vector<float> keys = random_keys(n, dim);
  for (auto _ : state) {
    auto kept = kvsift::kmeans_select(keys.data(), n, dim, k);
    benchmark::DoNotOptimize(kept.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_KMeansSelect)
    ->Args({128, 64})
    ->Args({64, 32})
    ->Args({32, 16})
    ->Args({16, 8})
    ->Args({8, 4})
    ->Unit(benchmark::kMicrosecond);
}  // namespace

BENCHMARK_MAIN();
