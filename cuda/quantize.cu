// TBQ group codecs on the GPU (docs/algorithms.md §3.2): one thread per group of 16.
//
// Why one thread per group: a group is 16 elements and one scale, and the element math is the
// host/device code of quant/ (nvfp4.hpp, fp8_group.hpp, e2m1/e4m3/e8m0.hpp, group_codec.hpp),
// called here on a register array, so the GPU runs the very arithmetic of the CPU reference and
// matches it bit for bit. Consecutive threads take consecutive groups (KiviGrid numbering):
//   - token axis (16 tokens of one channel): neighbouring threads read neighbouring channels of
//     the same token, so each of the 16 loads of a warp is one coalesced row segment;
//   - channel axis (16 channels of one token): a group is 32 B (16-bit) or 64 B (f32) of one row,
//     read with 16-byte vector loads when the rows are 16-byte aligned.
// Codes go out as one 4/8/16-byte store per group (ternary/nvfp4/fp8), contiguous across a warp.
//
// The one function of quant/ not used as is: ternary_optimal_count's insertion sort indexes its
// arrays with data-dependent indices and loops a data-dependent number of times, which puts them in
// local memory and diverges the warp. Here a bitonic network sorts the 16 (|x|, index) pairs in
// registers under the same order (|x| descending, lower index first among equal |x|), and the
// choice of m repeats the reference's arithmetic step for step (same summation order, same
// cross-multiplied comparison), so α and the kept set are identical.
//
// All math is fp32 without fast-math (IEEE division), the same operations in the same order as
// the host build. Contraction into FMA would change roundings: the codec expressions have no
// multiply-add, and the one place the compiler manufactured one (ternary's choice of m) pins its
// products with __fmul_rn. Checked by grepping the PTX for fma / mul feeding add.
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/quantize.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/quant/group_codec.hpp"

namespace kvsift::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kG = kQuantGroupSize;

// Where one launch's groups lie in a [tokens, channels] view with a row stride.
struct GroupWalk {
  std::int64_t num_groups = 0;
  std::int64_t channels = 0;
  std::int64_t row_stride = 0;        // elements between consecutive tokens
  std::int64_t blocks_per_token = 0;  // channels / 16
  bool token_axis = true;
  bool vector_elements = false;  // channel axis with 16-byte aligned groups: uint4 element access
  bool vector_codes = false;     // codes base aligned to the code bytes of a group
};

// Element offset of group g's first element (KiviGrid::group_offset with a row stride).
__device__ __forceinline__ std::int64_t group_first_element(const GroupWalk& w, std::int64_t g) {
  if (w.token_axis) {
    const std::int64_t block = g / w.channels;
    return block * kG * w.row_stride + (g - block * w.channels);
  }
  const std::int64_t token = g / w.blocks_per_token;
  return token * w.row_stride + (g - token * w.blocks_per_token) * kG;
}

template <class T>
__device__ __forceinline__ void load_group(const T* __restrict__ x, std::int64_t first,
                                           std::int64_t step, bool vector,
                                           float (&v)[kG]) {  // [16]
  if (vector) {
    constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));
    const uint4* p = reinterpret_cast<const uint4*>(x + first);
#pragma unroll
    for (int k = 0; k < kG / kPerVector; ++k) {
      const uint4 u = p[k];
      T e[kPerVector];
      memcpy(e, &u, sizeof u);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) v[k * kPerVector + j] = to_float(e[j]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kG; ++i) v[i] = to_float(x[first + i * step]);
  }
}

template <class T>
__device__ __forceinline__ void store_group(T* __restrict__ out, std::int64_t first,
                                            std::int64_t step, bool vector,
                                            const T (&e)[kG]) {  // [16]
  if (vector) {
    constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));
    uint4* p = reinterpret_cast<uint4*>(out + first);
#pragma unroll
    for (int k = 0; k < kG / kPerVector; ++k) {
      uint4 u;
      memcpy(&u, &e[k * kPerVector], sizeof u);
      p[k] = u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kG; ++i) out[first + i * step] = e[i];
  }
}

// One vector access for a group's codes when the base is aligned, bytes otherwise.
template <int kBytes>
struct CodeWord;
template <>
struct CodeWord<4> {
  using type = std::uint32_t;
};
template <>
struct CodeWord<8> {
  using type = uint2;
};
template <>
struct CodeWord<16> {
  using type = uint4;
};

template <int kBytes>
__device__ __forceinline__ void store_codes(std::uint8_t* __restrict__ dst, bool vector,
                                            const std::uint8_t (&c)[kBytes]) {
  if (vector) {
    typename CodeWord<kBytes>::type word;
    memcpy(&word, c, kBytes);
    *reinterpret_cast<typename CodeWord<kBytes>::type*>(dst) = word;
  } else {
#pragma unroll
    for (int i = 0; i < kBytes; ++i) dst[i] = c[i];
  }
}

