// The SkipKV pipeline (docs/algorithms.md §2) driven like an engine drives it: a two-sequence batch
// (one left-padded) over two layers decodes token by token; at every trigger each layer is
// selected and compacted. An oracle tracks, independently of the library, which generation
// position every cache slot of every (layer, sequence, head) holds. Checked: a planted redundant
// sentence is evicted whole at the trigger that marks it, the range maps always describe the
// compacted caches exactly, pads follow the pad mode, steering strength follows N_o, and desyncs
// (a plan not applied, tokens not observed, pads not declared) raise errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"

using namespace kvsift;

namespace {

constexpr std::int64_t kBatch = 2, kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 16, kHidden = 16;
constexpr std::int64_t kCap = 256, kSentenceLen = 8;
constexpr std::int32_t kPlain = 5, kDelim = 1, kKeyword = 7;

SkipKVConfig scenario_config(PadMode mode) {
  SkipKVConfig c;
  c.batch = kBatch;
  c.layers = kLayers;
  c.kv_heads = kHeads;
  c.scorer.rkv.budget = 64;
  c.scorer.rkv.window = 4;
  c.scorer.rkv.buffer = 32;
  c.scorer.pad_mode = mode;
  c.sentences.tokens = SentenceTokens{{kDelim}, {kKeyword}};
  c.sentences.hidden_size = kHidden;
  c.sentences.tau = 0.95f;
  return c;
}

// One sequence's stream: fixed-length sentences, each with a hidden-state direction; a sentence
// that "repeats" an earlier one reuses its direction. Every third sentence is a check sentence.
struct Stream {
  std::int64_t pads = 0;
  std::vector<std::int64_t> direction;        // [sentences] direction id per sentence
  std::int32_t token(std::int64_t i) const {  // i: index after the pads
    const std::int64_t s = i / kSentenceLen, k = i % kSentenceLen;
    if (k == kSentenceLen - 1) return kDelim;
    return (k == 2 && s % 3 == 0) ? kKeyword : kPlain;
  }
  std::int64_t sentence_start(std::int64_t s) const { return pads + s * kSentenceLen; }
};

// Engine side: per layer a contiguous cache with its lengths and mask, plus the oracle.
struct Engine {
  std::vector<std::vector<float>> keys, values;      // [layers][B * H * cap * D]
  std::vector<std::vector<std::int32_t>> lengths;    // [layers][B]
  std::vector<std::vector<std::uint8_t>> masks;      // [layers][B * cap]
  std::vector<std::vector<std::int64_t>> positions;  // [(layer * B + b) * H + h][slot]
  std::mt19937 rng{1234};

  Engine()
      : keys(kLayers, std::vector<float>(kBatch * kHeads * kCap * kDim)),
        values(keys),
        lengths(kLayers, std::vector<std::int32_t>(kBatch, 0)),
        masks(kLayers, std::vector<std::uint8_t>(kBatch * kCap, 0)),
        positions(kLayers * kBatch * kHeads) {}

