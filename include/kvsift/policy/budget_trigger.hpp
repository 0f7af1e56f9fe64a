// The decode trigger shared by the budget-based policies (docs/algorithms.md §1.3): compress once a
// sequence's resident length reaches budget + buffer, so the cache oscillates between the two.
#pragma once

#include <cstdint>

#include "kvsift/core/kv_cache_view.hpp"

namespace kvsift {

inline bool reaches_budget_plus_buffer(const KVCacheView& kv, int budget, int buffer) {
  KVSIFT_CHECK(kv.lengths != nullptr, "should_compress: the cache view has no lengths");
  for (std::int64_t b = 0; b < kv.batch(); ++b)
    if (kv.length(b) >= budget + buffer) return true;
  return false;
}

}  // namespace kvsift
