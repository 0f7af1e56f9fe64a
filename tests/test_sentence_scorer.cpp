// SentenceScorer (docs/algorithms.md §2.4): parity with the SkipKV reference in faithful pad mode
// (golden skipkv_pad and skipkv_sentences), the exclude-mode guarantees (no pad kept, kept count
// = min(budget, real tokens)), the penalty arithmetic on a hand example, and the error paths.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "golden_case.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"
#include "kvsift/policy/skipkv/sentence_tracker.hpp"

using namespace kvsift;
using test::check_kept_sets;
using test::check_scores;

namespace {

// A SkipKV scorer case: a golden case that must carry values, queries and a valid_mask.
struct Golden : test::GoldenCase {
  explicit Golden(const std::string& name) : GoldenCase(name) {
    REQUIRE(file.has("values"));
    REQUIRE(!queries.empty());
    REQUIRE(!mask.empty());
  }
  // The reference's settings: faithful redundancy fallback and faithful pads.
  SentenceScorerConfig scorer_config(PadMode mode = PadMode::faithful) const {
    SentenceScorerConfig c;
    c.rkv.budget = config.at("budget").get<int>();
    c.rkv.window = config.at("window").get<int>();
    c.rkv.kernel = config.at("kernel").get<int>();
    c.rkv.mix_lambda = config.at("mix_lambda").get<float>();
    c.rkv.threshold = config.at("threshold").get<float>();
    c.rkv.redundancy = RedundancyMode::faithful;
    c.pad_mode = mode;
    return c;
  }
};

// The golden `sentences` rows as SegmentTable penalties: each sequence's stream rebuilt from the
// mask (pads) and the row ends (delimiters), marks applied as given (cache range = generation
// range in these cases, golden/README.md).
SentencePenalties golden_penalties(const Golden& g, std::vector<SentenceTracker>& trackers) {
  const std::vector<float> rows = g.file.get("sentences", {-1, 4}).to_f32();
  SentenceTrackerConfig tc;
  tc.tokens = SentenceTokens{{1}, {}};
  for (std::int64_t b = 0; b < g.batch; ++b) {
    SentenceTracker t(tc);
    t.add_padding(g.pads(b));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(g.seq - g.pads(b)), 5);
    for (std::size_t r = 0; r < rows.size() / 4; ++r)
      if (rows[4 * r] == b) ids[static_cast<std::size_t>(rows[4 * r + 2]) - g.pads(b)] = 1;
    t.observe(ids);
    trackers.push_back(t);
  }
  apply_sentence_marks(trackers, rows.data(), static_cast<std::int64_t>(rows.size() / 4));
  SegmentTable table(1, g.batch, g.kv_heads);
  SentencePenalties pen(static_cast<std::size_t>(g.batch * g.kv_heads));
  for (std::int64_t b = 0; b < g.batch; ++b) {
    table.set_first_position(b, g.pads(b));
    table.append_closed(0, b, trackers[b].sentences(), trackers[b].position(), g.seq);
    for (std::int64_t h = 0; h < g.kv_heads; ++h)
      pen[b * g.kv_heads + h] = table.penalty_ranges(0, b, h, trackers[b].sentences());
  }
  return pen;
}

}  // namespace

