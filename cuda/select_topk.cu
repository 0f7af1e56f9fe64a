// Per-(sequence, KV head) top-k selection on the GPU (docs/algorithms.md §1.3): keep the
// `budget − window` highest scores of the candidates before the window, ties to the lower index,
// pads never kept, and emit the kept slots ascending followed by the window.
//
// One block per (b, h) row. A 4-pass, 8-bit radix select over order-preserving 32-bit keys of
// the scores finds the cut key T and how many candidates equal to T still fit; one ordered pass
// then keeps every key > T plus the first (lowest-index) keys == T, compacting them with block
// prefix sums, so the rows come out sorted with no sort at all. Histogram counts are integer
// atomics, hence the result is deterministic.
#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "batch_runs.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "rkv_kernels.cuh"

namespace kvsift::cuda {
namespace detail {
namespace {

constexpr int kRadixBins = 256;
static_assert(kRadixBins == kBlockThreads, "select_topk_kernel: one radix bin per thread");

// Monotone map float -> uint32: a > b (as floats) iff key(a) > key(b); −0 and +0 map alike,
// since they compare equal (and so tie) in the CPU reference.
__device__ __forceinline__ unsigned order_key(float x) {
  if (x == 0.0f) x = 0.0f;
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kBlockThreads)
    select_topk_kernel(const float* __restrict__ scores,        // [rows, score_pitch], n used
                       const std::uint8_t* __restrict__ valid,  // [mask_batch, capacity] or null
                       int mask_batch, std::int64_t capacity, int kv_heads, int n,
                       std::int64_t score_pitch, int keep, int window, int budget,
                       std::int32_t* __restrict__ slots) {  // [rows, budget]
  using Scan = cub::BlockScan<int, kBlockThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[kRadixBins];
  __shared__ unsigned cut_prefix;
  __shared__ int cut_remaining;
  const std::int64_t row = blockIdx.x;
  const int b = static_cast<int>(row / kv_heads) % mask_batch;  // layers share the mask
  const float* sc = scores + row * score_pitch;
  const std::uint8_t* vm = valid != nullptr ? valid + b * capacity : nullptr;
  std::int32_t* out = slots + row * budget;
  auto is_valid = [&](int j) { return vm == nullptr || vm[j] != 0; };

  int valid_here = 0, nan_here = 0;
  for (int j = threadIdx.x; j < n; j += kBlockThreads) {
    valid_here += is_valid(j) ? 1 : 0;
    nan_here |= isnan(sc[j]) ? 1 : 0;
  }
  int unused, n_valid;
  Scan(scan_tmp).ExclusiveSum(valid_here, unused, n_valid);
  if (__syncthreads_or(nan_here)) {  // also the barrier that frees scan_tmp
    for (int i = threadIdx.x; i < budget; i += kBlockThreads) out[i] = kNanScoreSlot;
    return;  // uniform: every thread saw the same predicate
  }
  const int take = min(keep, n_valid);

  // Radix select of the take-th largest key: after the passes every key > prefix is kept, and
  // `remaining` keys equal to prefix. Taking everything needs no passes: T = 0 is below every
  // non-NaN key.
  unsigned prefix = 0, mask = 0;
  int remaining = take;
  if (take > 0 && take < n_valid) {
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist[threadIdx.x] = 0;  // kRadixBins == kBlockThreads
      __syncthreads();
      for (int j = threadIdx.x; j < n; j += kBlockThreads) {
        if (!is_valid(j)) continue;
        const unsigned u = order_key(sc[j]);
        if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xffu], 1);
      }
      __syncthreads();
      // The cut digit is the largest d whose count of keys with digit >= d reaches `remaining`:
      // thread t holds digit 255 − t, so a prefix sum over the threads gives, in `above`, the
      // keys of the larger digits; exactly one thread sees above < remaining <= above + its own
      // (the counts of all digits sum to >= remaining). One scan instead of thread 0 walking up
      // to 255 bins, which at batch 1 was most of the kernel's time (bench/RESULTS.md run 100).
      const int digit = kRadixBins - 1 - static_cast<int>(threadIdx.x);
      const int count = hist[digit];
      int above;
      Scan(scan_tmp).ExclusiveSum(count, above);
      if (above < remaining && above + count >= remaining) {
        cut_prefix = prefix | (static_cast<unsigned>(digit) << shift);
        cut_remaining = remaining - above;
      }
      __syncthreads();
      prefix = cut_prefix;
      remaining = cut_remaining;
      mask |= 0xffu << shift;
    }
  } else {
    remaining = take > 0 ? n : 0;  // every valid key is > 0 (T = 0) or none is taken
  }

