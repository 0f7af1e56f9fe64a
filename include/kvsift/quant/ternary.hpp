// Ternary (T2) groups (docs/algorithms.md §3.2): 16 codes in {-1, 0, +1} times one scale α stored
// as E4M3. For a fixed set of m kept elements the best α is their mean |x|, and the squared
// error is
//   Σ x² − (Σ_{kept} |x|)² / m,
// so the best set of size m is the m largest |x|, and the best m maximises (S_m)² / m where S_m is
// the sum of the m largest |x|. Ties between equal |x| keep the lower index; ties between m keep
// the smaller m. α is then rounded to E4M3 (saturating at 448); an α that rounds to zero gives an
// all-zero group.
// Packing: 2 bits per element, element i at bits 2·(i % 4) of byte i / 4 (low bits first, like
// NVFP4's low nibble). Codes are 2-bit two's complement: 00 = 0, 01 = +1, 11 = -1; 10 is invalid.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/quant/e4m3.hpp"
#include "kvsift/quant/format.hpp"

namespace kvsift {

inline constexpr std::uint8_t kTernaryZero = 0x0, kTernaryPlus = 0x1, kTernaryMinus = 0x3,
                              kTernaryInvalid = 0x2;

// Sorts the first `count` (<= 16) magnitudes descending into `order` (indices), stable, and returns
// the optimal number of kept elements m (1..count; 0 when count == 0) and their sum in *kept_sum.
KVSIFT_HOST_DEVICE int ternary_optimal_count(const float* magnitude,  // [count]
                                             int count, int* order,   // [count]
                                             float* kept_sum) {
  // Insertion sort: 16 elements, no allocation, usable in a CUDA thread.
  for (int i = 0; i < count; ++i) {
    int j = i;
    while (j > 0 && magnitude[order[j - 1]] < magnitude[i]) {
      order[j] = order[j - 1];
      --j;
    }
    order[j] = i;
  }
  int best_m = 0;
  float best_sum = 0.0f, sum = 0.0f;
  for (int m = 1; m <= count; ++m) {
    sum += magnitude[order[m - 1]];
    // sum² / m > best² / best_m, cross-multiplied so no division; strict keeps the smaller m.
    if (best_m == 0 ||
        sum * sum * static_cast<float>(best_m) > best_sum * best_sum * static_cast<float>(m)) {
      best_m = m;
      best_sum = sum;
    }
  }
  *kept_sum = best_sum;
  return best_m;
}

KVSIFT_HOST_DEVICE std::uint8_t ternary_code(const std::uint8_t* packed, int i) {
  return static_cast<std::uint8_t>((packed[i >> 2] >> ((i & 3) * 2)) & 0x3u);
}

template <class T>
KVSIFT_HOST_DEVICE std::uint8_t ternary_quantize_group(const T* x,  // [count] with stride
                                                       long stride, int count,
                                                       std::uint8_t* codes) {  // [4]
  float value[kQuantGroupSize], magnitude[kQuantGroupSize];
  int order[kQuantGroupSize];
  for (int i = 0; i < count; ++i) {
    value[i] = to_float(x[i * stride]);
    magnitude[i] = value[i] < 0.0f ? -value[i] : value[i];
  }
  float kept_sum = 0.0f;
  const int m = ternary_optimal_count(magnitude, count, order, &kept_sum);
  const std::uint8_t alpha_code = m > 0 ? e4m3_from_float(kept_sum / static_cast<float>(m)) : 0;
  for (int b = 0; b < kQuantGroupSize / 4; ++b) codes[b] = 0;
  if (e4m3_to_float(alpha_code) > 0.0f) {
    for (int r = 0; r < m; ++r) {
      const int i = order[r];
      const std::uint8_t c = value[i] < 0.0f ? kTernaryMinus : kTernaryPlus;
      codes[i >> 2] = static_cast<std::uint8_t>(codes[i >> 2] | (c << ((i & 3) * 2)));
    }
  }
  return alpha_code;
}

// A 2-bit code's sign, two's complement: 01 -> +1, 11 -> -1, 00 (and the invalid 10) -> 0.
KVSIFT_HOST_DEVICE float ternary_sign(std::uint8_t code) {
  return code == kTernaryPlus ? 1.0f : code == kTernaryMinus ? -1.0f : 0.0f;
}

template <class T>
KVSIFT_HOST_DEVICE void ternary_dequantize_group(const std::uint8_t* codes,  // [4]
                                                 std::uint8_t alpha_code, int count,
                                                 T* out,  // [count] with stride
                                                 long stride) {
  const float alpha = e4m3_to_float(alpha_code);
  for (int i = 0; i < count; ++i) {
    out[i * stride] = from_float<T>(ternary_sign(ternary_code(codes, i)) * alpha);
  }
}

}  // namespace kvsift
