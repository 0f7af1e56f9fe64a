// SkipKV steering as the reference runs it (docs/algorithms.md §2.5, issue 13): the gate opens on
// ANY paragraph-break id (a token containing "\n\n"), with the R1 lists embedded from the data set;
// α and the redundant-sentence marks are refreshed every 128 decode steps independent of
// compression. These tests fail under the old behaviour (4 delimiter ids; refresh only at
// compression triggers). Also: NaN/inf hidden states and absurd layer indices are errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "kvsift/policy/skipkv/steering.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// The data set's list, read independently of the generated header (the oracle for the presets).
std::vector<std::int32_t> data_ids(const std::string& file) {
  std::ifstream in(std::string(KVSIFT_DATA_DIR) + "/" + file);
  REQUIRE(in.is_open());
  std::vector<std::int32_t> ids;
  for (std::int32_t id; in >> id;) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<std::int32_t> sorted(std::vector<std::int32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

constexpr std::int32_t kThink = 151648;  // "<think>" in R1-Distill-Qwen
constexpr std::int32_t kWait = 14190;    // "Wait": makes a sentence a check sentence
constexpr std::int32_t kNewline = 198;   // "\n": a sentence delimiter, not a paragraph break
constexpr std::int32_t kWord = 1000;     // a plain token

}  // namespace

TEST_CASE("the R1 presets gate on every paragraph-break id of the data set", "[steering]") {
  const auto qwen = data_ids("paragraph_break_ids_r1qwen.txt");
  const auto llama = data_ids("paragraph_break_ids_r1llama.txt");
  REQUIRE(qwen.size() == 565);
  REQUIRE(llama.size() == 588);
  CHECK(sorted(SteeringConfig::r1_qwen_7b().boundary) == qwen);
  CHECK(sorted(SteeringConfig::r1_qwen_14b().boundary) == qwen);
  CHECK(sorted(SteeringConfig::r1_llama_8b().boundary) == llama);
  CHECK(SteeringConfig{}.refresh_steps == 128);
}

TEST_CASE("a \\n\\n-containing id outside the four delimiters opens the gate", "[steering]") {
  SteeringVector v{{1.0f, 2.0f}, 20, "toy"};
  SteeringController qwen(SteeringConfig::r1_qwen_7b(), v, 1);
  // 401 is in the Qwen list but is none of 271 382 692 1939 (the old gate's only ids).
  qwen.observe(0, {kThink, kWord, 401});
  CHECK(qwen.gated(0));
  qwen.observe(0, {kWord});
  CHECK_FALSE(qwen.gated(0));
  const std::vector<std::int32_t> old = {271, 382, 692, 1939};
  int opened = 0;
  for (std::int32_t id : SteeringConfig::r1_qwen_7b().boundary) {
    if (std::find(old.begin(), old.end(), id) != old.end()) continue;
    qwen.observe(0, {id});
    opened += qwen.gated(0) ? 1 : 0;
  }
  CHECK(opened == 565 - 4);

  SteeringConfig lc = SteeringConfig::r1_llama_8b();
  SteeringController llama(lc, v, 1);
  const auto ids = data_ids("paragraph_break_ids_r1llama.txt");
  const std::vector<std::int32_t> old_llama = {271, 382, 696, 1980};
  std::int32_t other = -1;
  for (std::int32_t id : ids)
    if (std::find(old_llama.begin(), old_llama.end(), id) == old_llama.end()) other = id;
  REQUIRE(other >= 0);
  llama.observe(0, {lc.think_start[0], kWord, other});
  CHECK(llama.gated(0));

  // Configurable per tokenizer: a host's own list.
  SteeringConfig custom;
  custom.boundary = {7, 3};
  SteeringController c(custom, v, 1);
  c.observe(0, {kThink, 3});
  CHECK(c.gated(0));
  c.observe(0, {401});
  CHECK_FALSE(c.gated(0));
}

namespace {
SkipKVConfig cadence_config(std::int64_t hidden) {
  SkipKVConfig c;
  c.batch = 1;
  c.scorer.rkv.budget = 1024;
  c.sentences.hidden_size = hidden;
  c.steering = SteeringConfig::r1_qwen_7b();
  return c;
}
}  // namespace

TEST_CASE("α moves every 128 decode steps before any compression", "[skipkv][steering]") {
  SkipKV p(cadence_config(0));
  p.observe(0, {kThink, kWord, kNewline});  // the prompt
  // Decode: three check sentences, then plain tokens, one token per step; no select() ever runs.
  std::vector<std::int32_t> decode;
  for (int s = 0; s < 3; ++s) decode.insert(decode.end(), {kWait, kWord, kNewline});
  while (decode.size() < 200) decode.push_back(kWord);
  for (std::size_t i = 0; i < decode.size(); ++i) {
    p.observe(0, {decode[i]});
    const std::size_t steps = i + 1;
    if (steps < 128) {
      REQUIRE(p.steering_strength(0) == 1.25f);
    } else {
      REQUIRE(std::fabs(p.steering_strength(0) - (1.25f + 0.02f * 3)) < 1e-6f);
    }
  }
  CHECK(p.triggers() == 0);
  CHECK(p.refreshes() == 1);

  // refresh_steps = 0 keeps the old rule (α only at compression triggers).
  SkipKVConfig off = cadence_config(0);
  off.steering.refresh_steps = 0;
  SkipKV q(off);
  q.observe(0, {kThink});
  for (std::int32_t id : decode) q.observe(0, {id});
  CHECK(q.steering_strength(0) == 1.25f);

  // A configurable cadence; several tokens per call refresh once, after the call.
  SkipKVConfig ten = cadence_config(0);
  ten.steering.refresh_steps = 10;
  SkipKV r(ten);
  r.observe(0, {kThink});
  r.observe(0, {kWait, kWord, kNewline, kWord, kWord, kWord, kWord, kWord, kWord});  // 9 steps
  CHECK(r.steering_strength(0) == 1.25f);
  r.observe(0, {kWord, kWord});  // 11 steps: crosses 10
  CHECK(std::fabs(r.steering_strength(0) - 1.27f) < 1e-6f);
}

TEST_CASE("redundant-sentence marks are refreshed on the cadence, before any compression",
          "[skipkv][steering]") {
  constexpr std::int64_t kHidden = 4;
  SkipKV p(cadence_config(kHidden));
  auto row = [](float a, float b) { return std::vector<float>{a, b, 0.0f, 0.0f}; };
  auto observe = [&](std::int32_t id, const std::vector<float>& h) {
    p.observe(0, &id, 1,
              TensorView::contiguous(const_cast<float*>(h.data()), DType::f32, Device::cpu,
                                     {1, kHidden}));
  };
  // The prompt: its own sentence, "<think>\n".
  const std::int32_t prompt[2] = {kThink, kNewline};
  const std::vector<float> prompt_h = {0, 1, 0, 0, 0, 1, 0, 0};
  p.observe(0, prompt, 2,
            TensorView::contiguous(const_cast<float*>(prompt_h.data()), DType::f32, Device::cpu,
                                   {2, kHidden}));
  // Two sentences with identical hidden states (PSS 1 > τ): the earlier one is redundant.
  for (int s = 0; s < 2; ++s) {
    observe(kWord, row(1, 0));
    observe(kWord, row(1, 0));
    observe(kNewline, row(1, 0));
  }
  int steps = 6;
  REQUIRE(p.tracker(0).num_sentences() == 3);
  CHECK_FALSE(p.tracker(0).sentences()[1].redundant());
  while (steps < 127) observe(kWord, row(0, 1)), ++steps;
  CHECK_FALSE(p.tracker(0).sentences()[1].redundant());
  observe(kWord, row(0, 1));  // decode step 128
  CHECK(p.tracker(0).sentences()[1].redundant());
  CHECK_FALSE(p.tracker(0).sentences()[0].redundant());
  CHECK_FALSE(p.tracker(0).sentences()[2].redundant());
  CHECK(p.triggers() == 0);
}

TEST_CASE("SkipKV rejects NaN and inf hidden states with a clear error", "[skipkv][errors]") {
  constexpr std::int64_t kHidden = 4;
  SkipKV p(cadence_config(kHidden));
  const std::int32_t ids[2] = {kWord, kWord};
  std::vector<float> h(2 * kHidden, 0.5f);
  h[kHidden + 2] = std::numeric_limits<float>::quiet_NaN();
  auto view = TensorView::contiguous(h.data(), DType::f32, Device::cpu, {2, kHidden});
  REQUIRE_THROWS_WITH(p.observe(0, ids, 2, view),
                      Contains("SentenceTracker::observe: hidden[1, 2] = nan is not finite"));
  CHECK(p.tracker(0).position() == 0);  // nothing was consumed
  h[kHidden + 2] = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(p.observe(0, ids, 2, view), Contains("hidden[1, 2] = inf is not finite"));
  auto bad = view;
  bad.stride[0] = -kHidden;
  REQUIRE_THROWS_WITH(p.observe(0, ids, 2, bad), Contains("stride[0] must be >= 1, got -4"));
}

TEST_CASE("SkipKV refuses a layer index of INT_MAX instead of allocating for it", "[skipkv]") {
  SkipKVConfig c = cadence_config(0);
  c.scorer.rkv.budget = 4;
  c.scorer.rkv.window = 2;
  c.scorer.rkv.buffer = 2;
  c.scorer.rkv.kernel = 1;
  SkipKV p(c);
  std::vector<float> k(1 * 1 * 8 * 4, 0.5f), v(k);
  std::int32_t len[1] = {0};
  std::vector<float> q(1 * 1 * 2 * 4, 0.1f);
  StepInputs in{std::numeric_limits<int>::max(),
                make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 1, 8, 4, len),
                TensorView::contiguous(q.data(), DType::f32, Device::cpu, {1, 1, 2, 4})};
  REQUIRE_THROWS_WITH(p.select(in), Contains("layer 2147483647 outside [0, 1024)"));
}
