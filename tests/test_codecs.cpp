// The quantization codecs of ThinKV's TBQ (docs/algorithms.md §3.2): E2M1, E4M3, E8M0 elements, NVFP4 /
// FP8 / ternary groups, the KIVI tensor layout and packed-data validation. Expected values are
// worked out by hand from the format definitions or come from naive oracles written differently
// (linear searches, double precision, brute force over subsets). The bit-exact comparison with
// the CUDA toolkit lives in oracle_fp4_fp8.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/quant/e2m1.hpp"
#include "kvsift/quant/e4m3.hpp"
#include "kvsift/quant/e8m0.hpp"
#include "kvsift/quant/format.hpp"
#include "kvsift/quant/group_codec.hpp"
#include "kvsift/quant/kivi_layout.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// Naive E2M1 oracle: linear search over the 8 magnitudes; at an exact tie the even code wins.
std::uint8_t e2m1_oracle(float x) {
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const double a = std::fabs(double(x));
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(a - grid[c]), db = std::fabs(a - grid[best]);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<std::uint8_t>((std::signbit(x) ? 8 : 0) | best);
}

std::vector<float> random_group(std::mt19937& rng, float spread) {
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> v(16);
  for (float& x : v) x = normal(rng);
  return v;
}
}  // namespace

TEST_CASE("e2m1 encodes the grid exactly and rounds ties to the even code", "[e2m1]") {
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 8; ++c) {
    REQUIRE(e2m1_from_float(grid[c]) == c);
    REQUIRE(e2m1_from_float(-grid[c]) == (8 | c));
    REQUIRE(e2m1_to_float(static_cast<std::uint8_t>(c)) == grid[c]);
    REQUIRE(e2m1_to_float(static_cast<std::uint8_t>(8 | c)) == -grid[c]);
  }
  // Midpoints: 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4),
  // 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6).
  REQUIRE(e2m1_from_float(0.25f) == 0);
  REQUIRE(e2m1_from_float(0.75f) == 2);
  REQUIRE(e2m1_from_float(1.25f) == 2);
  REQUIRE(e2m1_from_float(1.75f) == 4);
  REQUIRE(e2m1_from_float(2.5f) == 4);
  REQUIRE(e2m1_from_float(3.5f) == 6);
  REQUIRE(e2m1_from_float(5.0f) == 6);
  REQUIRE(e2m1_from_float(-5.0f) == 0xe);
  // Just past a midpoint goes up.
  REQUIRE(e2m1_from_float(std::nextafter(0.25f, 1.0f)) == 1);
  REQUIRE(e2m1_from_float(std::nextafter(5.0f, 9.0f)) == 7);
  REQUIRE(e2m1_from_float(std::nextafter(0.75f, 0.0f)) == 1);
}

TEST_CASE("e2m1 saturates to ±6, maps NaN to +6 and keeps the sign of zero", "[e2m1]") {
  REQUIRE(e2m1_from_float(6.5f) == 0x7);
  REQUIRE(e2m1_from_float(1e30f) == 0x7);
  REQUIRE(e2m1_from_float(kInf) == 0x7);
  REQUIRE(e2m1_from_float(-kInf) == 0xf);
  REQUIRE(e2m1_from_float(kNaN) == 0x7);
  REQUIRE(e2m1_from_float(-kNaN) == 0x7);
  REQUIRE(e2m1_from_float(-0.0f) == 0x8);
  REQUIRE(e2m1_from_float(-0.1f) == 0x8);
  REQUIRE(e2m1_from_float(1e-30f) == 0x0);
}

TEST_CASE("e2m1 agrees with a linear-search oracle on random floats", "[e2m1]") {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-8.0f, 8.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = u(rng);
    REQUIRE(e2m1_from_float(x) == e2m1_oracle(x));
  }
}

TEST_CASE("e2m1 packs element 2i in the low nibble", "[e2m1]") {
  const std::uint8_t b = e2m1_pack2(e2m1_from_float(0.5f), e2m1_from_float(-6.0f));
  REQUIRE(b == 0xf1);
  REQUIRE(e2m1_unpack(&b, 0) == 0x1);
  REQUIRE(e2m1_unpack(&b, 1) == 0xf);
}

