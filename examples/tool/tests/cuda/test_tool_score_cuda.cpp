// The tool's CUDA path (`kvsift score --policy rkv --device cuda`, examples/tool/score_cuda.hpp)
// against the published R-KV outputs in the golden cases and against the tool's own CPU path:
// scores within |x − ref| <= 1e-6 + 1e-4·|ref|, kept sets equal up to near-cut swaps, compacted
// K/V rows bit-identical to the input rows of the kept slots. Also the GPU path's limits, which
// must fail with a message naming what the call asked for.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "demo_cuda.hpp"
#include "golden_case.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/segment_table.hpp"
#include "score_cuda.hpp"

using namespace kvsift;
using tool::RKVRun;

namespace {

// A golden case re-stored in dtype T (keys, values and queries rounded once), owned here.
template <class T>
struct HostCase {
  std::int64_t B = 0, H = 0, S = 0, D = 0, Hq = 0, W = 0;
  std::vector<T> keys, values, queries;
  std::vector<std::uint8_t> mask;  // [B, S] or empty
  std::vector<std::int32_t> lengths;
  nlohmann::json config;

  explicit HostCase(const std::string& name) {
    const SafetensorsFile f = SafetensorsFile::load(test::golden_path(name));
    config = nlohmann::json::parse(f.metadata().at("config"));
    const StTensor& k = f.get("keys", {-1, -1, -1, -1});
    B = k.shape[0], H = k.shape[1], S = k.shape[2], D = k.shape[3];
    const StTensor& q = f.get("queries", {B, -1, -1, D});
    Hq = q.shape[1], W = q.shape[2];
    keys = convert(k.to_f32());
    values = convert(f.get("values", k.shape).to_f32());
    queries = convert(q.to_f32());
    if (f.has("valid_mask")) {
      const std::vector<std::int64_t> m = f.get("valid_mask", {B, S}).to_i64();
      mask.assign(m.begin(), m.end());
    }
    lengths.assign(static_cast<std::size_t>(B), static_cast<std::int32_t>(S));
  }
  static std::vector<T> convert(const std::vector<float>& x) {
    std::vector<T> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<T>(x[i]);
    return out;
  }
  KVCacheView kv() {
    return make_kv_cache_view(keys.data(), values.data(), dtype_of<T>::value, Device::cpu, B, H, S,
                              D, lengths.data(), mask.empty() ? nullptr : mask.data());
  }
  TensorView q() {
    return TensorView::contiguous(queries.data(), dtype_of<T>::value, Device::cpu, {B, Hq, W, D});
  }
  RKVConfig rkv_config(RedundancyMode mode) const {
    RKVConfig r;
    r.budget = config.at("budget").get<int>();
    r.window = static_cast<int>(W);
    r.buffer = std::max(r.buffer, r.window);
    r.kernel = config.at("kernel").get<int>();
    r.mix_lambda = config.at("mix_lambda").get<float>();
    r.threshold = config.at("threshold").get<float>();
    r.redundancy = mode;
    return r;
  }
};

std::int64_t outside_tolerance(const std::vector<float>& ours, const std::vector<float>& ref) {
  REQUIRE(ours.size() == ref.size());
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (!(std::fabs(ours[i] - ref[i]) <= 1e-6 + 1e-4 * std::fabs(ref[i]))) {
      if (bad++ < 5) UNSCOPED_INFO("entry " << i << ": " << ours[i] << " vs " << ref[i]);
    }
  return bad;
}

// Every compacted row i of (b, h) must be the input row of the i-th kept slot, bit for bit.
template <class T>
void check_compacted_rows(const RKVRun& run, const HostCase<T>& c) {
  const std::size_t row = static_cast<std::size_t>(c.D) * sizeof(T);
  std::int64_t bad = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.H; ++h) {
      const std::int64_t r = b * c.H + h;
      REQUIRE(run.plan.row_size(b, h) == run.plan.kept_length(b));
      for (std::int64_t i = 0; i < run.plan.row_size(b, h); ++i) {
        const std::int64_t slot = run.plan.row(b, h)[i];
        const auto* in_k = reinterpret_cast<const std::uint8_t*>(&c.keys[(r * c.S + slot) * c.D]);
        const auto* in_v = reinterpret_cast<const std::uint8_t*>(&c.values[(r * c.S + slot) * c.D]);
        bad += std::memcmp(&run.keys[(r * c.S + i) * row], in_k, row) != 0;
        bad += std::memcmp(&run.values[(r * c.S + i) * row], in_v, row) != 0;
      }
    }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("tool score --device cuda matches the published R-KV outputs (golden cases)",
          "[cuda][tool][golden]") {
  for (const char* name :
       {"rkv_mha.safetensors", "rkv_gqa.safetensors", "rkv_batch2.safetensors"}) {
    INFO(name);
    HostCase<float> c(name);
    const RKVConfig cfg = c.rkv_config(RedundancyMode::faithful);  // the reference's fallback
    const RKVRun gpu = tool::run_rkv_cuda(c.kv(), c.q(), cfg);
    const SafetensorsFile f = SafetensorsFile::load(test::golden_path(name));
    const std::vector<float> ref_s = f.get("score").to_f32();
    CHECK(outside_tolerance(gpu.importance, f.get("importance").to_f32()) == 0);
    CHECK(outside_tolerance(gpu.redundancy_full, f.get("redundancy_full").to_f32()) == 0);
    CHECK(outside_tolerance(gpu.score, ref_s) == 0);
    REQUIRE(gpu.compressed);

    // Kept sets: the reference's, except tokens within 1e-6 of the cut (golden/README.md).
    test::check_kept_sets(gpu.plan, f.get("keep_sorted").to_i64(), ref_s, c.H, c.S, cfg.budget,
                          cfg.window);
    check_compacted_rows(gpu, c);

    // And the tool's own check: the CPU path agrees within the golden tolerances.
    const RKVRun cpu = tool::run_rkv_cpu(c.kv(), c.q(), cfg);
    const tool::RKVComparison cmp = tool::compare_rkv_runs(gpu, cpu, cfg, nullptr);
    for (const tool::OutputDiff& d : cmp.outputs) {
      INFO(d.name << ": max abs " << d.max_abs << ", max rel " << d.max_rel);
      CHECK(d.outside == 0);
    }
    CHECK(cmp.kept_lengths_equal);
    CHECK(cmp.kept_differ_off_cut == 0);
    CHECK(cmp.kv_rows_differ == 0);
    CHECK(cmp.kv_rows_compared > 0);
    CHECK(cmp.ok());
  }
}

TEST_CASE("tool score --device cuda agrees with the CPU path in 16-bit storage and with pads",
          "[cuda][tool]") {
  SECTION("bf16 GQA, sound redundancy") {
    HostCase<bf16_t> c("rkv_gqa.safetensors");
    const RKVConfig cfg = c.rkv_config(RedundancyMode::sound);
    const RKVRun gpu = tool::run_rkv_cuda(c.kv(), c.q(), cfg);
    const RKVRun cpu = tool::run_rkv_cpu(c.kv(), c.q(), cfg);
    CHECK(outside_tolerance(gpu.score, cpu.score) == 0);
    CHECK(outside_tolerance(gpu.redundancy, cpu.redundancy) == 0);
    CHECK(tool::compare_rkv_runs(gpu, cpu, cfg, nullptr).ok());
    check_compacted_rows(gpu, c);
  }
  SECTION("f16 batch 2 with the fp32 near-duplicate search (--fp32-search)") {
    HostCase<f16_t> c("rkv_batch2.safetensors");
    const RKVConfig cfg = c.rkv_config(RedundancyMode::faithful);
    const RKVRun gpu = tool::run_rkv_cuda(c.kv(), c.q(), cfg, /*fp32_search=*/true);
    const RKVRun cpu = tool::run_rkv_cpu(c.kv(), c.q(), cfg);
    CHECK(outside_tolerance(gpu.importance, cpu.importance) == 0);
    CHECK(outside_tolerance(gpu.redundancy_full, cpu.redundancy_full) == 0);
    CHECK(tool::compare_rkv_runs(gpu, cpu, cfg, nullptr).ok());
    check_compacted_rows(gpu, c);
  }
  SECTION("left padding (0/17/40 pads), f32, pads never kept") {
    HostCase<float> c("skipkv_pad.safetensors");
    REQUIRE(!c.mask.empty());
    const RKVConfig cfg = c.rkv_config(RedundancyMode::sound);
    const RKVRun gpu = tool::run_rkv_cuda(c.kv(), c.q(), cfg);
    const RKVRun cpu = tool::run_rkv_cpu(c.kv(), c.q(), cfg);
    const tool::RKVComparison cmp = tool::compare_rkv_runs(gpu, cpu, cfg, c.mask.data());
    CHECK(cmp.ok());
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t i = 0; i < gpu.plan.row_size(b, 0); ++i)
        CHECK(c.mask[b * c.S + gpu.plan.row(b, 0)[i]] == 1);
    check_compacted_rows(gpu, c);
  }
  SECTION("at or under the budget: keeps everything, as the CPU") {
    HostCase<float> c("rkv_mha.safetensors");
    RKVConfig cfg = c.rkv_config(RedundancyMode::faithful);
    cfg.budget = static_cast<int>(c.S);
    const RKVRun gpu = tool::run_rkv_cuda(c.kv(), c.q(), cfg);
    CHECK_FALSE(gpu.compressed);
    CHECK(gpu.plan.keeps_everything());
    CHECK(tool::compare_rkv_runs(gpu, tool::run_rkv_cpu(c.kv(), c.q(), cfg), cfg, nullptr).ok());
  }
}

