// Host staging of device views: the one place where a method without CUDA kernels of its own
// (FullKV, StreamingLLM, SnapKV, H2O in this version) reaches device memory. It copies the tensors
// the CPU reference reads to host buffers through DeviceBackend::copy_to_host (on ctx.stream,
// waited for) and hands back host views with the same shapes and strides, so the reference makes
// the very plan it would make for the same cache in host memory. Lengths already live on the
// host (KVCacheView's contract) and are copied too, so the reference can never write them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/exec_context.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

// Owns the host copies; the views it returns live as long as it does.
class HostStaging {
 public:
  explicit HostStaging(const ExecContext& ctx) : ctx_(ctx) {}
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // A host view of `t`: `t` itself when it is already on the host (or empty), else a copy of the
  // memory its strides span.
  TensorView tensor(const TensorView& t) {
    if (t.device == Device::cpu || t.data == nullptr) return t;
    std::int64_t span = 1;  // elements from the first to the last addressed one, inclusive
    for (int k = 0; k < t.rank; ++k) {
      if (t.shape[k] == 0) span = 0;
      KVSIFT_CHECK(t.stride[k] >= 0, "HostStaging: negative stride ", t.stride[k], " in dimension ",
                   k, " of a ", t.shape_string(), " device tensor");
    }
    if (span != 0)
      for (int k = 0; k < t.rank; ++k) span += (t.shape[k] - 1) * t.stride[k];
    TensorView host = t;
    host.device = Device::cpu;
    host.data = copy(t.data, static_cast<std::size_t>(span) * dtype_size(t.dtype));
    return host;
  }

  // A host view of one layer's cache: keys, values, the pad mask and a copy of the lengths.
  //   kv.keys / kv.values  [batch, kv_heads, capacity, head_dim]; kv.valid_mask [batch, capacity]
  KVCacheView cache(const KVCacheView& kv) {
    kv.validate();
    KVCacheView host = kv;
    host.keys = tensor(kv.keys);
    host.values = tensor(kv.values);
    lengths_.emplace_back(kv.lengths, kv.lengths + kv.batch());
    host.lengths = lengths_.back().data();
    if (kv.valid_mask != nullptr && kv.device() != Device::cpu) {
      host.valid_mask = static_cast<std::uint8_t*>(
          copy(kv.valid_mask, static_cast<std::size_t>(kv.batch() * kv.capacity())));
    }
    return host;
  }

  // A host view of the cache's lengths and pad mask only; keys and values keep pointing at the
  // device (for plans that read no K/V: StreamingLLM, FullKV). Marked host so the CPU code
  // accepts it; it must not read keys or values.
  KVCacheView lengths_and_mask(const KVCacheView& kv) {
    kv.validate();
    KVCacheView host = kv;
    host.keys.device = host.values.device = Device::cpu;
    host.keys.data = host.values.data = &dummy_;
    lengths_.emplace_back(kv.lengths, kv.lengths + kv.batch());
    host.lengths = lengths_.back().data();
    if (kv.valid_mask != nullptr) {
      host.valid_mask = static_cast<std::uint8_t*>(
          copy(kv.valid_mask, static_cast<std::size_t>(kv.batch() * kv.capacity())));
    }
    return host;
  }

 private:
  void* copy(const void* src, std::size_t bytes) {
    buffers_.emplace_back(bytes);
    if (bytes > 0) device_backend().copy_to_host(buffers_.back().data(), src, bytes, ctx_);
    return buffers_.back().data();
  }

  ExecContext ctx_;
  std::deque<std::vector<unsigned char>> buffers_;  // deque: earlier views stay valid
  std::deque<std::vector<std::int32_t>> lengths_;
  float dummy_ = 0.0f;  // what lengths_and_mask()'s K/V point at: never read
};

}  // namespace kvsift
