// SkipKV's one-call device step (SkipKV::compress_step on device views, through
// DeviceBackend::skipkv_compress_step) against two oracles, in lockstep over a prompt compression
// and three decode triggers of a left-padded batch (batch 1, 3 and 100):
//   - the per-layer device path (Policy::compress_step: select() then compact() of every layer,
//     the kernels the step reuses): caches, lengths, mask and every range map equal bit for bit;
//   - the CPU step (host views, the reference): equal bit for bit at batch 1 and 3 (as the decode
//     loop test holds every method's device plans to the host's); at batch 100 only the device
//     oracle is asserted, since eq. 6 scores may differ from the CPU's in the last bits and swap
//     near-cut tokens.
// Plus the error paths: a workspace too small leaves every cache untouched, and a NaN key makes
// its sequence stay untouched in every layer while the others are compacted.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr int kLayers = 3, kHeads = 2, kQHeads = 4, kDim = 64, kHidden = 16;
constexpr int kBudget = 64, kWindow = 8, kBuffer = 16, kPrompt = 96, kCapacity = kPrompt;
constexpr std::int32_t kDelimiter = 271, kKeyword = 14190;

SkipKVConfig config(int batch) {
  SkipKVConfig c;
  c.batch = batch;
  c.layers = kLayers;
  c.kv_heads = kHeads;
  c.scorer.rkv.budget = kBudget;
  c.scorer.rkv.window = kWindow;
  c.scorer.rkv.buffer = kBuffer;
  c.sentences.tokens = SentenceTokens{{kDelimiter}, {kKeyword}};
  c.sentences.hidden_size = kHidden;
  c.sentences.tau = 0.2f;  // random 16-wide states: many sentences get marked
  return c;
}

// One path's caches: every layer's keys/values (host vectors, or their device copies), one
// lengths vector per layer and one mask shared by all layers.
struct Caches {
  bool device;
  int batch;
  std::vector<std::vector<bf16_t>> keys, values;  // [layers][batch, heads, capacity, dim]
  std::vector<std::unique_ptr<DeviceBuffer<bf16_t>>> dkeys, dvalues;
  std::vector<std::vector<std::int32_t>> lengths;  // [layers][batch]
  std::vector<std::uint8_t> mask;                  // [batch, capacity]
  std::unique_ptr<DeviceBuffer<std::uint8_t>> dmask;
  std::vector<std::vector<bf16_t>> queries;  // [layers][batch, q_heads, window, dim]
  std::vector<std::unique_ptr<DeviceBuffer<bf16_t>>> dqueries;

  Caches(bool dev, int b)
      : device(dev),
        batch(b),
        keys(kLayers, std::vector<bf16_t>(std::size_t(b) * kHeads * kCapacity * kDim)),
        values(keys),
        lengths(kLayers, std::vector<std::int32_t>(b, 0)),
        mask(std::size_t(b) * kCapacity, 1),
        queries(kLayers, std::vector<bf16_t>(std::size_t(b) * kQHeads * kWindow * kDim)) {
    if (!device) return;
    for (int l = 0; l < kLayers; ++l) {
      dkeys.push_back(std::make_unique<DeviceBuffer<bf16_t>>(keys[l]));
      dvalues.push_back(std::make_unique<DeviceBuffer<bf16_t>>(values[l]));
      dqueries.push_back(std::make_unique<DeviceBuffer<bf16_t>>(queries[l]));
    }
    dmask = std::make_unique<DeviceBuffer<std::uint8_t>>(mask);
  }
  std::vector<KVCacheView> views() {
    std::vector<KVCacheView> v;
    for (int l = 0; l < kLayers; ++l)
      v.push_back(make_kv_cache_view(
          device ? static_cast<void*>(dkeys[l]->get()) : keys[l].data(),
          device ? static_cast<void*>(dvalues[l]->get()) : values[l].data(), DType::bf16,
          device ? Device::cuda : Device::cpu, batch, kHeads, kCapacity, kDim, lengths[l].data(),
          device ? dmask->get() : mask.data()));
    return v;
  }
  std::vector<TensorView> query_views() {
    std::vector<TensorView> v;
    for (int l = 0; l < kLayers; ++l)
      v.push_back(TensorView::contiguous(
          device ? static_cast<void*>(dqueries[l]->get()) : queries[l].data(), DType::bf16,
          device ? Device::cuda : Device::cpu, {batch, kQHeads, kWindow, kDim}));
    return v;
  }
  // The host copy of what the device holds (keys, values, mask).
  void download() {
    if (!device) return;
    for (int l = 0; l < kLayers; ++l) {
      keys[l] = dkeys[l]->download();
      values[l] = dvalues[l]->download();
    }
    mask = dmask->download();
  }
  void upload() {
    if (!device) return;
    for (int l = 0; l < kLayers; ++l) {
      dkeys[l]->upload(keys[l]);
      dvalues[l]->upload(values[l]);
      dqueries[l]->upload(queries[l]);
    }
    dmask->upload(mask);
  }
};

