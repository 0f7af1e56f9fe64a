// Device-view dispatch without a GPU: a fake DeviceBackend, registered by this test, whose
// "device memory" is host memory. Every registered planning method must give a device view the
// same plan as the same cache in host memory; R-KV and SkipKV must go through the backend's
// selection (and report its workspace size), the others through copy_to_host staging; compact()
// with a context must hand device views to the backend.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cpu/rkv_scores.hpp"
#include "kvsift/backend/cpu/sentence_scores.hpp"
#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "random_cache.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using kvsift_test::OwnedTensor;
using kvsift_test::RandomCache;

namespace {

KVCacheView as_host(KVCacheView kv) {
  kv.keys.device = kv.values.device = Device::cpu;
  return kv;
}
TensorView as_host(TensorView t) {
  t.device = Device::cpu;
  return t;
}
KVCacheView as_device(KVCacheView kv) {
  kv.keys.device = kv.values.device = Device::cuda;
  return kv;
}
TensorView as_device(TensorView t) {
  t.device = Device::cuda;
  return t;
}

// Host memory pretending to be device memory; counts what it was asked.
class FakeBackend final : public DeviceBackend {
 public:
  mutable int copies = 0, compacts = 0, rkv_selects = 0, skipkv_selects = 0, rkv_steps = 0,
              skipkv_steps = 0;
  mutable int nan_sequence = -1;
  // The penalty bound of the last skipkv_step_workspace_bytes: the step's CSR must fit in it.
  mutable std::int64_t last_max_ranges =
      -1;  // skipkv_compress_step reports this sequence as NaN once

