// detail::quotient_rn (cuda/quotient_rn.cuh) against the division it replaces in the tensor-core
// search's exact re-checks: the same bits as x / den for every finite bf16 value x (the keys'
// usual storage) over denominators spread across the exponent range plus the awkward ones
// (powers of two, all-ones significands, the 1e-8 floor of ||K|| + 1e-8), for random fp32 x (f32
// and f16 keys), and for the values the guard sends to the division (zeros, subnormals, NaN,
// infinities). The plain product x · (1/den), which the correction step fixes, must differ from
// the division somewhere here, or this test could not tell the two apart. Host only: runs in CI.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "quotient_rn.cuh"

using kvsift::cuda::detail::quotient_rn;

namespace {

std::uint32_t bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

std::vector<float> denominators() {
  std::vector<float> d = {1e-8f, 1.00000001e-8f, 1.0f, 1.5f, 3.0f, 11.3137085f, 1e4f};
  for (int e = -27; e <= 20; ++e) {
    d.push_back(std::ldexp(1.0f, e));                     // a power of two
    d.push_back(std::ldexp(0x1.fffffep0f, e));            // all-ones significand
    d.push_back(std::nextafter(std::ldexp(1.0f, e), 0));  // just below a power of two
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> sig(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-27, 20);
  while (d.size() < 320) d.push_back(std::ldexp(sig(rng), ex(rng)));
  return d;
}

}  // namespace

TEST_CASE("quotient_rn equals the division for every finite bf16 numerator") {
  const std::vector<float> dens = denominators();
  long long checked = 0, mismatches = 0, naive_differs = 0;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float x = from_bits(b << 16);
    if (!std::isfinite(x)) continue;
    for (float den : dens) {
      const float y = 1.0f / den;
      const float want = x / den;
      if (bits(quotient_rn(x, den, y)) != bits(want)) ++mismatches;
      if (bits(x * y) != bits(want)) ++naive_differs;
      ++checked;
    }
  }
  INFO(checked << " quotients");
  REQUIRE(mismatches == 0);
  REQUIRE(naive_differs > 0);
}

TEST_CASE("quotient_rn equals the division for random fp32 numerators") {
  const std::vector<float> dens = denominators();
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> any;
  long long mismatches = 0, naive_differs = 0;
  for (int n = 0; n < 2000000; ++n) {
    // Any sign and significand, exponents -40 .. 19 (the keys' range and beyond).
    const std::uint32_t exponent = static_cast<std::uint32_t>(127 - 40 + n % 60);
    const float x = from_bits((any(rng) & 0x807fffffu) | (exponent << 23));
    const float den = dens[static_cast<std::size_t>(n) % dens.size()];
    const float y = 1.0f / den;
    if (bits(quotient_rn(x, den, y)) != bits(x / den)) ++mismatches;
    if (bits(x * y) != bits(x / den)) ++naive_differs;
  }
  REQUIRE(mismatches == 0);
  REQUIRE(naive_differs > 0);
}

TEST_CASE("quotient_rn sends zeros, subnormals, NaN and infinities to the division") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float tiny = std::numeric_limits<float>::denorm_min();
  for (float x : {0.0f, -0.0f, tiny, -tiny, 1e-39f, 0x1p-81f, 1.0f, -3.5f, inf, -inf, nan}) {
    for (float den : {1e-8f, 1.0f, 7.0f, 1e30f, inf, nan}) {
      const float q = quotient_rn(x, den, 1.0f / den), want = x / den;
      INFO("x = " << x << ", den = " << den);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(q));
      } else {
        REQUIRE(bits(q) == bits(want));
      }
    }
  }
}
