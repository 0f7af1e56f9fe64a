// Device-view dispatch without a GPU: a fake DeviceBackend, registered by this test, whose
// "device memory" is host memory. Every registered planning method must give a device view the
// same plan as the same cache in host memory; R-KV and SkipKV must go through the backend's
// selection (and report its workspace size), the others through copy_to_host staging; compact()
// with a context must hand device views to the backend.
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
  mutable int copies = 0, compacts = 0, rkv_selects = 0, skipkv_selects = 0, rkv_steps = 0;

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
      const int steps = be.rkv_steps;
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
      } else {  // layer by layer: the larger of the selection's and compaction's scratch
        CHECK(ws == std::max<std::size_t>(13, m.name == "skipkv" ? 5678 : 0));
      }
    }
  }
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
