// ThinKV codec throughput on the GPU (docs/algorithms.md §3.2): kvsift::cuda::quantize and
// dequantize of a [tokens, channels] bf16 tensor (default [1M, 128], one KV head's keys or values
// of a 1M-token context) for every format and group axis, against a cudaMemcpyAsync
// device-to-device copy of the same bf16 tensor measured in the same run.
//
// Bytes counted = bytes read + bytes written:
//   quantize    bf16 input + codes + scales
//   dequantize  codes + scales + bf16 output
//   copy        bf16 tensor read + written (2 x tensor bytes)
// GB/s = bytes / median time (10^9 bytes); "vs copy" = codec GB/s / copy GB/s, so 1.0 means the
// codec streams as fast as a plain copy does. Median of kReps launches after kWarmup, CUDA events.
//
// Usage: gpu_bench_codecs [tokens] [channels]
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/quantize.hpp"
#include "kvsift/core/dtype.hpp"

using namespace kvsift;
using bench::DeviceArray;
using bench::make_values;

namespace {

constexpr int kWarmup = 3, kReps = 25;

}  // namespace

int main(int argc, char** argv) {
  if (!bench::cuda_device_present()) return 77;
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : (1 << 20);
  const std::int64_t channels = argc > 2 ? std::atoll(argv[2]) : 128;
  const std::size_t n = static_cast<std::size_t>(tokens * channels);
  const double tensor_bytes = static_cast<double>(n) * sizeof(bf16_t);

  cudaDeviceProp prop;
  KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));

  DeviceArray<bf16_t> x(n), y(n);
  const std::vector<bf16_t> host = make_values(n);
  KVSIFT_CUDA_CHECK(cudaMemcpy(x.get(), host.data(), tensor_bytes, cudaMemcpyHostToDevice));
  const std::int64_t groups = tokens * channels / kQuantGroupSize;
  DeviceArray<std::uint8_t> codes(static_cast<std::size_t>(groups) * kQuantGroupSize),
      scales(static_cast<std::size_t>(groups));
  const TensorView xv =
      TensorView::contiguous(x.get(), DType::bf16, Device::cuda, {tokens, channels});
  const TensorView yv =
      TensorView::contiguous(y.get(), DType::bf16, Device::cuda, {tokens, channels});

  const double copy_ms = bench::d2d_copy_ms(
      y.get(), x.get(), static_cast<std::size_t>(tensor_bytes), stream, kWarmup, kReps);
  const double copy_gbs = 2.0 * tensor_bytes / (copy_ms * 1e-3) / 1e9;

  std::printf("%s, bf16 [%lld, %lld] (%.1f MiB), median of %d after %d warm-up\n", prop.name,
              static_cast<long long>(tokens), static_cast<long long>(channels),
              tensor_bytes / (1 << 20), kReps, kWarmup);
  std::printf("D2D copy: %.3f ms, %.0f GB/s (read + write)\n\n", copy_ms, copy_gbs);
  std::printf("%-8s %-8s | %10s %9s %8s | %10s %9s %8s\n", "format", "axis", "quant ms", "GB/s",
              "vs copy", "dequant ms", "GB/s", "vs copy");
  for (QuantFormat format : {QuantFormat::nvfp4, QuantFormat::fp8, QuantFormat::ternary}) {
    for (GroupAxis axis : {GroupAxis::token, GroupAxis::channel}) {
      const cuda::DeviceQuantizedTensor q{format, KiviGrid{tokens, channels, axis}, 1.0f,
                                          codes.get(), scales.get()};
      const double packed = static_cast<double>(q.code_bytes() + q.scale_bytes());
      const double qms =
          bench::median_ms([&] { cuda::quantize(xv, q, nullptr, stream); }, stream, kWarmup, kReps);
      const double dms = bench::median_ms([&] { cuda::dequantize(q, yv, nullptr, stream); }, stream,
                                          kWarmup, kReps);
      const double qgbs = (tensor_bytes + packed) / (qms * 1e-3) / 1e9;
      const double dgbs = (packed + tensor_bytes) / (dms * 1e-3) / 1e9;
      std::printf("%-8s %-8s | %10.3f %9.0f %8.2f | %10.3f %9.0f %8.2f\n",
                  std::string(quant_format_name(format)).c_str(),
                  std::string(group_axis_name(axis)).c_str(), qms, qgbs, qgbs / copy_gbs, dms, dgbs,
                  dgbs / copy_gbs);
    }
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
