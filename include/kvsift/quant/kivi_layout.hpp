// Where the groups of a [tokens, channels] tensor lie (KIVI layout, docs/algorithms.md §3.2):
//   GroupAxis::token   a group runs along the token axis: 16 consecutive tokens of one channel.
//                      This is how keys are grouped ("keys per channel").
//   GroupAxis::channel a group runs along the channel axis: 16 consecutive channels of one token.
//                      This is how values are grouped ("values per token").
// Groups are numbered in the order a token stream produces them: for the token axis, block of 16
// tokens first, then channel (g = token_block · channels + channel); for the channel axis, token
// first, then channel block (g = token · channels/16 + channel_block).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvsift/core/config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/quant/format.hpp"

namespace kvsift {

enum class GroupAxis : std::uint8_t { token, channel };

inline constexpr std::string_view group_axis_name(GroupAxis a) {
  return a == GroupAxis::token ? "token" : "channel";
}

inline GroupAxis parse_group_axis(std::string_view name) {
  if (name == "token") return GroupAxis::token;
  if (name == "channel") return GroupAxis::channel;
  KVSIFT_FAIL("unknown group axis '", std::string(name), "' (expected token or channel)");
}

// Group geometry of a row-major [tokens, channels] tensor; both extents multiples of 16.
struct KiviGrid {
  std::int64_t tokens = 0;
  std::int64_t channels = 0;
  GroupAxis axis = GroupAxis::token;

  KVSIFT_HOST_DEVICE std::int64_t num_groups() const { return tokens * channels / kQuantGroupSize; }
  // Offset of group g's first element and the distance between its consecutive elements.
  KVSIFT_HOST_DEVICE std::int64_t group_offset(std::int64_t g) const {
    if (axis == GroupAxis::token) {
      const std::int64_t block = g / channels, channel = g % channels;
      return block * kQuantGroupSize * channels + channel;
    }
    const std::int64_t blocks_per_token = channels / kQuantGroupSize;
    return (g / blocks_per_token) * channels + (g % blocks_per_token) * kQuantGroupSize;
  }
  KVSIFT_HOST_DEVICE std::int64_t group_stride() const {
    return axis == GroupAxis::token ? channels : 1;
  }
};

}  // namespace kvsift
