// ThoughtBlockTable (docs/algorithms.md §3.4): allocation, soft eviction, refill of evicted slots
// with freshly quantized groups, and blocks returned to the pool. See
// include/kvsift/paged/thought_block_table.hpp and docs/thinkv.md §6.
#include "kvsift/paged/thought_block_table.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "kvsift/core/limits.hpp"

namespace kvsift {

namespace {
constexpr int kThoughtTypes = 3;

int lowest_set_bit(std::uint64_t m) {
  int i = 0;
  while (!((m >> i) & 1u)) ++i;
  return i;
}

bool bit(const std::uint64_t* mask, std::int32_t slot) {
  return (mask[slot / 64] >> (slot % 64)) & 1u;
}

// Whether slots [first, first + 16) are all free (a group never straddles a 64-bit word).
bool run_free(const std::uint64_t* mask, std::int32_t first) {
  return ((mask[first / 64] >> (first % 64)) & 0xffffu) == 0xffffu;
}

template <class T>
void release_vector(std::vector<T>& v) {
  std::vector<T>().swap(v);  // really gives the memory back
}
}  // namespace

void ThoughtBlockTableConfig::validate() const {
  KVSIFT_CHECK(kv_heads > 0, "ThoughtBlockTableConfig: kv_heads must be > 0, got ", kv_heads);
  KVSIFT_CHECK(head_dim > 0 && head_dim % kQuantGroupSize == 0,
               "ThoughtBlockTableConfig: head_dim (", head_dim, ") must be a positive multiple of ",
               kQuantGroupSize);
  KVSIFT_CHECK(
      block_size >= kQuantGroupSize && block_size <= 256 && block_size % kQuantGroupSize == 0,
      "ThoughtBlockTableConfig: block_size (", block_size, ") must be a multiple of ",
      kQuantGroupSize, " in [", kQuantGroupSize,
      ", 256], so every 16-token key group lies inside one block");
  KVSIFT_CHECK(num_blocks > 0 && num_blocks <= kMaxPoolBlocks,
               "ThoughtBlockTableConfig: num_blocks must be in [1, kMaxPoolBlocks = ",
               kMaxPoolBlocks, "], got ", num_blocks);
  KVSIFT_CHECK(
      global_factors.empty() || static_cast<std::int64_t>(global_factors.size()) == kv_heads,
      "ThoughtBlockTableConfig: global_factors has ", global_factors.size(),
      " entries, expected 0 or kv_heads = ", kv_heads);
  for (std::size_t h = 0; h < global_factors.size(); ++h) {
    KVSIFT_CHECK(std::isfinite(global_factors[h]) && global_factors[h] > 0.0f,
                 "ThoughtBlockTableConfig: global_factors[", h, "] = ", global_factors[h],
                 " must be finite and > 0");
  }
  KVSIFT_CHECK(staging == DType::f16 || staging == DType::bf16,
               "ThoughtBlockTableConfig: staging must be f16 or bf16 (16-bit, §3.4), got ",
               dtype_name(staging));
  KVSIFT_CHECK(refill == RefillRule::run || refill == RefillRule::regroup,
               "ThoughtBlockTableConfig: unknown refill rule code ", static_cast<int>(refill));
  KVSIFT_CHECK(regroup_min_free >= 1 && regroup_min_free < kQuantGroupSize,
               "ThoughtBlockTableConfig: regroup_min_free must be in [1, ", kQuantGroupSize - 1,
               "], got ", regroup_min_free);
}

ThoughtBlockTable::ThoughtBlockTable(ThoughtBlockTableConfig config) : config_(std::move(config)) {
  config_.validate();
  mask_words_ = (config_.block_size + 63) / 64;
  frames_.resize(static_cast<std::size_t>(config_.num_blocks));
  // A stack with the lowest frame id on top: blocks are handed out in id order.
  for (std::int32_t f = config_.num_blocks - 1; f >= 0; --f) free_frames_.push_back(f);
}

// --- sequences -------------------------------------------------------------------------------

std::int32_t ThoughtBlockTable::create_sequence() {
  std::size_t id = 0;
  while (id < sequences_.size() && sequences_[id].active) ++id;
  if (id == sequences_.size()) sequences_.emplace_back();
  Sequence& s = sequences_[id];
  s = Sequence{};
  s.active = true;
  const bool any_quantized = is_quantized(config_.reasoning) || is_quantized(config_.execution) ||
                             is_quantized(config_.transition);
  if (any_quantized) {
    StagedGroupQuantizerConfig q;
    q.kv_heads = config_.kv_heads;
    q.head_dim = config_.head_dim;
    q.staging = config_.staging;
    q.reasoning = config_.reasoning;
    q.execution = config_.execution;
    q.transition = config_.transition;
    q.global_factors = config_.global_factors;
    q.holds_data = config_.holds_data;
    s.staging.emplace(std::move(q));
  }
  return static_cast<std::int32_t>(id);
}

void ThoughtBlockTable::release_sequence(std::int32_t seq) {
  Sequence& s = sequence(seq, "release_sequence");
  // Pushed in reverse so the lowest frame id of the sequence is handed out next.
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) {
    Frame& f = frames_[static_cast<std::size_t>(*it)];
    f.owner = -1;
    release_vector(f.data);
    release_vector(f.free);
    release_vector(f.position);
    free_frames_.push_back(*it);
  }
  s = Sequence{};
}

bool ThoughtBlockTable::has_sequence(std::int32_t seq) const {
  return seq >= 0 && static_cast<std::size_t>(seq) < sequences_.size() &&
         sequences_[static_cast<std::size_t>(seq)].active;
}

