// kvsift::cuda::quantize / dequantize against the CPU reference kvsift::quantize_tensor /
// dequantize_tensor (quant/quantized_tensor.hpp): codes, scales and decoded values bit for bit, for
// every format x group axis x storage dtype (input and output) and several NVFP4 global factors,
// on random data with outliers, all-zero groups, tiny values, signed zeros and tied magnitudes;
// contiguous and row-strided, aligned and misaligned views (vector and scalar paths); GPU-quantized
// tensors decoded on the CPU and CPU-quantized ones decoded on the GPU; the fault word; error
// paths.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/quantize.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr QuantFormat kFormats[] = {QuantFormat::nvfp4, QuantFormat::fp8, QuantFormat::ternary};
constexpr GroupAxis kAxes[] = {GroupAxis::token, GroupAxis::channel};
constexpr std::uint8_t kPoisonByte = 0xab;

// [tokens, channels] test data: N(0, 1) rows at log-uniform scales, 1% outliers (x50..x1000), an
// all-zero 16x16 tile (zero groups on both axes), a tile of tiny values (scales that round to zero
// or land in E4M3's subnormals), signed zeros, and a tile of few distinct magnitudes (ternary ties,
// E2M1 midpoints after scaling).
std::vector<float> make_input(int tokens, int channels, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(tokens) * channels);
  for (int t = 0; t < tokens; ++t) {
    const float row_scale = std::pow(10.0f, -3.0f + 4.0f * unit(rng));
    for (int c = 0; c < channels; ++c) {
      float v = normal(rng) * row_scale;
      if (unit(rng) < 0.01f) v *= 50.0f + 950.0f * unit(rng);
      v = std::fmax(-30000.0f, std::fmin(30000.0f, v));  // finite in f16 too
      x[static_cast<std::size_t>(t) * channels + c] = v;
    }
  }
  auto at = [&](int t, int c) -> float& { return x[static_cast<std::size_t>(t) * channels + c]; };
  const int tb = tokens / 16, cb = channels / 16;
  for (int t = 0; t < 16; ++t) {
    for (int c = 0; c < 16; ++c) {
      at(16 * (1 % tb) + t, 16 * (1 % cb) + c) = 0.0f;                            // zero tile
      at(16 * (2 % tb) + t, 16 * (0 % cb) + c) = normal(rng) * 1e-6f;             // tiny tile
      const float ties[] = {1.0f, -1.0f, 0.5f, 0.25f, 0.75f, 1.25f, 3.0f, 0.0f};  // few magnitudes
      at(16 * (3 % tb) + t, 16 * ((cb - 1) % cb) + c) = ties[(t * 7 + c * 3) % 8] * 0.125f;
    }
  }
  at(0, 0) = -0.0f;
  at(5, 1) = -0.0f;
  at(tokens - 1, channels - 1) = 1e-30f;
  return x;
}

template <class T>
std::vector<T> poisoned(std::size_t n) {
  std::vector<T> v(n);
  std::memset(v.data(), 0xff, n * sizeof(T));  // NaN in every dtype
  return v;
}

template <class T>
std::uint32_t bits_of(T v) {
  std::uint32_t u = 0;
  std::memcpy(&u, &v, sizeof v);
  return u;
}

// A [tokens, channels] device view starting `lead` elements into `buf`, rows `row_stride` apart.
template <class T>
TensorView device_view(const DeviceBuffer<T>& buf, std::int64_t lead, int tokens, int channels,
                       std::int64_t row_stride) {
  TensorView v = TensorView::contiguous(buf.get() + lead, dtype_of<T>::value, Device::cuda,
                                        {tokens, channels});
  v.stride[0] = row_stride;
  return v;
}

// Index of the first differing byte, or -1.
std::int64_t first_mismatch(const std::vector<std::uint8_t>& a,
                            const std::vector<std::uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<std::int64_t>(i);
  return -1;
}