TEST_CASE("e4m3 rounds to nearest even, saturates at ±448 and maps NaN to 0x7F", "[e4m3]") {
  REQUIRE(e4m3_from_float(1.0f) == 0x38);  // exponent 7 (bias 7), mantissa 0
  REQUIRE(e4m3_to_float(0x38) == 1.0f);
  REQUIRE(e4m3_from_float(1.0625f) == 0x38);  // midpoint 1 | 1.125: even mantissa 0
  REQUIRE(e4m3_from_float(1.1875f) == 0x3a);  // midpoint 1.125 | 1.25: even mantissa 2
  REQUIRE(e4m3_from_float(std::nextafter(1.0625f, 2.0f)) == 0x39);
  REQUIRE(e4m3_from_float(448.0f) == 0x7e);
  REQUIRE(e4m3_to_float(0x7e) == 448.0f);
  REQUIRE(e4m3_from_float(464.0f) == 0x7e);  // overflow midpoint ties to even 448
  REQUIRE(e4m3_from_float(1e9f) == 0x7e);
  REQUIRE(e4m3_from_float(-1e9f) == 0xfe);
  REQUIRE(e4m3_from_float(kInf) == 0x7e);
  REQUIRE(e4m3_from_float(-kInf) == 0xfe);
  REQUIRE(e4m3_from_float(kNaN) == 0x7f);
  REQUIRE(std::isnan(e4m3_to_float(0x7f)));
  REQUIRE(std::isnan(e4m3_to_float(0xff)));
  // Subnormals: step 2^-9; 2^-10 ties to 0, 3·2^-10 ties to 2·2^-9; 2^-6 is the smallest normal.
  REQUIRE(e4m3_from_float(std::ldexp(1.0f, -9)) == 0x01);
  REQUIRE(e4m3_to_float(0x01) == std::ldexp(1.0f, -9));
  REQUIRE(e4m3_from_float(std::ldexp(1.0f, -10)) == 0x00);
  REQUIRE(e4m3_from_float(std::ldexp(3.0f, -10)) == 0x02);
  REQUIRE(e4m3_from_float(std::ldexp(1.0f, -6)) == 0x08);
  REQUIRE(e4m3_from_float(std::ldexp(15.0f, -10)) == 0x08);  // 7.5 steps -> 8 (even)
  REQUIRE(e4m3_from_float(-0.0f) == 0x80);
  // Every finite code round-trips.
  for (int c = 0; c < 256; ++c) {
    if (e4m3_is_nan(static_cast<std::uint8_t>(c))) continue;
    REQUIRE(e4m3_from_float(e4m3_to_float(static_cast<std::uint8_t>(c))) == c);
  }
}

TEST_CASE("e8m0 holds powers of two and rounds up", "[e8m0]") {
  REQUIRE(e8m0_to_float(127) == 1.0f);
  REQUIRE(e8m0_to_float(0) == std::ldexp(1.0f, -127));
  REQUIRE(e8m0_to_float(254) == std::ldexp(1.0f, 127));
  REQUIRE(std::isnan(e8m0_to_float(0xff)));
  REQUIRE(e8m0_ceil_from_float(1.0f) == 127);
  REQUIRE(e8m0_ceil_from_float(1.5f) == 128);
  REQUIRE(e8m0_ceil_from_float(0.75f) == 127);
  REQUIRE(e8m0_ceil_from_float(0.5f) == 126);
  REQUIRE(e8m0_ceil_from_float(0.0f) == 0);
  REQUIRE(e8m0_ceil_from_float(kInf) == 254);
  REQUIRE(e8m0_ceil_from_float(kNaN) == 0xff);
}