const ThoughtBlockTable::Sequence& ThoughtBlockTable::sequence(std::int32_t seq,
                                                               const char* fn) const {
  KVSIFT_CHECK(has_sequence(seq), "ThoughtBlockTable::", fn, ": unknown sequence ", seq, " (",
               std::count_if(sequences_.begin(), sequences_.end(),
                             [](const Sequence& s) { return s.active; }),
               " sequences are active)");
  return sequences_[static_cast<std::size_t>(seq)];
}

ThoughtBlockTable::Sequence& ThoughtBlockTable::sequence(std::int32_t seq, const char* fn) {
  return const_cast<Sequence&>(static_cast<const ThoughtBlockTable*>(this)->sequence(seq, fn));
}

void ThoughtBlockTable::check_holds_data(const char* fn) const {
  KVSIFT_CHECK(config_.holds_data, "ThoughtBlockTable::", fn,
               ": this table keeps metadata only (holds_data = false); its K/V are on the device");
}

void ThoughtBlockTable::check_head(std::int32_t head, const char* fn) const {
  KVSIFT_CHECK(head >= 0 && head < config_.kv_heads, "ThoughtBlockTable::", fn, ": kv head ", head,
               " outside [0, ", config_.kv_heads, ")");
}

const ThoughtBlockTable::Frame& ThoughtBlockTable::frame(const Sequence& s, std::int32_t seq,
                                                         std::int32_t block, const char* fn) const {
  KVSIFT_CHECK(block >= 0 && static_cast<std::size_t>(block) < s.blocks.size(),
               "ThoughtBlockTable::", fn, ": block ", block, " of sequence ", seq, " outside [0, ",
               s.blocks.size(), ")");
  return frames_[static_cast<std::size_t>(s.blocks[static_cast<std::size_t>(block)])];
}

void ThoughtBlockTable::check_address(const Sequence& s, std::int32_t seq, SlotAddress a,
                                      const char* fn) const {
  frame(s, seq, a.block, fn);
  KVSIFT_CHECK(a.slot >= 0 && a.slot < config_.block_size, "ThoughtBlockTable::", fn, ": slot ",
               a.slot, " of block ", a.block, " outside [0, block_size = ", config_.block_size,
               ")");
}

// --- segments --------------------------------------------------------------------------------

std::int32_t ThoughtBlockTable::open_segment(std::int32_t seq, ThoughtType type) {
  Sequence& s = sequence(seq, "open_segment");
  KVSIFT_CHECK(static_cast<int>(type) < kThoughtTypes,
               "ThoughtBlockTable::open_segment: unknown thought type code ",
               static_cast<int>(type));
  s.segment_starts.push_back(s.length);
  s.segment_types.push_back(type);
  return static_cast<std::int32_t>(s.segment_starts.size()) - 1;
}

std::int32_t ThoughtBlockTable::num_segments(std::int32_t seq) const {
  return static_cast<std::int32_t>(sequence(seq, "num_segments").segment_starts.size());
}

ThoughtType ThoughtBlockTable::segment_type(std::int32_t seq, std::int32_t segment) const {
  const Sequence& s = sequence(seq, "segment_type");
  KVSIFT_CHECK(segment >= 0 && static_cast<std::size_t>(segment) < s.segment_types.size(),
               "ThoughtBlockTable::segment_type: segment ", segment, " of sequence ", seq,
               " outside [0, ", s.segment_types.size(), ")");
  return s.segment_types[static_cast<std::size_t>(segment)];
}

std::int32_t ThoughtBlockTable::segment_start(std::int32_t seq, std::int32_t segment) const {
  const Sequence& s = sequence(seq, "segment_start");
  KVSIFT_CHECK(segment >= 0 && static_cast<std::size_t>(segment) < s.segment_starts.size(),
               "ThoughtBlockTable::segment_start: segment ", segment, " of sequence ", seq,
               " outside [0, ", s.segment_starts.size(), ")");
  return s.segment_starts[static_cast<std::size_t>(segment)];
}

std::int32_t ThoughtBlockTable::length(std::int32_t seq) const {
  return sequence(seq, "length").length;
}

// --- tokens ----------------------------------------------------------------------------------

std::int32_t ThoughtBlockTable::take_frame(std::int32_t seq, ThoughtType type) {
  KVSIFT_CHECK(!free_frames_.empty(), "ThoughtBlockTable::append: block pool exhausted: all ",
               config_.num_blocks, " blocks are in use (sequence ", seq, " needs a new ",
               thought_type_name(type), " block)");
  const std::int32_t id = free_frames_.back();
  free_frames_.pop_back();
  Frame& f = frames_[static_cast<std::size_t>(id)];
  const std::int64_t H = config_.kv_heads, S = config_.block_size;
  f.type = type;
  f.format = config_.format_of(type);
  f.owner = seq;
  if (config_.holds_data) f.data.assign(static_cast<std::size_t>(H * layout(f.format).bytes()), 0);
  // Every slot starts free: a never-written slot counts as evicted.
  std::vector<std::uint64_t> head_mask(static_cast<std::size_t>(mask_words_), 0);
  for (std::int32_t slot = 0; slot < S; ++slot)
    head_mask[slot / 64] |= std::uint64_t{1} << (slot % 64);
  f.free.clear();
  for (std::int64_t h = 0; h < H; ++h)
    f.free.insert(f.free.end(), head_mask.begin(), head_mask.end());
  f.position.assign(static_cast<std::size_t>(H * S * kSlotPositionBytes), 0xFF);  // all -1
  f.first_position = 0;
  f.last_position = -1;  // nothing written yet
  return id;
}

