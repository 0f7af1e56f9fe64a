// ThinKV behind the cache-owning interface (policy/cache_owning_policy.hpp): one ThinKV pipeline
// per sequence of the batch (TBE's decisions are per sequence, docs/thinkv.md), fed from
// batched engine tensors. What an engine driving ThinKV needs beyond ThinKV itself lives here:
// gathering a sequence's rows out of [batch, kv_heads, n, head_dim] views, per-sequence
// sparsities, the resident positions and the memory summed over sequences.
//
// On the device (place_on_device, cache_owning_policy.hpp): the whole batch runs in one
// DeviceThinKVPipeline (cuda::DeviceThinKV through the DeviceBackend, docs/thinkv.md §9), whose
// decisions are the host pipeline's; tensors are then contiguous device views (K/V f32 or bf16,
// queries and outputs f32). sequence() and observe_sparsity() serve the host pipeline only.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kvsift/backend/device_thinkv.hpp"
#include "kvsift/config/thinkv_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/cache_owning_policy.hpp"
#include "kvsift/policy/thinkv/thinkv.hpp"

namespace kvsift {

class ThinKVPolicy final : public CacheOwningPolicy {
 public:
  explicit ThinKVPolicy(const ThinKVPolicyConfig& cfg);

  std::string_view name() const override { return "thinkv"; }
  unsigned needs() const override { return kNeedsAppend | kNeedsQueries; }
  std::int64_t batch() const override { return cfg_.batch; }
  const ThinKVPolicyConfig& config() const { return cfg_; }

  void prefill(int layer, const TensorView& keys, const TensorView& values) override;
  void append(int layer, const TensorView& keys, const TensorView& values) override;
  // obs.queries [batch, q_heads, 1, head_dim] of a layer in L*: observe_query per sequence
  // (other layers' observations are ignored: ThinKV reads only L*).
  void observe(const Observation& obs) override;
  // The sparsities an engine already has, [batch] for `layer` (ThinKV::observe_sparsity).
  void observe_sparsity(int layer, const float* sparsity);
  bool end_step() override;
  void attention(int layer, const TensorView& queries, const TensorView& out) const override;

  std::size_t device_memory_bytes() const override;
  void place_on_device(const ExecContext& ctx) override;
  bool on_device() const override { return device_ != nullptr; }
  std::size_t attention_workspace_bytes(int layer) const override;
  void attention_with_workspace(int layer, const TensorView& queries, const TensorView& out,
                                const ExecContext& ctx) const override;

  std::int64_t resident_bytes(int layer) const override;
  std::int64_t resident_bytes() const override;
  std::int64_t fullkv_fp16_bytes() const override;
  std::vector<std::int32_t> resident_positions(int layer, std::int64_t seq,
                                               std::int64_t kv_head) const override;

  // (sequence, layer, step) triples with some eviction, and all of them.
  std::int64_t evicting_layer_steps() const;
  std::int64_t total_layer_steps() const;
  const ThinKV& sequence(std::int64_t seq) const;

 private:
  // Row t of sequence b's [n, kv_heads, head_dim] block out of a [batch, kv_heads, n, head_dim]
  // f32 view, contiguous in scratch_.
  const float* gather(const TensorView& t, std::int64_t b, const char* what) const;

  void check_host(const char* fn) const;

  ThinKVPolicyConfig cfg_;
  std::vector<std::unique_ptr<ThinKV>> seqs_;     // [batch] on the host; empty once on the device
  std::unique_ptr<DeviceThinKVPipeline> device_;  // after place_on_device
  mutable std::vector<float> scratch_;
};

}  // namespace kvsift
