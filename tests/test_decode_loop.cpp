// One decode loop, every registered method (registered_methods(): a new method is covered by
// adding its registry line). Host views, ragged prompts with left pads, several layers; every
// step the engine appends K/V, gives the step-level observation (token ids, pads, hidden states)
// and the per-layer ones (cache, queries), asks the trigger once, and at a trigger selects and
// compacts every layer. The test keeps its own record of which generation position sits in
// every cache slot and of every K/V row it generated, and checks after each compaction:
//   - the plan validates, matches the cache, and keeps everything when no sequence is over budget;
//   - the plan's window (its last plan.window() slots) holds the newest positions;
//   - compacted rows are exactly the generated rows of the positions kept (bit for bit);
//   - no pad survives a compression; lengths stay within [budget, budget + buffer) once a
//     sequence was compressed (at least its real tokens when fewer than the budget), and never
//     reach budget + buffer at a step's end;
//   - R-KV: every kept scored token outscores every dropped one under cpu::rkv_scores.
// Cache-owning methods (ThinKV, KIVI, PM-KVQ) are driven through their own loop: append, observe,
// attention, end_step, with the resident positions and memory checked.
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
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/registry.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

constexpr int kBatch = 3, kLayers = 2, kKvHeads = 2, kGroup = 2, kDim = 8, kHidden = 16;
constexpr int kBudget = 24, kWindow = 4, kBuffer = 8, kSteps = 70;
constexpr int kQHeads = kKvHeads * kGroup;
const std::vector<int> kPrompt = {14, 9, 6};  // real prompt tokens per sequence
constexpr int kPromptSlots = 14;              // left-padded prompt width
constexpr int kCapacity = kPromptSlots + kSteps;

// The shared knobs, each method taking the keys its config has.
std::string loop_config(const MethodInfo& m) {
  const nlohmann::json shared = {{"budget", kBudget}, {"window", kWindow},
                                 {"buffer", kBuffer}, {"kernel", 3},
                                 {"sink", 2},         {"hidden_size", kHidden}};
  return filter_config(m.name, shared.dump());
}

// An engine's caches and what it generated, fp32, [layer][batch, kv_heads, capacity, head_dim].
struct Engine {
  std::mt19937 rng{77};
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::vector<std::vector<float>> keys, values;      // the caches
  std::vector<std::vector<float>> gen_k, gen_v;      // every generated row, by generation position
  std::vector<std::vector<std::int32_t>> lengths;    // [layer][batch]
  std::vector<std::vector<std::uint8_t>> masks;      // [layer][batch * capacity]
  std::vector<std::vector<std::int32_t>> positions;  // [layer][(b * kv_heads + h) * capacity + i]
  std::vector<std::vector<float>> window_q;          // [layer][batch, q_heads, W, D] last W queries
  std::vector<std::int32_t> generated = std::vector<std::int32_t>(kBatch, 0);  // per sequence

