// StreamingLLM (docs/algorithms.md §1.4): keep the first `sink` tokens (attention sinks) and the
// most recent budget − sink. With left padding the sinks are the first real tokens. Needs no
// observations; the plan depends only on the lengths and the pad mask.
// Device views: staged to the host in this version: select() copies the pad mask (the only
// device memory it reads) to the host and runs the CPU reference, same plans as on host.
#pragma once

#include <string_view>

#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/config/streaming_llm_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/device_staging.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

class StreamingLLM final : public Policy {
 public:
  explicit StreamingLLM(const StreamingLLMConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "streaming"; }
  const StreamingLLMConfig& config() const { return cfg_; }

  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.budget, cfg_.buffer);
  }

  // Needs no queries: in.window_queries is ignored.
  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    in.kv.validate();
    if (in.kv.device() != Device::cpu) {
      HostStaging staging(ctx);
      return cpu::plan_from_scores(staging.lengths_and_mask(in.kv), nullptr,
                                   {cfg_.budget, cfg_.recent(), cfg_.sink});
    }
    return cpu::plan_from_scores(in.kv, nullptr, {cfg_.budget, cfg_.recent(), cfg_.sink});
  }

 private:
  StreamingLLMConfig cfg_;
};

}  // namespace kvsift