void ThoughtBlockTable::note_position(Frame& f, std::int32_t position) {
  if (f.last_position < f.first_position) {
    f.first_position = f.last_position = position;
  } else {
    f.first_position = std::min(f.first_position, position);
    f.last_position = std::max(f.last_position, position);
  }
}

SlotAddress ThoughtBlockTable::lowest_free_slot(const Sequence& s, ThoughtType type,
                                                std::int32_t head) const {
  for (std::size_t b = 0; b < s.blocks.size(); ++b) {
    const Frame& f = frames_[static_cast<std::size_t>(s.blocks[b])];
    if (f.type != type) continue;
    const std::uint64_t* mask = &f.free[static_cast<std::size_t>(head) * mask_words_];
    for (std::int32_t w = 0; w < mask_words_; ++w) {
      if (mask[w] != 0) {
        return SlotAddress{static_cast<std::int32_t>(b), w * 64 + lowest_set_bit(mask[w])};
      }
    }
  }
  return SlotAddress{};
}

SlotAddress ThoughtBlockTable::lowest_free_run(const Sequence& s, ThoughtType type,
                                               std::int32_t head) const {
  for (std::size_t b = 0; b < s.blocks.size(); ++b) {
    const Frame& f = frames_[static_cast<std::size_t>(s.blocks[b])];
    if (f.type != type) continue;
    const std::uint64_t* mask = &f.free[static_cast<std::size_t>(head) * mask_words_];
    for (std::int32_t first = 0; first < config_.block_size; first += kQuantGroupSize) {
      if (run_free(mask, first)) return SlotAddress{static_cast<std::int32_t>(b), first};
    }
  }
  return SlotAddress{};
}

SlotAddress ThoughtBlockTable::best_pinned_run(const Sequence& s, ThoughtType type,
                                               std::int32_t head, int& free_slots) const {
  SlotAddress best;
  free_slots = 0;
  for (std::size_t b = 0; b < s.blocks.size(); ++b) {
    const Frame& f = frames_[static_cast<std::size_t>(s.blocks[b])];
    if (f.type != type) continue;
    const std::uint64_t* mask = &f.free[static_cast<std::size_t>(head) * mask_words_];
    for (std::int32_t first = 0; first < config_.block_size; first += kQuantGroupSize) {
      const std::uint64_t run = (mask[first / 64] >> (first % 64)) & 0xffffu;
      int n = 0;
      for (int i = 0; i < kQuantGroupSize; ++i) n += (run >> i) & 1u;
      // Strictly more: the first (lowest block, lowest run) of the best ones wins.
      if (n < kQuantGroupSize && n >= config_.regroup_min_free && n > free_slots) {
        best = SlotAddress{static_cast<std::int32_t>(b), first};
        free_slots = n;
      }
    }
  }
  return best;
}

void ThoughtBlockTable::regroup_run(Sequence& s, ThoughtType type, std::int32_t head, SlotAddress a,
                                    int free_slots) {
  Frame& f = frames_[static_cast<std::size_t>(s.blocks[static_cast<std::size_t>(a.block)])];
  const BlockHeadLayout L = layout(f.format);
  const std::size_t D = static_cast<std::size_t>(config_.head_dim);
  const std::size_t S = static_cast<std::size_t>(config_.block_size);
  // Metadata only (holds_data = false): the same positions move into the same slots and no byte
  // is touched; the device table re-quantizes the group (cuda/paged_append.cu).
  const bool data = config_.holds_data;
  std::uint64_t* mask = &f.free[static_cast<std::size_t>(head) * mask_words_];
  std::uint8_t* slot_position =
      &f.position[static_cast<std::size_t>(head) * S * kSlotPositionBytes];
  std::vector<float> new_keys(data ? static_cast<std::size_t>(free_slots) * D : 0),
      new_values(new_keys.size());
  std::vector<std::int32_t> new_positions(static_cast<std::size_t>(free_slots));
  s.staging->take_oldest(type, head, free_slots, data ? new_keys.data() : nullptr,
                         data ? new_values.data() : nullptr, new_positions.data());
  if (data) {
    std::uint8_t* base = f.data.data() + head * L.bytes();
    const float g = config_.global_factor(head);
    // The survivors' current values: what attention reads today, so re-quantizing them is a
    // second rounding of the dequantized row, never a return to values the table no longer has.
    std::vector<float> block_keys(S * D), block_values(S * D);
    dequantize_block_head(L, base, g, block_keys.data(), block_values.data());
    // [16, D] rows in slot order: survivors where they are, new tokens (oldest first) in the free
    // slots in ascending order.
    std::vector<float> keys(kQuantGroupSize * D), values(keys.size());
    std::size_t next = 0;
    for (int i = 0; i < kQuantGroupSize; ++i) {
      const std::size_t slot = static_cast<std::size_t>(a.slot + i);
      const bool free = bit(mask, a.slot + i);
      const float* k = free ? &new_keys[next * D] : &block_keys[slot * D];
      const float* v = free ? &new_values[next * D] : &block_values[slot * D];
      next += free;
      std::copy_n(k, D, &keys[i * D]);
      std::copy_n(v, D, &values[i * D]);
    }
    QuantizedGroup group;
    quantize_token_group(f.format, keys.data(), values.data(), config_.head_dim, config_.head_dim,
                         g, group);
    write_token_group(L, base, a.slot / kQuantGroupSize, group.key_codes.data(),
                      group.key_scales.data(), group.value_codes.data(), group.value_scales.data());
  }
  std::size_t next = 0;
  for (std::int32_t slot = a.slot; slot < a.slot + kQuantGroupSize; ++slot) {
    if (!bit(mask, slot)) continue;
    note_position(f, new_positions[next]);
    store_slot_position(slot_position, slot, new_positions[next++]);
  }
  mask[a.slot / 64] &= ~(std::uint64_t{0xffff} << (a.slot % 64));
  ++refill_stats_.regroups;
  refill_stats_.survivors_requantized += kQuantGroupSize - free_slots;
}