  KVCacheView view(std::int64_t l) {
    return make_kv_cache_view(keys[l].data(), values[l].data(), DType::f32, Device::cpu, kBatch,
                              kHeads, kCap, kDim, lengths[l].data(), masks[l].data());
  }
  std::vector<std::int64_t>& pos(std::int64_t l, std::int64_t b, std::int64_t h) {
    return positions[(l * kBatch + b) * kHeads + h];
  }
  // Appends one slot for sequence b in every layer: a random key/value, `valid` in the mask.
  void append(std::int64_t b, std::int64_t position, bool valid) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (std::int64_t l = 0; l < kLayers; ++l) {
      const std::int32_t slot = lengths[l][b];
      REQUIRE(slot < kCap);
      for (std::int64_t h = 0; h < kHeads; ++h) {
        for (std::int64_t d = 0; d < kDim; ++d) {
          keys[l][((b * kHeads + h) * kCap + slot) * kDim + d] = n(rng);
          values[l][((b * kHeads + h) * kCap + slot) * kDim + d] = n(rng);
        }
        pos(l, b, h).push_back(position);
      }
      masks[l][b * kCap + slot] = valid ? 1 : 0;
      ++lengths[l][b];
    }
  }
  // The oracle's own remap: slot i of the compacted row holds what slot plan.row[i] held.
  void apply(std::int64_t l, const KeepPlan& plan) {
    for (std::int64_t b = 0; b < kBatch; ++b)
      for (std::int64_t h = 0; h < kHeads; ++h) {
        std::vector<std::int64_t> next;
        for (std::int64_t i = 0; i < plan.row_size(b, h); ++i)
          next.push_back(pos(l, b, h)[plan.row(b, h)[i]]);
        pos(l, b, h) = next;
      }
  }
  bool holds_any(std::int64_t l, std::int64_t b, std::int64_t h, std::int64_t start,
                 std::int64_t end) {
    for (std::int64_t p : pos(l, b, h))
      if (p >= start && p <= end) return true;
    return false;
  }
};

std::vector<float> sentence_directions(std::int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> dirs(n * kHidden);
  for (float& x : dirs) x = g(rng);
  return dirs;
}

// The range map of every (layer, b, h) describes the cache exactly: a mapped sentence's range is
// the set of slots holding its positions; a sentence not mapped has no slot left in that head.
void check_range_maps(const SkipKV& p, Engine& e) {
  for (std::int64_t l = 0; l < kLayers; ++l)
    for (std::int64_t b = 0; b < kBatch; ++b)
      for (std::int64_t h = 0; h < kHeads; ++h) {
        const auto& sentences = p.tracker(b).sentences();
        const auto& ranges = p.segments(static_cast<int>(l)).ranges(0, b, h);
        const std::vector<std::int64_t>& pos = e.pos(l, b, h);
        REQUIRE(static_cast<std::int64_t>(pos.size()) == e.lengths[l][b]);
        std::size_t r = 0;
        for (std::size_t id = 0; id < sentences.size(); ++id) {
          std::vector<std::int64_t> slots;
          for (std::size_t i = 0; i < pos.size(); ++i)
            if (pos[i] >= sentences[id].start && pos[i] <= sentences[id].end) slots.push_back(i);
          INFO("layer " << l << " b " << b << " h " << h << " sentence " << id << " ["
                        << sentences[id].start << ", " << sentences[id].end << "]");
          if (r < ranges.size() && ranges[r].sentence == static_cast<std::int64_t>(id)) {
            REQUIRE(!slots.empty());
            CHECK(slots.front() == ranges[r].lo);
            CHECK(slots.back() == ranges[r].hi);
            CHECK(static_cast<std::int64_t>(slots.size()) == ranges[r].hi - ranges[r].lo + 1);
            ++r;
          } else {
            CHECK(slots.empty());
          }
        }
        CHECK(r == ranges.size());
      }
}

struct Planted {
  std::int64_t b, sentence, repeat;  // sentence `repeat` repeats `sentence` of sequence b
};

