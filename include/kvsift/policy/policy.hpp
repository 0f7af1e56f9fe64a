// The engine-facing policy interface every method implements. Per decode step an engine:
//   policy->observe(step_obs);                          // token ids / hidden (needs() says)
//   for each layer: policy->observe(layer_obs);         // queries / appended K/V (needs() says)
//   if (policy->should_compress(kv_of_layer_0))
//     policy->compress_step(layers, window_queries, n_layers, ctx);   // every layer, in place
// (or, per layer, plan = policy->select(in, ctx); compact(in.kv, plan, ctx) — for an engine that
// applies plans itself, e.g. by remapping pages).
// select() runs where the views live: host views on the CPU reference, device views on the CUDA
// backend on ctx.stream with ctx.workspace (size it with workspace_bytes() first). A method needs
// the CUDA backend linked (kvsift::cuda) for device views and raises kvsift::Error otherwise.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/core/compact.hpp"
#include "kvsift/core/error.hpp"
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

  // One compression step of every layer, applied in place: layer l's cache layers[l] (lengths and
  // mask rewritten), its window queries queries[l] (an empty view for methods that read none).
  // Every layer is selected (and every plan checked) before any is compacted, so an error leaves
  // every layer untouched. Layers may share one valid_mask (see compact_layers).
  // Methods with an all-layer device path (R-KV) override it: one launch sequence for the step
  // and one host wait (the kept lengths) instead of a plan download and upload per layer.
  //   layers   [n_layers] keys/values [batch, kv_heads, capacity, head_dim], one device
  //   queries  [n_layers] [batch, q_heads, window, head_dim]
  virtual std::size_t step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                           int n_layers) const {
    check_step_args(layers, queries, n_layers);
    std::size_t need = 0;
    for (int l = 0; l < n_layers; ++l) {
      if (layers[l].device() == Device::cpu) continue;
      need = std::max({need, workspace_bytes(StepInputs{l, layers[l], queries[l]}),
                       device_backend().compact_workspace_bound(layers[l])});
    }
    return need;
  }
  virtual void compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                             const ExecContext& ctx) {
    check_step_args(layers, queries, n_layers);
    std::vector<KeepPlan> plans;
    plans.reserve(static_cast<std::size_t>(n_layers));
    for (int l = 0; l < n_layers; ++l)
      plans.push_back(select(StepInputs{l, layers[l], queries[l]}, ctx));
    compact_layers(layers, plans.data(), n_layers, ctx);
  }
  // What a host may log or tabulate about the method's state, as (name, value) pairs (SkipKV:
  // redundant sentences, steering strengths). Empty for stateless methods.
  virtual std::vector<std::pair<std::string, std::string>> summary() const { return {}; }

 protected:
  static void check_step_args(const KVCacheView* layers, const TensorView* queries, int n_layers) {
    KVSIFT_CHECK(n_layers >= 1, "compress_step: n_layers must be >= 1, got ", n_layers);
    KVSIFT_CHECK(layers != nullptr && queries != nullptr, "compress_step: layers (",
                 static_cast<const void*>(layers), ") and queries (",
                 static_cast<const void*>(queries), ") must not be null");
    for (int l = 1; l < n_layers; ++l)
      KVSIFT_CHECK(layers[l].device() == layers[0].device(), "compress_step: layer ", l, " is in ",
                   device_name(layers[l].device()), " memory, layer 0 in ",
                   device_name(layers[0].device()));
  }
};

}  // namespace kvsift
