// CUDA error checking for host launchers: every runtime call's status becomes a kvsift::Error.
#pragma once

#include <cuda_runtime_api.h>

#include "kvsift/core/error.hpp"

#define KVSIFT_CUDA_CHECK(expr)                                                            \
  do {                                                                                     \
    const cudaError_t kvsift_status_ = (expr);                                             \
    KVSIFT_CHECK(kvsift_status_ == cudaSuccess, "CUDA error in ", #expr, ": ",             \
                 cudaGetErrorString(kvsift_status_), " (", __FILE__, ":", __LINE__, ")"); \
  } while (0)