template <int kBytes>
__device__ __forceinline__ void load_codes(const std::uint8_t* __restrict__ src, bool vector,
                                           std::uint8_t (&c)[kBytes]) {
  if (vector) {
    const typename CodeWord<kBytes>::type word =
        *reinterpret_cast<const typename CodeWord<kBytes>::type*>(src);
    memcpy(c, &word, kBytes);
  } else {
#pragma unroll
    for (int i = 0; i < kBytes; ++i) c[i] = src[i];
  }
}

// Ternary (T2) group in registers; same result as ternary_quantize_group (see the file comment).
// Sort key: (|x| descending, index ascending); the tag carries index·2 + (x < 0).
__device__ __forceinline__ std::uint8_t ternary_quantize_registers(const float (&v)[kG],
                                                                   std::uint8_t (&codes)[4]) {
  float key[kG];
  int tag[kG];
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    key[i] = v[i] < 0.0f ? -v[i] : v[i];  // as the reference: -0 stays -0, equal to +0
    tag[i] = 2 * i + (v[i] < 0.0f ? 1 : 0);
  }
  // Bitonic network (80 compare-exchanges, all indices compile-time so nothing leaves registers).
#pragma unroll
  for (int k = 2; k <= kG; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
#pragma unroll
      for (int i = 0; i < kG; ++i) {
        const int l = i ^ j;
        if (l > i) {
          // i should precede l in this half-sequence's direction.
          const bool l_first = key[l] > key[i] || (key[l] == key[i] && tag[l] < tag[i]);
          const bool swap = ((i & k) == 0) ? l_first : !l_first;
          const float ki = key[i], kl = key[l];
          const int ti = tag[i], tl = tag[l];
          key[i] = swap ? kl : ki;
          key[l] = swap ? ki : kl;
          tag[i] = swap ? tl : ti;
          tag[l] = swap ? ti : tl;
        }
      }
    }
  }
  // ternary_optimal_count's choice of m over the sorted magnitudes, operation for operation. The
  // products are __fmul_rn because, with the loop unrolled, NVVM otherwise rewrites
  // best_sum² · 2 as fma(best_sum, best_sum, best_sum²), one rounding fewer than the host's.
  int best_m = 0;
  float best_sum = 0.0f, sum = 0.0f;
#pragma unroll
  for (int m = 1; m <= kG; ++m) {
    sum += key[m - 1];
    if (best_m == 0 || __fmul_rn(__fmul_rn(sum, sum), static_cast<float>(best_m)) >
                           __fmul_rn(__fmul_rn(best_sum, best_sum), static_cast<float>(m))) {
      best_m = m;
      best_sum = sum;
    }
  }
  const std::uint8_t alpha_code = e4m3_from_float(best_sum / static_cast<float>(best_m));
  std::uint32_t packed = 0;
  if (e4m3_to_float(alpha_code) > 0.0f) {
#pragma unroll
    for (int r = 0; r < kG; ++r) {
      const std::uint32_t c = (tag[r] & 1) ? kTernaryMinus : kTernaryPlus;
      // Element i sits at bits 2·(i mod 4) of byte i/4: bit 2·i of the little-endian word.
      if (r < best_m) packed |= c << (2 * (tag[r] >> 1));
    }
  }
  memcpy(codes, &packed, 4);
  return alpha_code;
}

template <QuantFormat F>
__device__ __forceinline__ std::uint8_t encode_group(const float (&v)[kG], float global_factor,
                                                     std::uint8_t (&c)[code_bytes_per_group(F)]) {
  if constexpr (F == QuantFormat::ternary) {
    return ternary_quantize_registers(v, c);
  } else {
    return quantize_group(F, v, 1, kG, global_factor, c);  // F is constant: the switch folds
  }
}

