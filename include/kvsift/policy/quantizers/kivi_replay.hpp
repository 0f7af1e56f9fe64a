// Runs a KIVI stream case in the golden format (docs/algorithms.md §5.1; the case's tensors and
// config keys are those of the golden README's KIVI section) and returns every output tensor under
// the same names, shapes and dtypes: dump_steps, lengths, Kq, sK, mK, K_full (absent when empty),
// Vq, sV, mV, V_full, attn_steps, attn_out. Used by `kvsift replay` and the golden parity tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/json_number.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/quantizers/kivi.hpp"

namespace kvsift {
namespace kivi_detail {

inline int required_int(const nlohmann::json& cfg, const char* key, int min, int max) {
  KVSIFT_CHECK(cfg.contains(key), "KIVI case: missing config key '", key, "'");
  return json_integer<int>(cfg.at(key), std::string("config key '") + key + "'", min, max);
}

inline StTensor f16_tensor(std::vector<std::int64_t> shape, const std::vector<float>& v) {
  StTensor t;
  t.dtype = StDType::f16;
  t.shape = std::move(shape);
  t.bytes.resize(v.size() * 2);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::uint16_t h = float_to_f16_bits(v[i]);
    std::memcpy(t.bytes.data() + 2 * i, &h, 2);
  }
  return t;
}

}  // namespace kivi_detail

