// ThoughtBlockTable: ThinKV's Continuous Thinking (CT) gather-free paged KV cache for one layer
// (docs/algorithms.md §3.4; docs/thinkv.md §6 explains every choice marked "our choice").
//  - A block holds tokens of one thought type, so it has one precision (TBQ §3.2: R4 E4 T2 by
//    default, or full precision f32).
//  - Per block the table keeps its thought type and format, and per KV head an eviction bitmask
//    (1 = evicted or never written = free) and the generation position of each slot; a slot's
//    segment follows from its position and the sequence's segment starts (segment_mask()).
//  - Refill with fresh scales (§3.4): a token of a quantized type first waits, at 16 bits, in the
//    sequence's StagedGroupQuantizer (one buffer per thought type and KV head). When 16 tokens of
//    one type have arrived in a head, they are quantized together with their own scales and written
//    into the lowest group-aligned run of 16 free slots of that head in the sequence's blocks of
//    that type (lowest block first); only when no such run exists is a new block taken. No token is
//    ever encoded under another group's scale. f32 blocks take each token at once, in the lowest
//    free slot.
//  - Refill rule `regroup` (opt-in experiment, our choice, docs/thinkv.md §6 "Experiment: regroup
//    in place"): when a group completes and no fully free run exists, the pinned run (a
//    group-aligned run holding f >= regroup_min_free free slots and 16 - f live survivors) with the
//    most free slots (lowest block, then lowest run, on ties) takes the f oldest staged tokens into
//    its free slots, and the whole 16-slot group is re-quantized with fresh scales over the
//    survivors' dequantized values and the new tokens. Survivors keep slot, position and segment;
//    their codes change. The other staged tokens wait for the next group. The default rule `run`
//    never does this and is bit-identical to the table without the option.
//  - Eviction (TBE §3.3) only sets bits (or drops a token still staged). A block whose slots are
//    all free in every KV head goes back to the pool and its storage is released.
//  - Eviction is per (layer, KV head), so slots are allocated per KV head (our choice): one token
//    can sit in different slots, even different blocks, in different heads.
//  - Bytes: paged/block_bytes.hpp, the one accounting shared with the CUDA table.
// One table serves one layer (an engine keeps one per layer); sequences share its block pool.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "kvsift/config/thought_type.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/paged/block_bytes.hpp"
#include "kvsift/paged/block_codec.hpp"
#include "kvsift/paged/refill_rule.hpp"
#include "kvsift/paged/staged_group_quantizer.hpp"

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
  // Dtype of the staging buffer of not yet quantized tokens (§3.4: 16-bit, the cache's own dtype;
  // bf16 by default, see staged_group_quantizer.hpp).
  DType staging = DType::bf16;
  // Refill of quantized blocks (refill_rule.hpp): run (default) or the regroup experiment, which
  // re-quantizes a pinned run only when it has at least regroup_min_free free slots (in [1, 15]),
  // bounding how often survivors are re-rounded.
  RefillRule refill = RefillRule::run;
  std::int32_t regroup_min_free = 8;
  // false: a metadata-only table — it places every token, keeps masks, positions, segments and
  // the pool exactly as with data, but stores no K/V byte (appends take null keys and values;
  // the reads of data refuse). A device table mirrors it and holds the data (cuda::DeviceThinKV).
  // Either refill rule (a regroup then moves positions only; the device re-quantizes).
  bool holds_data = true;

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
// table), `slot` the slot inside that block. A token still waiting in the staging buffer has
// block == kStagedBlock and slot == its generation position. Block indices are those of the moment:
// a block returned to the pool leaves the list, and later blocks move down by one.
inline constexpr std::int32_t kStagedBlock = -2;
struct SlotAddress {
  std::int32_t block = -1;
  std::int32_t slot = -1;
};

