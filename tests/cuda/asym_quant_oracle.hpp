// The CPU side of the GPU asymmetric group codec tests (test_kivi_codec_cuda.cpp,
// test_pmkvq_codec_cuda.cpp): the host codec of quant/asymmetric_group.hpp applied group by
// group in the layout backend/cuda/asym_quant.hpp documents, the GPU run of the same tensor, and
// comparisons that describe the first difference (index, both values) when they fail.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "device_buffer.hpp"
#include "kvsift/backend/cuda/asym_quant.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "kvsift/quant/asymmetric_group.hpp"

namespace kvsift::test {

// Words, scales and zeros of a packed tensor (words as uint32 whatever the word width).
struct HostPacked {
  std::vector<std::uint32_t> words;
  std::vector<float> scales, zeros;
};

// The host codec, one unit (a channel on the token axis, a token on the channel axis) at a time:
// asym_quantize_group on each group (the last one possibly partial), pack_codes on the unit.
// x: [slabs, tokens, channels] values as the GPU sees them (already rounded to the storage dtype).
inline HostPacked host_quantize(const cuda::DeviceAsymPacked& q, const std::vector<float>& x) {
  HostPacked h;
  const std::int64_t T = q.tokens, D = q.channels, units = q.units_per_slab();
  const std::int64_t extent = q.unit_extent();
  const long stride = q.axis == GroupAxis::token ? static_cast<long>(D) : 1L;
  std::vector<std::uint16_t> codes(static_cast<std::size_t>(extent));
  for (std::int64_t s = 0; s < q.slabs; ++s)
    for (std::int64_t u = 0; u < units; ++u) {
      // Element e of unit u: token e of channel u (token axis) or channel e of token u.
      const std::int64_t base = q.axis == GroupAxis::token ? s * T * D + u : (s * T + u) * D;
      for (std::int64_t g0 = 0; g0 < extent; g0 += q.group) {
        const int count = static_cast<int>(std::min<std::int64_t>(q.group, extent - g0));
        const GroupParams p = asym_quantize_group(q.spec, x.data() + base + g0 * stride, stride,
                                                  count, codes.data() + g0);
        h.scales.push_back(p.scale);
        h.zeros.push_back(p.zero);
      }
      const std::vector<std::uint32_t> w =
          pack_codes(codes.data(), extent, q.spec.bits, q.word_bits, q.order);
      h.words.insert(h.words.end(), w.begin(), w.end());
    }
  return h;
}

// The host decode of `h` (asym_dequantize, or pmkvq's bf16 formula) as [slabs, tokens, channels].
inline std::vector<float> host_dequantize(const cuda::DeviceAsymPacked& q, const HostPacked& h,
                                          cuda::AsymDequantMode mode) {
  const std::int64_t T = q.tokens, D = q.channels, units = q.units_per_slab();
  const std::int64_t extent = q.unit_extent(), wpu = q.words_per_unit();
  const std::int64_t gpu = q.groups_per_unit();
  std::vector<float> out(static_cast<std::size_t>(q.slabs * T * D));
  auto rb = [](float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); };
  for (std::int64_t s = 0; s < q.slabs; ++s)
    for (std::int64_t u = 0; u < units; ++u) {
      const std::int64_t unit = s * units + u;
      const std::vector<std::uint16_t> codes =
          unpack_codes(h.words.data() + unit * wpu, extent, q.spec.bits, q.word_bits, q.order);
      for (std::int64_t e = 0; e < extent; ++e) {
        GroupParams p;
        p.scale = h.scales[static_cast<std::size_t>(unit * gpu + e / q.group)];
        p.zero = h.zeros[static_cast<std::size_t>(unit * gpu + e / q.group)];
        const std::uint16_t c = codes[static_cast<std::size_t>(e)];
        const float y = mode == cuda::AsymDequantMode::f32
                            ? asym_dequantize(q.spec, c, p)
                            : rb(rb(rb(static_cast<float>(c)) * p.scale) - p.zero);
        const std::int64_t at =
            q.axis == GroupAxis::token ? (s * T + e) * D + u : (s * T + u) * D + e;
        out[static_cast<std::size_t>(at)] = y;
      }
    }
  return out;
}

template <class T>
std::uint32_t bits_of(T v) {
  std::uint32_t u = 0;
  std::memcpy(&u, &v, sizeof v);
  return u;
}

// A printable value of an element (16-bit floats widened, small integers as numbers).
inline float show(float v) { return v; }
inline float show(f16_t v) { return to_float(v); }
inline float show(bf16_t v) { return to_float(v); }
inline std::uint32_t show(std::uint32_t v) { return v; }
inline std::uint32_t show(std::uint16_t v) { return v; }
inline std::int32_t show(std::int32_t v) { return v; }

// "" when equal, else the first differing index with both values (for Catch's message).
template <class A, class B>
std::string first_difference(const char* what, const std::vector<A>& got,
                             const std::vector<B>& want) {
  std::ostringstream os;
  if (got.size() != want.size()) {
    os << what << ": " << got.size() << " entries, expected " << want.size();
    return os.str();
  }
  std::size_t bad = 0, first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i])) {
      if (first == got.size()) first = i;
      ++bad;
    }
  if (bad == 0) return "";
  os << what << ": " << bad << " of " << got.size() << " differ; first at " << first << ": got "
     << show(got[first]) << " (0x" << std::hex << bits_of(got[first]) << "), expected " << std::dec
     << show(want[first]) << " (0x" << std::hex << bits_of(want[first]) << ")";
  return os.str();
}