std::int32_t ThoughtBlockTable::segment_of(const Sequence& s, std::int32_t position) const {
  const auto it = std::upper_bound(s.segment_starts.begin(), s.segment_starts.end(), position);
  return static_cast<std::int32_t>(it - s.segment_starts.begin()) - 1;
}

bool ThoughtBlockTable::find_staged(const Sequence& s, std::int32_t head, std::int32_t position,
                                    ThoughtType& type, int& index) const {
  if (!s.staging) return false;
  for (int t = 0; t < kThoughtTypes; ++t) {
    const int i = s.staging->find(static_cast<ThoughtType>(t), head, position);
    if (i >= 0) {
      type = static_cast<ThoughtType>(t);
      index = i;
      return true;
    }
  }
  return false;
}

std::int32_t ThoughtBlockTable::append(std::int32_t seq, const float* key, const float* value,
                                       std::int64_t kv_heads, std::int64_t head_dim,
                                       SlotAddress* where) {
  Sequence& s = sequence(seq, "append");
  KVSIFT_CHECK(kv_heads == config_.kv_heads && head_dim == config_.head_dim,
               "ThoughtBlockTable::append: token is [kv_heads=", kv_heads, ", head_dim=", head_dim,
               "], table expects [kv_heads=", config_.kv_heads, ", head_dim=", config_.head_dim,
               "]");
  const bool data = config_.holds_data;
  KVSIFT_CHECK(!data || (key != nullptr && value != nullptr),
               "ThoughtBlockTable::append: key and value must not be null");
  KVSIFT_CHECK(!s.segment_starts.empty(), "ThoughtBlockTable::append: sequence ", seq,
               " has no open segment (call open_segment first)");
  KVSIFT_CHECK(s.length <= kMaxSlotPosition, "ThoughtBlockTable::append: sequence ", seq,
               " already holds ", s.length, " positions, the most a 3-byte slot position stores (",
               kMaxSlotPosition + 1, ")");
  const std::int64_t n = data ? kv_heads * head_dim : 0;
  for (std::int64_t i = 0; i < n; ++i) {
    KVSIFT_CHECK(std::isfinite(key[i]) && std::isfinite(value[i]),
                 "ThoughtBlockTable::append: kv head ", i / head_dim, " channel ", i % head_dim,
                 " is not finite (key ", key[i], ", value ", value[i], ")");
  }
  const ThoughtType type = s.segment_types.back();
  const BlockFormat format = config_.format_of(type);
  const std::int32_t position = s.length;
  const std::int32_t segment = static_cast<std::int32_t>(s.segment_starts.size()) - 1;
  const std::size_t H = static_cast<std::size_t>(config_.kv_heads);
  // Where each head's write goes: f32 blocks take the token now, in the lowest free slot;
  // quantized ones stage it and, in heads where it completes a group, need a free 16-slot run.
  std::vector<SlotAddress>& chosen = append_chosen_;
  std::vector<bool>& writes = append_writes_;
  std::vector<int>& regroup_free = append_regroup_free_;  // > 0: regroups a pinned run
  chosen.assign(H, SlotAddress{});
  writes.assign(H, false);
  regroup_free.assign(H, 0);
  bool need_block = false;
  for (std::int32_t h = 0; h < config_.kv_heads; ++h) {
    const bool completes =
        !is_quantized(format) || s.staging->staged_count(type, h) == kQuantGroupSize - 1;
    if (!completes) continue;
    writes[static_cast<std::size_t>(h)] = true;
    chosen[static_cast<std::size_t>(h)] =
        is_quantized(format) ? lowest_free_run(s, type, h) : lowest_free_slot(s, type, h);
    if (is_quantized(format) && config_.refill == RefillRule::regroup &&
        chosen[static_cast<std::size_t>(h)].block < 0) {
      // No fully free run (which keeps every survivor untouched): the best pinned run, if any.
      chosen[static_cast<std::size_t>(h)] =
          best_pinned_run(s, type, h, regroup_free[static_cast<std::size_t>(h)]);
    }
    need_block = need_block || chosen[static_cast<std::size_t>(h)].block < 0;
  }
  if (need_block) {
    // Checked before anything changes; only heads without room use the new block, the others keep
    // filling their holes.
    s.blocks.push_back(take_frame(seq, type));
    const std::int32_t b = static_cast<std::int32_t>(s.blocks.size()) - 1;
    for (SlotAddress& a : chosen) {
      if (a.block < 0) a = SlotAddress{b, 0};
    }
  }
  QuantizedGroup group;
  for (std::int32_t h = 0; h < config_.kv_heads; ++h) {
    const float* k = data ? key + h * head_dim : nullptr;
    const float* v = data ? value + h * head_dim : nullptr;
    if (is_quantized(format)) {
      s.staging->stage(type, h, position, k, v);
      if (!writes[static_cast<std::size_t>(h)]) {
        if (where != nullptr) where[h] = SlotAddress{kStagedBlock, position};
        continue;
      }
      if (regroup_free[static_cast<std::size_t>(h)] > 0) {
        // The f oldest staged tokens go in; this token, the newest, stays staged (f <= 15).
        regroup_run(s, type, h, chosen[static_cast<std::size_t>(h)],
                    regroup_free[static_cast<std::size_t>(h)]);
        if (where != nullptr) where[h] = SlotAddress{kStagedBlock, position};
        continue;
      }
    }
    const SlotAddress a = chosen[static_cast<std::size_t>(h)];
    Frame& f = frames_[static_cast<std::size_t>(s.blocks[static_cast<std::size_t>(a.block)])];
    const BlockHeadLayout L = layout(f.format);
    std::uint8_t* base = data ? f.data.data() + h * L.bytes() : nullptr;
    std::uint64_t* mask = &f.free[static_cast<std::size_t>(h) * mask_words_];
    std::uint8_t* slot_position =
        &f.position[static_cast<std::size_t>(h) * config_.block_size * kSlotPositionBytes];
    if (!is_quantized(format)) {
      if (data) {
        write_value_row(L, base, a.slot, v, 1.0f);
        write_key_row_f32(L, base, a.slot, k);
      }
      store_slot_position(slot_position, a.slot, position);
      note_position(f, position);
      mask[a.slot / 64] &= ~(std::uint64_t{1} << (a.slot % 64));
      if (where != nullptr) where[h] = a;
      continue;
    }
    // A whole group of this type has arrived in this head: quantize it with its own scales and
    // write it into the run (§3.4 refill with fresh scales).
    s.staging->take_group(type, h, group);
    ++refill_stats_.runs;
    if (data) {
      write_token_group(L, base, a.slot / kQuantGroupSize, group.key_codes.data(),
                        group.key_scales.data(), group.value_codes.data(),
                        group.value_scales.data());
    }
    for (int i = 0; i < kQuantGroupSize; ++i) {
      store_slot_position(slot_position, a.slot + i, group.positions[i]);
      note_position(f, group.positions[i]);
    }
    mask[a.slot / 64] &= ~(std::uint64_t{0xffff} << (a.slot % 64));
    // The new token is the group's last (positions ascend).
    if (where != nullptr) where[h] = SlotAddress{a.block, a.slot + kQuantGroupSize - 1};
  }
  (void)segment;
  s.length = position + 1;
  return position;
}

