// Test helper: an owned random KV cache (any storage dtype) and random window queries, with the
// views the scorers take. Values are stored already rounded to the dtype, so an oracle reading
// them through to_float() sees exactly what the library sees.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift_test {

// A 4-d tensor with storage of `dtype`, filled with N(0, scale) values (or set explicitly).
struct OwnedTensor {
  kvsift::DType dtype = kvsift::DType::f32;
  std::int64_t d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  std::vector<unsigned char> bytes;

  OwnedTensor() = default;
  OwnedTensor(kvsift::DType t, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d)
      : dtype(t), d0(a), d1(b), d2(c), d3(d), bytes(a * b * c * d * kvsift::dtype_size(t)) {}

  std::int64_t index(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) const {
    return ((a * d1 + b) * d2 + c) * d3 + d;
  }
  void set(std::int64_t i, float x) {
    unsigned char* p = bytes.data() + i * kvsift::dtype_size(dtype);
    if (dtype == kvsift::DType::f32) {
      std::memcpy(p, &x, 4);
    } else {
      const std::uint16_t h = dtype == kvsift::DType::f16 ? kvsift::float_to_f16_bits(x)
                                                          : kvsift::float_to_bf16_bits(x);
      std::memcpy(p, &h, 2);
    }
  }
  float get(std::int64_t i) const {
    const unsigned char* p = bytes.data() + i * kvsift::dtype_size(dtype);
    if (dtype == kvsift::DType::f32) {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    std::uint16_t h;
    std::memcpy(&h, p, 2);
    return dtype == kvsift::DType::f16 ? kvsift::f16_bits_to_float(h)
                                       : kvsift::bf16_bits_to_float(h);
  }
  float at(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) const {
    return get(index(a, b, c, d));
  }
  void randomize(std::mt19937& rng, float scale = 1.0f) {
    std::normal_distribution<float> n(0.0f, scale);
    for (std::int64_t i = 0; i < d0 * d1 * d2 * d3; ++i) set(i, n(rng));
  }
  kvsift::TensorView view() {
    return kvsift::TensorView::contiguous(bytes.data(), dtype, kvsift::Device::cpu,
                                          {d0, d1, d2, d3});
  }
};

struct RandomCache {
  OwnedTensor keys, values;           // [batch, kv_heads, capacity, head_dim]
  std::vector<std::int32_t> lengths;  // [batch]
  std::vector<std::uint8_t> mask;     // [batch, capacity], empty: no padding

  RandomCache(kvsift::DType t, std::int64_t batch, std::int64_t heads, std::int64_t capacity,
              std::int64_t dim, std::mt19937& rng)
      : keys(t, batch, heads, capacity, dim),
        values(t, batch, heads, capacity, dim),
        lengths(static_cast<std::size_t>(batch), static_cast<std::int32_t>(capacity)) {
    keys.randomize(rng);
    values.randomize(rng);
  }
  // Left padding: the first pads[b] slots of sequence b are pads.
  void left_pad(const std::vector<int>& pads) {
    mask.assign(static_cast<std::size_t>(keys.d0 * keys.d2), 1);
    for (std::size_t b = 0; b < pads.size(); ++b)
      for (int j = 0; j < pads[b]; ++j) mask[b * keys.d2 + j] = 0;
  }
  bool valid(std::int64_t b, std::int64_t j) const {
    return mask.empty() || mask[b * keys.d2 + j] != 0;
  }
  kvsift::KVCacheView view() {
    kvsift::KVCacheView v;
    v.keys = keys.view();
    v.values = values.view();
    v.lengths = lengths.data();
    v.valid_mask = mask.empty() ? nullptr : mask.data();
    return v;
  }
};

}  // namespace kvsift_test
