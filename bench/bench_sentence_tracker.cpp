// SkipKV bookkeeping cost on 16K-token sequences: the SentenceTracker fed one decode token at a
// time (segmentation only, and with hidden states of R1-Qwen-7B's width), compression triggers
// every 128 tokens (pairwise sentence similarity), and the SegmentTable updates of one layer.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/skipkv/sentence_tracker.hpp"
#include "real_tokens.hpp"

using namespace kvsift;

namespace {
constexpr std::int64_t kTokens = 16384;
constexpr std::int64_t kInterval = 128;  // docs/algorithms.md §4 compression interval

// 16K real R1-Qwen token ids: the MATH-500 prompts and solutions back to back (real sentence
// lengths), repeated if the file runs short.
const std::vector<std::int32_t>& real_stream() {
  static const std::vector<std::int32_t> stream = [] {
    std::vector<std::int32_t> ids = bench::read_math500_r1qwen_tokens();
    if (ids.empty()) ids.push_back(198);  // no data: a stream of one-token sentences
    std::vector<std::int32_t> out;
    while (static_cast<std::int64_t>(out.size()) < kTokens)
      out.push_back(ids[out.size() % ids.size()]);
    return out;
  }();
  return stream;
}

// A pool of random hidden rows, cycled: the tracker's cost does not depend on the values, and a
// real 16K x 3584 buffer would only measure memory bandwidth.
std::vector<float> hidden_pool(std::int64_t hidden, int rows) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> pool(static_cast<std::size_t>(hidden * rows));
  for (float& x : pool) x = nd(rng);
  return pool;
}

void BM_TrackerSegmentOnly(benchmark::State& state) {
  const auto& ids = real_stream();
  for (auto _ : state) {
    SentenceTracker t(SentenceTrackerConfig{SentenceTokens::r1_qwen(), 0, 0.95f});
    for (std::int64_t i = 0; i < kTokens; ++i) t.observe(&ids[i], 1);
    benchmark::DoNotOptimize(t.num_sentences());
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
}
BENCHMARK(BM_TrackerSegmentOnly)->Unit(benchmark::kMillisecond);

// A synthetic stream with a delimiter every `sentence_len` tokens: reasoning traces close
// sentences far more often than the MATH-500 reference solutions do.
std::vector<std::int32_t> dense_stream(std::int64_t sentence_len) {
  std::vector<std::int32_t> ids(kTokens, 1000);
  for (std::int64_t i = sentence_len - 1; i < kTokens; i += sentence_len) ids[i] = 271;
  return ids;
}

// observe() with hidden states of width range(0), plus a trigger every 128 tokens when range(1)
// is 1; range(2) = 0: the real stream, else a delimiter every range(2) tokens.
void BM_TrackerHidden(benchmark::State& state) {
  const std::int64_t hidden = state.range(0);
  const bool triggers = state.range(1) != 0;
  const auto ids = state.range(2) == 0 ? real_stream() : dense_stream(state.range(2));
  const int rows = 64;
  const auto pool = hidden_pool(hidden, rows);
  std::int64_t sentences = 0, marks = 0;
  for (auto _ : state) {
    SentenceTracker t(SentenceTrackerConfig{SentenceTokens::r1_qwen(), hidden, 0.95f});
    for (std::int64_t i = 0; i < kTokens; ++i) {
      t.observe(&ids[i], 1, pool.data() + (i % rows) * hidden, DType::f32);
      if (triggers && (i + 1) % kInterval == 0)
        marks += static_cast<std::int64_t>(t.mark_redundant().size());
    }
    sentences = t.num_sentences();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.counters["sentences"] = static_cast<double>(sentences);
  benchmark::DoNotOptimize(marks);
}
BENCHMARK(BM_TrackerHidden)
    ->Args({3584, 0, 0})
    ->Args({3584, 1, 0})
    ->Args({4096, 1, 0})
    ->Args({3584, 1, 16})
    ->Unit(benchmark::kMillisecond);

// One layer, 8 KV heads: at every trigger past the budget, append the newly closed sentences and
// remap through a random plan keeping `budget` slots (window 8) per head.
void BM_SegmentTableLayer(benchmark::State& state) {
  const std::int32_t budget = static_cast<std::int32_t>(state.range(0)), window = 8;
  const std::int64_t heads = 8;
  const auto& ids = real_stream();
  SentenceTracker tracker(SentenceTrackerConfig{SentenceTokens::r1_qwen(), 0, 0.95f});
  tracker.observe(ids.data(), kTokens);
  const auto& sentences = tracker.sentences();
  // Precompute the plans (random kept sets) so only the table's work is timed.
  std::mt19937 rng(5);
  std::vector<KeepPlan> plans;
  std::vector<std::int64_t> trigger_pos;
  std::int32_t len = 0;
  for (std::int64_t pos = 1; pos <= kTokens; ++pos) {
    ++len;
    if (pos % kInterval != 0 || len <= budget) continue;
    KeepPlan plan(1, heads, kTokens, {len}, {budget}, window);
    std::vector<std::int32_t> all(len - window), row;
    for (std::int32_t i = 0; i < len - window; ++i) all[i] = i;
    for (std::int64_t h = 0; h < heads; ++h) {
      std::shuffle(all.begin(), all.end(), rng);
      row.assign(all.begin(), all.begin() + (budget - window));
      std::sort(row.begin(), row.end());
      for (std::int32_t i = 0; i < window; ++i) row.push_back(len - window + i);
      plan.append_row(row);
    }
    plans.push_back(std::move(plan));
    trigger_pos.push_back(pos);
    len = budget;
  }
  for (auto _ : state) {
    SegmentTable table(1, 1, heads);
    std::size_t closed = 0;
    std::int32_t cache_len = 0;
    std::int64_t prev = 0;
    std::vector<Sentence> visible;
    for (std::size_t k = 0; k < plans.size(); ++k) {
      const std::int64_t pos = trigger_pos[k];
      cache_len += static_cast<std::int32_t>(pos - prev);
      prev = pos;
      while (closed < sentences.size() && sentences[closed].end < pos)
        visible.push_back(sentences[closed++]);
      table.append_closed(0, 0, visible, pos, cache_len);
      table.apply_plan(0, plans[k]);
      cache_len = budget;
    }
    benchmark::DoNotOptimize(table.ranges(0, 0, 0).size());
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.counters["evictions"] = static_cast<double>(plans.size());
  state.counters["sentences"] = static_cast<double>(sentences.size());
}
BENCHMARK(BM_SegmentTableLayer)->Arg(1024)->Arg(4096)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