  std::size_t compact_workspace_bytes(const KeepPlan&) const override { return 11; }
  std::size_t compact_workspace_bound(const KVCacheView&) const override { return 13; }
  std::size_t rkv_step_workspace_bytes(const KVCacheView*, const TensorView*, int,
                                       const RKVConfig&) const override {
    return 4321;
  }
  // The fake's step: every layer planned on the host, then compacted (one mask for all).
  void rkv_compress_step(const KVCacheView* layers, const TensorView* queries, int n,
                         const RKVConfig& cfg, const ExecContext& ctx) const override {
    ++rkv_steps;
    std::vector<KeepPlan> plans;
    for (int l = 0; l < n; ++l) plans.push_back(rkv_select(layers[l], queries[l], cfg, ctx));
    for (int l = 0; l < n; ++l) {
      KVCacheView h = as_host(layers[l]);
      if (l > 0) h.valid_mask = nullptr;
      kvsift::compact(h, plans[static_cast<std::size_t>(l)]);
    }
  }
  void compact(const KVCacheView& kv, const KeepPlan& plan, const ExecContext&) const override {
    REQUIRE(kv.device() == Device::cuda);
    ++compacts;
    kvsift::compact(as_host(kv), plan);
  }
  std::size_t skipkv_step_workspace_bytes(const KVCacheView*, const TensorView*, int,
                                          const SentenceScorerConfig&,
                                          std::int64_t max_ranges) const override {
    last_max_ranges = max_ranges;
    return 8765;
  }
  // The fake's SkipKV step: every layer planned on the host from its rows of the step's CSR (the
  // CPU scorer, as skipkv_select), then every layer compacted (one mask for all); the kept rows
  // handed back in the device layout. `nan_sequence` plays a NaN score: that sequence is left as
  // it was in every layer and reported with kept -1.
  void skipkv_compress_step(const KVCacheView* layers, const TensorView* queries, int n,
                            const SentenceScorerConfig& cfg, const StepPenalties& pen,
                            SkipKVStepRows& out, const ExecContext& ctx) const override {
    ++skipkv_steps;
    const std::int64_t batch = layers[0].batch(), heads = layers[0].kv_heads(),
                       rows = batch * heads;
    REQUIRE(pen.layers == n);
    REQUIRE(pen.indptr.size() == static_cast<std::size_t>(n * rows + 1));
    if (last_max_ranges >= 0)
      CHECK(static_cast<std::int64_t>(pen.ranges.size()) <= last_max_ranges);
    last_max_ranges = -1;  // a bound holds for the step it was asked for
    std::vector<KeepPlan> plans;
    for (int l = 0; l < n; ++l) {
      SentencePenalties lists(static_cast<std::size_t>(rows));
      for (std::int64_t r = 0; r < rows; ++r)
        lists[r].assign(pen.ranges.begin() + pen.indptr[l * rows + r],
                        pen.ranges.begin() + pen.indptr[l * rows + r + 1]);
      plans.push_back(skipkv_select(layers[l], queries[l], cfg, lists, ctx));
      --skipkv_selects;  // not a per-layer call
    }
    const int stride = cfg.rkv.budget;
    out.row_stride = stride;
    out.kept.assign(static_cast<std::size_t>(batch), 0);
    out.slots.assign(static_cast<std::size_t>(n * rows * stride), -7);  // unspecified past kept
    for (int l = 0; l < n; ++l)
      for (std::int64_t b = 0; b < batch; ++b) {
        out.kept[b] = static_cast<std::int32_t>(plans[0].kept_length(b));
        for (std::int64_t h = 0; h < heads; ++h)
          std::copy(plans[l].row(b, h), plans[l].row(b, h) + plans[l].row_size(b, h),
                    out.slots.begin() + (l * rows + b * heads + h) * stride);
      }
    if (nan_sequence >= 0) {
      for (int l = 0; l < n; ++l) {
        std::vector<std::int32_t> src = plans[l].source_lengths(), kept = plans[l].kept_lengths();
        kept[nan_sequence] = src[nan_sequence];
        KeepPlan untouched(batch, heads, layers[l].capacity(), src, kept, plans[l].window());
        for (std::int64_t b = 0; b < batch; ++b)
          for (std::int64_t h = 0; h < heads; ++h) {
            if (b != nan_sequence) {
              untouched.append_row(plans[l].row(b, h), plans[l].row_size(b, h));
              continue;
            }
            std::vector<std::int32_t> all(static_cast<std::size_t>(src[b]));
            for (std::int32_t i = 0; i < src[b]; ++i) all[i] = i;
            untouched.append_row(all);
          }
        plans[l] = untouched;
      }
      out.kept[nan_sequence] = -1;
      nan_sequence = -1;
    }
    for (int l = 0; l < n; ++l) {
      KVCacheView h = as_host(layers[l]);
      if (l > 0) h.valid_mask = nullptr;
      kvsift::compact(h, plans[static_cast<std::size_t>(l)]);
    }
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes,
                    const ExecContext&) const override {
    ++copies;
    std::memcpy(dst, src, bytes);
  }
  std::size_t rkv_workspace_bytes(const KVCacheView&, const TensorView&,
                                  const RKVConfig&) const override {
    return 1234;
  }
  KeepPlan rkv_select(const KVCacheView& kv, const TensorView& q, const RKVConfig& cfg,
                      const ExecContext&) const override {
    REQUIRE(kv.device() == Device::cuda);
    ++rkv_selects;
    const KVCacheView h = as_host(kv);
    return cpu::select_scored_over_budget(h, cfg.selection(), [&](const std::uint8_t* over) {
      return cpu::rkv_scores(h, as_host(q), cfg, over).score;
    });
  }
  std::size_t skipkv_workspace_bytes(const KVCacheView&, const TensorView&,
                                     const SentenceScorerConfig&,
                                     const SentencePenalties&) const override {
    return 5678;
  }
  KeepPlan skipkv_select(const KVCacheView& kv, const TensorView& q,
                         const SentenceScorerConfig& cfg, const SentencePenalties& penalties,
                         const ExecContext&) const override {
    REQUIRE(kv.device() == Device::cuda);
    ++skipkv_selects;
    const KVCacheView h = as_host(kv);
    const std::vector<std::uint8_t> over = cpu::sequences_over_budget(h, cfg.rkv.budget);
    return plan_sentence_scores(
        h, cpu::sentence_scores(h, as_host(q), cfg, penalties, over.data()).score, cfg);
  }
};

FakeBackend& fake() {
  static FakeBackend b;
  register_device_backend(&b);
  return b;
}

// Observes a whole cache as one prompt step (token ids, pads) and, per layer, its queries.
void observe_prompt(Policy& p, const std::vector<KVCacheView>& kv, const std::vector<TensorView>& q,
                    const std::vector<std::int32_t>& ids, const std::vector<std::int32_t>& pads) {
  Observation step;
  step.kv = kv[0];
  step.token_ids = ids.data();
  step.num_tokens = kv[0].length(0);
  step.pad_counts = pads.data();
  p.observe(step);
  for (std::size_t l = 0; l < kv.size(); ++l) {
    Observation layer;
    layer.layer = static_cast<int>(l);
    layer.kv = kv[l];
    layer.queries = q[l];
    p.observe(layer);
  }
}

}  // namespace

