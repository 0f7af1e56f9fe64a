// A non-owning, strided view of up to 4 dimensions: the one way tensors enter kvsift.
// The engine keeps the memory; kvsift reads (and, in compact(), writes) through the view.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kvsift/core/device.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int rank = 0;
  std::array<std::int64_t, 4> shape{};   // only the first `rank` entries are meaningful
  std::array<std::int64_t, 4> stride{};  // in elements, not bytes

  // Row-major contiguous view over `data`.
  static TensorView contiguous(void* data, DType dtype, Device device,
                               std::initializer_list<std::int64_t> dims) {
    KVSIFT_CHECK(dims.size() >= 1 && dims.size() <= 4, "TensorView rank must be 1..4, got ",
                 dims.size());
    TensorView v;
    v.data = data;
    v.dtype = dtype;
    v.device = device;
    v.rank = static_cast<int>(dims.size());
    int i = 0;
    for (std::int64_t d : dims) {
      KVSIFT_CHECK(d >= 0, "TensorView dimension ", i, " is negative (", d, ")");
      v.shape[i++] = d;
    }
    std::int64_t s = 1;
    for (int k = v.rank - 1; k >= 0; --k) {
      v.stride[k] = s;
      s *= v.shape[k];
    }
    return v;
  }

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int k = 0; k < rank; ++k) n *= shape[k];
    return n;
  }

  bool is_contiguous() const {
    std::int64_t s = 1;
    for (int k = rank - 1; k >= 0; --k) {
      if (shape[k] != 1 && stride[k] != s) return false;
      s *= shape[k];
    }
    return true;
  }

  std::int64_t offset(std::int64_t i0, std::int64_t i1 = 0, std::int64_t i2 = 0,
                      std::int64_t i3 = 0) const {
    return i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3];
  }

  template <class T>
  T* ptr(std::int64_t i0 = 0, std::int64_t i1 = 0, std::int64_t i2 = 0, std::int64_t i3 = 0) const {
    return static_cast<T*>(data) + offset(i0, i1, i2, i3);
  }

  std::string shape_string() const {
    std::string s = "[";
    for (int k = 0; k < rank; ++k) s += (k ? ", " : "") + std::to_string(shape[k]);
    return s + "]";
  }
};

}  // namespace kvsift
