// SkipKV's host-side cost of one compression step on device views: 32 layers, 8 KV heads, batch
// 64 and 432, budget 1024 and 2048 (+ buffer 128), 16K-token real R1-Qwen streams (hundreds of
// sentences per sequence, redundancy marks from small hidden states).
//
// The GPU is replaced by a bench-local DeviceBackend whose "device memory" is never touched: its
// selection hands back a cheap deterministic plan (a strided thinning of the candidates, 64
// patterns copied row by row, as a download would) and its compaction only rewrites the lengths.
// What is timed is therefore SkipKV's own bookkeeping (range maps before and after eviction,
// penalties, plan handling) plus the rows the fake writes (BM_FakeRowsOnly: the per-layer path's
// KeepPlans alone). Each timed iteration is one steady-state step: 128 decode tokens observed
// (untimed), then the step over all 32 layers: range(2) = 0 the one-call SkipKV::compress_step,
// 1 the per-layer path (Policy::compress_step: select + compact of each layer). Built with
// -DKVSIFT_BENCH_BEFORE_STEP against headers without the one-call step, both rows time the
// per-layer path (the "before" of bench/RESULTS.md).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvsift/backend/device_backend.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "real_tokens.hpp"

using namespace kvsift;

namespace {

constexpr int kLayers = 32;
constexpr int kHeads = 8;
constexpr std::int64_t kPrompt = 16384;  // tokens per sequence before the first compression
constexpr int kBuffer = 128;
constexpr int kWindow = 8;
constexpr std::int64_t kHidden = 16;  // small: the step's cost, not the embeddings', is measured

// Real R1-Qwen token ids (MATH-500 prompts and solutions back to back), long enough for every
// sequence to start at its own offset.
const std::vector<std::int32_t>& real_stream() {
  static const std::vector<std::int32_t> stream = [] {
    std::vector<std::int32_t> ids = bench::read_math500_r1qwen_tokens();
    if (ids.empty()) {  // no data: a delimiter every 24 tokens
      ids.assign(24 * 1024, 1000);
      for (std::size_t i = 23; i < ids.size(); i += 24) ids[i] = 271;
    }
    return ids;
  }();
  return stream;
}

// The kept candidates of row (b, h) out of n: k slots spread evenly, shifted per row so heads
// differ (64 shifts); strictly ascending because n >= k. Then the window. The 64 patterns are
// computed once per (n, k) and copied, so a row costs what a download of it would.
class FakeRows {
 public:
  const std::int32_t* row(std::int64_t n, std::int64_t k, std::int64_t b, std::int64_t h) {
    if (n != n_ || k != k_) {
      n_ = n;
      k_ = k;
      patterns_.resize(static_cast<std::size_t>(64 * (k + kWindow)));
      for (std::int64_t p = 0; p < 64; ++p) {
        std::int32_t* out = patterns_.data() + p * (k + kWindow);
        const std::int64_t off = (p * 37) % k;
        for (std::int64_t i = 0; i < k; ++i) out[i] = static_cast<std::int32_t>((i * n + off) / k);
        for (std::int64_t i = 0; i < kWindow; ++i) out[k + i] = static_cast<std::int32_t>(n + i);
      }
    }
    return patterns_.data() + ((h * 8 + b) % 64) * (k + kWindow);
  }