// The same new tokens for every path: `n` random rows at each sequence's end in every layer
// (keys sharing a direction per head, so R-KV's redundancy has matches), new window queries, and
// the tokens' ids and hidden states observed by every policy. Sequence b's first `pads[b]`
// positions of the prompt are pads.
struct Driver {
  int batch;
  std::vector<int> pads;
  std::int64_t position = 0;
  std::mt19937 rng{2024};

  explicit Driver(int b) : batch(b), pads(b) {
    for (int i = 0; i < b; ++i) pads[i] = (i * 5) % 17;
  }

  void append(std::vector<Caches*> paths, std::vector<SkipKV*> policies, int n) {
    std::normal_distribution<float> nd;
    Caches& first = *paths[0];
    for (int l = 0; l < kLayers; ++l) {
      for (int b = 0; b < batch; ++b)
        for (int h = 0; h < kHeads; ++h)
          for (int i = 0; i < n; ++i) {
            const std::size_t row =
                ((std::size_t(b) * kHeads + h) * kCapacity + first.lengths[l][b] + i) * kDim;
            const float shared = nd(rng);
            for (int d = 0; d < kDim; ++d) {
              const bf16_t k = from_float<bf16_t>(nd(rng) + (d % 7 == 0 ? 2.0f * shared : 0.0f));
              const bf16_t v = from_float<bf16_t>(nd(rng));
              for (Caches* c : paths) {
                c->keys[l][row + d] = k;
                c->values[l][row + d] = v;
              }
            }
          }
      for (bf16_t& q : first.queries[l]) q = from_float<bf16_t>(nd(rng));
      for (Caches* c : paths) c->queries[l] = first.queries[l];
    }
    for (int b = 0; b < batch; ++b) {
      const int len = first.lengths[0][b];
      for (int i = 0; i < n; ++i) {
        const bool pad = position == 0 && i < pads[b];
        for (Caches* c : paths) c->mask[std::size_t(b) * kCapacity + len + i] = pad ? 0 : 1;
      }
    }
    for (Caches* c : paths) {
      for (auto& ls : c->lengths)
        for (auto& len : ls) len += n;
      c->upload();
    }
    // Ids: a delimiter every 7th position, a keyword now and then; hidden states random.
    for (int b = 0; b < batch; ++b) {
      const int skip = position == 0 ? pads[b] : 0;
      std::vector<std::int32_t> ids;
      for (std::int64_t p = position + skip; p < position + n; ++p)
        ids.push_back(p % 7 == 6 ? kDelimiter : (p % 23 == 3 ? kKeyword : 1000 + int(p % 50)));
      std::vector<float> hidden(ids.size() * kHidden);
      for (float& x : hidden) x = nd(rng);
      const TensorView hv = TensorView::contiguous(hidden.data(), DType::f32, Device::cpu,
                                                   {std::int64_t(ids.size()), kHidden});
      for (SkipKV* p : policies) {
        if (skip > 0) p->add_padding(b, skip);
        p->observe(b, ids.data(), std::int64_t(ids.size()), hv);
      }
    }
    position += n;
  }
};