  Engine() {
    const std::size_t n = static_cast<std::size_t>(kBatch) * kKvHeads * kCapacity * kDim;
    keys.assign(kLayers, std::vector<float>(n));
    values = gen_k = gen_v = keys;
    lengths.assign(kLayers, std::vector<std::int32_t>(kBatch, 0));
    masks.assign(kLayers, std::vector<std::uint8_t>(kBatch * kCapacity, 1));
    positions.assign(kLayers, std::vector<std::int32_t>(kBatch * kKvHeads * kCapacity, -1));
    window_q.assign(kLayers, std::vector<float>(kBatch * kQHeads * kWindow * kDim));
    for (auto& w : window_q)
      for (float& x : w) x = normal(rng);
  }
  static std::size_t row(int b, int h, int slot) {
    return ((static_cast<std::size_t>(b) * kKvHeads + h) * kCapacity + slot) * kDim;
  }
  KVCacheView view(int l) {
    return make_kv_cache_view(keys[l].data(), values[l].data(), DType::f32, Device::cpu, kBatch,
                              kKvHeads, kCapacity, kDim, lengths[l].data(), masks[l].data());
  }
  TensorView queries(int l) {
    return TensorView::contiguous(window_q[l].data(), DType::f32, Device::cpu,
                                  {kBatch, kQHeads, kWindow, kDim});
  }
  // Appends `n` tokens to every sequence of every layer; the first pads[b] of sequence b are pads.
  void append(int n, const std::vector<int>& pads) {
    for (int l = 0; l < kLayers; ++l)
      for (int b = 0; b < kBatch; ++b)
        for (int t = 0; t < n; ++t) {
          const int slot = lengths[l][b] + t, pos = generated[b] + t;
          masks[l][b * kCapacity + slot] = t < pads[b] ? 0 : 1;
          for (int h = 0; h < kKvHeads; ++h) {
            for (int d = 0; d < kDim; ++d) {
              gen_k[l][row(b, h, pos) + d] = keys[l][row(b, h, slot) + d] = normal(rng);
              gen_v[l][row(b, h, pos) + d] = values[l][row(b, h, slot) + d] = normal(rng);
            }
            positions[l][(b * kKvHeads + h) * kCapacity + slot] = pos;
          }
        }
    for (int l = 0; l < kLayers; ++l)
      for (int b = 0; b < kBatch; ++b) lengths[l][b] += n;
    for (int b = 0; b < kBatch; ++b) generated[b] += n;
  }
  // The step's queries of layer l, [batch, q_heads, n, D]; the last one joins the window.
  std::vector<float> step_queries(int l, int n) {
    std::vector<float> q(static_cast<std::size_t>(kBatch) * kQHeads * n * kDim);
    for (float& x : q) x = normal(rng);
    auto& w = window_q[l];
    for (int b = 0; b < kBatch; ++b)
      for (int h = 0; h < kQHeads; ++h) {
        float* win = &w[((b * kQHeads + h) * kWindow) * kDim];
        std::memmove(win, win + kDim, (kWindow - 1) * kDim * sizeof(float));
        std::memcpy(win + (kWindow - 1) * kDim, &q[((b * kQHeads + h) * n + n - 1) * kDim],
                    kDim * sizeof(float));
      }
    return q;
  }
};

// Random token ids with R1-Qwen's "\n" (198) now and then, so SkipKV closes sentences.
std::vector<std::int32_t> step_tokens(std::mt19937& rng, int n) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(kBatch) * n);
  for (auto& id : ids) id = rng() % 7 == 0 ? 198 : static_cast<std::int32_t>(1000 + rng() % 50);
  return ids;
}

// Observes one step (prompt or decode) of n tokens the way an engine does.
void observe_step(Policy& p, Engine& e, std::mt19937& rng, int n, const std::vector<int>& pads) {
  std::vector<std::int32_t> ids = step_tokens(rng, n);
  std::vector<float> hidden(static_cast<std::size_t>(kBatch) * n * kHidden);
  for (float& x : hidden) x = e.normal(e.rng);
  std::vector<std::int32_t> pad_counts(pads.begin(), pads.end());
  Observation step;
  step.token_ids = ids.data();
  step.num_tokens = n;
  step.pad_counts = pad_counts.data();
  step.last_hidden =
      TensorView::contiguous(hidden.data(), DType::f32, Device::cpu, {kBatch, n, kHidden});
  p.observe(step);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> q = e.step_queries(l, n);
    Observation layer;
    layer.layer = l;
    layer.kv = e.view(l);
    layer.queries =
        TensorView::contiguous(q.data(), DType::f32, Device::cpu, {kBatch, kQHeads, n, kDim});
    p.observe(layer);
  }
}