TEST_CASE("fp8 group scale is 2^ceil(log2(amax/448)) exactly", "[fp8]") {
  // Oracle: smallest e in [-127, 127] with amax <= 448·2^e, searched in double precision.
  auto oracle = [](float amax) {
    int e = -127;
    while (e < 127 && double(amax) > 448.0 * std::ldexp(1.0, e)) ++e;
    return e + 127;
  };
  std::vector<float> amaxes = {0.0f, 1e-40f, 1.0f, 448.0f, 896.0f, 3.0e38f, 0.875f};
  for (int k = -130; k <= 120; ++k) {
    const float b = static_cast<float>(448.0 * std::ldexp(1.0, k));
    if (!std::isfinite(b) || b == 0.0f) continue;
    amaxes.insert(amaxes.end(), {b, std::nextafter(b, 0.0f), std::nextafter(b, kInf)});
  }
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> log_mag(-40.0f, 40.0f);
  for (int i = 0; i < 20000; ++i) amaxes.push_back(std::exp2(log_mag(rng)));
  for (float a : amaxes) {
    INFO("amax " << a);
    REQUIRE(fp8_group_scale_code(a) == oracle(a));
  }
  REQUIRE(fp8_group_scale_code(448.0f) == 127);  // hand: 448 / 448 = 1 = 2^0
  REQUIRE(fp8_group_scale_code(449.0f) == 128);
  REQUIRE(fp8_group_scale_code(224.0f) == 126);
}

TEST_CASE("nvfp4 group: hand-computed codes, scale and packing", "[nvfp4]") {
  // amax = 6, g = 1: s = e4m3(6/6) = 1, so codes are the elements' own E2M1 codes.
  std::vector<float> x = {0.5f, -6.0f,  1.2f, 2.6f, -0.2f, 0.0f, 3.5f, 5.1f,
                          4.0f, -1.75f, 0.3f, 0.0f, 0.0f,  0.0f, 0.0f, -0.75f};
  std::uint8_t codes[8];
  const std::uint8_t s = nvfp4_quantize_group(x.data(), 1, 16, 1.0f, codes);
  REQUIRE(s == 0x38);  // 1.0 in E4M3
  // Pairs (low, high): (0.5:1, -6:F), (1.2->1:2, 2.6->3:5), (-0.2->-0:8, 0:0),
  // (3.5->4:6, 5.1->6:7), (4:6, -1.75->-2:C), (0.3->0.5:1, 0:0), (0,0), (0:0, -0.75->-1:A).
  const std::uint8_t expect[8] = {0xf1, 0x52, 0x08, 0x76, 0xc6, 0x01, 0x00, 0xa0};
  for (int i = 0; i < 8; ++i) REQUIRE(codes[i] == expect[i]);
  std::vector<float> back(16);
  nvfp4_dequantize_group(codes, s, 1.0f, 16, back.data(), 1);
  REQUIRE(back[3] == 3.0f);
  REQUIRE(back[7] == 6.0f);
  REQUIRE(back[9] == -2.0f);

  // With g = 2 and amax = 3: s = e4m3(3/6·2) = 1, q = e2m1(2x), x̂ = q/2.
  std::vector<float> y(16, 0.0f);
  y[0] = 3.0f;
  y[1] = -0.6f;  // 2·-0.6 = -1.2 -> -1 -> x̂ = -0.5
  const std::uint8_t s2 = nvfp4_quantize_group(y.data(), 1, 16, 2.0f, codes);
  REQUIRE(s2 == 0x38);
  nvfp4_dequantize_group(codes, s2, 2.0f, 16, back.data(), 1);
  REQUIRE(back[0] == 3.0f);
  REQUIRE(back[1] == -0.5f);
}

TEST_CASE("nvfp4 all-zero and tiny groups decode to zeros, never NaN", "[nvfp4]") {
  std::uint8_t codes[8];
  std::vector<float> zeros(16, 0.0f), back(16, 1.0f);
  REQUIRE(nvfp4_quantize_group(zeros.data(), 1, 16, 1.0f, codes) == 0);
  for (std::uint8_t c : codes) REQUIRE(c == 0);
  nvfp4_dequantize_group(codes, 0, 1.0f, 16, back.data(), 1);
  for (float v : back) REQUIRE(v == 0.0f);
  // amax/6 = 1e-4 is below E4M3's smallest subnormal / 2: the scale rounds to 0.
  std::vector<float> tiny(16, -6e-4f);
  REQUIRE(nvfp4_quantize_group(tiny.data(), 1, 16, 1.0f, codes) == 0);
  for (std::uint8_t c : codes) REQUIRE(c == 0);
  nvfp4_dequantize_group(codes, 0, 1.0f, 16, back.data(), 1);
  for (float v : back) REQUIRE(v == 0.0f);
}

