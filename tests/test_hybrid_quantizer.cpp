// HybridQuantizer (ThinKV TBQ, docs/algorithms.md §3.2): the full-precision buffer, precision per
// thought type, the KIVI grouping, short chunks at type changes, and byte counts worked out by
// hand. Decoded values are checked against the whole-tensor codec (quantized_tensor.hpp) applied to
// the same tokens gathered by hand, which shares only the per-group codec (tested in test_codecs).
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/policy/thinkv/hybrid_quantizer.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {
constexpr int kDim = 32;

std::vector<float> random_rows(std::mt19937& rng, int rows, int dim) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> v(static_cast<std::size_t>(rows) * dim);
  for (float& x : v) x = normal(rng);
  return v;
}

// Oracle: quantize `rows` tokens ([rows, dim], rows <= 16) as the quantizer should, by padding to
// 16 token rows with zeros and using the whole-tensor codec: keys along the token axis, values
// along the channel axis. Returns the first `rows` decoded rows.
std::vector<float> oracle(const std::vector<float>& rows_data, int rows, QuantFormat f,
                          GroupAxis axis, float g) {
  std::vector<float> padded(16 * kDim, 0.0f);
  std::copy(rows_data.begin(), rows_data.begin() + rows * kDim, padded.begin());
  const std::vector<float> back =
      dequantize_tensor(quantize_tensor(padded.data(), 16, kDim, f, axis, g));
  return std::vector<float>(back.begin(), back.begin() + rows * kDim);
}

std::vector<float> slice(const std::vector<float>& v, int from_row, int rows) {
  return std::vector<float>(v.begin() + from_row * kDim, v.begin() + (from_row + rows) * kDim);
}
}  // namespace

TEST_CASE("config defaults are R4 E4 T2 and validation names the bad values", "[hybrid]") {
  HybridQuantizerConfig c;
  REQUIRE(c.format_for(ThoughtType::reasoning) == QuantFormat::nvfp4);
  REQUIRE(c.format_for(ThoughtType::execution) == QuantFormat::nvfp4);
  REQUIRE(c.format_for(ThoughtType::transition) == QuantFormat::ternary);
  c.head_dim = 20;
  REQUIRE_THROWS_WITH(c.validate(), Contains("head_dim (20)"));
  c = HybridQuantizerConfig{};
  c.num_layers = 0;
  REQUIRE_THROWS_WITH(c.validate(), Contains("num_layers (0)"));
  c = HybridQuantizerConfig{};
  c.num_kv_heads = -2;
  REQUIRE_THROWS_WITH(c.validate(), Contains("num_kv_heads (-2)"));
  c = HybridQuantizerConfig{};
  c.value_global_factor = 0.0f;
  REQUIRE_THROWS_WITH(c.validate(), Contains("value_global_factor (0)"));
  c = HybridQuantizerConfig{};
  c.key_global_factor = std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_AS(HybridQuantizer(c), Error);
}

TEST_CASE("tokens wait in the buffer until 16 arrive, then quantize as one chunk", "[hybrid]") {
  HybridQuantizerConfig c;
  c.head_dim = kDim;
  HybridQuantizer q(c);
  std::mt19937 rng(1);
  const std::vector<float> k = random_rows(rng, 16, kDim), v = random_rows(rng, 16, kDim);
  for (int t = 0; t < 15; ++t) q.append(0, 0, ThoughtType::reasoning, &k[t * kDim], &v[t * kDim]);
  REQUIRE(q.chunks(0, 0).empty());
  REQUIRE(q.buffered_tokens(0, 0) == 15);
  // Buffer: 15 tokens x (key + value) x 32 channels x 4 bytes.
  REQUIRE(q.bytes(0, 0).buffer_bytes == 15 * 2 * 32 * 4);
  REQUIRE(q.bytes(0, 0).code_bytes == 0);
  std::vector<float> kd(16 * kDim), vd(16 * kDim);
  q.dequantize(0, 0, kd.data(), vd.data());
  for (int i = 0; i < 15 * kDim; ++i) {  // buffered tokens come back exactly
    REQUIRE(kd[i] == k[i]);
    REQUIRE(vd[i] == v[i]);
  }

  q.append(0, 0, ThoughtType::reasoning, &k[15 * kDim], &v[15 * kDim]);
  REQUIRE(q.buffered_tokens(0, 0) == 0);
  REQUIRE(q.chunks(0, 0).size() == 1);
  REQUIRE(q.num_tokens(0, 0) == 16);
  // NVFP4: keys 32 groups (one per channel) x (8 code + 1 scale) bytes; values 16 tokens x 2
  // groups x (8 + 1). Codes 256 + 256, scales 32 + 32, buffer 0.
  const QuantBytes b = q.bytes(0, 0);
  REQUIRE(b.code_bytes == 512);
  REQUIRE(b.scale_bytes == 64);
  REQUIRE(b.buffer_bytes == 0);
  REQUIRE(b.total() == 576);
  REQUIRE(b.global_factor_bytes == 8);
  q.dequantize(0, 0, kd.data(), vd.data());
  REQUIRE(kd == oracle(k, 16, QuantFormat::nvfp4, GroupAxis::token, 1.0f));
  REQUIRE(vd == oracle(v, 16, QuantFormat::nvfp4, GroupAxis::channel, 1.0f));
}

