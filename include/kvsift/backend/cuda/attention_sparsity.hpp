// kvsift::cuda::attention_sparsity: ThinKV's per-sequence attention sparsity of one decode step
// (docs/algorithms.md §3.1) on a device KV cache, the same numbers as kvsift::attention_sparsity.
//
// For every sequence b and query head q (GQA: KV head q / G): the logits q·k_j / sqrt(D) of the
// valid keys j < lengths[b], then count(logit_j < max_logit + ln 0.01) / n_valid, averaged over the
// query heads. Each logit is summed over head_dim in index order with separately rounded fp32
// products and sums (no FMA), exactly as the CPU reference does, so logits, counts and the mean
// are bit-identical to it.
//
// FlashInfer-style: attention_sparsity_workspace_bytes() says how much device scratch a call
// needs (dominated by the fp32 logits [batch, q_heads, max length]); attention_sparsity() only
// enqueues work on the given stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda {

// Device scratch for `batch` sequences of `q_heads` query heads holding at most `max_length`
// tokens each.
std::size_t attention_sparsity_workspace_bytes(std::int64_t batch, std::int64_t q_heads,
                                               std::int64_t max_length);
// The same for this cache at its current (host) lengths and these queries.
std::size_t attention_sparsity_workspace_bytes(const KVCacheView& kv, const TensorView& queries);

// kv: the layer's device cache (keys [batch, kv_heads, capacity, head_dim], host lengths, device
// valid_mask or nullptr); queries: device [batch, q_heads, head_dim] or [batch, q_heads, W,
// head_dim] (the last row is used), f32/f16/bf16 (may differ from the cache's dtype), head_dim
// contiguous. out: device [batch] fp32.
// Validates on the host (every lengths[b] >= 1, shapes, devices, workspace) and throws
// kvsift::Error naming the bad value; nothing is enqueued then. What the CPU reference rejects
// only after reading the data (a NaN logit, an infinite largest logit, a sequence whose keys are
// all left pads) yields NaN in out[b] instead.
void attention_sparsity(const KVCacheView& kv, const TensorView& queries, float* out,
                        void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvsift::cuda
