// StreamingLLM (docs/algorithms.md §1.4): keep the first `sink` tokens (attention sinks) and the most
// recent budget − sink. With left padding the sinks are the first real tokens.
#pragma once

#include <string_view>

#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/policy.hpp"

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
    (void)ctx;
    in.kv.validate();
    return cpu::plan_from_scores(in.kv, nullptr, {cfg_.budget, cfg_.recent(), cfg_.sink});
  }

 private:
  StreamingLLMConfig cfg_;
};

}  // namespace kvsift
