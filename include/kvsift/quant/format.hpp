// The quantization formats of ThinKV's TBQ (docs/algorithms.md §3.2) and the bytes one group of 16
// elements costs in each. Every format stores one 8-bit scale per group:
//   nvfp4   16 E2M1 codes, 2 per byte (8 B) + E4M3 block scale (1 B) = 9 B  = 4.5 bits/element
//   fp8     16 E4M3 codes (16 B)            + E8M0 group scale (1 B) = 17 B = 8.5 bits/element
//   ternary 16 2-bit codes, 4 per byte (4 B) + E4M3 α (1 B)           = 5 B  = 2.5 bits/element
// NVFP4's per-(layer, head) fp32 global factor is stream metadata, not part of a group.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kvsift/core/config.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

// Elements per quantization group (docs/algorithms.md §4: "quant group 16").
inline constexpr int kQuantGroupSize = 16;

enum class QuantFormat : std::uint8_t { nvfp4, fp8, ternary };

inline constexpr std::string_view quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::nvfp4:
      return "nvfp4";
    case QuantFormat::fp8:
      return "fp8";
    case QuantFormat::ternary:
      return "ternary";
  }
  return "unknown";
}

// The names above, their aliases and the paper's bit-width shorthand ("4", "8", "2" as in
// "R4 E4 T2"); nullopt for anything else. The one list of accepted spellings.
inline std::optional<QuantFormat> find_quant_format(std::string_view name) {
  if (name == "nvfp4" || name == "fp4" || name == "4") return QuantFormat::nvfp4;
  if (name == "fp8" || name == "e4m3" || name == "8") return QuantFormat::fp8;
  if (name == "ternary" || name == "2") return QuantFormat::ternary;
  return std::nullopt;
}

inline QuantFormat parse_quant_format(std::string_view name) {
  if (const auto f = find_quant_format(name)) return *f;
  KVSIFT_FAIL("unknown quantization format '", std::string(name),
              "' (expected nvfp4, fp8 or ternary)");
}

KVSIFT_HOST_DEVICE constexpr int code_bytes_per_group(QuantFormat f) {
  return f == QuantFormat::nvfp4 ? kQuantGroupSize / 2
         : f == QuantFormat::fp8 ? kQuantGroupSize
                                 : kQuantGroupSize / 4;
}
KVSIFT_HOST_DEVICE constexpr int scale_bytes_per_group(QuantFormat) { return 1; }
KVSIFT_HOST_DEVICE constexpr int bytes_per_group(QuantFormat f) {
  return code_bytes_per_group(f) + scale_bytes_per_group(f);
}
inline constexpr double bits_per_element(QuantFormat f) {
  return 8.0 * bytes_per_group(f) / kQuantGroupSize;
}

}  // namespace kvsift
