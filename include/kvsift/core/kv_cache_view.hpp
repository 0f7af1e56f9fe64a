// KVCacheView: one layer's contiguous KV cache as the engine stores it, plus the per-sequence
// lengths and the optional left-padding mask. Non-owning; the engine keeps the memory.
#pragma once

#include <cstdint>

#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

struct KVCacheView {
  TensorView keys;    // [batch, kv_heads, capacity, head_dim], head_dim contiguous, post-RoPE
  TensorView values;  // [batch, kv_heads, capacity, head_dim], same dtype/device/shape as keys
  // [batch] resident tokens per sequence, in host memory. compact() rewrites it.
  std::int32_t* lengths = nullptr;
  // [batch, capacity] optional, 1 = real token, 0 = left pad; same device as keys; nullptr: no
  // pads. compact() rewrites it along with the rows.
  std::uint8_t* valid_mask = nullptr;

  std::int64_t batch() const { return keys.shape[0]; }
  std::int64_t kv_heads() const { return keys.shape[1]; }
  std::int64_t capacity() const { return keys.shape[2]; }
  std::int64_t head_dim() const { return keys.shape[3]; }
  DType dtype() const { return keys.dtype; }
  Device device() const { return keys.device; }
  std::int32_t length(std::int64_t b) const { return lengths[b]; }
  bool is_valid(std::int64_t b, std::int64_t slot) const {
    return valid_mask == nullptr || valid_mask[b * capacity() + slot] != 0;
  }

  // For the in-place movers (compact(), cuda::compact): keys and values in one buffer would be
  // moved twice (the second pass reads rows the first already overwrote), and a view whose rows
  // overlap would be moved onto itself; both are refused, naming `op`. Byte ranges
  // [data, data + span) are compared, so interleaved K/V layouts are refused too (they cannot be
  // told apart from aliasing). Only addresses are compared: works for device pointers as well.
  void check_separate_buffers(const char* op) const {
    auto strides = [](const TensorView& t) {
      return detail::concat(t.stride[0], ", ", t.stride[1], ", ", t.stride[2], ", ", t.stride[3]);
    };
    KVSIFT_CHECK(keys.non_overlapping(), op, ": keys view ", keys.shape_string(),
                 " has overlapping rows (strides ", strides(keys), ")");
    KVSIFT_CHECK(values.non_overlapping(), op, ": values view ", values.shape_string(),
                 " has overlapping rows (strides ", strides(values), ")");
    const std::size_t esz = dtype_size(dtype());
    const std::size_t bytes_k =
        checked_mul(checked_size(keys.span_elements("keys"), "keys span"), esz, "keys bytes");
    const std::size_t bytes_v = checked_mul(
        checked_size(values.span_elements("values"), "values span"), esz, "values bytes");
    if (bytes_k == 0 || bytes_v == 0) return;
    const auto begin_k = reinterpret_cast<std::uintptr_t>(keys.data);
    const auto begin_v = reinterpret_cast<std::uintptr_t>(values.data);
    const bool disjoint = begin_k + bytes_k <= begin_v || begin_v + bytes_v <= begin_k;
    KVSIFT_CHECK(disjoint, op, ": keys [", keys.data, ", +", bytes_k, " bytes) and values [",
                 values.data, ", +", bytes_v,
                 " bytes) overlap in memory; K and V must be separate buffers");
  }

  // Throws kvsift::Error naming the first inconsistency.
  void validate() const {
    KVSIFT_CHECK(keys.data != nullptr && values.data != nullptr,
                 "KVCacheView: keys and values must both be set");
    KVSIFT_CHECK(keys.rank == 4,
                 "KVCacheView: keys must be [batch, kv_heads, capacity, head_dim], got rank ",
                 keys.rank);
    keys.validate("KVCacheView keys");
    values.validate("KVCacheView values");
    // The mask is indexed b * capacity + slot: that product must not overflow either.
    checked_mul(batch(), capacity(), "KVCacheView: batch * capacity (valid_mask size)");
    KVSIFT_CHECK(values.rank == 4 && values.shape == keys.shape, "KVCacheView: values shape ",
                 values.shape_string(), " != keys shape ", keys.shape_string());
    KVSIFT_CHECK(values.dtype == keys.dtype, "KVCacheView: values dtype ", dtype_name(values.dtype),
                 " != keys dtype ", dtype_name(keys.dtype));
    KVSIFT_CHECK(values.device == keys.device, "KVCacheView: keys and values on different devices");
    KVSIFT_CHECK(keys.stride[3] == 1 && values.stride[3] == 1,
                 "KVCacheView: head_dim must be contiguous (stride 1), got keys stride ",
                 keys.stride[3], ", values stride ", values.stride[3]);
    KVSIFT_CHECK(lengths != nullptr, "KVCacheView: lengths must be set");
    for (std::int64_t b = 0; b < batch(); ++b) {
      KVSIFT_CHECK(lengths[b] >= 0 && lengths[b] <= capacity(), "KVCacheView: lengths[", b,
                   "] = ", lengths[b], " is outside [0, capacity = ", capacity(), "]");
    }
  }
};

// A contiguous view over caller-owned [batch, kv_heads, capacity, head_dim] buffers.
inline KVCacheView make_kv_cache_view(void* keys, void* values, DType dtype, Device device,
                                      std::int64_t batch, std::int64_t kv_heads,
                                      std::int64_t capacity, std::int64_t head_dim,
                                      std::int32_t* lengths, std::uint8_t* valid_mask = nullptr) {
  KVCacheView v;
  v.keys = TensorView::contiguous(keys, dtype, device, {batch, kv_heads, capacity, head_dim});
  v.values = TensorView::contiguous(values, dtype, device, {batch, kv_heads, capacity, head_dim});
  v.lengths = lengths;
  v.valid_mask = valid_mask;
  v.validate();
  return v;
}

}  // namespace kvsift