TEST_CASE("tool R-KV comparison fails when the runs disagree", "[cuda][tool]") {
  HostCase<float> c("rkv_mha.safetensors");
  const RKVConfig cfg = c.rkv_config(RedundancyMode::faithful);
  const RKVRun cpu = tool::run_rkv_cpu(c.kv(), c.q(), cfg);
  RKVRun gpu = tool::run_rkv_cuda(c.kv(), c.q(), cfg);
  REQUIRE(tool::compare_rkv_runs(gpu, cpu, cfg, nullptr).ok());
  SECTION("a score off by 1e-3 relative") {
    gpu.score[7] = cpu.score[7] * 1.001f + 1e-5f;
    const tool::RKVComparison cmp = tool::compare_rkv_runs(gpu, cpu, cfg, nullptr);
    CHECK(cmp.outputs[3].name == "score");
    CHECK(cmp.outputs[3].outside == 1);
    CHECK_FALSE(cmp.ok());
  }
  SECTION("a compacted value row changed") {
    gpu.values[3] ^= 0x1;
    const tool::RKVComparison cmp = tool::compare_rkv_runs(gpu, cpu, cfg, nullptr);
    CHECK(cmp.kv_rows_differ == 1);
    CHECK_FALSE(cmp.ok());
  }
}

TEST_CASE("tool score --device cuda names what the GPU R-KV does not support", "[cuda][tool]") {
  HostCase<float> c("rkv_mha.safetensors");
  RKVConfig cfg = c.rkv_config(RedundancyMode::faithful);
  SECTION("sink tokens") {
    cfg.sink = 4;
    REQUIRE_THROWS_WITH(tool::run_rkv_cuda(c.kv(), c.q(), cfg),
                        Catch::Matchers::Contains("no sink tokens, the case asks for 4"));
  }
  SECTION("GQA mean") {
    cfg.gqa = GqaReduce::mean;
    REQUIRE_THROWS_WITH(tool::run_rkv_cuda(c.kv(), c.q(), cfg),
                        Catch::Matchers::Contains("only GQA max"));
  }
  SECTION("queries in another dtype than the keys") {
    std::vector<bf16_t> q16 =
        HostCase<bf16_t>::convert(std::vector<float>(c.queries.begin(), c.queries.end()));
    const TensorView q =
        TensorView::contiguous(q16.data(), DType::bf16, Device::cpu, {c.B, c.Hq, c.W, c.D});
    REQUIRE_THROWS_WITH(tool::run_rkv_cuda(c.kv(), q, cfg),
                        Catch::Matchers::Contains("got queries bf16 and keys f32"));
  }
}