// R-KV's selection property under an independent call of the CPU scorer.
void check_rkv_top_scores(const KVCacheView& kv, const TensorView& q, const KeepPlan& plan) {
  RKVConfig cfg;
  cfg.budget = kBudget;
  cfg.window = kWindow;
  cfg.buffer = kBuffer;
  cfg.kernel = 3;
  cfg.sink = 2;  // loop_config's
  const RKVScores s = cpu::rkv_scores(kv, q, cfg);
  // The plan is exactly the CPU reference's selection over these scores...
  const KeepPlan direct = cpu::plan_from_scores(kv, &s.score, cfg.selection());
  CHECK(direct.slots() == plan.slots());
  CHECK(direct.kept_lengths() == plan.kept_lengths());
  // ...and keeps the best scores (checked without the selection code).
  for (int b = 0; b < kBatch; ++b) {
    if (plan.kept_length(b) == plan.source_length(b)) continue;
    for (int h = 0; h < kKvHeads; ++h) {
      std::vector<bool> kept(kv.length(b), false);
      for (std::int64_t i = 0; i < plan.row_size(b, h); ++i) kept[plan.row(b, h)[i]] = true;
      float min_kept = 1e30f, max_dropped = -1e30f;
      int sinks = 0;  // the first `sink` real tokens are kept whatever their score
      for (int j = 0; j < s.score.count(b); ++j) {
        if (!kv.is_valid(b, j) || sinks++ < cfg.sink) continue;
        float v = s.score.at(b, h, j);
        if (kept[j])
          min_kept = std::min(min_kept, v);
        else
          max_dropped = std::max(max_dropped, v);
      }
      INFO("b " << b << " h " << h);
      CHECK(min_kept >= max_dropped);
    }
  }
}

void run_policy_loop(const MethodInfo& m) {
  INFO("method " << m.name);
  std::unique_ptr<Policy> p = make_policy(m.name, loop_config(m));
  REQUIRE(p->name() == m.name);
  Engine e;
  std::mt19937 rng(5);
  std::vector<int> pads(kBatch);
  for (int b = 0; b < kBatch; ++b) pads[b] = kPromptSlots - kPrompt[b];
  e.append(kPromptSlots, pads);
  observe_step(*p, e, rng, kPromptSlots, pads);
  // Below budget: a plan keeps everything.
  for (int l = 0; l < kLayers; ++l) {
    const KeepPlan plan = p->select({l, e.view(l), e.queries(l)});
    CHECK(plan.keeps_everything());
    compact(e.view(l), plan);
  }
  std::vector<bool> compressed(kBatch, false);
  const std::vector<int> no_pads(kBatch, 0);
  int triggers = 0;
  for (int step = 0; step < kSteps; ++step) {
    e.append(1, no_pads);
    observe_step(*p, e, rng, 1, no_pads);
    if (!p->should_compress(e.view(0))) {
      // The trigger fires at budget + buffer (FullKV has no budget).
      if (m.name != "fullkv")
        for (int b = 0; b < kBatch; ++b) CHECK(e.lengths[0][b] < kBudget + kBuffer);
      continue;
    }
    ++triggers;
    for (int l = 0; l < kLayers; ++l) {
      KVCacheView kv = e.view(l);
      const KeepPlan plan = p->select({l, kv, e.queries(l)}, ExecContext{});
      plan.validate();
      plan.check_matches(kv);
      if (m.name == "rkv") check_rkv_top_scores(kv, e.queries(l), plan);
      const std::vector<std::int32_t> before = e.positions[l];
      compact(kv, plan, ExecContext{});
      for (int b = 0; b < kBatch; ++b) {
        const bool shrunk = plan.kept_length(b) < plan.source_length(b);
        compressed[b] = compressed[b] || shrunk;
        for (int h = 0; h < kKvHeads; ++h) {
          std::int32_t* pos = &e.positions[l][(b * kKvHeads + h) * kCapacity];
          const std::int32_t* old = &before[(b * kKvHeads + h) * kCapacity];
          for (std::int64_t i = 0; i < plan.row_size(b, h); ++i) pos[i] = old[plan.row(b, h)[i]];
          const int n = e.lengths[l][b];
          // The plan's window holds the newest positions.
          for (int k = 0; k < std::min<int>(plan.window(), n); ++k)
            REQUIRE(pos[n - 1 - k] == e.generated[b] - 1 - k);
          // Every resident row is the row generated at its position; no pad survives a shrink.
          for (int i = 0; i < n; ++i) {
            REQUIRE(std::memcmp(&e.keys[l][Engine::row(b, h, i)],
                                &e.gen_k[l][Engine::row(b, h, pos[i])], kDim * sizeof(float)) == 0);
            REQUIRE(std::memcmp(&e.values[l][Engine::row(b, h, i)],
                                &e.gen_v[l][Engine::row(b, h, pos[i])], kDim * sizeof(float)) == 0);
            if (shrunk) REQUIRE(e.masks[l][b * kCapacity + i] == 1);
          }
        }
        if (compressed[b]) {
          // At least the budget, unless the sequence's real tokens fit it: a compression that
          // only dropped pads (a sequence over budget by its pads; LazyEviction compresses
          // every `window` steps, not at budget + buffer, so it meets that case) keeps them all.
          int real = 0;
          for (int i = 0; i < e.lengths[l][b]; ++i) real += e.masks[l][b * kCapacity + i];
          CHECK(e.lengths[l][b] >= std::min(kBudget, real));
          CHECK(e.lengths[l][b] < kBudget + kBuffer);
        }
      }
    }
  }
  if (m.name == "fullkv") {
    CHECK(triggers == 0);
    for (int b = 0; b < kBatch; ++b) CHECK(e.lengths[0][b] == kPromptSlots + kSteps);
  } else {
    CHECK(triggers >= 3);
    for (int b = 0; b < kBatch; ++b) CHECK(compressed[b]);
  }
}