__device__ __forceinline__ bool is_finite(float x) {
  return (detail::float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

// The checks of validate_quantized() for one group.
template <QuantFormat F>
__device__ __forceinline__ bool group_is_valid(const std::uint8_t (&c)[code_bytes_per_group(F)],
                                               std::uint8_t scale) {
  if constexpr (F == QuantFormat::fp8) {
    bool ok = scale != kE8M0NaN;
#pragma unroll
    for (int i = 0; i < kG; ++i) ok = ok && !e4m3_is_nan(c[i]);
    return ok;
  } else {
    bool ok = !e4m3_is_nan(scale) && (scale & 0x80u) == 0;
    if constexpr (F == QuantFormat::ternary) {
#pragma unroll
      for (int i = 0; i < kG; ++i) ok = ok && ternary_code(c, i) != kTernaryInvalid;
    }
    return ok;
  }
}

template <QuantFormat F, class T>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x,  // [tokens, channels], row stride w.row_stride
                    GroupWalk w, float global_factor,
                    std::uint8_t* __restrict__ codes,   // [num_groups, code bytes]
                    std::uint8_t* __restrict__ scales,  // [num_groups]
                    unsigned long long* __restrict__ first_fault) {
  constexpr int kBytes = code_bytes_per_group(F);
  const std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= w.num_groups) return;
  float v[kG];
  load_group(x, group_first_element(w, g), w.token_axis ? w.row_stride : 1, w.vector_elements, v);
  if (first_fault != nullptr) {
    bool finite = true;
#pragma unroll
    for (int i = 0; i < kG; ++i) finite = finite && is_finite(v[i]);
    if (!finite) atomicMin(first_fault, static_cast<unsigned long long>(g));
  }
  std::uint8_t c[kBytes];
  scales[g] = encode_group<F>(v, global_factor, c);
  store_codes<kBytes>(codes + g * kBytes, w.vector_codes, c);
}

template <QuantFormat F, class T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const std::uint8_t* __restrict__ codes,   // [num_groups, code bytes]
                      const std::uint8_t* __restrict__ scales,  // [num_groups]
                      GroupWalk w, float global_factor,
                      T* __restrict__ out,  // [tokens, channels], row stride w.row_stride
                      unsigned long long* __restrict__ first_fault) {
  constexpr int kBytes = code_bytes_per_group(F);
  const std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= w.num_groups) return;
  std::uint8_t c[kBytes];
  load_codes<kBytes>(codes + g * kBytes, w.vector_codes, c);
  const std::uint8_t scale = scales[g];
  if (first_fault != nullptr && !group_is_valid<F>(c, scale)) {
    atomicMin(first_fault, static_cast<unsigned long long>(g));
  }
  T e[kG];
  dequantize_group(F, c, scale, global_factor, kG, e, 1);  // decodes straight to T
  store_group(out, group_first_element(w, g), w.token_axis ? w.row_stride : 1, w.vector_elements,
              e);
}

// Runs fn(std::integral_constant<QuantFormat, F>) for the run-time format.
template <class Fn>
void dispatch_format(QuantFormat f, Fn&& fn) {
  switch (f) {
    case QuantFormat::nvfp4:
      return fn(std::integral_constant<QuantFormat, QuantFormat::nvfp4>{});
    case QuantFormat::fp8:
      return fn(std::integral_constant<QuantFormat, QuantFormat::fp8>{});
    case QuantFormat::ternary:
      return fn(std::integral_constant<QuantFormat, QuantFormat::ternary>{});
  }
  KVSIFT_FAIL("unknown quantization format code ", static_cast<int>(f));
}

void check_format(QuantFormat f, const char* op) {
  KVSIFT_CHECK(f == QuantFormat::nvfp4 || f == QuantFormat::fp8 || f == QuantFormat::ternary, op,
               ": unknown quantization format code ", static_cast<int>(f));
}

void check_element_view(const TensorView& t, const KiviGrid& grid, const char* op,
                        const char* name) {
  KVSIFT_CHECK(t.device == Device::cuda, op, ": ", name,
               " is in host memory; use kvsift::quantize_tensor / dequantize_tensor");
  KVSIFT_CHECK(t.data != nullptr, op, ": ", name, " is null");
  KVSIFT_CHECK(t.rank == 2 && t.shape[0] == grid.tokens && t.shape[1] == grid.channels, op, ": ",
               name, " has shape ", t.shape_string(), ", expected [", grid.tokens, ", ",
               grid.channels, "]");
  KVSIFT_CHECK(t.stride[1] == 1 && t.stride[0] >= grid.channels, op, ": ", name, " strides [",
               t.stride[0], ", ", t.stride[1], "] must be [>= ", grid.channels,
               ", 1] (channels contiguous)");
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) == 0, op, ": ", name,
               " pointer is not aligned to its ", dtype_name(t.dtype), " elements");
}

GroupWalk make_walk(const DeviceQuantizedTensor& q, const TensorView& t) {
  GroupWalk w;
  w.num_groups = q.grid.num_groups();
  w.channels = q.grid.channels;
  w.row_stride = t.stride[0];
  w.blocks_per_token = q.grid.channels / kG;
  w.token_axis = q.grid.axis == GroupAxis::token;
  const std::int64_t esz = static_cast<std::int64_t>(dtype_size(t.dtype));
  w.vector_elements = !w.token_axis && reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0 &&
                      (w.row_stride * esz) % 16 == 0;
  w.vector_codes = reinterpret_cast<std::uintptr_t>(q.codes) % code_bytes_per_group(q.format) == 0;
  return w;
}

