// StagedGroupQuantizer (ThinKV TBQ with the refill rule, docs/algorithms.md §3.2, §3.4): 16-bit
// staging per (thought type, KV head), whole groups only, fresh scales, against the quant/
// whole-tensor path as the oracle; staged evictions; byte count; errors.
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/paged/block_bytes.hpp"
#include "kvsift/paged/staged_group_quantizer.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

constexpr int kDim = 32;

std::vector<float> random_rows(std::mt19937& rng, int tokens, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(static_cast<std::size_t>(tokens * kDim));
  for (float& v : x) v = normal(rng);
  return x;
}

// Fresh quantization of [16, kDim] by the whole-tensor path (KIVI axes), dequantized.
std::vector<float> oracle(const std::vector<float>& x, QuantFormat q, GroupAxis axis, float g) {
  return dequantize_tensor(quantize_tensor(x.data(), 16, kDim, q, axis, g));
}

// Decodes a QuantizedGroup back to [16, kDim] keys and values with the quant/ group decoder.
void decode(const QuantizedGroup& qg, float g, std::vector<float>& k, std::vector<float>& v) {
  const QuantFormat q = quant_format_of(qg.format);
  const int cb = code_bytes_per_group(q);
  k.assign(16 * kDim, 0.0f);
  v.assign(16 * kDim, 0.0f);
  for (int c = 0; c < kDim; ++c)
    dequantize_group(q, &qg.key_codes[c * cb], qg.key_scales[c], g, 16, &k[c], long{kDim});
  for (int t = 0; t < 16; ++t)
    for (int b = 0; b < kDim / 16; ++b) {
      const int grp = t * (kDim / 16) + b;
      dequantize_group(q, &qg.value_codes[grp * cb], qg.value_scales[grp], g, 16,
                       &v[t * kDim + b * 16], 1L);
    }
}

std::vector<float> rounded(const std::vector<float>& x, DType t) {
  std::vector<float> y(x);
  for (float& e : y)
    e = t == DType::f16 ? f16_bits_to_float(float_to_f16_bits(e))
                        : bf16_bits_to_float(float_to_bf16_bits(e));
  return y;
}

}  // namespace

TEST_CASE("tokens wait at 16 bits until a whole group of their type, then get fresh scales",
          "[staged_quantizer]") {
  for (DType staging : {DType::bf16, DType::f16}) {
    StagedGroupQuantizerConfig c;
    c.kv_heads = 2;
    c.head_dim = kDim;
    c.staging = staging;
    c.global_factors = {1.0f, 9.0f};
    StagedGroupQuantizer q(c);
    std::mt19937 rng(1);
    const std::vector<float> k = random_rows(rng, 16, 3.0f), v = random_rows(rng, 16);
    for (int t = 0; t < 15; ++t)
      REQUIRE_FALSE(q.stage(ThoughtType::reasoning, 1, 100 + t, &k[t * kDim], &v[t * kDim]));
    REQUIRE(q.staged_count(ThoughtType::reasoning, 1) == 15);
    REQUIRE(q.staged_count(ThoughtType::reasoning, 0) == 0);
    // Staged tokens read back rounded to the staging dtype, nothing else.
    const std::vector<float> kr = rounded(k, staging), vr = rounded(v, staging);
    std::vector<float> kk(kDim), vv(kDim);
    q.staged_token(ThoughtType::reasoning, 1, 7, kk.data(), vv.data());
    REQUIRE(std::vector<float>(kr.begin() + 7 * kDim, kr.begin() + 8 * kDim) == kk);
    REQUIRE(std::vector<float>(vr.begin() + 7 * kDim, vr.begin() + 8 * kDim) == vv);
    REQUIRE(q.staged_position(ThoughtType::reasoning, 1, 7) == 107);
    QuantizedGroup none;
    REQUIRE_THROWS_WITH(q.take_group(ThoughtType::reasoning, 1, none),
                        Contains("holds 15 of 16 tokens"));
    REQUIRE(q.stage(ThoughtType::reasoning, 1, 115, &k[15 * kDim], &v[15 * kDim]));
    QuantizedGroup g;
    q.take_group(ThoughtType::reasoning, 1, g);
    REQUIRE(q.staged_count(ThoughtType::reasoning, 1) == 0);
    REQUIRE(g.format == BlockFormat::nvfp4);
    for (int i = 0; i < 16; ++i) REQUIRE(g.positions[i] == 100 + i);
    std::vector<float> kd, vd;
    decode(g, 9.0f, kd, vd);
    REQUIRE(kd == oracle(kr, QuantFormat::nvfp4, GroupAxis::token, 9.0f));
    REQUIRE(vd == oracle(vr, QuantFormat::nvfp4, GroupAxis::channel, 9.0f));
  }
}

