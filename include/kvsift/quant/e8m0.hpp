// E8M0: an 8-bit power of two, 2^(code - 127), codes 0..254 (2^-127 .. 2^127), 0xFF = NaN; the OCP
// microscaling (MX) shared-scale format. kvsift stores the FP8 (R8) group scale in it
// (docs/algorithms.md §3.2: `2^ceil(log2(amax/448))`, our choice, because an E4M3 scale amax/448 would
// sit in E4M3's subnormal range).
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift {

inline constexpr int kE8M0Bias = 127;
inline constexpr std::uint8_t kE8M0NaN = 0xff;

KVSIFT_HOST_DEVICE float e8m0_to_float(std::uint8_t code) {
  if (code == kE8M0NaN) return detail::bits_float(0x7fc00000u);
  // 2^-127 is a float subnormal (bit 22 alone); every other code is a normal float's exponent.
  if (code == 0) return detail::bits_float(0x00400000u);
  return detail::bits_float(static_cast<std::uint32_t>(code) << 23);
}

// The smallest representable power of two >= |x| (round toward +inf), clamped to
// [2^-127, 2^127]: zero gives 2^-127 (code 0), Inf 2^127, NaN NaN. Matches cuda_fp8.h's
// __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf), which also takes |x|.
KVSIFT_HOST_DEVICE std::uint8_t e8m0_ceil_from_float(float x) {
  const std::uint32_t bits = detail::float_bits(x) & 0x7fffffffu;
  if (bits > 0x7f800000u) return kE8M0NaN;
  if (bits >= 0x7f000000u) return 254;  // >= 2^127 (Inf included) saturates at 2^127
  const std::uint32_t exp = bits >> 23, mant = bits & 0x7fffffu;
  if (exp == 0) return mant > 0x400000u ? 1 : 0;  // subnormal: above 2^-127 rounds up to 2^-126
  return static_cast<std::uint8_t>(mant != 0 ? exp + 1 : exp);
}

}  // namespace kvsift
