// E2M1: the 4-bit element format of NVFP4 (OCP MX / NVIDIA Blackwell FP4). One sign bit, two
// exponent bits (bias 1), one mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (docs/algorithms.md
// §3.2). float -> code rounds to nearest, ties to even, and saturates to ±6. E2M1 has no NaN or
// Inf: Inf saturates to ±6 and NaN becomes +6 (code 0x7), which is what the CUDA toolkit's
// __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest) does (our oracle,
// tests/oracle_fp4_fp8.cpp). The sign of zero and of values that round to zero is kept (-0.1 ->
// 0x8), as CUDA does.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift {

inline constexpr float kE2M1Max = 6.0f;

// Magnitude of the 3 low bits of an E2M1 code.
KVSIFT_HOST_DEVICE float e2m1_magnitude(std::uint8_t code3) {
  // Exponent field e = code3 >> 1, mantissa m = code3 & 1: subnormal (e == 0) is m * 0.5,
  // normal is (1 + m/2) * 2^(e-1).
  const unsigned e = (code3 >> 1) & 3u, m = code3 & 1u;
  if (e == 0) return 0.5f * static_cast<float>(m);
  return (1.0f + 0.5f * static_cast<float>(m)) * static_cast<float>(1u << (e - 1));
}

// The 4-bit code (low nibble) nearest to x.
KVSIFT_HOST_DEVICE std::uint8_t e2m1_from_float(float x) {
  const std::uint32_t bits = detail::float_bits(x);
  const std::uint8_t sign = static_cast<std::uint8_t>((bits >> 28) & 0x8u);
  const float a = detail::bits_float(bits & 0x7fffffffu);
  if (!(a == a)) return 0x7;  // NaN -> +6, following cuda_fp4.h
  // The code of |x| counts the midpoints it has passed. At a midpoint the tie goes to the even
  // code, so midpoints whose lower neighbour has an even code use '>' and the others '>='.
  const std::uint8_t code =
      static_cast<std::uint8_t>((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                                (a > 2.5f) + (a >= 3.5f) + (a > 5.0f));
  return static_cast<std::uint8_t>(sign | code);
}

KVSIFT_HOST_DEVICE float e2m1_to_float(std::uint8_t code) {
  const float mag = e2m1_magnitude(static_cast<std::uint8_t>(code & 0x7u));
  return (code & 0x8u) ? -mag : mag;
}

// Two codes per byte, element 2i in the low nibble and 2i+1 in the high nibble (the order of
// cuda_fp4.h's __nv_fp4x2 and of NVFP4 tensors in memory).
KVSIFT_HOST_DEVICE std::uint8_t e2m1_pack2(std::uint8_t even, std::uint8_t odd) {
  return static_cast<std::uint8_t>((even & 0xfu) | ((odd & 0xfu) << 4));
}
KVSIFT_HOST_DEVICE std::uint8_t e2m1_unpack(const std::uint8_t* packed, int i) {
  return static_cast<std::uint8_t>((packed[i >> 1] >> ((i & 1) * 4)) & 0xfu);
}

}  // namespace kvsift
