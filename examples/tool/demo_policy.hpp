// The demo's view of a method: the kvsift::Policy calls (observe, trigger, per-layer select) plus
// what the runner measures — how memory is counted and which positions are resident (ThinKV's own
// quantized tables answer these themselves) — and any extra table columns. Every registered
// planning method joins the demo through RegistryPolicy; a cache-owning one has its own adapter
// (ThinKV: demo_thinkv.hpp; the quantizers KIVI and PM-KVQ: demo_quantizer.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "kvsift/config/sentence_tracker_config.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/observation.hpp"
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
  // Where attention goes on the policy's own stored keys, when they are not the engine's (the
  // quantizers' dequantized keys): `top` = the sorted positions of the k resident tokens with the
  // highest logits for `query` [head_dim] of (layer, b, query head). false: the policy stores the
  // keys exactly, recall is measured on its resident positions.
  virtual bool attended_positions(int layer, int b, int q_head, const float* query, int k,
                                  std::vector<std::int32_t>& top) const {
    (void)layer;
    (void)b;
    (void)q_head;
    (void)query;
    (void)k;
    (void)top;
    return false;
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

// Any registered planning method (kvsift::make_policy), driven the way an engine drives it: every
// step the step-level observation (the token ids and the generator's hidden stand-ins) and one
// per-layer observation (the layer's cache and the step's queries), whatever needs() says; the
// trigger once per step; select() per layer. Its table columns are the method's summary().
// On a synthetic stream (ids -1) a delimiter id of the default sentence tokens (R1-Distill-Qwen,
// what the registry's SkipKV uses) stands in where the plan closes a sentence, so sentence-based
// methods see the plan's sentences; other synthetic ids stay -1.
class RegistryPolicy final : public DemoPolicy {
 public:
  explicit RegistryPolicy(std::unique_ptr<Policy> policy) : policy_(std::move(policy)) {
    KVSIFT_CHECK(policy_ != nullptr, "RegistryPolicy: null policy");
  }
  std::string name() const override { return std::string(policy_->name()); }

  void observe(const DecodeStep& step, const std::vector<DemoLayerCache>& caches) override {
    ids_.resize(static_cast<std::size_t>(step.batch));
    for (int b = 0; b < step.batch; ++b) {
      const std::int32_t id = step.token_ids[b];
      ids_[b] = id < 0 && step.closes_sentence[b] ? synthetic_delimiter_ : id;
    }
    Observation obs;
    obs.token_ids = ids_.data();
    obs.num_tokens = 1;
    // [batch, 1, head_dim]: the step's synthetic last-layer states.
    obs.last_hidden = TensorView::contiguous(const_cast<float*>(step.hidden.data()), DType::f32,
                                             Device::cpu, {step.batch, 1, step.head_dim});
    if (!caches.empty()) obs.kv = caches[0].view();
    policy_->observe(obs);
    for (int l = 0; l < static_cast<int>(caches.size()); ++l) {
      Observation layer;
      layer.layer = l;
      layer.kv = caches[l].view();
      // [batch, q_heads, 1, head_dim]: this step's queries of layer l, already rounded to the
      // cache dtype; fp32 views are accepted whatever the cache's dtype.
      layer.queries =
          TensorView::contiguous(const_cast<float*>(step.query(l, 0, 0)), DType::f32, Device::cpu,
                                 {step.batch, step.q_heads, 1, step.head_dim});
      policy_->observe(layer);
    }
    ++observed_steps_;
  }
  bool should_compress(const KVCacheView& kv) override { return policy_->should_compress(kv); }
  KeepPlan select(const StepInputs& in) override {
    if (in.layer == 0) trigger_positions_.push_back(observed_steps_);
    return select_plan(*policy_, in);
  }
  std::vector<std::pair<std::string, std::string>> extra_columns() const override {
    return policy_->summary();
  }

  const Policy& policy() const { return *policy_; }
  // Tokens observed when each compression began (layer 0's select), for tests.
  const std::vector<std::int64_t>& trigger_positions() const { return trigger_positions_; }

  // How select() reaches the policy: on the host views as given (the default), or, with
  // `kvsift demo --device cuda`, on device copies of them (demo_cuda.hpp).
  using SelectFn = KeepPlan (*)(Policy&, const StepInputs&);
  SelectFn select_plan = [](Policy& p, const StepInputs& in) { return p.select(in); };

 private:
  const std::int32_t synthetic_delimiter_ = SentenceTokens::r1_qwen().delimiters.front();
  std::unique_ptr<Policy> policy_;
  std::vector<std::int32_t> ids_;  // [batch] this step's ids
  std::int64_t observed_steps_ = 0;
  std::vector<std::int64_t> trigger_positions_;
};

}  // namespace kvsift::demo
