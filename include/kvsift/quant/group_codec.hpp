// One entry point per direction for a group of 16 in any QuantFormat, so layouts (kivi_layout.hpp,
// HybridQuantizer, CUDA kernels) pick the format at run time with one switch per group.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/quant/format.hpp"
#include "kvsift/quant/fp8_group.hpp"
#include "kvsift/quant/nvfp4.hpp"
#include "kvsift/quant/ternary.hpp"

namespace kvsift {

// Quantizes `count` (<= 16) elements spaced `stride` apart into code_bytes_per_group(format) bytes
// of codes; returns the scale code. `global_factor` is used by NVFP4 only.
template <class T>
KVSIFT_HOST_DEVICE std::uint8_t quantize_group(QuantFormat format,
                                               const T* x,  // [count] with stride
                                               long stride, int count, float global_factor,
                                               std::uint8_t* codes) {  // [code bytes]
  switch (format) {
    case QuantFormat::nvfp4:
      return nvfp4_quantize_group(x, stride, count, global_factor, codes);
    case QuantFormat::fp8:
      return fp8_quantize_group(x, stride, count, codes);
    case QuantFormat::ternary:
      return ternary_quantize_group(x, stride, count, codes);
  }
  return 0;
}

template <class T>
KVSIFT_HOST_DEVICE void dequantize_group(QuantFormat format,
                                         const std::uint8_t* codes,  // [code bytes]
                                         std::uint8_t scale_code, float global_factor, int count,
                                         T* out,  // [count] with stride
                                         long stride) {
  switch (format) {
    case QuantFormat::nvfp4:
      nvfp4_dequantize_group(codes, scale_code, global_factor, count, out, stride);
      return;
    case QuantFormat::fp8:
      fp8_dequantize_group(codes, scale_code, count, out, stride);
      return;
    case QuantFormat::ternary:
      ternary_dequantize_group(codes, scale_code, count, out, stride);
      return;
  }
}

}  // namespace kvsift
