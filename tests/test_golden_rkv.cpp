// Parity with the published reference implementations (golden/README.md): R-KV's importance,
// redundancy, joint score, kept set and compacted K/V; the redundancy fallback rule; SkipKV's
// padding handling of the two shared scores.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "golden_case.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/json_number.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/baselines/rkv.hpp"

using namespace kvsift;
using test::check_kept_sets;
using test::check_scores;
using test::GoldenCase;

namespace {

// The reference's R-KV settings of a case (its "config" metadata).
RKVConfig rkv_config(const GoldenCase& g) {
  RKVConfig c;
  // Strict: an integer key holding 16.7 is an error, not 16 (core/json_number.hpp).
  c.budget = json_integer<int>(g.config.at("budget"), "config budget");
  c.window = json_integer<int>(g.config.at("window"), "config window");
  c.kernel = json_integer<int>(g.config.at("kernel"), "config kernel");
  c.mix_lambda = json_float(g.config.at("mix_lambda"), "config mix_lambda");
  c.threshold = json_float(g.config.at("threshold"), "config threshold");
  c.buffer = std::max(128, c.window);
  c.redundancy = RedundancyMode::faithful;  // the reference's column-0 fallback
  return c;
}

void check_rkv_case(const std::string& name) {
  GoldenCase g(name);
  const RKVConfig cfg = rkv_config(g);
  REQUIRE(cfg.window == g.window);
  const std::int64_t s = g.seq, n = s - cfg.window, keep = cfg.budget - cfg.window;
  const std::int64_t B = g.batch, H = g.kv_heads, D = g.dim;
  KVCacheView kv = g.kv();

  const RKVScores sc = cpu::rkv_scores(kv, g.q(), cfg);
  check_scores(sc.importance, g.file.get("importance", {B, H, n}).to_f32(), n, "importance");
  check_scores(sc.redundancy_full, g.file.get("redundancy_full", {B, H, s}).to_f32(), s,
               "redundancy_full");
  const std::vector<float> ref_score = g.file.get("score", {B, H, n}).to_f32();
  check_scores(sc.score, ref_score, n, "score");

  // The policy path: select() as an engine calls it.
  RKV policy(cfg);
  StepInputs in{0, kv, g.q()};
  const KeepPlan plan = policy.select(in);
  plan.validate();
  const std::vector<std::int64_t> ref_sorted = g.file.get("keep_sorted", {B, H, keep}).to_i64();
  const std::vector<std::int64_t> ref_topk = g.file.get("keep_topk", {B, H, keep}).to_i64();
  const std::vector<float> ref_ck = g.file.get("compacted_keys", {B, H, cfg.budget, D}).to_f32();
  const std::vector<float> ref_cv = g.file.get("compacted_values", {B, H, cfg.budget, D}).to_f32();

  // Kept sets: equal except for tokens whose reference score is within 1e-6 of the cut.
  const std::int64_t swapped =
      check_kept_sets(plan, ref_sorted, ref_score, H, s, cfg.budget, cfg.window);
  UNSCOPED_INFO(name << ": " << swapped << " near-cut tokens differ");

  // Compaction: our rows in sorted-slot order, the reference's in top-k order then window; every
  // slot kept by both must hold bit-identical keys and values.
  compact(kv, plan);
  std::int64_t compared = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int32_t* row = plan.row(b, h);
      for (std::int64_t i = 0; i < cfg.budget; ++i) {
        const std::int64_t slot =
            i < keep ? ref_topk[(b * H + h) * keep + i] : s - cfg.window + (i - keep);
        const std::int32_t* pos = std::lower_bound(row, row + cfg.budget, slot);
        if (pos == row + cfg.budget || *pos != slot) continue;  // a near-cut swap
        const std::int64_t p = pos - row;
        const float* ours_k = &g.keys[((b * H + h) * s + p) * D];
        const float* ours_v = &g.values[((b * H + h) * s + p) * D];
        INFO("(b=" << b << ", h=" << h << ") slot " << slot);
        CHECK(std::memcmp(ours_k, &ref_ck[((b * H + h) * cfg.budget + i) * D], D * 4) == 0);
        CHECK(std::memcmp(ours_v, &ref_cv[((b * H + h) * cfg.budget + i) * D], D * 4) == 0);
        ++compared;
      }
    }
  CHECK(compared >= B * H * cfg.budget - swapped);
  CHECK(kv.lengths[0] == cfg.budget);
}

}  // namespace

TEST_CASE("R-KV parity: multi-head attention", "[golden][rkv]") {
  check_rkv_case("rkv_mha.safetensors");
}
TEST_CASE("R-KV parity: GQA 32/8, head_dim 128, window 16", "[golden][rkv]") {
  check_rkv_case("rkv_gqa.safetensors");
}
TEST_CASE("R-KV parity: batch of 2", "[golden][rkv]") { check_rkv_case("rkv_batch2.safetensors"); }

TEST_CASE("R-KV parity: sparing the last near-duplicate and the column-0 fallback",
          "[golden][rkv]") {
  GoldenCase g("rkv_retain6.safetensors");
  const float threshold = g.config.at("threshold").get<float>();
  const std::vector<float> ref = g.file.get("redundancy_full", {1, 1, 6}).to_f32();
  const cpu::ScoreTensor faithful =
      cpu::redundancy_full(g.kv(), {threshold, RedundancyMode::faithful});
  check_scores(faithful, ref, 6, "redundancy_full (faithful)");
  // The sound mode differs from the reference exactly at column 0: the ratios between the other
  // columns (their softmax logits' differences) are unchanged, column 0's are not.
  const cpu::ScoreTensor sound = cpu::redundancy_full(g.kv(), {threshold, RedundancyMode::sound});
  for (int j = 2; j < 6; ++j) {
    INFO("column " << j);
    CHECK(std::fabs(std::log(sound.at(0, 0, j) / sound.at(0, 0, 1)) - std::log(ref[j] / ref[1])) <
          1e-5);
  }
  const double shift0 = std::log(sound.at(0, 0, 0) / sound.at(0, 0, 1)) - std::log(ref[0] / ref[1]);
  CHECK(std::fabs(shift0) > 1e-3);
}

TEST_CASE("SkipKV parity: importance and redundancy under left padding", "[golden][skipkv]") {
  GoldenCase g("skipkv_pad.safetensors");
  REQUIRE(!g.mask.empty());
  const RKVConfig cfg = rkv_config(g);
  const std::int64_t n = g.seq - cfg.window;
  const cpu::ScoreTensor a = cpu::window_importance(g.kv(), g.q(), cfg.importance_config());
  check_scores(a, g.file.get("importance", {g.batch, g.kv_heads, n}).to_f32(), n,
               "importance (padded)");
  const cpu::ScoreTensor r = cpu::key_redundancy(g.kv(), cfg.redundancy_config(), cfg.window);
  check_scores(r, g.file.get("redundancy", {g.batch, g.kv_heads, n}).to_f32(), n,
               "redundancy (padded)");
}