void ThoughtBlockTable::evict_one(Sequence& s, std::int32_t seq, std::int32_t head, SlotAddress a) {
  if (a.block == kStagedBlock) {
    ThoughtType type{};
    int index = -1;
    KVSIFT_CHECK(find_staged(s, head, a.slot, type, index), "ThoughtBlockTable::evict: position ",
                 a.slot, " is not staged in kv head ", head, " of sequence ", seq);
    s.staging->evict(type, head, index);  // never quantized: it simply leaves the buffer
    return;
  }
  check_address(s, seq, a, "evict");
  Frame& f = frames_[static_cast<std::size_t>(s.blocks[static_cast<std::size_t>(a.block)])];
  std::uint64_t& word = f.free[static_cast<std::size_t>(head) * mask_words_ + a.slot / 64];
  const std::uint64_t b = std::uint64_t{1} << (a.slot % 64);
  KVSIFT_CHECK(!(word & b), "ThoughtBlockTable::evict: slot ", a.slot, " of block ", a.block,
               " in kv head ", head, " of sequence ", seq,
               " is not live (already evicted or never written)");
  word |= b;  // soft eviction: the bit is all that changes
}

void ThoughtBlockTable::release_empty_blocks(Sequence& s) {
  const std::size_t words = static_cast<std::size_t>(config_.kv_heads) * mask_words_;
  std::vector<std::uint64_t> all(static_cast<std::size_t>(mask_words_), 0);
  for (std::int32_t slot = 0; slot < config_.block_size; ++slot)
    all[static_cast<std::size_t>(slot / 64)] |= std::uint64_t{1} << (slot % 64);
  std::vector<std::int32_t> kept;
  kept.reserve(s.blocks.size());
  for (std::int32_t id : s.blocks) {
    Frame& f = frames_[static_cast<std::size_t>(id)];
    bool empty = true;
    for (std::size_t w = 0; w < words && empty; ++w) empty = f.free[w] == all[w % mask_words_];
    if (!empty) {
      kept.push_back(id);
      continue;
    }
    // Every slot of every head is free: the block goes back to the pool and its memory is
    // released (§3.4). The pool stays sorted with the lowest id on top.
    f.owner = -1;
    release_vector(f.data);
    release_vector(f.free);
    release_vector(f.position);
    free_frames_.insert(std::upper_bound(free_frames_.begin(), free_frames_.end(), id,
                                         [](std::int32_t x, std::int32_t y) { return x > y; }),
                        id);
  }
  s.blocks.swap(kept);
}

void ThoughtBlockTable::evict(std::int32_t seq, std::int32_t head, SlotAddress a) {
  Sequence& s = sequence(seq, "evict");
  check_head(head, "evict");
  evict_one(s, seq, head, a);
  release_empty_blocks(s);
}

void ThoughtBlockTable::evict_positions(std::int32_t seq, std::int32_t head,
                                        const std::vector<std::int32_t>& positions) {
  Sequence& s = sequence(seq, "evict_positions");
  check_head(head, "evict_positions");
  std::vector<ResidentToken> live = resident_tokens(seq, head);
  std::sort(live.begin(), live.end(),
            [](const ResidentToken& x, const ResidentToken& y) { return x.position < y.position; });
  std::vector<SlotAddress> targets;
  targets.reserve(positions.size());
  std::vector<std::int32_t> sorted = positions;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    KVSIFT_CHECK(i == 0 || sorted[i] != sorted[i - 1],
                 "ThoughtBlockTable::evict_positions: ", "position ", sorted[i],
                 " is listed twice (kv head ", head, ", sequence ", seq, ")");
    const auto it =
        std::lower_bound(live.begin(), live.end(), sorted[i],
                         [](const ResidentToken& t, std::int32_t p) { return t.position < p; });
    KVSIFT_CHECK(it != live.end() && it->position == sorted[i],
                 "ThoughtBlockTable::evict_positions: position ", sorted[i],
                 " is not resident in kv head ", head, " of sequence ", seq, " (length ",
                 length(seq), ")");
    targets.push_back(it->address);
  }
  // Bits first, blocks after: releasing a block renumbers the later ones.
  for (const SlotAddress& a : targets) evict_one(s, seq, head, a);
  release_empty_blocks(s);
}