namespace {

// A golden `sentences` row (batch, start, end, λ), in the shape SegmentTable reads.
struct MarkedSentence {
  std::int64_t start = 0, end = 0;
  float lambda = -1.0f;
};

// The golden SkipKV case's sentence penalties, built as `kvsift score --policy skipkv` builds them
// (every listed sentence mapped at its generation range, SkipKV §2.3 before any eviction).
SentencePenalties golden_penalties(const std::string& name, HostCase<float>& c) {
  const SafetensorsFile f = SafetensorsFile::load(test::golden_path(name));
  std::vector<std::vector<MarkedSentence>> sentences(static_cast<std::size_t>(c.B));
  if (f.has("sentences")) {
    const std::vector<float> rows = f.get("sentences", {-1, 4}).to_f32();
    for (std::size_t r = 0; r + 3 < rows.size(); r += 4)
      sentences[static_cast<std::size_t>(rows[r])].push_back(
          {static_cast<std::int64_t>(rows[r + 1]), static_cast<std::int64_t>(rows[r + 2]),
           rows[r + 3]});
  }
  SegmentTable table(1, c.B, c.H);
  SentencePenalties penalties(static_cast<std::size_t>(c.B * c.H));
  const KVCacheView kv = c.kv();
  for (std::int64_t b = 0; b < c.B; ++b) {
    std::int64_t pads = 0;
    while (pads < c.S && !kv.is_valid(b, pads)) ++pads;
    table.set_first_position(b, pads);
    table.append_closed(0, b, sentences[b], c.S, c.S);
    for (std::int64_t h = 0; h < c.H; ++h)
      penalties[b * c.H + h] = table.penalty_ranges(0, b, h, sentences[b]);
  }
  return penalties;
}

SentenceScorerConfig skipkv_config(const HostCase<float>& c, PadMode pads) {
  SentenceScorerConfig sc;
  sc.rkv.budget = c.config.at("budget").get<int>();
  sc.rkv.window = static_cast<int>(c.W);
  sc.rkv.kernel = c.config.at("kernel").get<int>();
  sc.rkv.mix_lambda = c.config.at("mix_lambda").get<float>();
  sc.rkv.threshold = c.config.at("threshold").get<float>();
  sc.rkv.redundancy = RedundancyMode::faithful;
  sc.pad_mode = pads;
  return sc;
}

}  // namespace