void run_scenario(PadMode mode) {
  const SkipKVConfig cfg = scenario_config(mode);
  SkipKV p(cfg);
  Engine e;
  std::mt19937 rng(99);
  Stream streams[kBatch];
  streams[1].pads = 5;
  const std::int64_t sentences = 34;
  std::vector<float> dirs[kBatch];
  for (std::int64_t b = 0; b < kBatch; ++b) {
    dirs[b] = sentence_directions(sentences, rng);
    streams[b].direction.resize(sentences);
    for (std::int64_t s = 0; s < sentences; ++s) streams[b].direction[s] = s;
  }
  // Seq 0: sentence 1 [8, 15] is repeated by sentence 9 (closes at 79, before the first trigger);
  // sentence 13 by sentence 24 (after a few evictions). Seq 1: sentence 2 by sentence 8.
  const Planted planted[] = {{0, 1, 9}, {0, 13, 24}, {1, 2, 8}};
  for (const Planted& pl : planted) streams[pl.b].direction[pl.repeat] = pl.sentence;

  for (std::int64_t b = 0; b < kBatch; ++b) {
    p.add_padding(b, streams[b].pads);
    for (std::int64_t i = 0; i < streams[b].pads; ++i) e.append(b, i, false);
  }
  std::normal_distribution<float> noise(0.0f, 0.05f);
  std::vector<float> queries(kBatch * kQHeads * cfg.scorer.rkv.window * kDim);
  std::vector<bool> evicted_whole(3, false);
  int triggers = 0;
  const std::int64_t steps = sentences * kSentenceLen;
  for (std::int64_t step = 0; step < steps; ++step) {
    for (std::int64_t b = 0; b < kBatch; ++b) {
      const Stream& st = streams[b];
      const std::int32_t tok = st.token(step);
      std::vector<float> hidden(kHidden);
      const float* d = &dirs[b][st.direction[step / kSentenceLen] * kHidden];
      for (std::int64_t k = 0; k < kHidden; ++k) hidden[k] = 3.0f * d[k] + noise(rng);
      e.append(b, st.pads + step, true);
      p.observe(b, &tok, 1,
                TensorView::contiguous(hidden.data(), DType::f32, Device::cpu, {1, kHidden}));
    }
    if (!p.should_compress(e.lengths[0])) continue;
    ++triggers;
    // Which planted sentences are still (partly) present anywhere before this trigger.
    std::vector<bool> present(3, false);
    for (int i = 0; i < 3; ++i) {
      const Planted& pl = planted[i];
      const std::int64_t s0 = streams[pl.b].sentence_start(pl.sentence);
      for (std::int64_t l = 0; l < kLayers; ++l)
        for (std::int64_t h = 0; h < kHeads; ++h)
          present[i] = present[i] || e.holds_any(l, pl.b, h, s0, s0 + kSentenceLen - 1);
    }
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (std::int64_t l = 0; l < kLayers; ++l) {
      for (float& x : queries) x = g(rng);
      StepInputs in{static_cast<int>(l), e.view(l),
                    TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                           {kBatch, kQHeads, cfg.scorer.rkv.window, kDim})};
      const KeepPlan plan = p.select(in);
      compact(in.kv, plan);
      e.apply(l, plan);
    }
    CHECK(p.triggers() == triggers);
    check_range_maps(p, e);
    for (std::int64_t b = 0; b < kBatch; ++b) {
      const std::int64_t real = streams[b].pads + step + 1 - streams[b].pads;
      const std::int64_t held = streams[b].pads + step + 1;
      for (std::int64_t l = 0; l < kLayers; ++l) {
        if (mode == PadMode::exclude) {
          // Pads leave at the first compression of their sequence and never count.
          if (held > cfg.scorer.rkv.budget)
            CHECK(e.lengths[l][b] <= std::min<std::int64_t>(cfg.scorer.rkv.budget, real));
          for (std::int64_t h = 0; h < kHeads; ++h)
            if (held > cfg.scorer.rkv.budget) CHECK(e.pos(l, b, h).front() >= streams[b].pads);
        } else {
          // Force-kept: every pad is still the first slots of every head.
          for (std::int64_t h = 0; h < kHeads; ++h)
            for (std::int64_t i = 0; i < streams[b].pads; ++i) CHECK(e.pos(l, b, h)[i] == i);
        }
      }
    }
    // α = α0 + γ·N_o with N_o the check sentences closed by this trigger (every third one).
    for (std::int64_t b = 0; b < kBatch; ++b) {
      const std::int64_t closed = (step + 1) / kSentenceLen;
      const std::int64_t checks = (closed + 2) / 3;
      CHECK(std::fabs(p.steering_strength(b) - (1.25f + 0.02f * checks)) < 1e-6f);
    }
    for (int i = 0; i < 3; ++i) {
      const Planted& pl = planted[i];
      if (pl.sentence >= p.tracker(pl.b).num_sentences()) continue;  // not closed yet
      const Sentence& s = p.tracker(pl.b).sentences()[pl.sentence];
      if (!s.redundant() || evicted_whole[i]) continue;
      // Marked at this trigger: whatever was left of it is gone from every head of every layer.
      INFO("planted sentence " << pl.sentence << " of sequence " << pl.b << ", trigger "
                               << triggers);
      CHECK(s.lambda > 0.95f);
      for (std::int64_t l = 0; l < kLayers; ++l)
        for (std::int64_t h = 0; h < kHeads; ++h)
          CHECK_FALSE(e.holds_any(l, pl.b, h, s.start, s.end));
      if (i != 1) CHECK(present[i]);  // never evicted before: nothing had touched it yet
      evicted_whole[i] = true;
    }
  }
  CHECK(triggers >= 5);
  for (int i = 0; i < 3; ++i) CHECK(evicted_whole[i]);
  // No sentence other than the planted ones was marked.
  for (std::int64_t b = 0; b < kBatch; ++b)
    CHECK(p.tracker(b).redundant_count() == (b == 0 ? 2 : 1));
}

}  // namespace

