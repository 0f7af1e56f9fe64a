// kvsift::cuda device mirror of ThinKV's Continuous Thinking table (docs/algorithms.md §3.4;
// docs/thinkv.md §8): the block storage (one pool per block format), the per-(block, KV head)
// eviction masks and slot positions, and the 16-bit staging buffers of not yet quantized tokens
// (keys AND values) live in device memory; slot allocation and segment metadata stay on the host.
//
// Division of labour (our choice, the simple one): the CPU ThoughtBlockTable of the layer decides
// where every token goes (its append() returns one SlotAddress per KV head: {kStagedBlock,
// position} for a staged token, the slot of the last token of a just completed 16-token group, or
// the slot of an f32 token). DevicePagedTable::record_append replays the same decision on its own
// host bookkeeping (staged positions per (sequence, type, head), eviction masks, page tables,
// per-format pools) and checks that it agrees with the CPU table's; append() then writes the
// batch on the device: staged rows at 16 bits, and every group the CPU sealed quantized on the
// device from the staged rows with the CPU's own codec (quantize_group, host/device), with fresh
// scales, into the same slots. The device bytes of every block equal
// ThoughtBlockTable::block_storage() bit for bit.
//
// Eviction (TBE §3.3) is evict(): mask bits (or a staged row dropped); a block whose slots are all
// free in every head goes back to its pool and leaves the page table, exactly as on the CPU.
//
// Pools: one per block format, its frames sized by block_bytes.hpp (a ternary block takes ternary
// bytes, rounded up to 256). CPU frame id f (the page table's entry) maps to a device byte offset
// frame_offsets[f] into `storage`; masks and positions are indexed by f.
//
// Plan/Run as everywhere in kvsift::cuda: *_workspace_bytes() says how much device scratch a call
// needs, the call validates on the host, copies its small plan into the workspace and only
// enqueues work on `stream` (no allocation, no synchronisation).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cuda/pinned_upload.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/paged/thought_block_table.hpp"

