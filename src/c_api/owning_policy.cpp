// The entry points of the methods that own their KV storage (policy/cache_owning_policy.hpp),
// thin translations onto kvsift::CacheOwningPolicy and make_cache_owning_policy().
#include <algorithm>
#include <memory>
#include <string>

#include "convert.hpp"
#include "handles.hpp"
#include "kvsift/backend/device_backend.hpp"
#include "kvsift/c/kvsift.h"
#include "kvsift/policy/registry.hpp"
#include "status.hpp"

namespace kvsift::c_api {
namespace {

CacheOwningPolicy& owning_of(kvsift_owning_policy* p) {
  KVSIFT_CHECK(p != nullptr && p->impl != nullptr, "policy is NULL");
  return *p->impl;
}
const CacheOwningPolicy& owning_of(const kvsift_owning_policy* p) {
  KVSIFT_CHECK(p != nullptr && p->impl != nullptr, "policy is NULL");
  return *p->impl;
}

// A device tensor for a policy that keeps its cache on the host is a valid request it cannot
// serve (the method has no device path, or it was not placed on the device), reported before any
// C++ code reads it.
void check_placement(const CacheOwningPolicy& p, const TensorView& v, const std::string& what) {
  if (v.rank == 0 || v.device == Device::cpu || p.on_device()) return;
  throw StatusError(KVSIFT_ERROR_UNSUPPORTED,
                    what + " is in device memory, but '" + std::string(p.name()) +
                        "' keeps its cache on the host: place it on the device first "
                        "(kvsift_owning_policy_place_on_device)");
}

TensorView policy_tensor(const CacheOwningPolicy& p, const kvsift_tensor* t,
                         const std::string& what) {
  KVSIFT_CHECK(t != nullptr, what, " is NULL");
  const TensorView v = to_tensor_view(*t, what);
  KVSIFT_CHECK(v.rank != 0, what, " is not given (rank 0)");
  check_placement(p, v, what);
  return v;
}

void require_cuda_backend() {
  if (!has_device_backend()) {
    throw StatusError(KVSIFT_ERROR_NO_CUDA,
                      "this libkvsift_c was built without the CUDA backend (no device storage)");
  }
}

}  // namespace
}  // namespace kvsift::c_api

using namespace kvsift::c_api;

extern "C" {

kvsift_status kvsift_owning_policy_create(const char* name, const char* json_config,
                                          kvsift_owning_policy** out) {
  return guarded("kvsift_owning_policy_create", [&] {
    KVSIFT_CHECK(out != nullptr, "out is NULL");
    *out = nullptr;
    KVSIFT_CHECK(name != nullptr, "name is NULL");
    if (!kvsift::method_info(name).owns_cache) {
      throw StatusError(KVSIFT_ERROR_UNSUPPORTED,
                        std::string("'") + name +
                            "' plans over the engine's cache: create it with kvsift_policy_create");
    }
    auto handle = std::make_unique<kvsift_owning_policy>();
    handle->impl =
        kvsift::make_cache_owning_policy(name, json_config != nullptr ? json_config : "{}");
    *out = handle.release();
  });
}

void kvsift_owning_policy_destroy(kvsift_owning_policy* policy) { delete policy; }

kvsift_status kvsift_owning_policy_needs(const kvsift_owning_policy* policy, uint32_t* out_needs) {
  return guarded("kvsift_owning_policy_needs", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    KVSIFT_CHECK(out_needs != nullptr, "out_needs is NULL");
    *out_needs = p.needs();
  });
}

kvsift_status kvsift_owning_policy_batch(const kvsift_owning_policy* policy, int64_t* out_batch) {
  return guarded("kvsift_owning_policy_batch", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    KVSIFT_CHECK(out_batch != nullptr, "out_batch is NULL");
    *out_batch = p.batch();
  });
}

kvsift_status kvsift_owning_policy_prefill(kvsift_owning_policy* policy, int32_t layer,
                                           const kvsift_tensor* keys, const kvsift_tensor* values) {
  return guarded("kvsift_owning_policy_prefill", [&] {
    kvsift::CacheOwningPolicy& p = owning_of(policy);
    const kvsift::TensorView k = policy_tensor(p, keys, "keys");  // checked in argument order
    p.prefill(layer, k, policy_tensor(p, values, "values"));
  });
}

kvsift_status kvsift_owning_policy_append(kvsift_owning_policy* policy, int32_t layer,
                                          const kvsift_tensor* keys, const kvsift_tensor* values) {
  return guarded("kvsift_owning_policy_append", [&] {
    kvsift::CacheOwningPolicy& p = owning_of(policy);
    const kvsift::TensorView k = policy_tensor(p, keys, "keys");  // checked in argument order
    p.append(layer, k, policy_tensor(p, values, "values"));
  });
}