TEST_CASE("a type change leaves the partial group waiting; types never share a group",
          "[staged_quantizer]") {
  StagedGroupQuantizerConfig c;
  c.kv_heads = 1;
  c.head_dim = kDim;
  c.execution = BlockFormat::fp8;
  StagedGroupQuantizer q(c);
  std::mt19937 rng(2);
  const std::vector<float> k = random_rows(rng, 48), v = random_rows(rng, 48);
  int pos = 0;
  for (int t = 0; t < 10; ++t, ++pos)  // 10 R
    q.stage(ThoughtType::reasoning, 0, pos, &k[pos * kDim], &v[pos * kDim]);
  for (int t = 0; t < 16; ++t, ++pos) {  // 16 T: a whole ternary group
    const bool whole = q.stage(ThoughtType::transition, 0, pos, &k[pos * kDim], &v[pos * kDim]);
    REQUIRE(whole == (t == 15));
  }
  REQUIRE(q.staged_count(ThoughtType::reasoning, 0) == 10);  // not flushed, not padded
  QuantizedGroup g;
  q.take_group(ThoughtType::transition, 0, g);
  REQUIRE(g.format == BlockFormat::ternary);
  REQUIRE(g.positions[0] == 10);
  std::vector<float> kd, vd;
  decode(g, 1.0f, kd, vd);
  const std::vector<float> tk(k.begin() + 10 * kDim, k.begin() + 26 * kDim);
  REQUIRE(kd == oracle(rounded(tk, DType::bf16), QuantFormat::ternary, GroupAxis::token, 1.0f));
  // The R group completes later with R tokens only, positions ascending across the gap.
  for (int t = 0; t < 6; ++t, ++pos)
    q.stage(ThoughtType::reasoning, 0, pos, &k[pos * kDim], &v[pos * kDim]);
  q.take_group(ThoughtType::reasoning, 0, g);
  REQUIRE(g.positions[9] == 9);
  REQUIRE(g.positions[10] == 26);
  // FP8 for E (R8-style option per type).
  for (int t = 0; t < 16; ++t)
    q.stage(ThoughtType::execution, 0, 100 + t, &k[t * kDim], &v[t * kDim]);
  q.take_group(ThoughtType::execution, 0, g);
  REQUIRE(g.format == BlockFormat::fp8);
  decode(g, 1.0f, kd, vd);
  const std::vector<float> ek(k.begin(), k.begin() + 16 * kDim);
  REQUIRE(kd == oracle(rounded(ek, DType::bf16), QuantFormat::fp8, GroupAxis::token, 1.0f));
}

TEST_CASE("an evicted staged token leaves the group; the others keep their order",
          "[staged_quantizer]") {
  StagedGroupQuantizerConfig c;
  c.kv_heads = 1;
  c.head_dim = kDim;
  StagedGroupQuantizer q(c);
  std::mt19937 rng(3);
  const std::vector<float> k = random_rows(rng, 17), v = random_rows(rng, 17);
  for (int t = 0; t < 10; ++t) q.stage(ThoughtType::reasoning, 0, t, &k[t * kDim], &v[t * kDim]);
  REQUIRE(q.find(ThoughtType::reasoning, 0, 4) == 4);
  q.evict(ThoughtType::reasoning, 0, 4);
  REQUIRE(q.find(ThoughtType::reasoning, 0, 4) == -1);
  REQUIRE(q.staged_count(ThoughtType::reasoning, 0) == 9);
  REQUIRE(q.staged_position(ThoughtType::reasoning, 0, 4) == 5);
  for (int t = 10; t < 17; ++t) q.stage(ThoughtType::reasoning, 0, t, &k[t * kDim], &v[t * kDim]);
  QuantizedGroup g;
  q.take_group(ThoughtType::reasoning, 0, g);
  std::vector<float> kept;
  for (int t = 0; t < 17; ++t)
    if (t != 4) kept.insert(kept.end(), k.begin() + t * kDim, k.begin() + (t + 1) * kDim);
  std::vector<float> kd, vd;
  decode(g, 1.0f, kd, vd);
  REQUIRE(kd == oracle(rounded(kept, DType::bf16), QuantFormat::nvfp4, GroupAxis::token, 1.0f));
  REQUIRE(g.positions[4] == 5);
}

TEST_CASE("staging bytes: the buffers held, as block_bytes.hpp counts them", "[staged_quantizer]") {
  StagedGroupQuantizerConfig c;
  c.kv_heads = 4;
  c.head_dim = 64;
  StagedGroupQuantizer q(c);
  // 3 types x 4 heads x 16 tokens x (64 key + 64 value elements x 2 B + 4 B position).
  REQUIRE(q.bytes() == 3 * 4 * 16 * (2 * 64 * 2 + 4));
  REQUIRE(q.bytes() == staging_bytes(4, 64));
}

TEST_CASE("staged quantizer errors name the values", "[staged_quantizer]") {
  StagedGroupQuantizerConfig c;
  c.head_dim = 24;
  REQUIRE_THROWS_WITH(StagedGroupQuantizer(c), Contains("head_dim (24)"));
  c = StagedGroupQuantizerConfig{};
  c.staging = DType::f32;
  REQUIRE_THROWS_WITH(StagedGroupQuantizer(c), Contains("must be f16 or bf16, got f32"));
  c = StagedGroupQuantizerConfig{};
  c.kv_heads = 2;
  c.head_dim = kDim;
  c.global_factors = {1.0f};
  REQUIRE_THROWS_WITH(StagedGroupQuantizer(c), Contains("global_factors has 1 entries"));
  c.global_factors.clear();
  StagedGroupQuantizer q(c);
  std::vector<float> x(kDim, 1.0f);
  REQUIRE_THROWS_WITH(q.stage(ThoughtType::reasoning, 2, 0, x.data(), x.data()),
                      Contains("kv head 2 outside [0, 2)"));
  std::vector<float> bad(x);
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(q.stage(ThoughtType::reasoning, 0, 0, x.data(), bad.data()),
                      Contains("kv head 0 channel 3 is not finite"));
  REQUIRE(q.staged_count(ThoughtType::reasoning, 0) == 0);
  q.stage(ThoughtType::reasoning, 0, 5, x.data(), x.data());
  REQUIRE_THROWS_WITH(q.stage(ThoughtType::reasoning, 0, 5, x.data(), x.data()),
                      Contains("position 5 does not follow 5"));
  REQUIRE_THROWS_WITH(q.evict(ThoughtType::reasoning, 0, 3),
                      Contains("staged token 3 outside [0, 1)"));
}