// GPU dequantize of the CPU-quantized `ref` into dtype U (row stride, poison around), compared
// with from_float<U>(dequantize_tensor(ref)).
template <class U>
void check_dequantize(const QuantizedTensor& ref, const std::vector<float>& cpu_decoded,
                      std::int64_t row_stride, std::int64_t lead, std::int64_t code_lead) {
  const int tokens = static_cast<int>(ref.grid.tokens),
            channels = static_cast<int>(ref.grid.channels);
  DeviceBuffer<std::uint8_t> codes(ref.codes.size() + code_lead), scales(ref.scales.size());
  cuda::DeviceQuantizedTensor dq{ref.format, ref.grid, ref.global_factor, codes.get() + code_lead,
                                 scales.get()};
  cuda::upload(ref, dq, nullptr);
  const std::size_t n = static_cast<std::size_t>(lead + tokens * row_stride + 16);
  DeviceBuffer<U> out(poisoned<U>(n));
  DeviceBuffer<unsigned long long> fault(1);
  cuda::dequantize(dq, device_view(out, lead, tokens, channels, row_stride), fault.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  REQUIRE(fault.download()[0] == cuda::kNoQuantFault);

  const std::vector<U> got = out.download(), untouched = poisoned<U>(n);
  std::int64_t bad = -1;
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(n) && bad < 0; ++i) {
    const std::int64_t rel = i - lead;
    const bool inside = rel >= 0 && rel / row_stride < tokens && rel % row_stride < channels;
    const U want = inside ? from_float<U>(cpu_decoded[static_cast<std::size_t>(
                                (rel / row_stride) * channels + rel % row_stride)])
                          : untouched[i];
    if (bits_of(got[i]) != bits_of(want)) bad = i;
  }
  INFO("output dtype " << dtype_name(dtype_of<U>::value) << ", first bad element " << bad);
  REQUIRE(bad == -1);
}

// The whole parity loop for storage dtype T of the input.
template <class T>
void check_parity(int tokens, int channels, std::int64_t row_stride, std::int64_t lead,
                  std::int64_t code_lead, std::uint32_t seed) {
  const std::vector<float> raw = make_input(tokens, channels, seed);
  // The reference sees exactly what the GPU sees: the values after rounding to T.
  std::vector<float> x(raw.size());
  const std::size_t n = static_cast<std::size_t>(lead + tokens * row_stride + 16);
  std::vector<T> host = poisoned<T>(n);
  for (int t = 0; t < tokens; ++t)
    for (int c = 0; c < channels; ++c) {
      const T v = from_float<T>(raw[static_cast<std::size_t>(t) * channels + c]);
      host[static_cast<std::size_t>(lead + t * row_stride + c)] = v;
      x[static_cast<std::size_t>(t) * channels + c] = to_float(v);
    }
  DeviceBuffer<T> dx(host);
  const float calibrated = nvfp4_calibrated_global_factor(abs_max(x.data(), x.size()));

  for (QuantFormat format : kFormats) {
    for (GroupAxis axis : kAxes) {
      for (float g : {1.0f, calibrated, 0.37f}) {
        if (format != QuantFormat::nvfp4 && g != 1.0f) continue;  // g is NVFP4's only
        INFO("input " << dtype_name(dtype_of<T>::value) << ", " << quant_format_name(format) << ", "
                      << group_axis_name(axis) << " axis, g " << g << ", [" << tokens << ", "
                      << channels << "], row stride " << row_stride << ", lead " << lead
                      << ", code lead " << code_lead);
        const QuantizedTensor ref = quantize_tensor(x.data(), tokens, channels, format, axis, g);
        const std::vector<float> cpu_decoded = dequantize_tensor(ref);

        // GPU quantize into poisoned buffers with a guard band on both sides.
        const std::size_t code_n = ref.codes.size() + code_lead + 16,
                          scale_n = ref.scales.size() + 16;
        DeviceBuffer<std::uint8_t> codes(std::vector<std::uint8_t>(code_n, kPoisonByte));
        DeviceBuffer<std::uint8_t> scales(std::vector<std::uint8_t>(scale_n, kPoisonByte));
        DeviceBuffer<unsigned long long> fault(1);
        cuda::DeviceQuantizedTensor dq{format, ref.grid, ref.global_factor, codes.get() + code_lead,
                                       scales.get()};
        cuda::quantize(device_view(dx, lead, tokens, channels, row_stride), dq, fault.get(),
                       nullptr);
        KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
        REQUIRE(fault.download()[0] == cuda::kNoQuantFault);

        const QuantizedTensor got = cuda::download(dq, nullptr);
        const std::int64_t bad_code = first_mismatch(got.codes, ref.codes);
        const std::int64_t bad_scale = first_mismatch(got.scales, ref.scales);
        INFO("first bad code byte " << bad_code << " (group "
                                    << bad_code / code_bytes_per_group(format)
                                    << "), first bad scale " << bad_scale);
        REQUIRE(bad_code == -1);
        REQUIRE(bad_scale == -1);
        // Nothing written outside the tensor's codes and scales.
        const std::vector<std::uint8_t> all_codes = codes.download(),
                                        all_scales = scales.download();
        for (std::int64_t i = 0; i < code_lead; ++i) REQUIRE(all_codes[i] == kPoisonByte);
        for (std::size_t i = ref.codes.size() + code_lead; i < code_n; ++i)
          REQUIRE(all_codes[i] == kPoisonByte);
        for (std::size_t i = ref.scales.size(); i < scale_n; ++i)
          REQUIRE(all_scales[i] == kPoisonByte);

        // GPU-quantized, CPU-decoded.
        const std::vector<float> cross = dequantize_tensor(got);
        REQUIRE(std::memcmp(cross.data(), cpu_decoded.data(), cross.size() * sizeof(float)) == 0);

        // CPU-quantized, GPU-decoded, into every storage dtype.
        check_dequantize<float>(ref, cpu_decoded, row_stride, lead, code_lead);
        check_dequantize<f16_t>(ref, cpu_decoded, row_stride, lead, code_lead);
        check_dequantize<bf16_t>(ref, cpu_decoded, row_stride, lead, code_lead);
      }
    }
  }
}