// Scales and zero points compare as numbers: the sign of a zero may differ (fmin(+0, −0) may
// return either zero; backend/cuda/asym_quant.hpp), nothing else may.
inline std::string first_value_difference(const char* what, const std::vector<float>& got,
                                          const std::vector<float>& want) {
  std::ostringstream os;
  if (got.size() != want.size()) {
    os << what << ": " << got.size() << " entries, expected " << want.size();
    return os.str();
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool same = got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i]));
    if (!same) {
      os << what << ": first difference at " << i << ": got " << got[i] << ", expected " << want[i];
      return os.str();
    }
  }
  return "";
}

// Test data for a [slabs, tokens, channels] tensor, every value passed through storage dtype T:
// N(0, 1) rows at log-uniform scales with 1% outliers, then per slab a constant run, a zero run
// with signed zeros, tiny values (scales that round to 0 in fp16) and a few large ones.
template <class T>
std::vector<float> make_values(std::int64_t slabs, std::int64_t tokens, std::int64_t channels,
                               std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const std::int64_t n = slabs * tokens * channels;
  std::vector<float> x(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < slabs * tokens; ++r) {
    const float row_scale = std::pow(10.0f, -3.0f + 4.0f * unit(rng));
    for (std::int64_t c = 0; c < channels; ++c) {
      float v = normal(rng) * row_scale;
      if (unit(rng) < 0.01f) v *= 30.0f + 300.0f * unit(rng);
      x[static_cast<std::size_t>(r * channels + c)] = std::fmax(-30000.0f, std::fmin(30000.0f, v));
    }
  }
  auto at = [&](std::int64_t s, std::int64_t t, std::int64_t c) -> float& {
    return x[static_cast<std::size_t>((s * tokens + t) * channels + c)];
  };
  for (std::int64_t s = 0; s < slabs; ++s) {
    // Token 0: one constant row (constant channel groups); channel 0: one constant column
    // (constant token groups).
    for (std::int64_t c = 0; c < channels; ++c) at(s, 0, c) = 0.375f;
    for (std::int64_t t = 0; t < tokens; ++t) at(s, t, 0) = -1.5f;
    if (tokens > 1)
      for (std::int64_t c = 0; c < channels; ++c) at(s, 1, c) = (c % 2) ? -0.0f : 0.0f;
    if (tokens > 2)
      for (std::int64_t c = 0; c < channels; ++c) at(s, 2, c) = normal(rng) * 1e-7f;
    if (channels > 1)
      for (std::int64_t t = 0; t < tokens; ++t) at(s, t, 1) = (t % 3 == 0) ? 20000.0f : -20000.0f;
  }
  for (float& v : x) v = to_float(from_float<T>(v));
  return x;
}

// The GPU run: x uploaded as dtype T, quantized into fresh buffers, downloaded.
template <class T>
HostPacked gpu_quantize(cuda::DeviceAsymPacked q, const std::vector<float>& x) {
  std::vector<T> xs(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xs[i] = from_float<T>(x[i]);
  DeviceBuffer<T> dx(xs);
  const std::size_t nw = static_cast<std::size_t>(q.num_words());
  const std::size_t ng = static_cast<std::size_t>(q.num_groups());
  DeviceBuffer<std::uint32_t> w32(q.word_bits == 32 ? nw : 1);
  DeviceBuffer<std::uint16_t> w16(q.word_bits == 16 ? nw : 1);
  DeviceBuffer<float> sc(ng), ze(ng);
  KVSIFT_CUDA_CHECK(cudaMemset(w32.get(), 0xab, w32.size() * 4));  // poison: every word written
  KVSIFT_CUDA_CHECK(cudaMemset(w16.get(), 0xab, w16.size() * 2));
  q.words = q.word_bits == 32 ? static_cast<void*>(w32.get()) : static_cast<void*>(w16.get());
  q.scales = sc.get();
  q.zeros = ze.get();
  cuda::asym_quantize(TensorView::contiguous(dx.get(), dtype_of<T>::value, Device::cuda,
                                             {q.slabs, q.tokens, q.channels}),
                      q, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  HostPacked h;
  if (q.word_bits == 32) {
    h.words = w32.download();
  } else {
    const std::vector<std::uint16_t> w = w16.download();
    h.words.assign(w.begin(), w.end());
  }
  h.scales = sc.download();
  h.zeros = ze.download();
  return h;
}

// The GPU decode of host-packed `h` into dtype U, returned as the U values.
template <class U>
std::vector<U> gpu_dequantize(cuda::DeviceAsymPacked q, const HostPacked& h,
                              cuda::AsymDequantMode mode) {
  DeviceBuffer<std::uint32_t> w32(q.word_bits == 32 ? h.words : std::vector<std::uint32_t>(1));
  std::vector<std::uint16_t> narrow(h.words.begin(), h.words.end());
  DeviceBuffer<std::uint16_t> w16(q.word_bits == 16 ? narrow : std::vector<std::uint16_t>(1));
  DeviceBuffer<float> sc(h.scales), ze(h.zeros);
  q.words = q.word_bits == 32 ? static_cast<void*>(w32.get()) : static_cast<void*>(w16.get());
  q.scales = sc.get();
  q.zeros = ze.get();
  const std::size_t n = static_cast<std::size_t>(q.slabs * q.tokens * q.channels);
  DeviceBuffer<U> out(n);
  KVSIFT_CUDA_CHECK(cudaMemset(out.get(), 0xff, n * sizeof(U)));  // NaN poison
  cuda::asym_dequantize(q, mode,
                        TensorView::contiguous(out.get(), dtype_of<U>::value, Device::cuda,
                                               {q.slabs, q.tokens, q.channels}),
                        nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

// from_float<U> of every host-decoded value: what gpu_dequantize<U> must return, bit for bit.
template <class U>
std::vector<U> narrowed(const std::vector<float>& v) {
  std::vector<U> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = from_float<U>(v[i]);
  return out;
}

}  // namespace kvsift::test
