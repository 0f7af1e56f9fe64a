// Storage dtypes of a KV cache (f32, f16, bf16) and their conversions to and from fp32.
// All scoring math runs in fp32 (docs/algorithms.md, notation); these conversions are the only place
// where storage formats meet the math. Float -> 16-bit rounds to nearest even and keeps NaN a NaN.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "kvsift/core/config.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

enum class DType : std::uint8_t { f32, f16, bf16 };

inline constexpr std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

inline constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
  }
  return "unknown";
}

inline DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32") return DType::f32;
  if (name == "f16" || name == "float16") return DType::f16;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  KVSIFT_FAIL("unknown dtype '", std::string(name), "' (expected f32, f16 or bf16)");
}

// IEEE binary16 and bfloat16 as raw bits: storage types with no arithmetic of their own.
struct f16_t {
  std::uint16_t bits;
};
struct bf16_t {
  std::uint16_t bits;
};

namespace detail {
KVSIFT_HOST_DEVICE std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
KVSIFT_HOST_DEVICE float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

KVSIFT_HOST_DEVICE std::uint16_t float_to_f16_bits(float f) {
  const std::uint32_t x = detail::float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (ax >= 0x38800000u) {  // normal half: rebias the exponent, round the 13 dropped bits to even
    return static_cast<std::uint16_t>(sign | ((ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13));
  }
  // Subnormal or zero: 0.5f has an ulp of 2^-24, the half subnormal step, so the FPU's own
  // round-to-nearest-even of |f| + 0.5 leaves the half mantissa in the low bits.
  const float sum = detail::bits_float(ax) + 0.5f;
  return static_cast<std::uint16_t>(sign | (detail::float_bits(sum) - 0x3f000000u));
}

KVSIFT_HOST_DEVICE float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return detail::bits_float(detail::float_bits(mag) | sign);
  }
  if (exp == 31) return detail::bits_float(sign | 0x7f800000u | (mant << 13));
  return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

KVSIFT_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t x = detail::float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

KVSIFT_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) {
  return detail::bits_float(static_cast<std::uint32_t>(b) << 16);
}

KVSIFT_HOST_DEVICE float to_float(float x) { return x; }
KVSIFT_HOST_DEVICE float to_float(f16_t x) { return f16_bits_to_float(x.bits); }
KVSIFT_HOST_DEVICE float to_float(bf16_t x) { return bf16_bits_to_float(x.bits); }

template <class T>
KVSIFT_HOST_DEVICE T from_float(float x);
template <>
KVSIFT_HOST_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
KVSIFT_HOST_DEVICE f16_t from_float<f16_t>(float x) {
  return f16_t{float_to_f16_bits(x)};
}
template <>
KVSIFT_HOST_DEVICE bf16_t from_float<bf16_t>(float x) {
  return bf16_t{float_to_bf16_bits(x)};
}

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<f16_t> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<bf16_t> {
  static constexpr DType value = DType::bf16;
};

}  // namespace kvsift

// Runs a lambda with `T` bound to the storage type of `dtype` (FlashInfer's DISPATCH_* idiom):
//   KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] { score<T>(kv); });
#define KVSIFT_DISPATCH_DTYPE(dtype, T, ...)                                      \
  [&]() {                                                                         \
    switch (dtype) {                                                              \
      case ::kvsift::DType::f32: {                                                \
        using T = float;                                                          \
        return __VA_ARGS__();                                                     \
      }                                                                           \
      case ::kvsift::DType::f16: {                                                \
        using T = ::kvsift::f16_t;                                                \
        return __VA_ARGS__();                                                     \
      }                                                                           \
      case ::kvsift::DType::bf16: {                                               \
        using T = ::kvsift::bf16_t;                                               \
        return __VA_ARGS__();                                                     \
      }                                                                           \
    }                                                                             \
    KVSIFT_FAIL("unknown dtype code ", static_cast<int>(dtype));                  \
  }()
