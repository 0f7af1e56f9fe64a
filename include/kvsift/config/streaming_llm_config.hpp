// StreamingLLM's config (docs/algorithms.md §1.4). Eigen-free.
#pragma once

#include "kvsift/core/error.hpp"

namespace kvsift {

struct StreamingLLMConfig {
  int budget = 1024;
  int sink = 4;
  int buffer = 128;

  void validate() const {
    KVSIFT_CHECK(sink >= 0, "StreamingLLMConfig: sink must be >= 0, got ", sink);
    KVSIFT_CHECK(budget > sink, "StreamingLLMConfig: budget (", budget, ") must exceed sink (",
                 sink, ")");
    KVSIFT_CHECK(buffer >= 1, "StreamingLLMConfig: buffer must be >= 1, got ", buffer);
  }
  int recent() const { return budget - sink; }
};

}  // namespace kvsift
