// kvsift::cuda device mirror of ThinKV's Continuous Thinking table (docs/algorithms.md §3.4;
// docs/continuous_thinking.md): the block storage, the per-(block, KV head) eviction masks, the
// sealed-key-group bits and the full-precision key staging buffers live in device memory; slot
// allocation and segment metadata stay on the host.
//
// Division of labour (our choice, the simple one): the CPU ThoughtBlockTable of the layer decides
// where every token goes (its append() returns one SlotAddress per KV head). DevicePagedTable
// records those addresses (record_append), tracks on the host which 16-slot key groups have been
// written once (so it knows, exactly as the CPU table does, whether a key is staged, seals its
// group, or is written under a sealed group's scales) and the sequence's page table, and then
// append() writes a whole batch of tokens' K/V into the device pool in three launches. The device
// bytes of every block are those of ThoughtBlockTable::block_storage(), bit for bit.
//
// Eviction on the device (TBE §3.3) is evict(): it sets mask bits and writes nothing else.
//
// Pool layout: frame f occupies bytes [f · frame_stride, (f + 1) · frame_stride) of `storage`;
// its first kv_heads · BlockHeadLayout(format).bytes() bytes are block_codec.hpp's layout, the
// rest is zero padding (frame_stride fits the largest configured format, 256-aligned). One pool
// for all formats wastes the difference for T2 blocks; a pool per format would not (future work).
//
// Plan/Run as everywhere in kvsift::cuda: *_workspace_bytes() says how much device scratch a call
// needs, the call validates on the host, copies its small plan into the workspace and only
// enqueues work on `stream` (no allocation, no synchronisation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/paged/thought_block_table.hpp"

namespace kvsift::cuda {

inline constexpr int kPagedThoughtTypes = 3;

// Element type of the device staging rows (full-precision keys of 16-slot key groups not yet
// quantized). The one switch for the staging dtype: the attention kernels read it through
// to_float(), so making it bf16_t (16-bit staging, docs/algorithms.md §3.4) touches only the
// append kernel's writes.
using PagedStaging = float;

// Device buffer sizes of one layer's mirror.
struct PagedTableSizes {
  std::int32_t mask_words = 1;           // uint64 words per (block, head) mask
  std::int64_t frame_stride = 0;         // bytes per pool frame
  std::int64_t storage_bytes = 0;        // num_blocks · frame_stride
  std::int64_t mask_bytes = 0;           // num_blocks · kv_heads · mask_words · 8
  std::int64_t sealed_bytes = 0;         // num_blocks · kv_heads · 4
  std::int64_t staging_bytes = 0;        // max_sequences · 3 · kv_heads · 16 · head_dim · 4
  std::int64_t global_factor_bytes = 0;  // kv_heads · 4
};

// Validates cfg and max_sequences (> 0) and returns the buffer sizes.
PagedTableSizes paged_table_sizes(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences);

// Caller-allocated device memory of one layer's mirror (sizes from paged_table_sizes). storage
// must be 16-byte aligned (cudaMalloc gives 256).
struct PagedTableMemory {
  std::uint8_t* storage = nullptr;      // [num_blocks, frame_stride] bytes
  std::uint64_t* free_masks = nullptr;  // [num_blocks, kv_heads, mask_words] bit set = slot free
  std::uint32_t* sealed = nullptr;      // [num_blocks, kv_heads] bit g = key slot group g quantized
  PagedStaging* staging_keys = nullptr;  // [max_sequences, 3 types, kv_heads, 16, head_dim]
  float* global_factors = nullptr;       // [kv_heads] NVFP4 g per KV head (filled by initialize)
};

// Settings of the split-KV (flash-decoding) attention launch.
struct DecodeAttentionConfig {
  // CTAs to aim for across (KV heads × splits): 4 per SM of an H200 (132 SMs; a CTA of 128
  // threads uses ~38 KB of shared memory at head_dim 128, GQA group 4, so 4-5 fit per SM). The
  // 32-slot tiles of a sequence are cut into ceil(tiles · kv_heads / target_ctas) tiles per split.
  std::int32_t target_ctas = 528;
  // Split-sequence kernels only: each warp walks at least this many 32-slot tiles. 1 lets short
  // sequences spread over as many warps as target_ctas allows (they are latency-bound); long ones
  // get ceil(tiles / (4 · target_ctas)) per warp anyway. Raise it to trade parallelism for fewer
  // partials (G · head_dim floats per warp, written once and read back by the merge).
  std::int32_t min_tiles_per_warp = 1;

