// The device references of a DevicePagedTable and of a batch uploaded from it
// (upload_paged_batch) that every kernel walking the batch's blocks takes: the split paged
// attention (paged_attention_split.cu) and the attention sparsity (paged_reads.cu).
#pragma once

#include <cstdint>

#include "kvsift/backend/cuda/paged_table.hpp"

namespace kvsift::cuda::detail {

struct PagedBatchRefs {
  const std::uint8_t* storage;        // the format pools
  const std::int64_t* frame_offsets;  // [num_blocks] byte offset of each frame in storage
  const std::uint64_t* masks;         // [num_blocks, kv_heads, mask_words] free bit = 1
  const float* global_factors;        // [kv_heads] NVFP4 global factors
  const std::int32_t* frames;         // [total_blocks] the batch's page tables
  const std::int32_t* meta;           // [total_blocks] format | thought type << 4
  const std::int32_t* block_begin;    // [batch + 1] first block of each sequence
  const std::int32_t* seq_ids;        // [batch] sequence ids (their staging rows)
  PagedLayouts layouts;
  int kv_heads, block_size, mask_words;
};

inline PagedBatchRefs paged_batch_refs(const DevicePagedTable& table, const PagedBatch& batch) {
  const PagedTableMemory& m = table.memory();
  const ThoughtBlockTableConfig& tc = table.config();
  PagedBatchRefs r;
  r.storage = m.storage;
  r.frame_offsets = m.frame_offsets;
  r.masks = m.free_masks;
  r.global_factors = m.global_factors;
  r.frames = batch.frames;
  r.meta = batch.meta;
  r.block_begin = batch.block_begin;
  r.seq_ids = batch.seq_ids;
  r.layouts = paged_layouts(tc);
  r.kv_heads = tc.kv_heads;
  r.block_size = tc.block_size;
  r.mask_words = table.sizes().mask_words;
  return r;
}

}  // namespace kvsift::cuda::detail
