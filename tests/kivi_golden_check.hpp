// The golden README's comparison rule for KIVI stream cases (docs/algorithms.md §5.1), applied to
// a file of outputs under the README's names: integers, full-precision tokens and minimums exact;
// scales within one fp16 ulp; codes exact except ±1 within the stated margin of a half-integer;
// every dequantized element within the stated bound of its input (exact in zero-range groups);
// attn_out within 4e-3 + 4e-3·|ref|. Shared by tests/test_kivi.cpp and the tool's replay test.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/safetensors.hpp"

namespace kvsift::test {

inline double f16_ulp(float x) {  // distance from |x| to the next fp16 up
  const std::uint16_t h = float_to_f16_bits(std::fabs(x));
  return double(f16_bits_to_float(static_cast<std::uint16_t>(h + 1))) - f16_bits_to_float(h);
}

inline void check_same_tensor_meta(const SafetensorsFile& got, const SafetensorsFile& ref,
                                   const std::string& name) {
  INFO("tensor " << name);
  REQUIRE(got.has(name) == ref.has(name));
  if (!ref.has(name)) return;
  CHECK(got.get(name).dtype == ref.get(name).dtype);
  REQUIRE(got.get(name).shape == ref.get(name).shape);
}

// `got`: the implementation's outputs; `ref`: the golden case (inputs and expected outputs).
inline void check_kivi_outputs(const SafetensorsFile& got, const SafetensorsFile& ref) {
  const nlohmann::json cfg = nlohmann::json::parse(ref.metadata().at("config"));
  const int kb = cfg.at("k_bits"), vb = cfg.at("v_bits"), G = cfg.at("group_size");
  const int B = cfg.at("batch"), H = cfg.at("kv_heads"), D = cfg.at("head_dim");
  const int T0 = cfg.at("prefill_len"), N = cfg.at("decode_steps");
  for (const char* n : {"dump_steps", "lengths", "attn_steps", "Kq", "sK", "mK", "K_full", "Vq",
                        "sV", "mV", "V_full", "attn_out"})
    check_same_tensor_meta(got, ref, n);
  for (const char* n : {"dump_steps", "lengths", "attn_steps"}) {
    INFO(n);
    CHECK(got.get(n).to_i64() == ref.get(n).to_i64());
  }
  for (const char* n : {"K_full", "V_full", "mK", "mV"}) {
    if (!ref.has(n)) continue;
    INFO(n);
    CHECK(got.get(n).bytes == ref.get(n).bytes);  // exact, bit for bit
  }
  long scale_bad = 0;
  for (const char* n : {"sK", "sV"}) {
    const auto a = got.get(n).to_f32(), r = ref.get(n).to_f32();
    for (std::size_t i = 0; i < r.size(); ++i)
      if (std::fabs(double(a[i]) - r[i]) > f16_ulp(r[i])) ++scale_bad;
  }
  CHECK(scale_bad == 0);

  // Inputs of the stream: token t of (b, h) is prefill token t, then decode token t − T0.
  const auto pk = ref.get("prefill_keys").to_f32(), dk = ref.get("decode_keys").to_f32();
  const auto pv = ref.get("prefill_values").to_f32(), dv = ref.get("decode_values").to_f32();
  auto input = [&](bool key, int b, int h, std::int64_t t, int d) -> float {
    const std::size_t bh = static_cast<std::size_t>(b) * H + h;
    if (t < T0) return (key ? pk : pv)[(bh * T0 + t) * D + d];
    return (key ? dk : dv)[(bh * N + (t - T0)) * D + d];
  };
  // Unpacks code j of a row of int32 words (LSB first).
  auto code_at = [](const std::vector<std::int64_t>& w, std::size_t row, std::int64_t words,
                    int bits, std::int64_t j) -> int {
    const int per = 32 / bits;
    const auto word = static_cast<std::uint32_t>(w[row * words + j / per]);
    return static_cast<int>((word >> (bits * (j % per))) & ((1u << bits) - 1u));
  };
  long code_bad = 0, deq_bad = 0, zero_range_bad = 0;
  for (int key = 0; key <= 1; ++key) {
    const int bits = key ? kb : vb;
    const auto& qt = ref.get(key ? "Kq" : "Vq");
    const auto gq = got.get(key ? "Kq" : "Vq").to_i64(), rq = qt.to_i64();
    const auto gs = got.get(key ? "sK" : "sV").to_f32(), rs = ref.get(key ? "sK" : "sV").to_f32();
    const auto gm = got.get(key ? "mK" : "mV").to_f32(), rm = ref.get(key ? "mK" : "mV").to_f32();
    const std::int64_t outer = qt.shape[2], words = qt.shape[3];
    const std::int64_t inner = words * 32 / bits;  // key: tokens per channel; value: channels
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (std::int64_t o = 0; o < outer; ++o) {
          const std::size_t row = (static_cast<std::size_t>(b) * H + h) * outer + o;
          for (std::int64_t j = 0; j < inner; ++j) {
            const std::size_t p = row * (inner / G) + j / G;  // group params index
            const std::int64_t t = key ? j : o;
            const int d = static_cast<int>(key ? o : j);
            const float x = input(key, b, h, t, d);
            const int cg = code_at(gq, row, words, bits, j), cr = code_at(rq, row, words, bits, j);
            if (cg != cr) {
              const double u = (double(x) - rm[p]) / rs[p];
              const double fr = u - std::floor(u);
              if (!(std::abs(cg - cr) == 1 &&
                    std::fabs(fr - 0.5) <= 1e-3 + std::fabs(u) * std::ldexp(1.0, -9)))
                ++code_bad;
            }
            const double xh = double(cg) * gs[p] + gm[p];
            if (rs[p] == 0.0f) {
              if (xh != x) ++zero_range_bad;
            } else if (std::fabs(xh - x) >
                       rs[p] * (0.5 + std::ldexp(1.0, -9) * ((1 << bits) - 1) + 1e-3) +
                           f16_ulp(x)) {
              ++deq_bad;
            }
          }
        }
  }
  CHECK(code_bad == 0);
  CHECK(deq_bad == 0);
  CHECK(zero_range_bad == 0);
  const auto ao = got.get("attn_out").to_f32(), ar = ref.get("attn_out").to_f32();
  long attn_bad = 0;
  for (std::size_t i = 0; i < ar.size(); ++i)
    if (!(std::fabs(double(ao[i]) - ar[i]) <= 4e-3 + 4e-3 * std::fabs(ar[i]))) ++attn_bad;
  CHECK(attn_bad == 0);
}

}  // namespace kvsift::test
