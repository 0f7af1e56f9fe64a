// The asymmetric min-max group quantizer (docs/algorithms.md §5.1, §5.2): expected codes, scales,
// packed words and byte counts worked out by hand from the definitions.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/quant/asymmetric_group.hpp"

using namespace kvsift;

TEST_CASE("asymmetric quantizer: codes, half-to-even rounding, KIVI dequantization") {
  AsymmetricQuantSpec spec;
  spec.bits = 2;
  spec.arith = DType::f32;
  const std::vector<float> x = {0.0f, 0.5f, 1.5f, 3.0f};  // s = 3 / 3 = 1
  std::vector<std::uint16_t> q(4);
  const GroupParams p = asym_quantize_group(spec, x.data(), 1, 4, q.data());
  CHECK(p.scale == 1.0f);
  CHECK(p.zero == 0.0f);
  CHECK(q == std::vector<std::uint16_t>{0, 0, 2, 3});  // 0.5 -> 0, 1.5 -> 2 (half to even)
  CHECK(asym_dequantize(spec, 2, p) == 2.0f);
}

TEST_CASE("asymmetric quantizer: fp16 arithmetic rounds the scale to fp16") {
  AsymmetricQuantSpec spec;
  spec.bits = 2;
  spec.arith = DType::f16;
  const std::vector<float> x = {1.0f, 2.0f, 1.5f, 2.0f};  // M - m = 1, s = fp16(1/3)
  std::vector<std::uint16_t> q(4);
  const GroupParams p = asym_quantize_group(spec, x.data(), 1, 4, q.data());
  CHECK(p.scale == 0.333251953125f);  // 0x3555
  CHECK(p.zero == 1.0f);
  // u = fp16(0.5 / 0.333251953125) = fp16(1.50037) = 1.5 -> 2 (half to even)
  CHECK(q == std::vector<std::uint16_t>{0, 3, 2, 3});
  spec.arith = DType::f32;
  const GroupParams p32 = asym_quantize_group(spec, x.data(), 1, 4, q.data());
  CHECK(p32.scale == 1.0f / 3.0f);
}

TEST_CASE("asymmetric quantizer: constant groups, KIVI and PM-KVQ conventions") {
  const std::vector<float> x = {2.0f, 2.0f, 2.0f};
  std::vector<std::uint16_t> q(3, 7);
  AsymmetricQuantSpec kivi;
  kivi.bits = 4;
  const GroupParams pk = asym_quantize_group(kivi, x.data(), 1, 3, q.data());
  CHECK(pk.scale == 0.0f);
  CHECK(q == std::vector<std::uint16_t>{0, 0, 0});
  CHECK(asym_dequantize(kivi, 0, pk) == 2.0f);

  AsymmetricQuantSpec pm;
  pm.bits = 4;
  pm.arith = DType::bf16;
  pm.zero = ZeroConvention::subtract_zero;
  pm.scale_min = 1e-5f;
  pm.scale_max = 1e5f;
  const GroupParams pp = asym_quantize_group(pm, x.data(), 1, 3, q.data());
  CHECK(pp.scale == 1e-5f);
  CHECK(pp.zero == -2.0f);
  CHECK(q == std::vector<std::uint16_t>{0, 0, 0});
  CHECK(asym_dequantize(pm, 0, pp) == 2.0f);
}

TEST_CASE("asymmetric quantizer: tensor grouping along tokens and channels") {
  AsymmetricQuantSpec spec;
  spec.bits = 2;
  spec.arith = DType::f32;
  // [rows 2, cols 2]: row 0 = (0, 10), row 1 = (3, 13)
  const std::vector<float> x = {0.0f, 10.0f, 3.0f, 13.0f};
  std::vector<std::uint16_t> q(4);
  std::vector<GroupParams> p(2);
  asym_quantize_tensor(spec, x.data(), 2, 2, GroupAxis::token, 2, q.data(), p.data());
  CHECK(q == std::vector<std::uint16_t>{0, 0, 3, 3});  // per column: min 0 / 10, s = 1
  CHECK(p[0].zero == 0.0f);
  CHECK(p[1].zero == 10.0f);
  asym_quantize_tensor(spec, x.data(), 2, 2, GroupAxis::channel, 2, q.data(), p.data());
  CHECK(q == std::vector<std::uint16_t>{0, 3, 0, 3});  // per row: s = 10/3
  CHECK(p[1].zero == 3.0f);
  CHECK_THROWS_WITH(
      asym_quantize_tensor(spec, x.data(), 2, 2, GroupAxis::token, 3, q.data(), p.data()),
      Catch::Matchers::Contains("group size (3) must divide the token extent (2)"));
}

TEST_CASE("pack_codes: LSB-first int32 (KIVI) and MSB-first int16 (PM-KVQ)") {
  const std::vector<std::uint16_t> c2 = {1, 2, 3, 0, 3};
  const auto w = pack_codes(c2.data(), 5, 2, 32, PackOrder::lsb_first);
  REQUIRE(w.size() == 1);
  CHECK(w[0] == (1u | (2u << 2) | (3u << 4) | (3u << 8)));
  CHECK(unpack_codes(w.data(), 5, 2, 32, PackOrder::lsb_first) == c2);
  const std::vector<std::uint16_t> c4 = {1, 2, 3, 4, 5};
  const auto h = pack_codes(c4.data(), 5, 4, 16, PackOrder::msb_first);
  REQUIRE(h.size() == 2);
  CHECK(h[0] == 0x1234u);
  CHECK(h[1] == 0x5000u);
  CHECK(unpack_codes(h.data(), 5, 4, 16, PackOrder::msb_first) == c4);
  const std::vector<std::uint16_t> top(16, 3);  // bit 31 set: a negative int32
  CHECK(pack_codes(top.data(), 16, 2, 32, PackOrder::lsb_first)[0] == 0xffffffffu);
  CHECK_THROWS_WITH(pack_codes(c2.data(), 5, 3, 32, PackOrder::lsb_first),
                    Catch::Matchers::Contains("bits (3) must divide word_bits (32)"));
}

TEST_CASE("asymmetric quantizer: byte accounting counts scales and zeros; bad specs") {
  // 128 channels at 2 bits: 8 int32 words = 32 B, plus 4 groups of fp16 scale + zero = 16 B.
  CHECK(asym_quantized_bytes(128, 4, 2, 32, 2) == 48);
  // 5 codes at 4 bits in int16 words: 2 words = 4 B, one bf16 scale + zero = 4 B.
  CHECK(asym_quantized_bytes(5, 1, 4, 16, 2) == 8);
  AsymmetricQuantSpec spec;
  spec.bits = 17;
  CHECK_THROWS_WITH(spec.validate(), Catch::Matchers::Contains("quantizer bits (17)"));
}
