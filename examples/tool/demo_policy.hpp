// The demo's view of a policy: the kvsift::Policy calls (trigger, per-layer select) plus the two
// things policies differ on beyond that — per-step bookkeeping (H2O's accumulated attention;
// SkipKV's sentence tracking on token ids and hidden states) and how their memory is counted
// (ThinKV's quantized blocks) — and any extra table columns. A new policy joins the demo with one
// adapter.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/step_inputs.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift::demo {

// A compression a policy made on its own inside observe() (ThinKV evicts in its end_step()), for
// the runner to count as it counts a trigger: `ms` is the time it took, summed over sequences.
struct SelfCompression {
  bool happened = false;
  double ms = 0;
};

class DemoPolicy {
 public:
  virtual ~DemoPolicy() = default;
  virtual std::string name() const = 0;
  // Every decode step, after the token's K/V is in every layer's cache and its queries are in the
  // window, before the trigger is asked. `caches` [layers]. Default: nothing to track.
  virtual void observe(const DecodeStep& step, const std::vector<DemoLayerCache>& caches) {
    (void)step;
    (void)caches;
  }
  // Asked once per step with layer 0's cache (every layer holds the same lengths), as an engine
  // asks once per step (DESIGN.md, per-step contract).
  virtual bool should_compress(const KVCacheView& kv) = 0;
  virtual KeepPlan select(const StepInputs& in) = 0;
  // Bytes layer `layer` holds (its demo cache is `cache`). Default: resident tokens x (K + V)
  // rows in the storage dtype.
  virtual std::int64_t resident_bytes(const DemoLayerCache& cache, int layer) const {
    (void)layer;
    return cache.resident_bytes();
  }
  // [n] ascending generation positions resident in (layer, sequence b, KV head h), for recall.
  // Default: the demo cache's slots. A policy with its own storage (ThinKV) answers from it.
  virtual const std::int32_t* resident_positions(const DemoLayerCache& cache, int layer, int b,
                                                 int h, std::int64_t& n) const {
    (void)layer;
    n = cache.length(b);
    return cache.positions(b, h);
  }
  // Whether observe() compressed in the step just observed. Default: never (the runner's trigger).
  virtual SelfCompression self_compression() const { return {}; }
  // (sequence, layer, step) triples with some eviction, and all of them, when the policy counts
  // them itself (ThinKV's EvictionCounter); false: the runner counts its compactions.
  virtual bool layer_step_evictions(std::int64_t& evicting, std::int64_t& total) const {
    (void)evicting;
    (void)total;
    return false;
  }
  // Policy-specific columns for the table, as (header, cell) pairs, read after the run.
  virtual std::vector<std::pair<std::string, std::string>> extra_columns() const { return {}; }
};

// Any kvsift::Policy that needs nothing but the trigger and select() (FullKV, StreamingLLM, SnapKV,
// R-KV), e.g. one from kvsift::make_policy().
class PlainPolicy final : public DemoPolicy {
 public:
  explicit PlainPolicy(std::unique_ptr<Policy> policy) : policy_(std::move(policy)) {
    KVSIFT_CHECK(policy_ != nullptr, "PlainPolicy: null policy");
  }
  std::string name() const override { return std::string(policy_->name()); }
  bool should_compress(const KVCacheView& kv) override { return policy_->should_compress(kv); }
  KeepPlan select(const StepInputs& in) override { return policy_->select(in); }

 private:
  std::unique_ptr<Policy> policy_;
};

}  // namespace kvsift::demo
