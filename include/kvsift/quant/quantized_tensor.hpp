// Whole-tensor quantization of a [tokens, channels] f32 tensor along one group axis (KIVI layout,
// kivi_layout.hpp), the host API behind `kvsift quantize` and the reference for the
// HybridQuantizer. Packed form: codes [num_groups, code_bytes_per_group] (u8), scales [num_groups]
// (u8, E4M3 for nvfp4/ternary, E8M0 for fp8) and, for nvfp4, one fp32 global factor. Decoding
// validates the packed data first (byte counts, NaN or negative scale codes, NaN FP8 elements, the
// invalid ternary code 10) and throws kvsift::Error naming the group, instead of producing garbage.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/quant/format.hpp"
#include "kvsift/quant/group_codec.hpp"
#include "kvsift/quant/kivi_layout.hpp"

namespace kvsift {

struct QuantizedTensor {
  QuantFormat format = QuantFormat::nvfp4;
  KiviGrid grid;
  float global_factor = 1.0f;        // NVFP4's g; 1 for the other formats
  std::vector<std::uint8_t> codes;   // [num_groups, code_bytes_per_group(format)]
  std::vector<std::uint8_t> scales;  // [num_groups]

  // Codes + scales (+ 4 for NVFP4's fp32 global factor).
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(codes.size() + scales.size()) +
           (format == QuantFormat::nvfp4 ? 4 : 0);
  }
};

namespace detail {
inline void check_tensor_shape(std::int64_t tokens, std::int64_t channels) {
  KVSIFT_CHECK(tokens > 0 && channels > 0 && tokens % kQuantGroupSize == 0 &&
                   channels % kQuantGroupSize == 0,
               "quantized tensor shape [", tokens, ", ", channels,
               "] must have both extents positive multiples of ", kQuantGroupSize);
  // Every later index (group offsets, the output size) is computed from tokens * channels in
  // int64: it must not wrap, or a tiny buffer would pass the byte-count checks.
  checked_mul(tokens, channels, "quantized tensor tokens * channels");
}
}  // namespace detail

// Largest |x| of a tensor, for nvfp4_calibrated_global_factor().
inline float abs_max(const float* x, std::int64_t n) {  // [n]
  float amax = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return amax;
}

// x: [tokens, channels], row-major, finite. global_factor: NVFP4's g (finite, > 0; ignored by the
// other formats).
inline QuantizedTensor quantize_tensor(const float* x, std::int64_t tokens, std::int64_t channels,
                                       QuantFormat format, GroupAxis axis,
                                       float global_factor = 1.0f) {
  detail::check_tensor_shape(tokens, channels);
  KVSIFT_CHECK(std::isfinite(global_factor) && global_factor > 0.0f, "global_factor (",
               global_factor, ") must be finite and > 0");
  for (std::int64_t i = 0; i < tokens * channels; ++i) {
    KVSIFT_CHECK(std::isfinite(x[i]), "quantize input x[", i / channels, ", ", i % channels,
                 "] is not finite (", x[i], ")");
  }
  QuantizedTensor q;
  q.format = format;
  q.grid = KiviGrid{tokens, channels, axis};
  q.global_factor = format == QuantFormat::nvfp4 ? global_factor : 1.0f;
  const int code_bytes = code_bytes_per_group(format);
  const std::int64_t groups = q.grid.num_groups();
  q.codes.assign(static_cast<std::size_t>(groups * code_bytes), 0);
  q.scales.assign(static_cast<std::size_t>(groups), 0);
  for (std::int64_t g = 0; g < groups; ++g) {
    q.scales[g] = quantize_group(format, x + q.grid.group_offset(g), q.grid.group_stride(),
                                 kQuantGroupSize, q.global_factor, &q.codes[g * code_bytes]);
  }
  return q;
}

// Throws kvsift::Error describing the first fault of a packed tensor.
inline void validate_quantized(const QuantizedTensor& q) {
  detail::check_tensor_shape(q.grid.tokens, q.grid.channels);
  KVSIFT_CHECK(q.grid.axis == GroupAxis::token || q.grid.axis == GroupAxis::channel,
               "quantized tensor group axis code ", int(q.grid.axis),
               " is neither token nor channel");
  const std::int64_t groups = q.grid.num_groups();
  const int code_bytes = code_bytes_per_group(q.format);
  const std::int64_t code_total =
      checked_mul(groups, std::int64_t{code_bytes}, "quantized tensor groups * code bytes");
  KVSIFT_CHECK(static_cast<std::int64_t>(q.codes.size()) == code_total, quant_format_name(q.format),
               " codes hold ", q.codes.size(), " bytes, expected ", groups * code_bytes, " (",
               groups, " groups x ", code_bytes, ")");
  KVSIFT_CHECK(static_cast<std::int64_t>(q.scales.size()) == groups, quant_format_name(q.format),
               " scales hold ", q.scales.size(), " bytes, expected ", groups);
  KVSIFT_CHECK(std::isfinite(q.global_factor) && q.global_factor > 0.0f, "global_factor (",
               q.global_factor, ") must be finite and > 0");
  for (std::int64_t g = 0; g < groups; ++g) {
    const std::uint8_t s = q.scales[g];
    const std::uint8_t* c = &q.codes[g * code_bytes];
    switch (q.format) {
      case QuantFormat::nvfp4:
      case QuantFormat::ternary:
        KVSIFT_CHECK(!e4m3_is_nan(s) && (s & 0x80u) == 0, quant_format_name(q.format), " group ", g,
                     " has an invalid E4M3 scale code 0x", std::hex, int(s), " (NaN or negative)");
        break;
      case QuantFormat::fp8:
        KVSIFT_CHECK(s != kE8M0NaN, "fp8 group ", g, " has the NaN E8M0 scale code 0xff");
        break;
    }
    for (int i = 0; i < kQuantGroupSize; ++i) {
      if (q.format == QuantFormat::fp8) {
        KVSIFT_CHECK(!e4m3_is_nan(c[i]), "fp8 group ", g, " element ", i, " has a NaN E4M3 code 0x",
                     std::hex, int(c[i]));
      } else if (q.format == QuantFormat::ternary) {
        KVSIFT_CHECK(ternary_code(c, i) != kTernaryInvalid, "ternary group ", g, " element ", i,
                     " has the invalid code 0b10");
      }
    }
  }
}

// out: [tokens, channels]
inline void dequantize_tensor(const QuantizedTensor& q, float* out) {
  validate_quantized(q);
  const int code_bytes = code_bytes_per_group(q.format);
  for (std::int64_t g = 0; g < q.grid.num_groups(); ++g) {
    dequantize_group(q.format, &q.codes[g * code_bytes], q.scales[g], q.global_factor,
                     kQuantGroupSize, out + q.grid.group_offset(g), q.grid.group_stride());
  }
}

inline std::vector<float> dequantize_tensor(const QuantizedTensor& q) {
  // Validate before allocating: the byte-count checks bound tokens * channels by the codes the
  // caller actually holds, so a hostile header cannot request a multi-GB output.
  validate_quantized(q);
  std::vector<float> out(checked_size(q.grid.tokens * q.grid.channels, "dequantized elements"));
  dequantize_tensor(q, out.data());
  return out;
}

}  // namespace kvsift
