// FP8 E4M3 (the OCP FP8 "E4M3FN" variant NVIDIA uses): sign, 4 exponent bits (bias 7), 3 mantissa
// bits; largest finite 448, smallest subnormal 2^-9, no Inf, NaN = S.1111.111 (0x7F / 0xFF).
// float -> code rounds to nearest even and saturates to ±448 (cuda_fp8.h's __NV_SATFINITE mode);
// NaN becomes 0x7F whatever its sign, as cuda_fp8.h's float conversion does. Used for NVFP4 block
// scales, the ternary α and the FP8 (R8) elements (docs/algorithms.md §3.2). Checked bit for bit against
// cuda_fp8.h in tests/oracle_fp4_fp8.cpp.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE4M3MinNormal = 0.015625f;  // 2^-6

KVSIFT_HOST_DEVICE bool e4m3_is_nan(std::uint8_t code) { return (code & 0x7fu) == 0x7fu; }

KVSIFT_HOST_DEVICE std::uint8_t e4m3_from_float(float x) {
  const std::uint32_t bits = detail::float_bits(x);
  const std::uint8_t sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  const std::uint32_t abits = bits & 0x7fffffffu;
  if (abits > 0x7f800000u) return 0x7f;  // NaN
  const float a = detail::bits_float(abits);
  // 448 is the top: anything from 448 up (the midpoint 464 ties to 448's even mantissa) saturates.
  if (a >= kE4M3Max) return static_cast<std::uint8_t>(sign | 0x7eu);
  if (a >= kE4M3MinNormal) {
    // Normal: keep 3 of the float's 23 mantissa bits, rounding the other 20 to nearest even, then
    // rebias the exponent from 127 to 7 (subtract 120 << 3 from the shifted bits).
    const std::uint32_t rounded = (abits + 0x7ffffu + ((abits >> 20) & 1u)) >> 20;
    return static_cast<std::uint8_t>(sign | (rounded - (120u << 3)));
  }
  // Subnormal or zero: the step is 2^-9. 2^14 has a float ulp of 2^-9, so the FPU's own
  // round-to-nearest-even of a + 2^14 leaves the subnormal code (0..8; 8 is the smallest normal,
  // which encodes as 0x08) in the low bits.
  const float sum = a + 16384.0f;
  return static_cast<std::uint8_t>(sign | (detail::float_bits(sum) - 0x46800000u));
}

KVSIFT_HOST_DEVICE float e4m3_to_float(std::uint8_t code) {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80u) << 24;
  const std::uint32_t exp = (code >> 3) & 0xfu, mant = code & 0x7u;
  if (exp == 0xfu && mant == 0x7u) return detail::bits_float(sign | 0x7fc00000u);  // NaN
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9, exact
    return detail::bits_float(sign | detail::float_bits(mag));
  }
  return detail::bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

}  // namespace kvsift
