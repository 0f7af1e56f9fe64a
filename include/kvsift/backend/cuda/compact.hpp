// kvsift::cuda::compact: applies a KeepPlan to a KV cache in device memory, in place, with no
// staging copy of the cache. Same result as kvsift::compact on the host. Batches may be ragged:
// every row carries its own kept count (the plan's, or the kRowEnd that ends a device row), so
// sequences of different lengths, and sequences that keep everything, compact side by side.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"

namespace kvsift::cuda {

// Device workspace compact() needs for `plan` (its row offsets and slots).
std::size_t compact_workspace_bytes(const KeepPlan& plan);

// Validates on the host (plan well-formed, made for this cache at these lengths), then enqueues
// the moves of keys, values and the padding mask (rewritten from head 0's row; the plan must keep
// pads at the same positions in every head, as every kvsift policy does) on `stream`, and
// rewrites kv.lengths (host) to the kept lengths. Nothing is written when validation fails.
void compact(const KVCacheView& kv, const KeepPlan& plan, void* workspace,
             std::size_t workspace_bytes, cudaStream_t stream);

// Row markers of device slot rows (the layout kvsift::cuda::rkv_select writes).
inline constexpr std::int32_t kRowEnd = -1;      // pads the rest of a row that keeps fewer slots
inline constexpr std::int32_t kRowInvalid = -2;  // fills a row whose scores held a NaN

// Applies kept rows that already live on the device, with no host round trip: the path for an
// engine that keeps its plan on the GPU (rkv_select → compact_device_rows, all on one stream).
//   slots        device [batch, kv_heads, row_stride] int32; each row its kept slots ascending,
//   then
//                kRowEnd. Rows come from kvsift's own selection kernels, so they are not checked
//                on the host; the kernel ignores slots outside [0, capacity).
//   new_lengths  device [batch] int32 out: each sequence's kept count, or -1 when any of its rows
//                is kRowInvalid — that sequence is then left untouched (the others are compacted).
// kv.lengths (host) is not touched; kv.valid_mask, when set, is compacted from head 0's row.
void compact_device_rows(const KVCacheView& kv, const std::int32_t* slots, int row_stride,
                         std::int32_t* new_lengths, cudaStream_t stream);

// compact_device_rows for all layers of one compression step in one set of launches (the rows
// rkv_select_step writes). Layer l's rows are slots[l]; the layers must agree in shape, dtype and
// strides and share one padding mask; 1 <= n_layers <= 128.
//   slots        device [n_layers, batch, kv_heads, row_stride] int32
//   new_lengths  device [batch] int32 out: layer 0's kept count per sequence (every kvsift
//   selection
//                keeps the same count in every layer), or -1 when a row of the sequence in any
//                layer is kRowInvalid — that sequence is then left untouched in every layer.
// The mask, when set, is compacted once, from layer 0's head-0 rows.
void compact_device_rows_step(const KVCacheView* layers, int n_layers, const std::int32_t* slots,
                              int row_stride, std::int32_t* new_lengths, cudaStream_t stream);

}  // namespace kvsift::cuda