 private:
  std::int64_t n_ = -1, k_ = -1;
  std::vector<std::int32_t> patterns_;
};

KeepPlan fake_plan(const KVCacheView& kv, int budget) {
  std::vector<std::int32_t> src(kv.lengths, kv.lengths + kv.batch()), kept(src);
  for (std::int32_t& k : kept) k = std::min(k, budget);
  KeepPlan plan(kv.batch(), kv.kv_heads(), kv.capacity(), src, kept, kWindow);
  std::vector<std::int32_t> all(static_cast<std::size_t>(budget));
  for (std::int32_t i = 0; i < budget; ++i) all[i] = i;
  FakeRows rows;
  for (std::int64_t b = 0; b < kv.batch(); ++b)
    for (std::int64_t h = 0; h < kv.kv_heads(); ++h)
      plan.append_row(
          src[b] <= budget ? all.data() : rows.row(src[b] - kWindow, budget - kWindow, b, h),
          kept[b]);
  return plan;
}

// A GPU that costs nothing: plans as above, compaction = new lengths.
class NullGpu final : public DeviceBackend {
 public:
  std::size_t compact_workspace_bytes(const KeepPlan&) const override { return 0; }
  void compact(const KVCacheView& kv, const KeepPlan& plan, const ExecContext&) const override {
    for (std::int64_t b = 0; b < kv.batch(); ++b) kv.lengths[b] = plan.kept_length(b);
  }
  std::size_t compact_workspace_bound(const KVCacheView&) const override { return 0; }
  std::size_t rkv_workspace_bytes(const KVCacheView&, const TensorView&,
                                  const RKVConfig&) const override {
    return 0;
  }
  KeepPlan rkv_select(const KVCacheView& kv, const TensorView&, const RKVConfig& cfg,
                      const ExecContext&) const override {
    return fake_plan(kv, cfg.budget);
  }
  std::size_t rkv_step_workspace_bytes(const KVCacheView*, const TensorView*, int,
                                       const RKVConfig&) const override {
    return 0;
  }
  void rkv_compress_step(const KVCacheView*, const TensorView*, int, const RKVConfig&,
                         const ExecContext&) const override {}
  std::size_t skipkv_workspace_bytes(const KVCacheView&, const TensorView&,
                                     const SentenceScorerConfig&,
                                     const SentencePenalties&) const override {
    return 0;
  }
  KeepPlan skipkv_select(const KVCacheView& kv, const TensorView&, const SentenceScorerConfig& cfg,
                         const SentencePenalties& penalties, const ExecContext&) const override {
    benchmark::DoNotOptimize(penalties.data());
    return fake_plan(kv, cfg.rkv.budget);
  }
#ifndef KVSIFT_BENCH_BEFORE_STEP  // defined only to time the code before the one-call step
  std::size_t skipkv_step_workspace_bytes(const KVCacheView*, const TensorView*, int,
                                          const SentenceScorerConfig&,
                                          std::int64_t) const override {
    return 0;
  }
  // The step as the CUDA backend hands it back: kept counts and fixed-stride rows of every layer.
  void skipkv_compress_step(const KVCacheView* layers, const TensorView*, int n,
                            const SentenceScorerConfig& cfg, const StepPenalties& penalties,
                            SkipKVStepRows& out, const ExecContext&) const override {
    benchmark::DoNotOptimize(penalties.ranges.data());
    const KVCacheView& kv = layers[0];
    const int budget = cfg.rkv.budget;
    const std::int64_t rows = kv.batch() * kv.kv_heads();
    out.row_stride = budget;
    out.kept.resize(static_cast<std::size_t>(kv.batch()));
    out.slots.resize(static_cast<std::size_t>(n * rows) * static_cast<std::size_t>(budget));
    FakeRows fake;
    for (int l = 0; l < n; ++l)
      for (std::int64_t b = 0; b < kv.batch(); ++b) {
        const std::int32_t len = kv.length(b);
        out.kept[b] = std::min(len, budget);
        for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
          std::int32_t* row = out.slots.data() + ((l * rows) + b * kv.kv_heads() + h) * budget;
          if (len <= budget) {
            for (std::int32_t i = 0; i < len; ++i) row[i] = i;
          } else {
            std::memcpy(row, fake.row(len - kWindow, budget - kWindow, b, h),
                        static_cast<std::size_t>(budget) * sizeof(std::int32_t));
          }
        }
      }
    for (int l = 0; l < n; ++l)
      for (std::int64_t b = 0; b < kv.batch(); ++b) layers[l].lengths[b] = out.kept[b];
  }
#endif
  void copy_to_host(void* dst, const void* src, std::size_t bytes,
                    const ExecContext&) const override {
    std::memcpy(dst, src, bytes);
  }
};

const NullGpu& null_gpu() {
  static const NullGpu g;
  register_device_backend(&g);
  return g;
}

// One layer's device cache as the host sees it: shapes, strides and lengths; the data pointers
// are distinct fake addresses that nothing dereferences.
struct FakeLayer {
  std::vector<std::int32_t> lengths;
  KVCacheView view;
  FakeLayer(std::int64_t batch, int l) : lengths(static_cast<std::size_t>(batch), 0) {
    const std::uintptr_t base = (std::uintptr_t{1} << 40) + (std::uintptr_t{1} << 32) * l;
    const std::uintptr_t span = static_cast<std::uintptr_t>(batch * kHeads * kPrompt * 2);
    view.keys = TensorView::contiguous(reinterpret_cast<void*>(base), DType::bf16, Device::cuda,
                                       {batch, kHeads, kPrompt, 1});
    view.values = TensorView::contiguous(reinterpret_cast<void*>(base + span), DType::bf16,
                                         Device::cuda, {batch, kHeads, kPrompt, 1});
    view.lengths = lengths.data();
  }
};

struct Fixture {
  std::int64_t batch;
  int budget;
  SkipKV policy;
  std::vector<FakeLayer> layers;
  std::vector<KVCacheView> views;
  std::vector<TensorView> queries;
  std::vector<float> hidden;  // [kPrompt, kHidden], shared by every sequence
  std::int64_t cursor = kPrompt;