// One compression step of a path: a workspace of the size the policy asks for, then the step
// (`per_layer`: Policy's default, select + compact of every layer).
void step(SkipKV& p, Caches& c, bool per_layer) {
  std::vector<KVCacheView> v = c.views();
  std::vector<TensorView> q = c.query_views();
  const std::size_t bytes = per_layer ? p.Policy::step_workspace_bytes(v.data(), q.data(), kLayers)
                                      : p.step_workspace_bytes(v.data(), q.data(), kLayers);
  DeviceBuffer<char> ws(std::max<std::size_t>(bytes, 1));
  const ExecContext ctx{ws.get(), bytes, nullptr};
  if (per_layer) {
    p.Policy::compress_step(v.data(), q.data(), kLayers, ctx);
  } else {
    p.compress_step(v.data(), q.data(), kLayers, ctx);
  }
  c.download();
}

// Rows [0, length) of every (layer, sequence, head) equal, and the masks over every length.
void expect_same_caches(const Caches& a, const Caches& b, const std::string& where) {
  INFO(where);
  REQUIRE(a.lengths == b.lengths);
  for (int s = 0; s < a.batch; ++s)
    REQUIRE(std::memcmp(a.mask.data() + std::size_t(s) * kCapacity,
                        b.mask.data() + std::size_t(s) * kCapacity, a.lengths[0][s]) == 0);
  for (int l = 0; l < kLayers; ++l)
    for (int s = 0; s < a.batch; ++s)
      for (int h = 0; h < kHeads; ++h) {
        const std::size_t row0 = (std::size_t(s) * kHeads + h) * kCapacity * kDim;
        const std::size_t n = std::size_t(a.lengths[l][s]) * kDim * sizeof(bf16_t);
        REQUIRE(std::memcmp(a.keys[l].data() + row0, b.keys[l].data() + row0, n) == 0);
        REQUIRE(std::memcmp(a.values[l].data() + row0, b.values[l].data() + row0, n) == 0);
      }
}

// Every range map equal; returns the penalty ranges the next step will plan with.
std::int64_t expect_same_range_maps(const SkipKV& a, const SkipKV& b, const std::string& where) {
  INFO(where);
  std::int64_t penalties = 0;
  for (int l = 0; l < kLayers; ++l)
    for (std::int64_t s = 0; s < a.batch(); ++s)
      for (std::int64_t h = 0; h < kHeads; ++h) {
        const auto& x = a.segments(l).ranges(0, s, h);
        const auto& y = b.segments(l).ranges(0, s, h);
        REQUIRE(x.size() == y.size());
        for (std::size_t i = 0; i < x.size(); ++i) {
          REQUIRE(x[i].sentence == y[i].sentence);
          REQUIRE(x[i].lo == y[i].lo);
          REQUIRE(x[i].hi == y[i].hi);
        }
        penalties +=
            std::int64_t(a.segments(l).penalty_ranges(0, s, h, a.tracker(s).sentences()).size());
      }
  return penalties;
}

void run_lockstep(int batch) {
  const bool with_cpu = batch <= 3;
  Caches cpu(false, batch), dev_step(true, batch), dev_layer(true, batch);
  SkipKV p_cpu(config(batch)), p_step(config(batch)), p_layer(config(batch));
  Driver drive(batch);
  // The CPU path only where it is compared (it would otherwise never be compacted).
  std::vector<Caches*> paths = {&dev_step, &dev_layer};
  std::vector<SkipKV*> policies = {&p_step, &p_layer};
  if (with_cpu) {
    paths.push_back(&cpu);
    policies.push_back(&p_cpu);
  }
  drive.append(paths, policies, kPrompt);
  std::int64_t penalties = 0;
  for (int trigger = 0; trigger < 4; ++trigger) {
    const std::string where =
        "batch " + std::to_string(batch) + " trigger " + std::to_string(trigger);
    step(p_step, dev_step, false);
    step(p_layer, dev_layer, true);
    if (with_cpu) step(p_cpu, cpu, false);  // host views: SkipKV's per-layer CPU path
    expect_same_caches(dev_layer, dev_step, where + " (device per-layer path)");
    penalties += expect_same_range_maps(p_layer, p_step, where + " (device per-layer path)");
    if (with_cpu) {
      expect_same_caches(cpu, dev_step, where + " (CPU)");
      expect_same_range_maps(p_cpu, p_step, where + " (CPU)");
    }
    for (int l = 0; l < kLayers; ++l)
      for (int s = 0; s < batch; ++s) REQUIRE(dev_step.lengths[l][s] <= kBudget);
    drive.append(paths, policies, kBuffer);
  }
  CHECK(penalties > 0);  // the steps planned with sentence penalties
}

}  // namespace

