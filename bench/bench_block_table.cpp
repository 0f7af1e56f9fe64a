// ThoughtBlockTable operations (docs/algorithms.md §3.4) on the CPU: appending tokens (with the
// staged quantization of 16-slot key groups), soft eviction plus slot reuse, and the reference
// paged decode attention. Shapes are R1-Qwen-7B-like: 4 KV heads, 28 query heads, head_dim 128.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "kvsift/paged/paged_attention.hpp"
#include "kvsift/paged/thought_block_table.hpp"

namespace {

constexpr std::int32_t kKvHeads = 4, kQHeads = 28, kHeadDim = 128;

kvsift::ThoughtBlockTableConfig make_config(bool quantized, std::int32_t block_size) {
  kvsift::ThoughtBlockTableConfig c;
  c.kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  c.block_size = block_size;
  c.num_blocks = 4096;
  if (!quantized) {
    c.reasoning = c.execution = c.transition = kvsift::BlockFormat::f32;
  }
  return c;
}

std::vector<float> random_tokens(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(n * kKvHeads * kHeadDim));
  for (float& v : x) v = normal(rng);
  return x;
}

// Fills a sequence with `n` tokens in segments of 128 whose types cycle R, E, T.
void fill(kvsift::ThoughtBlockTable& t, std::int32_t seq, const std::vector<float>& k,
          const std::vector<float>& v, std::int64_t n) {
  const std::int64_t stride = kKvHeads * kHeadDim;
  for (std::int64_t i = 0; i < n; ++i) {
    if (i % 128 == 0) t.open_segment(seq, static_cast<kvsift::ThoughtType>((i / 128) % 3));
    t.append(seq, &k[i * stride], &v[i * stride], kKvHeads, kHeadDim);
  }
}

