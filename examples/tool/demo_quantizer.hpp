// The quantizers in the demo (KIVI, PM-KVQ; docs/algorithms.md §5.1–5.2): the registry's
// cache-owning policies (make_cache_owning_policy, policy/quantizers/), driven from observe() —
// every layer's token appended, then end_step() — and asked for what the runner measures: their
// own bytes (codes + scales + zero points + full-precision buffers), their resident positions
// (every token: they evict nothing at the demo's settings), and where attention goes on their
// dequantized keys. Their trigger never fires: there is nothing to select() or compact().
//   compressions  quantization events (QuantizingCachePolicy): KIVI — steps in which the
//                 full-precision key buffer (R = 128 tokens) was flushed into 2-bit groups;
//                 PM-KVQ — steps in which its 128-token 16-bit window was flushed into the body
//                 or the body's width was halved. ms = that end_step() time.
//   recall@k      share of FullKV's top-k attended tokens among the top-k by the dequantized
//                 keys (what attention over the quantized cache would favour), over the
//                 queries after each event.
// Settings: KIVI's defaults (2-bit keys and values, G = 32, R = 128). PM-KVQ: group = head_dim,
// sink 1, window 128, graceful mode; its byte budget per (layer, sequence) is a quarter of an
// fp16 cache of the whole decode (at least what fits it at 2 bits without evicting, for short
// decodes), so that it walks 16 → 8 → 4 → 2 bits over the default run and needs no eviction (the
// demo's token budget means nothing to a quantizer).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "demo_metrics.hpp"
#include "demo_policy.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/quantizers/pmkvq_policy.hpp"
#include "kvsift/policy/quantizers/quantizing_policy.hpp"
#include "kvsift/policy/registry.hpp"

namespace kvsift::demo {

// PM-KVQ's byte budget per (layer, sequence) in the demo: a quarter of an fp16 K+V cache of the
// whole decode, or, for short decodes, the least that surely fits it without evicting: the sink
// and a full 128-token window at 16 bits plus every token at 2 bits (one group of head_dim per
// token and head, a bf16 scale and zero each).
inline std::int64_t pmkvq_demo_budget_bytes(int kv_heads, int head_dim, std::int64_t length) {
  const std::int64_t quarter = length * kv_heads * head_dim * 2 * 2 / 4;
  const std::int64_t at16 = 2 * head_dim + 4, at2 = head_dim / 4 + 4;  // bytes per token-head
  const std::int64_t least = 2 * kv_heads * ((1 + 128) * at16 + length * at2);
  return std::max(quarter, least);
}

// The JSON config the demo gives quantizer `name` for this geometry and decode length.
inline std::string quantizer_demo_config(const std::string& name, std::int64_t batch, int layers,
                                         int kv_heads, int q_heads, int head_dim,
                                         std::int64_t length) {
  std::string json =
      "{\"batch\": " + std::to_string(batch) + ", \"num_layers\": " + std::to_string(layers) +
      ", \"kv_heads\": " + std::to_string(kv_heads) + ", \"q_heads\": " + std::to_string(q_heads) +
      ", \"head_dim\": " + std::to_string(head_dim);
  if (name == "pmkvq") {
    const double bytes = static_cast<double>(pmkvq_demo_budget_bytes(kv_heads, head_dim, length));
    char mib[40];
    std::snprintf(mib, sizeof mib, "%.17g", bytes / 1048576.0);  // a power-of-two quotient: exact
    json += ", \"group_size\": " + std::to_string(head_dim) + ", \"kv_budget_mb\": [" + mib + "]";
  }
  return json + "}";
}

class QuantizerDemoPolicy final : public DemoPolicy {
 public:
  QuantizerDemoPolicy(std::string name, std::int64_t length)
      : name_(std::move(name)), length_(length) {
    KVSIFT_CHECK(length >= 1, "QuantizerDemoPolicy: length must be >= 1, got ", length);
  }

  std::string name() const override { return name_; }

  void observe(const DecodeStep& step, const std::vector<DemoLayerCache>& caches) override {
    using Clock = std::chrono::steady_clock;
    last_ = SelfCompression{};
    if (!policy_) start(step, static_cast<int>(caches.size()));
    for (int l = 0; l < layers_; ++l)  // [batch, kv_heads, 1, head_dim] of layer l
      policy_->append(l, row_view(step.key(l, 0, 0)), row_view(step.value(l, 0, 0)));
    const auto t0 = Clock::now();
    policy_->end_step();
    const auto t1 = Clock::now();
    if (policy_->last_step_quantized()) {
      last_.happened = true;
      last_.ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    }
    cached_ = -1;
  }

