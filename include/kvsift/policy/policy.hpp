// The engine-facing policy interface every method implements. Per decode step an engine:
//   policy->observe(step_obs);                          // token ids / hidden (needs() says)
//   for each layer: policy->observe(layer_obs);         // queries / appended K/V (needs() says)
//   if (policy->should_compress(kv_of_layer_0))
//     for each layer: plan = policy->select(in, ctx); compact(in.kv, plan, ctx);
// select() runs where the views live: host views on the CPU reference, device views on the CUDA
// backend on ctx.stream with ctx.workspace (size it with workspace_bytes() first). A method needs
// the CUDA backend linked (kvsift::cuda) for device views and raises kvsift::Error otherwise.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/core/exec_context.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/observation.hpp"
#include "kvsift/core/step_inputs.hpp"

namespace kvsift {

class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string_view name() const = 0;
  // What observe() must be given (a Needs bit set); kNeedsNothing for the stateless baselines.
  virtual unsigned needs() const { return kNeedsNothing; }
  // The decode trigger: true when the cache at these lengths must be compressed this step.
  virtual bool should_compress(const KVCacheView& kv) const = 0;
  // Every decode step (and the prompt): the signals needs() names. Methods that need nothing
  // accept and ignore every observation.
  virtual void observe(const Observation& obs) { (void)obs; }
  // Device scratch select() needs for these inputs; 0 for host views.
  virtual std::size_t workspace_bytes(const StepInputs& in) const {
    (void)in;
    return 0;
  }
  // Plans one layer of one step. Reads the cache, never writes it; apply the plan with compact().
  virtual KeepPlan select(const StepInputs& in, const ExecContext& ctx) = 0;
  KeepPlan select(const StepInputs& in) { return select(in, ExecContext{}); }
  // What a host may log or tabulate about the method's state, as (name, value) pairs (SkipKV:
  // redundant sentences, steering strengths). Empty for stateless methods.
  virtual std::vector<std::pair<std::string, std::string>> summary() const { return {}; }
};

}  // namespace kvsift