// One token of a batched eviction (evict_slots): KV head `head` of sequence `seq` at `address`.
struct EvictionSlot {
  std::int32_t seq = 0;
  std::int32_t head = 0;
  SlotAddress address;
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
// blocks), `scales` the group scales, `metadata` the block table (block headers, eviction masks,
// slot positions, page tables, segment starts, NVFP4 global factors), `staging` the 16-bit
// buffers of not yet quantized tokens. Blocks and staging come from block_bytes.hpp.
struct TableBytes {
  std::int64_t codes = 0;
  std::int64_t scales = 0;
  std::int64_t metadata = 0;
  std::int64_t staging = 0;
  std::int64_t total() const { return codes + scales + metadata + staging; }
  TableBytes& operator+=(const TableBytes& o) {
    codes += o.codes;
    scales += o.scales;
    metadata += o.metadata;
    staging += o.staging;
    return *this;
  }
};

// How the table has refilled quantized blocks so far (all sequences, all heads).
struct RefillStats {
  std::int64_t runs = 0;                   // groups written into a fully free run (or new block)
  std::int64_t regroups = 0;               // pinned runs re-quantized (refill = regroup only)
  std::int64_t survivors_requantized = 0;  // survivors re-rounded by those regroups
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
  // receives the token's address in each KV head ({kStagedBlock, position} while it is staged;
  // the token that completes a group receives its slot). Either the whole token is taken or (on
  // error) nothing changes.
  std::int32_t append(std::int32_t seq,
                      const float* key,    // [kv_heads, head_dim] post-RoPE
                      const float* value,  // [kv_heads, head_dim]
                      std::int64_t kv_heads, std::int64_t head_dim,
                      SlotAddress* where = nullptr);  // [kv_heads] or null
  // Soft eviction: sets the slot's eviction bit (or drops a staged token); no data moves. The slot
  // must be live. A block left with no live slot in any head returns to the pool.
  void evict(std::int32_t seq, std::int32_t head, SlotAddress address);
  // Evicts the tokens at these generation positions in one KV head (e.g. TBE's
  // segment_eviction_marks). All are checked before any bit is set.
  void evict_positions(std::int32_t seq, std::int32_t head,
                       const std::vector<std::int32_t>& positions);
  // Evicts many tokens of any sequences and KV heads at once (a TBE step's demotions of one
  // layer): every address is checked (live, listed once) before any bit is set, then the bits,
  // then each sequence's blocks left empty return to the pool. Addresses are those of before the
  // call: no block moves until every bit is set. The result equals evicting the tokens one by one
  // with addresses taken at each moment.
  void evict_slots(const std::vector<EvictionSlot>& slots);

  // --- inspection ----------------------------------------------------------------------------
  std::int32_t num_blocks(std::int32_t seq) const;
  BlockInfo block_info(std::int32_t seq, std::int32_t block) const;
  // Eviction bitmask of (block, head): bit s of word s/64 set = slot s is free. [mask_words()]
  const std::uint64_t* free_mask(std::int32_t seq, std::int32_t block, std::int32_t head) const;
  bool is_live(std::int32_t seq, std::int32_t head, SlotAddress address) const;
  // Segment bitmask of (block, head): live slots holding tokens of `segment`. [mask_words()]
  std::vector<std::uint64_t> segment_mask(std::int32_t seq, std::int32_t block, std::int32_t head,
                                          std::int32_t segment) const;
  // Live tokens of one KV head in (block, slot) order, then the staged ones (R, E, T buffers, each
  // in position order); `segment` >= 0 keeps only that segment's.
  std::vector<ResidentToken> resident_tokens(std::int32_t seq, std::int32_t head,
                                             std::int32_t segment = -1) const;
  // The live tokens of one KV head with positions in [first, last], in resident_tokens() order;
  // blocks that never held such a position are skipped unread (a demotion's segments are a
  // small part of a long sequence).
  std::vector<ResidentToken> resident_tokens_between(std::int32_t seq, std::int32_t head,
                                                     std::int32_t first, std::int32_t last) const;
  // The same into `out` (cleared first): a caller scanning many heads keeps one buffer.
  void resident_tokens_between(std::int32_t seq, std::int32_t head, std::int32_t first,
                               std::int32_t last, std::vector<ResidentToken>& out) const;
  // The generation positions of resident_tokens(seq, head), ascending (what an engine asks
  // which tokens one KV head still attends to).
  std::vector<std::int32_t> resident_positions(std::int32_t seq, std::int32_t head) const;
  std::int64_t live_tokens(std::int32_t seq, std::int32_t head) const;
  // What TBE's per-(layer, KV head) token choice needs (segment_evictor.hpp's
  // segment_eviction_marks): the dequantized keys and positions of a segment's live tokens in one
  // head, in (block, slot) order. keys: resized to [n, head_dim]; positions: resized to [n].
  void segment_keys(std::int32_t seq, std::int32_t head, std::int32_t segment,
                    std::vector<float>& keys, std::vector<std::int32_t>& positions) const;
  // The dequantized key and value of a live slot. key, value: [head_dim]
  void read_token(std::int32_t seq, std::int32_t head, SlotAddress address, float* key,
                  float* value) const;
  // The staged tokens of one KV head as stored (16-bit, decoded), in resident_tokens() order.
  // keys, values: resized to [n, head_dim].
  void staged_rows(std::int32_t seq, std::int32_t head, std::vector<float>& keys,
                   std::vector<float>& values) const;
  // The dequantized keys and values of every slot of (block, head), free slots included (their
  // contents are whatever was last written there). keys, values: [block_size, head_dim]
  void dequantize_block(std::int32_t seq, std::int32_t block, std::int32_t head, float* keys,
                        float* values) const;
  // The raw storage of a block (all heads, codes and scales): for tests that check nothing moves.
  const std::vector<std::uint8_t>& block_storage(std::int32_t seq, std::int32_t block) const;