TEST_CASE("tool score --policy skipkv --device cuda matches the SkipKV reference and the CPU",
          "[cuda][tool][golden]") {
  for (const char* name : {"skipkv_pad.safetensors", "skipkv_sentences.safetensors"}) {
    INFO(name);
    HostCase<float> c(name);
    const SentencePenalties penalties = golden_penalties(name, c);
    const SentenceScorerConfig sc = skipkv_config(c, PadMode::faithful);  // the reference's pads
    const RKVRun gpu = tool::run_skipkv_cuda(c.kv(), c.q(), sc, penalties);
    const SafetensorsFile f = SafetensorsFile::load(test::golden_path(name));
    const std::vector<float> ref_s = f.get("score").to_f32();
    CHECK(outside_tolerance(gpu.importance, f.get("importance").to_f32()) == 0);
    CHECK(outside_tolerance(gpu.redundancy, f.get("redundancy").to_f32()) == 0);
    CHECK(outside_tolerance(gpu.score, ref_s) == 0);
    test::check_kept_sets(gpu.plan, f.get("keep_sorted").to_i64(), ref_s, c.H, c.S, sc.rkv.budget,
                          sc.rkv.window);
    check_compacted_rows(gpu, c);
    const RKVRun cpu = tool::run_skipkv_cpu(c.kv(), c.q(), sc, penalties);
    CHECK(tool::compare_rkv_runs(gpu, cpu, sc.rkv, nullptr).ok());

    // The library default, pads excluded: never kept, and the CPU agrees.
    const SentenceScorerConfig ex = skipkv_config(c, PadMode::exclude);
    const RKVRun gpu_ex = tool::run_skipkv_cuda(c.kv(), c.q(), ex, penalties);
    const RKVRun cpu_ex = tool::run_skipkv_cpu(c.kv(), c.q(), ex, penalties);
    CHECK(tool::compare_rkv_runs(gpu_ex, cpu_ex, ex.rkv, c.mask.data()).ok());
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t i = 0; i < gpu_ex.plan.row_size(b, 0); ++i)
        CHECK(c.mask[b * c.S + gpu_ex.plan.row(b, 0)[i]] == 1);
  }
}