unsigned launch_blocks(std::int64_t groups, const char* op) {
  const std::int64_t blocks = (groups + kThreads - 1) / kThreads;
  KVSIFT_CHECK(blocks <= std::numeric_limits<int>::max(), op, ": ", groups,
               " groups exceed one launch");
  return static_cast<unsigned>(blocks);
}

void reset_fault(unsigned long long* first_fault, cudaStream_t stream) {
  if (first_fault != nullptr) {
    KVSIFT_CUDA_CHECK(cudaMemsetAsync(first_fault, 0xff, sizeof *first_fault, stream));
  }
}

}  // namespace

void quantize(const TensorView& x, const DeviceQuantizedTensor& out,
              unsigned long long* first_fault, cudaStream_t stream) {
  check_format(out.format, "cuda::quantize");
  out.validate();
  check_element_view(x, out.grid, "cuda::quantize", "input x");
  const GroupWalk w = make_walk(out, x);
  const unsigned blocks = launch_blocks(w.num_groups, "cuda::quantize");
  const float g = out.format == QuantFormat::nvfp4 ? out.global_factor : 1.0f;
  reset_fault(first_fault, stream);
  KVSIFT_DISPATCH_DTYPE(x.dtype, T, [&] {
    dispatch_format(out.format, [&](auto format) {
      quantize_kernel<decltype(format)::value, T><<<blocks, kThreads, 0, stream>>>(
          static_cast<const T*>(x.data), w, g, out.codes, out.scales, first_fault);
    });
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void dequantize(const DeviceQuantizedTensor& q, const TensorView& out,
                unsigned long long* first_fault, cudaStream_t stream) {
  check_format(q.format, "cuda::dequantize");
  q.validate();
  check_element_view(out, q.grid, "cuda::dequantize", "output");
  const GroupWalk w = make_walk(q, out);
  const unsigned blocks = launch_blocks(w.num_groups, "cuda::dequantize");
  reset_fault(first_fault, stream);
  KVSIFT_DISPATCH_DTYPE(out.dtype, T, [&] {
    dispatch_format(q.format, [&](auto format) {
      dequantize_kernel<decltype(format)::value, T><<<blocks, kThreads, 0, stream>>>(
          q.codes, q.scales, w, q.global_factor, static_cast<T*>(out.data), first_fault);
    });
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void upload(const QuantizedTensor& src, const DeviceQuantizedTensor& dst, cudaStream_t stream) {
  check_format(dst.format, "cuda::upload");
  dst.validate();
  KVSIFT_CHECK(src.format == dst.format && src.grid.tokens == dst.grid.tokens &&
                   src.grid.channels == dst.grid.channels && src.grid.axis == dst.grid.axis,
               "cuda::upload: host tensor (", quant_format_name(src.format), ", [", src.grid.tokens,
               ", ", src.grid.channels, "], ", group_axis_name(src.grid.axis),
               " axis) does not match the device tensor (", quant_format_name(dst.format), ", [",
               dst.grid.tokens, ", ", dst.grid.channels, "], ", group_axis_name(dst.grid.axis),
               " axis)");
  KVSIFT_CHECK(src.global_factor == dst.global_factor, "cuda::upload: host global_factor (",
               src.global_factor, ") differs from the device tensor's (", dst.global_factor, ")");
  KVSIFT_CHECK(static_cast<std::int64_t>(src.codes.size()) == dst.code_bytes() &&
                   static_cast<std::int64_t>(src.scales.size()) == dst.scale_bytes(),
               "cuda::upload: host tensor holds ", src.codes.size(), " code and ",
               src.scales.size(), " scale bytes, expected ", dst.code_bytes(), " and ",
               dst.scale_bytes());
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst.codes, src.codes.data(), src.codes.size(),
                                    cudaMemcpyHostToDevice, stream));
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst.scales, src.scales.data(), src.scales.size(),
                                    cudaMemcpyHostToDevice, stream));
}

QuantizedTensor download(const DeviceQuantizedTensor& src, cudaStream_t stream) {
  check_format(src.format, "cuda::download");
  src.validate();
  QuantizedTensor q;
  q.format = src.format;
  q.grid = src.grid;
  q.global_factor = src.global_factor;
  q.codes.resize(static_cast<std::size_t>(src.code_bytes()));
  q.scales.resize(static_cast<std::size_t>(src.scale_bytes()));
  KVSIFT_CUDA_CHECK(
      cudaMemcpyAsync(q.codes.data(), src.codes, q.codes.size(), cudaMemcpyDeviceToHost, stream));
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(q.scales.data(), src.scales, q.scales.size(),
                                    cudaMemcpyDeviceToHost, stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  return q;
}

}  // namespace kvsift::cuda
