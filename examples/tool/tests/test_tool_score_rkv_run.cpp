// The host half of `kvsift score --policy rkv` (examples/tool/score_rkv_run.hpp): the CPU run
// against the published R-KV outputs of the golden cases, and compare_rkv_runs() — the check
// behind `--device cuda --compare-cpu` — accepting a run equal to the reference and rejecting
// every kind of disagreement the golden README rules out.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/safetensors.hpp"
#include "score_rkv_run.hpp"

using namespace kvsift;
using tool::RKVRun;

namespace {

struct GoldenCase {
  SafetensorsFile file;
  std::int64_t B, H, S, D, Hq, W;
  std::vector<float> keys, values, queries;
  std::vector<std::int32_t> lengths;
  RKVConfig cfg;

  explicit GoldenCase(const std::string& name)
      : file(SafetensorsFile::load(std::string(KVSIFT_GOLDEN_DIR) + "/" + name)) {
    const nlohmann::json c = nlohmann::json::parse(file.metadata().at("config"));
    const StTensor& k = file.get("keys", {-1, -1, -1, -1});
    B = k.shape[0], H = k.shape[1], S = k.shape[2], D = k.shape[3];
    const StTensor& q = file.get("queries", {B, -1, -1, D});
    Hq = q.shape[1], W = q.shape[2];
    keys = k.to_f32();
    values = file.get("values", k.shape).to_f32();
    queries = q.to_f32();
    lengths.assign(static_cast<std::size_t>(B), static_cast<std::int32_t>(S));
    cfg.budget = c.at("budget").get<int>();
    cfg.window = static_cast<int>(W);
    cfg.kernel = c.at("kernel").get<int>();
    cfg.mix_lambda = c.at("mix_lambda").get<float>();
    cfg.threshold = c.at("threshold").get<float>();
    cfg.redundancy = RedundancyMode::faithful;  // the reference's column-0 fallback
  }
  KVCacheView kv() {
    return make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, B, H, S, D,
                              lengths.data());
  }
  TensorView q() {
    return TensorView::contiguous(queries.data(), DType::f32, Device::cpu, {B, Hq, W, D});
  }
};

std::int64_t outside_tolerance(const std::vector<float>& ours, const std::vector<float>& ref) {
  REQUIRE(ours.size() == ref.size());
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    bad += std::fabs(ours[i] - ref[i]) <= 1e-6 + 1e-4 * std::fabs(ref[i]) ? 0 : 1;
  return bad;
}

}  // namespace

TEST_CASE("tool R-KV CPU run matches the published R-KV outputs", "[tool][golden]") {
  for (const char* name : {"rkv_mha.safetensors", "rkv_batch2.safetensors"}) {
    INFO(name);
    GoldenCase g(name);
    const RKVRun run = tool::run_rkv_cpu(g.kv(), g.q(), g.cfg);
    CHECK(outside_tolerance(run.importance, g.file.get("importance").to_f32()) == 0);
    CHECK(outside_tolerance(run.redundancy_full, g.file.get("redundancy_full").to_f32()) == 0);
    CHECK(outside_tolerance(run.score, g.file.get("score").to_f32()) == 0);
    // redundancy is redundancy_full with the last W columns sliced off.
    const std::int64_t n = g.S - g.W;
    for (std::int64_t r = 0; r < g.B * g.H; ++r)
      for (std::int64_t j = 0; j < n; j += 17)
        CHECK(run.redundancy[r * n + j] == run.redundancy_full[r * g.S + j]);
    REQUIRE(run.compressed);
    // Compacted rows are the input rows of the kept slots, in slot order; the caller's cache is
    // untouched (the run compacts a copy).
    for (std::int64_t r = 0; r < g.B * g.H; r += 3) {
      const std::int32_t* row = run.plan.row(r / g.H, r % g.H);
      for (std::int64_t i = 0; i < g.cfg.budget; i += 5)
        for (std::int64_t d = 0; d < g.D; d += 7) {
          float got;
          std::memcpy(&got, &run.keys[((r * g.S + i) * g.D + d) * 4], 4);
          CHECK(got == g.keys[(r * g.S + row[i]) * g.D + d]);
        }
    }
    CHECK(g.keys == g.file.get("keys").to_f32());
  }
}