  static SkipKVConfig config(std::int64_t batch, int budget) {
    SkipKVConfig c;
    c.batch = batch;
    c.layers = kLayers;
    c.kv_heads = kHeads;
    c.scorer.rkv.budget = budget;
    c.scorer.rkv.window = kWindow;
    c.scorer.rkv.buffer = kBuffer;
    c.sentences.hidden_size = kHidden;
    c.sentences.tau = 0.5f;  // random 16-wide states: a fair share of sentences gets marked
    return c;
  }

  Fixture(std::int64_t b, int bud) : batch(b), budget(bud), policy(config(b, bud)) {
    null_gpu();
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    hidden.resize(static_cast<std::size_t>(kPrompt * kHidden));
    for (float& x : hidden) x = nd(rng);
    for (int l = 0; l < kLayers; ++l) layers.emplace_back(batch, l);
    for (int l = 0; l < kLayers; ++l) views.push_back(layers[l].view);
    queries.assign(kLayers,
                   TensorView::contiguous(reinterpret_cast<void*>(std::uintptr_t{1} << 39),
                                          DType::bf16, Device::cuda, {batch, kHeads, kWindow, 1}));
    observe(0, kPrompt);
    step();  // the prompt's compression: 16K tokens down to the budget
  }

  // `n` more tokens of every sequence, each from its own place in the real stream.
  void observe(std::int64_t from, std::int64_t n) {
    const auto& ids = real_stream();
    std::vector<std::int32_t> tok(static_cast<std::size_t>(n));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t i = 0; i < n; ++i)
        tok[i] = ids[static_cast<std::size_t>(b * 5003 + from + i) % ids.size()];
      const std::int64_t row0 = from % (kPrompt - n + 1);
      const TensorView h = TensorView::contiguous(hidden.data() + row0 * kHidden, DType::f32,
                                                  Device::cpu, {n, kHidden});
      policy.observe(b, tok.data(), n, h);
    }
    for (FakeLayer& l : layers)
      for (std::int32_t& len : l.lengths) len += static_cast<std::int32_t>(n);
  }
  // The one-call step (SkipKV::compress_step), or the per-layer path (select + compact of every
  // layer, Policy's default) when `per_layer`.
  void step(bool per_layer = false) {
    if (per_layer) {  // before the one-call step, both were this
      policy.Policy::compress_step(views.data(), queries.data(), kLayers, ExecContext{});
    } else {
      policy.compress_step(views.data(), queries.data(), kLayers, ExecContext{});
    }
  }
  // Mapped penalty ranges of layer 0, all rows: how much bookkeeping a step carries.
  std::int64_t penalty_ranges() const {
    std::int64_t n = 0;
    const SegmentTable& t = policy.segments(0);
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < kHeads; ++h)
        n += static_cast<std::int64_t>(
            t.penalty_ranges(0, b, h, policy.tracker(b).sentences()).size());
    return n;
  }
};

// range(0) batch, range(1) budget, range(2) 1: the per-layer path.
void BM_SkipKVStep(benchmark::State& state) {
  Fixture f(state.range(0), static_cast<int>(state.range(1)));
  for (auto _ : state) {
    state.PauseTiming();
    f.observe(f.cursor, kBuffer);
    f.cursor += kBuffer;
    state.ResumeTiming();
    f.step(state.range(2) != 0);
  }
  state.counters["pen_ranges_per_row"] =
      static_cast<double>(f.penalty_ranges()) / static_cast<double>(f.batch * kHeads);
  state.counters["sentences_per_seq"] = static_cast<double>(f.policy.tracker(0).num_sentences());
}
BENCHMARK(BM_SkipKVStep)
    ->ArgsProduct({{64, 432}, {1024, 2048}, {0, 1}})
    ->Iterations(4)
    ->Unit(benchmark::kMillisecond);

// What the fake GPU itself costs per step: the plan rows of every layer, nothing else.
void BM_FakeRowsOnly(benchmark::State& state) {
  const std::int64_t batch = state.range(0);
  const int budget = static_cast<int>(state.range(1));
  FakeLayer layer(batch, 0);
  for (std::int32_t& len : layer.lengths) len = budget + kBuffer;
  for (auto _ : state)
    for (int l = 0; l < kLayers; ++l) benchmark::DoNotOptimize(fake_plan(layer.view, budget));
}
BENCHMARK(BM_FakeRowsOnly)
    ->Args({64, 1024})
    ->Args({64, 2048})
    ->Args({432, 1024})
    ->Args({432, 2048})
    ->Iterations(4)
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
