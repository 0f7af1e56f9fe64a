// How one KV head of one Continuous Thinking block stores its tokens (docs/algorithms.md §3.2,
// §3.4). A block holds tokens of one thought type, so it has one format: full precision (f32, for
// tests and for R16-style runs) or one of TBQ's quantized formats (NVFP4, FP8 E4M3 + E8M0,
// ternary). Quantized blocks use the KIVI layout (kivi_layout.hpp) over the block's [slots,
// head_dim] grid:
//   keys   per channel: a group = 16 consecutive slots of one channel (GroupAxis::token)
//   values per token:   a group = 16 consecutive channels of one slot   (GroupAxis::channel)
// Byte layout of one (block, head), S = slots per block, D = head_dim:
//   f32        keys [S, D] f32 | values [S, D] f32
//   quantized  key codes [S/16 · D, cb] | key scales [S/16 · D] | value codes [S · D/16, cb] |
//              value scales [S · D/16]          (cb = code_bytes_per_group(format))
// Byte counts come from block_bytes.hpp (the one accounting). Every writer below touches only the
// bytes of the slot (f32) or the 16-slot group (quantized) it writes, which is what lets the table
// reuse evicted slots while the survivors' bytes stay bit-identical (§3.4: nothing is gathered or
// moved).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "kvsift/core/config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/paged/block_bytes.hpp"
#include "kvsift/quant/e2m1.hpp"
#include "kvsift/quant/e4m3.hpp"
#include "kvsift/quant/e8m0.hpp"
#include "kvsift/quant/format.hpp"
#include "kvsift/quant/group_codec.hpp"
#include "kvsift/quant/kivi_layout.hpp"
#include "kvsift/quant/ternary.hpp"

namespace kvsift {

inline constexpr BlockFormat block_format_of(QuantFormat f) {
  return f == QuantFormat::fp8       ? BlockFormat::fp8
         : f == QuantFormat::ternary ? BlockFormat::ternary
                                     : BlockFormat::nvfp4;
}

// The quantized formats take their names and spellings from quant/format.hpp.
inline constexpr std::string_view block_format_name(BlockFormat f) {
  return is_quantized(f) ? quant_format_name(quant_format_of(f)) : "f32";
}

// Accepts "f32" (or "full", and the bit widths "32"/"16") and every spelling parse_quant_format
// accepts.
inline BlockFormat parse_block_format(std::string_view name) {
  if (name == "f32" || name == "full" || name == "32" || name == "16") return BlockFormat::f32;
  if (const auto q = find_quant_format(name)) return block_format_of(*q);
  KVSIFT_FAIL("unknown block format '", std::string(name),
              "' (expected f32, nvfp4, fp8 or ternary, or 32/16, 4, 8, 2)");
}

// Geometry and byte offsets of one (block, head) in one format.
struct BlockHeadLayout {
  BlockFormat format = BlockFormat::f32;
  std::int64_t slots = 0;     // S, a multiple of 16
  std::int64_t head_dim = 0;  // D, a multiple of 16

  std::int64_t key_groups() const { return slots / kQuantGroupSize * head_dim; }
  std::int64_t value_groups() const { return slots * (head_dim / kQuantGroupSize); }
  std::int64_t code_bytes() const { return code_bytes_per_group(quant_format_of(format)); }

  // Bytes of element codes (raw floats for f32) and of group scales (block_bytes.hpp).
  std::int64_t codes_bytes() const { return block_head_code_bytes(format, slots, head_dim); }
  std::int64_t scales_bytes() const { return block_head_scale_bytes(format, slots, head_dim); }
  std::int64_t bytes() const { return codes_bytes() + scales_bytes(); }

