// FP8 (R8) groups (docs/algorithms.md §3.2): 16 E4M3 elements sharing a power-of-two scale
// s = 2^ceil(log2(amax / 448)) stored as E8M0 (our choice: an E4M3 scale amax/448 would fall in
// E4M3's subnormal range). q_i = e4m3(x_i / s), x̂_i = q_i · s. Scaling by a power of two is exact,
// so the only rounding is E4M3's own, and since amax / s <= 448 no element saturates.
// Zero groups get the smallest scale 2^-127 (code 0), which E8M0 can represent; nothing divides.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/quant/e4m3.hpp"
#include "kvsift/quant/e8m0.hpp"
#include "kvsift/quant/format.hpp"

namespace kvsift {

// E8M0 code of the smallest power of two s in [2^-127, 2^127] with amax <= 448 · s, i.e.
// 2^ceil(log2(amax/448)) computed exactly: amax / 448 is rounded by the division, so the estimate
// is corrected by one step either way with exact comparisons (448 · 2^e is exact in float).
KVSIFT_HOST_DEVICE std::uint8_t fp8_group_scale_code(float amax) {
  std::uint8_t code = e8m0_ceil_from_float(amax / kE4M3Max);
  if (code < 254 && amax > kE4M3Max * e8m0_to_float(code)) ++code;
  if (code > 0 && amax <= kE4M3Max * e8m0_to_float(static_cast<std::uint8_t>(code - 1))) --code;
  return code;
}

template <class T>
KVSIFT_HOST_DEVICE std::uint8_t fp8_quantize_group(const T* x,  // [count] with stride
                                                   long stride, int count,
                                                   std::uint8_t* codes) {  // [16]
  float amax = 0.0f;
  for (int i = 0; i < count; ++i) {
    const float v = to_float(x[i * stride]);
    const float a = v < 0.0f ? -v : v;
    amax = a > amax ? a : amax;
  }
  const std::uint8_t scale_code = fp8_group_scale_code(amax);
  // 1/s = 2^-e is E8M0 code 254 - code (codes 0..254 mirror around 127).
  const float inv = e8m0_to_float(static_cast<std::uint8_t>(254 - scale_code));
  for (int i = 0; i < kQuantGroupSize; ++i) {
    codes[i] = i < count ? e4m3_from_float(to_float(x[i * stride]) * inv) : 0;
  }
  return scale_code;
}

template <class T>
KVSIFT_HOST_DEVICE void fp8_dequantize_group(const std::uint8_t* codes,  // [16]
                                             std::uint8_t scale_code, int count,
                                             T* out,  // [count] with stride
                                             long stride) {
  const float scale = e8m0_to_float(scale_code);
  for (int i = 0; i < count; ++i) out[i * stride] = from_float<T>(e4m3_to_float(codes[i]) * scale);
}

}  // namespace kvsift