namespace kvsift::cuda {

inline constexpr int kPagedThoughtTypes = 3;

// Element type of the device staging rows (16-bit keys and values of tokens whose 16-token group
// has not arrived yet, docs/algorithms.md §3.4). The one switch for the staging dtype: it must
// match ThoughtBlockTableConfig::staging (bf16 by default; DevicePagedTable checks), and the
// kernels read it through to_float() and write it through from_float<PagedStaging>().
using PagedStaging = bf16_t;
inline constexpr DType kPagedStagingDType = dtype_of<PagedStaging>::value;

// Frames per format pool (indexed by BlockFormat). -1: the CPU pool's num_blocks for every format
// the config uses, 0 for the others. A pool smaller than num_blocks saves device memory when the
// caller knows how its blocks split by format; taking a block beyond it raises kvsift::Error.
struct PagedPoolFrames {
  std::int32_t frames[4] = {-1, -1, -1, -1};
};

// Device buffer sizes of one layer's mirror.
struct PagedTableSizes {
  std::int32_t mask_words = 1;           // uint64 words per (block, head) mask
  std::int32_t pool_frames[4] = {};      // frames per format pool
  std::int64_t frame_bytes[4] = {};      // bytes per frame of each format: block_bytes(...).codes
                                         // + .scales, rounded up to 256
  std::int64_t pool_offset[4] = {};      // byte offset of each pool in storage
  std::int64_t storage_bytes = 0;        // Σ pool_frames · frame_bytes
  std::int64_t mask_bytes = 0;           // num_blocks · kv_heads · mask_words · 8
  std::int64_t position_bytes = 0;       // num_blocks · kv_heads · block_size · 3
  std::int64_t frame_offset_bytes = 0;   // num_blocks · 8
  std::int64_t staging_bytes = 0;        // per buffer (keys, values): max_sequences · 3 ·
                                         // kv_heads · 16 · head_dim · 2
  std::int64_t staged_mask_bytes = 0;    // max_sequences · 3 · kv_heads · 4
  std::int64_t global_factor_bytes = 0;  // kv_heads · 4
};

// Validates cfg, max_sequences (> 0) and pools, and returns the buffer sizes.
PagedTableSizes paged_table_sizes(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences,
                                  const PagedPoolFrames& pools = {});

// Caller-allocated device memory of one layer's mirror (sizes from paged_table_sizes). storage
// must be 16-byte aligned (cudaMalloc gives 256).
struct PagedTableMemory {
  std::uint8_t* storage = nullptr;        // [storage_bytes] the format pools
  std::uint64_t* free_masks = nullptr;    // [num_blocks, kv_heads, mask_words] bit set = slot free
  std::uint8_t* positions = nullptr;      // [num_blocks, kv_heads, block_size, 3] generation
                                          // position (slot_positions.hpp)
  std::int64_t* frame_offsets = nullptr;  // [num_blocks] byte offset of CPU frame f in storage
  PagedStaging* staged_keys = nullptr;    // [max_sequences, 3 types, kv_heads, 16, head_dim]
  PagedStaging* staged_values = nullptr;  // [max_sequences, 3 types, kv_heads, 16, head_dim]
  std::uint32_t* staged_masks = nullptr;  // [max_sequences, 3 types, kv_heads] bit r: row r holds
                                          // a staged token (rows are unordered; see append())
  float* global_factors = nullptr;        // [kv_heads] NVFP4 g per KV head (filled by initialize)
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
struct PagedFreshFrame {  // a frame the CPU table has just taken
  std::int32_t frame, format;
  std::int64_t offset;  // its byte offset in storage
};
struct PagedRowWrite {  // one (token, KV head) of an f32 block: its key and value rows
  std::int32_t token, head, frame, slot, position, pad;
  std::int64_t base;  // byte offset of the (frame, head) in storage
};
struct PagedStreamOp {  // one token staged in one (sequence, type, head), then maybe a seal
  std::int32_t token, row;
  std::int32_t seal;  // >= 0: the 16 rows now form a group, quantized as seals[seal] says
};
struct PagedSeal {                         // where a completed group goes
  std::int32_t frame, first_slot, format;  // its first slot in the frame, the frame's format
  std::int32_t regroup;                    // 1: refill = regroup into a pinned run (survivors stay)
  std::int64_t base;                       // byte offset of the (frame, head) in storage
  std::int32_t order[16];      // per slot of the run: its staging row; -1 for a survivor
  std::int32_t positions[16];  // per slot: the staged row's position; -1 for a survivor
};
struct PagedStreamTask {  // every op of a batch on one (sequence, type, head), in order
  std::int64_t stream;    // (seq · 3 + type) · kv_heads + head
  std::int32_t head, first, count;
  std::uint32_t final_mask;  // the stream's staged rows after the batch
};
// The recorded batch as the append kernels take it (host arrays, reused from call to call).
struct PagedAppendPlan {
  std::vector<PagedFreshFrame> fresh;
  std::vector<PagedRowWrite> rows;
  std::vector<PagedStreamTask> tasks;  // one per stream with ops
  std::vector<PagedStreamOp> ops;      // each task's ops contiguous, in recording order
  std::vector<PagedSeal> seals;
};
struct PagedEviction {
  std::int32_t frame, head, slot;
};
struct PagedStagedMask {
  std::int64_t stream;
  std::uint32_t mask;
};
}  // namespace detail

// Where the key of one live token of one KV head lives on the device (for the reads of
// paged_reads.hpp): a slot of a block, or a row of the 16-bit staging buffer.
inline constexpr std::int32_t kStagedKeySource = -1;
struct PagedKeySource {
  std::int64_t base = 0;  // block slot: byte offset of its (frame, head) in storage;
                          // staged row: element offset of the row in staged_keys
  std::int32_t format = kStagedKeySource;  // the block's BlockFormat, or kStagedKeySource
  std::int32_t slot = 0;                   // slot in the block (block slots only)
  std::int32_t head = 0;                   // KV head (its NVFP4 global factor)
  std::int32_t pad = 0;
};

class DevicePagedTable {
 public:
  // Host bookkeeping for a table built with `cfg` (the CPU ThoughtBlockTable's config) serving
  // sequence ids [0, max_sequences). Checks that every pointer of `memory` is non-null and that
  // cfg.staging is PagedStaging's dtype. Both refill rules: with regroup, a group completing in a
  // head with no free run is regrouped into the CPU table's pinned run (docs/thinkv.md §6).
  DevicePagedTable(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences,
                   const PagedTableMemory& memory, const PagedPoolFrames& pools = {});

  const ThoughtBlockTableConfig& config() const { return cfg_; }
  const PagedTableSizes& sizes() const { return sizes_; }
  const PagedTableMemory& memory() const { return mem_; }
  std::int32_t max_sequences() const { return max_sequences_; }

