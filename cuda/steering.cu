// Steering update h[b, last] += α_b · v (docs/algorithms.md §2.5, SkipKV adaptive steering).
//
// One block column-slice per steered row; every element is read, updated and written by exactly
// one thread, so there are no races. __fmul_rn / __fadd_rn keep nvcc from contracting the update
// into an FMA: the CPU reference rounds the product and the sum separately. Results are
// bit-identical to the host's for every input, NaN payloads included, except a NaN the add itself
// creates (inf + −inf), whose bits are the hardware's default NaN on either side.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/steering.hpp"

namespace kvsift::cuda {
namespace {

constexpr int kThreads = 256;

// Gated rows and their strengths, passed by value so a host alpha array needs no copy.
struct HostRows {
  std::int32_t row[kSteeringRowsPerLaunch];
  float alpha[kSteeringRowsPerLaunch];
};

struct HiddenLayout {
  char* data;                // element (0, 0, 0)
  std::int64_t stride_b;     // elements between sequences
  std::int64_t stride_k;     // elements between hidden channels
  std::int64_t last_offset;  // elements from a sequence's start to its last position
  std::int64_t hidden_size;
};

__device__ float quieted(float nan) { return __uint_as_float(__float_as_uint(nan) | 0x00400000u); }

template <class T>
__device__ void steer_row(const HiddenLayout& h, std::int64_t b, float alpha,
                          const float* __restrict__ vector) {
  T* row = reinterpret_cast<T*>(h.data) + b * h.stride_b + h.last_offset;
  for (std::int64_t k = blockIdx.y * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       k < h.hidden_size; k += static_cast<std::int64_t>(gridDim.y) * blockDim.x) {
    T* x = row + k * h.stride_k;
    const float old = to_float(*x);
    const float sum = __fadd_rn(old, __fmul_rn(alpha, vector[k]));
    // A NaN input keeps its payload (quieted), as the host's IEEE add propagates it; the GPU's
    // own add would return the canonical NaN instead.
    *x = from_float<T>(isnan(old) ? quieted(old) : sum);
  }
}

template <class T>
__global__ void steer_host_rows_kernel(HiddenLayout h, HostRows rows,
                                       const float* __restrict__ vector) {
  steer_row<T>(h, rows.row[blockIdx.x], rows.alpha[blockIdx.x], vector);
}

template <class T>
__global__ void steer_device_alpha_kernel(HiddenLayout h, const float* __restrict__ alpha,
                                          const float* __restrict__ vector) {
  const float a = alpha[blockIdx.x];
  if (a == 0.0f) return;  // ungated (+0 and −0 alike)
  steer_row<T>(h, blockIdx.x, a, vector);
}

void validate(const TensorView& hidden, const float* vector) {
  KVSIFT_CHECK(hidden.rank == 3, "cuda::apply_steering: hidden must be [batch, seq, hidden], got ",
               hidden.shape_string());
  KVSIFT_CHECK(hidden.device == Device::cuda,
               "cuda::apply_steering: hidden must be in device memory");
  KVSIFT_CHECK(hidden.shape[1] >= 1,
               "cuda::apply_steering: hidden has no positions (seq = ", hidden.shape[1], ")");
  KVSIFT_CHECK(hidden.shape[0] <= 0x7fffffff, "cuda::apply_steering: batch ", hidden.shape[0],
               " exceeds the grid limit");
  KVSIFT_CHECK(hidden.shape[0] == 0 || hidden.shape[2] == 0 || hidden.data != nullptr,
               "cuda::apply_steering: hidden.data is null for shape ", hidden.shape_string());
  KVSIFT_CHECK(vector != nullptr || hidden.shape[2] == 0,
               "cuda::apply_steering: the steering vector is null");
}

HiddenLayout layout_of(const TensorView& hidden) {
  return HiddenLayout{static_cast<char*>(hidden.data), hidden.stride[0], hidden.stride[2],
                      (hidden.shape[1] - 1) * hidden.stride[1], hidden.shape[2]};
}

// Column slices per row: enough blocks to cover a hidden size of a few thousand channels with
// one element per thread.
unsigned column_blocks(std::int64_t hidden_size) {
  return static_cast<unsigned>(std::max<std::int64_t>(
      1, std::min<std::int64_t>((hidden_size + kThreads - 1) / kThreads, 64)));
}

// Launches for an explicit list of (row, alpha) pairs, at most kSteeringRowsPerLaunch at a time.
void launch_host_rows(const TensorView& hidden, const std::vector<std::int32_t>& rows,
                      const std::vector<float>& alphas, const float* vector, cudaStream_t stream) {
  if (rows.empty() || hidden.shape[2] == 0) return;
  const HiddenLayout h = layout_of(hidden);
  for (std::size_t first = 0; first < rows.size(); first += kSteeringRowsPerLaunch) {
    const std::size_t count = std::min<std::size_t>(kSteeringRowsPerLaunch, rows.size() - first);
    HostRows chunk{};
    std::copy(rows.begin() + first, rows.begin() + first + count, chunk.row);
    std::copy(alphas.begin() + first, alphas.begin() + first + count, chunk.alpha);
    const dim3 grid(static_cast<unsigned>(count), column_blocks(h.hidden_size));
    KVSIFT_DISPATCH_DTYPE(hidden.dtype, T, [&] {
      steer_host_rows_kernel<T><<<grid, kThreads, 0, stream>>>(h, chunk, vector);
    });
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void apply_steering(const TensorView& hidden, const float* alpha, AlphaLocation alpha_location,
                    const float* vector, cudaStream_t stream) {
  validate(hidden, vector);
  const std::int64_t batch = hidden.shape[0];
  KVSIFT_CHECK(alpha != nullptr || batch == 0, "cuda::apply_steering: alpha is null for batch ",
               batch);
  if (batch == 0 || hidden.shape[2] == 0) return;
  if (alpha_location == AlphaLocation::host) {
    std::vector<std::int32_t> rows;
    std::vector<float> alphas;
    for (std::int64_t b = 0; b < batch; ++b) {
      if (alpha[b] == 0.0f) continue;
      rows.push_back(static_cast<std::int32_t>(b));
      alphas.push_back(alpha[b]);
    }
    launch_host_rows(hidden, rows, alphas, vector, stream);
    return;
  }
  const HiddenLayout h = layout_of(hidden);
  const dim3 grid(static_cast<unsigned>(batch), column_blocks(h.hidden_size));
  KVSIFT_DISPATCH_DTYPE(hidden.dtype, T, [&] {
    steer_device_alpha_kernel<T><<<grid, kThreads, 0, stream>>>(h, alpha, vector);
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

std::int64_t apply_steering(const SteeringConfig& cfg, int layer, const TensorView& hidden,
                            const std::uint8_t* gated, const float* alpha, const float* vector,
                            std::int64_t vector_size, cudaStream_t stream) {
  validate(hidden, vector);
  const std::int64_t batch = hidden.shape[0];
  KVSIFT_CHECK(vector_size == hidden.shape[2], "cuda::apply_steering: steering vector has ",
               vector_size, " values, hidden size is ", hidden.shape[2]);
  KVSIFT_CHECK((gated != nullptr && alpha != nullptr) || batch == 0,
               "cuda::apply_steering: gated and alpha (host, [batch]) must be given for batch ",
               batch);
  if (layer != cfg.layer) return 0;
  // Gated rows are steered even at strength 0, exactly as the CPU controller does.
  std::vector<std::int32_t> rows;
  std::vector<float> alphas;
  for (std::int64_t b = 0; b < batch; ++b) {
    if (gated[b] == 0) continue;
    rows.push_back(static_cast<std::int32_t>(b));
    alphas.push_back(alpha[b]);
  }
  launch_host_rows(hidden, rows, alphas, vector, stream);
  return static_cast<std::int64_t>(rows.size());
}

}  // namespace kvsift::cuda