TEST_CASE("nvfp4 groups agree with a naive oracle and meet the error bound", "[nvfp4]") {
  // Bound (docs/quantization.md): with s in E4M3's normal range, |x - x̂| <= max(|x|/4, s/(4g)).
  std::mt19937 rng(3);
  double err2 = 0.0, ref2 = 0.0;
  for (int trial = 0; trial < 4000; ++trial) {
    const float spread = std::exp2(static_cast<float>(trial % 12) - 3.0f);
    const std::vector<float> x = random_group(rng, spread);
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    const float g = trial % 2 ? 1.0f : nvfp4_calibrated_global_factor(amax);
    std::uint8_t codes[8];
    const std::uint8_t s = nvfp4_quantize_group(x.data(), 1, 16, g, codes);
    REQUIRE(s == e4m3_from_float(amax / 6.0f * g));
    const float scale = e4m3_to_float(s);
    REQUIRE(scale >= kE4M3MinNormal);
    std::vector<float> back(16);
    nvfp4_dequantize_group(codes, s, g, 16, back.data(), 1);
    for (int i = 0; i < 16; ++i) {
      REQUIRE(e2m1_unpack(codes, i) == e2m1_oracle(x[i] * (g / scale)));
      const double bound = std::max(std::fabs(x[i]) / 4.0, scale / (4.0 * g)) * (1 + 1e-6);
      REQUIRE(std::fabs(double(x[i]) - back[i]) <= bound);
      err2 += std::pow(double(x[i]) - back[i], 2);
      ref2 += double(x[i]) * x[i];
    }
  }
  // Gaussian groups: relative RMS error about 9% (documented); guard against regressions.
  REQUIRE(std::sqrt(err2 / ref2) < 0.12);
}

TEST_CASE("fp8 groups: codes match a naive oracle, nothing saturates, error bound holds", "[fp8]") {
  // Bound: |x - x̂| <= max(|x|·2^-4, s·2^-10) with s the E8M0 scale (relative half-ulp of a 3-bit
  // mantissa, absolute half-step of E4M3 subnormals).
  std::mt19937 rng(4);
  double err2 = 0.0, ref2 = 0.0;
  for (int trial = 0; trial < 4000; ++trial) {
    const std::vector<float> x = random_group(rng, std::exp2(static_cast<float>(trial % 40) - 20));
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    std::uint8_t codes[16];
    const std::uint8_t s = fp8_quantize_group(x.data(), 1, 16, codes);
    const float scale = e8m0_to_float(s);
    REQUIRE(amax <= 448.0f * scale);
    REQUIRE(amax > 224.0f * scale);
    std::vector<float> back(16);
    fp8_dequantize_group(codes, s, 16, back.data(), 1);
    for (int i = 0; i < 16; ++i) {
      REQUIRE(codes[i] == e4m3_from_float(static_cast<float>(std::ldexp(double(x[i]), 127 - s))));
      const double bound = std::max(std::fabs(x[i]) / 16.0, scale / 1024.0);
      REQUIRE(std::fabs(double(x[i]) - back[i]) <= bound);
      err2 += std::pow(double(x[i]) - back[i], 2);
      ref2 += double(x[i]) * x[i];
    }
  }
  REQUIRE(std::sqrt(err2 / ref2) < 0.03);
  std::uint8_t codes[16];
  std::vector<float> zeros(16, 0.0f), back(16, 1.0f);
  REQUIRE(fp8_quantize_group(zeros.data(), 1, 16, codes) == 0);
  fp8_dequantize_group(codes, 0, 16, back.data(), 1);
  for (float v : back) REQUIRE(v == 0.0f);
}