kvsift_status kvsift_owning_policy_observe(kvsift_owning_policy* policy,
                                           const kvsift_observation* obs) {
  return guarded("kvsift_owning_policy_observe", [&] {
    kvsift::CacheOwningPolicy& p = owning_of(policy);
    const kvsift::Observation o = to_observation(obs, "obs");
    check_placement(p, o.queries, "obs->queries");
    p.observe(o);
  });
}

kvsift_status kvsift_owning_policy_end_step(kvsift_owning_policy* policy, int* evicted) {
  return guarded("kvsift_owning_policy_end_step", [&] {
    const bool any = owning_of(policy).end_step();
    if (evicted != nullptr) *evicted = any ? 1 : 0;
  });
}

kvsift_status kvsift_owning_policy_attention(const kvsift_owning_policy* policy, int32_t layer,
                                             const kvsift_tensor* queries, const kvsift_tensor* out,
                                             void* workspace, size_t workspace_bytes) {
  return guarded("kvsift_owning_policy_attention", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    const kvsift::TensorView q = policy_tensor(p, queries, "queries");
    const kvsift::TensorView o = policy_tensor(p, out, "out");
    p.attention_with_workspace(layer, q, o,
                               kvsift::ExecContext{workspace, workspace_bytes, nullptr});
  });
}

kvsift_status kvsift_owning_policy_attention_workspace_bytes(const kvsift_owning_policy* policy,
                                                             int32_t layer, size_t* out_bytes) {
  return guarded("kvsift_owning_policy_attention_workspace_bytes", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    KVSIFT_CHECK(out_bytes != nullptr, "out_bytes is NULL");
    *out_bytes = p.attention_workspace_bytes(layer);
  });
}

kvsift_status kvsift_owning_policy_device_memory_bytes(const kvsift_owning_policy* policy,
                                                       size_t* out_bytes) {
  return guarded("kvsift_owning_policy_device_memory_bytes", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    KVSIFT_CHECK(out_bytes != nullptr, "out_bytes is NULL");
    *out_bytes = 0;
    require_cuda_backend();
    *out_bytes = p.device_memory_bytes();
  });
}

kvsift_status kvsift_owning_policy_place_on_device(kvsift_owning_policy* policy, void* memory,
                                                   size_t memory_bytes, void* stream) {
  return guarded("kvsift_owning_policy_place_on_device", [&] {
    kvsift::CacheOwningPolicy& p = owning_of(policy);
    require_cuda_backend();
    if (p.device_memory_bytes() == 0) {
      throw StatusError(KVSIFT_ERROR_UNSUPPORTED,
                        "'" + std::string(p.name()) + "' keeps its cache on the host only");
    }
    KVSIFT_CHECK(memory != nullptr, "memory is NULL");
    p.place_on_device(kvsift::ExecContext{memory, memory_bytes, stream});
  });
}

kvsift_status kvsift_owning_policy_on_device(const kvsift_owning_policy* policy, int* out) {
  return guarded("kvsift_owning_policy_on_device", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    KVSIFT_CHECK(out != nullptr, "out is NULL");
    *out = p.on_device() ? 1 : 0;
  });
}

kvsift_status kvsift_owning_policy_memory(const kvsift_owning_policy* policy, int32_t layer,
                                          int64_t* resident_bytes, int64_t* fullkv_fp16_bytes) {
  return guarded("kvsift_owning_policy_memory", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    KVSIFT_CHECK(layer >= -1, "layer must be >= -1 (-1: all layers), got ", layer);
    if (resident_bytes != nullptr)
      *resident_bytes = layer < 0 ? p.resident_bytes() : p.resident_bytes(layer);
    if (fullkv_fp16_bytes != nullptr) *fullkv_fp16_bytes = p.fullkv_fp16_bytes();
  });
}

kvsift_status kvsift_owning_policy_resident_positions(const kvsift_owning_policy* policy,
                                                      int32_t layer, int64_t seq, int64_t kv_head,
                                                      int32_t* out, int64_t capacity,
                                                      int64_t* count) {
  return guarded("kvsift_owning_policy_resident_positions", [&] {
    const kvsift::CacheOwningPolicy& p = owning_of(policy);
    KVSIFT_CHECK(count != nullptr, "count is NULL");
    KVSIFT_CHECK(capacity >= 0, "capacity must be >= 0, got ", capacity);
    KVSIFT_CHECK(out != nullptr || capacity == 0, "out is NULL but capacity is ", capacity);
    const std::vector<std::int32_t> pos = p.resident_positions(layer, seq, kv_head);
    const int64_t n = static_cast<int64_t>(pos.size());
    std::copy(pos.begin(), pos.begin() + std::min(n, capacity), out);
    *count = n;
  });
}

}  // extern "C"
