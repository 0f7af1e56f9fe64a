// Attention sparsity of one decode step (ThinKV, docs/algorithms.md §3.1) on a device cache.
//
// Three small kernels, all with a fixed reduction order so the result is deterministic and equal
// to the CPU reference bit for bit:
//   1. logits: one thread per key, the G query heads of its KV head staged in shared memory; every
//      dot product runs over head_dim in index order with separately rounded products and sums
//      (__fmul_rn / __fadd_rn: an FMA would round once and differ from the host's q[d] * k[d]);
//   2. per (sequence, query head): max over valid logits, then the count below max + ln 0.01;
//      max and integer counts do not depend on the reduction order;
//   3. per sequence: the mean over query heads, accumulated in double in head order as the CPU
//      reference does.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvsift/backend/cuda/attention_sparsity.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/backend/cpu/attention_sparsity.hpp"

namespace kvsift::cuda {
namespace {

constexpr int kKeysPerBlock = 128;
constexpr int kReduceThreads = 256;
constexpr int kHeadsPerPass = 4;  // independent dot products in flight per thread
constexpr std::int64_t kMaxStagedQueryFloats = 48 * 1024 / 4;  // default dynamic smem limit

struct QueryLayout {
  const char* data;
  DType dtype;
  std::int64_t stride_b, stride_h;  // elements
  std::int64_t row_offset;          // elements: the newest query row of a window
};

__device__ float load_as_float(const char* base, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::f16:
      return to_float(reinterpret_cast<const f16_t*>(base)[i]);
    case DType::bf16:
      return to_float(reinterpret_cast<const bf16_t*>(base)[i]);
    default:
      return reinterpret_cast<const float*>(base)[i];
  }
}

template <class KT>
__global__ void sparsity_logits_kernel(const KT* __restrict__ keys, std::int64_t key_stride_b,
                                       std::int64_t key_stride_h, std::int64_t key_stride_s,
                                       int head_dim, int group, int q_heads, QueryLayout q,
                                       const std::uint8_t* __restrict__ valid_mask,
                                       std::int64_t capacity,
                                       const std::int32_t* __restrict__ lengths, float scale,
                                       float* __restrict__ logits,  // [batch, q_heads, max_len]
                                       std::int64_t max_length) {
  extern __shared__ float staged_queries[];  // [group, head_dim]
  const int h = blockIdx.y, b = blockIdx.z;
  for (int e = threadIdx.x; e < group * head_dim; e += blockDim.x) {
    const int g = e / head_dim, d = e % head_dim;
    const std::int64_t qh = static_cast<std::int64_t>(h) * group + g;
    staged_queries[e] =
        load_as_float(q.data, q.dtype, b * q.stride_b + qh * q.stride_h + q.row_offset + d);
  }
  __syncthreads();
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kKeysPerBlock + threadIdx.x;
  if (j >= lengths[b]) return;
  if (valid_mask != nullptr && valid_mask[b * capacity + j] == 0) return;  // pads: not read later
  const KT* key = keys + b * key_stride_b + h * key_stride_h + j * key_stride_s;
  for (int g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    float dot[kHeadsPerPass] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int d = 0; d < head_dim; ++d) {
      const float k = to_float(key[d]);
#pragma unroll
      for (int u = 0; u < kHeadsPerPass; ++u) {
        if (g0 + u < group) {
          dot[u] = __fadd_rn(dot[u], __fmul_rn(staged_queries[(g0 + u) * head_dim + d], k));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kHeadsPerPass; ++u) {
      if (g0 + u < group) {
        const std::int64_t qh = static_cast<std::int64_t>(h) * group + g0 + u;
        logits[(b * static_cast<std::int64_t>(q_heads) + qh) * max_length + j] =
            __fmul_rn(dot[u], scale);
      }
    }
  }
}

// Block-wide reductions over kReduceThreads threads; `scratch` holds one value per warp.
__device__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // scratch may still be read by an earlier reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kReduceThreads / 32; ++w) v = fmaxf(v, scratch[w]);
  return v;
}

__device__ long long block_sum(long long v, long long* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = 0;
  for (int w = 0; w < kReduceThreads / 32; ++w) v += scratch[w];
  return v;
}

// One block per (query head, sequence): sparsity of that head's row, NaN where the CPU throws.
__global__ void head_sparsity_kernel(const float* __restrict__ logits, std::int64_t max_length,
                                     const std::uint8_t* __restrict__ valid_mask,
                                     std::int64_t capacity,
                                     const std::int32_t* __restrict__ lengths, float log_ratio,
                                     float* __restrict__ head_sparsity) {  // [batch, q_heads]
  __shared__ float max_scratch[kReduceThreads / 32];
  __shared__ long long sum_scratch[kReduceThreads / 32];
  const int qh = blockIdx.x, b = blockIdx.y, q_heads = gridDim.x;
  const std::int64_t row_index = static_cast<std::int64_t>(b) * q_heads + qh;
  const float* row = logits + row_index * max_length;
  const std::int32_t length = lengths[b];
  auto valid = [&](std::int64_t j) {
    return valid_mask == nullptr || valid_mask[b * capacity + j];
  };

  float local_max = -INFINITY;
  long long local_valid = 0, local_nan = 0;
  for (std::int64_t j = threadIdx.x; j < length; j += kReduceThreads) {
    if (!valid(j)) continue;
    const float x = row[j];
    ++local_valid;
    if (isnan(x)) ++local_nan;
    local_max = fmaxf(local_max, x);  // fmaxf, like std::fmax, ignores a NaN operand
  }
  const float max_logit = block_max(local_max, max_scratch);
  const long long n = block_sum(local_valid, sum_scratch);
  const long long nans = block_sum(local_nan, sum_scratch);
  const float cut = __fadd_rn(max_logit, log_ratio);
  long long local_sparse = 0;
  for (std::int64_t j = threadIdx.x; j < length; j += kReduceThreads) {
    if (valid(j) && row[j] < cut) ++local_sparse;
  }
  const long long sparse = block_sum(local_sparse, sum_scratch);
  if (threadIdx.x == 0) {
    head_sparsity[row_index] = (n == 0 || nans != 0 || !isfinite(max_logit))
                                   ? NAN
                                   : __fdiv_rn(static_cast<float>(sparse), static_cast<float>(n));
  }
}

// One thread per sequence: mean over query heads in head order, in double as on the CPU.
__global__ void mean_over_heads_kernel(const float* __restrict__ head_sparsity, int batch,
                                       int q_heads, float* __restrict__ out) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  double total = 0.0;
  for (int qh = 0; qh < q_heads; ++qh) {
    total += static_cast<double>(head_sparsity[static_cast<std::int64_t>(b) * q_heads + qh]);
  }
  out[b] = static_cast<float>(total / static_cast<double>(q_heads));
}