TEST_CASE("a type change quantizes the partial buffer as a short chunk of its own type",
          "[hybrid]") {
  HybridQuantizerConfig c;
  c.head_dim = kDim;
  HybridQuantizer q(c);
  q.set_global_factors(0, 0, 4.0f, 0.5f);
  std::mt19937 rng(2);
  const int n = 10 + 22;
  const std::vector<float> k = random_rows(rng, n, kDim), v = random_rows(rng, n, kDim);
  for (int t = 0; t < n; ++t) {
    q.append(0, 0, t < 10 ? ThoughtType::reasoning : ThoughtType::transition, &k[t * kDim],
             &v[t * kDim]);
  }
  // 10 R tokens (short NVFP4 chunk), 16 T tokens (ternary chunk), 6 T tokens buffered.
  const auto& chunks = q.chunks(0, 0);
  REQUIRE(chunks.size() == 2);
  REQUIRE(chunks[0].tokens == 10);
  REQUIRE(chunks[0].type == ThoughtType::reasoning);
  REQUIRE(chunks[0].format == QuantFormat::nvfp4);
  REQUIRE(chunks[1].tokens == 16);
  REQUIRE(chunks[1].format == QuantFormat::ternary);
  REQUIRE(q.buffered_tokens(0, 0) == 6);
  // By hand: short NVFP4 chunk: keys 32 x (8 + 1) (padded to 16 tokens), values 10 x 2 x (8 + 1);
  // ternary chunk: keys 32 x (4 + 1), values 16 x 2 x (4 + 1); buffer 6 x 2 x 32 x 4.
  const QuantBytes b = q.bytes(0, 0);
  REQUIRE(b.code_bytes == 32 * 8 + 20 * 8 + 32 * 4 + 32 * 4);
  REQUIRE(b.scale_bytes == 32 + 20 + 32 + 32);
  REQUIRE(b.buffer_bytes == 6 * 2 * 32 * 4);
  REQUIRE(b.total() == 288 + 180 + 160 + 160 + 1536);

  std::vector<float> kd(n * kDim), vd(n * kDim);
  q.dequantize(0, 0, kd.data(), vd.data());
  REQUIRE(slice(kd, 0, 10) == oracle(k, 10, QuantFormat::nvfp4, GroupAxis::token, 4.0f));
  REQUIRE(slice(vd, 0, 10) == oracle(v, 10, QuantFormat::nvfp4, GroupAxis::channel, 0.5f));
  REQUIRE(slice(kd, 10, 16) ==
          oracle(slice(k, 10, 16), 16, QuantFormat::ternary, GroupAxis::token, 1.0f));
  REQUIRE(slice(vd, 10, 16) ==
          oracle(slice(v, 10, 16), 16, QuantFormat::ternary, GroupAxis::channel, 1.0f));
  REQUIRE(slice(kd, 26, 6) == slice(k, 26, 6));
  REQUIRE(slice(vd, 26, 6) == slice(v, 26, 6));

  q.flush(0, 0);  // the 6 buffered T tokens become a short ternary chunk
  REQUIRE(q.chunks(0, 0).size() == 3);
  REQUIRE(q.chunks(0, 0)[2].tokens == 6);
  REQUIRE(q.bytes(0, 0).buffer_bytes == 0);
  REQUIRE(q.bytes(0, 0).total() == 288 + 180 + 160 + 160 + 32 * 5 + 6 * 2 * 5);
  REQUIRE_THROWS_WITH(q.set_global_factors(0, 0, 1.0f, 1.0f), Contains("3 quantized chunk"));
}

