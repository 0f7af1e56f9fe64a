// `kvsift score`: runs one baseline policy on a golden-format case (golden/README.md) and writes
// its scores, kept slots and compacted K/V, so any policy can be compared with the reference
// implementations' outputs or inspected offline.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "args.hpp"
#include "case_io.hpp"
#include "command.hpp"
#include "device_flag.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/baselines/full_kv.hpp"
#include "kvsift/policy/baselines/h2o.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/baselines/snapkv.hpp"
#include "kvsift/policy/baselines/streaming_llm.hpp"
#include "score_rkv_run.hpp"
#if defined(KVSIFT_WITH_CUDA)
#include "score_cuda.hpp"
#endif

namespace kvsift::tool {

// `--policy skipkv` has its own flags (--pad-mode) and inputs (sentences): score_skipkv.cpp.
int run_score_skipkv(const std::vector<std::string>& argv);

namespace {

void print_help() {
  std::printf(
      "usage: kvsift score --policy {rkv,snapkv,h2o,streaming,fullkv,skipkv} --case "
      "IN.safetensors\n"
      "                    --out OUT.safetensors [--budget N] [--window W] [--kernel K]\n"
      "                    [--lambda L] [--threshold T] [--redundancy faithful|sound]\n"
      "                    [--device cpu|cuda] [--compare-cpu] [--fp32-search]\n\n"
      "Reads queries [B,Hq,W,D], keys and values [B,Hkv,S,D] (f32, f16 or bf16) and an optional\n"
      "valid_mask [B,S]; parameters come from __metadata__.config (JSON), flags override them.\n"
      "Writes what the policy computes: importance, redundancy (window sliced), redundancy_full,\n"
      "score (rkv), importance (snapkv), attention_mass (h2o); and for every policy keep_sorted\n"
      "(int64 [B,Hkv,K-W], kept slots without the window, -1 past a shorter row),\n"
      "compacted_keys and compacted_values ([B,Hkv,K,D], sorted kept slots; K = the longest kept\n"
      "row, the budget when every sequence is compressed), and __metadata__.config.\n\n"
      "--redundancy defaults to the case's config key 'redundancy', else 'faithful' for a case\n"
      "that names a reference implementation (config key 'reference'), else 'sound'.\n"
      "--window defaults to the queries' W. SnapKV's own defaults (kernel 5, avg pooling, summed\n"
      "window, mean over GQA groups) apply unless the case or a flag sets kernel. H2O observes "
      "the\n"
      "W window queries as W decode steps.\n"
      "--policy skipkv also takes --pad-mode and reads sentences; see\n"
      "'kvsift score --policy skipkv --help'.\n\n"
      "--device cuda (default cpu) runs --policy rkv on the GPU (kvsift::cuda::rkv_score,\n"
      "rkv_select, compact) and writes the same tensors, with \"device\": \"cuda\" in the\n"
      "config. It needs queries stored in the keys' dtype and R-KV's defaults (GQA max, max\n"
      "pooling, window mean, no sink). --policy skipkv has a GPU path too (see its --help);\n"
      "streaming, h2o, snapkv and fullkv run on the CPU only. Needs a build with the CUDA\n"
      "backend and a CUDA device. --compare-cpu (with --device cuda) also runs the CPU path,\n"
      "prints the max abs/rel difference of every output and the kept-set agreement, and exits\n"
      "1 unless they agree within the golden tolerances (scores |x-ref| <= 1e-6+1e-4|ref|, kept\n"
      "sets equal up to near-cut swaps, compacted K/V bit-identical on common slots).\n"
      "--fp32-search: the GPU's fp32 near-duplicate search instead of the default bf16 "
      "tensor-core\n"
      "              one (same results, slower; for cross-checks).\n");
}

int run_score(const std::vector<std::string>& argv) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--policy=skipkv" ||
        (argv[i] == "--policy" && i + 1 < argv.size() && argv[i + 1] == "skipkv")) {
      return run_score_skipkv(argv);
    }
  }
  const Args a(argv,
               {"policy", "case", "out", "budget", "window", "kernel", "lambda", "threshold",
                "redundancy", "device"},
               {"help", "compare-cpu", "fp32-search"});
  if (a.has("help")) {
    print_help();
    return 0;
  }
  const std::string policy = a.required("policy");
  const bool known = policy == "rkv" || policy == "snapkv" || policy == "h2o" ||
                     policy == "streaming" || policy == "fullkv";
  KVSIFT_CHECK(known, "unknown --policy '", policy,
               "' (known: rkv, snapkv, h2o, streaming, fullkv, skipkv)");
  const std::string device = device_setting(a);
  KVSIFT_CHECK(device == "cpu" || policy == "rkv", "--policy ", policy,
               " has no CUDA path: it runs on --device cpu only (--device cuda supports --policy "
               "rkv and skipkv)");
  KVSIFT_CHECK(!a.has("compare-cpu") || device == "cuda",
               "--compare-cpu compares the CUDA run with the CPU run: it needs --device cuda");
  KVSIFT_CHECK(!a.has("fp32-search") || device == "cuda",
               "--fp32-search is a GPU option: it needs --device cuda");
  const std::string in_path = a.required("case"), out_path = a.required("out");
  ScoreCase c = read_score_case(SafetensorsFile::load(in_path), in_path);
  const nlohmann::json& cfg = c.config;
  const int budget = setting<int>(a, "budget", cfg, "budget", 1024);
  const int window = setting<int>(a, "window", cfg, "window", static_cast<int>(c.window));
  KVSIFT_CHECK(window == c.window, "window (", window, ") must equal the queries' W (", c.window,
               ")");
  nlohmann::json echo = {{"policy", policy},
                         {"budget", budget},
                         {"window", window},
                         {"source", in_path},
                         {"device", device}};
  SafetensorsFile out;
  KVCacheView kv = c.kv();
  StepInputs in{0, kv, c.q()};
  const std::int64_t n = c.seq - window;
  KeepPlan plan;
  RKVRun run;  // rkv: its tensors and its compacted K/V (from the device that ran it)
  const std::vector<std::uint8_t>* compacted_keys = nullptr;
  const std::vector<std::uint8_t>* compacted_values = nullptr;
  bool agrees = true;  // --compare-cpu's verdict

  if (policy == "rkv") {
    RKVConfig r;
    r.budget = budget;
    r.window = window;
    r.buffer = std::max(r.buffer, window);
    r.kernel = setting<int>(a, "kernel", cfg, "kernel", r.kernel);
    r.mix_lambda = setting<float>(a, "lambda", cfg, "mix_lambda", r.mix_lambda);
    r.threshold = setting<float>(a, "threshold", cfg, "threshold", r.threshold);
    r.redundancy = redundancy_setting(a, cfg);
    if (device == "cuda") {
#if defined(KVSIFT_WITH_CUDA)
      std::vector<std::uint8_t> q = c.queries_in_kv_dtype("R-KV");
      const TensorView q_view = TensorView::contiguous(q.data(), c.dtype, Device::cpu,
                                                       {c.batch, c.q_heads, c.window, c.dim});
      run = run_rkv_cuda(kv, q_view, r, a.has("fp32-search"));
      if (a.has("compare-cpu")) {
        const RKVRun cpu_run = run_rkv_cpu(kv, in.window_queries, r);
        agrees = print_rkv_comparison(compare_rkv_runs(run, cpu_run, r, c.valid_mask()));
      }
      echo["fp32_search"] = a.has("fp32-search");
#endif
    } else {
      run = run_rkv_cpu(kv, in.window_queries, r);
    }
    put_run_scores(out, run);
    plan = run.plan;
    compacted_keys = &run.keys;
    compacted_values = &run.values;
    echo.update({{"kernel", r.kernel},
                 {"mix_lambda", r.mix_lambda},
                 {"threshold", r.threshold},
                 {"redundancy", redundancy_name(r.redundancy)},
                 {"sink", r.sink}});
  } else if (policy == "snapkv") {
    SnapKVConfig s;
    s.budget = budget;
    s.window = window;
    s.buffer = std::max(s.buffer, window);
    s.kernel = setting<int>(a, "kernel", cfg, "kernel", s.kernel);
    SnapKV p(s);
    put_scores(out, "importance",
               cpu::window_importance(kv, in.window_queries, s.importance_config()), n);
    plan = p.select(in);
    echo.update({{"kernel", s.kernel}, {"pooling", "avg"}, {"reduction", "sum"}, {"gqa", "mean"}});
  } else if (policy == "h2o") {
    H2OConfig h;
    h.budget = budget;
    H2O p(h);
    p.observe_step(in);
    put_scores(out, "attention_mass", *p.accumulator(0), c.seq);
    plan = p.select(in);
    echo.update({{"recent", h.recent_tokens()}, {"observed_steps", window}});
  } else if (policy == "streaming") {
    StreamingLLMConfig s;
    s.budget = budget;
    StreamingLLM p(s);
    plan = p.select(in);
    echo.update({{"sink", s.sink}});
  } else if (policy == "fullkv") {
    plan = FullKV().select(in);
  }
  plan.validate();
  if (compacted_keys == nullptr) {  // a CPU baseline: compact the case's own buffers here
    compact(c.kv(), plan);
    compacted_keys = &c.keys;
    compacted_values = &c.values;
  }
  put_plan(out, c, plan, window, *compacted_keys, *compacted_values);
  save_score_output(out, echo, policy, c, in_path, out_path);
  return agrees ? 0 : 1;
}

const RegisterCommand kRegister{
    {"score", "score a golden-format case with a baseline policy", &run_score}};

}  // namespace
}  // namespace kvsift::tool
