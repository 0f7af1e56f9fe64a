// Kernels of bench/gpu_rkv_inputs.hpp: counter-based (stateless) random keys, so every element is
// a pure function of (seed, index) and a cache can be regenerated bit for bit between
// repetitions, and the mma.sync throughput kernel.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gpu_rkv_inputs.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "mma.cuh"

namespace kvsift::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 8192;

// splitmix64's finaliser: a bijection of 64-bit words with good avalanche.
__host__ __device__ __forceinline__ std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// One independent stream per (seed, tag), indexed by `idx`.
__host__ __device__ __forceinline__ std::uint64_t draw(std::uint64_t seed, std::uint64_t tag,
                                                       std::uint64_t idx) {
  return mix64(mix64(seed ^ (tag << 56)) ^ idx);
}
// Uniform in [0, 1) from the top 24 bits.
__host__ __device__ __forceinline__ float uniform01(std::uint64_t h) {
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}
// N(0, 1) by Box-Muller from two 24-bit halves (u1 in (0, 1], so the log is finite).
__host__ __device__ __forceinline__ float normal01(std::uint64_t h) {
  const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777216.0f);
  const float u2 = static_cast<float>(h & 0xffffffull) * (1.0f / 16777216.0f);
#ifdef __CUDA_ARCH__
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
#else  // host copy (checks of the generator's statistics): the same values up to rounding
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.28318530718f * u2);
#endif
}

__global__ void fill_normal_kernel(__nv_bfloat16* dst, std::size_t n, std::uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += stride)
    dst[e] = __float2bfloat16_rn(normal01(draw(seed, 1, e)));
}

// Tags of the structured generator's streams (see StructuredKeys).
enum : std::uint64_t {
  kTagMag = 2,
  kTagDup = 3,
  kTagDir = 4,
  kTagNoise = 5,
  kTagSrc = 6,
  kTagJit = 7
};

struct Slab {
  std::uint64_t seed;
  std::int64_t slab, seq, dim;
  float a;
};
__host__ __device__ __forceinline__ bool is_duplicate(const Slab& s, std::int64_t i,
                                                      float fraction) {
  return i > 0 && uniform01(draw(s.seed, kTagDup, static_cast<std::uint64_t>(s.slab * s.seq + i))) <
                      fraction;
}
__host__ __device__ __forceinline__ float base_value(const Slab& s, std::int64_t i,
                                                     std::int64_t d) {
  const float g = normal01(draw(s.seed, kTagDir, static_cast<std::uint64_t>(s.slab * s.dim + d)));
  const float n = normal01(
      draw(s.seed, kTagNoise, static_cast<std::uint64_t>((s.slab * s.seq + i) * s.dim + d)));
  return s.a * g + n;
}

// Element e of a contiguous [slabs, seq, dim] structured-key cache (StructuredKeys).
__host__ __device__ __forceinline__ float structured_value(const StructuredKeys& p,
                                                           std::uint64_t seed, std::int64_t seq,
                                                           std::int64_t dim, std::size_t e) {
  const auto d = static_cast<std::int64_t>(e % static_cast<std::size_t>(dim));
  const auto row = static_cast<std::int64_t>(e / static_cast<std::size_t>(dim));
  const std::int64_t i = row % seq;
  Slab s{seed, row / seq, seq, dim, 0.0f};
  s.a = p.mag_min + (p.mag_max - p.mag_min) *
                        uniform01(draw(seed, kTagMag, static_cast<std::uint64_t>(s.slab)));
  if (!is_duplicate(s, i, p.dup_fraction)) return base_value(s, i, d);
  // An earlier row, stepped back to a non-duplicate (row 0 never is one, so this ends).
  std::int64_t j = static_cast<std::int64_t>(
      uniform01(draw(seed, kTagSrc, static_cast<std::uint64_t>(s.slab * seq + i))) *
      static_cast<float>(i));
  j = j < 0 ? 0 : (j > i - 1 ? i - 1 : j);  // float rounding could reach i
  while (j > 0 && is_duplicate(s, j, p.dup_fraction)) --j;
  return base_value(s, j, d) + p.dup_noise * normal01(draw(seed, kTagJit, e));
}

__global__ void fill_structured_kernel(__nv_bfloat16* keys, std::int64_t n_slabs, std::int64_t seq,
                                       std::int64_t dim, StructuredKeys p, std::uint64_t seed) {
  const std::size_t n = static_cast<std::size_t>(n_slabs * seq * dim);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += stride)
    keys[e] = __float2bfloat16_rn(structured_value(p, seed, seq, dim, e));
}