TEST_CASE("pipeline: planted redundant sentences are evicted whole, range maps track compact()",
          "[skipkv][pipeline]") {
  SECTION("exclude pads (default)") { run_scenario(PadMode::exclude); }
  SECTION("faithful pads") { run_scenario(PadMode::faithful); }
}

TEST_CASE("pipeline: a plan not applied, tokens not observed, pads not declared all raise",
          "[skipkv][errors]") {
  SkipKVConfig cfg = scenario_config(PadMode::exclude);
  cfg.sentences.hidden_size = 0;
  std::vector<float> queries(kBatch * kQHeads * cfg.scorer.rkv.window * kDim, 0.1f);
  auto q = TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                  {kBatch, kQHeads, cfg.scorer.rkv.window, kDim});
  Engine e;
  SkipKV p(cfg);
  for (std::int64_t b = 0; b < kBatch; ++b)
    for (std::int64_t i = 0; i < 100; ++i) e.append(b, i, true);
  // Only 99 of 100 tokens observed for sequence 1.
  std::vector<std::int32_t> ids(100, kPlain);
  p.observe(0, ids);
  p.observe(1, ids.data(), 99);
  REQUIRE_THROWS_WITH(p.select(StepInputs{0, e.view(0), q}),
                      Catch::Matchers::Contains("sequence 1 holds 100 tokens, expected 99") &&
                          Catch::Matchers::Contains("observe() every token"));
  p.observe(1, ids.data(), 1);
  const KeepPlan plan = p.select(StepInputs{0, e.view(0), q});
  CHECK(plan.kept_length(0) == cfg.scorer.rkv.budget);
  // Not compacted: the next select of layer 0 sees 100 tokens where 64 were planned.
  REQUIRE_THROWS_WITH(
      p.select(StepInputs{0, e.view(0), q}),
      Catch::Matchers::Contains("layer 0 sequence 0 holds 100 tokens, expected 64") &&
          Catch::Matchers::Contains("was the plan applied"));
  // Layer 1 has its own bookkeeping: still uncompressed, so 100 is right there.
  CHECK(p.select(StepInputs{1, e.view(1), q}).kept_length(1) == cfg.scorer.rkv.budget);
  REQUIRE_THROWS_WITH(p.select(StepInputs{2, e.view(1), q}),
                      Catch::Matchers::Contains("layer 2 outside [0, 2)"));

  // Pads in the mask but not declared with add_padding.
  Engine padded;
  SkipKV p2(cfg);
  for (std::int64_t b = 0; b < kBatch; ++b) {
    padded.append(b, 0, b == 0);
    for (std::int64_t i = 1; i < 70; ++i) padded.append(b, i, true);
    p2.observe(b, std::vector<std::int32_t>(70, kPlain));
  }
  REQUIRE_THROWS_WITH(
      p2.select(StepInputs{0, padded.view(0), q}),
      Catch::Matchers::Contains("sequence 1 has 1 pads in valid_mask but add_padding() gave 0"));
  REQUIRE_THROWS_WITH(p2.observe(2, ids),
                      Catch::Matchers::Contains("sequence 2 outside [0, batch = 2)"));
  REQUIRE_THROWS_WITH(p2.steering_strength(-1), Catch::Matchers::Contains("sequence -1 outside"));
}