void ThoughtBlockTable::evict_slots(const std::vector<EvictionSlot>& slots) {
  // 1. Sequences, heads and addresses; staged tokens found, none listed twice.
  std::vector<std::tuple<std::int32_t, std::int32_t, std::int32_t>> staged;  // seq, head, position
  std::vector<std::int32_t> touched;                                         // sequences, in runs
  for (const EvictionSlot& e : slots) {
    const Sequence& s = sequence(e.seq, "evict_slots");
    check_head(e.head, "evict_slots");
    if (touched.empty() || touched.back() != e.seq) touched.push_back(e.seq);
    if (e.address.block == kStagedBlock) {
      ThoughtType type{};
      int index = -1;
      KVSIFT_CHECK(find_staged(s, e.head, e.address.slot, type, index),
                   "ThoughtBlockTable::evict_slots: position ", e.address.slot,
                   " is not staged in kv head ", e.head, " of sequence ", e.seq);
      staged.emplace_back(e.seq, e.head, e.address.slot);
    } else {
      check_address(s, e.seq, e.address, "evict_slots");
    }
  }
  std::sort(staged.begin(), staged.end());
  const auto twice = std::adjacent_find(staged.begin(), staged.end());
  KVSIFT_CHECK(twice == staged.end(), "ThoughtBlockTable::evict_slots: staged position ",
               std::get<2>(*twice), " of kv head ", std::get<1>(*twice), " of sequence ",
               std::get<0>(*twice), " is listed twice");
  // 2. The block slots' bits, each found live as it is set (so a slot listed twice finds its own
  // bit); on an error the bits set so far are cleared again and nothing has changed.
  const auto word = [&](const EvictionSlot& e) -> std::uint64_t& {
    const Sequence& s = sequence(e.seq, "evict_slots");
    Frame& f =
        frames_[static_cast<std::size_t>(s.blocks[static_cast<std::size_t>(e.address.block)])];
    return f.free[static_cast<std::size_t>(e.head) * mask_words_ + e.address.slot / 64];
  };
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const EvictionSlot& e = slots[i];
    if (e.address.block == kStagedBlock) continue;
    const std::uint64_t bit_of = std::uint64_t{1} << (e.address.slot % 64);
    std::uint64_t& w = word(e);
    if (w & bit_of) {
      for (std::size_t j = 0; j < i; ++j) {
        if (slots[j].address.block != kStagedBlock)
          word(slots[j]) &= ~(std::uint64_t{1} << (slots[j].address.slot % 64));
      }
      KVSIFT_CHECK(false, "ThoughtBlockTable::evict_slots: slot ", e.address.slot, " of block ",
                   e.address.block, " in kv head ", e.head, " of sequence ", e.seq,
                   " is not live (already evicted, never written, or listed twice)");
    }
    w |= bit_of;  // soft eviction: the bit is all that changes
  }
  // 3. Staged tokens leave their buffers; then each sequence's empty blocks go back (releasing a
  // block renumbers the later ones, so only now).
  for (const auto& [seq, head, position] : staged) {
    evict_one(sequence(seq, "evict_slots"), seq, head, SlotAddress{kStagedBlock, position});
  }
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (const std::int32_t seq : touched) release_empty_blocks(sequence(seq, "evict_slots"));
}

// --- inspection ------------------------------------------------------------------------------

std::int32_t ThoughtBlockTable::num_blocks(std::int32_t seq) const {
  return static_cast<std::int32_t>(sequence(seq, "num_blocks").blocks.size());
}

BlockInfo ThoughtBlockTable::block_info(std::int32_t seq, std::int32_t block) const {
  const Sequence& s = sequence(seq, "block_info");
  const Frame& f = frame(s, seq, block, "block_info");
  return BlockInfo{s.blocks[static_cast<std::size_t>(block)], f.type, f.format};
}

const std::uint64_t* ThoughtBlockTable::free_mask(std::int32_t seq, std::int32_t block,
                                                  std::int32_t head) const {
  const Sequence& s = sequence(seq, "free_mask");
  check_head(head, "free_mask");
  return &frame(s, seq, block, "free_mask").free[static_cast<std::size_t>(head) * mask_words_];
}

bool ThoughtBlockTable::is_live(std::int32_t seq, std::int32_t head, SlotAddress a) const {
  const Sequence& s = sequence(seq, "is_live");
  check_head(head, "is_live");
  if (a.block == kStagedBlock) {
    ThoughtType type{};
    int index = -1;
    return find_staged(s, head, a.slot, type, index);
  }
  check_address(s, seq, a, "is_live");
  return !bit(free_mask(seq, a.block, head), a.slot);
}

std::vector<std::uint64_t> ThoughtBlockTable::segment_mask(std::int32_t seq, std::int32_t block,
                                                           std::int32_t head,
                                                           std::int32_t segment) const {
  const Sequence& s = sequence(seq, "segment_mask");
  check_head(head, "segment_mask");
  const Frame& f = frame(s, seq, block, "segment_mask");
  std::vector<std::uint64_t> mask(static_cast<std::size_t>(mask_words_), 0);
  const std::uint64_t* free = &f.free[static_cast<std::size_t>(head) * mask_words_];
  for (std::int32_t slot = 0; slot < config_.block_size; ++slot) {
    if (!bit(free, slot) &&
        segment_of(s, load_slot_position(f.position.data(),
                                         std::int64_t{head} * config_.block_size + slot)) ==
            segment) {
      mask[slot / 64] |= std::uint64_t{1} << (slot % 64);
    }
  }
  return mask;
}

