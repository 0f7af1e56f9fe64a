// PM-KVQ (docs/algorithms.md §5.2) behind the cache-owning interface
// (policy/cache_owning_policy.hpp): one stream per (layer, sequence) — the reference runs one
// sequence, so each sequence has its layer's whole byte budget —, of the configured ordering
// (pmkvq.backend: real integer codes, or the fake in-place quantize-dequantize).
//   prefill(layer, k, v)   the stream's update 0 (the prompt, left pads skipped)
//   append(layer, k, v)    the step's token, held in full precision until end_step()
//   attention(layer, q)    over the dequantized [sink | body | window] of the previous step plus
//                          the step's own token in full precision (as the reference), GQA, exact
//                          softmax
//   end_step()             every stream's one-token update: sink/window append, window flush to
//                          the body, then the bit-width halving while the layer is over budget
// pmkvq.reference_exact = true keeps the reference's rule (codes-only budget, one halving per
// update, a PmkvqBudgetError — a kvsift::Error — where the reference raises; the policy should
// not be used after it). false (default): parameters counted, halvings repeated until the layer
// fits and below 2 bits the oldest body tokens evicted; end_step() returns true then.
// Storage dtype: the real ordering rounds inputs to bf16 (its reference's dtype), the fake one
// keeps fp32. Memory: resident_bytes counts codes as packed int16 words plus every scale and zero
// point (bf16 for real, fp32 for fake) in either mode, and a step's not-yet-quantized token at 16
// bits until end_step(); for the fake ordering this is the storage the simulated format would
// hold. Ragged batches: as KiviPolicy (pad_counts observed before prefill, padded slot numbering).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kvsift/config/pmkvq_config.hpp"
#include "kvsift/policy/quantizers/pmkvq_stream.hpp"
#include "kvsift/policy/quantizers/quantizing_policy.hpp"

namespace kvsift {

class PmkvqPolicy final : public QuantizingCachePolicy {
 public:
  explicit PmkvqPolicy(const PmkvqPolicyConfig& cfg);

  std::string_view name() const override { return "pmkvq"; }
  unsigned needs() const override { return kNeedsAppend; }
  std::int64_t batch() const override { return cfg_.batch; }
  const PmkvqPolicyConfig& config() const { return cfg_; }

  void prefill(int layer, const TensorView& keys, const TensorView& values) override;
  void append(int layer, const TensorView& keys, const TensorView& values) override;
  // Reads only a step-level obs.pad_counts (before prefill); per-layer observations are ignored.
  void observe(const Observation& obs) override;
  bool end_step() override;  // true when some stream evicted body tokens (graceful mode only)
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

  // The stream of (layer, sequence) and its body width.
  const PmkvqStreamBase& stream(int layer, std::int64_t seq) const;
  int n_bits(int layer, std::int64_t seq) const { return stream(layer, seq).n_bits(); }
  // Body tokens evicted so far (graceful mode), all streams.
  std::int64_t evicted_tokens() const { return evicted_; }

 private:
  std::size_t index(int layer, std::int64_t seq, const char* who) const;
  bool real() const { return cfg_.pmkvq.backend == PmkvqBackend::real; }
  DType storage() const { return real() ? DType::bf16 : DType::f32; }
  // Feeds u tokens of one sequence, element (h, t, d) at [h·src_seq·D + t·D + d].
  PmkvqUpdateResult update(std::size_t i, const float* keys, const float* values, std::int64_t u,
                           std::int64_t src_seq);
  // [n, D] dequantized keys (kv = 0) or values (kv = 1) of one head, pending token included.
  std::vector<float> rows(std::size_t i, std::int64_t kv_head, int kv) const;

  PmkvqPolicyConfig cfg_;
  std::vector<std::unique_ptr<PmkvqRealStream>> real_;  // [num_layers, batch] (real ordering)
  std::vector<std::unique_ptr<PmkvqFakeStream>> fake_;  // [num_layers, batch] (fake ordering)
  std::vector<std::int64_t> fed_;                       // [num_layers, batch] real tokens given
  std::vector<float> pending_k_, pending_v_;            // [num_layers, batch, kv_heads, head_dim]
  std::vector<bool> prefilled_, appended_;              // [num_layers]
  std::vector<std::int64_t> pads_;                      // [batch]
  bool any_prefilled_ = false;
  bool last_quantized_ = false;
  std::int64_t quantization_steps_ = 0;
  std::int64_t evicted_ = 0;
};

}  // namespace kvsift