  void validate() const {
    KVSIFT_CHECK(target_ctas >= 1, "DecodeAttentionConfig: target_ctas must be >= 1, got ",
                 target_ctas);
    KVSIFT_CHECK(min_tiles_per_warp >= 1,
                 "DecodeAttentionConfig: min_tiles_per_warp must be >= 1, got ",
                 min_tiles_per_warp);
  }
};

namespace detail {
// Byte offsets of one (block, KV head) of one format (block_codec.hpp's BlockHeadLayout, flattened
// for kernels). f32 blocks: keys at 0, values at value_codes.
struct PagedHeadLayout {
  std::int64_t head_bytes = 0, key_scales = 0, value_codes = 0, value_scales = 0;
  std::int32_t code_bytes = 0;
};
struct PagedLayouts {
  PagedHeadLayout by_format[4];  // indexed by BlockFormat
};
inline PagedLayouts paged_layouts(const ThoughtBlockTableConfig& cfg) {
  PagedLayouts out;
  for (int f = 0; f < 4; ++f) {
    const BlockHeadLayout L{static_cast<BlockFormat>(f), cfg.block_size, cfg.head_dim};
    PagedHeadLayout& o = out.by_format[f];
    o.head_bytes = L.bytes();
    if (is_quantized(L.format)) {
      o.key_scales = L.key_scales_offset();
      o.value_codes = L.value_codes_offset();
      o.value_scales = L.value_scales_offset();
      o.code_bytes = static_cast<std::int32_t>(L.code_bytes());
    } else {
      o.value_codes = L.f32_values_offset();
    }
  }
  return out;
}

// The append plan, as copied to the device.
struct PagedRowWrite {  // one (token, KV head): its value row, and its key row in f32 blocks
  std::int32_t token, head, frame, slot, format;
};
struct PagedKeyTask {  // every write of a batch into one (frame, head, key slot group)
  std::int32_t frame, head, group, format, seal;
  std::int32_t first, count;  // its entries, contiguous after append() sorts them
  std::int64_t staging;       // float offset of the (seq, type, head) staging rows; -1: sealed
};
struct PagedKeyEntry {  // one key write of a task: token row, slot within the 16-slot group
  std::int32_t task, token, row;
};
struct PagedEviction {
  std::int32_t frame, head, slot;
};
}  // namespace detail

class DevicePagedTable {
 public:
  // Host bookkeeping for a table built with `cfg` (the CPU ThoughtBlockTable's config) serving
  // sequence ids [0, max_sequences). Checks that every pointer of `memory` is non-null.
  DevicePagedTable(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences,
                   const PagedTableMemory& memory);

  const ThoughtBlockTableConfig& config() const { return cfg_; }
  const PagedTableSizes& sizes() const { return sizes_; }
  const PagedTableMemory& memory() const { return mem_; }
  std::int32_t max_sequences() const { return max_sequences_; }

  // Enqueues: every mask all-free, sealed bits and staging keys zero, NVFP4 global factors
  // uploaded. Call once before the first append.
  void initialize(cudaStream_t stream);

  // --- append: record on the host, then write on the device -----------------------------------
  // Records the token `table` has just appended to `seq` (`where`, [kv_heads], as filled by
  // ThoughtBlockTable::append). Tokens are numbered in recording order: token i of the next
  // append() batch reads row i of its key/value tensors. A slot may be written only once per
  // batch (evicting and refilling it needs an append() in between); nothing is recorded on error.
  void record_append(const ThoughtBlockTable& table, std::int32_t seq,
                     const SlotAddress* where);  // [kv_heads]
  std::int32_t pending_tokens() const { return pending_tokens_; }
  // Device scratch bytes append() needs for the recorded batch.
  std::size_t append_workspace_bytes() const;
  // Writes the recorded batch and clears it. key, value: device [pending_tokens, kv_heads,
  // head_dim] in `dtype` (f32 or bf16). Values are quantized per token at once; keys of quantized
  // blocks go to the staging buffer until their 16-slot group is complete, which is then
  // quantized per channel; keys written into an already sealed group take its scales.
  void append(const void* key, const void* value, DType dtype, void* workspace,
              std::size_t workspace_bytes, cudaStream_t stream);

