// The generation position of every slot of a ThinKV block, stored in 3 bytes (docs/thinkv.md §6).
// Positions are per slot because eviction frees slots one at a time and refill puts later tokens
// into the holes, so a block's positions are neither contiguous nor ascending. 3 bytes instead of
// an int32 save 1 B per held slot per (layer, KV head): 14 KiB of 73 KiB of metadata in the demo's
// 32K decode at budget 1024 (docs/thinkv.md §6). The price is a length limit: a sequence holds at
// most kMaxSlotPosition + 1 = 16,777,215 generation positions (ThoughtBlockTable::append checks
// it). 0xFFFFFF is the never-written slot (position -1). Little-endian; host and device code.
#pragma once

#include <cstdint>

#include "kvsift/core/config.hpp"

namespace kvsift {

inline constexpr int kSlotPositionBytes = 3;
inline constexpr std::int32_t kUnwrittenSlotPosition = -1;
inline constexpr std::int32_t kMaxSlotPosition = (std::int32_t{1} << 24) - 2;

// slots: [n slots, 3] bytes; p in [-1, kMaxSlotPosition] (the caller checks the range).
KVSIFT_HOST_DEVICE void store_slot_position(std::uint8_t* slots, std::int64_t slot,
                                            std::int32_t p) {
  const std::uint32_t u = static_cast<std::uint32_t>(p) & 0xFFFFFFu;  // -1 -> 0xFFFFFF
  std::uint8_t* b = slots + slot * kSlotPositionBytes;
  b[0] = static_cast<std::uint8_t>(u);
  b[1] = static_cast<std::uint8_t>(u >> 8);
  b[2] = static_cast<std::uint8_t>(u >> 16);
}

KVSIFT_HOST_DEVICE std::int32_t load_slot_position(const std::uint8_t* slots, std::int64_t slot) {
  const std::uint8_t* b = slots + slot * kSlotPositionBytes;
  const std::uint32_t u = b[0] | (std::uint32_t{b[1]} << 8) | (std::uint32_t{b[2]} << 16);
  return u == 0xFFFFFFu ? kUnwrittenSlotPosition : static_cast<std::int32_t>(u);
}

}  // namespace kvsift
