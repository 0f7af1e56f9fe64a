// The host side of cuda::DeviceThinKV's decode step, on the CPU alone: what a layer costs the host
// per step before any kernel runs. Per sequence of the batch, one token is placed by the
// metadata-only ThoughtBlockTable (holds_data = false) and recorded by the DevicePagedTable that
// mirrors it (DeviceThinKV::record_tokens), and the page tables are walked (what
// upload_paged_batch does when a sequence gained or lost a block). R1-Llama-8B shapes: 8 KV heads,
// head_dim 128, blocks of 32, R4 E4 T2.
//
// Recording, take_append_plan (append()'s host half) and walking never touch the table's device
// memory and launch nothing, so host buffers stand in for that memory and no GPU is needed.
// BM_RecordStep times a batch's first 32 tokens (two sealed key groups and one new block per
// sequence and KV head: what every 32 decode steps cost); BM_PageWalk walks tables of 1,024
// tokens per sequence; BM_DemotionSources lists one layer's problems of a TBE demotion.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/paged/thought_block_table.hpp"

namespace {

using namespace kvsift;

constexpr std::int32_t kKVHeads = 8, kHeadDim = 128, kResident = 1024, kSteps = 32;

// A metadata table and its device mirror over host memory, `resident` tokens per sequence.
struct HostPipeline {
  ThoughtBlockTableConfig cfg;
  std::vector<std::uint64_t> memory = std::vector<std::uint64_t>(8);  // never read or written
  ThoughtBlockTable table;
  cuda::DevicePagedTable mirror;
  std::vector<SlotAddress> where = std::vector<SlotAddress>(kKVHeads);

  static ThoughtBlockTableConfig config(std::int32_t batch) {
    ThoughtBlockTableConfig c;
    c.kv_heads = kKVHeads;
    c.head_dim = kHeadDim;
    c.block_size = 32;
    c.num_blocks = batch * ((kResident + kSteps) / 32 + 8);
    c.holds_data = false;
    return c;
  }
  cuda::PagedTableMemory stand_in() {
    auto* p = memory.data();
    return cuda::PagedTableMemory{
        reinterpret_cast<std::uint8_t*>(p),       p,
        reinterpret_cast<std::uint8_t*>(p),       reinterpret_cast<std::int64_t*>(p),
        reinterpret_cast<cuda::PagedStaging*>(p), reinterpret_cast<cuda::PagedStaging*>(p),
        reinterpret_cast<std::uint32_t*>(p),      reinterpret_cast<float*>(p)};
  }
  HostPipeline(std::int32_t batch, std::int32_t resident)
      : cfg(config(batch)), table(cfg), mirror(cfg, batch, stand_in()) {
    for (std::int32_t b = 0; b < batch; ++b) {
      table.create_sequence();
      table.open_segment(b, ThoughtType::reasoning);
    }
    for (std::int32_t i = 0; i < resident; ++i) step(batch);
  }
  // One token of every sequence, placed and recorded (DeviceThinKV::record_tokens(layer, 1)),
  // then put in the append kernels' order (the host half of DevicePagedTable::append).
  std::size_t step(std::int32_t batch) {
    for (std::int32_t b = 0; b < batch; ++b) {
      table.append(b, nullptr, nullptr, kKVHeads, kHeadDim, where.data());
      mirror.record_append(table, b, where.data());
    }
    return mirror.take_append_plan().ops.size();
  }
};

// Arg: batch. Time per layer and decode step in the counter us_per_layer_step (CPU time).
void BM_RecordStep(benchmark::State& state) {
  const auto batch = static_cast<std::int32_t>(state.range(0));
  for (auto _ : state) {
    state.PauseTiming();
    auto p = std::make_unique<HostPipeline>(batch, 0);
    state.ResumeTiming();
    for (std::int32_t s = 0; s < kSteps; ++s) benchmark::DoNotOptimize(p->step(batch));
    state.PauseTiming();
    p.reset();
    state.ResumeTiming();
  }
  state.counters["us_per_layer_step"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kSteps * 1e-6,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_RecordStep)->Arg(64)->Arg(800)->Unit(benchmark::kMillisecond)->Iterations(10);

// Arg: batch. One walk of every sequence's page table (cuda::describe_paged_batch).
void BM_PageWalk(benchmark::State& state) {
  const auto batch = static_cast<std::int32_t>(state.range(0));
  HostPipeline p(batch, kResident);
  std::vector<std::int32_t> seqs(static_cast<std::size_t>(batch));
  std::iota(seqs.begin(), seqs.end(), 0);
  for (auto _ : state) {
    benchmark::DoNotOptimize(cuda::describe_paged_batch(p.mirror, seqs.data(), batch).total_blocks);
  }
  state.SetItemsProcessed(state.iterations() * batch * p.mirror.num_blocks(0));
}
BENCHMARK(BM_PageWalk)->Arg(64)->Arg(800)->Unit(benchmark::kMicrosecond);

// Arg: batch. One layer's share of listing a TBE demotion, as DeviceThinKV::layer_problems does
// it: per sequence and KV head, one scan (into a reused buffer) of the resident tokens in the
// demoted segment's positions — the 128 tokens after a 1,024-token prompt, the e2e benchmark's
// evicting step — each token's address and key source (DevicePagedTable::key_source) written
// into the layer's two lists, sized once for the layer; the lists freed inside the timing, as
// the step frees them.
void BM_DemotionSources(benchmark::State& state) {
  const auto batch = static_cast<std::int32_t>(state.range(0));
  HostPipeline p(batch, kResident);
  for (std::int32_t b = 0; b < batch; ++b) p.table.open_segment(b, ThoughtType::execution);
  for (std::int32_t i = 0; i < 128; ++i) p.step(batch);
  const std::size_t tokens = static_cast<std::size_t>(batch) * kKVHeads * 128;
  std::int64_t listed = 0;
  std::vector<ResidentToken> scan;
  for (auto _ : state) {
    std::vector<SlotAddress> addresses(tokens);
    std::vector<cuda::PagedKeySource> sources(tokens);
    std::size_t k = 0;
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kKVHeads; ++h) {
        p.table.resident_tokens_between(b, h, kResident, 1 << 30, scan);
        for (const ResidentToken& r : scan) {
          addresses[k] = r.address;
          sources[k++] = p.mirror.key_source(b, h, r.address);
        }
      }
    }
    listed += static_cast<std::int64_t>(k);
    benchmark::DoNotOptimize(sources.data());
  }
  state.SetItemsProcessed(listed);
}
BENCHMARK(BM_DemotionSources)->Arg(208)->Arg(704)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
