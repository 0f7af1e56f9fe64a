// Adapters for policies that need more from the demo than the trigger and select(): here H2O,
// whose accumulated attention must see every decode step's queries. SkipKV (token ids and hidden
// states per step) is in demo_skipkv.hpp; ThinKV, which keeps its own storage, in demo_thinkv.hpp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "demo_policy.hpp"
#include "demo_skipkv.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/step_inputs.hpp"
#include "kvsift/policy/baselines/h2o.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"

namespace kvsift::demo {

// H2O (docs/algorithms.md §1.4): every step, every layer's accumulator takes the softmax attention of
// that step's queries (h2o.hpp: observe_step after the step's K/V is appended). H2O sizes its
// accumulator by the cache's capacity; the demo's caches start at budget + buffer, H2O's trigger
// point, so they never grow under it.
class H2OPolicy final : public DemoPolicy {
 public:
  explicit H2OPolicy(std::unique_ptr<H2O> h2o) : h2o_(std::move(h2o)) {
    KVSIFT_CHECK(h2o_ != nullptr, "H2OPolicy: null policy");
  }
  std::string name() const override { return std::string(h2o_->name()); }

  void observe(const DecodeStep& step, const std::vector<DemoLayerCache>& caches) override {
    for (int l = 0; l < static_cast<int>(caches.size()); ++l) {
      StepInputs in;
      in.layer = l;
      in.kv = caches[l].view();
      // [batch, q_heads, 1, head_dim]: this step's queries of layer l, already rounded to the
      // cache dtype; fp32 views are accepted whatever the cache's dtype.
      in.window_queries =
          TensorView::contiguous(const_cast<float*>(step.query(l, 0, 0)), DType::f32, Device::cpu,
                                 {step.batch, step.q_heads, 1, step.head_dim});
      h2o_->observe_step(in);
    }
  }
  bool should_compress(const KVCacheView& kv) override { return h2o_->should_compress(kv); }
  KeepPlan select(const StepInputs& in) override { return h2o_->select(in); }

 private:
  std::unique_ptr<H2O> h2o_;
};

// Wraps a policy from kvsift::make_policy() in the adapter it needs.
inline std::unique_ptr<DemoPolicy> adapt_policy(std::unique_ptr<Policy> policy) {
  KVSIFT_CHECK(policy != nullptr, "adapt_policy: null policy");
  if (auto* h2o = dynamic_cast<H2O*>(policy.get())) {
    policy.release();
    return std::make_unique<H2OPolicy>(std::unique_ptr<H2O>(h2o));
  }
  if (auto* skipkv = dynamic_cast<SkipKV*>(policy.get())) {
    policy.release();
    return std::make_unique<SkipKVPolicy>(std::unique_ptr<SkipKV>(skipkv));
  }
  return std::make_unique<PlainPolicy>(std::move(policy));
}

}  // namespace kvsift::demo