TEST_CASE("ternary keeps the m that minimises the squared error (brute force over all m)",
          "[ternary]") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::vector<float> x = random_group(rng, 1.0f);
    // Oracle: for every m, the SSE of keeping the m largest |x| with α = their mean.
    std::vector<double> mag;
    for (float v : x) mag.push_back(std::fabs(v));
    std::vector<double> sorted = mag;
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    double best_sse = 1e300;
    int best_m = 0;
    for (int m = 1; m <= 16; ++m) {
      double sum = 0.0;
      for (int r = 0; r < m; ++r) sum += sorted[r];
      const double alpha = sum / m;
      double sse = 0.0;
      for (int r = 0; r < 16; ++r)
        sse += r < m ? std::pow(sorted[r] - alpha, 2) : sorted[r] * sorted[r];
      if (sse < best_sse) {
        best_sse = sse;
        best_m = m;
      }
    }
    float magf[16], kept = 0.0f;
    int order[16];
    for (int i = 0; i < 16; ++i) magf[i] = std::fabs(x[i]);
    const int m = ternary_optimal_count(magf, 16, order, &kept);
    double ours_sse = 0.0, alpha = double(kept) / m;
    for (int r = 0; r < 16; ++r) {
      ours_sse +=
          r < m ? std::pow(magf[order[r]] - alpha, 2) : double(magf[order[r]]) * magf[order[r]];
    }
    INFO("trial " << trial << " m " << m << " oracle m " << best_m);
    REQUIRE(ours_sse <= best_sse * (1 + 1e-5) + 1e-12);
  }
}

TEST_CASE("ternary top-m structure is optimal: brute force over all subsets and signs",
          "[ternary]") {
  // For 10 elements, every subset S kept with α = mean |x| over S (the best α for S).
  std::mt19937 rng(6);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<float> x = random_group(rng, 2.0f);
    for (int i = 10; i < 16; ++i) x[i] = 0.0f;
    double best = 1e300;
    for (int mask = 1; mask < (1 << 10); ++mask) {
      double sum = 0.0;
      int m = 0;
      for (int i = 0; i < 10; ++i)
        if (mask >> i & 1) sum += std::fabs(x[i]), ++m;
      const double alpha = sum / m;
      double sse = 0.0;
      for (int i = 0; i < 10; ++i) {
        sse += (mask >> i & 1) ? std::pow(std::fabs(x[i]) - alpha, 2) : double(x[i]) * x[i];
      }
      best = std::min(best, sse);
    }
    std::uint8_t codes[4];
    const std::uint8_t a = ternary_quantize_group(x.data(), 1, 10, codes);
    // Unrounded α: recover it from the kept set (codes) and compare the optimal SSE.
    double sum = 0.0;
    int m = 0;
    for (int i = 0; i < 10; ++i)
      if (ternary_code(codes, i) != kTernaryZero) sum += std::fabs(x[i]), ++m;
    REQUIRE(m > 0);
    double sse = 0.0;
    for (int i = 0; i < 10; ++i) {
      sse += ternary_code(codes, i) != kTernaryZero ? std::pow(std::fabs(x[i]) - sum / m, 2)
                                                    : double(x[i]) * x[i];
    }
    REQUIRE(sse <= best * (1 + 1e-5) + 1e-12);
    REQUIRE(a == e4m3_from_float(static_cast<float>(sum / m)));
    for (int i = 10; i < 16; ++i) REQUIRE(ternary_code(codes, i) == kTernaryZero);
  }
}

TEST_CASE("ternary hand cases: codes, packing, ties, zero group", "[ternary]") {
  // |x| = 4, 4, 1: S²/m = 16, 32, 27 -> keep 2, α = 4. Codes +1 (01), -1 (11): byte 0 = 0b1101.
  std::vector<float> x(16, 0.0f);
  x[0] = 4.0f;
  x[1] = -4.0f;
  x[2] = 1.0f;
  std::uint8_t codes[4];
  const std::uint8_t a = ternary_quantize_group(x.data(), 1, 16, codes);
  REQUIRE(a == e4m3_from_float(4.0f));
  REQUIRE(codes[0] == 0x0d);
  REQUIRE((codes[1] | codes[2] | codes[3]) == 0);
  std::vector<float> back(16);
  ternary_dequantize_group(codes, a, 16, back.data(), 1);
  REQUIRE(back[0] == 4.0f);
  REQUIRE(back[1] == -4.0f);
  REQUIRE(back[2] == 0.0f);
  // All |x| equal: S²/m = m grows, keep all 16.
  std::vector<float> ones(16, -1.0f);
  REQUIRE(ternary_quantize_group(ones.data(), 1, 16, codes) == 0x38);
  for (std::uint8_t c : codes) REQUIRE(c == 0xff);
  // All zero: α = 0, all codes 0, decodes to zeros.
  std::vector<float> zeros(16, 0.0f);
  REQUIRE(ternary_quantize_group(zeros.data(), 1, 16, codes) == 0);
  for (std::uint8_t c : codes) REQUIRE(c == 0);
  ternary_dequantize_group(codes, 0, 16, back.data(), 1);
  for (float v : back) REQUIRE(v == 0.0f);
}

