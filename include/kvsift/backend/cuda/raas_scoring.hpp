// kvsift::cuda RaaS scoring (docs/algorithms.md §5.4) on device arrays: the per-step timestamp
// refresh (top half of the units by score, or every unit reaching alpha) and page mode's Quest
// bound (the page's elementwise key min/max, then sum_c max(q_c·Kmax_c, q_c·Kmin_c), max over
// the GQA group). Equal to the CPU functions of backend/cpu/raas_scores.hpp (refresh_top_half,
// refresh_above, page_key_bounds, page_bounds), which the RaaS policy calls:
//   - timestamps bit for bit (the same strict order: higher score first, the lower unit on equal
//     scores, +0 == −0; NaN scores are unspecified);
//   - key bounds and Quest bounds bit for bit: the same fp32 operations in the same order
//     (channel-order sums, separately rounded products: the file is compiled with -fmad=false and
//     uses __fmul_rn/__fadd_rn), std::min/std::max's exact selection rules.
// Token mode's softmax scores are not computed here (any per-unit scores can be refreshed).
//
// Rows are (sequence b, KV head h), row = b·kv_heads + h. Every call validates on the host
// (kvsift::Error naming the argument; nothing enqueued) and only enqueues on `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda {

enum class RaasRefreshRule : std::uint8_t { top_half, alpha };

// Stamps ts[row, j] = t for the refreshed units j < units[b] of every row: top_half, the
// ceil(units[b] / 2) highest scores (cpu::raas::refresh_top_half); alpha, every score >= alpha
// (cpu::raas::refresh_above). Units j >= units[b] and unrefreshed units are untouched.
//   scores  device [batch, kv_heads, pitch] fp32
//   units   device [batch] int32, 0 <= units[b] <= pitch (a row with units[b] > pitch is
//           left untouched)
//   ts      device [batch, kv_heads, pitch] int32, updated in place
// Cost: O(units²) comparisons a row for top_half (one thread a unit counts the units ranked
// above it, stopping at ceil(units / 2)); meant for units up to a few thousand a row.
void raas_refresh(const float* scores, const std::int32_t* units, std::int64_t batch,
                  std::int64_t kv_heads, std::int64_t pitch, RaasRefreshRule rule, float alpha,
                  std::int32_t t, std::int32_t* ts, cudaStream_t stream);

// Page mode: the elementwise key min/max of every page of every row (cpu::raas::page_key_bounds
// over the row's decode tokens). Page p of row (b, h) covers cache slots
// first[b] + [p·page_size, min((p + 1)·page_size, count[b])); pages = ceil(count[b] / page_size)
// <= max_pages; pages past a row's count are untouched.
//   keys   device [batch, kv_heads, capacity, dim], f32/f16/bf16, contiguous
//   first  device [batch] int32 (the prompt length: decode tokens start there)
//   count  device [batch] int32 (decode tokens), first[b] + count[b] <= capacity (a row
//          that violates it is left untouched)
//   kmin   device [batch, kv_heads, max_pages, dim] fp32
//   kmax   device [batch, kv_heads, max_pages, dim] fp32
void raas_page_key_bounds(const TensorView& keys, const std::int32_t* first,
                          const std::int32_t* count, int page_size, std::int64_t max_pages,
                          float* kmin, float* kmax, cudaStream_t stream);

// Page mode: out[row, p] = max over the group's query heads g of
// sum_c max(q[b, h·group + g, c]·kmax[row, p, c], q[b, h·group + g, c]·kmin[row, p, c])
// (cpu::raas::page_bounds), for p < ceil(count[b] / page_size); the rest untouched.
//   queries  device [batch, q_heads, dim] fp32, q_heads a multiple of kv_heads
//   kmin     device [batch, kv_heads, max_pages, dim] fp32 (raas_page_key_bounds)
//   kmax     device [batch, kv_heads, max_pages, dim] fp32
//   count    device [batch] int32
//   out      device [batch, kv_heads, max_pages] fp32
void raas_page_bounds(const float* queries, std::int64_t batch, std::int64_t q_heads,
                      std::int64_t kv_heads, std::int64_t dim, const float* kmin, const float* kmax,
                      const std::int32_t* count, int page_size, std::int64_t max_pages, float* out,
                      cudaStream_t stream);

}  // namespace kvsift::cuda