TEST_CASE("device views get the host plans, through the backend or host staging",
          "[device][dispatch]") {
  FakeBackend& be = fake();
  std::mt19937 rng(31);
  const int batch = 2, heads = 2, cap = 48, dim = 8, window = 4;
  for (const MethodInfo& m : registered_methods()) {
    if (m.owns_cache) continue;
    INFO("method " << m.name);
    const std::string cfg = filter_config(
        m.name, R"({"budget": 20, "window": 4, "buffer": 8, "kernel": 3, "sink": 2})");
    RandomCache c(DType::f32, batch, heads, cap, dim, rng);
    c.left_pad({3, 0});  // every sequence holds cap tokens, sequence 0 behind 3 pads
    OwnedTensor q(DType::f32, batch, heads * 2, window, dim);
    q.randomize(rng);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(batch) * cap, 1000), pads = {3, 0};

    std::unique_ptr<Policy> host = make_policy(m.name, cfg), dev = make_policy(m.name, cfg);
    observe_prompt(*host, {c.view()}, {q.view()}, ids, pads);
    const KeepPlan want = host->select({0, c.view(), q.view()});

    const int copies = be.copies, rkv = be.rkv_selects, skip = be.skipkv_selects;
    const KVCacheView dkv = as_device(c.view());
    observe_prompt(*dev, {dkv}, {as_device(q.view())}, ids, pads);
    const StepInputs din{0, dkv, as_device(q.view())};
    const KeepPlan got = dev->select(din, ExecContext{});
    CHECK(got.slots() == want.slots());
    CHECK(got.kept_lengths() == want.kept_lengths());
    CHECK(host->workspace_bytes({0, c.view(), q.view()}) == 0);
    if (m.name == "rkv") {
      CHECK(be.rkv_selects == rkv + 1);
      CHECK(dev->workspace_bytes(din) == 1234);
    } else if (m.name == "skipkv") {
      CHECK(be.skipkv_selects == skip + 1);
      CHECK(dev->workspace_bytes(din) == 5678);
    } else if (m.name != "fullkv") {
      CHECK(be.copies > copies);  // staged to the host
    }
  }
}

