// ThoughtBlockTable: ThinKV's Continuous Thinking (CT) gather-free paged KV cache for one layer
// (docs/algorithms.md §3.4; docs/continuous_thinking.md explains every choice marked "our choice").
//  - A block holds tokens of one thought type, so it has one precision (TBQ §3.2: R4 E4 T2 by
//    default, or full precision f32).
//  - Per block the table keeps: thought type, per (KV head, slot) the token's generation position
//    and segment id (from which the segment bitmasks follow), and per KV head an eviction bitmask
//    (1 = evicted or never written = free). Per sequence it keeps its segments' start positions.
//  - Eviction (TBE §3.3) only sets bits. A new token is written, per KV head, into the lowest free
//    slot of the sequence's blocks of its type (lowest block first, then lowest slot); only when
//    some head has no free slot is a new block taken from the pool. Nothing is gathered or moved.
//  - Eviction is per (layer, KV head), so slots are allocated per KV head (our choice): one token
//    can sit in different slots, even different blocks, in different heads.
// One table serves one layer (an engine keeps one per layer); sequences share its block pool.
#pragma once

#include <cstdint>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/paged/block_codec.hpp"
#include "kvsift/config/thought_type.hpp"

namespace kvsift {

struct ThoughtBlockTableConfig {
  std::int32_t kv_heads = 8;
  std::int32_t head_dim = 128;     // a multiple of 16 (value groups are 16 channels)
  std::int32_t block_size = 32;    // slots per block: a multiple of 16 in [16, 256], so every KIVI
                                   // key group (16 tokens of one channel) lies inside one block
  std::int32_t num_blocks = 1024;  // capacity of the block pool
  // TBQ precision per thought type (§3.2 default R4 E4 T2).
  BlockFormat reasoning = BlockFormat::nvfp4;
  BlockFormat execution = BlockFormat::nvfp4;
  BlockFormat transition = BlockFormat::ternary;
  // NVFP4's per-(layer, KV head) global factor g: empty = 1 for every head, else [kv_heads].
  std::vector<float> global_factors;

  BlockFormat format_of(ThoughtType t) const {
    return t == ThoughtType::reasoning   ? reasoning
           : t == ThoughtType::execution ? execution
                                         : transition;
  }
  float global_factor(std::int32_t head) const {
    return global_factors.empty() ? 1.0f : global_factors[static_cast<std::size_t>(head)];
  }
  void validate() const;
};

// Where one token lives in one KV head: `block` indexes the sequence's block list (its page
// table), `slot` the slot inside that block.
struct SlotAddress {
  std::int32_t block = -1;
  std::int32_t slot = -1;
};

// A token resident (not evicted) in one KV head.
struct ResidentToken {
  SlotAddress address;
  std::int32_t position = 0;  // generation-space index
  std::int32_t segment = 0;
};

struct BlockInfo {
  std::int32_t frame = 0;  // the block's index in the pool
  ThoughtType type = ThoughtType::reasoning;
  BlockFormat format = BlockFormat::f32;
};

// Resident bytes of the table (for memory reports). `codes` are element codes (raw floats in f32
// blocks), `scales` the group scales, `metadata` the block table (types, masks, positions,
// segment ids, page tables, segment starts, NVFP4 global factors), `staging` the full-precision
// key buffers of not yet quantized 16-slot groups.
struct TableBytes {
  std::int64_t codes = 0;
  std::int64_t scales = 0;
  std::int64_t metadata = 0;
  std::int64_t staging = 0;
  std::int64_t total() const { return codes + scales + metadata + staging; }
};

class ThoughtBlockTable {
 public:
  explicit ThoughtBlockTable(ThoughtBlockTableConfig config);

  const ThoughtBlockTableConfig& config() const { return config_; }
  std::int32_t mask_words() const { return mask_words_; }  // uint64 words per (block, head) mask

  // --- sequences -----------------------------------------------------------------------------
  // Returns the lowest unused sequence id.
  std::int32_t create_sequence();
  // Returns the sequence's blocks to the pool; the id becomes unused.
  void release_sequence(std::int32_t seq);
  bool has_sequence(std::int32_t seq) const;

  // --- segments (TBE §3.3: one per refresh interval, with its thought type) ------------------
  // Opens a new segment starting at the next position; later appends take its type. Returns its id.
  std::int32_t open_segment(std::int32_t seq, ThoughtType type);
  std::int32_t num_segments(std::int32_t seq) const;
  ThoughtType segment_type(std::int32_t seq, std::int32_t segment) const;
  std::int32_t segment_start(std::int32_t seq, std::int32_t segment) const;
  std::int32_t length(std::int32_t seq) const;  // positions appended so far

  // --- tokens --------------------------------------------------------------------------------
  // Appends one token to the open segment; returns its generation position. `where`, when given,
  // receives the slot chosen in each KV head. Either the whole token is written or (on error)
  // nothing is.
  std::int32_t append(std::int32_t seq,
                      const float* key,    // [kv_heads, head_dim] post-RoPE
                      const float* value,  // [kv_heads, head_dim]
                      std::int64_t kv_heads, std::int64_t head_dim,
                      SlotAddress* where = nullptr);  // [kv_heads] or null
  // Soft eviction: sets the slot's eviction bit; no data moves. The slot must be live.
  void evict(std::int32_t seq, std::int32_t head, SlotAddress address);
  // Evicts the tokens at these generation positions in one KV head (e.g. TBE's
  // segment_eviction_marks). All are checked before any bit is set.
  void evict_positions(std::int32_t seq, std::int32_t head,
                       const std::vector<std::int32_t>& positions);