  // Enqueues: every mask all-free, positions -1, staged rows and masks zero, NVFP4 global
  // factors uploaded. Call once before the first append.
  void initialize(cudaStream_t stream);

  // --- append: record on the host, then write on the device -----------------------------------
  // Records the token `table` has just appended to `seq` (`where`, [kv_heads], as filled by
  // ThoughtBlockTable::append). Tokens are numbered in recording order: token i of the next
  // append() batch reads row i of its key/value tensors. The mirror replays the CPU table's
  // decision (stage, or seal a group into the lowest free 16-slot run, or take a new block) and
  // raises kvsift::Error naming the head when `where` disagrees; nothing is recorded on error.
  void record_append(const ThoughtBlockTable& table, std::int32_t seq,
                     const SlotAddress* where);  // [kv_heads]
  // Tokens recorded (or prepared) and not yet written by append().
  std::int32_t pending_tokens() const { return pending_tokens_ + prepared_tokens_; }
  // Device scratch bytes append() needs for the recorded (or prepared) batch.
  std::size_t append_workspace_bytes() const;
  // Writes the recorded batch and clears it. key, value: device [pending_tokens, kv_heads,
  // head_dim] in `dtype` (f32 or bf16). f32 blocks take their rows at once; quantized types stage
  // key and value at 16 bits, and a completed group is quantized (fresh scales) into its slots.
  void append(const void* key, const void* value, DType dtype, void* workspace,
              std::size_t workspace_bytes, cudaStream_t stream);
  // The host half of append(): the recorded batch in the kernels' order, and the recording
  // cleared (pending_tokens() becomes 0; the plan stays valid until the next call). append() is
  // this, the upload and the launches; bench_device_table_host times it without a GPU.
  const detail::PagedAppendPlan& take_append_plan();
  // append()'s host half done ahead: take_append_plan() packed into this table's pinned upload
  // buffer, so that append() enqueues one asynchronous copy and the launches. For another host
  // thread while the stream runs earlier work (DeviceThinKV's placers): nothing else may touch the
  // table until append(). Waits for the last append's copy out of the buffer (in a decode loop,
  // done a step ago); needs a CUDA device. Nothing more can be recorded until append(); no-op
  // with nothing recorded.
  void prepare_append();

  // --- eviction ---------------------------------------------------------------------------------
  std::size_t evict_workspace_bytes(std::size_t count) const;
  // Evicts these tokens of `seq` in KV head `head`: block slots get their eviction bit, staged
  // tokens ({kStagedBlock, position}) leave the staging buffer; then every block left with no live
  // slot in any head returns to its pool and later blocks move down by one (the mirror of
  // ThoughtBlockTable::evict_positions; a caller of ThoughtBlockTable::evict calls this once per
  // token). Every address must be live. Requires no pending append.
  void evict(std::int32_t seq, std::int32_t head, const std::vector<SlotAddress>& slots,
             void* workspace, std::size_t workspace_bytes, cudaStream_t stream);
  // Evicts many tokens of any sequences and KV heads with one upload and one launch (a TBE step's
  // demotions of one layer): the mirror of ThoughtBlockTable::evict_slots. Addresses are those of
  // before the call; every one is checked (live, listed once) before anything changes.
  // evict_workspace_bytes(slots.size()) of workspace.
  void evict_slots(const std::vector<EvictionSlot>& slots, void* workspace,
                   std::size_t workspace_bytes, cudaStream_t stream);
  // evict_slots in its two halves, for a caller that applies many tables' host halves on other
  // threads and enqueues their device halves from one: apply_evictions checks `slots` as
  // evict_slots does and applies them to the host bookkeeping (blocks left empty return to their
  // pools; on an error nothing has changed), returning what the device still has to set;
  // enqueue_evictions sets it on `stream`, in as many launches as the workspace needs (at least
  // evict_workspace_bytes(1)). Nothing may touch the table between the two.
  struct DeviceEvictions {
    std::vector<detail::PagedEviction> slots;     // (frame, head, slot) bits to set
    std::vector<detail::PagedStagedMask> staged;  // staged masks to write
  };
  DeviceEvictions apply_evictions(const std::vector<EvictionSlot>& slots);
  void enqueue_evictions(const DeviceEvictions& evictions, void* workspace,
                         std::size_t workspace_bytes, cudaStream_t stream);