// Args: tokens, quantized (0/1), block size.
void BM_Append(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto k = random_tokens(n, 1), v = random_tokens(n, 2);
  for (auto _ : state) {
    kvsift::ThoughtBlockTable t(make_config(state.range(1) != 0, state.range(2)));
    const std::int32_t seq = t.create_sequence();
    fill(t, seq, k, v, n);
    benchmark::DoNotOptimize(t.length(seq));
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_Append)->Args({1024, 0, 32})->Args({1024, 1, 16})->Args({1024, 1, 32});

// One TBE-like round: evict one whole 16-slot group of each head (a different group per head),
// then append 16 new tokens, whose group refills the freed runs with fresh scales (§3.4; a run
// with any survivor is never refilled). Args: tokens, quantized.
void BM_EvictAndReuse(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto k = random_tokens(n, 3), v = random_tokens(n, 4);
  kvsift::ThoughtBlockTable t(make_config(state.range(1) != 0, 32));
  const std::int32_t seq = t.create_sequence();
  fill(t, seq, k, v, n);
  std::mt19937 rng(5);
  const std::int64_t stride = kKvHeads * kHeadDim;
  for (auto _ : state) {
    for (std::int32_t h = 0; h < kKvHeads; ++h) {
      auto tokens = t.resident_tokens(seq, h, t.num_segments(seq) - 1);
      std::vector<kvsift::ResidentToken> placed;
      for (const auto& r : tokens)
        if (r.address.block >= 0) placed.push_back(r);
      const auto& pick = placed[rng() % placed.size()];
      std::vector<std::int32_t> victims;
      for (const auto& r : tokens) {
        if (r.address.block == pick.address.block && r.address.slot / 16 == pick.address.slot / 16)
          victims.push_back(r.position);
      }
      t.evict_positions(seq, h, victims);
    }
    for (int i = 0; i < 16; ++i) t.append(seq, &k[i * stride], &v[i * stride], kKvHeads, kHeadDim);
  }
  state.SetItemsProcessed(state.iterations() * 16);
  state.counters["blocks"] = t.num_blocks(seq);
}
BENCHMARK(BM_EvictAndReuse)->Args({1024, 0})->Args({1024, 1});

// Decode attention of one query token. Args: tokens, quantized, evicted fraction (percent).
void BM_PagedAttention(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto k = random_tokens(n, 6), v = random_tokens(n, 7);
  kvsift::ThoughtBlockTable t(make_config(state.range(1) != 0, 32));
  const std::int32_t seq = t.create_sequence();
  fill(t, seq, k, v, n);
  std::mt19937 rng(8);
  for (std::int32_t h = 0; h < kKvHeads; ++h) {
    std::vector<std::int32_t> victims;
    for (std::int32_t p = 0; p < n; ++p)
      if (static_cast<std::int64_t>(rng() % 100) < state.range(2)) victims.push_back(p);
    t.evict_positions(seq, h, victims);
  }
  std::vector<float> query(kQHeads * kHeadDim, 0.1f), out(query.size());
  for (auto _ : state) {
    kvsift::paged_decode_attention(t, seq, query.data(), kQHeads, kHeadDim, 0.088f, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.counters["resident_MiB"] = static_cast<double>(t.resident_bytes().total()) / (1 << 20);
}
BENCHMARK(BM_PagedAttention)
    ->Args({4096, 0, 0})
    ->Args({4096, 1, 0})
    ->Args({4096, 1, 50})
    ->Unit(benchmark::kMicrosecond);

// The host-table share of one layer's TBE demotion in cuda::DeviceThinKV::end_step, at a shape
// like bench/e2e_generate.py's ThinKV rows at budget 1024 (8 KV heads as R1-Llama-8B; 1,024 tokens
// per sequence in segments of 128): every sequence demotes one segment, keeping 64 of its 128
// tokens per head. head_dim is 16: neither step reads a key. Arg: batch (sequences).
struct DemotionLayer {
  kvsift::ThoughtBlockTable table;
  std::vector<kvsift::EvictionSlot> slots;  // every other token of segment 4, every head
};

DemotionLayer demotion_layer(std::int32_t batch) {
  constexpr std::int32_t kHeads = 8, kDim = 16, kTokens = 1024;
  kvsift::ThoughtBlockTableConfig c;
  c.kv_heads = kHeads;
  c.head_dim = kDim;
  c.num_blocks = batch * (kTokens / c.block_size + 8);
  DemotionLayer d{kvsift::ThoughtBlockTable(c), {}};
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(kHeads * kDim), v(k.size());
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int32_t seq = d.table.create_sequence();
    for (std::int32_t i = 0; i < kTokens; ++i) {
      if (i % 128 == 0) d.table.open_segment(seq, static_cast<kvsift::ThoughtType>((i / 128) % 3));
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      d.table.append(seq, k.data(), v.data(), kHeads, kDim);
    }
    for (std::int32_t h = 0; h < kHeads; ++h) {
      const auto tokens = d.table.resident_tokens_between(seq, h, 512, 639);
      for (std::size_t i = 0; i < tokens.size(); i += 2)
        d.slots.push_back(kvsift::EvictionSlot{seq, h, tokens[i].address});
    }
  }
  return d;
}

// Listing a demoted segment's tokens per (sequence, KV head), as DeviceThinKV::layer_problems.
void BM_DemotionList(benchmark::State& state) {
  const DemotionLayer d = demotion_layer(static_cast<std::int32_t>(state.range(0)));
  const std::int32_t heads = d.table.config().kv_heads;
  std::int64_t listed = 0;
  for (auto _ : state) {
    for (std::int32_t b = 0; b < static_cast<std::int32_t>(state.range(0)); ++b) {
      for (std::int32_t h = 0; h < heads; ++h)
        listed += static_cast<std::int64_t>(d.table.resident_tokens_between(b, h, 512, 639).size());
    }
  }
  state.SetItemsProcessed(listed);
}
BENCHMARK(BM_DemotionList)->Arg(208)->Arg(704)->Unit(benchmark::kMillisecond);

// One layer's evictions in one evict_slots batch (the table copied before each and destroyed
// after it, both untimed).
void BM_DemotionEvictSlots(benchmark::State& state) {
  const DemotionLayer d = demotion_layer(static_cast<std::int32_t>(state.range(0)));
  for (auto _ : state) {
    state.PauseTiming();
    auto t = std::make_unique<kvsift::ThoughtBlockTable>(d.table);
    state.ResumeTiming();
    t->evict_slots(d.slots);
    benchmark::DoNotOptimize(t->free_blocks());
    state.PauseTiming();
    t.reset();
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(d.slots.size()));
}
BENCHMARK(BM_DemotionEvictSlots)->Arg(208)->Arg(704)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
