// `kvsift demo --device cuda`: R-KV's selection on the GPU inside the demo's decode. At each
// compression the layer's host cache and window queries are uploaded, kvsift::cuda::rkv_select
// picks the kept slots, and the downloaded plan comes back to the runner, which compacts the demo's
// host cache with it exactly as for a CPU plan (so recall and eviction shapes are measured the
// same way). The point is agreement with the CPU R-KV, not speed: its ms/compression includes
// allocation and both transfers. Only for builds with the CUDA backend (KVSIFT_WITH_CUDA).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "demo_policy.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "score_cuda.hpp"

namespace kvsift::demo {

class RKVCudaPolicy final : public DemoPolicy {
 public:
  explicit RKVCudaPolicy(std::unique_ptr<RKV> rkv) : rkv_(std::move(rkv)) {
    KVSIFT_CHECK(rkv_ != nullptr, "RKVCudaPolicy: null policy");
  }
  // Same name as the CPU policy, so the two tables line up row for row.
  std::string name() const override { return std::string(rkv_->name()); }
  bool should_compress(const KVCacheView& kv) override { return rkv_->should_compress(kv); }
  //   in.kv              host [batch, kv_heads, capacity, head_dim], any lengths
  //   in.window_queries  host [batch, q_heads, W, head_dim] in the cache's dtype
  KeepPlan select(const StepInputs& in) override {
    return tool::select_rkv_cuda(in.kv, in.window_queries, rkv_->config());
  }

 private:
  std::unique_ptr<RKV> rkv_;  // its config and trigger; select() runs on the GPU instead
};

// Wraps the registry's "rkv" policy to select on the GPU; any other policy is a caller error.
inline std::unique_ptr<DemoPolicy> cuda_rkv_policy(std::unique_ptr<Policy> policy) {
  auto* rkv = dynamic_cast<RKV*>(policy.get());
  KVSIFT_CHECK(rkv != nullptr, "cuda_rkv_policy: expected the rkv policy, got '",
               policy == nullptr ? std::string("null") : std::string(policy->name()), "'");
  policy.release();
  return std::make_unique<RKVCudaPolicy>(std::unique_ptr<RKV>(rkv));
}

}  // namespace kvsift::demo
