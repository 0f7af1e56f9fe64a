// `kvsift score --policy skipkv`: SkipKV's sentence scorer (ALGORITHMS.md §2.4) on one
// golden-format case (golden/README.md). Reads `valid_mask` [B,S] (left pads) and `sentences`
// [n,4] rows (batch, start, end, λ; λ = −1: not redundant) when the case has them; the marks are
// taken as decided and every sentence is mapped at its generation range (no earlier eviction).
// `kvsift score` (score.cpp) forwards `--policy skipkv` here: SkipKV has its own flag and inputs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "args.hpp"
#include "device_flag.hpp"
#include "score_rkv_run.hpp"
#if defined(KVSIFT_WITH_CUDA)
#include "score_cuda.hpp"
#endif
#include "kvsift/core/compact.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/sentence_scorer.hpp"

namespace kvsift::tool {

int run_score_skipkv(const std::vector<std::string>& argv);

namespace {

void print_skipkv_help() {
  std::printf(
      "usage: kvsift score --policy skipkv --case IN.safetensors --out OUT.safetensors\n"
      "                    [--pad-mode exclude|faithful] [--budget N] [--window W] [--kernel K]\n"
      "                    [--lambda L] [--threshold T] [--redundancy faithful|sound]\n"
      "                    [--device cpu|cuda] [--compare-cpu] [--tensor-core-search]\n\n"
      "SkipKV eq. 6: score = lambda*a - (1-lambda)*R - sum of the marks of redundant sentences\n"
      "over each token. Reads queries [B,Hq,W,D], keys and values [B,Hkv,S,D] (F32/F16/BF16), and\n"
      "when present valid_mask [B,S] and sentences [n,4] = (batch, start, end, lambda) with\n"
      "lambda = -1 for a sentence that is not redundant. Parameters come from\n"
      "__metadata__.config, flags override them.\n"
      "--pad-mode exclude (default): pads are never kept nor counted; a compressed sequence\n"
      "keeps min(budget, real tokens). faithful: pads score +100 and are force-kept (the SkipKV\n"
      "reference; use it for parity with the golden cases).\n"
      "--redundancy defaults to 'faithful' for a case that names a reference (config key\n"
      "'reference'), else 'sound'.\n"
      "Writes importance, redundancy, redundancy_full, score ([B,Hkv,S-W] / [B,Hkv,S]),\n"
      "keep_sorted (int64 [B,Hkv,K-W], kept slots without the window, -1 past a shorter row),\n"
      "compacted_keys / compacted_values ([B,Hkv,K,D]; K the longest kept row) and\n"
      "__metadata__.config.\n"
      "--device cuda runs eq. 6 on the GPU (kvsift::cuda::skipkv_score / skipkv_select, then\n"
      "kvsift::cuda::compact) and writes the same tensors; queries must be stored in the keys'\n"
      "dtype. --compare-cpu also runs the CPU path and prints the max abs/rel difference of\n"
      "every output and the kept-set agreement; exit 1 outside the golden tolerances. Needs a\n"
      "build with the CUDA backend and a CUDA device.\n");
}

DType key_dtype(const StTensor& t) {
  switch (t.dtype) {
    case StDType::f32:
      return DType::f32;
    case StDType::f16:
      return DType::f16;
    case StDType::bf16:
      return DType::bf16;
    default:
      break;
  }
  KVSIFT_FAIL("keys have dtype ", st_dtype_name(t.dtype), "; expected F32, F16 or BF16");
}

// A closed sentence as the golden rows give it; the shape SegmentTable::penalty_ranges reads.
struct MarkedSentence {
  std::int64_t start = 0, end = 0;
  float lambda = -1.0f;
};

// Flag, else config key, else fallback.
double number(const Args& a, const char* flag, const nlohmann::json& cfg, const char* key,
              double fallback) {
  if (a.has(flag)) return a.real(flag, fallback);
  if (!cfg.contains(key)) return fallback;
  KVSIFT_CHECK(cfg[key].is_number(), "config key '", key, "' must be a number, got ",
               cfg[key].dump());
  return cfg[key].get<double>();
}

}  // namespace

int run_score_skipkv(const std::vector<std::string>& argv) {
  const Args a(argv,
               {"policy", "case", "out", "budget", "window", "kernel", "lambda", "threshold",
                "redundancy", "pad-mode", "device"},
               {"help", "compare-cpu", "tensor-core-search"});
  if (a.has("help")) {
    print_skipkv_help();
    return 0;
  }
  const std::string policy = a.str("policy", "skipkv");
  KVSIFT_CHECK(policy == "skipkv", "this scorer runs --policy skipkv, got '", policy, "'");
  const std::string device = device_setting(a);
  KVSIFT_CHECK(!a.has("compare-cpu") || device == "cuda",
               "--compare-cpu compares the CUDA run with the CPU run: it needs --device cuda");
  KVSIFT_CHECK(!a.has("tensor-core-search") || device == "cuda",
               "--tensor-core-search is a GPU option: it needs --device cuda");
  const std::string in_path = a.required("case"), out_path = a.required("out");
  const SafetensorsFile f = SafetensorsFile::load(in_path);
  nlohmann::json cfg = nlohmann::json::object();
  if (f.metadata().count("config")) {
    cfg = nlohmann::json::parse(f.metadata().at("config"), nullptr, false);
    KVSIFT_CHECK(cfg.is_object(), in_path, ": __metadata__.config is not a JSON object");
  }

  // Inputs, owned here; the views point into them.
  const StTensor& kt = f.get("keys", {-1, -1, -1, -1});
  const std::int64_t B = kt.shape[0], H = kt.shape[1], S = kt.shape[2], D = kt.shape[3];
  KVSIFT_CHECK(B > 0 && H > 0 && S > 0 && D > 0, in_path, ": keys must be non-empty [B,Hkv,S,D]");
  const StTensor& vt = f.get("values", kt.shape);
  KVSIFT_CHECK(vt.dtype == kt.dtype, in_path, ": values dtype ", st_dtype_name(vt.dtype),
               " != keys dtype ", st_dtype_name(kt.dtype));
  const DType dtype = key_dtype(kt);
  std::vector<std::uint8_t> keys = kt.bytes, values = vt.bytes, mask;
  const StTensor& qt = f.get("queries", {B, -1, -1, D});
  std::vector<float> queries = qt.to_f32();
  if (f.has("valid_mask")) {
    for (std::int64_t m : f.get("valid_mask", {B, S}).to_i64()) {
      KVSIFT_CHECK(m == 0 || m == 1, in_path, ": valid_mask holds ", m, ", expected 0 or 1");
      mask.push_back(static_cast<std::uint8_t>(m));
    }
  }
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(B), static_cast<std::int32_t>(S));
  KVCacheView kv = make_kv_cache_view(keys.data(), values.data(), dtype, Device::cpu, B, H, S, D,
                                      lengths.data(), mask.empty() ? nullptr : mask.data());
  const TensorView q = TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                              {B, qt.shape[1], qt.shape[2], D});

  SentenceScorerConfig sc;
  sc.window =
      static_cast<int>(number(a, "window", cfg, "window", static_cast<double>(qt.shape[2])));
  KVSIFT_CHECK(sc.window == qt.shape[2], "window (", sc.window, ") must equal the queries' W (",
               qt.shape[2], ")");
  sc.budget = static_cast<int>(number(a, "budget", cfg, "budget", sc.budget));
  sc.kernel = static_cast<int>(number(a, "kernel", cfg, "kernel", sc.kernel));
  sc.mix_lambda = static_cast<float>(number(a, "lambda", cfg, "mix_lambda", sc.mix_lambda));
  sc.threshold = static_cast<float>(number(a, "threshold", cfg, "threshold", sc.threshold));
  std::string red = cfg.contains("reference") ? "faithful" : "sound";
  if (cfg.contains("redundancy") && cfg["redundancy"].is_string()) red = cfg["redundancy"];
  red = a.str("redundancy", red);
  KVSIFT_CHECK(red == "faithful" || red == "sound",
               "--redundancy must be 'faithful' or 'sound', got '", red, "'");
  sc.redundancy = red == "faithful" ? RedundancyMode::faithful : RedundancyMode::sound;
  sc.pad_mode = parse_pad_mode(a.str("pad-mode", "exclude"));

  // Sentence marks: every listed sentence mapped at its generation range (§2.3 before any
  // eviction); rows of one sequence must be ordered and disjoint (SegmentTable checks).
  std::vector<std::vector<MarkedSentence>> sentences(static_cast<std::size_t>(B));
  if (f.has("sentences")) {
    const std::vector<float> rows = f.get("sentences", {-1, 4}).to_f32();
    for (std::size_t r = 0; r < rows.size() / 4; ++r) {
      const float* row = &rows[4 * r];
      for (int c = 0; c < 3; ++c)
        KVSIFT_CHECK(std::isfinite(row[c]) && row[c] == std::floor(row[c]) && row[c] >= 0 &&
                         row[c] < static_cast<float>(c == 0 ? B : S),
                     in_path, ": sentences row ", r, " column ", c, " = ", row[c],
                     c == 0 ? " is not a batch index" : " is not a position");
      KVSIFT_CHECK(std::isfinite(row[3]) && (row[3] == -1.0f || row[3] >= 0.0f), in_path,
                   ": sentences row ", r, " has lambda ", row[3], " (expected -1 or >= 0)");
      sentences[static_cast<std::size_t>(row[0])].push_back(
          {static_cast<std::int64_t>(row[1]), static_cast<std::int64_t>(row[2]), row[3]});
    }
  }
  SegmentTable table(1, B, H);
  SentencePenalties penalties(static_cast<std::size_t>(B * H));
  std::int64_t marked = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t pads = 0;
    while (pads < S && !kv.is_valid(b, pads)) ++pads;
    table.set_first_position(b, pads);
    table.append_closed(0, b, sentences[b], S, S);
    for (std::int64_t h = 0; h < H; ++h)
      penalties[b * H + h] = table.penalty_ranges(0, b, h, sentences[b]);
    for (const MarkedSentence& s : sentences[b]) marked += s.lambda >= 0.0f ? 1 : 0;
  }

  RKVRun run;
  bool agrees = true;  // --compare-cpu's verdict
  if (device == "cuda") {
#if defined(KVSIFT_WITH_CUDA)
    KVSIFT_CHECK(qt.dtype == kt.dtype,
                 "--device cuda: SkipKV on CUDA needs queries in the keys' dtype; the case stores "
                 "queries as ",
                 st_dtype_name(qt.dtype), " and keys as ", st_dtype_name(kt.dtype),
                 " (use --device cpu)");
    std::vector<std::uint8_t> q_dev = queries_in_dtype(queries, dtype);
    const TensorView q_view = TensorView::contiguous(q_dev.data(), dtype, Device::cpu,
                                                     {B, qt.shape[1], qt.shape[2], D});
    run = run_skipkv_cuda(kv, q_view, sc, penalties, a.has("tensor-core-search"));
    if (a.has("compare-cpu")) {
      // Faithful pads compete for the budget (+100), so the cut is taken over every slot.
      const bool pads_compete = sc.pad_mode == PadMode::faithful || mask.empty();
      agrees = print_rkv_comparison(
          compare_rkv_runs(run, run_skipkv_cpu(kv, q, sc, penalties), sc.rkv_config(),
                           pads_compete ? nullptr : mask.data()));
    }
#endif
  } else {
    run = run_skipkv_cpu(kv, q, sc, penalties);
  }
  const KeepPlan& plan = run.plan;
  const std::int64_t n = S - sc.window;
  SafetensorsFile out;
  out.put_f32("importance", {B, H, n}, run.importance.data());
  out.put_f32("redundancy", {B, H, n}, run.redundancy.data());
  out.put_f32("redundancy_full", {B, H, S}, run.redundancy_full.data());
  out.put_f32("score", {B, H, n}, run.score.data());

  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < B; ++b)
    longest = std::max<std::int64_t>(longest, plan.kept_length(b));
  const std::int64_t tops = std::max<std::int64_t>(0, longest - sc.window);
  std::vector<std::int64_t> keep(static_cast<std::size_t>(B * H * tops), -1);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i + sc.window < plan.row_size(b, h); ++i)
        keep[(b * H + h) * tops + i] = plan.row(b, h)[i];
  out.put_i64("keep_sorted", {B, H, tops}, keep.data());
  const std::size_t row_bytes = static_cast<std::size_t>(D) * dtype_size(dtype);
  for (const char* name : {"compacted_keys", "compacted_values"}) {
    const std::vector<std::uint8_t>& src = name[10] == 'k' ? run.keys : run.values;
    StTensor t;
    t.dtype = kt.dtype;
    t.shape = {B, H, longest, D};
    t.bytes.assign(static_cast<std::size_t>(B * H * longest) * row_bytes, 0);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        std::memcpy(&t.bytes[(b * H + h) * longest * row_bytes], &src[(b * H + h) * S * row_bytes],
                    plan.kept_length(b) * row_bytes);
    out.put(name, std::move(t));
  }
  nlohmann::json echo = {
      {"policy", "skipkv"},          {"budget", sc.budget},
      {"window", sc.window},         {"kernel", sc.kernel},
      {"mix_lambda", sc.mix_lambda}, {"threshold", sc.threshold},
      {"redundancy", red},           {"pad_mode", pad_mode_name(sc.pad_mode)},
      {"marked_sentences", marked},  {"source", in_path},
      {"device", device}};
  if (device == "cuda") echo["tensor_core_search"] = a.has("tensor-core-search");
  out.metadata()["config"] = echo.dump();
  out.save(out_path);
  std::printf("kvsift score: skipkv on %s (B=%lld, Hkv=%lld, S=%lld, D=%lld, %s) -> %s\n",
              in_path.c_str(), static_cast<long long>(B), static_cast<long long>(H),
              static_cast<long long>(S), static_cast<long long>(D),
              std::string(dtype_name(dtype)).c_str(), out_path.c_str());
  std::printf("config: %s\n", echo.dump().c_str());
  return agrees ? 0 : 1;
}

}  // namespace kvsift::tool