TEST_CASE("compact(kv, plan, ctx) hands device views to the backend", "[device][dispatch]") {
  FakeBackend& be = fake();
  std::mt19937 rng(5);
  RandomCache c(DType::f32, 1, 2, 16, 4, rng);
  std::vector<std::int32_t> slots = {0, 2, 15};
  KeepPlan plan(1, 2, 16, {16}, {3}, 1);
  plan.append_row(slots);
  plan.append_row(slots);
  const RandomCache before = c;
  const int compacts = be.compacts;
  CHECK(compact_workspace_bytes(as_device(c.view()), plan) == 11);
  CHECK(compact_workspace_bytes(c.view(), plan) == 0);
  compact(as_device(c.view()), plan, ExecContext{});
  CHECK(be.compacts == compacts + 1);
  CHECK(c.lengths[0] == 3);
  CHECK(c.keys.at(0, 1, 1, 2) == before.keys.at(0, 1, 2, 2));
  // Host views stay on the host.
  c.lengths[0] = 16;
  compact(c.view(), KeepPlan::keep_all(c.view()), ExecContext{});
  CHECK(be.compacts == compacts + 1);
  REQUIRE_THROWS_WITH(compact(as_device(c.view()), plan), Contains("compact(kv, plan, ctx)"));
}

// Three layers of one step: their own keys, values, queries and lengths, one shared pad mask.
struct StepCaches {
  std::vector<RandomCache> layers;
  std::vector<OwnedTensor> queries;
  std::vector<std::uint8_t> mask;
  StepCaches(int n, std::mt19937& rng) {
    for (int l = 0; l < n; ++l) {
      layers.emplace_back(DType::f32, 2, 2, 48, 8, rng);
      layers.back().left_pad({3, 0});
      queries.emplace_back(DType::f32, 2, 4, 4, 8);
      queries.back().randomize(rng);
    }
    mask = layers[0].mask;
  }
  std::vector<KVCacheView> views(bool device, bool shared_mask) {
    std::vector<KVCacheView> v;
    for (RandomCache& c : layers) {
      KVCacheView kv = device ? as_device(c.view()) : c.view();
      if (shared_mask) kv.valid_mask = mask.data();
      v.push_back(kv);
    }
    return v;
  }
  std::vector<TensorView> query_views(bool device) {
    std::vector<TensorView> v;
    for (OwnedTensor& q : queries) v.push_back(device ? as_device(q.view()) : q.view());
    return v;
  }
};

TEST_CASE("compress_step equals select + compact layer by layer, host and device views",
          "[device][dispatch][step]") {
  FakeBackend& be = fake();
  const int n = 3;
  for (const MethodInfo& m : registered_methods()) {
    if (m.owns_cache) continue;
    INFO("method " << m.name);
    const std::string cfg = filter_config(
        m.name, R"({"budget": 20, "window": 4, "buffer": 8, "kernel": 3, "sink": 2})");
    std::vector<std::int32_t> ids(2 * 48, 1000), pads = {3, 0};
    for (const bool device : {false, true}) {
      INFO("device views " << device);
      std::mt19937 rng(77);
      StepCaches oracle(n, rng);  // per-layer select + compact, each layer its own mask
      std::mt19937 rng2(77);
      StepCaches stepped(n, rng2);  // one compress_step over a shared mask
      std::unique_ptr<Policy> p1 = make_policy(m.name, cfg), p2 = make_policy(m.name, cfg);
      std::vector<KVCacheView> ov = oracle.views(false, false), sv = stepped.views(device, true);
      std::vector<TensorView> oq = oracle.query_views(false), sq = stepped.query_views(device);
      observe_prompt(*p1, ov, oq, ids, pads);
      observe_prompt(*p2, sv, sq, ids, pads);
      for (int l = 0; l < n; ++l) compact(ov[l], p1->select({l, ov[l], oq[l]}));
      const int steps = be.rkv_steps, skip_steps = be.skipkv_steps;
      const std::size_t ws = p2->step_workspace_bytes(sv.data(), sq.data(), n);
      p2->compress_step(sv.data(), sq.data(), n, ExecContext{});
      for (int l = 0; l < n; ++l) {
        CHECK(stepped.layers[l].lengths == oracle.layers[l].lengths);
        CHECK(stepped.layers[l].keys.bytes == oracle.layers[l].keys.bytes);
        CHECK(stepped.layers[l].values.bytes == oracle.layers[l].values.bytes);
      }
      CHECK(stepped.mask == oracle.layers[0].mask);
      if (!device) {
        CHECK(ws == 0);
      } else if (m.name == "rkv") {  // the backend's one-call step
        CHECK(be.rkv_steps == steps + 1);
        CHECK(ws == 4321);
      } else if (m.name == "skipkv") {  // its own one-call step
        CHECK(be.skipkv_steps == skip_steps + 1);
        CHECK(ws == 8765);
      } else {  // layer by layer: the larger of the selection's and compaction's scratch
        CHECK(ws == 13);
      }
    }
  }
}