  // --- pool and memory -----------------------------------------------------------------------
  std::int32_t free_blocks() const { return static_cast<std::int32_t>(free_frames_.size()); }
  std::int32_t used_blocks() const { return config_.num_blocks - free_blocks(); }
  // From block_bytes.hpp: blocks in use per format × block_bytes, staging, page tables.
  TableBytes resident_bytes() const;
  // What the table's buffers actually hold right now (sizes of its block and staging storage), for
  // checking resident_bytes() against the allocations.
  TableBytes allocated_bytes() const;
  const RefillStats& refill_stats() const { return refill_stats_; }

 private:
  struct Frame {
    ThoughtType type = ThoughtType::reasoning;
    BlockFormat format = BlockFormat::f32;
    std::int32_t owner = -1;             // sequence, -1 when in the pool
    std::vector<std::uint8_t> data;      // [kv_heads, head bytes] (block_codec.hpp layout)
    std::vector<std::uint64_t> free;     // [kv_heads, mask_words] 1 = free (evicted/unwritten)
    std::vector<std::uint8_t> position;  // [kv_heads, block_size, kSlotPositionBytes]
    // The lowest and highest position ever written into the block (any head): a host index that
    // lets a scan for some positions skip the blocks that cannot hold them.
    std::int32_t first_position = 0, last_position = -1;
  };
  struct Sequence {
    bool active = false;
    std::vector<std::int32_t> blocks;          // page table: frame ids in allocation order
    std::vector<std::int32_t> segment_starts;  // [segments] generation position of each start
    std::vector<ThoughtType> segment_types;    // [segments]
    std::int32_t length = 0;
    std::optional<StagedGroupQuantizer> staging;  // when some thought type is quantized
  };

  BlockHeadLayout layout(BlockFormat format) const {
    return BlockHeadLayout{format, config_.block_size, config_.head_dim};
  }
  const Sequence& sequence(std::int32_t seq, const char* fn) const;
  Sequence& sequence(std::int32_t seq, const char* fn);
  const Frame& frame(const Sequence& s, std::int32_t seq, std::int32_t block, const char* fn) const;
  void check_head(std::int32_t head, const char* fn) const;
  void check_holds_data(const char* fn) const;
  void check_address(const Sequence& s, std::int32_t seq, SlotAddress a, const char* fn) const;
  std::int32_t take_frame(std::int32_t seq, ThoughtType type);
  SlotAddress lowest_free_slot(const Sequence& s, ThoughtType type, std::int32_t head) const;
  SlotAddress lowest_free_run(const Sequence& s, ThoughtType type, std::int32_t head) const;
  // refill = regroup: the run with the most free slots among those with f in
  // [regroup_min_free, 15], lowest block then run on ties; {} if none. free_slots receives f.
  SlotAddress best_pinned_run(const Sequence& s, ThoughtType type, std::int32_t head,
                              int& free_slots) const;
  // Writes the f oldest staged tokens of (type, head) into the free slots of the pinned run at
  // `a` and re-quantizes the whole group with fresh scales (survivors' dequantized rows and the
  // new tokens, in slot order).
  void regroup_run(Sequence& s, ThoughtType type, std::int32_t head, SlotAddress a, int free_slots);
  std::int32_t segment_of(const Sequence& s, std::int32_t position) const;
  // The staged token at `position` in `head`: its type and index, or false.
  bool find_staged(const Sequence& s, std::int32_t head, std::int32_t position, ThoughtType& type,
                   int& index) const;
  void evict_one(Sequence& s, std::int32_t seq, std::int32_t head, SlotAddress a);
  void release_empty_blocks(Sequence& s);
  static void note_position(Frame& f, std::int32_t position);
  void scan_tokens(const Sequence& s, std::int32_t head, std::int32_t segment, std::int32_t first,
                   std::int32_t last, std::vector<ResidentToken>& out) const;

  ThoughtBlockTableConfig config_;
  std::int32_t mask_words_ = 1;
  std::vector<Frame> frames_;              // [num_blocks]
  std::vector<std::int32_t> free_frames_;  // pool, popped from the back (lowest id on top)
  std::vector<Sequence> sequences_;
  RefillStats refill_stats_;
  // append()'s per-head choices, [kv_heads] each: reused, so a token costs no allocation.
  std::vector<SlotAddress> append_chosen_;
  std::vector<bool> append_writes_;
  std::vector<int> append_regroup_free_;
};

}  // namespace kvsift
