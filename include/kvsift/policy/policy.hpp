// The run-time policy interface: an engine picks a policy by name from its config, then per
// compression step asks it whether to compress and, layer by layer, what to keep.
#pragma once

#include <string_view>

#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/step_inputs.hpp"

namespace kvsift {

class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string_view name() const = 0;
  // The decode trigger: true when the cache at these lengths must be compressed this step.
  virtual bool should_compress(const KVCacheView& kv) const = 0;
  // Plans one layer of one step. Reads the cache, never writes it; apply the plan with compact().
  virtual KeepPlan select(const StepInputs& in) = 0;
};

}  // namespace kvsift