__global__ void read_flush_kernel(const uint4* __restrict__ buf, std::size_t n,
                                  std::uint32_t* sink) {
  std::uint32_t x = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t e = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += stride) {
    const uint4 v = buf[e];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u && threadIdx.x == 0x3ffu) *sink = x;  // never: threadIdx.x < 256
}

int grid_for(std::size_t n) {
  return static_cast<int>(std::clamp<std::size_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// Independent accumulator chains per warp: enough in flight to keep the tensor cores busy.
constexpr int kChains = 8;
constexpr int kPeakThreads = 256;

__global__ void __launch_bounds__(kPeakThreads) mma_peak_kernel(int iters, float* out) {
  using kvsift::cuda::detail::mma_16816;
  using kvsift::cuda::detail::pack_bf16;
  const float t = static_cast<float>(threadIdx.x) * 1e-3f;
  const std::uint32_t a[4] = {pack_bf16(t, 1e-3f), pack_bf16(2e-3f, t), pack_bf16(t, t),
                              pack_bf16(3e-3f, 4e-3f)};
  const std::uint32_t b0 = pack_bf16(1e-3f, t), b1 = pack_bf16(t, 2e-3f);
  float acc[kChains][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) mma_16816(acc[c], a, b0, b1);
  }
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x] = s;  // keeps the work
}

}  // namespace

void fill_normal_bf16(void* dst, std::size_t n, std::uint64_t seed, cudaStream_t stream) {
  if (n == 0) return;
  fill_normal_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n,
                                                           seed);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void fill_structured_keys_bf16(void* keys, std::int64_t batch, std::int64_t kv_heads,
                               std::int64_t seq, std::int64_t head_dim,
                               const StructuredKeys& params, std::uint64_t seed,
                               cudaStream_t stream) {
  KVSIFT_CHECK(batch >= 1 && kv_heads >= 1 && seq >= 1 && head_dim >= 1,
               "fill_structured_keys_bf16: bad shape [", batch, ", ", kv_heads, ", ", seq, ", ",
               head_dim, "]");
  KVSIFT_CHECK(params.mag_min >= 0.0f && params.mag_max >= params.mag_min,
               "fill_structured_keys_bf16: magnitude range [", params.mag_min, ", ", params.mag_max,
               "] is empty or negative");
  KVSIFT_CHECK(params.dup_fraction >= 0.0f && params.dup_fraction < 1.0f,
               "fill_structured_keys_bf16: dup_fraction must be in [0, 1), got ",
               params.dup_fraction);
  const std::size_t n = static_cast<std::size_t>(batch * kv_heads * seq * head_dim);
  fill_structured_kernel<<<grid_for(n), kThreads, 0, stream>>>(
      static_cast<__nv_bfloat16*>(keys), batch * kv_heads, seq, head_dim, params, seed);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void read_flush(const void* buf, std::size_t bytes, std::uint32_t* sink, cudaStream_t stream) {
  KVSIFT_CHECK(bytes % 16 == 0, "read_flush: bytes (", bytes, ") must be a multiple of 16");
  const std::size_t n = bytes / 16;
  if (n == 0) return;
  read_flush_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<const uint4*>(buf), n, sink);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

double mma_sync_peak_flops(cudaStream_t stream, int warmup, int reps) {
  int device = 0, sms = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  KVSIFT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int blocks = std::max(sms, 1) * 4;  // 32 resident warps per SM
  const int iters = 8192;                   // ~1.1e12 FLOP per launch on 132 SMs
  float* out = nullptr;
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&out),
                               static_cast<std::size_t>(blocks) * kPeakThreads * sizeof(float)));
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  KVSIFT_CUDA_CHECK(cudaEventCreate(&e0));
  KVSIFT_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < warmup + reps; ++r) {
    KVSIFT_CUDA_CHECK(cudaEventRecord(e0, stream));
    mma_peak_kernel<<<blocks, kPeakThreads, 0, stream>>>(iters, out);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
    KVSIFT_CUDA_CHECK(cudaEventRecord(e1, stream));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0.0f;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (r >= warmup) ms.push_back(t);
  }
  KVSIFT_CUDA_CHECK(cudaEventDestroy(e0));
  KVSIFT_CUDA_CHECK(cudaEventDestroy(e1));
  KVSIFT_CUDA_CHECK(cudaFree(out));
  std::sort(ms.begin(), ms.end());
  const double t = static_cast<double>(ms[ms.size() / 2]) * 1e-3;
  const double flop = 2.0 * 16 * 8 * 16 * kChains * static_cast<double>(iters) *
                      (kPeakThreads / 32) * static_cast<double>(blocks);
  return flop / t;
}

}  // namespace kvsift::bench
