// `kvsift score`: runs one registered planning method on a golden-format case (golden/README.md)
// and writes its scores, kept slots and compacted K/V, so any policy can be compared with the
// reference implementations' outputs or inspected offline.
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
#include "kvsift/backend/cpu/attention_mass.hpp"
#include "kvsift/backend/cpu/window_importance.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/config/snapkv_config.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/registry.hpp"
#include "output_path.hpp"
#include "score_rkv_run.hpp"
#if defined(KVSIFT_WITH_CUDA)
#include "demo_cuda.hpp"
#include "score_cuda.hpp"
#endif

namespace kvsift::tool {

// `--policy skipkv` has its own flags (--pad-mode) and inputs (sentences): score_skipkv.cpp.
int run_score_skipkv(const std::vector<std::string>& argv);

namespace {

void print_help() {
  std::string names;
  for (const MethodInfo& m : registered_methods())
    if (!m.owns_cache) names += (names.empty() ? "" : ",") + std::string(m.name);
  std::printf("usage: kvsift score --policy {%s} --case IN.safetensors\n", names.c_str());
  std::printf(
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
      "Every method is built by the registry (make_policy) from the knobs above as JSON, each\n"
      "taking the keys its config has, observes the window queries (H2O: as W decode steps),\n"
      "then select() and compact() give the plan; the config used is echoed.\n"
      "--policy skipkv also takes --pad-mode and reads sentences; see\n"
      "'kvsift score --policy skipkv --help'.\n\n"
      "--device cuda (default cpu) runs select() on device copies of the case (device views:\n"
      "R-KV and SkipKV on CUDA kernels, the others staged to the host by the library), with\n"
      "\"device\": \"cuda\" in the config; --policy rkv also writes the GPU's score tensors\n"
      "(kvsift::cuda::rkv_score). Queries must be stored in the keys' dtype; R-KV needs its\n"
      "defaults (GQA max, max pooling, window mean, no sink). Needs a build with the CUDA\n"
      "backend and a CUDA device. --compare-cpu (with --device cuda) also runs the CPU path,\n"
      "prints the max abs/rel difference of every output and the kept-set agreement, and exits\n"
      "1 unless they agree within the golden tolerances (scores |x-ref| <= 1e-6+1e-4|ref|, kept\n"
      "sets equal up to near-cut swaps, compacted K/V bit-identical on common slots).\n"
      "--fp32-search: the GPU's fp32 near-duplicate search instead of the default bf16 "
      "tensor-core\n"
      "              one (same results, slower; for cross-checks).\n");
}

// The case's and the flags' knobs as one JSON object; each method takes the keys its config has
// (filter_config). Only knobs the case or a flag sets are given, so every method keeps its own
// defaults otherwise (SnapKV's kernel 5, R-KV's 7).
nlohmann::json score_knobs(const Args& a, const nlohmann::json& cfg, int budget, int window) {
  nlohmann::json k = {{"budget", budget}, {"window", window}, {"buffer", std::max(128, window)}};
  if (a.has("kernel") || cfg.contains("kernel"))
    k["kernel"] = setting<int>(a, "kernel", cfg, "kernel", 7, 1, kMaxKernel);
  if (a.has("lambda") || cfg.contains("mix_lambda"))
    k["mix_lambda"] = setting<float>(a, "lambda", cfg, "mix_lambda", 0.1f, 0.0f, 1.0f);
  if (a.has("threshold") || cfg.contains("threshold"))
    k["threshold"] = setting<float>(a, "threshold", cfg, "threshold", 0.5f, -1.0f, 1.0f);
  k["redundancy"] = redundancy_name(redundancy_setting(a, cfg));
  return k;
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
  const MethodInfo& method = method_info(policy);  // unknown: the registry's names listed
  KVSIFT_CHECK(!method.owns_cache, "--policy ", policy,
               " owns its KV cache (a CacheOwningPolicy): a golden-format case is one compression "
               "of an engine's cache, which it never plans; try 'kvsift demo --policies ",
               policy, "'");
  const std::string device = device_setting(a);
  KVSIFT_CHECK(!a.has("compare-cpu") || (device == "cuda" && policy == "rkv"),
               "--compare-cpu compares the CUDA R-KV run with the CPU run: it needs --policy rkv "
               "and --device cuda");
  KVSIFT_CHECK(!a.has("fp32-search") || (device == "cuda" && policy == "rkv"),
               "--fp32-search is a GPU R-KV option: it needs --policy rkv and --device cuda");
  const std::string in_path = a.required("case"), out_path = a.required("out");
  check_output_path(out_path, {in_path});  // before any work (output_path.hpp)
  ScoreCase c = read_score_case(SafetensorsFile::load(in_path), in_path);
  const nlohmann::json& cfg = c.config;
  const int budget = setting<int>(a, "budget", cfg, "budget", 1024, 1, kMaxBudget);
  const int window =
      setting<int>(a, "window", cfg, "window", static_cast<int>(c.window), 1, kMaxBudget);
  KVSIFT_CHECK(window == c.window, "window (", window, ") must equal the queries' W (", c.window,
               ")");
  const std::string config = filter_config(policy, score_knobs(a, cfg, budget, window).dump());
  nlohmann::json echo = nlohmann::json::parse(method.default_config());
  echo.update(nlohmann::json::parse(config));
  echo.update({{"policy", policy}, {"source", in_path}, {"device", device}});
  SafetensorsFile out;
  KVCacheView kv = c.kv();
  StepInputs in{0, kv, c.q()};
  const std::int64_t n = c.seq - window;
  bool agrees = true;  // --compare-cpu's verdict

#if defined(KVSIFT_WITH_CUDA)
  if (device == "cuda" && policy == "rkv") {
    // The GPU's score tensors too (kvsift::cuda::rkv_score), not only its plan.
    const RKVConfig r = RKVConfig{budget,
                                  window,
                                  std::max(128, window),
                                  echo["kernel"].get<int>(),
                                  echo["mix_lambda"].get<float>(),
                                  echo["threshold"].get<float>(),
                                  echo["sink"].get<int>(),
                                  redundancy_setting(a, cfg),
                                  GqaReduce::max};
    std::vector<std::uint8_t> q = c.queries_in_kv_dtype("R-KV");
    const TensorView q_view = TensorView::contiguous(q.data(), c.dtype, Device::cpu,
                                                     {c.batch, c.q_heads, c.window, c.dim});
    const RKVRun run = run_rkv_cuda(kv, q_view, r, a.has("fp32-search"));
    if (a.has("compare-cpu")) {
      const RKVRun cpu_run = run_rkv_cpu(kv, in.window_queries, r);
      agrees = print_rkv_comparison(compare_rkv_runs(run, cpu_run, r, c.valid_mask()));
    }
    echo["fp32_search"] = a.has("fp32-search");
    put_run_scores(out, run);
    put_plan(out, c, run.plan, window, run.keys, run.values);
    save_score_output(out, echo, policy, c, in_path, out_path);
    return agrees ? 0 : 1;
  }
#endif

  // The method's own intermediate scores, from the CPU math it plans with (for comparison with
  // the reference implementations' outputs).
  if (policy == "rkv") {
    RKVConfig r;
    r.budget = budget;
    r.window = window;
    r.buffer = std::max(r.buffer, window);
    r.kernel = echo["kernel"].get<int>();
    r.mix_lambda = echo["mix_lambda"].get<float>();
    r.threshold = echo["threshold"].get<float>();
    r.redundancy = redundancy_setting(a, cfg);
    put_run_scores(out, run_rkv_cpu(kv, in.window_queries, r));
  } else if (policy == "snapkv") {
    SnapKVConfig s;
    s.window = window;
    s.kernel = echo["kernel"].get<int>();
    put_scores(out, "importance",
               cpu::window_importance(kv, in.window_queries, s.importance_config()), n);
  } else if (policy == "h2o") {
    // H2O observes the W window queries as W decode steps: their attention mass.
    cpu::ScoreTensor mass(kv.batch(), kv.kv_heads(), kv.capacity());
    cpu::accumulate_attention(kv, in.window_queries, mass);
    put_scores(out, "attention_mass", mass, c.seq);
    echo["observed_steps"] = window;
  }

  // The plan, as an engine gets it: registry, observe, select, compact.
  std::unique_ptr<Policy> p = make_policy(policy, config);
  Observation obs;
  obs.layer = 0;
  obs.kv = kv;
  obs.queries = in.window_queries;
  p->observe(obs);
  KeepPlan plan;
#if defined(KVSIFT_WITH_CUDA)
  if (device == "cuda") {
    std::vector<std::uint8_t> q = c.queries_in_kv_dtype(policy.c_str());
    in.window_queries = TensorView::contiguous(q.data(), c.dtype, Device::cpu,
                                               {c.batch, c.q_heads, c.window, c.dim});
    plan = demo::select_on_device(*p, in);
  }
#endif
  if (device != "cuda") plan = p->select(in);
  plan.validate();
  compact(c.kv(), plan);
  put_plan(out, c, plan, window, c.keys, c.values);
  save_score_output(out, echo, policy, c, in_path, out_path);
  return agrees ? 0 : 1;
}

const RegisterCommand kRegister{
    {"score", "score a golden-format case with any registered planning method", &run_score}};

}  // namespace
}  // namespace kvsift::tool