void run_cache_owning_loop(const MethodInfo& m) {
  INFO("method " << m.name);
  const nlohmann::json cfg = nlohmann::json::parse(std::string(m.example_config));
  std::unique_ptr<CacheOwningPolicy> p = make_cache_owning_policy(m.name, m.example_config);
  REQUIRE(p->name() == m.name);
  const int layers = cfg.value("num_layers", 1), heads = cfg.value("kv_heads", 1),
            q_heads = cfg.value("q_heads", 1), dim = cfg.value("head_dim", 16);
  const std::int64_t batch = p->batch();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = normal(rng);
    return v;
  };
  const int prompt = 8, steps = 150;
  for (int l = 0; l < layers; ++l) {
    auto k = random(batch * heads * prompt * dim), v = random(batch * heads * prompt * dim);
    p->prefill(
        l, TensorView::contiguous(k.data(), DType::f32, Device::cpu, {batch, heads, prompt, dim}),
        TensorView::contiguous(v.data(), DType::f32, Device::cpu, {batch, heads, prompt, dim}));
  }
  for (int s = 0; s < steps; ++s) {
    for (int l = 0; l < layers; ++l) {
      auto k = random(batch * heads * dim), v = random(batch * heads * dim);
      auto q = random(batch * q_heads * dim);
      std::vector<float> out(q.size());
      p->append(l,
                TensorView::contiguous(k.data(), DType::f32, Device::cpu, {batch, heads, 1, dim}),
                TensorView::contiguous(v.data(), DType::f32, Device::cpu, {batch, heads, 1, dim}));
      Observation obs;
      obs.layer = l;
      obs.queries =
          TensorView::contiguous(q.data(), DType::f32, Device::cpu, {batch, q_heads, 1, dim});
      p->observe(obs);
      p->attention(
          l, obs.queries,
          TensorView::contiguous(out.data(), DType::f32, Device::cpu, {batch, q_heads, 1, dim}));
      for (float x : out) REQUIRE(std::isfinite(x));
    }
    p->end_step();
  }
  const int budget = cfg.value("budget", 1 << 30);
  // Quantizers (KIVI, PM-KVQ) evict nothing with their example configs: every token stays, in
  // fewer bytes. Eviction methods (ThinKV) keep at most their budget plus a refresh interval.
  const bool quantizer = m.family == "quantizer";
  for (int l = 0; l < layers; ++l)
    for (std::int64_t b = 0; b < batch; ++b)
      for (int h = 0; h < heads; ++h) {
        const std::vector<std::int32_t> pos = p->resident_positions(l, b, h);
        REQUIRE(std::is_sorted(pos.begin(), pos.end()));
        REQUIRE(std::adjacent_find(pos.begin(), pos.end()) == pos.end());
        if (quantizer) {
          CHECK(static_cast<int>(pos.size()) == prompt + steps);
          CHECK(pos.front() == 0);
        } else {
          CHECK(static_cast<int>(pos.size()) < prompt + steps);  // something was evicted
          CHECK(static_cast<int>(pos.size()) <= budget + cfg.value("refresh", 128));
        }
        CHECK(pos.back() == prompt + steps - 1);  // the newest token is resident
      }
  CHECK(p->resident_bytes() > 0);
  CHECK(p->resident_bytes() < p->fullkv_fp16_bytes());
  // An fp16 K+V cache of every token: 2 tensors x 2 bytes.
  CHECK(p->fullkv_fp16_bytes() ==
        std::int64_t{layers} * batch * heads * (prompt + steps) * dim * 2 * 2);
  std::int64_t by_layer = 0;
  for (int l = 0; l < layers; ++l) by_layer += p->resident_bytes(l);
  CHECK(by_layer == p->resident_bytes());
}

}  // namespace

