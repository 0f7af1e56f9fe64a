// The row-at-a-time work of R-KV's key redundancy (docs/algorithms.md §1.2) against a plain copy
// of the same bytes, at R1-Llama-8B KV shapes: 8 KV heads, head_dim 128, bf16, S = budget + 128
// (the decode trigger, §1.3), budget 1024 and 2048, batch 1, 8, 64 (or the batches given as
// arguments), one layer.
//
// Rows, per (batch, budget), median device µs (CUDA events) after warm-up:
//   copy      cudaMemcpyAsync device-to-device of the keys' bytes (read + write);
//   pass      the one pass of cuda/key_pass.cu: norms, fp16 unit keys, key sums (reads the keys,
//             writes the fp16 copy: the same bytes as the copy);
//   pass-ro   the same pass without the fp16 copy (the fp32 search's case: reads only);
//   +logits   the pass with the window logits folded in (32 query heads, window 8: the R-KV
//             default), as the scoring runs it (its % counts the queries read and the logits
//             written besides the pass's bytes); vs logits-old, the separate tensor-core logits
//             kernel it saves (window importance with and without its logits kernel, the
//             difference);
//   scalar    the scalar kernels the pass replaced (normalize_and_sum_kernel);
//   cm-vec    the column means with 16-byte reads (reads the keys again);
//   cm-old    the scalar column means;
//   compact   compact_device_rows of K and V (budget slots kept of S), against a copy of the
//             kept bytes of K and V.
// "% copy" is a kernel's bytes read + written per second over the cudaMemcpy's in the same row
// (bytes read + written per second); read-only kernels count their reads only. The goal
// is >= 80% for the pass and the compaction.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../cuda/rkv_kernels.cuh"  // internal launchers: the passes alone
#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/kv_cache_view.hpp"

using namespace kvsift;
using bench::DeviceArray;

namespace {

constexpr int kKVHeads = 8, kQHeads = 32, kWindow = 8, kHeadDim = 128, kWarmup = 5, kReps = 30;

void run(int batch, int budget, cudaStream_t stream) {
  const int S = budget + 128;
  const std::size_t rows = static_cast<std::size_t>(batch) * kKVHeads * S;
  const std::size_t elems = rows * kHeadDim, key_bytes = elems * sizeof(bf16_t);
  const std::vector<bf16_t> host = bench::make_values(elems);
  DeviceArray<bf16_t> keys(elems), values(elems);
  KVSIFT_CUDA_CHECK(cudaMemcpy(keys.get(), host.data(), key_bytes, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemcpy(values.get(), host.data(), key_bytes, cudaMemcpyHostToDevice));
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(batch), S);
  const KVCacheView kv = make_kv_cache_view(keys.get(), values.get(), DType::bf16, Device::cuda,
                                            batch, kKVHeads, S, kHeadDim, lengths.data());
  const cuda::detail::StepView step{&kv, nullptr, 1};
  const std::size_t q_elems = static_cast<std::size_t>(batch) * kQHeads * kWindow * kHeadDim;
  const std::vector<bf16_t> host_q = bench::make_values(q_elems);
  DeviceArray<bf16_t> queries(q_elems);
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(queries.get(), host_q.data(), q_elems * sizeof(bf16_t), cudaMemcpyHostToDevice));
  const TensorView qv = TensorView::contiguous(queries.get(), DType::bf16, Device::cuda,
                                               {batch, kQHeads, kWindow, kHeadDim});
  const cuda::detail::StepView qstep{&kv, &qv, 1};
  const std::size_t n_rows = static_cast<std::size_t>(batch) * kKVHeads * (S - kWindow);
  DeviceArray<float> logits(n_rows * kWindow), pre_pool(n_rows), importance(n_rows);
  const int chunks = cuda::detail::key_sum_chunks(S);
  DeviceArray<float> denom(rows), rbar(rows);
  DeviceArray<std::uint16_t> unit16(static_cast<std::size_t>(
      cuda::detail::tc_unit16_count(static_cast<std::int64_t>(batch) * kKVHeads, S, kHeadDim)));
  DeviceArray<float> partial(static_cast<std::size_t>(batch) * kKVHeads * chunks * kHeadDim);
  DeviceArray<unsigned long long> spared(rows);
  KVSIFT_CUDA_CHECK(cudaMemset(spared.get(), 0, rows * sizeof(unsigned long long)));

  auto time = [&](auto&& f) { return 1e3f * bench::median_ms(f, stream, kWarmup, kReps); };
  const std::size_t kept_bytes =  // of K, or of V
      static_cast<std::size_t>(batch) * kKVHeads * budget * kHeadDim * sizeof(bf16_t);
  DeviceArray<char> copy_src(std::max(key_bytes, 2 * kept_bytes));
  DeviceArray<char> copy_dst(std::max(key_bytes, 2 * kept_bytes));
  const float copy_us = time([&] {
    KVSIFT_CUDA_CHECK(
        cudaMemcpyAsync(copy_dst.get(), keys.get(), key_bytes, cudaMemcpyDeviceToDevice, stream));
  });
  bool ok = true;
  const float pass_us = time([&] {
    ok = cuda::detail::launch_key_pass(step, S, denom.get(), unit16.get(), partial.get(), stream);
  });
  KVSIFT_CHECK(ok, "gpu_bench_keypass: the one pass refused an aligned bf16 layout");
  const float pass_ro_us = time(
      [&] { cuda::detail::launch_key_pass(step, S, denom.get(), nullptr, partial.get(), stream); });
  bool written = false;
  const float pass_logits_us = time([&] {
    cuda::detail::launch_key_pass(qstep, S, denom.get(), unit16.get(), partial.get(), stream,
                                  logits.get(), &written);
  });
  KVSIFT_CHECK(written, "gpu_bench_keypass: the pass did not fold the window logits in");
  const float importance_us = time([&] {
    cuda::detail::launch_window_importance(qstep, S, 7, logits.get(), pre_pool.get(),
                                           importance.get(), stream, false);
  });
  const float softmax_pool_us = time([&] {
    cuda::detail::launch_window_importance(qstep, S, 7, logits.get(), pre_pool.get(),
                                           importance.get(), stream, true);
  });
  const float scalar_us = time([&] {
    cuda::detail::launch_key_rows_scalar(step, S, denom.get(), unit16.get(), partial.get(), stream);
  });
  const float cm_vec_us = time([&] {
    cuda::detail::launch_column_means(step, S, denom.get(), spared.get(), partial.get(), rbar.get(),
                                      true, stream);
  });
  const float cm_old_us = time([&] {
    cuda::detail::launch_column_means(step, S, denom.get(), spared.get(), partial.get(), rbar.get(),
                                      false, stream);
  });