// Group index (KiviGrid numbering, docs/quantization.md) of element (t, c).
std::int64_t group_of(GroupAxis axis, int channels, int t, int c) {
  return axis == GroupAxis::token ? static_cast<std::int64_t>(t / 16) * channels + c
                                  : static_cast<std::int64_t>(t) * (channels / 16) + c / 16;
}

}  // namespace

TEST_CASE("cuda quantize/dequantize match the CPU reference, contiguous", "[cuda][quantize]") {
  check_parity<float>(208, 48, 48, 0, 0, 1);
  check_parity<f16_t>(208, 48, 48, 0, 0, 2);
  check_parity<bf16_t>(208, 48, 48, 0, 0, 3);
  check_parity<bf16_t>(64, 128, 128, 0, 0, 4);
}

TEST_CASE("cuda quantize/dequantize match the CPU reference, strided and misaligned",
          "[cuda][quantize]") {
  // Row stride not a multiple of 8 and a 1-element lead: scalar element path; 1-byte code lead:
  // byte-wise code path.
  check_parity<float>(48, 64, 67, 1, 1, 5);
  check_parity<f16_t>(48, 64, 67, 1, 1, 6);
  check_parity<bf16_t>(48, 64, 67, 1, 3, 7);
  // Row stride a multiple of 8 elements: vector path on padded rows.
  check_parity<bf16_t>(32, 32, 40, 8, 0, 8);
}

