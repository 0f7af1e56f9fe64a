// LazyEviction's counters and score on the GPU (docs/algorithms.md §5.3): one thread per cached
// slot. A slot's TS/MRI update reads only its own counters and the step's weights of its own
// column, so threads never share a word and no synchronisation is needed. Neighbouring threads
// take neighbouring slots of one row: every read (the group's weight rows, the counters) and
// write is coalesced.
//
// The arithmetic is lazy_counters.hpp's, transcribed (this layer cannot include policy/): a value
// rounded "to the counters" is the double result cast to fp32 (round to nearest), then, for fp16
// counters, through core/dtype.hpp's fp16 conversion. Compiled with -fmad=false (CMakeLists.txt)
// so that no multiply-add is fused into the score.
#include <cuda_runtime_api.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/lazy_scoring.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float round_to(bool fp16, double x) {
  const float f = __double2float_rn(x);
  return fp16 ? f16_bits_to_float(float_to_f16_bits(f)) : f;
}

__global__ void __launch_bounds__(kThreads)
    lazy_observe_kernel(std::int32_t* __restrict__ ts,   // [batch, kv_heads, capacity]
                        std::int32_t* __restrict__ mri,  // [batch, kv_heads, capacity]
                        std::int64_t kv_heads, std::int64_t capacity,
                        const float* __restrict__ probs,  // [batch, q_heads, capacity] or null
                        std::int64_t group,
                        const std::int32_t* __restrict__ lengths,       // [batch]
                        const std::int32_t* __restrict__ prev_lengths,  // [batch]
                        const std::uint8_t* __restrict__ valid,         // [batch, capacity] or null
                        std::int32_t start, std::int32_t now, float alpha, bool fp16) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t row = blockIdx.y;  // b · kv_heads + h
  if (j >= capacity) return;
  const std::int64_t b = row / kv_heads, h = row % kv_heads;
  if (j >= lengths[b]) return;
  const std::int64_t at = row * capacity + j;
  std::int32_t t_old = ts[at], m_old = mri[at];
  if (j >= prev_lengths[b]) {  // lazy::append_tokens
    t_old = start;
    m_old = 0;
  }
  if (probs != nullptr && (valid == nullptr || valid[b * capacity + j] != 0)) {
    // The weight is the max over the GQA group (cpu: p.col(j).maxCoeff()).
    const float* p = probs + (b * kv_heads * group + h * group) * capacity + j;
    float w = p[0];
    for (std::int64_t g = 1; g < group; ++g) w = fmaxf(w, p[g * capacity]);
    if (w >= alpha) {  // lazy::record_hits
      const auto gap = static_cast<std::int32_t>(round_to(fp16, double(now) - double(t_old)));
      m_old = m_old > gap ? m_old : gap;
      t_old = now;
    }
  }
  ts[at] = t_old;
  mri[at] = m_old;
}

// lazy::score, operation for operation.
__device__ __forceinline__ float lazy_score(std::int32_t ts, std::int32_t mri, std::int64_t t,
                                            bool c) {
  const float a = round_to(c, double(t) - double(ts));
  const float b = round_to(c, double(mri) + 1e-5);
  const float r = round_to(c, double(a) / double(b));
  const float e = round_to(c, exp(double(round_to(c, 1.0 + double(r)))));
  const float first = round_to(c, 2.0 / double(round_to(c, 1.0 + double(e))));
  if (mri == 0) return first;
  const float e2 = round_to(c, exp(double(round_to(c, double(mri) - 1.0))));
  const float second = round_to(c, 2.0 / double(round_to(c, 1.0 + double(e2))));
  return round_to(c, double(first) + double(second));
}

__global__ void __launch_bounds__(kThreads)
    lazy_scores_kernel(const std::int32_t* __restrict__ ts,   // [batch, kv_heads, capacity]
                       const std::int32_t* __restrict__ mri,  // [batch, kv_heads, capacity]
                       std::int64_t kv_heads, std::int64_t capacity,
                       const std::int32_t* __restrict__ lengths,  // [batch]
                       int window, std::int64_t step, bool fp16,
                       float* __restrict__ scores) {  // [batch, kv_heads, capacity]
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t row = blockIdx.y;
  if (j >= capacity) return;
  const std::int64_t b = row / kv_heads;
  if (j >= static_cast<std::int64_t>(lengths[b]) - window) return;
  const std::int64_t at = row * capacity + j;
  scores[at] = lazy_score(ts[at], mri[at], step, fp16);
}

