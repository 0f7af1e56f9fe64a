// H2O's config (docs/algorithms.md §1.4). Eigen-free, shared by the CPU reference and the registry.
#pragma once

#include "kvsift/config/options.hpp"
#include "kvsift/config/scoring.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

struct H2OConfig {
  int budget = 1024;
  int recent = -1;  // most recent tokens always kept; -1: budget / 2 (H2O's default)
  int buffer = 128;
  H2OMode mode = H2OMode::accumulated;

  int recent_tokens() const { return recent < 0 ? budget / 2 : recent; }
  void validate() const {
    KVSIFT_CHECK(budget >= 2, "H2OConfig: budget must be >= 2, got ", budget);
    KVSIFT_CHECK(recent >= -1, "H2OConfig: recent must be >= 0 (or -1 for budget / 2), got ",
                 recent);
    KVSIFT_CHECK(recent_tokens() >= 1 && recent_tokens() < budget, "H2OConfig: recent (",
                 recent_tokens(), ") must be in [1, budget = ", budget, ")");
    KVSIFT_CHECK(buffer >= 1, "H2OConfig: buffer must be >= 1, got ", buffer);
  }
  TopKSelection selection() const { return {budget, recent_tokens(), 0}; }
};

}  // namespace kvsift
