// The one byte accounting of ThinKV's Continuous Thinking cache (docs/algorithms.md §3.2, §3.4):
// what one block of a given format, slot count, head_dim and KV-head count occupies, and what one
// sequence's 16-bit staging buffers occupy. The CPU ThoughtBlockTable reports resident_bytes() with
// these functions and sizes its allocations with them; the CUDA table is meant to size its
// per-format pools with the same functions, so both report the same bytes for the same blocks.
// Eigen-free and usable in host and device code.
//
// One (block, KV head), S slots, head_dim D (both multiples of 16), KIVI grouping:
//  - key groups: S/16 · D (16 slots of one channel); value groups: S · D/16 (16 channels of one
//    slot); each group has code_bytes_per_group(format) code bytes and 1 scale byte
//    (quant/format.hpp). f32 blocks: keys and values [S, D] f32, no scales.
//  - metadata: the eviction bitmask (1 bit per slot, whole uint64 words) and the 3-byte generation
//    position of every slot (slot_positions.hpp; a slot's segment follows from its position and
//    the sequence's segment starts, so no segment id is stored per slot).
// One block: kv_heads (block, head)s + a header (thought type, format: 1 B each; owner sequence,
// frame id: 4 B each).
// Staging (§3.4): per (sequence, layer, thought type, KV head) up to 16 tokens, keys and values at
// 16 bits (2 B per element), plus the int32 position of each staged token.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/paged/slot_positions.hpp"
#include "kvsift/quant/format.hpp"

namespace kvsift {

enum class BlockFormat : std::uint8_t { f32, nvfp4, fp8, ternary };

KVSIFT_HOST_DEVICE constexpr bool is_quantized(BlockFormat f) { return f != BlockFormat::f32; }

KVSIFT_HOST_DEVICE constexpr QuantFormat quant_format_of(BlockFormat f) {
  return f == BlockFormat::fp8       ? QuantFormat::fp8
         : f == BlockFormat::ternary ? QuantFormat::ternary
                                     : QuantFormat::nvfp4;
}

inline constexpr std::int64_t kBlockHeaderBytes = 1 + 1 + 4 + 4;  // type, format, owner, frame
inline constexpr int kStagedThoughtTypes = 3;                     // R, E, T each stage apart

KVSIFT_HOST_DEVICE constexpr std::int64_t block_mask_words(std::int64_t slots) {
  return (slots + 63) / 64;
}

// Bytes of one (block, KV head) of `format`, split as resident_bytes() reports them.
KVSIFT_HOST_DEVICE constexpr std::int64_t block_head_code_bytes(BlockFormat format,
                                                                std::int64_t slots,
                                                                std::int64_t head_dim) {
  return !is_quantized(format)
             ? 2 * slots * head_dim * 4
             : (slots / kQuantGroupSize * head_dim + slots * (head_dim / kQuantGroupSize)) *
                   code_bytes_per_group(quant_format_of(format));
}
KVSIFT_HOST_DEVICE constexpr std::int64_t block_head_scale_bytes(BlockFormat format,
                                                                 std::int64_t slots,
                                                                 std::int64_t head_dim) {
  return !is_quantized(format)
             ? 0
             : slots / kQuantGroupSize * head_dim + slots * (head_dim / kQuantGroupSize);
}
KVSIFT_HOST_DEVICE constexpr std::int64_t block_head_metadata_bytes(std::int64_t slots) {
  return block_mask_words(slots) * 8 + slots * kSlotPositionBytes;
}

struct BlockBytes {
  std::int64_t codes = 0;     // element codes (raw floats in f32 blocks)
  std::int64_t scales = 0;    // group scales
  std::int64_t metadata = 0;  // eviction masks, slot positions, block header
  KVSIFT_HOST_DEVICE constexpr std::int64_t total() const { return codes + scales + metadata; }
};

// One whole block: every KV head's part plus the header.
KVSIFT_HOST_DEVICE constexpr BlockBytes block_bytes(BlockFormat format, std::int64_t slots,
                                                    std::int64_t head_dim, std::int64_t kv_heads) {
  return BlockBytes{kv_heads * block_head_code_bytes(format, slots, head_dim),
                    kv_heads * block_head_scale_bytes(format, slots, head_dim),
                    kv_heads * block_head_metadata_bytes(slots) + kBlockHeaderBytes};
}

// One sequence's staging buffers in one layer: 16 tokens per (thought type, KV head), K and V at
// 16 bits, and their positions.
KVSIFT_HOST_DEVICE constexpr std::int64_t staging_bytes(std::int64_t kv_heads,
                                                        std::int64_t head_dim) {
  return kStagedThoughtTypes * kv_heads * kQuantGroupSize * (2 * head_dim * 2 + 4);
}

// One sequence's page table in one layer: 4 B per block (its frame id), 5 B per segment (start and
// thought type), 4 B for its length.
KVSIFT_HOST_DEVICE constexpr std::int64_t page_table_bytes(std::int64_t blocks,
                                                           std::int64_t segments) {
  return 4 * blocks + 5 * segments + 4;
}

// NVFP4's fp32 global factor g per KV head, held once a table has an NVFP4 block.
KVSIFT_HOST_DEVICE constexpr std::int64_t global_factor_bytes(std::int64_t kv_heads) {
  return 4 * kv_heads;
}

}  // namespace kvsift