std::vector<ResidentToken> ThoughtBlockTable::resident_tokens(std::int32_t seq, std::int32_t head,
                                                              std::int32_t segment) const {
  const Sequence& s = sequence(seq, "resident_tokens");
  check_head(head, "resident_tokens");
  std::vector<ResidentToken> out;
  if (segment < 0 || segment >= static_cast<std::int32_t>(s.segment_starts.size())) {
    scan_tokens(s, head, segment, 0, std::numeric_limits<std::int32_t>::max(), out);
    return out;
  }
  const std::size_t next = static_cast<std::size_t>(segment) + 1;
  const std::int32_t last = next < s.segment_starts.size()
                                ? s.segment_starts[next] - 1
                                : std::numeric_limits<std::int32_t>::max();
  scan_tokens(s, head, segment, s.segment_starts[static_cast<std::size_t>(segment)], last, out);
  return out;
}

std::vector<ResidentToken> ThoughtBlockTable::resident_tokens_between(std::int32_t seq,
                                                                      std::int32_t head,
                                                                      std::int32_t first,
                                                                      std::int32_t last) const {
  std::vector<ResidentToken> out;
  resident_tokens_between(seq, head, first, last, out);
  return out;
}

void ThoughtBlockTable::resident_tokens_between(std::int32_t seq, std::int32_t head,
                                                std::int32_t first, std::int32_t last,
                                                std::vector<ResidentToken>& out) const {
  const Sequence& s = sequence(seq, "resident_tokens_between");
  check_head(head, "resident_tokens_between");
  scan_tokens(s, head, -1, first, last, out);
}

// Live tokens of `head` with positions in [first, last] (and of `segment` when >= 0), into
// `out` (cleared first); a block whose written positions all lie outside [first, last] is not
// read.
void ThoughtBlockTable::scan_tokens(const Sequence& s, std::int32_t head, std::int32_t segment,
                                    std::int32_t first, std::int32_t last,
                                    std::vector<ResidentToken>& out) const {
  out.clear();
  for (std::size_t b = 0; b < s.blocks.size(); ++b) {
    const Frame& f = frames_[static_cast<std::size_t>(s.blocks[b])];
    if (f.last_position < first || f.first_position > last) continue;
    const std::uint64_t* free = &f.free[static_cast<std::size_t>(head) * mask_words_];
    for (std::int32_t slot = 0; slot < config_.block_size; ++slot) {
      if (bit(free, slot)) continue;
      const std::int32_t p =
          load_slot_position(f.position.data(), std::int64_t{head} * config_.block_size + slot);
      if (p < first || p > last) continue;
      const std::int32_t seg = segment_of(s, p);
      if (segment >= 0 && seg != segment) continue;
      out.push_back(ResidentToken{SlotAddress{static_cast<std::int32_t>(b), slot}, p, seg});
    }
  }
  if (s.staging) {
    for (int t = 0; t < kThoughtTypes; ++t) {
      const ThoughtType type = static_cast<ThoughtType>(t);
      for (int i = 0; i < s.staging->staged_count(type, head); ++i) {
        const std::int32_t p = s.staging->staged_position(type, head, i);
        if (p < first || p > last) continue;
        const std::int32_t seg = segment_of(s, p);
        if (segment >= 0 && seg != segment) continue;
        out.push_back(ResidentToken{SlotAddress{kStagedBlock, p}, p, seg});
      }
    }
  }
}

std::vector<std::int32_t> ThoughtBlockTable::resident_positions(std::int32_t seq,
                                                                std::int32_t head) const {
  std::vector<std::int32_t> p;
  for (const ResidentToken& t : resident_tokens(seq, head)) p.push_back(t.position);
  std::sort(p.begin(), p.end());
  return p;
}

void ThoughtBlockTable::staged_rows(std::int32_t seq, std::int32_t head, std::vector<float>& keys,
                                    std::vector<float>& values) const {
  const Sequence& s = sequence(seq, "staged_rows");
  check_head(head, "staged_rows");
  check_holds_data("staged_rows");
  const std::size_t D = static_cast<std::size_t>(config_.head_dim);
  keys.clear();
  values.clear();
  if (!s.staging) return;
  for (int t = 0; t < kThoughtTypes; ++t) {
    const ThoughtType type = static_cast<ThoughtType>(t);
    for (int i = 0; i < s.staging->staged_count(type, head); ++i) {
      keys.resize(keys.size() + D);
      values.resize(values.size() + D);
      s.staging->staged_token(type, head, i, &keys[keys.size() - D], &values[values.size() - D]);
    }
  }
}

std::int64_t ThoughtBlockTable::live_tokens(std::int32_t seq, std::int32_t head) const {
  const Sequence& s = sequence(seq, "live_tokens");
  check_head(head, "live_tokens");
  std::int64_t live = 0;
  for (std::int32_t frame_id : s.blocks) {
    const Frame& f = frames_[static_cast<std::size_t>(frame_id)];
    for (std::int32_t slot = 0; slot < config_.block_size; ++slot) {
      live += !bit(&f.free[static_cast<std::size_t>(head) * mask_words_], slot);
    }
  }
  if (s.staging) {
    for (int t = 0; t < kThoughtTypes; ++t)
      live += s.staging->staged_count(static_cast<ThoughtType>(t), head);
  }
  return live;
}

