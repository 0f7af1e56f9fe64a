// Reading a golden-format case (golden/README.md) and writing what `kvsift score` computes, for
// every scorer of the tool: score.cpp (the baselines and R-KV) and score_skipkv.cpp (SkipKV). One
// home for the input checks, the flag/config settings and the output layout, so every policy reads
// and writes a case the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "args.hpp"
#include "kvsift/backend/cpu/key_redundancy.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"
#include "kvsift/core/json_number.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "score_rkv_run.hpp"

namespace kvsift::tool {

// Upper bounds of the scorers' integer knobs, refused up front with the flag or key named: a
// budget or window beyond any cache a case can hold, a pooling kernel wider than that.
inline constexpr int kMaxBudget = 1 << 24;
inline constexpr int kMaxKernel = 1 << 16;

// A case's inputs as owned buffers the views point into.
struct ScoreCase {
  std::vector<std::uint8_t> keys, values;  // [B, Hkv, S, D], storage dtype
  std::vector<float> queries;              // [B, Hq, W, D], widened to f32
  StDType query_dtype = StDType::f32;      // how the case stores the queries
  std::vector<std::uint8_t> mask;          // [B, S] (1 = real token) or empty
  std::vector<std::int32_t> lengths;       // [B], all S: golden cases pad through valid_mask
  DType dtype = DType::f32;                // storage dtype of keys and values
  std::int64_t batch = 0, kv_heads = 0, seq = 0, dim = 0, q_heads = 0, window = 0;
  nlohmann::json config = nlohmann::json::object();  // __metadata__.config, {} when absent

  const std::uint8_t* valid_mask() const { return mask.empty() ? nullptr : mask.data(); }
  // [B, Hkv, S, D] over keys / values, every sequence S tokens.
  KVCacheView kv() {
    return make_kv_cache_view(keys.data(), values.data(), dtype, Device::cpu, batch, kv_heads, seq,
                              dim, lengths.data(), mask.empty() ? nullptr : mask.data());
  }
  // [B, Hq, W, D] f32 over queries.
  TensorView q() {
    return TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                  {batch, q_heads, window, dim});
  }
  // The queries [B, Hq, W, D] back in the keys' dtype, as the GPU scorers take them. Exact: the
  // case must store them in that dtype (checked; `scorer` names the GPU path in the error).
  std::vector<std::uint8_t> queries_in_kv_dtype(const char* scorer) const {
    KVSIFT_CHECK(query_dtype == st_dtype_of(dtype), "--device cuda: ", scorer,
                 " on CUDA needs queries in the keys' dtype; the case stores queries as ",
                 st_dtype_name(query_dtype), " and keys as ", st_dtype_name(st_dtype_of(dtype)),
                 " (use --device cpu)");
    return queries_in_dtype(queries, dtype);
  }
};