// SkipKV with sentences (delimiter id 1 every 6 tokens), embeddings from 4-wide hidden states and
// a low τ, so every step has penalty ranges to plan.
SkipKVConfig sentence_config() {
  SkipKVConfig c;
  c.batch = 2;
  c.layers = 3;
  c.kv_heads = 2;
  c.scorer.rkv.budget = 20;
  c.scorer.rkv.window = 4;
  c.scorer.rkv.buffer = 8;
  c.sentences.tokens = SentenceTokens{{1}, {7}};
  c.sentences.hidden_size = 4;
  c.sentences.tau = 0.2f;
  return c;
}

// The same `n` tokens of both sequences (sequence 0 behind `pads` pads on its first call) to
// every policy; token i of the stream is a delimiter when i % 6 == 5.
void observe_sentences(std::vector<SkipKV*> ps, std::int64_t from, std::int64_t n,
                       std::int64_t pads, std::mt19937& rng) {
  std::normal_distribution<float> g;
  for (std::int64_t b = 0; b < 2; ++b) {
    const std::int64_t skip = b == 0 ? pads : 0;
    std::vector<std::int32_t> ids;
    for (std::int64_t i = from + skip; i < from + n; ++i) ids.push_back(i % 6 == 5 ? 1 : 1000);
    std::vector<float> hidden(ids.size() * 4);
    for (float& x : hidden) x = g(rng);
    const TensorView h = TensorView::contiguous(hidden.data(), DType::f32, Device::cpu,
                                                {static_cast<std::int64_t>(ids.size()), 4});
    for (SkipKV* p : ps) {
      if (skip > 0) p->add_padding(b, skip);
      p->observe(b, ids.data(), static_cast<std::int64_t>(ids.size()), h);
    }
  }
}

// `n` new random tokens at the end of every layer of both caches (same values in both), valid in
// every mask.
void append_tokens(StepCaches& a, StepCaches& b, int n, std::mt19937& rng) {
  std::normal_distribution<float> g;
  for (std::size_t l = 0; l < a.layers.size(); ++l)
    for (std::int64_t s = 0; s < 2; ++s) {
      const std::int64_t len = a.layers[l].lengths[s];
      REQUIRE(b.layers[l].lengths[s] == len);
      for (std::int64_t t = len; t < len + n; ++t) {
        for (std::int64_t h = 0; h < 2; ++h)
          for (std::int64_t d = 0; d < 8; ++d) {
            const float k = g(rng), v = g(rng);
            for (StepCaches* c : {&a, &b}) {
              c->layers[l].keys.set(c->layers[l].keys.index(s, h, t, d), k);
              c->layers[l].values.set(c->layers[l].values.index(s, h, t, d), v);
            }
          }
        a.layers[l].mask[s * 48 + t] = 1;
        b.mask[s * 48 + t] = 1;
      }
      a.layers[l].lengths[s] = b.layers[l].lengths[s] = static_cast<std::int32_t>(len + n);
    }
}

void check_same_range_maps(const SkipKV& want, const SkipKV& got, int layers) {
  for (int l = 0; l < layers; ++l)
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 2; ++h) {
        INFO("layer " << l << " sequence " << b << " head " << h);
        const auto& w = want.segments(l).ranges(0, b, h);
        const auto& g = got.segments(l).ranges(0, b, h);
        REQUIRE(g.size() == w.size());
        for (std::size_t i = 0; i < w.size(); ++i) {
          CHECK(g[i].sentence == w[i].sentence);
          CHECK(g[i].lo == w[i].lo);
          CHECK(g[i].hi == w[i].hi);
        }
      }
}