void ThoughtBlockTable::segment_keys(std::int32_t seq, std::int32_t head, std::int32_t segment,
                                     std::vector<float>& keys,
                                     std::vector<std::int32_t>& positions) const {
  KVSIFT_CHECK(segment >= 0 && segment < num_segments(seq),
               "ThoughtBlockTable::segment_keys: ", "segment ", segment, " of sequence ", seq,
               " outside [0, ", num_segments(seq), ")");
  const std::vector<ResidentToken> tokens = resident_tokens(seq, head, segment);
  const std::size_t D = static_cast<std::size_t>(config_.head_dim);
  const std::size_t block_elems = static_cast<std::size_t>(config_.block_size) * D;
  keys.resize(tokens.size() * D);
  positions.resize(tokens.size());
  std::vector<float> block_keys(block_elems), block_values(block_elems);
  std::int32_t loaded = -1;  // tokens come in block order: dequantize each block once
  std::vector<float> staged_value(D);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const SlotAddress a = tokens[i].address;
    positions[i] = tokens[i].position;
    if (a.block == kStagedBlock) {
      read_token(seq, head, a, &keys[i * D], staged_value.data());
      continue;
    }
    if (a.block != loaded) {
      dequantize_block(seq, a.block, head, block_keys.data(), block_values.data());
      loaded = a.block;
    }
    std::copy_n(&block_keys[static_cast<std::size_t>(a.slot) * D], D, &keys[i * D]);
  }
}

void ThoughtBlockTable::dequantize_block(std::int32_t seq, std::int32_t block, std::int32_t head,
                                         float* keys, float* values) const {
  const Sequence& s = sequence(seq, "dequantize_block");
  check_head(head, "dequantize_block");
  check_holds_data("dequantize_block");
  const Frame& f = frame(s, seq, block, "dequantize_block");
  const BlockHeadLayout L = layout(f.format);
  dequantize_block_head(L, f.data.data() + head * L.bytes(), config_.global_factor(head), keys,
                        values);
}

void ThoughtBlockTable::read_token(std::int32_t seq, std::int32_t head, SlotAddress a, float* key,
                                   float* value) const {
  KVSIFT_CHECK(is_live(seq, head, a), "ThoughtBlockTable::read_token: slot ", a.slot, " of block ",
               a.block, " in kv head ", head, " of sequence ", seq, " is not live");
  check_holds_data("read_token");
  if (a.block == kStagedBlock) {  // still waiting for its group: read at 16 bits
    const Sequence& s = sequence(seq, "read_token");
    ThoughtType type{};
    int index = -1;
    find_staged(s, head, a.slot, type, index);
    s.staging->staged_token(type, head, index, key, value);
    return;
  }
  const std::size_t n = static_cast<std::size_t>(config_.block_size) * config_.head_dim;
  std::vector<float> keys(n), values(n);
  dequantize_block(seq, a.block, head, keys.data(), values.data());
  const std::size_t row = static_cast<std::size_t>(a.slot) * config_.head_dim;
  std::copy_n(&keys[row], config_.head_dim, key);
  std::copy_n(&values[row], config_.head_dim, value);
}

const std::vector<std::uint8_t>& ThoughtBlockTable::block_storage(std::int32_t seq,
                                                                  std::int32_t block) const {
  const Sequence& s = sequence(seq, "block_storage");
  check_holds_data("block_storage");
  return frame(s, seq, block, "block_storage").data;
}

// --- memory ----------------------------------------------------------------------------------

namespace {
// Per sequence: page table, segment starts and types, length (block_bytes.hpp).
std::int64_t sequence_metadata(std::size_t blocks, std::size_t segments) {
  return page_table_bytes(static_cast<std::int64_t>(blocks), static_cast<std::int64_t>(segments));
}
}  // namespace

TableBytes ThoughtBlockTable::resident_bytes() const {
  TableBytes out;
  bool any_nvfp4 = false;
  for (const Frame& f : frames_) {
    if (f.owner < 0) continue;
    const BlockBytes b =
        block_bytes(f.format, config_.block_size, config_.head_dim, config_.kv_heads);
    out.codes += b.codes;
    out.scales += b.scales;
    out.metadata += b.metadata;
    any_nvfp4 = any_nvfp4 || f.format == BlockFormat::nvfp4;
  }
  if (any_nvfp4) out.metadata += global_factor_bytes(config_.kv_heads);
  for (const Sequence& s : sequences_) {
    if (!s.active) continue;
    out.metadata += sequence_metadata(s.blocks.size(), s.segment_starts.size());
    if (s.staging) out.staging += staging_bytes(config_.kv_heads, config_.head_dim);
  }
  return out;
}

TableBytes ThoughtBlockTable::allocated_bytes() const {
  TableBytes out;
  bool any_nvfp4 = false;
  for (const Frame& f : frames_) {
    if (f.data.empty() && f.free.empty()) continue;  // a pool frame holds no storage
    const BlockHeadLayout L = layout(f.format);
    const std::int64_t heads = static_cast<std::int64_t>(f.data.size()) / L.bytes();
    out.codes += heads * L.codes_bytes();
    out.scales += heads * L.scales_bytes();
    out.metadata +=
        static_cast<std::int64_t>(f.free.size() * sizeof(std::uint64_t) + f.position.size()) +
        kBlockHeaderBytes;
    any_nvfp4 = any_nvfp4 || f.format == BlockFormat::nvfp4;
  }
  if (any_nvfp4) out.metadata += global_factor_bytes(config_.kv_heads);
  for (const Sequence& s : sequences_) {
    if (!s.active) continue;
    out.metadata += sequence_metadata(s.blocks.size(), s.segment_starts.size());
    if (s.staging) out.staging += s.staging->bytes();
  }
  return out;
}

}  // namespace kvsift