inline SafetensorsFile kivi_replay(const SafetensorsFile& in) {
  using namespace kivi_detail;
  const auto it = in.metadata().find("config");
  KVSIFT_CHECK(it != in.metadata().end(), "KIVI case: missing __metadata__.config");
  const nlohmann::json cfg = nlohmann::json::parse(it->second, nullptr, false);
  KVSIFT_CHECK(cfg.is_object(), "KIVI case: __metadata__.config is not a JSON object");
  KVSIFT_CHECK(!cfg.contains("dtype") || cfg.at("dtype") == "float16",
               "KIVI case: config key 'dtype' must be \"float16\", got ",
               cfg.value("dtype", nlohmann::json()).dump());
  KiviConfig kc;
  kc.k_bits = required_int(cfg, "k_bits", 1, 16);
  kc.v_bits = required_int(cfg, "v_bits", 1, 16);
  kc.group_size = required_int(cfg, "group_size", 1, 1 << 20);
  kc.residual_length = required_int(cfg, "residual_length", 1, 1 << 24);
  const int B = required_int(cfg, "batch", 1, 1 << 16);
  const int H = required_int(cfg, "kv_heads", 1, 1 << 12);
  const int Hq = required_int(cfg, "q_heads", 1, 1 << 14);
  const int D = required_int(cfg, "head_dim", 1, 1 << 14);
  const int T0 = required_int(cfg, "prefill_len", 0, 1 << 24);
  const int N = required_int(cfg, "decode_steps", 0, 1 << 24);
  KVSIFT_CHECK(cfg.contains("dump_steps") && cfg.at("dump_steps").is_array(),
               "KIVI case: config key 'dump_steps' must be an array");
  std::vector<std::int32_t> dumps;
  for (const auto& d : cfg.at("dump_steps")) {
    const int s = json_integer<int>(d, "config key 'dump_steps'", 0, N);
    KVSIFT_CHECK(dumps.empty() || s > dumps.back(), "KIVI case: dump_steps must increase, got ", s,
                 " after ", dumps.back());
    dumps.push_back(s);
  }
  const std::vector<float> pk = in.get("prefill_keys", {B, H, T0, D}).to_f32();
  const std::vector<float> pv = in.get("prefill_values", {B, H, T0, D}).to_f32();
  const std::vector<float> dk = in.get("decode_keys", {B, H, N, D}).to_f32();
  const std::vector<float> dv = in.get("decode_values", {B, H, N, D}).to_f32();
  std::vector<std::int32_t> attn_steps;
  for (std::int32_t s : dumps)
    if (s >= 1) attn_steps.push_back(s);
  const std::int64_t A = static_cast<std::int64_t>(attn_steps.size());
  const std::vector<float> queries = in.get("queries", {B, Hq, A, D}).to_f32();

  KiviStream stream(kc, B, H, D);
  stream.prefill(pk.data(), pv.data(), T0);
  std::vector<std::int32_t> lengths;
  auto record = [&] {
    const KiviLengths l = stream.lengths(0, 0);
    for (std::int64_t x : {l.quantized_keys, l.full_keys, l.quantized_values, l.full_values})
      lengths.push_back(static_cast<std::int32_t>(x));
  };
  std::size_t next_dump = 0, next_attn = 0;
  if (next_dump < dumps.size() && dumps[next_dump] == 0) {
    record();
    ++next_dump;
  }
  std::vector<float> attn_out(static_cast<std::size_t>(B) * Hq * A * D);
  std::vector<float> k(static_cast<std::size_t>(B) * H * D), v(k.size());
  std::vector<float> q(static_cast<std::size_t>(B) * Hq * D), o(q.size());
  for (int s = 1; s <= N; ++s) {
    for (int bh = 0; bh < B * H; ++bh) {
      const std::size_t src = (static_cast<std::size_t>(bh) * N + (s - 1)) * D;
      std::memcpy(k.data() + bh * D, dk.data() + src, D * sizeof(float));
      std::memcpy(v.data() + bh * D, dv.data() + src, D * sizeof(float));
    }
    stream.append(k.data(), v.data());
    if (next_attn < attn_steps.size() && attn_steps[next_attn] == s) {
      for (int bh = 0; bh < B * Hq; ++bh)
        std::memcpy(q.data() + bh * D, queries.data() + (bh * A + next_attn) * D,
                    D * sizeof(float));
      stream.attend(q.data(), Hq, o.data());
      for (int bh = 0; bh < B * Hq; ++bh)
        std::memcpy(attn_out.data() + (bh * A + next_attn) * D, o.data() + bh * D,
                    D * sizeof(float));
      ++next_attn;
    }
    stream.after_attention();
    if (next_dump < dumps.size() && dumps[next_dump] == s) {
      record();
      ++next_dump;
    }
  }

  // Final state, packed as the reference stores it (int32 words, LSB first).
  const KiviLengths fin = stream.lengths(0, 0);
  const std::int64_t Tqk = fin.quantized_keys, Tfk = fin.full_keys;
  const std::int64_t Tqv = fin.quantized_values, Tfv = fin.full_values;
  const int G = kc.group_size;
  std::vector<std::int32_t> Kq, Vq;
  std::vector<float> sK, mK, sV, mV, Kf, Vf;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const KiviHeadState& st = stream.head(b, h);
      const KiviLengths l = stream.lengths(b, h);
      KVSIFT_CHECK(l.quantized_keys == Tqk && l.full_keys == Tfk && l.quantized_values == Tqv &&
                       l.full_values == Tfv,
                   "KIVI case: sequences of one case must have equal lengths");
      std::vector<std::uint16_t> col(static_cast<std::size_t>(Tqk));
      for (int d = 0; d < D; ++d) {
        for (std::int64_t t = 0; t < Tqk; ++t) col[t] = st.kq_codes[t * D + d];
        for (std::uint32_t w : pack_codes(col.data(), Tqk, kc.k_bits, 32, PackOrder::lsb_first))
          Kq.push_back(static_cast<std::int32_t>(w));
        for (std::int64_t g = 0; g < Tqk / G; ++g) {
          sK.push_back(st.kq_params[g * D + d].scale);
          mK.push_back(st.kq_params[g * D + d].zero);
        }
      }
      for (std::int64_t t = 0; t < Tqv; ++t) {
        for (std::uint32_t w :
             pack_codes(st.vq_codes.data() + t * D, D, kc.v_bits, 32, PackOrder::lsb_first))
          Vq.push_back(static_cast<std::int32_t>(w));
        for (int g = 0; g < D / G; ++g) {
          sV.push_back(st.vq_params[t * (D / G) + g].scale);
          mV.push_back(st.vq_params[t * (D / G) + g].zero);
        }
      }
      Kf.insert(Kf.end(), st.k_full.begin(), st.k_full.end());
      Vf.insert(Vf.end(), st.v_full.begin(), st.v_full.end());
    }

  SafetensorsFile out;
  out.metadata() = in.metadata();
  out.put("dump_steps", StTensor::from_i32({static_cast<std::int64_t>(dumps.size())}, dumps));
  out.put("lengths", StTensor::from_i32({static_cast<std::int64_t>(dumps.size()), 4}, lengths));
  out.put("Kq", StTensor::from_i32({B, H, D, Tqk * kc.k_bits / 32}, Kq));
  out.put("sK", f16_tensor({B, H, D, Tqk / G}, sK));
  out.put("mK", f16_tensor({B, H, D, Tqk / G}, mK));
  if (Tfk > 0) out.put("K_full", f16_tensor({B, H, Tfk, D}, Kf));
  out.put("Vq", StTensor::from_i32({B, H, Tqv, D * kc.v_bits / 32}, Vq));
  out.put("sV", f16_tensor({B, H, Tqv, D / G}, sV));
  out.put("mV", f16_tensor({B, H, Tqv, D / G}, mV));
  out.put("V_full", f16_tensor({B, H, Tfv, D}, Vf));
  out.put("attn_steps", StTensor::from_i32({A}, attn_steps));
  out.put_f32("attn_out", {B, Hq, A, D}, attn_out.data());
  return out;
}

}  // namespace kvsift
