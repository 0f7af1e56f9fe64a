// SnapKV (docs/algorithms.md §1.4): the window importance a of §1.1 alone, with SnapKV's own
// defaults (window 32, kernel 5, average pooling, attention summed over the window). For
// grouped-query attention the group's logits are averaged (our choice: SnapKV itself is multi-head
// only). Same trigger and prefill use as R-KV (see rkv.hpp). Needs no observations. Device views:
// staged to the host in this version (policy/device_staging.hpp): select() copies the cache and
// window queries to host memory and runs the CPU reference, same plans as on host.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/backend/cpu/window_importance.hpp"
#include "kvsift/config/snapkv_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/device_staging.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

class SnapKV final : public Policy {
 public:
  explicit SnapKV(const SnapKVConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "snapkv"; }
  const SnapKVConfig& config() const { return cfg_; }

  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.budget, cfg_.buffer);
  }

  // Scores and plans the sequences over budget; the others keep everything.
  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    if (in.kv.device() != Device::cpu) {
      HostStaging staging(ctx);
      return select({in.layer, staging.cache(in.kv), staging.tensor(in.window_queries)},
                    ExecContext{});
    }
    return cpu::select_scored_over_budget(in.kv, cfg_.selection(), [&](const std::uint8_t* over) {
      return cpu::window_importance(in.kv, in.window_queries, cfg_.importance_config(), over);
    });
  }

 private:
  SnapKVConfig cfg_;
};

}  // namespace kvsift