TEST_CASE("SkipKV's one-call device step equals select + compact per layer, range maps included",
          "[device][dispatch][step][skipkv]") {
  FakeBackend& be = fake();
  const int n = 3;
  std::mt19937 rng(77), rng2(77), obs(5), kv_rng(6);
  StepCaches oracle(n, rng);    // host views, per-layer select + compact, each layer its own mask
  StepCaches stepped(n, rng2);  // device views, one compress_step over a shared mask
  SkipKV host(sentence_config()), dev(sentence_config());
  observe_sentences({&host, &dev}, 0, 48, 3, obs);
  std::int64_t position = 48, penalties_seen = 0;
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    std::vector<KVCacheView> ov = oracle.views(false, false), sv = stepped.views(true, true);
    std::vector<TensorView> oq = oracle.query_views(false), sq = stepped.query_views(true);
    for (int l = 0; l < n; ++l) compact(ov[l], host.select({l, ov[l], oq[l]}));
    const int steps = be.skipkv_steps, selects = be.skipkv_selects;
    CHECK(dev.step_workspace_bytes(sv.data(), sq.data(), n) == 8765);
    dev.compress_step(sv.data(), sq.data(), n, ExecContext{});
    CHECK(be.skipkv_steps == steps + 1);
    CHECK(be.skipkv_selects == selects);
    for (int l = 0; l < n; ++l) {
      CHECK(stepped.layers[l].lengths == oracle.layers[l].lengths);
      CHECK(stepped.layers[l].keys.bytes == oracle.layers[l].keys.bytes);
      CHECK(stepped.layers[l].values.bytes == oracle.layers[l].values.bytes);
    }
    CHECK(stepped.mask == oracle.layers[0].mask);
    check_same_range_maps(host, dev, n);
    for (int l = 0; l < n; ++l)
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t h = 0; h < 2; ++h)
          penalties_seen += static_cast<std::int64_t>(
              dev.segments(l).penalty_ranges(0, b, h, dev.tracker(b).sentences()).size());
    // The next step's tokens: the buffer's worth, observed and appended alike.
    observe_sentences({&host, &dev}, position, 8, 0, obs);
    append_tokens(oracle, stepped, 8, kv_rng);
    position += 8;
  }
  CHECK(penalties_seen > 0);  // the steps did plan with sentence penalties
}

TEST_CASE("SkipKV's device step: a NaN sequence stays untouched everywhere, the range maps agree",
          "[device][dispatch][step][skipkv]") {
  FakeBackend& be = fake();
  const int n = 3;
  std::mt19937 rng(12), obs(8);
  StepCaches c(n, rng);
  SkipKV p(sentence_config());
  observe_sentences({&p}, 0, 48, 3, obs);
  std::vector<KVCacheView> v = c.views(true, true);
  std::vector<TensorView> q = c.query_views(true);
  const StepCaches before = c;
  be.nan_sequence = 1;
  REQUIRE_THROWS_WITH(p.compress_step(v.data(), q.data(), n, ExecContext{}),
                      Contains("NaN scores in sequence(s) 1;"));
  for (int l = 0; l < n; ++l) {
    CHECK(c.layers[l].lengths[0] == 20);  // compacted
    CHECK(c.layers[l].lengths[1] == 48);  // untouched
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t t = 0; t < 48; ++t)
        CHECK(c.layers[l].keys.at(1, h, t, 0) == before.layers[l].keys.at(1, h, t, 0));
  }
  // Sequence 1's ranges are its sentences as they lie in the uncompacted cache.
  const auto& sentences = p.tracker(1).sentences();
  REQUIRE(!sentences.empty());
  for (int l = 0; l < n; ++l) {
    const auto& r = p.segments(l).ranges(0, 1, 0);
    REQUIRE(r.size() == sentences.size());
    for (std::size_t i = 0; i < r.size(); ++i) {
      CHECK(r[i].lo == sentences[i].start);
      CHECK(r[i].hi == sentences[i].end);
    }
  }
  // The maps match the caches: the next step runs (no desync error) and compacts sequence 1.
  p.compress_step(v.data(), q.data(), n, ExecContext{});
  for (int l = 0; l < n; ++l) CHECK(c.layers[l].lengths == std::vector<std::int32_t>{20, 20});
}

