// Asymmetric min-max group codec on the GPU (docs/algorithms.md §5.1 KIVI, §5.2 PM-KVQ): one
// thread per group, the host codec's arithmetic step for step (backend/cuda/asym_quant.hpp).
//
// Why one thread per group: a group is independent (its min/max, scale, codes and whole packed
// words), so no thread shares a word with another and no synchronisation or atomics are needed.
// A thread reads its group twice (min/max, then codes; the second pass hits L1/L2) and packs its
// codes into words as it goes. Neighbouring threads take neighbouring channels (token axis, keys)
// so the strided reads of a warp are coalesced rows; on the channel axis a thread reads G
// contiguous elements.
//
// Bit identity with quant/asymmetric_group.hpp: fp32 operations with explicit rounding intrinsics
// in the host's order, fp16/bf16 rounding through core/dtype.hpp's shared conversions, rintf for
// std::nearbyint (round half to even), fminf/fmaxf for std::fmin/fmax. This file is compiled with
// -fmad=false (CMakeLists.txt) so that not even a compiler-generated multiply-add can appear.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>

#include "kvsift/backend/cuda/asym_quant.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift::cuda {
namespace {

constexpr int kThreads = 256;

// The launch-time description of a packed tensor (plain values for the kernel).
struct Geometry {
  std::int64_t slabs, tokens, channels;
  std::int64_t groups_per_unit, words_per_unit, num_groups;
  int group, bits, per, word_bits;
  bool token_axis, lsb_first, add_min, fp32_quotient;
  DType arith;
  float scale_min, scale_max;
};

Geometry make_geometry(const DeviceAsymPacked& q) {
  Geometry g;
  g.slabs = q.slabs;
  g.tokens = q.tokens;
  g.channels = q.channels;
  g.groups_per_unit = q.groups_per_unit();
  g.words_per_unit = q.words_per_unit();
  g.num_groups = q.num_groups();
  g.group = q.group;
  g.bits = q.spec.bits;
  g.per = q.codes_per_word();
  g.word_bits = q.word_bits;
  g.token_axis = q.axis == GroupAxis::token;
  g.lsb_first = q.order == PackOrder::lsb_first;
  g.add_min = q.spec.zero == ZeroConvention::add_min;
  g.fp32_quotient = q.spec.fp32_quotient;
  g.arith = q.spec.arith;
  g.scale_min = q.spec.scale_min;
  g.scale_max = q.spec.scale_max;
  return g;
}

// Where group `gid` lies: first element, element stride, element count, first word, param index.
struct GroupAt {
  std::int64_t first, stride, word;
  int count;
};

__device__ __forceinline__ GroupAt locate(const Geometry& geo, std::int64_t gid) {
  GroupAt a;
  if (geo.token_axis) {
    // gid = (slab · groups_per_unit + gb) · channels + d: neighbouring threads, neighbouring d.
    const std::int64_t d = gid % geo.channels;
    const std::int64_t rest = gid / geo.channels;
    const std::int64_t gb = rest % geo.groups_per_unit, slab = rest / geo.groups_per_unit;
    const std::int64_t t0 = gb * geo.group;
    a.first = (slab * geo.tokens + t0) * geo.channels + d;
    a.stride = geo.channels;
    a.count = static_cast<int>(geo.tokens - t0 < geo.group ? geo.tokens - t0 : geo.group);
    a.word = (slab * geo.channels + d) * geo.words_per_unit + t0 / geo.per;
  } else {
    // gid = (slab · tokens + t) · groups_per_unit + gc: the params' own order.
    const std::int64_t gc = gid % geo.groups_per_unit, row = gid / geo.groups_per_unit;
    const std::int64_t c0 = gc * geo.group;
    a.first = row * geo.channels + c0;
    a.stride = 1;
    a.count = static_cast<int>(geo.channels - c0 < geo.group ? geo.channels - c0 : geo.group);
    a.word = row * geo.words_per_unit + c0 / geo.per;
  }
  return a;
}

// Params are stored [slab, unit, group of unit].
__device__ __forceinline__ std::int64_t param_index(const Geometry& geo, std::int64_t gid) {
  if (!geo.token_axis) return gid;
  const std::int64_t d = gid % geo.channels, rest = gid / geo.channels;
  const std::int64_t gb = rest % geo.groups_per_unit, slab = rest / geo.groups_per_unit;
  return (slab * geo.channels + d) * geo.groups_per_unit + gb;
}

// round_to_dtype (quant/asymmetric_group.hpp) on the device, through the same bit conversions.
__device__ __forceinline__ float round_arith(DType t, float x) {
  if (t == DType::f16) return f16_bits_to_float(float_to_f16_bits(x));
  if (t == DType::bf16) return bf16_bits_to_float(float_to_bf16_bits(x));
  return x;
}

__device__ __forceinline__ int code_shift(const Geometry& geo, int j) {
  return geo.lsb_first ? geo.bits * j : geo.word_bits - geo.bits * (j + 1);
}

template <class T, class W>
__global__ void __launch_bounds__(kThreads)
    asym_quantize_kernel(const T* __restrict__ x,  // [slabs, tokens, channels]
                         Geometry geo,
                         W* __restrict__ words,        // [slabs, units, words_per_unit]
                         float* __restrict__ scales,   // [slabs, units, groups_per_unit]
                         float* __restrict__ zeros) {  // [slabs, units, groups_per_unit]
  const std::int64_t gid = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (gid >= geo.num_groups) return;
  const GroupAt at = locate(geo, gid);
  // asym_quantize_group, operation for operation.
  float lo = to_float(x[at.first]), hi = lo;
  for (int i = 1; i < at.count; ++i) {
    const float v = to_float(x[at.first + i * at.stride]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  const DType a = geo.arith;
  const float qmax = static_cast<float>((1 << geo.bits) - 1);
  float s = round_arith(a, __fdiv_rn(round_arith(a, __fsub_rn(hi, lo)), qmax));
  s = fminf(fmaxf(s, geo.scale_min), geo.scale_max);
  const std::uint32_t mask = (1u << geo.bits) - 1u;
  std::uint32_t acc = 0;
  int j = 0;
  std::int64_t w = at.word;
  for (int i = 0; i < at.count; ++i) {
    const float v = to_float(x[at.first + i * at.stride]);
    float u = 0.0f;  // s == 0: a constant group, code 0 (docs/algorithms.md §5.1)
    if (s > 0.0f)
      u = geo.fp32_quotient ? __fdiv_rn(__fsub_rn(v, lo), s)
                            : round_arith(a, __fdiv_rn(round_arith(a, __fsub_rn(v, lo)), s));
    u = fminf(fmaxf(u, 0.0f), qmax);
    const std::uint32_t code = static_cast<std::uint32_t>(rintf(u));
    acc |= (code & mask) << code_shift(geo, j);
    if (++j == geo.per) {
      words[w++] = static_cast<W>(acc);
      acc = 0;
      j = 0;
    }
  }
  if (j > 0) words[w] = static_cast<W>(acc);  // the unit's partial last word, zero-filled
  const std::int64_t p = param_index(geo, gid);
  scales[p] = s;
  zeros[p] = geo.add_min ? lo : round_arith(a, -lo);
}

__device__ __forceinline__ float round_bf16(float x) {
  return bf16_bits_to_float(float_to_bf16_bits(x));
}

template <class W, class T>
__global__ void __launch_bounds__(kThreads)
    asym_dequantize_kernel(const W* __restrict__ words,       // [slabs, units, words_per_unit]
                           const float* __restrict__ scales,  // [slabs, units, groups_per_unit]
                           const float* __restrict__ zeros,   // [slabs, units, groups_per_unit]
                           Geometry geo, AsymDequantMode mode,
                           T* __restrict__ out) {  // [slabs, tokens, channels]
  const std::int64_t gid = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (gid >= geo.num_groups) return;
  const GroupAt at = locate(geo, gid);
  const std::int64_t p = param_index(geo, gid);
  const float s = scales[p], z = zeros[p];
  const std::uint32_t mask = (1u << geo.bits) - 1u;
  for (int i = 0; i < at.count; ++i) {
    const std::uint32_t word = static_cast<std::uint32_t>(words[at.word + i / geo.per]);
    const float q = static_cast<float>((word >> code_shift(geo, i % geo.per)) & mask);
    float y;
    if (mode == AsymDequantMode::pmkvq_bf16) {  // pmkvq::dequantize_bf16
      y = round_bf16(__fsub_rn(round_bf16(__fmul_rn(round_bf16(q), s)), z));
    } else {  // asym_dequantize
      const float qs = __fmul_rn(q, s);
      y = geo.add_min ? __fadd_rn(qs, z) : __fsub_rn(qs, z);
    }
    out[at.first + i * at.stride] = from_float<T>(y);
  }
}

// pmkvq::ers_code on the device (64-bit products: for w = 8 they reach 2^40).
__device__ __forceinline__ std::uint32_t ers_code(std::uint32_t q, int w) {
  const std::uint64_t a = (1ull << (2 * w)) - (1ull << w) + 1ull;
  const std::uint64_t b = (1ull << (3 * w - 1)) - (1ull << (2 * w - 1)) + (1ull << (w - 1));
  return static_cast<std::uint32_t>(((a * q + b) >> (3 * w)) & ((1ull << w) - 1ull));
}

// One thread per output word: unpack its 16/to codes from the input words, shift each down the
// width chain, pack MSB first.
__global__ void __launch_bounds__(kThreads)
    ers_codes_kernel(const std::uint16_t* __restrict__ in,  // [count / (16 / from)]
                     int from, std::int64_t out_words, int to,
                     std::uint16_t* __restrict__ out) {  // [out_words]
  const std::int64_t ow = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (ow >= out_words) return;
  const int per_in = 16 / from, per_out = 16 / to;
  const std::uint32_t in_mask = from == 16 ? 0xffffu : ((1u << from) - 1u);
  std::uint32_t acc = 0;
  for (int j = 0; j < per_out; ++j) {
    const std::int64_t c = ow * per_out + j;  // code index
    const int k = static_cast<int>(c % per_in);
    std::uint32_t q =
        (static_cast<std::uint32_t>(in[c / per_in]) >> (16 - from * (k + 1))) & in_mask;
    for (int w = from / 2; w >= to; w /= 2) q = ers_code(q, w);
    acc |= q << (16 - to * (j + 1));
  }
  out[ow] = static_cast<std::uint16_t>(acc);
}

__global__ void __launch_bounds__(kThreads)
    ers_scales_kernel(float* __restrict__ scales,  // [groups], in place
                      std::int64_t groups, int from, int to) {
  const std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= groups) return;
  float s = scales[g];
  // pmkvq::ers_scale: the fp32 product of a bf16 value and 2^w + 1 is exact; one bf16 rounding.
  for (int w = from / 2; w >= to; w /= 2)
    s = round_bf16(__fmul_rn(s, static_cast<float>((1u << w) + 1u)));
  scales[g] = s;
}

unsigned launch_blocks(std::int64_t n, const char* op) {
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  KVSIFT_CHECK(blocks <= std::numeric_limits<int>::max(), op, ": ", n,
               " threads exceed one launch");
  return static_cast<unsigned>(blocks);
}

void check_view(const TensorView& t, const DeviceAsymPacked& q, const char* op, const char* name) {
  t.validate(name);
  KVSIFT_CHECK(t.device == Device::cuda, op, ": ", name, " is in host memory (device required)");
  KVSIFT_CHECK(t.data != nullptr, op, ": ", name, " is null");
  KVSIFT_CHECK(
      t.rank == 3 && t.shape[0] == q.slabs && t.shape[1] == q.tokens && t.shape[2] == q.channels,
      op, ": ", name, " has shape ", t.shape_string(), ", expected [", q.slabs, ", ", q.tokens,
      ", ", q.channels, "]");
  KVSIFT_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, strides [", t.stride[0],
               ", ", t.stride[1], ", ", t.stride[2], "]");
}

bool is_pmkvq_width(int n) { return n == 16 || n == 8 || n == 4 || n == 2; }

}  // namespace

void DeviceAsymPacked::validate(const char* op) const {
  spec.validate();
  KVSIFT_CHECK(word_bits == 16 || word_bits == 32, op, ": word_bits (", word_bits,
               ") must be 16 or 32");
  KVSIFT_CHECK(word_bits % spec.bits == 0, op, ": bits (", spec.bits, ") must divide word_bits (",
               word_bits, ")");
  KVSIFT_CHECK(group >= 1 && group % codes_per_word() == 0, op, ": group (", group,
               ") must be a positive multiple of the codes per word (", codes_per_word(),
               ") so that every group owns whole words");
  KVSIFT_CHECK(slabs >= 1 && tokens >= 1 && channels >= 1, op, ": shape [", slabs, ", ", tokens,
               ", ", channels, "] must be positive");
  const std::int64_t limit = std::int64_t{1} << 40;
  KVSIFT_CHECK(slabs <= limit / tokens && slabs * tokens <= limit / channels, op, ": shape [",
               slabs, ", ", tokens, ", ", channels, "] exceeds 2^40 elements");
  KVSIFT_CHECK(words != nullptr && scales != nullptr && zeros != nullptr, op,
               ": words, scales and zeros must be non-null (words ", words, ", scales ",
               static_cast<const void*>(scales), ", zeros ", static_cast<const void*>(zeros), ")");
}

void asym_quantize(const TensorView& x, const DeviceAsymPacked& q, cudaStream_t stream) {
  q.validate("cuda::asym_quantize");
  check_view(x, q, "cuda::asym_quantize", "input x");
  const Geometry geo = make_geometry(q);
  const unsigned blocks = launch_blocks(geo.num_groups, "cuda::asym_quantize");
  KVSIFT_DISPATCH_DTYPE(x.dtype, T, [&] {
    const T* src = static_cast<const T*>(x.data);
    if (q.word_bits == 32) {
      asym_quantize_kernel<T, std::uint32_t><<<blocks, kThreads, 0, stream>>>(
          src, geo, static_cast<std::uint32_t*>(q.words), q.scales, q.zeros);
    } else {
      asym_quantize_kernel<T, std::uint16_t><<<blocks, kThreads, 0, stream>>>(
          src, geo, static_cast<std::uint16_t*>(q.words), q.scales, q.zeros);
    }
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void asym_dequantize(const DeviceAsymPacked& q, AsymDequantMode mode, const TensorView& out,
                     cudaStream_t stream) {
  q.validate("cuda::asym_dequantize");
  check_view(out, q, "cuda::asym_dequantize", "output");
  KVSIFT_CHECK(mode == AsymDequantMode::f32 || mode == AsymDequantMode::pmkvq_bf16,
               "cuda::asym_dequantize: unknown mode code ", static_cast<int>(mode));
  KVSIFT_CHECK(mode != AsymDequantMode::pmkvq_bf16 || q.spec.zero == ZeroConvention::subtract_zero,
               "cuda::asym_dequantize: mode pmkvq_bf16 needs subtract_zero zero points");
  const Geometry geo = make_geometry(q);
  const unsigned blocks = launch_blocks(geo.num_groups, "cuda::asym_dequantize");
  KVSIFT_DISPATCH_DTYPE(out.dtype, T, [&] {
    T* dst = static_cast<T*>(out.data);
    if (q.word_bits == 32) {
      asym_dequantize_kernel<std::uint32_t, T><<<blocks, kThreads, 0, stream>>>(
          static_cast<const std::uint32_t*>(q.words), q.scales, q.zeros, geo, mode, dst);
    } else {
      asym_dequantize_kernel<std::uint16_t, T><<<blocks, kThreads, 0, stream>>>(
          static_cast<const std::uint16_t*>(q.words), q.scales, q.zeros, geo, mode, dst);
    }
  });
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

namespace {
DeviceAsymPacked kivi_layout(int bits, int group, GroupAxis axis, std::int64_t slabs,
                             std::int64_t tokens, std::int64_t channels, const char* op) {
  KVSIFT_CHECK(bits == 2 || bits == 4 || bits == 8, op, ": bits must be 2, 4 or 8, got ", bits);
  DeviceAsymPacked q;
  q.spec.bits = bits;  // fp16 arithmetic, add_min, no clamp: AsymmetricQuantSpec's defaults
  q.axis = axis;
  q.group = group;
  q.word_bits = 32;
  q.order = PackOrder::lsb_first;
  q.slabs = slabs;
  q.tokens = tokens;
  q.channels = channels;
  return q;
}
}  // namespace

DeviceAsymPacked kivi_keys_layout(int bits, int group, std::int64_t slabs, std::int64_t tokens,
                                  std::int64_t channels) {
  return kivi_layout(bits, group, GroupAxis::token, slabs, tokens, channels,
                     "cuda::kivi_keys_layout");
}

DeviceAsymPacked kivi_values_layout(int bits, int group, std::int64_t slabs, std::int64_t tokens,
                                    std::int64_t channels) {
  return kivi_layout(bits, group, GroupAxis::channel, slabs, tokens, channels,
                     "cuda::kivi_values_layout");
}

DeviceAsymPacked pmkvq_layout(int n_bits, bool bf16_arith, int group, std::int64_t slabs,
                              std::int64_t tokens, std::int64_t channels) {
  KVSIFT_CHECK(is_pmkvq_width(n_bits), "cuda::pmkvq_layout: n_bits must be 16, 8, 4 or 2, got ",
               n_bits);
  DeviceAsymPacked q;
  // pmkvq::quant_spec, restated here because quant/pmkvq_codec.hpp's helpers are host-only
  // (the scale bounds rounded to the arithmetic dtype; fp32 quotient at 16 bits).
  q.spec.bits = n_bits;
  q.spec.zero = ZeroConvention::subtract_zero;
  q.spec.arith = bf16_arith ? DType::bf16 : DType::f32;
  q.spec.scale_min = round_to_dtype(q.spec.arith, 1e-5f);
  q.spec.scale_max = round_to_dtype(q.spec.arith, 1e5f);
  q.spec.fp32_quotient = n_bits == 16;
  q.axis = GroupAxis::channel;
  q.group = group;
  q.word_bits = 16;
  q.order = PackOrder::msb_first;
  q.slabs = slabs;
  q.tokens = tokens;
  q.channels = channels;
  return q;
}

void pmkvq_requantize(const std::uint16_t* in_words, int from_bits, std::int64_t count,
                      std::uint16_t* out_words, int to_bits, float* scales, std::int64_t groups,
                      cudaStream_t stream) {
  const char* op = "cuda::pmkvq_requantize";
  KVSIFT_CHECK(is_pmkvq_width(from_bits) && is_pmkvq_width(to_bits) && to_bits < from_bits, op,
               ": widths must be in {16, 8, 4, 2} with to_bits < from_bits, got from_bits ",
               from_bits, ", to_bits ", to_bits);
  KVSIFT_CHECK(count >= 0 && count % (16 / to_bits) == 0, op, ": count (", count,
               ") must be >= 0 and a multiple of ", 16 / to_bits, " (whole output words)");
  KVSIFT_CHECK(groups >= 0, op, ": groups (", groups, ") must be >= 0");
  KVSIFT_CHECK(count == 0 || (in_words != nullptr && out_words != nullptr), op,
               ": in_words and out_words must be non-null");
  KVSIFT_CHECK(groups == 0 || scales != nullptr, op, ": scales must be non-null for ", groups,
               " groups");
  const std::int64_t in_n = count / (16 / from_bits), out_n = count / (16 / to_bits);
  const auto in_lo = reinterpret_cast<std::uintptr_t>(in_words);
  const auto out_lo = reinterpret_cast<std::uintptr_t>(out_words);
  KVSIFT_CHECK(count == 0 || out_lo + 2 * static_cast<std::uintptr_t>(out_n) <= in_lo ||
                   in_lo + 2 * static_cast<std::uintptr_t>(in_n) <= out_lo,
               op, ": out_words must not overlap in_words");
  if (out_n > 0) {
    ers_codes_kernel<<<launch_blocks(out_n, op), kThreads, 0, stream>>>(in_words, from_bits, out_n,
                                                                        to_bits, out_words);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
  if (groups > 0) {
    ers_scales_kernel<<<launch_blocks(groups, op), kThreads, 0, stream>>>(scales, groups, from_bits,
                                                                          to_bits);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace kvsift::cuda
