// How Continuous Thinking refills evicted slots of a quantized block (docs/algorithms.md §3.4,
// docs/thinkv.md §6). Eigen-free: ThinKV's config (config/thinkv_config.hpp) and the block table
// (paged/thought_block_table.hpp) both carry it.
//  - run (default): a whole staged group of 16 tokens goes into a group-aligned run of 16 FREE
//    slots; a survivor's codes never change, and a group holding any survivor is never refilled.
//  - regroup (our choice, an experiment, docs/thinkv.md §6 "Experiment: regroup in place"): when
//    no fully free run exists, the staged tokens fill the free slots of a partly evicted run and
//    that whole 16-slot group is re-quantized with fresh scales over its survivors' dequantized
//    values and the new tokens. Survivors keep their slots (nothing moves); their codes change.
#pragma once

#include <string>
#include <string_view>

#include "kvsift/core/error.hpp"

namespace kvsift {

enum class RefillRule { run, regroup };

inline constexpr std::string_view refill_rule_name(RefillRule r) {
  return r == RefillRule::regroup ? "regroup" : "run";
}

inline RefillRule parse_refill_rule(std::string_view name) {
  if (name == "run") return RefillRule::run;
  if (name == "regroup") return RefillRule::regroup;
  KVSIFT_FAIL("unknown refill rule '", std::string(name), "' (expected run or regroup)");
}

}  // namespace kvsift