TEST_CASE("compress_step leaves every layer untouched when one layer fails", "[dispatch][step]") {
  std::mt19937 rng(4);
  StepCaches c(3, rng);
  const StepCaches before = c;
  std::vector<KVCacheView> v = c.views(false, true);
  std::vector<TensorView> q = c.query_views(false);
  q[2].shape[1] = 3;  // 3 query heads over 2 KV heads: not a GQA grouping
  auto p = make_policy("rkv", R"({"budget": 20, "window": 4, "buffer": 8})");
  REQUIRE_THROWS_WITH(p->compress_step(v.data(), q.data(), 3, ExecContext{}), Contains("q_heads"));
  for (int l = 0; l < 3; ++l) {
    CHECK(c.layers[l].lengths == before.layers[l].lengths);
    CHECK(c.layers[l].keys.bytes == before.layers[l].keys.bytes);
  }
  CHECK(c.mask == before.mask);
  REQUIRE_THROWS_WITH(p->compress_step(v.data(), q.data(), 0, ExecContext{}),
                      Contains("n_layers must be >= 1, got 0"));
}

TEST_CASE("compact_layers refuses a shared mask the layers' plans would compact differently",
          "[dispatch][step]") {
  std::mt19937 rng(9);
  StepCaches c(2, rng);
  std::vector<KVCacheView> v = c.views(false, true);
  // Sequence 0's slots 0..2 are pads: layer 0 keeps pad 0 where layer 1 keeps token 3, so one
  // shared mask cannot describe both results. Sequence 1 keeps everything in both.
  std::vector<std::int32_t> all(48);
  for (int i = 0; i < 48; ++i) all[static_cast<std::size_t>(i)] = i;
  const std::vector<std::int32_t> a = {0, 10, 20, 47}, b = {3, 10, 20, 47};
  KeepPlan p0(2, 2, 48, {48, 48}, {4, 48}, 0), p1(2, 2, 48, {48, 48}, {4, 48}, 0);
  for (int h = 0; h < 2; ++h) p0.append_row(a);
  for (int h = 0; h < 2; ++h) p0.append_row(all);
  for (int h = 0; h < 2; ++h) p1.append_row(b);
  for (int h = 0; h < 2; ++h) p1.append_row(all);
  const KeepPlan plans[2] = {p0, p1};
  const StepCaches before = c;
  REQUIRE_THROWS_WITH(compact_layers(v.data(), plans, 2, ExecContext{}),
                      Contains("share a valid_mask but keep pads at different positions"));
  CHECK(c.layers[0].keys.bytes == before.layers[0].keys.bytes);
  CHECK(c.layers[0].lengths == before.layers[0].lengths);
}

TEST_CASE("without a backend, a device view raises a clear error", "[device][dispatch]") {
  fake();
  register_device_backend(nullptr);
  std::mt19937 rng(2);
  RandomCache c(DType::f32, 1, 1, 40, 4, rng);
  OwnedTensor q(DType::f32, 1, 1, 8, 4);
  auto p = make_policy("snapkv", R"({"budget": 20, "window": 8, "buffer": 8})");
  REQUIRE_THROWS_WITH(p->select({0, as_device(c.view()), as_device(q.view())}),
                      Contains("built without the CUDA backend"));
  fake();  // re-registered for any later test
}
