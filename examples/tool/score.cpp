// `kvsift score`: runs one baseline policy on a golden-format case (golden/README.md) and writes
// its scores, kept slots and compacted K/V, so any policy can be compared with the reference
// implementations' outputs or inspected offline.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "args.hpp"
#include "command.hpp"
#include "device_flag.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/full_kv.hpp"
#include "kvsift/policy/h2o.hpp"
#include "kvsift/policy/rkv.hpp"
#include "kvsift/policy/snapkv.hpp"
#include "kvsift/policy/streaming_llm.hpp"
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
      "                    [--device cpu|cuda] [--compare-cpu] [--tensor-core-search]\n\n"
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
      "--tensor-core-search: the GPU's bf16 tensor-core near-duplicate search (same results).\n");
}

StDType storage_st_dtype(DType t) {
  return t == DType::f32 ? StDType::f32 : t == DType::f16 ? StDType::f16 : StDType::bf16;
}
DType storage_dtype(const StTensor& t, const char* name) {
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
  KVSIFT_FAIL("tensor '", name, "' has dtype ", st_dtype_name(t.dtype),
              "; keys and values must be F32, F16 or BF16");
}

// The case with its tensors as owned buffers the views point into.
struct Case {
  std::vector<std::uint8_t> keys, values;  // [B, Hkv, S, D], storage dtype
  std::vector<float> queries;              // [B, Hq, W, D]
  StDType query_dtype = StDType::f32;      // how the case stores the queries
  std::vector<std::uint8_t> mask;          // [B, S] or empty
  std::vector<std::int32_t> lengths;       // [B], all S
  DType dtype = DType::f32;
  std::int64_t batch = 0, kv_heads = 0, seq = 0, dim = 0, q_heads = 0, window = 0;
  nlohmann::json config = nlohmann::json::object();

  KVCacheView kv() {
    return make_kv_cache_view(keys.data(), values.data(), dtype, Device::cpu, batch, kv_heads, seq,
                              dim, lengths.data(), mask.empty() ? nullptr : mask.data());
  }
  TensorView q() {
    return TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                  {batch, q_heads, window, dim});
  }
};

Case load_case(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::load(path);
  Case c;
  const auto meta = f.metadata().find("config");
  if (meta != f.metadata().end()) {
    c.config = nlohmann::json::parse(meta->second, nullptr, /*allow_exceptions=*/false);
    KVSIFT_CHECK(c.config.is_object(), path, ": __metadata__.config is not a JSON object");
  }
  const StTensor& k = f.get("keys", {-1, -1, -1, -1});
  c.batch = k.shape[0], c.kv_heads = k.shape[1], c.seq = k.shape[2], c.dim = k.shape[3];
  KVSIFT_CHECK(c.batch > 0 && c.kv_heads > 0 && c.seq > 0 && c.dim > 0, path,
               ": keys must be non-empty [B, Hkv, S, D]");
  const StTensor& v = f.get("values", k.shape);
  c.dtype = storage_dtype(k, "keys");
  KVSIFT_CHECK(v.dtype == k.dtype, path, ": values dtype ", st_dtype_name(v.dtype),
               " != keys dtype ", st_dtype_name(k.dtype));
  c.keys = k.bytes;
  c.values = v.bytes;
  const StTensor& q = f.get("queries", {c.batch, -1, -1, c.dim});
  c.q_heads = q.shape[1], c.window = q.shape[2];
  c.queries = q.to_f32();
  c.query_dtype = q.dtype;
  if (f.has("valid_mask")) {
    const std::vector<std::int64_t> m = f.get("valid_mask", {c.batch, c.seq}).to_i64();
    for (std::int64_t x : m)
      KVSIFT_CHECK(x == 0 || x == 1, path, ": valid_mask holds ", x, ", expected 0 or 1");
    c.mask.assign(m.begin(), m.end());
  }
  c.lengths.assign(static_cast<std::size_t>(c.batch), static_cast<std::int32_t>(c.seq));
  return c;
}

