// Reads of the device Continuous Thinking table (paged_table.hpp) that ThinKV's own decisions
// need (docs/algorithms.md §3.1, §3.3), with the same numbers as the CPU table gives:
//  - paged_gather_keys: the dequantized keys of chosen live tokens — what
//    ThoughtBlockTable::segment_keys returns, bit for bit — for k-means on a demoted segment;
//  - paged_attention_sparsity: the step's attention sparsity of every (sequence, query head)
//    over the resident keys as stored, as ThinKV::observe_query computes it, bit for bit.
// Keys are decoded with the CPU's own codec (dequantize_group, host/device); every dot product
// runs over head_dim in index order with separately rounded products and sums (no FMA), as the
// host loop does.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/backend/cuda/paged_table.hpp"

namespace kvsift::cuda {

std::size_t paged_gather_keys_workspace_bytes(std::int64_t rows);
// out[r, :] = the key of token sources[r] (DevicePagedTable::key_source), dequantized to fp32.
//   sources  host [rows]; out device [rows, head_dim] f32
void paged_gather_keys(const DevicePagedTable& table, const PagedKeySource* sources,
                       std::int64_t rows, float* out, void* workspace, std::size_t workspace_bytes,
                       cudaStream_t stream);
// The same with the sources already in device memory (copied by the caller, e.g. from pinned
// memory so that the call never waits for the stream), unchecked: each must come from
// key_source of this table since its last change.
//   sources  device [rows]; out device [rows, head_dim] f32
void paged_gather_keys_uploaded(const DevicePagedTable& table, const PagedKeySource* sources,
                                std::int64_t rows, float* out, cudaStream_t stream);

// For every sequence b of `batch` and query head q (GQA: KV head q / (q_heads / kv_heads)): the
// logits q·k / sqrt(head_dim) (scale = softmax_scale) over the live tokens of the head (block
// slots and staged rows), and count(logit < max + ln 0.01) / count(live), written to
// out[b · q_heads + q]. A head with no live token, a NaN logit or an infinite maximum gives NaN
// (the CPU reference raises an error there; the caller does).
// logits (optional): device scratch [batch, q_heads, max_slots] f32 where each logit is kept
// between the maximum and the count, so it is computed once; a sequence whose page table spans
// more than max_slots slots (paged_sparsity_slots) computes its logits twice instead, as without
// the scratch. The result is the same either way.
//   query device [batch, q_heads, head_dim] f32; out device [batch, q_heads] f32
void paged_attention_sparsity(const DevicePagedTable& table, const PagedBatch& batch,
                              const float* query, std::int64_t q_heads, float softmax_scale,
                              float* out, cudaStream_t stream, float* logits = nullptr,
                              std::int64_t max_slots = 0);
// The slots the sparsity kernel walks for a sequence of `blocks` blocks: every 16-slot group of
// its blocks and the 16 rows of each of its three staging streams.
inline std::int64_t paged_sparsity_slots(std::int64_t blocks, std::int32_t block_size) {
  return blocks * block_size + kPagedThoughtTypes * 16;
}

}  // namespace kvsift::cuda
