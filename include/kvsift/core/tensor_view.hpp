// A non-owning, strided view of up to 4 dimensions: the one way tensors enter kvsift.
// The engine keeps the memory; kvsift reads (and, in compact(), writes) through the view.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "kvsift/core/checked_math.hpp"
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
    // An empty extent still advances the stride by 1, so every stride of a contiguous view is
    // positive (validate() rejects zero strides) and the element count is checked for overflow.
    std::int64_t s = 1;
    for (int k = v.rank - 1; k >= 0; --k) {
      v.stride[k] = s;
      s = checked_mul(s, v.shape[k] > 0 ? v.shape[k] : 1, "TensorView::contiguous: element count");
    }
    return v;
  }

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int k = 0; k < rank; ++k) n *= shape[k];
    return n;
  }

  // Throws kvsift::Error naming `name`, the field and its value for a rank outside 1..4, a
  // negative extent, a stride < 1 on an axis of extent > 1, or an element count / furthest offset
  // that overflows int64. Views are the engine's memory described by the engine: a wrong sign or
  // an overflowing span would turn into a wild read or write, so every kernel entry validates.
  void validate(const char* name) const {
    KVSIFT_CHECK(rank >= 1 && rank <= 4, name, ": rank must be 1..4, got ", rank);
    for (int k = 0; k < rank; ++k) {
      KVSIFT_CHECK(shape[k] >= 0, name, ": shape[", k, "] is negative (", shape[k], ") in ",
                   shape_string());
      KVSIFT_CHECK(shape[k] <= 1 || stride[k] >= 1, name, ": stride[", k, "] must be >= 1, got ",
                   stride[k], " (shape ", shape_string(), ")");
    }
    checked_product(shape.data(), static_cast<std::size_t>(rank), name);
    span_elements(name);
  }

  // Elements from data to one past the furthest element: 1 + sum (shape[k]-1)·stride[k]; 0 for
  // an empty view. Overflow-checked; assumes validate()'s sign rules.
  std::int64_t span_elements(const char* name = "TensorView") const {
    std::int64_t last = 0;
    for (int k = 0; k < rank; ++k) {
      if (shape[k] == 0) return 0;
      if (shape[k] > 1) last = checked_add(last, checked_mul(shape[k] - 1, stride[k], name), name);
    }
    return checked_add(last, 1, name);
  }

  // True when no two index tuples reach the same element (sufficient test: with axes sorted by
  // stride, each stride clears the span of the axes inside it). compact() moves rows in place
  // and needs this.
  bool non_overlapping() const {
    std::array<int, 4> axes{0, 1, 2, 3};
    int n = 0;
    for (int k = 0; k < rank; ++k)
      if (shape[k] > 1) axes[n++] = k;
    for (int i = 1; i < n; ++i)  // insertion sort by stride: at most 4 axes
      for (int j = i; j > 0 && stride[axes[j]] < stride[axes[j - 1]]; --j)
        std::swap(axes[j], axes[j - 1]);
    std::int64_t inner = 1;  // span of the axes inside the current one
    for (int i = 0; i < n; ++i) {
      const int k = axes[i];
      if (stride[k] < inner) return false;
      inner = checked_add(inner, checked_mul(shape[k] - 1, stride[k], "TensorView span"),
                          "TensorView span");
    }
    return true;
  }

  // An empty view holds nothing and is trivially contiguous (contiguous() gives its axes strides
  // as if empty extents were 1, so every stride stays positive).
  bool is_contiguous() const {
    for (int k = 0; k < rank; ++k)
      if (shape[k] == 0) return true;
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