TEST_CASE("cuda SkipKV one-call step equals select + compact per layer and the CPU",
          "[cuda][skipkv][step]") {
  REQUIRE(has_device_backend());
  SECTION("batch 1") { run_lockstep(1); }
  SECTION("batch 3") { run_lockstep(3); }
  SECTION("batch 100") { run_lockstep(100); }
}

TEST_CASE(
    "cuda SkipKV step: a small workspace leaves every cache untouched; a NaN sequence "
    "stays untouched in every layer",
    "[cuda][skipkv][step][errors]") {
  using Catch::Matchers::Contains;
  const int batch = 3;
  Caches c(true, batch);
  SkipKV p(config(batch));
  Driver drive(batch);
  drive.append({&c}, {&p}, kPrompt);
  std::vector<KVCacheView> v = c.views();
  std::vector<TensorView> q = c.query_views();
  const std::size_t bytes = p.step_workspace_bytes(v.data(), q.data(), kLayers);
  {
    DeviceBuffer<char> ws(bytes);
    const std::vector<std::vector<bf16_t>> keys = c.keys;
    REQUIRE_THROWS_WITH(
        p.compress_step(v.data(), q.data(), kLayers, ExecContext{ws.get(), 16, nullptr}),
        Contains("workspace of 16 bytes is too small"));
    c.download();
    for (int l = 0; l < kLayers; ++l)
      CHECK(std::memcmp(c.keys[l].data(), keys[l].data(), keys[l].size() * sizeof(bf16_t)) == 0);
    for (int l = 0; l < kLayers; ++l) CHECK(c.lengths[l] == std::vector<std::int32_t>(3, kPrompt));
  }
  // A NaN key in sequence 1 of layer 2: every other sequence is compacted in every layer.
  c.keys[2][(std::size_t(1) * kHeads + 0) * kCapacity * kDim + 40 * kDim] =
      from_float<bf16_t>(std::numeric_limits<float>::quiet_NaN());
  c.upload();
  const std::vector<std::vector<bf16_t>> with_nan = c.keys;
  DeviceBuffer<char> ws(bytes);
  REQUIRE_THROWS_WITH(
      p.compress_step(v.data(), q.data(), kLayers, ExecContext{ws.get(), bytes, nullptr}),
      Contains("NaN scores in sequence(s) 1;"));
  c.download();
  const std::size_t seq = std::size_t(kHeads) * kCapacity * kDim;
  for (int l = 0; l < kLayers; ++l) {
    CHECK(c.lengths[l][1] == kPrompt);
    CHECK(c.lengths[l][0] <= kBudget);
    CHECK(std::memcmp(c.keys[l].data() + seq, with_nan[l].data() + seq, seq * sizeof(bf16_t)) == 0);
  }
  // Sequence 1's ranges are its sentences where the uncompacted cache holds them.
  for (int l = 0; l < kLayers; ++l) {
    const auto& r = p.segments(l).ranges(0, 1, 0);
    const auto& s = p.tracker(1).sentences();
    REQUIRE(r.size() == s.size());
    for (std::size_t i = 0; i < r.size(); ++i) {
      CHECK(r[i].lo == s[i].start);
      CHECK(r[i].hi == s[i].end);
    }
  }
}