TEST_CASE("golden skipkv_pad: faithful pads (+100, force-kept) match the reference",
          "[golden][scorer]") {
  Golden g("skipkv_pad.safetensors");
  const SentenceScorerConfig cfg = g.scorer_config();
  const std::int64_t n = g.seq - g.window;
  const SentenceScorer scorer(cfg);
  const SentenceScores s = scorer.scores(g.kv(), g.q(), {});
  check_scores(s.importance, g.file.get("importance", {g.batch, g.kv_heads, n}).to_f32(), n,
               "importance");
  check_scores(s.redundancy, g.file.get("redundancy", {g.batch, g.kv_heads, n}).to_f32(), n,
               "redundancy");
  const std::vector<float> ref_score = g.file.get("score", {g.batch, g.kv_heads, n}).to_f32();
  check_scores(s.score, ref_score, n, "score");

  KVCacheView kv = g.kv();
  const KeepPlan plan = scorer.select(kv, g.q(), {});
  plan.validate();
  check_kept_sets(
      plan, g.file.get("keep_sorted", {g.batch, g.kv_heads, cfg.rkv.budget - g.window}).to_i64(),
      ref_score, g.kv_heads, g.seq, cfg.rkv.budget, g.window);
  // Every pad is kept in every head (0, 17 and 40 pads, all below budget − W) and eats budget.
  REQUIRE(g.pads(1) == 17);
  REQUIRE(g.pads(2) == 40);
  for (std::int64_t b = 0; b < g.batch; ++b)
    for (std::int64_t h = 0; h < g.kv_heads; ++h) {
      REQUIRE(plan.row_size(b, h) == cfg.rkv.budget);
      for (std::int64_t j = 0; j < g.pads(b); ++j) CHECK(plan.row(b, h)[j] == j);
    }
  compact(kv, plan);  // accepts it: pads agree across heads
  for (std::int64_t b = 0; b < g.batch; ++b) {
    CHECK(kv.lengths[b] == cfg.rkv.budget);
    const std::int64_t kept_pads =
        std::count(g.mask.begin() + b * g.seq, g.mask.begin() + b * g.seq + cfg.rkv.budget, 0);
    CHECK(kept_pads == g.pads(b));
  }
}

TEST_CASE("golden skipkv_sentences: the sentence penalty and its eviction match the reference",
          "[golden][scorer]") {
  Golden g("skipkv_sentences.safetensors");
  const SentenceScorerConfig cfg = g.scorer_config();
  const std::int64_t n = g.seq - g.window;
  std::vector<SentenceTracker> trackers;
  const SentencePenalties pen = golden_penalties(g, trackers);
  const SentenceScorer scorer(cfg);
  const SentenceScores s = scorer.scores(g.kv(), g.q(), pen);
  const std::vector<float> ref_score = g.file.get("score", {g.batch, g.kv_heads, n}).to_f32();
  check_scores(s.score, ref_score, n, "score");

  const KeepPlan plan = scorer.select(g.kv(), g.q(), pen);
  plan.validate();
  check_kept_sets(
      plan, g.file.get("keep_sorted", {g.batch, g.kv_heads, cfg.rkv.budget - g.window}).to_i64(),
      ref_score, g.kv_heads, g.seq, cfg.rkv.budget, g.window);
  // Independent of the reference: every redundant sentence (more than one token) is gone whole
  // in every head, since enough unpenalized tokens remain to fill the budget.
  std::int64_t redundant_seen = 0;
  for (std::int64_t b = 0; b < g.batch; ++b)
    for (const Sentence& sen : trackers[b].sentences()) {
      if (!sen.redundant() || sen.end <= sen.start) continue;
      ++redundant_seen;
      for (std::int64_t h = 0; h < g.kv_heads; ++h) {
        const std::int32_t* row = plan.row(b, h);
        const std::int32_t* lo = std::lower_bound(row, row + cfg.rkv.budget, sen.start);
        INFO("b=" << b << " h=" << h << " sentence [" << sen.start << ", " << sen.end << "]");
        CHECK((lo == row + cfg.rkv.budget || *lo > sen.end));
      }
    }
  CHECK(redundant_seen == 3);
  // Without penalties those sentences are (partly) kept: the penalty is what evicts them.
  const KeepPlan plain = scorer.select(g.kv(), g.q(), {});
  const std::int32_t* row = plain.row(0, 0);
  CHECK(std::any_of(row, row + cfg.rkv.budget, [](std::int32_t j) { return j >= 21 && j <= 47; }));
}

