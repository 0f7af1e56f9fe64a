// Every registered method through one generic decode loop, twice in lockstep: once on host views
// (the CPU reference) and once on device views (the CUDA backend, reached through the same
// Policy interface) of the same left-padded batch, which becomes ragged after the first
// compression (pads are not kept). At every trigger the device plan must equal the host plan, and
// at the end the device cache must equal the host cache bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/policy/registry.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr int kLayers = 2, kBatch = 3, kKvHeads = 2, kQHeads = 4, kHeadDim = 64;
constexpr int kBudget = 64, kBuffer = 16, kWindow = 8, kPrompt = 48, kSteps = 120;
constexpr int kCapacity = kPrompt + kSteps;  // FullKV never compresses
constexpr int kPads[kBatch] = {0, 12, 5};    // left pads of each prompt
constexpr std::int32_t kDelimiter = 271;     // "\n\n" in the R1-Distill-Qwen vocabulary

// The same budget for every method, in the keys its config knows.
std::string config_for(const std::string& name) {
  if (name == "fullkv") return "{}";
  if (name == "streaming" || name == "h2o") return R"({"budget": 64, "buffer": 16})";
  // Each method takes the keys its config has (LazyEviction: budget and window, no buffer).
  return filter_config(name, R"({"budget": 64, "buffer": 16, "window": 8})");
}

// One layer's cache in both places: host vectors and their device mirror.
struct LayerCache {
  std::vector<bf16_t> keys, values;  // [batch, kv_heads, capacity, head_dim]
  DeviceBuffer<bf16_t> dkeys, dvalues;
  LayerCache()
      : keys(std::size_t(kBatch) * kKvHeads * kCapacity * kHeadDim),
        values(keys.size()),
        dkeys(keys.size()),
        dvalues(keys.size()) {}
};

struct Loop {
  std::vector<std::unique_ptr<LayerCache>> layers;
  // [layers][batch]: every layer's view has its own lengths (compact() rewrites them layer by
  // layer), host and device apart.
  std::vector<std::vector<std::int32_t>> host_lengths, device_lengths;
  // [layers][batch, capacity]: the pad mask, also per layer since compact() rewrites it.
  std::vector<std::vector<std::uint8_t>> host_mask;
  std::vector<std::unique_ptr<DeviceBuffer<std::uint8_t>>> device_mask;
  // [layers][batch, q_heads, window, head_dim] the last W queries, host and device
  std::vector<std::vector<bf16_t>> window;
  std::vector<std::unique_ptr<DeviceBuffer<bf16_t>>> dwindow;
  std::mt19937 rng{7};

  Loop()
      : host_lengths(kLayers, std::vector<std::int32_t>(kBatch, 0)),
        device_lengths(host_lengths),
        host_mask(kLayers, std::vector<std::uint8_t>(std::size_t(kBatch) * kCapacity, 1)) {
    for (int l = 0; l < kLayers; ++l) {
      layers.push_back(std::make_unique<LayerCache>());
      window.emplace_back(std::size_t(kBatch) * kQHeads * kWindow * kHeadDim);
      dwindow.push_back(std::make_unique<DeviceBuffer<bf16_t>>(window.back().size()));
    }
    for (int l = 0; l < kLayers; ++l) {
      for (int b = 0; b < kBatch; ++b)
        for (int i = 0; i < kPads[b]; ++i) host_mask[l][std::size_t(b) * kCapacity + i] = 0;
      device_mask.push_back(std::make_unique<DeviceBuffer<std::uint8_t>>(host_mask[l]));
    }
  }

  KVCacheView host_view(int l) {
    return make_kv_cache_view(layers[l]->keys.data(), layers[l]->values.data(), DType::bf16,
                              Device::cpu, kBatch, kKvHeads, kCapacity, kHeadDim,
                              host_lengths[l].data(), host_mask[l].data());
  }
  KVCacheView device_view(int l) {
    return make_kv_cache_view(layers[l]->dkeys.get(), layers[l]->dvalues.get(), DType::bf16,
                              Device::cuda, kBatch, kKvHeads, kCapacity, kHeadDim,
                              device_lengths[l].data(), device_mask[l]->get());
  }
  TensorView queries(int l, bool device) {
    void* p = device ? static_cast<void*>(dwindow[l]->get()) : window[l].data();
    return TensorView::contiguous(p, DType::bf16, device ? Device::cuda : Device::cpu,
                                  {kBatch, kQHeads, kWindow, kHeadDim});
  }

