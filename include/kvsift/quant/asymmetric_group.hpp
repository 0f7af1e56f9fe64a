// One asymmetric min-max group quantizer for the integer KV baselines (docs/algorithms.md §5.1
// KIVI, §5.2 PM-KVQ). Per group of G values with m = min, M = max:
//   s = clamp(r(r(M − m) / (2^b − 1)), scale_min, scale_max)
//   q = round_half_even(clamp(r(r(x − m) / s), 0, 2^b − 1))
//   ZeroConvention::add_min        (KIVI)    stored zero = m,   x̂ = q·s + m
//   ZeroConvention::subtract_zero  (PM-KVQ)  stored zero = z = −m, x̂ = q·s − z
// where r() rounds to `arith` after every operation, emulating the reference's activation-dtype
// arithmetic (KIVI: fp16; PM-KVQ: bf16). Rounding the exact fp32 result of one fp16/bf16 operation
// to fp16/bf16 equals the correctly rounded fp16/bf16 operation (fp32 has ≥ 2p + 2 bits), so
// emulation is exact. Without a lower clamp, s = 0 (a constant group) gives q = 0 and x̂ = m
// exactly: our documented choice where the reference divides 0/0 (KIVI, §5.1).
// Packing: codes_per_word = word_bits / b; PackOrder::lsb_first puts code j of a word at bits
// [b·j, b·j + b) (KIVI int32 words); PackOrder::msb_first puts code 0 in the top bits (PM-KVQ
// int16 words). Byte accounting counts packed words plus one scale and one zero per group.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/quant/kivi_layout.hpp"  // GroupAxis

namespace kvsift {

enum class ZeroConvention : std::uint8_t { add_min, subtract_zero };
enum class PackOrder : std::uint8_t { lsb_first, msb_first };

struct AsymmetricQuantSpec {
  int bits = 2;  // 1..16
  ZeroConvention zero = ZeroConvention::add_min;
  DType arith = DType::f16;    // every operation of s and q rounded to this
  float scale_min = 0.0f;      // 0 and +inf: no clamp (KIVI)
  float scale_max = INFINITY;  // PM-KVQ: [1e-5, 1e5]
  // PM-KVQ's 16-bit path computes s in `arith` but the quotient (x − m)/s in fp32 (its codes
  // reach 65535, beyond bf16's integers); false: the quotient is rounded to `arith` as well.
  bool fp32_quotient = false;

  int max_code() const { return (1 << bits) - 1; }
  void validate() const {
    KVSIFT_CHECK(bits >= 1 && bits <= 16, "quantizer bits (", bits, ") must be in [1, 16]");
    KVSIFT_CHECK(scale_min >= 0.0f && scale_min <= scale_max, "quantizer scale clamp [", scale_min,
                 ", ", scale_max, "] must satisfy 0 <= scale_min <= scale_max");
  }
};

struct GroupParams {
  float scale = 0.0f;
  float zero = 0.0f;  // m (add_min) or z = −m (subtract_zero), already rounded to `arith`
};

inline float round_to_dtype(DType t, float x) {
  switch (t) {
    case DType::f16:
      return f16_bits_to_float(float_to_f16_bits(x));
    case DType::bf16:
      return bf16_bits_to_float(float_to_bf16_bits(x));
    case DType::f32:
      break;
  }
  return x;
}

// Quantizes `count` values spaced `stride` apart (already representable in spec.arith) into
// codes[0..count); returns the group's scale and zero.
inline GroupParams asym_quantize_group(const AsymmetricQuantSpec& spec,
                                       const float* x,  // [count] with stride
                                       long stride, int count,
                                       std::uint16_t* codes) {  // [count]
  KVSIFT_CHECK(count > 0, "group size (", count, ") must be positive");
  float lo = x[0], hi = x[0];
  for (int i = 1; i < count; ++i) {
    lo = std::fmin(lo, x[i * stride]);
    hi = std::fmax(hi, x[i * stride]);
  }
  const DType a = spec.arith;
  float s = round_to_dtype(a, round_to_dtype(a, hi - lo) / static_cast<float>(spec.max_code()));
  s = std::fmin(std::fmax(s, spec.scale_min), spec.scale_max);
  const float qmax = static_cast<float>(spec.max_code());
  for (int i = 0; i < count; ++i) {
    float u = 0.0f;  // s == 0: constant group, code 0 (documented deviation, §5.1)
    if (s > 0.0f)
      u = spec.fp32_quotient ? (x[i * stride] - lo) / s
                             : round_to_dtype(a, round_to_dtype(a, x[i * stride] - lo) / s);
    u = std::fmin(std::fmax(u, 0.0f), qmax);
    codes[i] = static_cast<std::uint16_t>(std::nearbyint(u));  // default mode: half to even
  }
  GroupParams p;
  p.scale = s;
  p.zero = spec.zero == ZeroConvention::add_min ? lo : round_to_dtype(a, -lo);
  return p;
}

// x̂ in fp32 (KIVI's gemv kernel dequantizes in fp32; PM-KVQ rounds afterwards itself).
inline float asym_dequantize(const AsymmetricQuantSpec& spec, std::uint16_t code, GroupParams p) {
  const float qs = static_cast<float>(code) * p.scale;
  return spec.zero == ZeroConvention::add_min ? qs + p.zero : qs - p.zero;
}

// Quantizes a row-major [rows, cols] tensor in groups of `group` along `axis` (GroupAxis::token:
// a group is `group` consecutive rows of one column; GroupAxis::channel: `group` consecutive
// columns of one row). codes: [rows, cols]; params: for the token axis [rows/group, cols], for the
// channel axis [rows, cols/group].
inline void asym_quantize_tensor(const AsymmetricQuantSpec& spec,
                                 const float* x,  // [rows, cols]
                                 std::int64_t rows, std::int64_t cols, GroupAxis axis, int group,
                                 std::uint16_t* codes,  // [rows, cols]
                                 GroupParams* params) {
  spec.validate();
  const std::int64_t along = axis == GroupAxis::token ? rows : cols;
  KVSIFT_CHECK(group > 0 && along % group == 0, "group size (", group, ") must divide the ",
               group_axis_name(axis), " extent (", along, ")");
  std::vector<std::uint16_t> tmp(static_cast<std::size_t>(group));
  if (axis == GroupAxis::token) {
    for (std::int64_t gb = 0; gb < rows / group; ++gb)
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t off = gb * group * cols + c;
        params[gb * cols + c] =
            asym_quantize_group(spec, x + off, static_cast<long>(cols), group, tmp.data());
        for (int i = 0; i < group; ++i) codes[off + i * cols] = tmp[static_cast<std::size_t>(i)];
      }
  } else {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t gb = 0; gb < cols / group; ++gb) {
        const std::int64_t off = r * cols + gb * group;
        params[r * (cols / group) + gb] = asym_quantize_group(spec, x + off, 1, group, codes + off);
      }
  }
}

