// The C structs of kvsift/c/kvsift.h checked and turned into the C++ views (and back for plans).
// Every check names the argument as the C caller spelled it ("kv->keys.dtype"), so a message
// points at the field to fix.
#pragma once

#include <string>

#include "kvsift/c/kvsift.h"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/observation.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::c_api {

// A tensor; rank 0 (data NULL) is "not given" and becomes an empty TensorView.
TensorView to_tensor_view(const kvsift_tensor& t, const std::string& what);
// An optional tensor argument: NULL is "not given".
TensorView to_optional_tensor_view(const kvsift_tensor* t, const std::string& what);
// A required cache view: checked field by field, then KVCacheView::validate().
KVCacheView to_cache_view(const kvsift_cache_view* kv, const std::string& what);
// An observation; its cache view is optional (keys.rank 0).
Observation to_observation(const kvsift_observation* obs, const std::string& what);

// Raises NO_CUDA when a device view reaches a library that cannot serve it (no CUDA backend
// linked, or no device present), before any C++ code touches the memory.
void require_cuda_for(const TensorView& t, const std::string& what);

// True when kvsift::cuda is linked and registered and a CUDA device is present.
bool cuda_available();

}  // namespace kvsift::c_api