void check_counters(const LazyDeviceCounters& c, const char* op) {
  KVSIFT_CHECK(c.batch >= 1 && c.kv_heads >= 1 && c.capacity >= 1, op, ": counters shape [",
               c.batch, ", ", c.kv_heads, ", ", c.capacity, "] must be positive");
  KVSIFT_CHECK(c.batch * c.kv_heads <= 65535, op, ": batch · kv_heads (", c.batch * c.kv_heads,
               ") exceeds 65535 rows per launch");
  KVSIFT_CHECK(c.capacity <= std::int64_t{INT32_MAX}, op, ": capacity (", c.capacity,
               ") exceeds int32 slots");
  KVSIFT_CHECK(c.ts != nullptr && c.mri != nullptr, op, ": counters ts and mri must be non-null");
}

dim3 grid_of(const LazyDeviceCounters& c) {
  return dim3(static_cast<unsigned>((c.capacity + kThreads - 1) / kThreads),
              static_cast<unsigned>(c.batch * c.kv_heads));
}

}  // namespace

std::int32_t lazy_counter_of_step(LazyCounters counters, std::int64_t step) {
  const bool fp16 = counters == LazyCounters::fp16;
  KVSIFT_CHECK(step >= 0 && step <= (fp16 ? 65504 : INT32_MAX), "LazyEviction: step ", step,
               " outside the range of the ", fp16 ? "fp16" : "int32", " step counters");
  const float f = static_cast<float>(static_cast<double>(step));
  return static_cast<std::int32_t>(fp16 ? f16_bits_to_float(float_to_f16_bits(f)) : f);
}

void lazy_observe(const LazyDeviceCounters& counters, const float* probs, std::int64_t q_heads,
                  const std::int32_t* lengths, const std::int32_t* prev_lengths,
                  const std::uint8_t* valid_mask, std::int32_t start, std::int64_t step,
                  float alpha, LazyCounters mode, cudaStream_t stream) {
  const char* op = "cuda::lazy_observe";
  check_counters(counters, op);
  KVSIFT_CHECK(lengths != nullptr && prev_lengths != nullptr, op,
               ": lengths and prev_lengths must be non-null");
  KVSIFT_CHECK(mode == LazyCounters::int32 || mode == LazyCounters::fp16, op,
               ": unknown counters mode ", static_cast<int>(mode));
  std::int64_t group = 1;
  std::int32_t now = 0;
  if (probs != nullptr) {
    KVSIFT_CHECK(q_heads >= counters.kv_heads && q_heads % counters.kv_heads == 0, op,
                 ": q_heads (", q_heads, ") must be a multiple of kv_heads (", counters.kv_heads,
                 ")");
    KVSIFT_CHECK(alpha > 0.0f && alpha <= 1.0f, op, ": alpha must be in (0, 1], got ", alpha);
    group = q_heads / counters.kv_heads;
    now = lazy_counter_of_step(mode, step);
  }
  lazy_observe_kernel<<<grid_of(counters), kThreads, 0, stream>>>(
      counters.ts, counters.mri, counters.kv_heads, counters.capacity, probs, group, lengths,
      prev_lengths, valid_mask, start, now, alpha, mode == LazyCounters::fp16);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void lazy_scores(const LazyDeviceCounters& counters, const std::int32_t* lengths, int window,
                 std::int64_t step, LazyCounters mode, float* scores, cudaStream_t stream) {
  const char* op = "cuda::lazy_scores";
  check_counters(counters, op);
  KVSIFT_CHECK(lengths != nullptr && scores != nullptr, op,
               ": lengths and scores must be non-null");
  KVSIFT_CHECK(window >= 0, op, ": window must be >= 0, got ", window);
  KVSIFT_CHECK(mode == LazyCounters::int32 || mode == LazyCounters::fp16, op,
               ": unknown counters mode ", static_cast<int>(mode));
  KVSIFT_CHECK(step >= 0, op, ": step must be >= 0, got ", step);
  lazy_scores_kernel<<<grid_of(counters), kThreads, 0, stream>>>(
      counters.ts, counters.mri, counters.kv_heads, counters.capacity, lengths, window, step,
      mode == LazyCounters::fp16, scores);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvsift::cuda
