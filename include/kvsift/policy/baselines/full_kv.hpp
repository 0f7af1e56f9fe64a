// FullKV (docs/algorithms.md §1.4): keeps everything; the reference for memory and recall. Needs
// no observations. Device views: the plan depends only on the lengths (host memory by
// KVCacheView's contract), so nothing is read from the device.
#pragma once

#include <string_view>

#include "kvsift/policy/policy.hpp"

namespace kvsift {

class FullKV final : public Policy {
 public:
  std::string_view name() const override { return "fullkv"; }
  bool should_compress(const KVCacheView&) const override { return false; }
  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    (void)ctx;
    in.kv.validate();
    return KeepPlan::keep_all(in.kv);
  }
};

}  // namespace kvsift