TEST_CASE("tool R-KV comparison accepts agreement and rejects disagreement", "[tool]") {
  GoldenCase g("rkv_mha.safetensors");
  const RKVRun ref = tool::run_rkv_cpu(g.kv(), g.q(), g.cfg);
  RKVRun ours = ref;
  const std::int64_t n = g.S - g.W, keep = g.cfg.budget - g.cfg.window;

  SECTION("identical runs") {
    const tool::RKVComparison c = tool::compare_rkv_runs(ours, ref, g.cfg, nullptr);
    CHECK(c.ok());
    CHECK(c.kept_slots == g.B * g.H * g.cfg.budget);
    CHECK(c.kv_rows_compared == c.kept_slots);
    for (const tool::OutputDiff& d : c.outputs) CHECK(d.max_abs == 0.0);
  }
  SECTION("a score inside the tolerance is fine, one outside is not") {
    ours.importance[5] = ref.importance[5] + 0.5e-6f;
    CHECK(tool::compare_rkv_runs(ours, ref, g.cfg, nullptr).ok());
    ours.redundancy_full[9] = ref.redundancy_full[9] * 1.01f;
    const tool::RKVComparison c = tool::compare_rkv_runs(ours, ref, g.cfg, nullptr);
    CHECK(c.outputs[2].name == "redundancy_full");
    CHECK(c.outputs[2].outside == 1);
    CHECK(c.outputs[2].max_rel == Approx(0.01).epsilon(1e-3));
    CHECK_FALSE(c.ok());
  }
  SECTION("a NaN counts as outside") {
    ours.score[0] = std::nanf("");
    CHECK(tool::compare_rkv_runs(ours, ref, g.cfg, nullptr).outputs[3].outside == 1);
  }
  SECTION("swapping the best kept token for the worst evicted one is not a near-cut swap") {
    // Row (0, 0): drop its highest-scoring kept slot, keep instead its lowest-scoring candidate.
    const std::int32_t* row = ref.plan.row(0, 0);
    std::vector<std::int32_t> kept(row, row + keep);
    const auto best = std::max_element(kept.begin(), kept.end(),
                                       [&](int a, int b) { return ref.score[a] < ref.score[b]; });
    std::int32_t worst = -1;
    for (std::int32_t j = 0; j < n; ++j)
      if (!std::binary_search(kept.begin(), kept.end(), j) &&
          (worst < 0 || ref.score[j] < ref.score[worst]))
        worst = j;
    REQUIRE(worst >= 0);
    *best = worst;
    std::sort(kept.begin(), kept.end());
    for (std::int64_t w = 0; w < g.W; ++w) kept.push_back(static_cast<std::int32_t>(n + w));
    KeepPlan plan(g.B, g.H, g.S, ref.plan.source_lengths(), ref.plan.kept_lengths(), g.cfg.window);
    plan.append_row(kept);
    for (std::int64_t h = 1; h < g.H; ++h)
      plan.append_row(ref.plan.row(0, h), ref.plan.row_size(0, h));
    ours.plan = plan;
    const tool::RKVComparison c = tool::compare_rkv_runs(ours, ref, g.cfg, nullptr);
    CHECK(c.kept_differ == 2);
    CHECK(c.kept_differ_off_cut == 2);
    CHECK_FALSE(c.ok());
  }
  SECTION("a compacted key row differing in one bit") {
    ours.keys[(2 * g.S + 4) * g.D * 4 + 1] ^= 0x10;  // (b 0, h 2), kept row 4
    const tool::RKVComparison c = tool::compare_rkv_runs(ours, ref, g.cfg, nullptr);
    CHECK(c.kv_rows_differ == 1);
    CHECK(c.kv_max_abs > 0);
    CHECK_FALSE(c.ok());
  }
  SECTION("runs of different cases are refused") {
    ours.seq += 1;
    REQUIRE_THROWS_WITH(tool::compare_rkv_runs(ours, ref, g.cfg, nullptr),
                        Catch::Matchers::Contains("not of the same case"));
  }
}

TEST_CASE("tool R-KV run rejects inputs it cannot score, naming the values", "[tool]") {
  GoldenCase g("rkv_mha.safetensors");
  SECTION("window differs from the queries' W") {
    g.cfg.window = 4;
    REQUIRE_THROWS_WITH(tool::run_rkv_cpu(g.kv(), g.q(), g.cfg),
                        Catch::Matchers::Contains("window (4) must equal the queries' W (8)"));
  }
  SECTION("a ragged batch") {
    g.lengths[0] = 100;
    REQUIRE_THROWS_WITH(tool::run_rkv_cpu(g.kv(), g.q(), g.cfg),
                        Catch::Matchers::Contains("sequence 0 holds 100 tokens, expected all 256"));
  }
}