TEST_CASE("precision per type is configurable (R8) and streams are independent", "[hybrid]") {
  HybridQuantizerConfig c;
  c.head_dim = kDim;
  c.num_layers = 2;
  c.num_kv_heads = 3;
  c.reasoning_format = QuantFormat::fp8;
  c.buffer_dtype = DType::bf16;
  HybridQuantizer q(c);
  std::mt19937 rng(3);
  const std::vector<float> k = random_rows(rng, 3 * 20, kDim), v = random_rows(rng, 3 * 20, kDim);
  // Layer 1 gets 20 steps of R tokens on all 3 heads; head h's token t is row t*3 + h.
  for (int t = 0; t < 20; ++t) {
    q.append_step(1, ThoughtType::reasoning, &k[t * 3 * kDim], &v[t * 3 * kDim]);
  }
  REQUIRE(q.num_tokens(0, 0) == 0);
  REQUIRE(q.bytes(0, 2).total() == 0);
  for (int h = 0; h < 3; ++h) {
    REQUIRE(q.num_tokens(1, h) == 20);
    REQUIRE(q.chunks(1, h)[0].format == QuantFormat::fp8);
    // FP8: keys 32 x (16 + 1), values 16 x 2 x (16 + 1); bf16 buffer 4 x 2 x 32 x 2.
    REQUIRE(q.bytes(1, h).total() == 544 + 544 + 512);
    // Head h's rows as the bf16 buffer holds them (chunks are quantized from the buffer).
    auto bf16 = [](float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); };
    std::vector<float> kh(20 * kDim), vh(20 * kDim), kd(20 * kDim), vd(20 * kDim);
    for (int t = 0; t < 20; ++t) {
      for (int i = 0; i < kDim; ++i) {
        kh[t * kDim + i] = bf16(k[(t * 3 + h) * kDim + i]);
        vh[t * kDim + i] = bf16(v[(t * 3 + h) * kDim + i]);
      }
    }
    q.dequantize(1, h, kd.data(), vd.data());
    REQUIRE(slice(kd, 0, 16) == oracle(kh, 16, QuantFormat::fp8, GroupAxis::token, 1.0f));
    REQUIRE(slice(vd, 0, 16) == oracle(vh, 16, QuantFormat::fp8, GroupAxis::channel, 1.0f));
    for (int i = 16 * kDim; i < 20 * kDim; ++i) {  // buffered in bf16
      REQUIRE(kd[i] == kh[i]);
      REQUIRE(vd[i] == vh[i]);
      REQUIRE(kd[i] != k[(i / kDim * 3 + h) * kDim + i % kDim]);  // really rounded
    }
  }
  REQUIRE(q.bytes().total() == 3 * (544 + 544 + 512));
  REQUIRE(q.bytes().global_factor_bytes == 6 * 8);
}

TEST_CASE("bf16 input rows and reconstruction quality per type", "[hybrid]") {
  HybridQuantizerConfig c;
  c.head_dim = kDim;
  HybridQuantizer q(c);
  std::mt19937 rng(4);
  const std::vector<float> k = random_rows(rng, 64, kDim), v = random_rows(rng, 64, kDim);
  std::vector<bf16_t> kb(k.size()), vb(v.size());
  for (std::size_t i = 0; i < k.size(); ++i)
    kb[i] = from_float<bf16_t>(k[i]), vb[i] = from_float<bf16_t>(v[i]);
  for (int t = 0; t < 64; ++t) {
    q.append(0, 0, t < 32 ? ThoughtType::execution : ThoughtType::transition, &kb[t * kDim],
             &vb[t * kDim]);
  }
  std::vector<float> kd(64 * kDim), vd(64 * kDim);
  q.dequantize(0, 0, kd.data(), vd.data());
  auto rel_rms = [&](const std::vector<float>& ref, const std::vector<float>& got, int from) {
    double e = 0, r = 0;
    for (int i = from * kDim; i < (from + 32) * kDim; ++i) {
      const double x = to_float(from_float<bf16_t>(ref[i]));
      e += (x - got[i]) * (x - got[i]);
      r += x * x;
    }
    return std::sqrt(e / r);
  };
  REQUIRE(rel_rms(k, kd, 0) < 0.12);  // NVFP4 (E4): about 0.095 on Gaussian data
  REQUIRE(rel_rms(v, vd, 0) < 0.12);
  REQUIRE(rel_rms(k, kd, 32) < 0.6);  // ternary (T2): about 0.41
  REQUIRE(rel_rms(k, kd, 32) > 0.2);  // ...and clearly coarser than NVFP4
}

TEST_CASE("bad appends are rejected before anything changes", "[hybrid]") {
  HybridQuantizerConfig c;
  c.head_dim = kDim;
  c.num_layers = 2;
  HybridQuantizer q(c);
  std::vector<float> row(kDim, 1.0f), bad = row;
  bad[7] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(q.append(2, 0, ThoughtType::reasoning, row.data(), row.data()),
                      Contains("layer (2)"));
  REQUIRE_THROWS_WITH(q.append(0, 1, ThoughtType::reasoning, row.data(), row.data()),
                      Contains("head (1)"));
  REQUIRE_THROWS_WITH(q.append(0, 0, ThoughtType::reasoning, row.data(), bad.data()),
                      Contains("channel 7"));
  REQUIRE_THROWS_WITH(q.append(0, 0, static_cast<ThoughtType>(9), row.data(), row.data()),
                      Contains("thought type code 9"));
  REQUIRE(q.num_tokens(0, 0) == 0);
  REQUIRE_THROWS_WITH(q.set_global_factors(0, 0, -1.0f, 1.0f), Contains("key -1"));
}