TEST_CASE("exclude mode: no pad kept, kept count = min(budget, real tokens)", "[scorer][pads]") {
  Golden g("skipkv_pad.safetensors");
  // Sequence 2 gets 100 pads: 60 real tokens, fewer than the budget of 96.
  for (std::int64_t j = 40; j < 100; ++j) g.mask[2 * g.seq + j] = 0;
  const SentenceScorerConfig faithful_cfg = g.scorer_config(PadMode::faithful);
  const SentenceScorerConfig cfg = g.scorer_config(PadMode::exclude);
  const std::int64_t n = g.seq - g.window, keep = cfg.rkv.budget - g.window;
  KVCacheView kv = g.kv();
  const SentenceScores s = SentenceScorer(cfg).scores(kv, g.q(), {});
  const SentenceScores sf = SentenceScorer(faithful_cfg).scores(kv, g.q(), {});
  const KeepPlan plan = SentenceScorer(cfg).select(kv, g.q(), {});
  plan.validate();
  const std::int64_t real[3] = {160, 143, 60};
  for (std::int64_t b = 0; b < g.batch; ++b) {
    CHECK(plan.kept_length(b) == std::min<std::int64_t>(cfg.rkv.budget, real[b]));
    for (std::int64_t h = 0; h < g.kv_heads; ++h) {
      const std::int32_t* row = plan.row(b, h);
      for (std::int64_t i = 0; i < plan.row_size(b, h); ++i) CHECK(kv.is_valid(b, row[i]));
      // Real tokens score the same in both modes; only pads differ (+100 when faithful).
      for (std::int64_t j = 0; j < n; ++j) {
        if (kv.is_valid(b, j)) {
          CHECK(s.score.at(b, h, j) == sf.score.at(b, h, j));
        } else {
          CHECK(sf.score.at(b, h, j) == kFaithfulPadScore);
        }
      }
      if (real[b] <= cfg.rkv.budget) continue;
      // Oracle: the real candidates ranked by score (ties: lower index), the best budget − W.
      std::vector<std::int32_t> cand;
      for (std::int32_t j = 0; j < n; ++j)
        if (kv.is_valid(b, j)) cand.push_back(j);
      const float* sc = s.score.row(b, h);
      std::stable_sort(cand.begin(), cand.end(),
                       [sc](std::int32_t x, std::int32_t y) { return sc[x] > sc[y]; });
      cand.resize(static_cast<std::size_t>(keep));
      std::sort(cand.begin(), cand.end());
      CHECK(std::vector<std::int32_t>(row, row + keep) == cand);
    }
  }
  compact(kv, plan);
  for (std::int64_t b = 0; b < g.batch; ++b) {
    CHECK(kv.lengths[b] == std::min<std::int64_t>(cfg.rkv.budget, real[b]));
    for (std::int64_t j = 0; j < kv.lengths[b]; ++j) CHECK(kv.is_valid(b, j));
  }
}

TEST_CASE("faithful mode: more pads than budget − W keeps the same pads in every head",
          "[scorer][pads]") {
  Golden g("skipkv_pad.safetensors");
  for (std::int64_t j = 0; j < 120; ++j) g.mask[2 * g.seq + j] = 0;  // 120 pads > 88
  const SentenceScorerConfig cfg = g.scorer_config(PadMode::faithful);
  KVCacheView kv = g.kv();
  const KeepPlan plan = SentenceScorer(cfg).select(kv, g.q(), {});
  for (std::int64_t h = 0; h < g.kv_heads; ++h) {
    const std::int32_t* row = plan.row(2, h);
    // the first 88 pads
    for (std::int64_t i = 0; i < cfg.rkv.budget - g.window; ++i) CHECK(row[i] == i);
  }
  compact(kv, plan);
  CHECK(kv.lengths[2] == cfg.rkv.budget);
}

