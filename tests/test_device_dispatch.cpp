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
  mutable int copies = 0, compacts = 0, rkv_selects = 0, skipkv_selects = 0;

  std::size_t compact_workspace_bytes(const KeepPlan&) const override { return 11; }
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

// Observes a whole cache as one prompt step (token ids, pads) and, per layer 0, its queries.
void observe_prompt(Policy& p, const KVCacheView& kv, const TensorView& q,
                    const std::vector<std::int32_t>& ids, const std::vector<std::int32_t>& pads) {
  Observation step;
  step.kv = kv;
  step.token_ids = ids.data();
  step.num_tokens = kv.length(0);
  step.pad_counts = pads.data();
  p.observe(step);
  Observation layer;
  layer.layer = 0;
  layer.kv = kv;
  layer.queries = q;
  p.observe(layer);
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
    observe_prompt(*host, c.view(), q.view(), ids, pads);
    const KeepPlan want = host->select({0, c.view(), q.view()});

    const int copies = be.copies, rkv = be.rkv_selects, skip = be.skipkv_selects;
    const KVCacheView dkv = as_device(c.view());
    observe_prompt(*dev, dkv, as_device(q.view()), ids, pads);
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