// Flag, else config key, else fallback.
template <class T>
T setting(const Args& a, const char* flag, const nlohmann::json& cfg, const char* key, T fallback) {
  if (a.has(flag)) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(a.integer(flag, 0));
    } else {
      return static_cast<T>(a.real(flag, 0));
    }
  }
  if (cfg.contains(key)) {
    KVSIFT_CHECK(cfg[key].is_number(), "config key '", key, "' must be a number, got ",
                 cfg[key].dump());
    return cfg[key].get<T>();
  }
  return fallback;
}

RedundancyMode redundancy_setting(const Args& a, const nlohmann::json& cfg) {
  std::string mode = cfg.contains("reference") ? "faithful" : "sound";
  if (cfg.contains("redundancy") && cfg["redundancy"].is_string()) mode = cfg["redundancy"];
  mode = a.str("redundancy", mode);
  if (mode == "faithful") return RedundancyMode::faithful;
  KVSIFT_CHECK(mode == "sound", "--redundancy must be 'faithful' or 'sound', got '", mode, "'");
  return RedundancyMode::sound;
}

void put_scores(SafetensorsFile& out, const std::string& name, const cpu::ScoreTensor& s,
                std::int64_t n) {
  std::vector<float> data(static_cast<std::size_t>(s.batch() * s.kv_heads() * n));
  for (std::int64_t b = 0; b < s.batch(); ++b)
    for (std::int64_t h = 0; h < s.kv_heads(); ++h)
      std::copy(s.row(b, h), s.row(b, h) + n, data.begin() + (b * s.kv_heads() + h) * n);
  out.put_f32(name, {s.batch(), s.kv_heads(), n}, data.data());
}

// keep_sorted and the compacted K/V of `plan`: `keys` / `values` [B, Hkv, S, D] already compacted
// by the device that ran the policy, or nullptr to apply `plan` to the case's own buffers here.
void put_plan(SafetensorsFile& out, Case& c, const KeepPlan& plan, std::int64_t window,
              const std::vector<std::uint8_t>* keys, const std::vector<std::uint8_t>* values) {
  std::int64_t longest = 0;
  for (std::int64_t b = 0; b < c.batch; ++b)
    longest = std::max<std::int64_t>(longest, plan.kept_length(b));
  const std::int64_t tops = std::max<std::int64_t>(0, longest - window);
  std::vector<std::int64_t> keep(static_cast<std::size_t>(c.batch * c.kv_heads * tops), -1);
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.kv_heads; ++h)
      for (std::int64_t i = 0; i + window < plan.row_size(b, h); ++i)
        keep[(b * c.kv_heads + h) * tops + i] = plan.row(b, h)[i];
  out.put_i64("keep_sorted", {c.batch, c.kv_heads, tops}, keep.data());

  if (keys == nullptr) {
    compact(c.kv(), plan);
    keys = &c.keys;
    values = &c.values;
  }
  const std::size_t row = static_cast<std::size_t>(c.dim) * dtype_size(c.dtype);
  auto put_compacted = [&](const char* name, const std::vector<std::uint8_t>& src) {
    StTensor t;
    t.dtype = storage_st_dtype(c.dtype);
    t.shape = {c.batch, c.kv_heads, longest, c.dim};
    t.bytes.assign(static_cast<std::size_t>(c.batch * c.kv_heads * longest) * row, 0);
    for (std::int64_t b = 0; b < c.batch; ++b)
      for (std::int64_t h = 0; h < c.kv_heads; ++h)
        std::memcpy(&t.bytes[(b * c.kv_heads + h) * longest * row],
                    &src[(b * c.kv_heads + h) * c.seq * row], plan.kept_length(b) * row);
    out.put(name, std::move(t));
  };
  put_compacted("compacted_keys", *keys);
  put_compacted("compacted_values", *values);
}

void put_dense(SafetensorsFile& out, const std::string& name, const std::vector<float>& data,
               std::int64_t batch, std::int64_t kv_heads, std::int64_t n) {
  out.put_f32(name, {batch, kv_heads, n}, data.data());
}