TEST_CASE("ternary reconstruction error: optimal SSE plus the α rounding term", "[ternary]") {
  // ||x - x̂||² = Σx² - S²/m + m(α - α_q)² exactly; α_q within 2^-4 of α (E4M3 normal).
  std::mt19937 rng(7);
  double err2 = 0.0, ref2 = 0.0;
  for (int trial = 0; trial < 2000; ++trial) {
    const std::vector<float> x = random_group(rng, 1.0f);
    std::uint8_t codes[4];
    const std::uint8_t a = ternary_quantize_group(x.data(), 1, 16, codes);
    std::vector<float> back(16);
    ternary_dequantize_group(codes, a, 16, back.data(), 1);
    double sum = 0.0, sq = 0.0, sse = 0.0;
    int m = 0;
    for (int i = 0; i < 16; ++i) {
      sq += double(x[i]) * x[i];
      sse += std::pow(double(x[i]) - back[i], 2);
      if (ternary_code(codes, i) != kTernaryZero) sum += std::fabs(x[i]), ++m;
    }
    const double alpha = sum / m, alpha_q = e4m3_to_float(a);
    REQUIRE(std::fabs(alpha_q - alpha) <= alpha / 16.0 + 1e-7);
    const double predicted = sq - sum * sum / m + m * std::pow(alpha - alpha_q, 2);
    REQUIRE(std::fabs(sse - predicted) <= 1e-4 * sq + 1e-9);
    REQUIRE(sse <= sq);
    err2 += sse;
    ref2 += sq;
  }
  REQUIRE(std::sqrt(err2 / ref2) < 0.6);  // Gaussian: about 0.41 (documented)
}

TEST_CASE("format names, bytes per group and parse errors", "[format]") {
  REQUIRE(parse_quant_format("nvfp4") == QuantFormat::nvfp4);
  REQUIRE(parse_quant_format("8") == QuantFormat::fp8);
  REQUIRE(parse_quant_format("ternary") == QuantFormat::ternary);
  REQUIRE(bytes_per_group(QuantFormat::nvfp4) == 9);
  REQUIRE(bytes_per_group(QuantFormat::fp8) == 17);
  REQUIRE(bytes_per_group(QuantFormat::ternary) == 5);
  REQUIRE(bits_per_element(QuantFormat::nvfp4) == 4.5);
  REQUIRE_THROWS_WITH(parse_quant_format("int3"), Contains("'int3'"));
  REQUIRE_THROWS_AS(parse_quant_format("int3"), Error);
  REQUIRE_THROWS_WITH(parse_group_axis("head"), Contains("'head'"));
}