  // Returns the sequence's blocks to their pools and clears its staged rows (enqueued on
  // `stream`): the mirror of ThoughtBlockTable::release_sequence. Requires no pending append.
  void release_sequence(std::int32_t seq, cudaStream_t stream = nullptr);

  // --- inspection -------------------------------------------------------------------------------
  std::int32_t num_blocks(std::int32_t seq) const;
  std::int32_t frame_of(std::int32_t seq, std::int32_t block) const;
  BlockFormat format_of_block(std::int32_t seq, std::int32_t block) const;
  ThoughtType type_of_block(std::int32_t seq, std::int32_t block) const;
  // Byte offset of (block, head 0) of `seq` in storage.
  std::int64_t block_offset(std::int32_t seq, std::int32_t block) const;
  std::int64_t head_bytes(BlockFormat format) const {
    return BlockHeadLayout{format, cfg_.block_size, cfg_.head_dim}.bytes();
  }
  // Where the key of the live token at `address` of (seq, head) lives (an address as the CPU
  // table gives it: a block slot, or {kStagedBlock, position}). Requires no pending append.
  PagedKeySource key_source(std::int32_t seq, std::int32_t head, SlotAddress address) const;
  // Tokens staged in (seq, type, head) on the device after the last append()/evict().
  int staged_count(std::int32_t seq, ThoughtType type, std::int32_t head) const;
  // Frames of each format's pool in use.
  std::int32_t used_frames(BlockFormat format) const;
  // Changes whenever the page table of any sequence gains or loses a block (record_append took
  // one, evict or release_sequence freed one): page tables uploaded at one version
  // (upload_paged_batch) stay valid while it holds.
  std::uint64_t page_version() const { return page_version_; }
  // The mirror's resident bytes, by the same accounting as ThoughtBlockTable::resident_bytes()
  // (block_bytes.hpp): its own blocks (block_bytes of each block's format), eviction masks and
  // positions, staging and global factors, plus the host-side metadata that stays with `table`
  // (which sequences are active, their segments; the page table sized by the mirror's own).
  // Equal to table.resident_bytes() when the mirror has followed table's history.
  TableBytes resident_bytes(const ThoughtBlockTable& table) const;

 private:
  struct BlockRef {
    std::int32_t frame = 0;
    BlockFormat format = BlockFormat::f32;
    ThoughtType type = ThoughtType::reasoning;
  };
  struct SeqState {
    std::vector<BlockRef> pages;  // page table, as the CPU's
  };
  void check_seq(std::int32_t seq, const char* fn) const;
  std::int64_t stream_index(std::int32_t seq, int type, std::int32_t head) const {
    return (static_cast<std::int64_t>(seq) * kPagedThoughtTypes + type) * cfg_.kv_heads + head;
  }
  std::uint64_t* host_mask(std::int32_t frame, std::int32_t head) {
    return &masks_[(static_cast<std::size_t>(frame) * cfg_.kv_heads + head) * sizes_.mask_words];
  }
  const std::uint64_t* host_mask(std::int32_t frame, std::int32_t head) const {
    return &masks_[(static_cast<std::size_t>(frame) * cfg_.kv_heads + head) * sizes_.mask_words];
  }
  std::uint32_t staged_mask(std::int64_t stream) const;
  // refill = regroup: the pinned run among the first `blocks` blocks of `st` that the CPU table
  // regroups when a group of `type` completes in `head` ({} when none, or when a fully free run
  // exists); free_slots receives its f.
  SlotAddress regroup_target(const SeqState& st, std::int32_t blocks, ThoughtType type,
                             std::int32_t head, int& free_slots) const;
  void release_frame(std::int32_t frame, BlockFormat format);
  void release_empty_blocks(std::int32_t seq);

