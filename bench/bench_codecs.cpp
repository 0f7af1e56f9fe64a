// CPU throughput of ThinKV's group codecs (docs/algorithms.md §3.2): quantize and dequantize of a
// [4096, 128] f32 tensor (one KV head of a long trace) in the KIVI layout, per format and group
// axis. Bytes/s counts the f32 tensor (4 bytes per element), so GB/s compares across formats.
// The loops call the same KVSIFT_HOST_DEVICE group functions a CUDA kernel would, one group at a
// time, single-threaded: a reference point, not a tuned CPU kernel.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kvsift/quant/group_codec.hpp"
#include "kvsift/quant/kivi_layout.hpp"

namespace {

constexpr std::int64_t kTokens = 4096, kChannels = 128;

const std::vector<float>& input() {
  static const std::vector<float> x = [] {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.5f);
    std::vector<float> v(kTokens * kChannels);
    for (float& e : v) e = normal(rng);
    return v;
  }();
  return x;
}

kvsift::QuantFormat format_of(const benchmark::State& s) {
  return static_cast<kvsift::QuantFormat>(s.range(0));
}
kvsift::GroupAxis axis_of(const benchmark::State& s) {
  return static_cast<kvsift::GroupAxis>(s.range(1));
}

void label(benchmark::State& s) {
  s.SetLabel(std::string(kvsift::quant_format_name(format_of(s))) + "/" +
             std::string(kvsift::group_axis_name(axis_of(s))));
  s.SetBytesProcessed(static_cast<std::int64_t>(s.iterations()) * kTokens * kChannels * 4);
}

void BM_Quantize(benchmark::State& state) {
  const kvsift::KiviGrid grid{kTokens, kChannels, axis_of(state)};
  const kvsift::QuantFormat f = format_of(state);
  const int cb = kvsift::code_bytes_per_group(f);
  std::vector<std::uint8_t> codes(grid.num_groups() * cb), scales(grid.num_groups());
  const float* x = input().data();
  for (auto _ : state) {
    for (std::int64_t g = 0; g < grid.num_groups(); ++g) {
      scales[g] = kvsift::quantize_group(f, x + grid.group_offset(g), grid.group_stride(),
                                         kvsift::kQuantGroupSize, 1.0f, &codes[g * cb]);
    }
    benchmark::DoNotOptimize(codes.data());
    benchmark::DoNotOptimize(scales.data());
  }
  label(state);
}

void BM_Dequantize(benchmark::State& state) {
  const kvsift::KiviGrid grid{kTokens, kChannels, axis_of(state)};
  const kvsift::QuantFormat f = format_of(state);
  const int cb = kvsift::code_bytes_per_group(f);
  std::vector<std::uint8_t> codes(grid.num_groups() * cb), scales(grid.num_groups());
  const float* x = input().data();
  for (std::int64_t g = 0; g < grid.num_groups(); ++g) {
    scales[g] = kvsift::quantize_group(f, x + grid.group_offset(g), grid.group_stride(),
                                       kvsift::kQuantGroupSize, 1.0f, &codes[g * cb]);
  }
  std::vector<float> out(kTokens * kChannels);
  for (auto _ : state) {
    for (std::int64_t g = 0; g < grid.num_groups(); ++g) {
      kvsift::dequantize_group(f, &codes[g * cb], scales[g], 1.0f, kvsift::kQuantGroupSize,
                               out.data() + grid.group_offset(g), grid.group_stride());
    }
    benchmark::DoNotOptimize(out.data());
  }
  label(state);
}

// Args: {format (nvfp4 = 0, fp8 = 1, ternary = 2), axis (token = 0, channel = 1)}.
void formats_and_axes(benchmark::internal::Benchmark* b) {
  for (int f = 0; f < 3; ++f)
    for (int a = 0; a < 2; ++a) b->Args({f, a});
}

BENCHMARK(BM_Quantize)->Apply(formats_and_axes)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Dequantize)->Apply(formats_and_axes)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