TEST_CASE("every registered method survives the generic decode loop", "[decode_loop]") {
  for (const MethodInfo& m : registered_methods()) {
    if (m.owns_cache) {
      run_cache_owning_loop(m);
    } else {
      run_policy_loop(m);
    }
  }
}

TEST_CASE("methods that need observations refuse to select without them", "[decode_loop][errors]") {
  for (const MethodInfo& m : registered_methods()) {
    if (m.owns_cache || m.needs == kNeedsNothing) continue;
    INFO("method " << m.name);
    std::unique_ptr<Policy> p = make_policy(m.name, loop_config(m));
    Engine e;
    e.append(kBudget + kBuffer, std::vector<int>(kBatch, 0));
    REQUIRE(p->should_compress(e.view(0)));
    REQUIRE_THROWS_WITH(p->select({0, e.view(0), e.queries(0)}),
                        Contains("needs observe()") && Contains("layer 0"));
  }
}

TEST_CASE("H2O detects a plan that was never applied", "[decode_loop][errors][h2o]") {
  std::unique_ptr<Policy> p = make_policy("h2o", R"({"budget": 24, "buffer": 8})");
  Engine e;
  std::mt19937 rng(9);
  const std::vector<int> no_pads(kBatch, 0);
  e.append(kBudget + kBuffer, no_pads);
  observe_step(*p, e, rng, kBudget + kBuffer, no_pads);
  const KeepPlan plan = p->select({0, e.view(0), e.queries(0)});
  REQUIRE(plan.kept_length(0) == kBudget);
  // Not compacted: the next step's observation of layer 0 finds the old length plus one.
  e.append(1, no_pads);
  std::vector<float> q(kBatch * kQHeads * kDim, 0.5f);
  Observation obs;
  obs.layer = 0;
  obs.kv = e.view(0);
  obs.queries =
      TensorView::contiguous(q.data(), DType::f32, Device::cpu, {kBatch, kQHeads, 1, kDim});
  REQUIRE_THROWS_WITH(p->observe(obs), Contains("layer 0") && Contains("not applied"));
  // And select() on the stale cache says the same.
  REQUIRE_THROWS_WITH(p->select({0, e.view(0), e.queries(0)}),
                      Contains("accumulator observed 24") && Contains("not applied"));
}

TEST_CASE("cache-owning methods reject mis-shaped tensors, naming them", "[decode_loop][errors]") {
  for (const MethodInfo& m : registered_methods()) {
    if (!m.owns_cache) continue;
    INFO("method " << m.name);
    std::unique_ptr<CacheOwningPolicy> p = make_cache_owning_policy(m.name, m.example_config);
    const std::int64_t batch = p->batch();
    std::vector<float> k(static_cast<std::size_t>(batch * 2 * 1 * 3), 0.5f);
    const TensorView bad =
        TensorView::contiguous(k.data(), DType::f32, Device::cpu, {batch, 2, 1, 3});
    REQUIRE_THROWS_WITH(p->append(0, bad, bad), Contains("head_dim") && Contains("3]"));
    std::vector<float> out(static_cast<std::size_t>(batch * 3), 0.0f);
    REQUIRE_THROWS_WITH(
        p->attention(0, bad,
                     TensorView::contiguous(out.data(), DType::f32, Device::cpu, {batch, 1, 1, 3})),
        Contains("out must be"));
  }
}
