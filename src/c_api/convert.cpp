#include "convert.hpp"

#include "status.hpp"

#if defined(KVSIFT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::c_api {

bool cuda_available() {
  if (!has_device_backend()) return false;
#if defined(KVSIFT_WITH_CUDA)
  // Asked once: devices do not come and go within a process, and the query initialises the
  // CUDA runtime, which the first device call would do anyway.
  static const bool present = [] {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }();
  return present;
#else
  return false;
#endif
}

void require_cuda_for(const TensorView& t, const std::string& what) {
  if (t.rank == 0 || t.device != Device::cuda) return;
  if (!has_device_backend()) {
    throw StatusError(KVSIFT_ERROR_NO_CUDA,
                      what +
                          " is in CUDA device memory, but this libkvsift_c was built without "
                          "the CUDA backend");
  }
  if (!cuda_available()) {
    throw StatusError(KVSIFT_ERROR_NO_CUDA,
                      what + " is in CUDA device memory, but no CUDA device is present");
  }
}

TensorView to_tensor_view(const kvsift_tensor& t, const std::string& what) {
  if (t.rank == 0) {
    KVSIFT_CHECK(t.data == nullptr, what, ".rank is 0 (not given) but ", what, ".data is set");
    return TensorView{};
  }
  KVSIFT_CHECK(t.rank >= 1 && t.rank <= 4, what, ".rank must be in [0, 4], got ", t.rank);
  KVSIFT_CHECK(
      t.dtype == KVSIFT_DTYPE_F32 || t.dtype == KVSIFT_DTYPE_F16 || t.dtype == KVSIFT_DTYPE_BF16,
      what, ".dtype must be 0 (f32), 1 (f16) or 2 (bf16), got ", t.dtype);
  KVSIFT_CHECK(t.device == KVSIFT_DEVICE_CPU || t.device == KVSIFT_DEVICE_CUDA, what,
               ".device must be 0 (cpu) or 1 (cuda), got ", t.device);
  TensorView v;
  v.data = t.data;
  v.dtype = t.dtype == KVSIFT_DTYPE_F32   ? DType::f32
            : t.dtype == KVSIFT_DTYPE_F16 ? DType::f16
                                          : DType::bf16;
  v.device = t.device == KVSIFT_DEVICE_CPU ? Device::cpu : Device::cuda;
  v.rank = t.rank;
  for (int k = 0; k < t.rank; ++k) {
    KVSIFT_CHECK(t.shape[k] >= 0, what, ".shape[", k, "] is negative (", t.shape[k], ")");
    // Negative strides would let offsets leave the buffer the caller described.
    KVSIFT_CHECK(t.strides[k] >= 0, what, ".strides[", k, "] is negative (", t.strides[k], ")");
    v.shape[k] = t.shape[k];
    v.stride[k] = t.strides[k];
  }
  KVSIFT_CHECK(v.shape[t.rank - 1] <= 1 || v.stride[t.rank - 1] == 1, what,
               ": the innermost dimension must be contiguous (stride 1), got strides[", t.rank - 1,
               "] = ", v.stride[t.rank - 1]);
  KVSIFT_CHECK(v.numel() == 0 || v.data != nullptr, what, ".data is NULL but ", what, " has shape ",
               v.shape_string());
  return v;
}

TensorView to_optional_tensor_view(const kvsift_tensor* t, const std::string& what) {
  return t == nullptr ? TensorView{} : to_tensor_view(*t, what);
}

KVCacheView to_cache_view(const kvsift_cache_view* kv, const std::string& what) {
  KVSIFT_CHECK(kv != nullptr, what, " is NULL");
  KVCacheView v;
  v.keys = to_tensor_view(kv->keys, what + "->keys");
  v.values = to_tensor_view(kv->values, what + "->values");
  KVSIFT_CHECK(v.keys.rank == 4, what,
               "->keys must be [batch, kv_heads, capacity, head_dim] (rank 4), got rank ",
               v.keys.rank);
  KVSIFT_CHECK(v.values.rank == 4 && v.values.shape == v.keys.shape, what, "->values shape ",
               v.values.shape_string(), " != keys shape ", v.keys.shape_string());
  KVSIFT_CHECK(kv->lengths != nullptr, what,
               "->lengths is NULL (it must point at [batch = ", v.keys.shape[0], "] host int32)");
  v.lengths = kv->lengths;
  v.valid_mask = kv->valid_mask;
  require_cuda_for(v.keys, what + "->keys");
  v.validate();
  return v;
}

Observation to_observation(const kvsift_observation* obs, const std::string& what) {
  KVSIFT_CHECK(obs != nullptr, what, " is NULL");
  Observation o;
  o.layer = obs->layer;
  KVSIFT_CHECK(obs->batch >= 0, what, "->batch must be >= 0 (0: from kv or last_hidden), got ",
               obs->batch);
  o.batch = obs->batch;
  KVSIFT_CHECK(obs->layer >= -1, what, "->layer must be >= -1 (-1: the step-level part), got ",
               obs->layer);
  if (obs->kv.keys.rank != 0 || obs->kv.keys.data != nullptr) {
    o.kv = to_cache_view(&obs->kv, what + "->kv");
  }
  o.queries = to_tensor_view(obs->queries, what + "->queries");
  o.last_hidden = to_tensor_view(obs->last_hidden, what + "->last_hidden");
  require_cuda_for(o.queries, what + "->queries");
  require_cuda_for(o.last_hidden, what + "->last_hidden");
  KVSIFT_CHECK(obs->num_tokens >= 0, what, "->num_tokens must be >= 0, got ", obs->num_tokens);
  KVSIFT_CHECK(obs->num_tokens == 0 || obs->token_ids != nullptr, what,
               "->token_ids is NULL but num_tokens is ", obs->num_tokens);
  o.token_ids = obs->token_ids;
  o.num_tokens = obs->num_tokens;
  o.pad_counts = obs->pad_counts;
  return o;
}

}  // namespace kvsift::c_api