TEST_CASE("pipeline config: validation names the values", "[skipkv][errors]") {
  SkipKVConfig c;
  c.batch = -1;
  REQUIRE_THROWS_WITH(
      SkipKV(c),
      Catch::Matchers::Contains("batch must be >= 0 (0: from the sequences observed), got -1"));
  c.batch = 0;
  SteeringVector v;
  v.values.assign(4, 1.0f);
  REQUIRE_THROWS_WITH(SkipKV(c, v),
                      Catch::Matchers::Contains("steering needs a fixed batch, config batch is 0"));
  c = SkipKVConfig{};
  c.scorer.rkv.buffer = 4;
  c.scorer.rkv.window = 8;
  REQUIRE_THROWS_WITH(SkipKV(c), Catch::Matchers::Contains("buffer (4) must be >= window (8)"));
  c = SkipKVConfig{};
  c.scorer.rkv.budget = 8;
  REQUIRE_THROWS_WITH(SkipKV(c),
                      Catch::Matchers::Contains("budget (8) must exceed window + sink (8 + 0)"));
  c = SkipKVConfig{};
  c.sentences.tau = 1.5f;
  REQUIRE_THROWS_WITH(SkipKV(c), Catch::Matchers::Contains("tau (1.5)"));
  c = SkipKVConfig{};
  c.sentences.tokens.delimiters.clear();
  REQUIRE_THROWS_WITH(SkipKV(c), Catch::Matchers::Contains("delimiters is empty"));
  c = SkipKVConfig{};
  c.layers = -1;
  REQUIRE_THROWS_WITH(SkipKV(c),
                      Catch::Matchers::Contains("layers must be in [0, 1024] (0: any), got -1"));
  c = SkipKVConfig{};
  c.steering.boundary.clear();
  REQUIRE_THROWS_WITH(SkipKV(c), Catch::Matchers::Contains("boundary"));
  // kv_heads given: a cache with another head count is rejected.
  c = scenario_config(PadMode::exclude);
  c.kv_heads = 4;
  SkipKV p(c);
  Engine e;
  std::vector<float> queries(kBatch * kQHeads * c.scorer.rkv.window * kDim, 0.1f);
  REQUIRE_THROWS_WITH(
      p.select(StepInputs{0, e.view(0),
                          TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                                 {kBatch, kQHeads, c.scorer.rkv.window, kDim})}),
      Catch::Matchers::Contains("cache has 2 kv heads, expected 4"));
}

