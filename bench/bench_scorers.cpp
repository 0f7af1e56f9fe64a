// CPU reference scorers at the R1-Llama-8B attention shape (32 query / 8 KV heads, head_dim 128)
// at the two trigger lengths S = budget + buffer for budgets 1024 and 2048: window importance,
// key redundancy, and a full R-KV select (both scores + top-k). Random keys are the redundancy
// search's worst case: no key has a near-duplicate, so no row leaves the search early.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kvsift/backend/cpu/key_redundancy.hpp"
#include "kvsift/backend/cpu/window_importance.hpp"
#include "kvsift/policy/baselines/rkv.hpp"

namespace {

constexpr std::int64_t kQHeads = 32, kKVHeads = 8, kHeadDim = 128, kWindow = 8, kBuffer = 128;

// Random storage for one layer's cache and window queries; the views point into it.
template <class T>
struct BenchCache {
  std::vector<T> keys, values, queries;
  std::vector<std::int32_t> lengths;
  std::int64_t batch, seq;

  BenchCache(std::int64_t b, std::int64_t s) : batch(b), seq(s) {
    std::mt19937 rng(42);
    std::normal_distribution<float> n(0.0f, 1.0f);
    keys.resize(b * kKVHeads * s * kHeadDim);
    values.resize(keys.size());
    queries.resize(b * kQHeads * kWindow * kHeadDim);
    for (auto& x : keys) x = kvsift::from_float<T>(n(rng));
    for (auto& x : values) x = kvsift::from_float<T>(n(rng));
    for (auto& x : queries) x = kvsift::from_float<T>(n(rng));
    lengths.assign(static_cast<std::size_t>(b), static_cast<std::int32_t>(s));
  }
  kvsift::KVCacheView kv() {
    return kvsift::make_kv_cache_view(keys.data(), values.data(), kvsift::dtype_of<T>::value,
                                      kvsift::Device::cpu, batch, kKVHeads, seq, kHeadDim,
                                      lengths.data());
  }
  kvsift::TensorView q() {
    return kvsift::TensorView::contiguous(queries.data(), kvsift::dtype_of<T>::value,
                                          kvsift::Device::cpu, {batch, kQHeads, kWindow, kHeadDim});
  }
  std::int64_t key_bytes() const { return static_cast<std::int64_t>(keys.size() * sizeof(T)); }
};

// items: tokens scored per (sequence, KV head); bytes: keys (+ queries) read.
template <class T>
void set_counters(benchmark::State& st, const BenchCache<T>& c, bool with_queries) {
  st.SetItemsProcessed(st.iterations() * c.batch * kKVHeads * c.seq);
  st.SetBytesProcessed(
      st.iterations() *
      (c.key_bytes() +
       (with_queries ? static_cast<std::int64_t>(c.queries.size() * sizeof(T)) : 0)));
}

template <class T>
void BM_WindowImportance(benchmark::State& st) {
  BenchCache<T> c(st.range(0), st.range(1));
  const kvsift::KVCacheView kv = c.kv();
  const kvsift::TensorView q = c.q();
  for (auto _ : st) benchmark::DoNotOptimize(kvsift::cpu::window_importance(kv, q, {}));
  set_counters(st, c, true);
}

template <class T>
void BM_KeyRedundancy(benchmark::State& st) {
  BenchCache<T> c(st.range(0), st.range(1));
  const kvsift::KVCacheView kv = c.kv();
  for (auto _ : st) benchmark::DoNotOptimize(kvsift::cpu::redundancy_full(kv, {}));
  set_counters(st, c, false);
}

template <class T>
void BM_RKVSelect(benchmark::State& st) {
  BenchCache<T> c(st.range(0), st.range(1));
  kvsift::RKVConfig cfg;
  cfg.budget = static_cast<int>(c.seq - kBuffer);
  kvsift::RKV policy(cfg);
  const kvsift::StepInputs in{0, c.kv(), c.q()};
  for (auto _ : st) benchmark::DoNotOptimize(policy.select(in));
  set_counters(st, c, true);
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"batch", "S"})->Unit(benchmark::kMillisecond);
  for (std::int64_t batch : {1, 8})
    for (std::int64_t s : {1152, 2176}) b->Args({batch, s});
}

}  // namespace

BENCHMARK_TEMPLATE(BM_WindowImportance, float)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_WindowImportance, kvsift::bf16_t)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_KeyRedundancy, float)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_KeyRedundancy, kvsift::bf16_t)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_RKVSelect, float)->Apply(shapes);
BENCHMARK_TEMPLATE(BM_RKVSelect, kvsift::bf16_t)->Apply(shapes);

BENCHMARK_MAIN();