  // Compaction: every row keeps `budget` of S slots, a sorted random subset that always holds the
  // last 128 (the window), as rkv_select writes them. Rerunning it on the compacted cache moves
  // the same rows again: the same work each time.
  std::mt19937 rng(7);
  std::vector<std::int32_t> slots(static_cast<std::size_t>(batch) * kKVHeads * budget);
  std::vector<std::int32_t> all(static_cast<std::size_t>(S - 128));
  for (std::size_t r = 0; r < static_cast<std::size_t>(batch) * kKVHeads; ++r) {
    for (int i = 0; i < S - 128; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<std::int32_t> keep(all.begin(), all.begin() + (budget - 128));
    for (int i = S - 128; i < S; ++i) keep.push_back(i);
    std::sort(keep.begin(), keep.end());
    std::copy(keep.begin(), keep.end(), slots.begin() + r * budget);
  }
  DeviceArray<std::int32_t> d_slots(slots.size());
  DeviceArray<std::int32_t> new_lengths(static_cast<std::size_t>(batch));
  KVSIFT_CUDA_CHECK(cudaMemcpy(d_slots.get(), slots.data(), slots.size() * sizeof(std::int32_t),
                               cudaMemcpyHostToDevice));
  const float compact_us = time(
      [&] { cuda::compact_device_rows(kv, d_slots.get(), budget, new_lengths.get(), stream); });
  const float kept_copy_us = time([&] {  // the kept bytes of K and V in one copy
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(copy_dst.get(), copy_src.get(), 2 * kept_bytes,
                                      cudaMemcpyDeviceToDevice, stream));
  });

  // Bandwidth in GB/s (bytes read + written); the pass also writes 4 B of denom per row and the
  // partial sums, counted.
  const double copy_gbs = 2.0 * key_bytes / (copy_us * 1e3);
  const double pass_bytes = 2.0 * key_bytes + rows * 4.0 + partial.size() * 4.0;
  const double pass_gbs = pass_bytes / (pass_us * 1e3);
  // +logits: the pass's bytes, the window queries read and the fp32 logits written.
  const double logits_gbs =
      (pass_bytes + q_elems * sizeof(bf16_t) + n_rows * kWindow * 4.0) / (pass_logits_us * 1e3);
  const double pass_ro_gbs = (key_bytes + rows * 4.0 + partial.size() * 4.0) / (pass_ro_us * 1e3);
  const double cm_gbs = (key_bytes + rows * 16.0) / (cm_vec_us * 1e3);
  const double compact_gbs = 4.0 * kept_bytes / (compact_us * 1e3);
  const double kept_copy_gbs = 4.0 * kept_bytes / (kept_copy_us * 1e3);
  std::printf(
      "| %5d | %6d | %5d | %7.1f | %8.1f | %8.1f (%3.0f%%) | %8.1f (%3.0f%%) | %8.1f (%3.0f%%) | "
      "%8.1f | "
      "%8.1f | %8.1f (%3.0f%%) | %8.1f | %8.1f (%3.0f%%) |\n",
      batch, budget, S, key_bytes / 1e6, copy_us, pass_us, 100.0 * pass_gbs / copy_gbs, pass_ro_us,
      100.0 * pass_ro_gbs / copy_gbs, pass_logits_us, 100.0 * logits_gbs / copy_gbs,
      importance_us - softmax_pool_us, scalar_us, cm_vec_us, 100.0 * cm_gbs / copy_gbs, cm_old_us,
      compact_us, 100.0 * compact_gbs / kept_copy_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> batches;
  for (int i = 1; i < argc; ++i) batches.push_back(std::atoi(argv[i]));
  if (batches.empty()) batches = {1, 8, 64};
  for (int b : batches) KVSIFT_CHECK(b >= 1, "gpu_bench_keypass: batch must be >= 1, got ", b);
  if (!bench::cuda_device_present()) return 0;
  cudaDeviceProp prop{};
  KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));
  std::printf(
      "R-KV key passes on %s: %d KV heads (%d query heads, window %d), head_dim %d, bf16, one "
      "layer, S = budget + 128; median µs of %d reps after %d warm-up\n",
      prop.name, kKVHeads, kQHeads, kWindow, kHeadDim, kReps, kWarmup);
  std::printf(
      "(%% = bytes read + written per second relative to the cudaMemcpy of the keys in "
      "the same row; compact: relative to a copy of the kept K and V bytes)\n");
  std::printf(
      "| batch | budget | S | keys MB | copy µs | pass µs (%% copy) | pass-ro µs (%% copy) | "
      "+logits µs (%% copy) | logits-old µs | scalar µs | cm-vec µs (%% copy) | cm-old µs | "
      "compact K+V "
      "µs (%% copy) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int budget : {1024, 2048})
    for (int batch : batches) run(batch, budget, stream);
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