// Reads and checks queries [B, Hq, W, D], keys and values [B, Hkv, S, D] (F32, F16 or BF16, the
// same for both), the optional valid_mask [B, S] of 0/1, and __metadata__.config (a JSON object).
// `path` names the file in errors. Other tensors (e.g. SkipKV's sentences) stay in `f`.
inline ScoreCase read_score_case(const SafetensorsFile& f, const std::string& path) {
  ScoreCase c;
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
  const std::optional<DType> dtype = storage_dtype_of(k.dtype);
  KVSIFT_CHECK(dtype.has_value(), "tensor 'keys' has dtype ", st_dtype_name(k.dtype),
               "; keys and values must be F32, F16 or BF16");
  c.dtype = *dtype;
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

// A numeric parameter: the flag, else the config key, else `fallback`, within [min, max]. An
// integral T must be written as an integer in both places (a flag "16.7" or a config 16.7 is an
// error, never truncated); a floating T must be finite. One parser for flags
// (core/parse_number.hpp) and config values (core/json_number.hpp), so both fail alike.
template <class T>
T setting(const Args& a, const char* flag, const nlohmann::json& cfg, const char* key, T fallback,
          T min = std::numeric_limits<T>::lowest(), T max = std::numeric_limits<T>::max()) {
  if constexpr (std::is_integral_v<T>) {
    if (a.has(flag)) return a.integer<T>(flag, fallback, min, max);
    return config_integer<T>(cfg, key, fallback, min, max);
  } else {
    if (a.has(flag)) return static_cast<T>(a.real(flag, fallback, min, max));
    return static_cast<T>(config_real(cfg, key, fallback, min, max));
  }
}

// --redundancy, else the config key 'redundancy', else 'faithful' for a case that names a
// reference implementation (config key 'reference'), else 'sound'.
inline RedundancyMode redundancy_setting(const Args& a, const nlohmann::json& cfg) {
  std::string mode = cfg.contains("reference") ? "faithful" : "sound";
  if (cfg.contains("redundancy") && cfg["redundancy"].is_string()) mode = cfg["redundancy"];
  mode = a.str("redundancy", mode);
  if (mode == "faithful") return RedundancyMode::faithful;
  KVSIFT_CHECK(mode == "sound", "--redundancy must be 'faithful' or 'sound', got '", mode, "'");
  return RedundancyMode::sound;
}

inline const char* redundancy_name(RedundancyMode m) {
  return m == RedundancyMode::faithful ? "faithful" : "sound";
}

// One score tensor as `name` [B, Hkv, n]: the first n entries of every row of `s`.
inline void put_scores(SafetensorsFile& out, const std::string& name, const cpu::ScoreTensor& s,
                       std::int64_t n) {
  out.put_f32(name, {s.batch(), s.kv_heads(), n}, dense_scores(s, n).data());
}

// An R-KV-shaped run's score tensors: importance, redundancy, score [B, Hkv, S-W] and
// redundancy_full [B, Hkv, S].
inline void put_run_scores(SafetensorsFile& out, const RKVRun& run) {
  const std::int64_t n = run.candidates();
  out.put_f32("importance", {run.batch, run.kv_heads, n}, run.importance.data());
  out.put_f32("redundancy", {run.batch, run.kv_heads, n}, run.redundancy.data());
  out.put_f32("redundancy_full", {run.batch, run.kv_heads, run.seq}, run.redundancy_full.data());
  out.put_f32("score", {run.batch, run.kv_heads, n}, run.score.data());
}

// keep_sorted (int64 [B, Hkv, K-W], the kept slots without the window, -1 past a shorter row) and
// compacted_keys / compacted_values ([B, Hkv, K, D] in the case's dtype), K the longest kept row.
//   keys, values  [B, Hkv, S, D] already compacted with `plan`: the first plan.kept_length(b) rows
//                 of each (b, h) are the kept tokens in slot order
inline void put_plan(SafetensorsFile& out, const ScoreCase& c, const KeepPlan& plan,
                     std::int64_t window, const std::vector<std::uint8_t>& keys,
                     const std::vector<std::uint8_t>& values) {
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

  const std::size_t row = static_cast<std::size_t>(c.dim) * dtype_size(c.dtype);
  auto put_compacted = [&](const char* name, const std::vector<std::uint8_t>& src) {
    StTensor t;
    t.dtype = st_dtype_of(c.dtype);
    t.shape = {c.batch, c.kv_heads, longest, c.dim};
    t.bytes.assign(static_cast<std::size_t>(c.batch * c.kv_heads * longest) * row, 0);
    // A sequence that keeps nothing (all pads) copies nothing: with every sequence so, t.bytes is
    // empty and indexing it, even for a zero-byte copy, would be undefined.
    for (std::int64_t b = 0; b < c.batch; ++b) {
      const std::size_t kept = static_cast<std::size_t>(plan.kept_length(b)) * row;
      if (kept == 0) continue;
      for (std::int64_t h = 0; h < c.kv_heads; ++h)
        std::memcpy(t.bytes.data() + (b * c.kv_heads + h) * longest * row,
                    src.data() + (b * c.kv_heads + h) * c.seq * row, kept);
    }
    out.put(name, std::move(t));
  };
  put_compacted("compacted_keys", keys);
  put_compacted("compacted_values", values);
}

// Stores `echo` as __metadata__.config, saves `out` and prints the two-line summary every scorer
// ends with.
inline void save_score_output(SafetensorsFile& out, const nlohmann::json& echo,
                              const std::string& policy, const ScoreCase& c,
                              const std::string& in_path, const std::string& out_path) {
  out.metadata()["config"] = echo.dump();
  out.save(out_path);
  std::printf("kvsift score: %s on %s (B=%lld, Hkv=%lld, S=%lld, D=%lld, %s) -> %s\n",
              policy.c_str(), in_path.c_str(), static_cast<long long>(c.batch),
              static_cast<long long>(c.kv_heads), static_cast<long long>(c.seq),
              static_cast<long long>(c.dim), std::string(dtype_name(c.dtype)).c_str(),
              out_path.c_str());
  std::printf("config: %s\n", echo.dump().c_str());
}

}  // namespace kvsift::tool