  // --- eviction: mask bits only -----------------------------------------------------------------
  std::size_t evict_workspace_bytes(std::size_t count) const;
  // Sets the eviction bits of these slots of `seq` in KV head `head` (mirror of
  // ThoughtBlockTable::evict; liveness is the CPU table's to check). Requires no pending append.
  void evict(std::int32_t seq, std::int32_t head, const std::vector<SlotAddress>& slots,
             void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

  // Forgets the sequence's page table (mirror of ThoughtBlockTable::release_sequence); its frames
  // are re-initialised on the device when the CPU table hands them out again.
  void release_sequence(std::int32_t seq);

  // --- inspection -------------------------------------------------------------------------------
  std::int32_t num_blocks(std::int32_t seq) const;
  std::int32_t frame_of(std::int32_t seq, std::int32_t block) const;
  BlockFormat format_of_block(std::int32_t seq, std::int32_t block) const;
  ThoughtType type_of_block(std::int32_t seq, std::int32_t block) const;
  std::int64_t head_bytes(BlockFormat format) const {
    return BlockHeadLayout{format, cfg_.block_size, cfg_.head_dim}.bytes();
  }

 private:
  struct BlockRef {
    std::int32_t frame = 0;
    BlockFormat format = BlockFormat::f32;
    ThoughtType type = ThoughtType::reasoning;
  };
  void check_seq(std::int32_t seq, const char* fn) const;
  std::int32_t groups_per_block() const { return cfg_.block_size / 16; }

  ThoughtBlockTableConfig cfg_;
  std::int32_t max_sequences_;
  PagedTableSizes sizes_;
  PagedTableMemory mem_;
  std::vector<std::vector<BlockRef>> pages_;  // [max_sequences][blocks]
  std::vector<std::uint16_t> written_;        // [num_blocks, kv_heads, groups] slots written once
  // The recorded batch.
  std::int32_t pending_tokens_ = 0;
  std::vector<std::int32_t> fresh_frames_;  // frames taken by this batch: initialise first
  std::vector<std::int32_t> fresh_formats_;
  std::vector<detail::PagedRowWrite> rows_;
  std::vector<detail::PagedKeyTask> tasks_;
  std::vector<detail::PagedKeyEntry> entries_;
  std::map<std::int64_t, std::int32_t> task_index_;  // (frame, head, group) -> task
  std::set<std::int64_t> batch_slots_;               // (frame, head, slot) written in this batch
};

// Decode attention of one query token over a sequence of the device table (§3.4): per query head
// (GQA: KV head q / (q_heads / kv_heads)), over all blocks, evicted and never-written slots
// skipped through the mask, each block dequantized by its own format, staged key rows read from
// the staging buffer. A KV head with no live slot gives zero outputs (as the CPU reference).
//   query  device [q_heads, head_dim] f32; out device [q_heads, head_dim] f32
// head_dim must be <= 256 here. Requires no pending append on `table`.
// Runs the split-sequence tensor-core kernel (paged_decode_attention_batch) when it applies
// (GQA group <= 8, head_dim 16/32/64/128/256, no f32 block), the tiled kernel otherwise.
std::size_t paged_decode_attention_workspace_bytes(const DevicePagedTable& table, std::int32_t seq,
                                                   std::int64_t q_heads,
                                                   const DecodeAttentionConfig& cfg = {});
void paged_decode_attention(const DevicePagedTable& table, std::int32_t seq, const float* query,
                            std::int64_t q_heads, std::int64_t head_dim, float softmax_scale,
                            float* out, void* workspace, std::size_t workspace_bytes,
                            cudaStream_t stream, const DecodeAttentionConfig& cfg = {});

// The first kernel (kept as the fallback and as the benchmark's "old" column): CTA (KV head,
// split) dequantizes 32-slot tiles into shared memory in fp32 and runs the online softmax with
// block-wide barriers per tile. Same contract as paged_decode_attention.
std::size_t paged_decode_attention_tiled_workspace_bytes(const DevicePagedTable& table,
                                                         std::int32_t seq, std::int64_t q_heads,
                                                         const DecodeAttentionConfig& cfg = {});
void paged_decode_attention_tiled(const DevicePagedTable& table, std::int32_t seq,
                                  const float* query, std::int64_t q_heads, std::int64_t head_dim,
                                  float softmax_scale, float* out, void* workspace,
                                  std::size_t workspace_bytes, cudaStream_t stream,
                                  const DecodeAttentionConfig& cfg = {});

// --- batched split-sequence decode attention ---------------------------------------------------
// The page tables of a batch of sequences in device memory (upload_paged_batch). They stay valid
// while no sequence of the batch gains or loses a block (appends into existing blocks, evictions
// and staging are read live), so an engine uploads once per new block, not once per step.
struct PagedBatch {
  const std::int32_t* frames = nullptr;       // [total_blocks] pool frame, sequence after sequence
  const std::int32_t* meta = nullptr;         // [total_blocks] format | thought type << 4
  const std::int32_t* block_begin = nullptr;  // [batch + 1] first block of each sequence
  const std::int32_t* seq_ids = nullptr;      // [batch] sequence id (its staging rows)
  std::int32_t batch = 0;
  std::int32_t max_blocks = 0;             // longest sequence, in blocks
  std::int64_t total_blocks = 0;           // Σ blocks
  bool has_f32_blocks = false;             // blocks the split kernel does not take (f32, FP8)
  std::vector<std::int32_t> host_seq_ids;  // for the per-sequence fallback
};
std::size_t paged_batch_bytes(const DevicePagedTable& table, const std::int32_t* seqs,  // [batch]
                              std::int32_t batch);
// Copies the page tables of `seqs` into `workspace` (enqueued on `stream`; the host side may be
// freed at return). Requires no pending append.
PagedBatch upload_paged_batch(const DevicePagedTable& table, const std::int32_t* seqs,  // [batch]
                              std::int32_t batch, void* workspace, std::size_t workspace_bytes,
                              cudaStream_t stream);

// Whether paged_decode_attention_batch runs the split kernel for this shape (otherwise it runs
// the tiled kernel once per sequence).
bool paged_split_kernel_applies(const DevicePagedTable& table, const PagedBatch& batch,
                                std::int64_t q_heads);

// Flash-decoding over the paged table: the grid is (splits, KV heads, batch) with 4 warps per
// CTA; every warp walks its own run of 32-slot tiles (interleaved with its CTA's other warps),
// dequantizes each tile's codes into fp16/bf16 in registers and then its own shared-memory tile
// (no dequantized copy in global memory), computes the logits of all query heads of the GQA
// group at once with tensor-core MMAs (the KV head's tile is read once for the whole group),
// folds them into its online softmax and writes one partial (max, sum, acc); a second kernel
// merges the partials. Staged key rows are read in fp32 from the staging buffer.
//   query  device [batch, q_heads, head_dim] f32; out device [batch, q_heads, head_dim] f32
std::size_t paged_decode_attention_batch_workspace_bytes(const DevicePagedTable& table,
                                                         const PagedBatch& batch,
                                                         std::int64_t q_heads,
                                                         const DecodeAttentionConfig& cfg = {});
void paged_decode_attention_batch(const DevicePagedTable& table, const PagedBatch& batch,
                                  const float* query, std::int64_t q_heads, std::int64_t head_dim,
                                  float softmax_scale, float* out, void* workspace,
                                  std::size_t workspace_bytes, cudaStream_t stream,
                                  const DecodeAttentionConfig& cfg = {});

// The same kernel over a dense bf16 cache (the baseline the CT table is measured against):
//   keys, values device [kv_heads, tokens, head_dim] bf16; query [q_heads, head_dim] f32;
//   out [q_heads, head_dim] f32. tokens may be 0 (zero outputs).
std::size_t dense_decode_attention_workspace_bytes(std::int64_t kv_heads, std::int64_t tokens,
                                                   std::int64_t q_heads, std::int64_t head_dim,
                                                   const DecodeAttentionConfig& cfg = {});
void dense_decode_attention_bf16(const bf16_t* keys, const bf16_t* values, std::int64_t kv_heads,
                                 std::int64_t tokens, const float* query, std::int64_t q_heads,
                                 std::int64_t head_dim, float softmax_scale, float* out,
                                 void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                                 const DecodeAttentionConfig& cfg = {});

// The split-sequence tensor-core design over dense bf16 caches of equal length: the baseline the
// paged kernel is benchmarked against (a fair one: split along the sequence, the GQA group served
// by one read of each K/V tile, cp.async copies, tensor-core MMAs; it only skips the paging and
// the dequantization). GQA group <= 8, head_dim 16/32/64/128/256.
//   keys, values device [batch, kv_heads, tokens, head_dim] bf16, 16-byte aligned
//   query device [batch, q_heads, head_dim] f32; out device [batch, q_heads, head_dim] f32
std::size_t dense_split_decode_attention_workspace_bytes(std::int64_t batch, std::int64_t kv_heads,
                                                         std::int64_t tokens, std::int64_t q_heads,
                                                         std::int64_t head_dim,
                                                         const DecodeAttentionConfig& cfg = {});
void dense_split_decode_attention_bf16(const bf16_t* keys, const bf16_t* values, std::int64_t batch,
                                       std::int64_t kv_heads, std::int64_t tokens,
                                       const float* query, std::int64_t q_heads,
                                       std::int64_t head_dim, float softmax_scale, float* out,
                                       void* workspace, std::size_t workspace_bytes,
                                       cudaStream_t stream, const DecodeAttentionConfig& cfg = {});

}  // namespace kvsift::cuda
