// R-KV's whole compression step for every layer of a model (docs/algorithms.md §1.3), enqueued on
// one stream and nothing else: the layers are selected in chunks (rkv_select_step) and compacted in
// one launch sequence (compact_device_rows_step). No host wait, no allocation, no copy from host
// memory: the step can be captured in a CUDA graph and replayed. A graph bakes in what the host saw
// at capture (shapes, strides, pointers, the lengths kv.lengths, hence the chunks and the runs of
// equal length), so replay it only on caches in the same state — for an engine that compresses
// when every sequence reaches budget + buffer, that is every compression.
//
// The kept lengths stay on the device (`new_lengths`); the caller downloads them when it needs
// them and rewrites its host lengths (DeviceBackend::rkv_compress_step does, with one wait).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/config/rkv_config.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda {

// How the step uses its workspace: [slot rows of every layer | selection scratch of one chunk].
// A chunk holds layers · batch <= 256 sequences (all 32 layers of a model up to batch 8, one layer
// per chunk from batch 256), which bounds the scratch (an fp16 copy of the chunk's normalised keys)
// to a few layers' worth at large batch.
struct RKVStepLayout {
  int chunk = 1;                // layers selected per rkv_select_step call
  std::size_t slots_bytes = 0;  // [n_layers, batch, kv_heads, budget] int32
  std::size_t scratch_bytes = 0;
  std::size_t total() const { return slots_bytes + scratch_bytes; }
};

// Validates every layer (shape, strides, dtype, one shared pad mask, equal lengths across layers,
// the config) and returns the workspace layout; throws kvsift::Error naming the layer and field.
//   layers   [n_layers] device caches, keys/values [batch, kv_heads, capacity, head_dim]
//   queries  [n_layers] device window queries [batch, q_heads, window, head_dim]
RKVStepLayout rkv_compress_step_layout(const KVCacheView* layers, const TensorView* queries,
                                       int n_layers, const RKVConfig& cfg);

// Enqueues the step on `stream`. Returns false, enqueuing nothing, when no sequence is over the
// budget (§1.3: nothing moves). Otherwise every layer is compacted in place and
//   new_lengths  device [batch] int32 out: each sequence's kept count, or -1 for a sequence with
//                a NaN score in some layer, which is left untouched in every layer.
// The host lengths (kv.lengths) are not changed.
bool rkv_compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                       const RKVConfig& cfg, void* workspace, std::size_t workspace_bytes,
                       std::int32_t* new_lengths, cudaStream_t stream);

}  // namespace kvsift::cuda