  // Writes `n` new random rows at each sequence's end in every layer (host and device alike)
  // and shifts the new queries into the window. Keys share a direction per head so that some
  // cosines pass R-KV's threshold.
  void append(int n) {
    std::normal_distribution<float> nd;
    for (int l = 0; l < kLayers; ++l) {
      LayerCache& c = *layers[l];
      for (int b = 0; b < kBatch; ++b)
        for (int h = 0; h < kKvHeads; ++h)
          for (int i = 0; i < n; ++i) {
            const std::size_t row =
                ((std::size_t(b) * kKvHeads + h) * kCapacity + host_lengths[l][b] + i) * kHeadDim;
            const float shared = nd(rng);
            for (int d = 0; d < kHeadDim; ++d) {
              c.keys[row + d] = from_float<bf16_t>(nd(rng) + (d % 7 == 0 ? 2.0f * shared : 0.0f));
              c.values[row + d] = from_float<bf16_t>(nd(rng));
            }
          }
      std::vector<bf16_t>& w = window[l];
      for (std::size_t r = 0; r < std::size_t(kBatch) * kQHeads; ++r) {
        bf16_t* q = w.data() + r * kWindow * kHeadDim;
        std::memmove(q, q + kHeadDim, std::size_t(kWindow - 1) * kHeadDim * sizeof(bf16_t));
        for (int d = 0; d < kHeadDim; ++d)
          q[std::size_t(kWindow - 1) * kHeadDim + d] = from_float<bf16_t>(nd(rng));
      }
    }
    for (int l = 0; l < kLayers; ++l)
      for (int b = 0; b < kBatch; ++b) {
        host_lengths[l][b] += n;
        device_lengths[l][b] += n;
      }
    sync_to_device();
  }

  // The device copy of the rows the host holds (the device rows are only ever written here and
  // by device compaction, which the test compares before it copies again).
  void sync_to_device() {
    for (int l = 0; l < kLayers; ++l) {
      layers[l]->dkeys.upload(layers[l]->keys);
      layers[l]->dvalues.upload(layers[l]->values);
      dwindow[l]->upload(window[l]);
      device_mask[l]->upload(host_mask[l]);
    }
  }
};

void expect_same_plan(const KeepPlan& host, const KeepPlan& device, const std::string& where) {
  INFO(where);
  REQUIRE(device.kept_lengths() == host.kept_lengths());
  REQUIRE(device.indptr() == host.indptr());
  REQUIRE(device.slots() == host.slots());
}

// Cache rows [0, length) of every (sequence, head) agree bit for bit.
void expect_same_cache(Loop& loop, const std::string& where) {
  INFO(where);
  REQUIRE(loop.device_lengths == loop.host_lengths);
  for (int l = 0; l < kLayers; ++l) {
    REQUIRE(loop.device_mask[l]->download() == loop.host_mask[l]);
    const std::vector<bf16_t> k = loop.layers[l]->dkeys.download();
    const std::vector<bf16_t> v = loop.layers[l]->dvalues.download();
    for (int b = 0; b < kBatch; ++b)
      for (int h = 0; h < kKvHeads; ++h) {
        const std::size_t row0 = ((std::size_t(b) * kKvHeads + h) * kCapacity) * kHeadDim;
        const std::size_t n = std::size_t(loop.host_lengths[l][b]) * kHeadDim * sizeof(bf16_t);
        REQUIRE(std::memcmp(k.data() + row0, loop.layers[l]->keys.data() + row0, n) == 0);
        REQUIRE(std::memcmp(v.data() + row0, loop.layers[l]->values.data() + row0, n) == 0);
      }
  }
}

// One observation of the step's tokens (prompt: all of them with their pads; decode: one).
Observation token_observation(const std::vector<std::int32_t>& ids, int n, const int* pads,
                              const KVCacheView& any_layer) {
  Observation o;
  o.layer = -1;
  o.kv = any_layer;  // says the batch
  o.token_ids = ids.data();
  o.num_tokens = n;
  o.pad_counts = pads;
  return o;
}