TEST_CASE("demo --device cuda: R-KV's GPU plan for a cache with spare capacity equals the CPU's",
          "[cuda][tool]") {
  // The demo's caches hold more slots than tokens, and its window queries are in the cache dtype.
  HostCase<bf16_t> c("rkv_batch2.safetensors");
  const std::int64_t capacity = c.S + 24;
  std::vector<bf16_t> keys(static_cast<std::size_t>(c.B * c.H * capacity * c.D),
                           from_float<bf16_t>(9.0f));
  std::vector<bf16_t> values(keys.size(), from_float<bf16_t>(-9.0f));
  for (std::int64_t r = 0; r < c.B * c.H; ++r) {
    std::copy_n(&c.keys[r * c.S * c.D], c.S * c.D, &keys[r * capacity * c.D]);
    std::copy_n(&c.values[r * c.S * c.D], c.S * c.D, &values[r * capacity * c.D]);
  }
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(c.B), static_cast<std::int32_t>(c.S));
  const KVCacheView kv = make_kv_cache_view(keys.data(), values.data(), DType::bf16, Device::cpu,
                                            c.B, c.H, capacity, c.D, lengths.data());
  const RKVConfig cfg = c.rkv_config(RedundancyMode::sound);
  RKV gpu_policy(cfg);  // selects on device views (demo_cuda.hpp), through the CUDA backend
  const KeepPlan gpu = demo::select_on_device(gpu_policy, StepInputs{0, kv, c.q()});
  RKV cpu_policy(cfg);
  const KeepPlan cpu = cpu_policy.select(StepInputs{0, kv, c.q()});
  REQUIRE(gpu.kept_lengths() == cpu.kept_lengths());
  const RKVScores s = cpu::rkv_scores(kv, c.q(), cfg);  // the CPU's scores, for the cut
  const std::int64_t keep = cfg.budget - cfg.window;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.H; ++h) {
      std::vector<float> sorted(s.score.row(b, h), s.score.row(b, h) + (c.S - c.W));
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const float cut = sorted[keep - 1];
      std::vector<std::int32_t> diff;
      std::set_symmetric_difference(gpu.row(b, h), gpu.row(b, h) + gpu.row_size(b, h),
                                    cpu.row(b, h), cpu.row(b, h) + cpu.row_size(b, h),
                                    std::back_inserter(diff));
      for (std::int32_t j : diff) {
        INFO("(b=" << b << ", h=" << h << ") slot " << j << " score " << s.score.at(b, h, j)
                   << " cut " << cut);
        CHECK(std::fabs(s.score.at(b, h, j) - cut) <= 1e-6 + 1e-4 * std::fabs(cut));
      }
    }
}
