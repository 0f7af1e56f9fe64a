// Refill with fresh scales (docs/algorithms.md §3.4): a group of new tokens written into evicted
// slots of an already quantized block must reconstruct exactly as well as a fresh quantization of
// the same 16 tokens (group_codec.hpp's quantize_group over each key channel and value row, the
// independent oracle). Checked for NVFP4, FP8 and ternary, with new tokens from the evicted
// tokens' distribution and from one twice as wide (a shift that old scales cannot represent).
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "kvsift/quant/group_codec.hpp"

using namespace kvsift;

namespace {

constexpr int kHeads = 2, kDim = 32, kSlots = 32;

// Values that 16-bit staging stores exactly (bf16 and f16 alike: 8 significant bits, moderate
// exponents), so the oracle and the table quantize the same numbers whatever the staging dtype.
std::vector<float> representable_rows(std::mt19937& rng, std::size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = bf16_bits_to_float(float_to_bf16_bits(normal(rng)));
  return x;
}

struct Errors {
  double refilled = 0.0;  // squared error of the table's reconstruction
  double fresh = 0.0;     // squared error of the oracle's fresh quantization
};

// Squared reconstruction error of 16 tokens [16, kDim] of one head under a fresh quantization:
// keys per channel over the 16 tokens, values per token over 16 channels (KIVI, §3.2).
double fresh_error(QuantFormat q, const std::vector<float>& keys, const std::vector<float>& values,
                   int head) {
  double err = 0.0;
  std::uint8_t codes[16];
  float out[16];
  for (int c = 0; c < kDim; ++c) {
    const float* x = &keys[static_cast<std::size_t>(head * kDim + c)];
    const long stride = kHeads * kDim;  // token-major [16, heads, dim]
    const std::uint8_t s = quantize_group(q, x, stride, 16, 1.0f, codes);
    dequantize_group(q, codes, s, 1.0f, 16, out, 1L);
    for (int i = 0; i < 16; ++i) err += std::pow(out[i] - x[i * stride], 2);
  }
  for (int t = 0; t < 16; ++t) {
    for (int b = 0; b < kDim / 16; ++b) {
      const float* x = &values[static_cast<std::size_t>((t * kHeads + head) * kDim + b * 16)];
      const std::uint8_t s = quantize_group(q, x, 1L, 16, 1.0f, codes);
      dequantize_group(q, codes, s, 1.0f, 16, out, 1L);
      for (int i = 0; i < 16; ++i) err += std::pow(out[i] - x[i], 2);
    }
  }
  return err;
}

// Fills one block with 32 tokens (scale 1), evicts the first 16 in every head, appends 16 new
// tokens drawn at `new_scale`, and compares their reconstruction with the oracle's, per head.
std::vector<Errors> refill_errors(BlockFormat format, float new_scale, unsigned seed) {
  ThoughtBlockTableConfig c;
  c.kv_heads = kHeads;
  c.head_dim = kDim;
  c.block_size = kSlots;
  c.num_blocks = 8;
  c.reasoning = format;
  ThoughtBlockTable t(c);
  const std::int32_t seq = t.create_sequence();
  t.open_segment(seq, ThoughtType::reasoning);
  std::mt19937 rng(seed);
  const std::size_t row = static_cast<std::size_t>(kHeads * kDim);
  const auto old_k = representable_rows(rng, 32 * row, 1.0f);
  const auto old_v = representable_rows(rng, 32 * row, 1.0f);
  for (int i = 0; i < 32; ++i) t.append(seq, &old_k[i * row], &old_v[i * row], kHeads, kDim);
  std::vector<std::int32_t> first16;
  for (int p = 0; p < 16; ++p) first16.push_back(p);
  for (int h = 0; h < kHeads; ++h) t.evict_positions(seq, h, first16);
  const auto new_k = representable_rows(rng, 16 * row, new_scale);
  const auto new_v = representable_rows(rng, 16 * row, new_scale);
  for (int i = 0; i < 16; ++i) t.append(seq, &new_k[i * row], &new_v[i * row], kHeads, kDim);

  std::vector<Errors> out(kHeads);
  const QuantFormat q = quant_format_of(format);
  std::vector<float> k(kDim), v(kDim);
  for (int h = 0; h < kHeads; ++h) {
    int seen = 0;
    for (const ResidentToken& tok : t.resident_tokens(seq, h)) {
      if (tok.position < 32) continue;
      const int i = tok.position - 32;
      t.read_token(seq, h, tok.address, k.data(), v.data());
      for (int d = 0; d < kDim; ++d) {
        out[h].refilled += std::pow(k[d] - new_k[i * row + h * kDim + d], 2) +
                           std::pow(v[d] - new_v[i * row + h * kDim + d], 2);
      }
      ++seen;
    }
    REQUIRE(seen == 16);
    out[h].fresh = fresh_error(q, new_k, new_v, h);
  }
  return out;
}

}  // namespace

TEST_CASE("refilled groups reconstruct as well as a fresh quantization of the same tokens",
          "[thinkv][refill]") {
  for (BlockFormat f : {BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary}) {
    for (float new_scale : {1.0f, 2.0f}) {
      for (unsigned seed : {1u, 2u, 3u}) {
        for (const Errors& e : refill_errors(f, new_scale, seed)) {
          INFO(std::string(block_format_name(f))
               << " new tokens at scale " << new_scale << ", seed " << seed << ": refilled "
               << e.refilled << " vs fresh " << e.fresh << " (ratio " << e.refilled / e.fresh
               << ")");
          REQUIRE(e.fresh > 0.0);
          // Equal up to rounding ties: the table quantizes the very same 16 tokens the oracle does.
          CHECK(e.refilled <= e.fresh * (1.0 + 1e-6) + 1e-12);
          CHECK(e.refilled >= e.fresh * (1.0 - 1e-6) - 1e-12);
        }
      }
    }
  }
}