  int equal_base = 0, out_base = 0;
  for (int c0 = 0; c0 < n; c0 += kBlockThreads) {
    const int j = c0 + threadIdx.x;
    const bool v = j < n && is_valid(j);
    const unsigned u = v ? order_key(sc[j]) : 0u;
    const int is_equal = (v && u == prefix) ? 1 : 0;
    int equal_before, equal_total;
    Scan(scan_tmp).ExclusiveSum(is_equal, equal_before, equal_total);
    __syncthreads();
    const bool kept =
        take > 0 && v && (u > prefix || (is_equal && equal_base + equal_before < remaining));
    int pos, kept_total;
    Scan(scan_tmp).ExclusiveSum(kept ? 1 : 0, pos, kept_total);
    __syncthreads();
    if (kept) out[out_base + pos] = j;
    equal_base += equal_total;
    out_base += kept_total;
  }
  // out_base == take here. Then the window (slots n .. n + window − 1), then unused entries.
  for (int i = threadIdx.x; i < budget - take; i += kBlockThreads)
    out[take + i] = i < window ? n + i : kUnusedSlot;
}

__global__ void keep_all_kernel(std::int64_t total, int length, int budget,
                                std::int32_t* __restrict__ slots) {  // [rows, budget]
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= total) return;
  const int i = static_cast<int>(e % budget);
  slots[e] = i < length ? i : kUnusedSlot;
}

}  // namespace

void launch_select_topk(const float* scores, const std::uint8_t* valid_mask, int mask_batch,
                        int sequences, int kv_heads, std::int64_t capacity, int length, int budget,
                        int window, std::int32_t* slots, cudaStream_t stream,
                        std::int64_t score_pitch) {
  if (sequences == 0) return;
  const int n = length - window;
  select_topk_kernel<<<static_cast<unsigned>(sequences * kv_heads), kBlockThreads, 0, stream>>>(
      scores, valid_mask, mask_batch, capacity, kv_heads, n, score_pitch < 0 ? n : score_pitch,
      budget - window, window, budget, slots);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void launch_keep_all_slots(int rows, int length, int budget, std::int32_t* slots,
                           cudaStream_t stream) {
  const std::int64_t total = static_cast<std::int64_t>(rows) * budget;
  if (total == 0) return;
  keep_all_kernel<<<static_cast<unsigned>((total + kBlockThreads - 1) / kBlockThreads),
                    kBlockThreads, 0, stream>>>(total, length, budget, slots);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

void select_topk_slots(const float* scores, const std::int32_t* lengths,
                       const std::uint8_t* valid_mask, int batch, int kv_heads,
                       std::int64_t capacity, int budget, int window, std::int32_t* slots,
                       cudaStream_t stream) {
  KVSIFT_CHECK(batch >= 0 && kv_heads >= 1, "select_topk_slots: bad shape batch=", batch,
               " kv_heads=", kv_heads);
  KVSIFT_CHECK(window >= 1 && budget > window, "select_topk_slots: budget (", budget,
               ") must exceed window (", window, ") >= 1");
  KVSIFT_CHECK(static_cast<std::int64_t>(batch) * kv_heads <= 0x7fffffff,
               "select_topk_slots: batch * kv_heads (", batch, " * ", kv_heads, ") too large");
  if (batch == 0) return;
  KVSIFT_CHECK(lengths != nullptr, "select_topk_slots: lengths (host) must be given, got null");
  std::int32_t longest = 0;
  for (int b = 0; b < batch; ++b) {
    KVSIFT_CHECK(lengths[b] >= 0 && lengths[b] <= capacity, "select_topk_slots: lengths[", b,
                 "] = ", lengths[b], " is outside [0, capacity = ", capacity, "]");
    longest = std::max(longest, lengths[b]);
  }
  KVSIFT_CHECK(slots != nullptr, "select_topk_slots: slots must be a device pointer, got null");
  KVSIFT_CHECK(scores != nullptr || longest <= budget,
               "select_topk_slots: scores must be a device pointer, got null");
  const std::int64_t pitch = longest > window ? longest - window : 0;
  for (const detail::LengthRun& r : detail::equal_length_runs(lengths, batch)) {
    const std::int64_t row0 = r.first * kv_heads;
    const int rows = static_cast<int>(r.count * kv_heads);
    if (r.length <= budget) {  // docs/algorithms.md §1.3: keeps everything
      detail::launch_keep_all_slots(rows, r.length, budget, slots + row0 * budget, stream);
      continue;
    }
    const std::uint8_t* mask = valid_mask != nullptr ? valid_mask + r.first * capacity : nullptr;
    detail::launch_select_topk(scores + row0 * pitch, mask, static_cast<int>(r.count),
                               static_cast<int>(r.count), kv_heads, capacity, r.length, budget,
                               window, slots + row0 * budget, stream, pitch);
  }
}

}  // namespace kvsift::cuda