  bool should_compress(const KVCacheView&) override { return false; }
  KeepPlan select(const StepInputs&) override {
    KVSIFT_CHECK(false, "QuantizerDemoPolicy::select: ", name_,
                 " quantizes inside end_step(), never by select()");
    return {};
  }
  SelfCompression self_compression() const override { return last_; }

  std::int64_t resident_bytes(const DemoLayerCache& cache, int layer) const override {
    return policy_ ? policy_->resident_bytes(layer) : cache.resident_bytes();
  }
  const std::int32_t* resident_positions(const DemoLayerCache& cache, int layer, int b, int h,
                                         std::int64_t& n) const override {
    if (!policy_) {
      n = cache.length(b);
      return cache.positions(b, h);
    }
    positions_ = policy_->resident_positions(layer, b, h);
    n = static_cast<std::int64_t>(positions_.size());
    return positions_.data();
  }
  bool attended_positions(int layer, int b, int q_head, const float* query, int k,
                          std::vector<std::int32_t>& top) const override {
    if (!policy_) return false;
    const int h = q_head / (q_heads_ / kv_heads_);
    const int index = (layer * batch_ + b) * kv_heads_ + h;
    if (index != cached_) {  // one dequantization per KV head and step, shared by its group
      keys_ = policy_->dequantized_keys(layer, b, h);
      key_positions_ = policy_->resident_positions(layer, b, h);
      cached_ = index;
    }
    const std::vector<std::int32_t> j = top_k_attended(
        query, keys_.data(), static_cast<std::int64_t>(key_positions_.size()), head_dim_, k);
    top.clear();
    for (std::int32_t i : j) top.push_back(key_positions_[static_cast<std::size_t>(i)]);
    std::sort(top.begin(), top.end());
    return true;
  }
  // KIVI's widths and residual; PM-KVQ's body width at the end (lowest-highest over layers and
  // sequences).
  std::vector<std::pair<std::string, std::string>> extra_columns() const override {
    std::string cell = "-";
    if (const auto* pm = dynamic_cast<const PmkvqPolicy*>(policy_.get())) {
      int lo = 16, hi = 0;
      for (int l = 0; l < layers_; ++l)
        for (int b = 0; b < batch_; ++b) {
          lo = std::min(lo, pm->n_bits(l, b));
          hi = std::max(hi, pm->n_bits(l, b));
        }
      cell = "body " + std::to_string(lo) + (lo == hi ? "" : "-" + std::to_string(hi)) + " bit";
    } else if (policy_) {
      cell = "K2 V2, R 128";
    }
    return {{"quantized as", cell}};
  }

  // For tests: the library policy, nullptr before the first step.
  const QuantizingCachePolicy* policy() const { return policy_.get(); }

 private:
  TensorView row_view(const float* p) const {
    return TensorView::contiguous(const_cast<float*>(p), DType::f32, Device::cpu,
                                  {batch_, kv_heads_, 1, head_dim_});
  }

  // Built on the first step, when the geometry is known; every layer gets an empty prompt.
  void start(const DecodeStep& step, int layers) {
    layers_ = layers;
    batch_ = step.batch;
    kv_heads_ = step.kv_heads;
    q_heads_ = step.q_heads;
    head_dim_ = step.head_dim;
    const std::string config =
        quantizer_demo_config(name_, batch_, layers_, kv_heads_, q_heads_, head_dim_, length_);
    std::unique_ptr<CacheOwningPolicy> p = make_cache_owning_policy(name_, config);
    auto* q = dynamic_cast<QuantizingCachePolicy*>(p.get());
    KVSIFT_CHECK(q != nullptr, "kvsift demo: '", name_, "' is not a quantizer");
    p.release();
    policy_.reset(q);
    float none = 0.0f;  // [batch, kv_heads, 0, head_dim]
    const TensorView empty =
        TensorView::contiguous(&none, DType::f32, Device::cpu, {batch_, kv_heads_, 0, head_dim_});
    for (int l = 0; l < layers_; ++l) policy_->prefill(l, empty, empty);
  }

  std::string name_;
  std::int64_t length_;
  int layers_ = 0, batch_ = 0, kv_heads_ = 0, q_heads_ = 0, head_dim_ = 0;
  std::unique_ptr<QuantizingCachePolicy> policy_;
  SelfCompression last_;
  mutable std::vector<std::int32_t> positions_;  // scratch for resident_positions()
  mutable int cached_ = -1;                      // (layer, b, h) whose keys_ are cached
  mutable std::vector<float> keys_;              // [n, head_dim] dequantized
  mutable std::vector<std::int32_t> key_positions_;
};

}  // namespace kvsift::demo
