// Shared plumbing of the GPU benchmarks (bench/gpu_bench_*.cpp): an owning device array, CUDA-event
// timing reported as the median of the timed reps after warm-up, and the device-to-device copy
// bandwidth that several tables use as their "as fast as a plain copy" reference.
// Benchmarks only: the library itself never allocates or synchronises (DESIGN.md).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift::bench {

// cudaMalloc'd storage for n elements of T, freed on scope exit (at least one element is allocated
// so that empty arrays still have a valid pointer).
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    KVSIFT_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&p_), std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return p_; }
  std::size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

// True when a CUDA device is present; otherwise prints the skip line every GPU benchmark prints.
inline bool cuda_device_present() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device present: benchmark skipped\n");
    return false;
  }
  return true;
}

// The upper median (element size/2 of the sorted values); v must not be empty.
template <class T>
T median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A start/stop CUDA event pair, created once and reused for many timings.
class EventPair {
 public:
  EventPair() {
    KVSIFT_CUDA_CHECK(cudaEventCreate(&start_));
    KVSIFT_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventPair() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;

  // Device milliseconds of what `launch` enqueues on `stream` (waits for it to finish).
  template <class F>
  float time_ms(F&& launch, cudaStream_t stream) {
    KVSIFT_CUDA_CHECK(cudaEventRecord(start_, stream));
    launch();
    KVSIFT_CUDA_CHECK(cudaEventRecord(stop_, stream));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0.0f;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Median device milliseconds of `launch` over `reps` runs after `warmup` discarded runs, each run
// timed alone with events (so one slow launch cannot hide in an average).
template <class F>
float median_ms(F&& launch, cudaStream_t stream, int warmup, int reps) {
  EventPair events;
  std::vector<float> ms;
  ms.reserve(static_cast<std::size_t>(reps));
  for (int r = 0; r < warmup + reps; ++r) {
    const float t = events.time_ms(launch, stream);
    if (r >= warmup) ms.push_back(t);
  }
  return median(ms);
}

// Median milliseconds of one cudaMemcpyAsync device-to-device copy of `bytes` from src to dst.
inline float d2d_copy_ms(void* dst, const void* src, std::size_t bytes, cudaStream_t stream,
                         int warmup, int reps) {
  return median_ms(
      [&] {
        KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
      },
      stream, warmup, reps);
}

// Device-to-device copy bandwidth in bytes per second, counting bytes read + written (2 x bytes),
// measured on two scratch buffers of `bytes` each.
inline double d2d_copy_bandwidth(std::size_t bytes, cudaStream_t stream, int warmup, int reps) {
  DeviceArray<char> a(bytes), b(bytes);
  const float ms = d2d_copy_ms(b.get(), a.get(), bytes, stream, warmup, reps);
  return 2.0 * static_cast<double>(bytes) / (static_cast<double>(ms) * 1e-3);
}

// Deterministic N(0,1)-like bf16 values with a few outliers (sum of uniforms; fast setup), the
// inputs of the codec benchmarks.
inline std::vector<bf16_t> make_values(std::size_t n) {
  std::vector<bf16_t> v(n);
  std::uint64_t s = 0x9e3779b97f4a7c15ull;
  auto uniform = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(s >> 40) / 16777216.0f;
  };
  for (std::size_t i = 0; i < n; ++i) {
    float x = uniform() + uniform() + uniform() + uniform() - 2.0f;
    if (i % 997 == 0) x *= 40.0f;
    v[i] = from_float<bf16_t>(x);
  }
  return v;
}

}  // namespace kvsift::bench
