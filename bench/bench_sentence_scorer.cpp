// SkipKV's sentence scorer (docs/algorithms.md §2.4) on 16K-token caches shaped like
// R1-Llama-8B attention: 32 query / 8 KV heads, head_dim 128, batch 1, window 8, budget 1024.
// Compared side by side with the plain R-KV select on the same cache, so the ratio shows what the
// sentence penalty and the pad handling add on top of the shared importance + redundancy scores.
//
// Keys: a per-head shared direction plus isotropic noise, pairwise cosine ≈ 0.6 (real post-RoPE
// keys are strongly anisotropic, so near-duplicates above the 0.5 threshold are common and the
// redundancy's last-match search stops early). The `isotropic` variant (cosines ≈ 0) is the
// search's worst case, O(S²·D), measured at 4K only.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"

using namespace kvsift;

namespace {
constexpr std::int64_t kQHeads = 32, kKVHeads = 8, kDim = 128, kWindow = 8;
constexpr int kBudget = 1024;

struct Inputs {
  std::int64_t seq = 0;
  std::vector<float> keys, values, queries;  // [1, 8, S, 128], [1, 32, 8, 128]
  std::vector<std::int32_t> lengths;
  std::vector<std::uint8_t> mask;  // [1, S]
  SentencePenalties penalties;     // [8] lists

  Inputs(std::int64_t s, float shared, std::int64_t pads) : seq(s) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    keys.resize(kKVHeads * s * kDim);
    values.resize(keys.size());
    for (std::int64_t h = 0; h < kKVHeads; ++h) {
      std::vector<float> dir(kDim);
      float norm = 0;
      for (float& x : dir) norm += (x = nd(rng)) * x;
      for (float& x : dir) x *= shared / std::sqrt(norm);
      for (std::int64_t j = 0; j < s; ++j)
        for (std::int64_t d = 0; d < kDim; ++d) keys[(h * s + j) * kDim + d] = dir[d] + nd(rng);
    }
    for (float& v : values) v = nd(rng);
    queries.resize(kQHeads * kWindow * kDim);
    for (float& q : queries) q = nd(rng);
    lengths = {static_cast<std::int32_t>(s)};
    mask.assign(static_cast<std::size_t>(s), 1);
    for (std::int64_t j = 0; j < pads; ++j) mask[j] = 0;
    // One sentence per 16 tokens after the pads, every tenth redundant (λ 0.97), mapped at its
    // generation range in every head (first eviction).
    struct Marked {
      std::int64_t start, end;
      float lambda;
    };
    std::vector<Marked> sentences;
    for (std::int64_t p = pads, i = 0; p + 16 <= s - kWindow; p += 16, ++i)
      sentences.push_back({p, p + 15, i % 10 == 3 ? 0.97f : -1.0f});
    SegmentTable table(1, 1, kKVHeads);
    table.set_first_position(0, pads);
    table.append_closed(0, 0, sentences, s, s);
    penalties.resize(kKVHeads);
    for (std::int64_t h = 0; h < kKVHeads; ++h)
      penalties[h] = table.penalty_ranges(0, 0, h, sentences);
  }
  KVCacheView kv() {
    return make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, 1, kKVHeads, seq,
                              kDim, lengths.data(), mask.data());
  }
  TensorView q() {
    return TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                  {1, kQHeads, kWindow, kDim});
  }
};

// Shared ≈ sqrt(1.5·D) gives a pairwise key cosine of about 0.6.
const float kAnisotropic = std::sqrt(1.5f * kDim);

SentenceScorerConfig scorer_config(PadMode mode) {
  SentenceScorerConfig c;
  c.rkv.budget = kBudget;
  c.rkv.window = kWindow;
  c.pad_mode = mode;
  return c;
}

void BM_SentenceScorerSelect(benchmark::State& state) {
  const std::int64_t s = state.range(0);
  const PadMode mode = state.range(1) ? PadMode::faithful : PadMode::exclude;
  Inputs in(s, state.range(2) ? kAnisotropic : 0.0f, /*pads=*/state.range(3));
  const SentenceScorer scorer(scorer_config(mode));
  for (auto _ : state) {
    KeepPlan plan = scorer.select(in.kv(), in.q(), in.penalties);
    benchmark::DoNotOptimize(plan.slots().data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(s), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_RKVSelect(benchmark::State& state) {
  const std::int64_t s = state.range(0);
  Inputs in(s, state.range(1) ? kAnisotropic : 0.0f, 0);
  RKVConfig c;
  c.budget = kBudget;
  c.window = kWindow;
  RKV rkv(c);
  for (auto _ : state) {
    KeepPlan plan = rkv.select(StepInputs{0, in.kv(), in.q()});
    benchmark::DoNotOptimize(plan.slots().data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(s), benchmark::Counter::kIsIterationInvariantRate);
}

// The part SkipKV adds: the eq. 6 penalty over 8 head rows (1K sentences, 10% redundant).
void BM_SentencePenaltyOnly(benchmark::State& state) {
  const std::int64_t s = state.range(0);
  Inputs in(s, kAnisotropic, 0);
  std::vector<float> rows(kKVHeads * s, 0.0f);
  for (auto _ : state) {
    for (std::int64_t h = 0; h < kKVHeads; ++h)
      add_sentence_penalty(&rows[h * s], s - kWindow, s, in.penalties[h]);
    benchmark::DoNotOptimize(rows.data());
  }
}

}  // namespace

// Args: seq, pad mode (0 exclude, 1 faithful), anisotropic keys, pads.
BENCHMARK(BM_SentenceScorerSelect)
    ->ArgNames({"seq", "faithful", "aniso", "pads"})
    ->Args({16384, 0, 1, 0})
    ->Args({16384, 1, 1, 0})
    ->Args({16384, 0, 1, 512})
    ->Args({16384, 1, 1, 512})
    ->Args({4096, 0, 1, 0})
    ->Args({4096, 0, 0, 0})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
BENCHMARK(BM_RKVSelect)
    ->ArgNames({"seq", "aniso"})
    ->Args({16384, 1})
    ->Args({4096, 1})
    ->Args({4096, 0})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
BENCHMARK(BM_SentencePenaltyOnly)->Arg(16384)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