  ThoughtBlockTableConfig cfg_;
  std::int32_t max_sequences_;
  PagedTableSizes sizes_;
  PagedTableMemory mem_;
  std::vector<SeqState> seqs_;                  // [max_sequences]
  std::vector<std::uint64_t> masks_;            // [num_blocks, kv_heads, mask_words] host copy
  std::vector<std::int64_t> offsets_;           // [num_blocks] device byte offset, -1 unused
  std::vector<std::int32_t> pool_free_[4];      // free pool indices, lowest on top (back)
  std::vector<std::int32_t> staged_positions_;  // [max_sequences · 3 · kv_heads, 16], -1 free
  std::vector<std::uint32_t> staged_bits_;      // [max_sequences · 3 · kv_heads] rows in use
  std::uint64_t page_version_ = 0;
  // The recorded batch.
  std::int32_t pending_tokens_ = 0;
  std::vector<detail::PagedFreshFrame> fresh_;
  std::vector<detail::PagedRowWrite> rows_;
  std::vector<detail::PagedStreamOp> ops_;    // in recording order
  std::vector<std::int32_t> op_task_;         // [ops_] its stream's task (index in task_streams_)
  std::vector<detail::PagedSeal> seals_;      // the groups completed by ops_
  std::vector<std::int64_t> task_streams_;    // the streams with ops, in order of first op
  std::vector<std::int32_t> task_of_stream_;  // [max_sequences · 3 · kv_heads] task, -1 none
  detail::PagedAppendPlan plan_;              // take_append_plan()'s result
  std::vector<std::int32_t> next_op_;         // [tasks] take_append_plan()'s counting sort
  // The prepared batch: plan_ packed into pinned host memory, uploaded by append() in one copy.
  std::int32_t prepared_tokens_ = 0;  // > 0: plan_ is packed in upload_, no recording allowed
  std::size_t prepared_bytes_ = 0;    // its size (append_workspace_bytes())
  PinnedUpload upload_;
};

// Decode attention of one query token over a sequence of the device table (§3.4): per query head
// (GQA: KV head q / (q_heads / kv_heads)), over all blocks, evicted and never-written slots
// skipped through the mask, each block dequantized by its own format, and the staged tokens'
// 16-bit keys and values read in fp32 (exact). A KV head with no live token gives zero outputs
// (as the CPU reference).
//   query  device [q_heads, head_dim] f32; out device [q_heads, head_dim] f32
// head_dim must be <= 256 here. Requires no pending append on `table`.
// Runs the split-sequence tensor-core kernel (paged_decode_attention_batch) when it applies
// (GQA group <= 8, head_dim 64/128/256, no f32 or FP8 block), the tiled kernel otherwise.
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
// while no sequence of the batch gains or loses a block (appends into existing blocks, eviction
// bits and staging are read live), so an engine uploads again only after an append took a block
// or an eviction freed one (num_blocks changed), not once per step.
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
// The host fields of the PagedBatch that upload_paged_batch would return (batch, max_blocks,
// total_blocks, has_f32_blocks, host_seq_ids; no device pointers): enough to size the workspace of
// paged_decode_attention_batch before uploading.
PagedBatch describe_paged_batch(const DevicePagedTable& table, const std::int32_t* seqs,  // [batch]
                                std::int32_t batch);
// Copies the page tables of `seqs` into `workspace` (enqueued on `stream`; the host side may be
// freed at return). Requires no pending append.
PagedBatch upload_paged_batch(const DevicePagedTable& table, const std::int32_t* seqs,  // [batch]
                              std::int32_t batch, void* workspace, std::size_t workspace_bytes,
                              cudaStream_t stream);
// upload_paged_batch's host half, for a caller that walks the page tables ahead (on another
// thread, into pinned memory) and copies later: fills `image` with the bytes that belong at the
// start of `workspace` and returns the view with the device pointers they will have there. The
// blocks of recorded (not yet written) tokens are included: copy the image after their append().
PagedBatch paged_batch_image(const DevicePagedTable& table, const std::int32_t* seqs,  // [batch]
                             std::int32_t batch, void* workspace, std::size_t workspace_bytes,
                             std::vector<std::uint8_t>& image);

// Whether paged_decode_attention_batch runs the split kernel for this shape (otherwise it runs
// the tiled kernel once per sequence).
bool paged_split_kernel_applies(const DevicePagedTable& table, const PagedBatch& batch,
                                std::int64_t q_heads);

// Flash-decoding over the paged table: the grid is (splits, KV heads, batch) with 4 warps per
// CTA; every warp walks its own run of 32-slot tiles (interleaved with its CTA's other warps),
// decodes each tile's NVFP4 / ternary codes straight from global memory into the fp16 operand
// fragments of its tensor-core MMAs (no dequantized copy anywhere, not even in shared memory),
// computes the logits of all query heads of the GQA group at once (the KV head's tile is read
// once for the whole group), folds them into its online softmax and writes one partial (max,
// sum, acc); a second kernel merges the partials. The staged tokens (16-bit K and V) never enter
// the MMAs (bf16 is not exact in the fp16 path): one more kernel computes their partial in fp32 on
// CUDA cores.
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