TEST_CASE("cuda quantize reports the first group with non-finite input", "[cuda][quantize]") {
  const int tokens = 64, channels = 48;
  std::vector<float> x = make_input(tokens, channels, 11);
  x[37 * channels + 40] = std::nanf("");
  x[50 * channels + 5] = -INFINITY;
  DeviceBuffer<float> dx(x);
  for (GroupAxis axis : kAxes) {
    KiviGrid grid{tokens, channels, axis};
    DeviceBuffer<std::uint8_t> codes(grid.num_groups() * 8), scales(grid.num_groups());
    DeviceBuffer<unsigned long long> fault(1);
    const cuda::DeviceQuantizedTensor dq{QuantFormat::nvfp4, grid, 1.0f, codes.get(), scales.get()};
    cuda::quantize(TensorView::contiguous(dx.get(), DType::f32, Device::cuda, {tokens, channels}),
                   dq, fault.get(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::int64_t want =
        std::min(group_of(axis, channels, 37, 40), group_of(axis, channels, 50, 5));
    CHECK(fault.download()[0] == static_cast<unsigned long long>(want));
  }
}

TEST_CASE("cuda dequantize reports the first group validate_quantized rejects",
          "[cuda][quantize]") {
  const int tokens = 32, channels = 64;
  const std::vector<float> x = make_input(tokens, channels, 12);
  for (QuantFormat format : kFormats) {
    QuantizedTensor q = quantize_tensor(x.data(), tokens, channels, format, GroupAxis::channel);
    const int cb = code_bytes_per_group(format);
    std::int64_t want = 0;
    switch (format) {
      case QuantFormat::nvfp4:
        q.scales[9] = 0x7f;  // NaN scale
        q.scales[6] = 0x90;  // negative scale
        want = 6;
        break;
      case QuantFormat::fp8:
        q.scales[12] = 0xff;         // NaN E8M0
        q.codes[7 * cb + 3] = 0xff;  // NaN E4M3 element
        want = 7;
        break;
      case QuantFormat::ternary:
        q.codes[5 * cb + 2] = 0x20;  // element 10 of group 5 = 0b10
        q.scales[8] = 0xff;
        want = 5;
        break;
    }
    INFO(quant_format_name(format));
    REQUIRE_THROWS_AS(validate_quantized(q), Error);  // the CPU rejects it too
    DeviceBuffer<std::uint8_t> codes(q.codes), scales(q.scales);
    DeviceBuffer<float> out(static_cast<std::size_t>(tokens) * channels);
    DeviceBuffer<unsigned long long> fault(1);
    const cuda::DeviceQuantizedTensor dq{format, q.grid, q.global_factor, codes.get(),
                                         scales.get()};
    cuda::dequantize(
        dq, TensorView::contiguous(out.get(), DType::f32, Device::cuda, {tokens, channels}),
        fault.get(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(fault.download()[0] == static_cast<unsigned long long>(want));
    // Without a fault word the call still decodes (no check, no crash).
    cuda::dequantize(
        dq, TensorView::contiguous(out.get(), DType::f32, Device::cuda, {tokens, channels}),
        nullptr, nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

TEST_CASE("cuda quantize/dequantize reject bad arguments before enqueuing", "[cuda][quantize]") {
  using Catch::Matchers::Contains;
  const int tokens = 32, channels = 32;
  DeviceBuffer<float> dx(std::vector<float>(tokens * channels, 1.0f));
  DeviceBuffer<std::uint8_t> codes(std::vector<std::uint8_t>(64 * 8, kPoisonByte));
  DeviceBuffer<std::uint8_t> scales(std::vector<std::uint8_t>(64, kPoisonByte));
  const KiviGrid grid{tokens, channels, GroupAxis::token};
  const cuda::DeviceQuantizedTensor dq{QuantFormat::nvfp4, grid, 1.0f, codes.get(), scales.get()};
  const TensorView x =
      TensorView::contiguous(dx.get(), DType::f32, Device::cuda, {tokens, channels});

  std::vector<float> host(tokens * channels, 1.0f);
  REQUIRE_THROWS_WITH(
      cuda::quantize(TensorView::contiguous(host.data(), DType::f32, Device::cpu, {32, 32}), dq,
                     nullptr, nullptr),
      Contains("host memory"));
  REQUIRE_THROWS_WITH(
      cuda::quantize(TensorView::contiguous(dx.get(), DType::f32, Device::cuda, {16, 32}), dq,
                     nullptr, nullptr),
      Contains("has shape [16, 32], expected [32, 32]"));
  TensorView strided = x;
  strided.stride[1] = 2;
  REQUIRE_THROWS_WITH(cuda::quantize(strided, dq, nullptr, nullptr), Contains("strides [32, 2]"));
  cuda::DeviceQuantizedTensor bad = dq;
  bad.grid.tokens = 20;
  REQUIRE_THROWS_WITH(cuda::dequantize(bad, x, nullptr, nullptr), Contains("[20, 32]"));
  bad = dq;
  bad.global_factor = 0.0f;
  REQUIRE_THROWS_WITH(cuda::quantize(x, bad, nullptr, nullptr), Contains("global_factor (0)"));
  bad = dq;
  bad.codes = nullptr;
  REQUIRE_THROWS_WITH(cuda::quantize(x, bad, nullptr, nullptr), Contains("must be non-null"));
  bad = dq;
  bad.format = static_cast<QuantFormat>(7);
  REQUIRE_THROWS_WITH(cuda::quantize(x, bad, nullptr, nullptr), Contains("format code 7"));
  TensorView odd = x;
  odd.data = reinterpret_cast<char*>(dx.get()) + 2;
  REQUIRE_THROWS_WITH(cuda::quantize(odd, dq, nullptr, nullptr), Contains("not aligned"));

  const QuantizedTensor wrong_axis =
      quantize_tensor(host.data(), tokens, channels, QuantFormat::nvfp4, GroupAxis::channel);
  REQUIRE_THROWS_WITH(cuda::upload(wrong_axis, dq, nullptr), Contains("does not match"));
  const QuantizedTensor wrong_g =
      quantize_tensor(host.data(), tokens, channels, QuantFormat::nvfp4, GroupAxis::token, 2.0f);
  REQUIRE_THROWS_WITH(cuda::upload(wrong_g, dq, nullptr), Contains("global_factor (2)"));

  // Nothing was written by any rejected call.
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  for (std::uint8_t b : codes.download()) REQUIRE(b == kPoisonByte);
  for (std::uint8_t b : scales.download()) REQUIRE(b == kPoisonByte);
}
