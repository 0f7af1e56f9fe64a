// A pinned host buffer for small host-to-device copies that must not stall the host: a copy from
// pageable memory makes the call wait for the stream (the runtime stages it), a copy from pinned
// memory is only enqueued. The price is that the buffer may not be refilled before its last copy
// has run, so each copy records an event and fill() waits for it (in a decode loop the copy ran
// a step ago). Used for the append plans of DevicePagedTable and the page tables of DeviceThinKV,
// which are packed on placement threads while the stream runs the previous layers.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvsift/backend/cuda/check.hpp"

namespace kvsift::cuda {

class PinnedUpload {
 public:
  // Room for `bytes` to be written before the next copy_to: waits for the last copy out of the
  // buffer, then grows it when it is too small (needs a CUDA device). Throws kvsift::Error
  // naming the size when pinned memory cannot be had; the buffer is then unchanged.
  std::uint8_t* fill(std::size_t bytes) {
    if (bytes <= capacity_) {
      if (bytes_) KVSIFT_CUDA_CHECK(cudaEventSynchronize(bytes_.get_deleter().copied));
      return bytes_.get();
    }
    const std::size_t capacity = std::max(bytes, 2 * capacity_);
    cudaEvent_t copied = nullptr;
    KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming));
    void* p = nullptr;
    const cudaError_t e = cudaMallocHost(&p, capacity);
    if (e != cudaSuccess) cudaEventDestroy(copied);
    KVSIFT_CHECK(e == cudaSuccess, "cuda::PinnedUpload: cannot pin ", capacity,
                 " bytes of host memory: ", cudaGetErrorString(e));
    bytes_ = Bytes(static_cast<std::uint8_t*>(p), Free{copied});  // the old one after its copy
    capacity_ = capacity;
    return bytes_.get();
  }
  // Enqueues the copy of the first `bytes` filled to `device` on `stream`.
  void copy_to(void* device, std::size_t bytes, cudaStream_t stream) {
    KVSIFT_CHECK(bytes <= capacity_, "cuda::PinnedUpload::copy_to: ", bytes,
                 " bytes but the buffer holds ", capacity_);
    if (bytes == 0) return;
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(device, bytes_.get(), bytes, cudaMemcpyHostToDevice, stream));
    KVSIFT_CUDA_CHECK(cudaEventRecord(bytes_.get_deleter().copied, stream));
  }

 private:
  // Owns the event recorded after each copy and waits for it before freeing the buffer (its
  // owner may go away with the last copy still queued).
  struct Free {
    cudaEvent_t copied = nullptr;
    void operator()(std::uint8_t* p) const {
      cudaEventSynchronize(copied);
      cudaEventDestroy(copied);
      cudaFreeHost(p);
    }
  };
  using Bytes = std::unique_ptr<std::uint8_t[], Free>;
  Bytes bytes_{nullptr, Free{}};
  std::size_t capacity_ = 0;
};

}  // namespace kvsift::cuda