TEST_CASE("tensor quantization follows the KIVI layout", "[tensor]") {
  const int tokens = 32, channels = 48;
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::vector<float> x(tokens * channels);
  for (float& v : x) v = normal(rng);
  for (QuantFormat f : {QuantFormat::nvfp4, QuantFormat::fp8, QuantFormat::ternary}) {
    for (GroupAxis axis : {GroupAxis::token, GroupAxis::channel}) {
      const float g = f == QuantFormat::nvfp4 ? 3.0f : 1.0f;
      const QuantizedTensor q = quantize_tensor(x.data(), tokens, channels, f, axis, g);
      REQUIRE(q.grid.num_groups() == tokens * channels / 16);
      REQUIRE(q.codes.size() == std::size_t(q.grid.num_groups() * code_bytes_per_group(f)));
      const std::vector<float> back = dequantize_tensor(q);
      // Oracle: gather each group by hand in the documented order and quantize it alone.
      const int cb = code_bytes_per_group(f);
      int gi = 0;
      auto check_group = [&](std::vector<float> elems, std::vector<int> where) {
        std::uint8_t codes[16];
        const std::uint8_t s = quantize_group(f, elems.data(), 1, 16, g, codes);
        REQUIRE(q.scales[gi] == s);
        for (int b = 0; b < cb; ++b) REQUIRE(q.codes[gi * cb + b] == codes[b]);
        std::vector<float> d(16);
        dequantize_group(f, codes, s, g, 16, d.data(), 1);
        for (int i = 0; i < 16; ++i) REQUIRE(back[where[i]] == d[i]);
        ++gi;
      };
      if (axis == GroupAxis::token) {
        for (int tb = 0; tb < tokens / 16; ++tb)
          for (int c = 0; c < channels; ++c) {
            std::vector<float> e;
            std::vector<int> w;
            for (int t = tb * 16; t < tb * 16 + 16; ++t)
              e.push_back(x[t * channels + c]), w.push_back(t * channels + c);
            check_group(e, w);
          }
      } else {
        for (int t = 0; t < tokens; ++t)
          for (int c0 = 0; c0 < channels; c0 += 16) {
            std::vector<float> e(x.begin() + t * channels + c0, x.begin() + t * channels + c0 + 16);
            std::vector<int> w;
            for (int c = c0; c < c0 + 16; ++c) w.push_back(t * channels + c);
            check_group(e, w);
          }
      }
    }
  }
}

TEST_CASE("tensor API rejects bad shapes, non-finite input and corrupt packed data", "[tensor]") {
  std::vector<float> x(32 * 32, 0.5f);
  REQUIRE_THROWS_WITH(quantize_tensor(x.data(), 15, 32, QuantFormat::fp8, GroupAxis::token),
                      Contains("[15, 32]"));
  REQUIRE_THROWS_WITH(quantize_tensor(x.data(), 32, 24, QuantFormat::fp8, GroupAxis::token),
                      Contains("[32, 24]"));
  REQUIRE_THROWS_WITH(quantize_tensor(x.data(), 32, 32, QuantFormat::nvfp4, GroupAxis::token, 0.0f),
                      Contains("global_factor (0)"));
  x[5 * 32 + 7] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(quantize_tensor(x.data(), 32, 32, QuantFormat::fp8, GroupAxis::token),
                      Contains("x[5, 7]"));
  x[5 * 32 + 7] = 0.5f;

  std::vector<float> out(32 * 32);
  QuantizedTensor q = quantize_tensor(x.data(), 32, 32, QuantFormat::nvfp4, GroupAxis::channel);
  QuantizedTensor bad = q;
  bad.scales[3] = 0x7f;
  REQUIRE_THROWS_WITH(dequantize_tensor(bad, out.data()), Contains("group 3"));
  bad.scales[3] = 0x80;  // negative zero: scales are non-negative
  REQUIRE_THROWS_WITH(dequantize_tensor(bad, out.data()), Contains("negative"));
  bad = q;
  bad.codes.pop_back();
  REQUIRE_THROWS_WITH(dequantize_tensor(bad, out.data()), Contains("expected 512"));
  bad = q;
  bad.scales.push_back(0);
  REQUIRE_THROWS_WITH(dequantize_tensor(bad, out.data()), Contains("expected 64"));
  bad = q;
  bad.global_factor = -1.0f;
  REQUIRE_THROWS_WITH(dequantize_tensor(bad, out.data()), Contains("global_factor (-1)"));

  QuantizedTensor f8 = quantize_tensor(x.data(), 32, 32, QuantFormat::fp8, GroupAxis::token);
  f8.scales[2] = 0xff;
  REQUIRE_THROWS_WITH(dequantize_tensor(f8, out.data()), Contains("fp8 group 2"));
  f8.scales[2] = 0x7f;
  f8.codes[16 * 9 + 4] = 0xff;
  REQUIRE_THROWS_WITH(dequantize_tensor(f8, out.data()), Contains("group 9 element 4"));

  QuantizedTensor t2 = quantize_tensor(x.data(), 32, 32, QuantFormat::ternary, GroupAxis::token);
  t2.codes[4 * 6 + 1] = 0x08;  // element 5 of group 6 gets the invalid code 10
  REQUIRE_THROWS_WITH(dequantize_tensor(t2, out.data()), Contains("group 6 element 5"));
}
