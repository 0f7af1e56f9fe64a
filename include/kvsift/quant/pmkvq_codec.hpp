// PM-KVQ codec math (docs/algorithms.md §5.2): the asymmetric min-max group quantizer in the
// reference's arithmetic (bf16 or fp32), the exact integer right shift that requantizes 2n-bit
// codes to n bits (ERS), its scale update, and the int16 MSB-first packing.
// Eigen-free host code; no policy/ includes.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/quant/asymmetric_group.hpp"

namespace kvsift::pmkvq {

// Widths the progressive schedule visits: 16 → 8 → 4 → 2.
inline bool is_valid_bits(int n) { return n == 16 || n == 8 || n == 4 || n == 2; }

inline float round_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// Arithmetic of one quantization: the input dtype of the reference tensors.
enum class Arith : std::uint8_t { bf16, f32 };

// PM-KVQ's quantizer Q_n as a configuration of the shared asymmetric group quantizer
// (quant/asymmetric_group.hpp): z = −m (subtract_zero), s clamped to [1e-5, 1e5] — the bounds
// rounded to the arithmetic dtype, as PyTorch's clamp of a bf16 tensor stores them — and for
// n = 16 the quotient (x + z)/s in fp32 (the reference upcasts its 16-bit path).
inline AsymmetricQuantSpec quant_spec(int n_bits, Arith arith) {
  AsymmetricQuantSpec spec;
  spec.bits = n_bits;
  spec.zero = ZeroConvention::subtract_zero;
  spec.arith = arith == Arith::bf16 ? DType::bf16 : DType::f32;
  spec.scale_min = round_to_dtype(spec.arith, 1e-5f);
  spec.scale_max = round_to_dtype(spec.arith, 1e5f);
  spec.fp32_quotient = n_bits == 16;
  return spec;
}

// Codes of one group of `g` values (already representable in `arith`) at n bits; returns s, z.
inline GroupParams quantize_group(const float* x,  // [g]
                                  std::int64_t g, int n_bits, Arith arith,
                                  std::uint16_t* codes) {  // [g]
  KVSIFT_CHECK(g > 0 && g <= (std::int64_t{1} << 30),
               "pmkvq quantize_group: group size must be in [1, 2^30], got ", g);
  const AsymmetricQuantSpec spec = quant_spec(n_bits, arith);
  spec.validate();
  return asym_quantize_group(spec, x, 1, static_cast<int>(g), codes);
}

// x̂ = q·s − z in fp32 (the fake backend's values; the golden cases are built so that contracting
// this into a fused multiply-add changes no result).
inline float dequantize_f32(std::uint16_t q, GroupParams p) {
  return asym_dequantize(quant_spec(16, Arith::f32), q, p);
}

// The real backend's dequantization for attention: bf16(bf16(bf16(q)·s) − z).
inline float dequantize_bf16(std::uint16_t q, GroupParams p) {
  return round_bf16(round_bf16(round_bf16(static_cast<float>(q)) * p.scale) - p.zero);
}

// Exact integer right shift 2n → n bits (ERS; the reference's shift formula):
// q' = ((2^{2n} − 2^n + 1)·q + 2^{3n−1} − 2^{2n−1} + 2^{n−1}) >> 3n, masked to n bits; equal to
// ⌊q/(2^n + 1) + ½⌋ for every 2n-bit q. 64-bit products: for n = 8 they reach 2^40.
inline std::uint16_t ers_code(std::uint32_t q, int n) {
  KVSIFT_CHECK(n == 8 || n == 4 || n == 2 || n == 1,
               "pmkvq ers_code: target width n must be 8, 4, 2 or 1, got ", n);
  KVSIFT_CHECK(q < (1u << (2 * n)), "pmkvq ers_code: code ", q, " does not fit in ", 2 * n,
               " bits");
  const std::uint64_t a = (1ull << (2 * n)) - (1ull << n) + 1ull;
  const std::uint64_t b = (1ull << (3 * n - 1)) - (1ull << (2 * n - 1)) + (1ull << (n - 1));
  const std::uint64_t r = (a * q + b) >> (3 * n);
  return static_cast<std::uint16_t>(r & ((1ull << n) - 1ull));
}

// The scale of the shifted codes: s' = bf16(s·(2^n + 1)). s is a bf16 value (8 significant bits)
// and 2^n + 1 has at most 9, so the fp32 product is exact and this is the one rounding of the
// reference (`scales *= 2^n + 1` on a bf16 tensor).
inline float ers_scale(float s, int n) {
  return round_bf16(s * static_cast<float>((1u << n) + 1u));
}

// Words of packed codes of `count` codes at `n_bits`: 16/n codes per int16 word.
inline std::int64_t packed_words(std::int64_t count, int n_bits) {
  KVSIFT_CHECK(is_valid_bits(n_bits), "pmkvq packed_words: n_bits must be 16, 8, 4 or 2, got ",
               n_bits);
  const std::int64_t per = 16 / n_bits;
  return (count + per - 1) / per;
}

// int16 words (as 0…65535), 16/n codes per word, the first code in the most significant bits
// (pack_funcs.py): the shared packer with 16-bit words, MSB first. A short last word is padded
// with zero codes in its low bits.
inline std::vector<std::uint16_t> pack_msb_first(const std::uint16_t* codes,  // [count]
                                                 std::int64_t count, int n_bits) {
  KVSIFT_CHECK(is_valid_bits(n_bits), "pmkvq pack_msb_first: n_bits must be 16, 8, 4 or 2, got ",
               n_bits);
  const std::uint32_t mask = n_bits == 16 ? 0xffffu : ((1u << n_bits) - 1u);
  for (std::int64_t i = 0; i < count; ++i)
    KVSIFT_CHECK(codes[i] <= mask, "pmkvq pack_msb_first: code ", codes[i], " at index ", i,
                 " does not fit in ", n_bits, " bits");
  const std::vector<std::uint32_t> w = pack_codes(codes, count, n_bits, 16, PackOrder::msb_first);
  return std::vector<std::uint16_t>(w.begin(), w.end());
}

inline std::vector<std::uint16_t> unpack_msb_first(const std::uint16_t* words,  // [words]
                                                   std::int64_t count, int n_bits) {
  KVSIFT_CHECK(is_valid_bits(n_bits), "pmkvq unpack_msb_first: n_bits must be 16, 8, 4 or 2, got ",
               n_bits);
  const std::vector<std::uint32_t> w(words, words + packed_words(count, n_bits));
  return unpack_codes(w.data(), count, n_bits, 16, PackOrder::msb_first);
}

}  // namespace kvsift::pmkvq
