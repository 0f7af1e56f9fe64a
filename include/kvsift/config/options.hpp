// The option enums of every method, in one Eigen-free header that both backends, the policies,
// the tool and the C API include (docs/algorithms.md names each choice where it is made).
#pragma once

#include <string>
#include <string_view>

#include "kvsift/core/error.hpp"

namespace kvsift {

// How the G query heads of one KV head are combined, on raw logits before the softmax (§1.1).
enum class GqaReduce { max, mean };
// The 1-d pooling over neighbouring tokens (stride 1, "same" padding) (§1.1 step 4).
enum class Pooling { max, avg };
// How the W per-query attention rows are combined (§1.1 step 3).
enum class WindowReduce { mean, sum };

// What happens to a key row with no near-duplicate (§1.2 step 3).
enum class RedundancyMode {
  sound,     // nothing is zeroed (library default)
  faithful,  // the reference's r_i = 0 fallback: C[i, 0] is zeroed, an accidental sink keeper
};

// How SkipKV treats left pads (§2.4).
enum class PadMode {
  exclude,   // pads never kept, never counted in the budget (library default)
  faithful,  // the SkipKV reference: pad score +100, force-kept, counted in the budget
};

// H2O's scoring (§1.4).
enum class H2OMode {
  accumulated,        // H2O: per KV head, summed over steps and the group's query heads
  last_query_shared,  // SkipKV's variant: last query only, heads averaged, one set for all heads
};

inline const char* pad_mode_name(PadMode m) {
  return m == PadMode::faithful ? "faithful" : "exclude";
}

inline PadMode parse_pad_mode(std::string_view s) {
  if (s == "faithful") return PadMode::faithful;
  KVSIFT_CHECK(s == "exclude", "pad mode must be 'faithful' or 'exclude', got '", std::string(s),
               "'");
  return PadMode::exclude;
}

}  // namespace kvsift
