// ThinKV's thought types (docs/algorithms.md §3.1): reasoning, execution and transition segments of
// a reasoning trace, and their importance ρ used by eviction (§3.3) and precision (§3.2).
#pragma once

#include <cstdint>
#include <string_view>

namespace kvsift {

enum class ThoughtType : std::uint8_t { reasoning, execution, transition };

// ρ(R) = 2 > ρ(E) = 1 > ρ(T) = 0 (§3.1): the least important segments are evicted first.
inline constexpr int importance(ThoughtType t) {
  switch (t) {
    case ThoughtType::reasoning:
      return 2;
    case ThoughtType::execution:
      return 1;
    case ThoughtType::transition:
      return 0;
  }
  return 0;
}

// One-letter names as the paper writes them: "R", "E", "T".
inline constexpr std::string_view thought_type_name(ThoughtType t) {
  switch (t) {
    case ThoughtType::reasoning:
      return "R";
    case ThoughtType::execution:
      return "E";
    case ThoughtType::transition:
      return "T";
  }
  return "?";
}

}  // namespace kvsift