std::int64_t max_length_of(const KVCacheView& kv) {
  std::int64_t m = 0;
  for (std::int64_t b = 0; b < kv.batch(); ++b) m = std::max<std::int64_t>(m, kv.lengths[b]);
  return m;
}

}  // namespace

std::size_t attention_sparsity_workspace_bytes(std::int64_t batch, std::int64_t q_heads,
                                               std::int64_t max_length) {
  KVSIFT_CHECK(batch >= 0 && q_heads >= 0 && max_length >= 0,
               "attention_sparsity_workspace_bytes: negative size (batch=", batch,
               " q_heads=", q_heads, " max_length=", max_length, ")");
  const auto rows = static_cast<std::size_t>(batch * q_heads);
  return align_up(rows * static_cast<std::size_t>(max_length) * sizeof(float)) +
         align_up(rows * sizeof(float)) +
         align_up(static_cast<std::size_t>(batch) * sizeof(std::int32_t));
}

std::size_t attention_sparsity_workspace_bytes(const KVCacheView& kv, const TensorView& queries) {
  kv.validate();
  KVSIFT_CHECK(queries.rank == 3 || queries.rank == 4,
               "cuda::attention_sparsity: queries must be [batch, q_heads, head_dim] or [batch, "
               "q_heads, W, head_dim], got rank ",
               queries.rank);
  return attention_sparsity_workspace_bytes(kv.batch(), queries.shape[1], max_length_of(kv));
}