TEST_CASE("the penalty subtracts λ exactly over mapped ranges with lo < hi < S", "[scorer]") {
  Golden g("skipkv_pad.safetensors");
  const SentenceScorerConfig cfg = g.scorer_config(PadMode::exclude);
  const std::int64_t n = g.seq - g.window;
  SentencePenalties pen(static_cast<std::size_t>(g.batch * g.kv_heads));
  // overlap; one-token
  pen[0 * g.kv_heads + 1] = {{10, 19, 0.97f}, {15, 30, 0.5f}, {40, 40, 0.9f}};
  // tail into the window; hi >= S
  pen[1 * g.kv_heads + 0] = {{150, 159, 0.96f}, {100, 200, 0.99f}};
  const SentenceScores with = SentenceScorer(cfg).scores(g.kv(), g.q(), pen);
  const SentenceScores without = SentenceScorer(cfg).scores(g.kv(), g.q(), {});
  for (std::int64_t b = 0; b < g.batch; ++b)
    for (std::int64_t h = 0; h < g.kv_heads; ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        double expected = 0;  // hand-written: which ranges cover t
        if (b == 0 && h == 1)
          expected = (t >= 10 && t <= 19 ? 0.97 : 0) + (t >= 15 && t <= 30 ? 0.5 : 0);
        if (b == 1 && h == 0) expected = (t >= 150 ? 0.96 : 0);
        INFO("b=" << b << " h=" << h << " t=" << t);
        CHECK(std::fabs((without.score.at(b, h, t) - with.score.at(b, h, t)) - expected) < 1e-5);
      }
}

TEST_CASE("bad configs and penalties raise errors naming the values", "[scorer][errors]") {
  SentenceScorerConfig c;
  c.rkv.budget = 8;
  REQUIRE_THROWS_WITH(SentenceScorer(c),
                      Catch::Matchers::Contains("budget (8) must exceed window + sink (8 + 0)"));
  c = SentenceScorerConfig{};
  c.rkv.window = 0;
  REQUIRE_THROWS_WITH(SentenceScorer(c), Catch::Matchers::Contains("window must be >= 1, got 0"));
  c = SentenceScorerConfig{};
  c.rkv.mix_lambda = 1.5f;
  REQUIRE_THROWS_WITH(SentenceScorer(c),
                      Catch::Matchers::Contains("mix_lambda must be in [0, 1], got 1.5"));
  c = SentenceScorerConfig{};
  c.rkv.kernel = 4;
  REQUIRE_THROWS_WITH(SentenceScorer(c), Catch::Matchers::Contains("kernel must be odd"));
  c = SentenceScorerConfig{};
  c.rkv.threshold = 2.0f;
  REQUIRE_THROWS_WITH(SentenceScorer(c),
                      Catch::Matchers::Contains("threshold must be in [-1, 1], got 2"));
  REQUIRE_THROWS_WITH(parse_pad_mode("keep"), Catch::Matchers::Contains("got 'keep'"));
  CHECK(parse_pad_mode("faithful") == PadMode::faithful);
  CHECK(parse_pad_mode("exclude") == PadMode::exclude);

  Golden g("skipkv_pad.safetensors");
  const SentenceScorer scorer(g.scorer_config());
  const SentencePenalties wrong(3);
  REQUIRE_THROWS_WITH(
      scorer.scores(g.kv(), g.q(), wrong),
      Catch::Matchers::Contains("penalties has 3 lists, expected 0 or batch * kv_heads = 3 * 2"));
  SentencePenalties nan_pen(static_cast<std::size_t>(g.batch * g.kv_heads));
  nan_pen[0] = {{1, 5, NAN}};
  REQUIRE_THROWS_WITH(scorer.scores(g.kv(), g.q(), nan_pen),
                      Catch::Matchers::Contains("non-finite lambda"));
  g.keys[7] = NAN;
  REQUIRE_THROWS_WITH(scorer.select(g.kv(), g.q(), {}), Catch::Matchers::Contains("non-finite"));
}