  std::int64_t key_codes_offset() const { return 0; }
  std::int64_t key_scales_offset() const { return key_groups() * code_bytes(); }
  std::int64_t value_codes_offset() const { return key_scales_offset() + key_groups(); }
  std::int64_t value_scales_offset() const {
    return value_codes_offset() + value_groups() * code_bytes();
  }
  // f32 layout
  std::int64_t f32_keys_offset() const { return 0; }
  std::int64_t f32_values_offset() const { return slots * head_dim * 4; }
};

namespace detail {
// The two element-level helpers below are host/device. The CUDA append kernel
// (cuda/paged_append.cu) still uses them to write a key under a sealed group's scale; the CPU table
// no longer does (§3.4: a refilled group gets fresh scales, write_token_group) and the GPU side is
// to follow. Replaces the code of element i (0..15) of one packed group, leaving every other
// element's bits.
KVSIFT_HOST_DEVICE void set_element_code(QuantFormat format, std::uint8_t* codes, int i,
                                         std::uint8_t code) {
  switch (format) {
    case QuantFormat::nvfp4: {
      const int shift = (i & 1) * 4;
      codes[i >> 1] =
          static_cast<std::uint8_t>((codes[i >> 1] & ~(0xfu << shift)) | ((code & 0xfu) << shift));
      return;
    }
    case QuantFormat::fp8:
      codes[i] = code;
      return;
    case QuantFormat::ternary: {
      const int shift = (i & 3) * 2;
      codes[i >> 2] =
          static_cast<std::uint8_t>((codes[i >> 2] & ~(0x3u << shift)) | ((code & 0x3u) << shift));
      return;
    }
  }
}

// The code of x in a group whose scale is already fixed: the nearest representable value under that
// scale, saturating (NVFP4 at ±6·s/g, FP8 at ±448·s, ternary at ±α). A zero scale encodes zero.
KVSIFT_HOST_DEVICE std::uint8_t encode_with_scale(QuantFormat format, float x,
                                                  std::uint8_t scale_code, float global_factor) {
  switch (format) {
    case QuantFormat::nvfp4: {
      const float scale = e4m3_to_float(scale_code);
      return scale > 0.0f ? e2m1_from_float(x * global_factor / scale) : 0;
    }
    case QuantFormat::fp8: {
      // 1/s = 2^-e is E8M0 code 254 - code, exact (fp8_group.hpp).
      const float inv = e8m0_to_float(static_cast<std::uint8_t>(254 - scale_code));
      return e4m3_from_float(x * inv);
    }
    case QuantFormat::ternary: {
      // Nearest of {-α, 0, +α}; the midpoint α/2 goes to 0.
      const float alpha = e4m3_to_float(scale_code);
      const float a = x < 0.0f ? -x : x;
      if (!(alpha > 0.0f) || !(a > 0.5f * alpha)) return kTernaryZero;
      return x < 0.0f ? kTernaryMinus : kTernaryPlus;
    }
  }
  return 0;
}
}  // namespace detail

// Writes the value row of `slot` (per-token groups: every group belongs to this slot alone).
inline void write_value_row(const BlockHeadLayout& L, std::uint8_t* base, std::int64_t slot,
                            const float* value,  // [D]
                            float global_factor) {
  if (!is_quantized(L.format)) {
    std::memcpy(base + L.f32_values_offset() + slot * L.head_dim * 4, value,
                static_cast<std::size_t>(L.head_dim) * 4);
    return;
  }
  const QuantFormat q = quant_format_of(L.format);
  const std::int64_t per_token = L.head_dim / kQuantGroupSize;
  for (std::int64_t cb = 0; cb < per_token; ++cb) {
    const std::int64_t g = slot * per_token + cb;  // KiviGrid channel-axis numbering
    base[L.value_scales_offset() + g] =
        quantize_group(q, value + cb * kQuantGroupSize, 1, kQuantGroupSize, global_factor,
                       base + L.value_codes_offset() + g * L.code_bytes());
  }
}

// f32 blocks: the key row of `slot`.
inline void write_key_row_f32(const BlockHeadLayout& L, std::uint8_t* base, std::int64_t slot,
                              const float* key) {  // [D]
  std::memcpy(base + L.f32_keys_offset() + slot * L.head_dim * 4, key,
              static_cast<std::size_t>(L.head_dim) * 4);
}

// Quantized blocks: writes one already quantized 16-token group (staged_group_quantizer.hpp) into
// slot group `group` (slots 16·group .. 16·group + 15): its key codes and fresh key scales (one
// group per channel) and the value codes and scales of its 16 slots. Touches nothing else.
inline void write_token_group(const BlockHeadLayout& L, std::uint8_t* base, std::int64_t group,
                              const std::uint8_t* key_codes,    // [head_dim, code bytes]
                              const std::uint8_t* key_scales,   // [head_dim]
                              const std::uint8_t* value_codes,  // [16, head_dim / 16, code bytes]
                              const std::uint8_t* value_scales) {  // [16, head_dim / 16]
  const std::int64_t cb = L.code_bytes(), D = L.head_dim;
  // KiviGrid token-axis numbering: key group of (slot group, channel c) = group · D + c.
  std::memcpy(base + L.key_codes_offset() + group * D * cb, key_codes,
              static_cast<std::size_t>(D * cb));
  std::memcpy(base + L.key_scales_offset() + group * D, key_scales, static_cast<std::size_t>(D));
  // Channel-axis numbering: value group of (slot, block b) = slot · D/16 + b, so the group's 16
  // slots are one contiguous run of 16 · D/16 groups.
  const std::int64_t first = group * kQuantGroupSize * (D / kQuantGroupSize);
  const std::int64_t n = kQuantGroupSize * (D / kQuantGroupSize);
  std::memcpy(base + L.value_codes_offset() + first * cb, value_codes,
              static_cast<std::size_t>(n * cb));
  std::memcpy(base + L.value_scales_offset() + first, value_scales, static_cast<std::size_t>(n));
}

// Dequantizes one (block, head): keys and values [S, D] f32 (never written groups read as zeros).
inline void dequantize_block_head(const BlockHeadLayout& L, const std::uint8_t* base,
                                  float global_factor,
                                  float* keys,      // [S, D]
                                  float* values) {  // [S, D]
  const std::int64_t n = L.slots * L.head_dim;
  if (!is_quantized(L.format)) {
    std::memcpy(keys, base + L.f32_keys_offset(), static_cast<std::size_t>(n) * 4);
    std::memcpy(values, base + L.f32_values_offset(), static_cast<std::size_t>(n) * 4);
    return;
  }
  const QuantFormat q = quant_format_of(L.format);
  const KiviGrid key_grid{L.slots, L.head_dim, GroupAxis::token};
  for (std::int64_t g = 0; g < L.key_groups(); ++g) {
    dequantize_group(q, base + L.key_codes_offset() + g * L.code_bytes(),
                     base[L.key_scales_offset() + g], global_factor, kQuantGroupSize,
                     keys + key_grid.group_offset(g), key_grid.group_stride());
  }
  const KiviGrid value_grid{L.slots, L.head_dim, GroupAxis::channel};
  for (std::int64_t g = 0; g < L.value_groups(); ++g) {
    dequantize_group(q, base + L.value_codes_offset() + g * L.code_bytes(),
                     base[L.value_scales_offset() + g], global_factor, kQuantGroupSize,
                     values + value_grid.group_offset(g), value_grid.group_stride());
  }
}

}  // namespace kvsift
