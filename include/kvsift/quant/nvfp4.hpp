// NVFP4 groups (docs/algorithms.md §3.2): 16 E2M1 elements sharing one E4M3 block scale, under a
// per-(layer, head) fp32 global factor g:
//   s = e4m3(amax / 6 · g),   q_i = e2m1(x_i · g / s),   x̂_i = q_i · s / g.
// g = 1 by default; the calibrated choice g = 448·6 / amax(stream) puts the largest block scale at
// E4M3's top, away from its subnormal range. We multiply by the reciprocal g / s once per block
// (as NVIDIA's NVFP4 quantize kernels do) instead of dividing per element.
// A block whose scale rounds to zero (all-zero block, or amax·g/6 <= 2^-10) encodes every element
// as +0 and decodes to zeros: no division by zero.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/quant/e2m1.hpp"
#include "kvsift/quant/e4m3.hpp"
#include "kvsift/quant/format.hpp"

namespace kvsift {

// g = 448·6 / amax: the calibrated global factor for a stream whose largest |x| is amax; 1 for an
// all-zero stream.
inline float nvfp4_calibrated_global_factor(float amax) {
  return amax > 0.0f ? kE4M3Max * kE2M1Max / amax : 1.0f;
}

KVSIFT_HOST_DEVICE std::uint8_t nvfp4_scale_code(float amax, float global_factor) {
  return e4m3_from_float(amax / kE2M1Max * global_factor);
}

// Quantizes x[0], x[stride], ..., x[(count-1)·stride] (count <= 16; the missing tail of a short
// group is encoded as zeros) into 8 bytes of packed codes; returns the E4M3 scale code.
template <class T>
KVSIFT_HOST_DEVICE std::uint8_t nvfp4_quantize_group(const T* x,  // [count] with stride
                                                     long stride, int count, float global_factor,
                                                     std::uint8_t* codes) {  // [8]
  float amax = 0.0f;
  for (int i = 0; i < count; ++i) {
    const float v = to_float(x[i * stride]);
    const float a = v < 0.0f ? -v : v;
    amax = a > amax ? a : amax;
  }
  const std::uint8_t scale_code = nvfp4_scale_code(amax, global_factor);
  const float scale = e4m3_to_float(scale_code);
  const float inv = scale > 0.0f ? global_factor / scale : 0.0f;
  for (int i = 0; i < kQuantGroupSize; i += 2) {
    const float lo = i < count ? to_float(x[i * stride]) * inv : 0.0f;
    const float hi = i + 1 < count ? to_float(x[(i + 1) * stride]) * inv : 0.0f;
    // inv == 0 would turn -x into -0 codes; keep the all-zero block canonical (+0).
    codes[i / 2] = scale > 0.0f ? e2m1_pack2(e2m1_from_float(lo), e2m1_from_float(hi)) : 0;
  }
  return scale_code;
}

// One E2M1 unit of a group: x̂ = e2m1 value · step (the decoders that unpack codes their own way,
// e.g. the device sparsity kernel's vector loads, use it to keep the same product).
KVSIFT_HOST_DEVICE float nvfp4_step(std::uint8_t scale_code, float global_factor) {
  return e4m3_to_float(scale_code) / global_factor;
}

template <class T>
KVSIFT_HOST_DEVICE void nvfp4_dequantize_group(const std::uint8_t* codes,  // [8]
                                               std::uint8_t scale_code, float global_factor,
                                               int count, T* out,  // [count] with stride
                                               long stride) {
  const float step = nvfp4_step(scale_code, global_factor);
  for (int i = 0; i < count; ++i) {
    out[i * stride] = from_float<T>(e2m1_to_float(e2m1_unpack(codes, i)) * step);
  }
}

}  // namespace kvsift
