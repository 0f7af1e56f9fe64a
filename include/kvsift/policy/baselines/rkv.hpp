// R-KV (redundancy-aware KV compression for reasoning models), docs/algorithms.md §1.3: joint score
// score_j = λ·a_j − (1−λ)·R_j of window importance (§1.1) and key redundancy (§1.2); keep the
// budget − W best per (sequence, KV head) plus the window.
//
// Decode: call select() for every layer when should_compress() (resident length reaches
// budget + buffer). Prefill: a prompt longer than the budget is compressed by calling select()
// directly after the prompt's KV is written, with the prompt's last W queries; select() compresses
// every sequence over the budget whatever the trigger says. Needs no observations.
// Device views: select() runs the CUDA backend (device_backend().rkv_select) on ctx.stream with
// ctx.workspace, sized by workspace_bytes().
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvsift/backend/cpu/rkv_scores.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/backend/device_backend.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

class RKV final : public Policy {
 public:
  explicit RKV(const RKVConfig& cfg) : cfg_(cfg) { cfg_.validate(); }

  std::string_view name() const override { return "rkv"; }
  const RKVConfig& config() const { return cfg_; }

  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.budget, cfg_.buffer);
  }

  // Scores and plans the sequences over budget; the others keep everything.
  using Policy::select;
  std::size_t workspace_bytes(const StepInputs& in) const override {
    if (in.kv.device() == Device::cpu) return 0;
    return device_backend().rkv_workspace_bytes(in.kv, in.window_queries, cfg_);
  }

  // Device views whose layers share one mask (or none), at most 128 layers: every layer in one
  // launch sequence, the kept rows never leave the GPU. Otherwise layer by layer.
  std::size_t step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                   int n_layers) const override {
    if (!one_device_step(layers, queries, n_layers))
      return Policy::step_workspace_bytes(layers, queries, n_layers);
    return device_backend().rkv_step_workspace_bytes(layers, queries, n_layers, cfg_);
  }
  void compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                     const ExecContext& ctx) override {
    if (!one_device_step(layers, queries, n_layers))
      return Policy::compress_step(layers, queries, n_layers, ctx);
    device_backend().rkv_compress_step(layers, queries, n_layers, cfg_, ctx);
  }

  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    if (in.kv.device() != Device::cpu)
      return device_backend().rkv_select(in.kv, in.window_queries, cfg_, ctx);
    return cpu::select_scored_over_budget(in.kv, cfg_.selection(), [&](const std::uint8_t* over) {
      return cpu::rkv_scores(in.kv, in.window_queries, cfg_, over).score;
    });
  }

 private:
  static bool one_device_step(const KVCacheView* layers, const TensorView* queries, int n_layers) {
    check_step_args(layers, queries, n_layers);
    if (layers[0].device() == Device::cpu || n_layers > 128) return false;
    for (int l = 1; l < n_layers; ++l)
      if (layers[l].valid_mask != layers[0].valid_mask) return false;
    return true;
  }

  RKVConfig cfg_;
};

}  // namespace kvsift
