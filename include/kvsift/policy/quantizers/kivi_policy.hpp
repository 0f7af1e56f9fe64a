// KIVI (docs/algorithms.md §5.1) behind the cache-owning interface
// (policy/cache_owning_policy.hpp): one KiviStream per layer (the stream holds the batch), fed from
// batched engine tensors.
//   prefill(layer, k, v)   the stream's prefill rule per sequence (left pads skipped, below)
//   append(layer, k, v)    the step's token in full precision
//   attention(layer, q)    over [dequantized quantized part; full-precision buffers], GQA, exact
//                          softmax (the step sees the previous step's quantized state: quantize
//                          after use, as the reference)
//   end_step()             every layer's after-attention hook: the key buffer flushed at R tokens,
//                          the value window's oldest token quantized past R + 1
// K/V are stored as the reference stores them, fp16: inputs are rounded to fp16 on the way in.
// Memory: packed int32 code words, one fp16 scale and one fp16 minimum per group, the fp16
// full-precision keys and values (KiviStream::bytes). KIVI evicts nothing: every real token is
// resident, end_step() never reports an eviction.
// Ragged batches: a step-level observe() with pad_counts ([batch] left pads of the prompt) before
// the first prefill(); sequence b's first pad_counts[b] prompt slots are skipped and never stored,
// its positions keep the padded slot numbering (prompt slot i is position i, decode step s is
// prompt + s). Decode steps advance every sequence together (no pads after the prompt).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "kvsift/config/kivi_config.hpp"
#include "kvsift/policy/quantizers/kivi.hpp"
#include "kvsift/policy/quantizers/quantizing_policy.hpp"

namespace kvsift {

class KiviPolicy final : public QuantizingCachePolicy {
 public:
  explicit KiviPolicy(const KiviPolicyConfig& cfg);

  std::string_view name() const override { return "kivi"; }
  unsigned needs() const override { return kNeedsAppend; }
  std::int64_t batch() const override { return cfg_.batch; }
  const KiviPolicyConfig& config() const { return cfg_; }

  void prefill(int layer, const TensorView& keys, const TensorView& values) override;
  void append(int layer, const TensorView& keys, const TensorView& values) override;
  // Reads only a step-level obs.pad_counts (before prefill); per-layer observations are ignored.
  void observe(const Observation& obs) override;
  bool end_step() override;  // always false: KIVI evicts nothing
  void attention(int layer, const TensorView& queries, const TensorView& out) const override;

  std::int64_t resident_bytes(int layer) const override;
  std::int64_t resident_bytes() const override;
  std::int64_t fullkv_fp16_bytes() const override;
  std::vector<std::int32_t> resident_positions(int layer, std::int64_t seq,
                                               std::int64_t kv_head) const override;

  bool last_step_quantized() const override { return last_quantized_; }
  std::int64_t quantization_steps() const override { return quantization_steps_; }
  std::vector<float> dequantized_keys(int layer, std::int64_t seq,
                                      std::int64_t kv_head) const override;

  const KiviStream& stream(int layer) const;

 private:
  std::size_t layer_index(int layer, const char* who) const;
  std::int64_t tokens(std::size_t layer, std::int64_t seq) const;

  KiviPolicyConfig cfg_;
  std::vector<KiviStream> layers_;  // [num_layers]
  std::vector<bool> prefilled_;     // [num_layers]
  std::vector<bool> appended_;      // [num_layers] this step
  std::vector<std::int64_t> pads_;  // [batch] left pads of the prompt
  bool any_prefilled_ = false;
  bool last_quantized_ = false;
  std::int64_t quantization_steps_ = 0;
};

}  // namespace kvsift