#if defined(KVSIFT_WITH_CUDA)
// The case's queries [B, Hq, W, D] in the keys' dtype, as the GPU R-KV takes them. Exact: the
// case stores them in that dtype (checked), and Case::queries holds them widened to f32.
std::vector<std::uint8_t> queries_in_kv_dtype(const Case& c) {
  KVSIFT_CHECK(c.query_dtype == storage_st_dtype(c.dtype),
               "--device cuda: R-KV on CUDA needs queries in the keys' dtype; the case stores "
               "queries as ",
               st_dtype_name(c.query_dtype), " and keys as ",
               st_dtype_name(storage_st_dtype(c.dtype)), " (use --device cpu)");
  return queries_in_dtype(c.queries, c.dtype);
}
#endif

int run_score(const std::vector<std::string>& argv) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == "--policy=skipkv" ||
        (argv[i] == "--policy" && i + 1 < argv.size() && argv[i + 1] == "skipkv")) {
      return run_score_skipkv(argv);
    }
  }
  const Args a(
      argv,
      {"policy", "case", "out", "budget", "window", "kernel", "lambda", "threshold", "redundancy",
       "device"},
      {"help", "compare-cpu", "tensor-core-search"});
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
  KVSIFT_CHECK(!a.has("tensor-core-search") || device == "cuda",
               "--tensor-core-search is a GPU option: it needs --device cuda");
  const std::string in_path = a.required("case"), out_path = a.required("out");
  Case c = load_case(in_path);
  const nlohmann::json& cfg = c.config;
  const int budget = setting<int>(a, "budget", cfg, "budget", 1024);
  const int window = setting<int>(a, "window", cfg, "window", static_cast<int>(c.window));
  KVSIFT_CHECK(window == c.window, "window (", window, ") must equal the queries' W (", c.window,
               ")");
  nlohmann::json echo = {
      {"policy", policy}, {"budget", budget},   {"window", window},
      {"source", in_path}, {"device", device}};
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
      std::vector<std::uint8_t> q = queries_in_kv_dtype(c);
      const TensorView q_view = TensorView::contiguous(q.data(), c.dtype, Device::cpu,
                                                       {c.batch, c.q_heads, c.window, c.dim});
      run = run_rkv_cuda(kv, q_view, r, a.has("tensor-core-search"));
      if (a.has("compare-cpu")) {
        const RKVRun cpu_run = run_rkv_cpu(kv, in.window_queries, r);
        agrees = print_rkv_comparison(
            compare_rkv_runs(run, cpu_run, r, c.mask.empty() ? nullptr : c.mask.data()));
      }
      echo["tensor_core_search"] = a.has("tensor-core-search");
#endif
    } else {
      run = run_rkv_cpu(kv, in.window_queries, r);
    }
    put_dense(out, "importance", run.importance, c.batch, c.kv_heads, n);
    put_dense(out, "redundancy", run.redundancy, c.batch, c.kv_heads, n);
    put_dense(out, "redundancy_full", run.redundancy_full, c.batch, c.kv_heads, c.seq);
    put_dense(out, "score", run.score, c.batch, c.kv_heads, n);
    plan = run.plan;
    compacted_keys = &run.keys;
    compacted_values = &run.values;
    echo.update({{"kernel", r.kernel},
                 {"mix_lambda", r.mix_lambda},
                 {"threshold", r.threshold},
                 {"redundancy", r.redundancy == RedundancyMode::faithful ? "faithful" : "sound"},
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
  put_plan(out, c, plan, window, compacted_keys, compacted_values);
  out.metadata()["config"] = echo.dump();
  out.save(out_path);
  std::printf("kvsift score: %s on %s (B=%lld, Hkv=%lld, S=%lld, D=%lld, %s) -> %s\n",
              policy.c_str(), in_path.c_str(), static_cast<long long>(c.batch),
              static_cast<long long>(c.kv_heads), static_cast<long long>(c.seq),
              static_cast<long long>(c.dim), std::string(dtype_name(c.dtype)).c_str(),
              out_path.c_str());
  std::printf("config: %s\n", echo.dump().c_str());
  return agrees ? 0 : 1;
}

const RegisterCommand kRegister{
    {"score", "score a golden-format case with a baseline policy", &run_score}};

}  // namespace
}  // namespace kvsift::tool
