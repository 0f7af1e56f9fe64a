// `kvsift score --policy skipkv`: SkipKV's sentence scorer (docs/algorithms.md §2.4) on one
// golden-format case (golden/README.md). Reads `valid_mask` [B,S] (left pads) and `sentences`
// [n,4] rows (batch, start, end, λ; λ = −1: not redundant) when the case has them; the marks are
// taken as decided and every sentence is mapped at its generation range (no earlier eviction).
// `kvsift score` (score.cpp) forwards `--policy skipkv` here: SkipKV has its own flag and inputs.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "args.hpp"
#include "case_io.hpp"
#include "device_flag.hpp"
#include "output_path.hpp"
#include "score_rkv_run.hpp"
#if defined(KVSIFT_WITH_CUDA)
#include "score_cuda.hpp"
#endif
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"

namespace kvsift::tool {

int run_score_skipkv(const std::vector<std::string>& argv);

namespace {

void print_skipkv_help() {
  std::printf(
      "usage: kvsift score --policy skipkv --case IN.safetensors --out OUT.safetensors\n"
      "                    [--pad-mode exclude|faithful] [--budget N] [--window W] [--kernel K]\n"
      "                    [--lambda L] [--threshold T] [--redundancy faithful|sound]\n"
      "                    [--device cpu|cuda] [--compare-cpu] [--fp32-search]\n\n"
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

// A closed sentence as the golden rows give it; the shape SegmentTable::penalty_ranges reads.
struct MarkedSentence {
  std::int64_t start = 0, end = 0;
  float lambda = -1.0f;
};

}  // namespace

int run_score_skipkv(const std::vector<std::string>& argv) {
  const Args a(argv,
               {"policy", "case", "out", "budget", "window", "kernel", "lambda", "threshold",
                "redundancy", "pad-mode", "device"},
               {"help", "compare-cpu", "fp32-search"});
  if (a.has("help")) {
    print_skipkv_help();
    return 0;
  }
  const std::string policy = a.str("policy", "skipkv");
  KVSIFT_CHECK(policy == "skipkv", "this scorer runs --policy skipkv, got '", policy, "'");
  const std::string device = device_setting(a);
  KVSIFT_CHECK(!a.has("compare-cpu") || device == "cuda",
               "--compare-cpu compares the CUDA run with the CPU run: it needs --device cuda");
  KVSIFT_CHECK(!a.has("fp32-search") || device == "cuda",
               "--fp32-search is a GPU option: it needs --device cuda");
  const std::string in_path = a.required("case"), out_path = a.required("out");
  check_output_path(out_path, {in_path});  // before any work (output_path.hpp)
  const SafetensorsFile f = SafetensorsFile::load(in_path);
  ScoreCase input = read_score_case(f, in_path);
  const nlohmann::json& cfg = input.config;
  const std::int64_t B = input.batch, H = input.kv_heads, S = input.seq;
  KVCacheView kv = input.kv();
  const TensorView q = input.q();

  // Strict numbers (case_io.hpp setting()): a fractional, non-finite or out-of-range budget,
  // window or kernel is an error, never truncated or cast from NaN.
  SentenceScorerConfig sc;
  sc.rkv.window =
      setting<int>(a, "window", cfg, "window", static_cast<int>(input.window), 1, kMaxBudget);
  KVSIFT_CHECK(sc.rkv.window == input.window, "window (", sc.rkv.window,
               ") must equal the queries' W (", input.window, ")");
  sc.rkv.budget = setting<int>(a, "budget", cfg, "budget", sc.rkv.budget, 1, kMaxBudget);
  sc.rkv.kernel = setting<int>(a, "kernel", cfg, "kernel", sc.rkv.kernel, 1, kMaxKernel);
  sc.rkv.mix_lambda = setting<float>(a, "lambda", cfg, "mix_lambda", sc.rkv.mix_lambda, 0.0f, 1.0f);
  sc.rkv.threshold =
      setting<float>(a, "threshold", cfg, "threshold", sc.rkv.threshold, -1.0f, 1.0f);
  sc.rkv.redundancy = redundancy_setting(a, cfg);
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
    std::vector<std::uint8_t> q_dev = input.queries_in_kv_dtype("SkipKV");
    const TensorView q_view = TensorView::contiguous(q_dev.data(), input.dtype, Device::cpu,
                                                     {B, input.q_heads, input.window, input.dim});
    run = run_skipkv_cuda(kv, q_view, sc, penalties, a.has("fp32-search"));
    if (a.has("compare-cpu")) {
      // Faithful pads compete for the budget (+100), so the cut is taken over every slot.
      const bool pads_compete = sc.pad_mode == PadMode::faithful || input.mask.empty();
      agrees =
          print_rkv_comparison(compare_rkv_runs(run, run_skipkv_cpu(kv, q, sc, penalties), sc.rkv,
                                                pads_compete ? nullptr : input.valid_mask()));
    }
#endif
  } else {
    run = run_skipkv_cpu(kv, q, sc, penalties);
  }
  SafetensorsFile out;
  put_run_scores(out, run);
  put_plan(out, input, run.plan, sc.rkv.window, run.keys, run.values);
  nlohmann::json echo = {{"policy", "skipkv"},
                         {"budget", sc.rkv.budget},
                         {"window", sc.rkv.window},
                         {"kernel", sc.rkv.kernel},
                         {"mix_lambda", sc.rkv.mix_lambda},
                         {"threshold", sc.rkv.threshold},
                         {"redundancy", redundancy_name(sc.rkv.redundancy)},
                         {"pad_mode", pad_mode_name(sc.pad_mode)},
                         {"marked_sentences", marked},
                         {"source", in_path},
                         {"device", device}};
  if (device == "cuda") echo["fp32_search"] = a.has("fp32-search");
  save_score_output(out, echo, "skipkv", input, in_path, out_path);
  return agrees ? 0 : 1;
}

}  // namespace kvsift::tool