  // --- inspection ----------------------------------------------------------------------------
  std::int32_t num_blocks(std::int32_t seq) const;
  BlockInfo block_info(std::int32_t seq, std::int32_t block) const;
  // Eviction bitmask of (block, head): bit s of word s/64 set = slot s is free. [mask_words()]
  const std::uint64_t* free_mask(std::int32_t seq, std::int32_t block, std::int32_t head) const;
  bool is_live(std::int32_t seq, std::int32_t head, SlotAddress address) const;
  // Segment bitmask of (block, head): live slots holding tokens of `segment`. [mask_words()]
  std::vector<std::uint64_t> segment_mask(std::int32_t seq, std::int32_t block, std::int32_t head,
                                          std::int32_t segment) const;
  // Live tokens of one KV head in (block, slot) order; `segment` >= 0 keeps only that segment's.
  std::vector<ResidentToken> resident_tokens(std::int32_t seq, std::int32_t head,
                                             std::int32_t segment = -1) const;
  std::int64_t live_tokens(std::int32_t seq, std::int32_t head) const;
  // What TBE's per-(layer, KV head) token choice needs (segment_evictor.hpp's
  // segment_eviction_marks): the dequantized keys and positions of a segment's live tokens in one
  // head, in (block, slot) order. keys: resized to [n, head_dim]; positions: resized to [n].
  void segment_keys(std::int32_t seq, std::int32_t head, std::int32_t segment,
                    std::vector<float>& keys, std::vector<std::int32_t>& positions) const;
  // The dequantized key and value of a live slot. key, value: [head_dim]
  void read_token(std::int32_t seq, std::int32_t head, SlotAddress address, float* key,
                  float* value) const;
  // The dequantized keys and values of every slot of (block, head), free slots included (their
  // contents are whatever was last written there). keys, values: [block_size, head_dim]
  void dequantize_block(std::int32_t seq, std::int32_t block, std::int32_t head, float* keys,
                        float* values) const;
  // The raw storage of a block (all heads, codes and scales): for tests that check nothing moves.
  const std::vector<std::uint8_t>& block_storage(std::int32_t seq, std::int32_t block) const;

  // --- pool and memory -----------------------------------------------------------------------
  std::int32_t free_blocks() const { return static_cast<std::int32_t>(free_frames_.size()); }
  std::int32_t used_blocks() const { return config_.num_blocks - free_blocks(); }
  TableBytes resident_bytes() const;

 private:
  struct Frame {
    ThoughtType type = ThoughtType::reasoning;
    BlockFormat format = BlockFormat::f32;
    std::int32_t owner = -1;             // sequence, -1 when in the pool
    std::vector<std::uint8_t> data;      // [kv_heads, head bytes] (block_codec.hpp layout)
    std::vector<std::uint64_t> free;     // [kv_heads, mask_words] 1 = free (evicted/unwritten)
    std::vector<std::uint32_t> sealed;   // [kv_heads] bit g = key slot group g is quantized
    std::vector<std::int32_t> position;  // [kv_heads, block_size]
    std::vector<std::int32_t> segment;   // [kv_heads, block_size]
  };
  // Keys of the one not-yet-quantized 16-slot group of each (thought type, KV head): slots are
  // filled lowest first, so unwritten slots are always a suffix of a head's blocks of one type
  // and at most one key group per (type, head) is partly written (docs/continuous_thinking.md).
  struct Staging {
    std::int32_t block = -1;    // sequence block index of the group being filled
    std::int32_t group = -1;    // its slot group
    std::uint32_t written = 0;  // bit i = slot 16·group + i written at least once
  };
  struct Sequence {
    bool active = false;
    std::vector<std::int32_t> blocks;          // page table: frame ids in allocation order
    std::vector<std::int32_t> segment_starts;  // [segments] generation position of each start
    std::vector<ThoughtType> segment_types;    // [segments]
    std::int32_t length = 0;
    std::vector<Staging> staging;     // [3 types, kv_heads]
    std::vector<float> staging_keys;  // [3 types, kv_heads, 16, head_dim]
  };

  BlockHeadLayout layout(BlockFormat format) const {
    return BlockHeadLayout{format, config_.block_size, config_.head_dim};
  }
  const Sequence& sequence(std::int32_t seq, const char* fn) const;
  Sequence& sequence(std::int32_t seq, const char* fn);
  const Frame& frame(const Sequence& s, std::int32_t seq, std::int32_t block, const char* fn) const;
  void check_head(std::int32_t head, const char* fn) const;
  void check_address(const Sequence& s, std::int32_t seq, SlotAddress a, const char* fn) const;
  std::int32_t take_frame(std::int32_t seq, ThoughtType type);
  SlotAddress lowest_free_slot(const Sequence& s, ThoughtType type, std::int32_t head) const;
  void write_slot(Sequence& s, std::int32_t head, SlotAddress a, const float* key,
                  const float* value);
  std::size_t staging_index(ThoughtType type, std::int32_t head) const {
    return static_cast<std::size_t>(static_cast<int>(type) * config_.kv_heads + head);
  }

  ThoughtBlockTableConfig config_;
  std::int32_t mask_words_ = 1;
  std::vector<Frame> frames_;              // [num_blocks]
  std::vector<std::int32_t> free_frames_;  // pool, popped from the back (lowest id on top)
  std::vector<Sequence> sequences_;
};

}  // namespace kvsift
