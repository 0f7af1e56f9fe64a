// A LazyEviction stream case (golden/README.md "LazyEviction"): reading its config and inputs
// from a safetensors file, and writing the stream's record under the README's tensor names,
// shapes and dtypes (rows sorted by original position, padded with −1). Used by
// `kvsift replay` and the golden tests (docs/algorithms.md §5.3).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvsift/core/json_number.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/baselines/lazy_stream.hpp"

namespace kvsift::lazy {

struct Case {
  StreamShape shape;
  LazyConfig cfg;
  bool fp16 = false;                                             // the model dtype
  std::vector<float> prefill_keys, decode_keys, decode_queries;  // see run_stream
};

inline Case load_case(const SafetensorsFile& f) {
  KVSIFT_CHECK(f.metadata().count("config") != 0,
               "lazy case: no __metadata__.config (expected the README's config keys)");
  const nlohmann::json cfg = nlohmann::json::parse(f.metadata().at("config"), nullptr, false);
  KVSIFT_CHECK(cfg.is_object(), "lazy case: __metadata__.config is not a JSON object");
  const auto req = [&](const char* k) -> const nlohmann::json& {
    KVSIFT_CHECK(cfg.contains(k), "lazy case: config key '", k, "' is missing");
    return cfg.at(k);
  };
  const auto integer = [&](const char* k, std::int64_t lo) {
    return json_integer<std::int64_t>(req(k), std::string("config key '") + k + "'", lo,
                                      std::int64_t(1) << 30);
  };
  Case c;
  c.shape.q_heads = integer("q_heads", 1);
  c.shape.kv_heads = integer("kv_heads", 1);
  c.shape.head_dim = integer("head_dim", 1);
  c.shape.prefill = integer("prefill_len", 0);
  c.shape.steps = integer("decode_steps", 1);
  c.cfg.budget = int(integer("budget", 2));
  c.cfg.window = int(integer("window", 1));
  c.cfg.alpha = json_float(req("alpha"), "config key 'alpha'", 0.0f, 1.0f);
  const nlohmann::json& dt = req("dtype");
  KVSIFT_CHECK(dt.is_string() && (dt == "float32" || dt == "float16"),
               "lazy case: config key 'dtype' must be \"float32\" or \"float16\", got ", dt.dump());
  c.fp16 = dt == "float16";
  c.cfg.counters = c.fp16 ? LazyCounters::fp16 : LazyCounters::int32;
  c.cfg.scope = LazyScope::query_head;
  c.cfg.validate();
  const StTensor& pk =
      f.get("prefill_keys", {1, c.shape.kv_heads, c.shape.prefill, c.shape.head_dim});
  const StTensor& dk = f.get("decode_keys", {1, c.shape.kv_heads, c.shape.steps, c.shape.head_dim});
  const StTensor& dq =
      f.get("decode_queries", {1, c.shape.q_heads, c.shape.steps, c.shape.head_dim});
  const StDType want = c.fp16 ? StDType::f16 : StDType::f32;
  for (const auto* t : {&pk, &dk, &dq})
    KVSIFT_CHECK(t->dtype == want, "lazy case: inputs must be ", st_dtype_name(want),
                 " (config dtype ", dt.get<std::string>(), "), got ", st_dtype_name(t->dtype));
  c.prefill_keys = pk.to_f32();
  c.decode_keys = dk.to_f32();
  c.decode_queries = dq.to_f32();
  return c;
}

// Rows [rows][width] padded with `pad`; width = the longest row.
template <class T>
std::vector<T> padded(const std::vector<std::vector<T>>& rows, std::int64_t width, T pad) {
  std::vector<T> out;
  for (const auto& r : rows) {
    out.insert(out.end(), r.begin(), r.end());
    out.insert(out.end(), std::size_t(width) - r.size(), pad);
  }
  return out;
}

// The README's output tensors of a stream result.
inline SafetensorsFile write_outputs(const StreamResult& r, const Case& c) {
  SafetensorsFile f;
  const std::int64_t E = std::int64_t(r.evictions.size()), H = c.shape.q_heads;
  std::vector<std::int32_t> steps;
  std::int64_t C = 0, K = 0;
  for (const auto& e : r.evictions) {
    steps.push_back(std::int32_t(e.step));
    for (const auto& p : e.cand_pos) C = std::max<std::int64_t>(C, std::int64_t(p.size()));
    for (const auto& p : e.kept_pos) K = std::max<std::int64_t>(K, std::int64_t(p.size()));
  }
  f.put("evict_steps", StTensor::from_i32({E}, steps));
  f.put("hit_count", StTensor::from_i32({c.shape.steps, H}, r.hit_count));
  std::vector<std::int32_t> cp, kp;
  std::vector<float> cs, ct, cm, kt, km;
  for (const auto& e : r.evictions) {
    for (const auto& x : padded(e.cand_pos, C, -1)) cp.push_back(x);
    for (const auto& x : padded(e.cand_score, C, -1.0f)) cs.push_back(x);
    for (const auto& x : padded(e.cand_ts, C, -1.0f)) ct.push_back(x);
    for (const auto& x : padded(e.cand_mri, C, -1.0f)) cm.push_back(x);
    for (const auto& x : padded(e.kept_pos, K, -1)) kp.push_back(x);
    for (const auto& x : padded(e.kept_ts, K, -1.0f)) kt.push_back(x);
    for (const auto& x : padded(e.kept_mri, K, -1.0f)) km.push_back(x);
  }
  f.put("cand_pos", StTensor::from_i32({E, H, C}, cp));
  f.put_f32("cand_score", {E, H, C}, cs.data());
  f.put_f32("cand_ts", {E, H, C}, ct.data());
  f.put_f32("cand_mri", {E, H, C}, cm.data());
  f.put("kept_pos", StTensor::from_i32({E, H, K}, kp));
  f.put_f32("kept_ts", {E, H, K}, kt.data());
  f.put_f32("kept_mri", {E, H, K}, km.data());
  std::int64_t F = 0;
  for (const auto& p : r.final_pos) F = std::max<std::int64_t>(F, std::int64_t(p.size()));
  f.put("final_pos", StTensor::from_i32({H, F}, padded(r.final_pos, F, -1)));
  f.put_f32("final_ts", {H, F}, padded(r.final_ts, F, -1.0f).data());
  f.put_f32("final_mri", {H, F}, padded(r.final_mri, F, -1.0f).data());
  return f;
}

}  // namespace kvsift::lazy