void attention_sparsity(const KVCacheView& kv, const TensorView& queries, float* out,
                        void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cuda && queries.device == Device::cuda,
               "cuda::attention_sparsity: cache and queries must be in device memory; use "
               "kvsift::attention_sparsity for host memory");
  KVSIFT_CHECK(queries.data != nullptr && (queries.rank == 3 || queries.rank == 4),
               "cuda::attention_sparsity: queries must be [batch, q_heads, head_dim] or [batch, "
               "q_heads, W, head_dim], got rank ",
               queries.rank);
  const int dim_axis = queries.rank - 1;
  KVSIFT_CHECK(queries.shape[0] == kv.batch() && queries.shape[dim_axis] == kv.head_dim(),
               "cuda::attention_sparsity: queries ", queries.shape_string(),
               " do not match the cache ", kv.keys.shape_string());
  KVSIFT_CHECK(queries.stride[dim_axis] == 1,
               "cuda::attention_sparsity: queries' head_dim must be contiguous, got stride ",
               queries.stride[dim_axis]);
  const std::int64_t batch = kv.batch(), kv_heads = kv.kv_heads(), q_heads = queries.shape[1];
  const std::int64_t dim = kv.head_dim();
  KVSIFT_CHECK(kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0,
               "cuda::attention_sparsity: q_heads (", q_heads,
               ") must be a positive multiple of kv_heads (", kv_heads, ")");
  KVSIFT_CHECK(queries.rank == 3 || queries.shape[2] > 0,
               "cuda::attention_sparsity: the query window is empty");
  KVSIFT_CHECK(dim > 0, "cuda::attention_sparsity: head_dim is 0");
  const std::int64_t group = q_heads / kv_heads;
  KVSIFT_CHECK(group * dim <= kMaxStagedQueryFloats, "cuda::attention_sparsity: group (", group,
               ") x head_dim (", dim, ") query floats exceed the ", kMaxStagedQueryFloats,
               " staged in shared memory");
  KVSIFT_CHECK(batch <= 65535 && kv_heads <= 65535 && q_heads <= 0x7fffffff,
               "cuda::attention_sparsity: batch (", batch, ") and kv_heads (", kv_heads,
               ") must be <= 65535");
  KVSIFT_CHECK(out != nullptr || batch == 0, "cuda::attention_sparsity: out is null");
  for (std::int64_t b = 0; b < batch; ++b) {
    KVSIFT_CHECK(kv.lengths[b] >= 1, "cuda::attention_sparsity: sequence ", b,
                 " has no keys (lengths[", b, "] = ", kv.lengths[b], ")");
  }
  const std::int64_t max_length = max_length_of(kv);
  WorkspaceCarver carve(workspace, workspace_bytes, "cuda::attention_sparsity");
  float* logits = carve.take<float>(static_cast<std::size_t>(batch * q_heads * max_length));
  float* head_sparsity = carve.take<float>(static_cast<std::size_t>(batch * q_heads));
  std::int32_t* d_lengths = carve.take<std::int32_t>(static_cast<std::size_t>(batch));
  if (batch == 0) return;

  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_lengths, kv.lengths,
                                    static_cast<std::size_t>(batch) * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream));
  // The CPU reference's constants, computed by the host exactly as it computes them.
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const float log_ratio = std::log(kSparsityRatio);
  const QueryLayout q{static_cast<const char*>(queries.data), queries.dtype, queries.stride[0],
                      queries.stride[1],
                      queries.rank == 4 ? (queries.shape[2] - 1) * queries.stride[2] : 0};
  const dim3 grid(static_cast<unsigned>((max_length + kKeysPerBlock - 1) / kKeysPerBlock),
                  static_cast<unsigned>(kv_heads), static_cast<unsigned>(batch));
  const std::size_t smem = static_cast<std::size_t>(group * dim) * sizeof(float);
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), KT, [&] {
    sparsity_logits_kernel<KT><<<grid, kKeysPerBlock, smem, stream>>>(
        static_cast<const KT*>(kv.keys.data), kv.keys.stride[0], kv.keys.stride[1],
        kv.keys.stride[2], static_cast<int>(dim), static_cast<int>(group),
        static_cast<int>(q_heads), q, kv.valid_mask, kv.capacity(), d_lengths, scale, logits,
        max_length);
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
  head_sparsity_kernel<<<dim3(static_cast<unsigned>(q_heads), static_cast<unsigned>(batch)),
                         kReduceThreads, 0, stream>>>(
      logits, max_length, kv.valid_mask, kv.capacity(), d_lengths, log_ratio, head_sparsity);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
  mean_over_heads_kernel<<<static_cast<unsigned>((batch + 127) / 128), 128, 0, stream>>>(
      head_sparsity, static_cast<int>(batch), static_cast<int>(q_heads), out);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvsift::cuda
