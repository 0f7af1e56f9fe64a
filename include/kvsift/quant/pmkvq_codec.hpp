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

namespace kvsift::pmkvq {

// Widths the progressive schedule visits: 16 → 8 → 4 → 2.
inline bool is_valid_bits(int n) { return n == 16 || n == 8 || n == 4 || n == 2; }

inline float round_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// The reference clamps scales to [1e-5, 1e5] (quantizer.py) so a constant group never divides by 0.
constexpr float kMinScale = 1e-5f;
constexpr float kMaxScale = 1e5f;

// Arithmetic of one quantization: the input dtype of the reference tensors.
enum class Arith : std::uint8_t { bf16, f32 };

struct GroupParams {
  float scale = 0.f;  // s (a bf16 value when Arith::bf16)
  float zero = 0.f;   // z = −min
};

// s and z of one group of `g` values (docs/algorithms.md §5.2):
// s = clamp((M − m)/(2^n − 1), 1e-5, 1e5), z = −m. In bf16 each operation rounds once to bf16:
// s = bf16(bf16(M − m)/(2^n − 1)), then the clamp (computed in fp32 and rounded, as PyTorch does).
inline GroupParams group_params(const float* x, std::int64_t g, int n_bits, Arith arith) {
  KVSIFT_CHECK(g > 0, "pmkvq group_params: group size must be > 0, got ", g);
  KVSIFT_CHECK(n_bits >= 1 && n_bits <= 16, "pmkvq group_params: n_bits must be in [1, 16], got ",
               n_bits);
  float m = x[0], M = x[0];
  for (std::int64_t i = 1; i < g; ++i) {
    m = std::fmin(m, x[i]);
    M = std::fmax(M, x[i]);
  }
  const float levels = static_cast<float>((1u << n_bits) - 1u);
  GroupParams p;
  if (arith == Arith::bf16) {
    const float range = round_bf16(M - m);
    const float s = round_bf16(range / levels);
    p.scale = round_bf16(std::fmin(std::fmax(s, kMinScale), kMaxScale));
  } else {
    p.scale = std::fmin(std::fmax((M - m) / levels, kMinScale), kMaxScale);
  }
  p.zero = -m;
  return p;
}

// Code of one value: clamp(round-half-even((x + z)/s), 0, 2^n − 1). The quotient is in fp32 for
// n = 16 (the reference upcasts its 16-bit path) and in the input dtype otherwise.
inline std::uint16_t quantize_value(float x, GroupParams p, int n_bits, Arith arith) {
  float u;
  if (arith == Arith::bf16 && n_bits < 16)
    u = round_bf16(round_bf16(x + p.zero) / p.scale);
  else
    u = (x + p.zero) / p.scale;
  float q = std::nearbyint(u);  // default rounding mode: half to even, as torch.round
  const float qmax = static_cast<float>((1u << n_bits) - 1u);
  q = std::fmin(std::fmax(q, 0.f), qmax);
  return static_cast<std::uint16_t>(q);
}

// x̂ = q·s − z in fp32 (the fake backend's body values; the product is kept as a separate
// rounding so no fused multiply-add can change the result on any compiler).
inline float dequantize_f32(std::uint16_t q, GroupParams p) {
  volatile float prod = static_cast<float>(q) * p.scale;
  return prod - p.zero;
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
// (pack_funcs.py). A short last word is padded with zero codes in its low bits.
inline std::vector<std::uint16_t> pack_msb_first(const std::uint16_t* codes, std::int64_t count,
                                                 int n_bits) {
  const std::int64_t per = 16 / n_bits;
  std::vector<std::uint16_t> words(static_cast<std::size_t>(packed_words(count, n_bits)), 0);
  const std::uint32_t mask = (n_bits == 16) ? 0xffffu : ((1u << n_bits) - 1u);
  for (std::int64_t i = 0; i < count; ++i) {
    KVSIFT_CHECK(codes[i] <= mask, "pmkvq pack_msb_first: code ", codes[i], " at index ", i,
                 " does not fit in ", n_bits, " bits");
    const int shift = 16 - n_bits * static_cast<int>(i % per + 1);
    words[static_cast<std::size_t>(i / per)] |= static_cast<std::uint16_t>(codes[i] << shift);
  }
  return words;
}

inline std::vector<std::uint16_t> unpack_msb_first(const std::uint16_t* words, std::int64_t count,
                                                   int n_bits) {
  KVSIFT_CHECK(is_valid_bits(n_bits), "pmkvq unpack_msb_first: n_bits must be 16, 8, 4 or 2, got ",
               n_bits);
  const std::int64_t per = 16 / n_bits;
  const std::uint32_t mask = (n_bits == 16) ? 0xffffu : ((1u << n_bits) - 1u);
  std::vector<std::uint16_t> codes(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    const int shift = 16 - n_bits * static_cast<int>(i % per + 1);
    codes[static_cast<std::size_t>(i)] =
        static_cast<std::uint16_t>((words[i / per] >> shift) & mask);
  }
  return codes;
}

}  // namespace kvsift::pmkvq