// Packs `count` codes of `bits` bits into words of `word_bits` (16 or 32) bits, word_bits / bits
// codes per word (a partial last word is zero-filled). Words are returned as uint32 (an int32
// word with bit 31 set reinterprets to a negative value; int16 words occupy the low 16 bits).
inline std::vector<std::uint32_t> pack_codes(const std::uint16_t* codes,  // [count]
                                             std::int64_t count, int bits, int word_bits,
                                             PackOrder order) {
  KVSIFT_CHECK(word_bits == 16 || word_bits == 32, "word_bits (", word_bits, ") must be 16 or 32");
  KVSIFT_CHECK(bits >= 1 && bits <= word_bits && word_bits % bits == 0, "bits (", bits,
               ") must divide word_bits (", word_bits, ")");
  const int per = word_bits / bits;
  std::vector<std::uint32_t> words(static_cast<std::size_t>((count + per - 1) / per), 0u);
  const std::uint32_t mask = bits == 32 ? 0xffffffffu : ((1u << bits) - 1u);
  for (std::int64_t i = 0; i < count; ++i) {
    const int j = static_cast<int>(i % per);
    const int shift = order == PackOrder::lsb_first ? bits * j : word_bits - bits * (j + 1);
    words[static_cast<std::size_t>(i / per)] |= (codes[i] & mask) << shift;
  }
  return words;
}

inline std::vector<std::uint16_t> unpack_codes(const std::uint32_t* words,  // [ceil(count/per)]
                                               std::int64_t count, int bits, int word_bits,
                                               PackOrder order) {
  KVSIFT_CHECK(word_bits == 16 || word_bits == 32, "word_bits (", word_bits, ") must be 16 or 32");
  KVSIFT_CHECK(bits >= 1 && bits <= word_bits && word_bits % bits == 0, "bits (", bits,
               ") must divide word_bits (", word_bits, ")");
  const int per = word_bits / bits;
  const std::uint32_t mask = (1u << bits) - 1u;
  std::vector<std::uint16_t> codes(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    const int j = static_cast<int>(i % per);
    const int shift = order == PackOrder::lsb_first ? bits * j : word_bits - bits * (j + 1);
    codes[static_cast<std::size_t>(i)] =
        static_cast<std::uint16_t>((words[i / per] >> shift) & mask);
  }
  return codes;
}

// Bytes that `elements` codes in `groups` groups cost: packed words (word_bits / bits codes per
// word, the last word padded; call it per packing unit — KIVI packs each channel's tokens or each
// token's channels separately) plus one scale and one zero of `param_bytes` bytes per group.
inline std::int64_t asym_quantized_bytes(std::int64_t elements, std::int64_t groups, int bits,
                                         int word_bits, int param_bytes) {
  const std::int64_t per = word_bits / bits;
  const std::int64_t words = (elements + per - 1) / per;
  return words * (word_bits / 8) + groups * 2 * param_bytes;
}

}  // namespace kvsift