TEST_CASE("pipeline steering: α updates only at triggers, applied where gated",
          "[skipkv][steering]") {
  SkipKVConfig c = scenario_config(PadMode::exclude);
  c.batch = 1;
  c.sentences.hidden_size = 0;
  c.steering.layer = 3;
  c.steering.think_start = {11};
  c.steering.think_end = {12};
  c.steering.boundary = {kDelim};
  SteeringVector v;
  v.values.assign(kHidden, 1.0f);
  v.layer = 3;
  SkipKV p(c, v);
  REQUIRE(p.has_steering_vector());
  // <think>, a check sentence, another check sentence: N_o = 2 but no trigger yet.
  p.observe(0, {11, kKeyword, kDelim, kPlain, kKeyword, kDelim});
  CHECK(p.steering_strength(0) == 1.25f);
  CHECK(p.tracker(0).check_count() == 2);
  std::vector<float> h(kHidden, 0.0f);
  auto hv = TensorView::contiguous(h.data(), DType::f32, Device::cpu, {1, 1, kHidden});
  CHECK(p.apply_steering(3, hv) == 1);  // inside <think>, last token a boundary
  CHECK(h[0] == 1.25f);
  CHECK(p.apply_steering(2, hv) == 0);  // another layer: untouched
  // A trigger (a select after new tokens) updates α = 1.25 + 0.02 · 2.
  std::vector<float> keys(1 * kHeads * 8 * kDim, 0.5f), values(keys);
  std::vector<std::int32_t> len = {6};
  std::vector<float> queries(1 * kQHeads * c.scorer.rkv.window * kDim, 0.1f);
  p.select(StepInputs{0,
                      make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, 1,
                                         kHeads, 8, kDim, len.data()),
                      TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                             {1, kQHeads, c.scorer.rkv.window, kDim})});
  CHECK(std::fabs(p.steering_strength(0) - 1.29f) < 1e-6f);
  p.observe(0, {kPlain});
  CHECK(p.apply_steering(3, hv) == 0);  // not at a boundary
}

TEST_CASE("pipeline with batch 0 sizes itself from the sequences observed", "[skipkv]") {
  SkipKVConfig cfg = scenario_config(PadMode::exclude);
  cfg.batch = 0;
  cfg.sentences.hidden_size = 0;
  std::vector<float> queries(kBatch * kQHeads * cfg.scorer.rkv.window * kDim, 0.1f);
  auto q = TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                  {kBatch, kQHeads, cfg.scorer.rkv.window, kDim});
  Engine e;
  for (std::int64_t b = 0; b < kBatch; ++b)
    for (std::int64_t i = 0; i < 70; ++i) e.append(b, i, true);
  SkipKV p(cfg);
  CHECK(p.batch() == 0);
  p.observe(1, std::vector<std::int32_t>(70, kPlain));
  CHECK(p.batch() == 2);  // sequence 0 exists too, still empty
  REQUIRE_THROWS_WITH(p.select(StepInputs{0, e.view(0), q}),
                      Catch::Matchers::Contains("sequence 0 holds 70 tokens, expected 0"));
  p.observe(0, std::vector<std::int32_t>(70, kPlain));
  const KeepPlan plan = p.select(StepInputs{0, e.view(0), q});
  CHECK(plan.kept_length(0) == cfg.scorer.rkv.budget);
  CHECK(plan.kept_length(1) == cfg.scorer.rkv.budget);
  // Sized at the first select: a third sequence is now out of range.
  REQUIRE_THROWS_WITH(p.observe(2, {kPlain}),
                      Catch::Matchers::Contains("sequence 2 outside [0, batch = 2)"));
  SkipKV fresh(cfg);
  fresh.observe(0, std::vector<std::int32_t>(70, kPlain));
  REQUIRE_THROWS_WITH(fresh.select(StepInputs{0, e.view(0), q}),
                      Catch::Matchers::Contains("cache batch (2) != sequences observed (1)"));
}

TEST_CASE("pipeline step observations: the batch is read, never guessed", "[skipkv][errors]") {
  SkipKVConfig cfg = scenario_config(PadMode::exclude);
  cfg.batch = 0;
  cfg.sentences.hidden_size = 0;
  const std::vector<std::int32_t> ids(3 * 2, kPlain);  // [batch 3, n 2]
  Observation obs;
  obs.token_ids = ids.data();
  obs.num_tokens = 2;
  SkipKV unknown(cfg);
  // Without batch, kv or hidden states, token_ids [?, 2] could be any number of rows.
  REQUIRE_THROWS_WITH(unknown.observe(obs),
                      Catch::Matchers::Contains("does not say its batch: set Observation.batch"));
  obs.batch = 3;
  SkipKV told(cfg);
  told.observe(obs);
  CHECK(told.batch() == 3);
  for (std::int64_t b = 0; b < 3; ++b) CHECK(told.tracker(b).position() == 2);
}