void run_method(const MethodInfo& m) {
  const std::string name(m.name);
  std::unique_ptr<Policy> host = make_policy(name, config_for(name));
  std::unique_ptr<Policy> device = make_policy(name, config_for(name));
  Loop loop;
  std::mt19937 ids_rng(11);
  auto token = [&](int i) { return i % 9 == 8 ? kDelimiter : std::int32_t(ids_rng() % 5000); };

  // The prompt: kPrompt positions per sequence, its first kPads[b] are pads.
  loop.append(kPrompt);
  std::vector<std::int32_t> prompt(std::size_t(kBatch) * kPrompt);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = token(int(i % kPrompt));
  int pads[kBatch];
  std::copy(kPads, kPads + kBatch, pads);
  host->observe(token_observation(prompt, kPrompt, pads, loop.host_view(0)));
  device->observe(token_observation(prompt, kPrompt, pads, loop.device_view(0)));

  std::vector<std::unique_ptr<DeviceBuffer<std::uint8_t>>> workspaces;
  int triggers = 0;
  for (int step = 0; step < kSteps; ++step) {
    // The prompt's rows were written above; decode appends one row per step.
    loop.append(1);
    std::vector<std::int32_t> ids(kBatch);
    for (auto& t : ids) t = token(step);
    host->observe(token_observation(ids, 1, nullptr, loop.host_view(0)));
    device->observe(token_observation(ids, 1, nullptr, loop.device_view(0)));
    for (int l = 0; l < kLayers; ++l) {
      Observation oh, od;
      oh.layer = od.layer = l;
      oh.kv = loop.host_view(l);
      od.kv = loop.device_view(l);
      // [batch, q_heads, 1, head_dim]: the step's query is the window's last row.
      oh.queries = loop.queries(l, false);
      od.queries = loop.queries(l, true);
      oh.queries.shape[2] = od.queries.shape[2] = 1;
      oh.queries.data = static_cast<bf16_t*>(oh.queries.data) + (kWindow - 1) * kHeadDim;
      od.queries.data = static_cast<bf16_t*>(od.queries.data) + (kWindow - 1) * kHeadDim;
      host->observe(oh);
      device->observe(od);
    }
    const bool fire = host->should_compress(loop.host_view(0));
    REQUIRE(device->should_compress(loop.device_view(0)) == fire);
    if (!fire) continue;
    ++triggers;
    for (int l = 0; l < kLayers; ++l) {
      StepInputs hin{l, loop.host_view(l), loop.queries(l, false)};
      StepInputs din{l, loop.device_view(l), loop.queries(l, true)};
      const KeepPlan hplan = host->select(hin);
      const std::size_t bytes = device->workspace_bytes(din);
      workspaces.push_back(std::make_unique<DeviceBuffer<std::uint8_t>>(bytes));
      const KeepPlan dplan =
          device->select(din, ExecContext{workspaces.back()->get(), bytes, nullptr});
      expect_same_plan(
          hplan, dplan,
          name + " layer " + std::to_string(l) + " trigger " + std::to_string(triggers));
      compact(hin.kv, hplan);
      const std::size_t cbytes = device_backend().compact_workspace_bytes(dplan);
      workspaces.push_back(std::make_unique<DeviceBuffer<std::uint8_t>>(cbytes));
      compact(din.kv, dplan, ExecContext{workspaces.back()->get(), cbytes, nullptr});
    }
    expect_same_cache(loop, name + " after trigger " + std::to_string(triggers));
    loop.sync_to_device();
  }
  if (name != "fullkv") CHECK(triggers >= 3);
  expect_same_cache(loop, name + " at the end");
}

}  // namespace

TEST_CASE("every registered method: device views plan and compact as host views do", "[loop]") {
  REQUIRE(has_device_backend());
  for (const MethodInfo& m : registered_methods()) {
    if (m.owns_cache) continue;  // cache-owning methods keep their own store
    SECTION(std::string(m.name)) { run_method(m); }
  }
}
