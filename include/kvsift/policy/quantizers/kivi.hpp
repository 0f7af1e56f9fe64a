// KIVI (docs/algorithms.md §5.1): 2/4-bit asymmetric KV quantization with a full-precision
// residual, as a stream object over a batch of sequences of one layer:
//   prefill(keys, values, lengths)    the schedule's prefill rule per sequence
//   append(k, v)                      a decode step's new token, full precision
//   attend(q, out)                    attention over what this step sees
//   after_attention()                 flush: R full keys → quantized; the value window's oldest
// Keys are grouped per channel (G consecutive tokens of one channel), values per token (G
// consecutive channels). Arithmetic is fp16 (emulated exactly, quant/asymmetric_group.hpp); a
// constant group gets code 0 and dequantizes to m exactly (the reference gives 0/0 = NaN).
// Ragged batches: `lengths[b]` real tokens of sequence b at the END of the padded prefill (left
// pads are skipped); each sequence follows its own schedule.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cpu/dense_attention.hpp"
#include "kvsift/config/kivi_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/quant/asymmetric_group.hpp"

namespace kvsift {

// One KV head of one sequence: the quantized prefix and the full-precision tail.
struct KiviHeadState {
  // Keys: codes and params per token-block group; kq_codes [Tqk, D], kq_params [Tqk / G, D].
  std::vector<std::uint16_t> kq_codes;
  std::vector<GroupParams> kq_params;
  std::vector<float> k_full;  // [Tfk, D]
  // Values: vq_codes [Tqv, D], vq_params [Tqv, D / G].
  std::vector<std::uint16_t> vq_codes;
  std::vector<GroupParams> vq_params;
  std::vector<float> v_full;  // [Tfv, D]
};

struct KiviLengths {
  std::int64_t quantized_keys = 0, full_keys = 0, quantized_values = 0, full_values = 0;
};

class KiviStream {
 public:
  KiviStream(const KiviConfig& cfg, int batch, int kv_heads, int head_dim)
      : cfg_(cfg), batch_(batch), kv_heads_(kv_heads), dim_(head_dim) {
    cfg_.validate();
    KVSIFT_CHECK(batch >= 1 && kv_heads >= 1, "KiviStream: batch (", batch, ") and kv_heads (",
                 kv_heads, ") must be >= 1");
    KVSIFT_CHECK(head_dim >= 1 && head_dim % cfg.group_size == 0, "KiviStream: head_dim (",
                 head_dim, ") must be a positive multiple of group_size (", cfg.group_size, ")");
    heads_.resize(static_cast<std::size_t>(batch) * kv_heads);
    kspec_.bits = cfg.k_bits;
    vspec_.bits = cfg.v_bits;
  }

  const KiviConfig& config() const { return cfg_; }
  int batch() const { return batch_; }
  int kv_heads() const { return kv_heads_; }
  int head_dim() const { return dim_; }
  const KiviHeadState& head(int b, int h) const { return heads_[index(b, h)]; }

  // keys, values: fp16-representable fp32. lengths: [batch] real tokens (left-padded), or empty
  // when every sequence uses all `tokens`.
  void prefill(const float* keys,    // [batch, kv_heads, tokens, head_dim]
               const float* values,  // [batch, kv_heads, tokens, head_dim]
               std::int64_t tokens, const std::vector<std::int64_t>& lengths = {}) {
    KVSIFT_CHECK(!prefilled_, "KiviStream: prefill called twice");
    KVSIFT_CHECK(tokens >= 0, "KiviStream: prefill tokens (", tokens, ") must be >= 0");
    KVSIFT_CHECK(lengths.empty() || static_cast<int>(lengths.size()) == batch_,
                 "KiviStream: lengths has ", lengths.size(), " entries, batch is ", batch_);
    const std::int64_t R = cfg_.residual_length;
    for (int b = 0; b < batch_; ++b) {
      const std::int64_t T = lengths.empty() ? tokens : lengths[static_cast<std::size_t>(b)];
      KVSIFT_CHECK(T >= 0 && T <= tokens, "KiviStream: lengths[", b, "] (", T, ") must be in [0, ",
                   tokens, "]");
      const std::int64_t pad = tokens - T;
      const std::int64_t kq = T < R ? 0 : T - T % R;
      const std::int64_t vq = T <= R ? 0 : T - R;
      for (int h = 0; h < kv_heads_; ++h) {
        KiviHeadState& s = heads_[index(b, h)];
        const std::size_t base = (static_cast<std::size_t>(b) * kv_heads_ + h) * tokens + pad;
        const float* k = keys + base * dim_;
        const float* v = values + base * dim_;
        if (kq > 0) quantize_keys(s, k, kq);
        s.k_full.assign(k + kq * dim_, k + T * dim_);
        for (std::int64_t t = 0; t < vq; ++t) quantize_value(s, v + t * dim_);
        s.v_full.assign(v + vq * dim_, v + T * dim_);
      }
    }
    prefilled_ = true;
  }

  // One decode token per sequence (all sequences advance together).
  void append(const float* k,    // [batch, kv_heads, head_dim]
              const float* v) {  // [batch, kv_heads, head_dim]
    KVSIFT_CHECK(prefilled_, "KiviStream: append before prefill");
    for (std::size_t i = 0; i < heads_.size(); ++i) {
      heads_[i].k_full.insert(heads_[i].k_full.end(), k + i * dim_, k + (i + 1) * dim_);
      heads_[i].v_full.insert(heads_[i].v_full.end(), v + i * dim_, v + (i + 1) * dim_);
    }
  }

  // The step's quantize-after-use: keys when the buffer holds R, the oldest value at R + 1.
  void after_attention() {
    const std::int64_t R = cfg_.residual_length;
    for (KiviHeadState& s : heads_) {
      if (static_cast<std::int64_t>(s.k_full.size()) == R * dim_) {
        quantize_keys(s, s.k_full.data(), R);
        s.k_full.clear();
      }
      if (static_cast<std::int64_t>(s.v_full.size()) == (R + 1) * dim_) {
        quantize_value(s, s.v_full.data());
        s.v_full.erase(s.v_full.begin(), s.v_full.begin() + dim_);
      }
    }
  }

  // softmax(q·[K̂q; K_full]ᵀ/√D)·[V̂q; V_full] in fp32 (double accumulation); query head h reads
  // KV head h / (q_heads / kv_heads). Each KV head is dequantized once for its query group.
  void attend(const float* q,  // [batch, q_heads, head_dim]
              int q_heads,
              float* out) const {  // [batch, q_heads, head_dim]
    KVSIFT_CHECK(q_heads >= kv_heads_ && q_heads % kv_heads_ == 0, "KiviStream: q_heads (", q_heads,
                 ") must be a multiple of kv_heads (", kv_heads_, ")");
    const int group = q_heads / kv_heads_;
    for (int b = 0; b < batch_; ++b)
      for (int h = 0; h < kv_heads_; ++h) {
        const KiviHeadState& s = heads_[index(b, h)];
        const std::vector<float> K = dequantized_keys(s), V = dequantized_values(s);
        const std::size_t first = (static_cast<std::size_t>(b) * q_heads + h * group) * dim_;
        dense_decode_attention(q + first, group, K.data(), V.data(),
                               static_cast<std::int64_t>(K.size()) / dim_, dim_, out + first);
      }
  }

  KiviLengths lengths(int b, int h) const {
    const KiviHeadState& s = heads_[index(b, h)];
    KiviLengths l;
    l.quantized_keys = static_cast<std::int64_t>(s.kq_codes.size()) / dim_;
    l.full_keys = static_cast<std::int64_t>(s.k_full.size()) / dim_;
    l.quantized_values = static_cast<std::int64_t>(s.vq_codes.size()) / dim_;
    l.full_values = static_cast<std::int64_t>(s.v_full.size()) / dim_;
    return l;
  }

  // [tokens, D] dequantized quantized keys then the full keys (fp32).
  std::vector<float> dequantized_keys(const KiviHeadState& s) const {
    const std::int64_t tq = static_cast<std::int64_t>(s.kq_codes.size()) / dim_;
    std::vector<float> K(static_cast<std::size_t>(tq * dim_));
    for (std::int64_t t = 0; t < tq; ++t)
      for (int d = 0; d < dim_; ++d)
        K[t * dim_ + d] = asym_dequantize(kspec_, s.kq_codes[t * dim_ + d],
                                          s.kq_params[(t / cfg_.group_size) * dim_ + d]);
    K.insert(K.end(), s.k_full.begin(), s.k_full.end());
    return K;
  }
  std::vector<float> dequantized_values(const KiviHeadState& s) const {
    const std::int64_t tq = static_cast<std::int64_t>(s.vq_codes.size()) / dim_;
    const int gpt = dim_ / cfg_.group_size;
    std::vector<float> V(static_cast<std::size_t>(tq * dim_));
    for (std::int64_t t = 0; t < tq; ++t)
      for (int d = 0; d < dim_; ++d)
        V[t * dim_ + d] = asym_dequantize(vspec_, s.vq_codes[t * dim_ + d],
                                          s.vq_params[t * gpt + d / cfg_.group_size]);
    V.insert(V.end(), s.v_full.begin(), s.v_full.end());
    return V;
  }

  // Bytes the whole stream holds: packed int32 code words, one fp16 scale and one fp16 minimum
  // per group, and the fp16 full-precision tokens.
  std::int64_t bytes() const {
    std::int64_t total = 0;
    for (std::size_t i = 0; i < heads_.size(); ++i) {
      const KiviLengths l =
          lengths(static_cast<int>(i / kv_heads_), static_cast<int>(i % kv_heads_));
      total += dim_ * asym_quantized_bytes(l.quantized_keys, l.quantized_keys / cfg_.group_size,
                                           cfg_.k_bits, 32, 2);
      total += l.quantized_values *
               asym_quantized_bytes(dim_, dim_ / cfg_.group_size, cfg_.v_bits, 32, 2);
      total += 2 * dim_ * (l.full_keys + l.full_values);
    }
    return total;
  }

 private:
  std::size_t index(int b, int h) const {
    KVSIFT_CHECK(b >= 0 && b < batch_ && h >= 0 && h < kv_heads_, "KiviStream: (batch ", b,
                 ", head ", h, ") out of range [", batch_, ", ", kv_heads_, ")");
    return static_cast<std::size_t>(b) * kv_heads_ + h;
  }
  void quantize_keys(KiviHeadState& s, const float* k, std::int64_t n) {  // k: [n, D]
    const std::size_t c0 = s.kq_codes.size(), p0 = s.kq_params.size();
    s.kq_codes.resize(c0 + static_cast<std::size_t>(n * dim_));
    s.kq_params.resize(p0 + static_cast<std::size_t>(n / cfg_.group_size * dim_));
    asym_quantize_tensor(kspec_, k, n, dim_, GroupAxis::token, cfg_.group_size,
                         s.kq_codes.data() + c0, s.kq_params.data() + p0);
  }
  void quantize_value(KiviHeadState& s, const float* v) {  // v: [D]
    const std::size_t c0 = s.vq_codes.size(), p0 = s.vq_params.size();
    s.vq_codes.resize(c0 + static_cast<std::size_t>(dim_));
    s.vq_params.resize(p0 + static_cast<std::size_t>(dim_ / cfg_.group_size));
    asym_quantize_tensor(vspec_, v, 1, dim_, GroupAxis::channel, cfg_.group_size,
                         s.vq_codes.data() + c0, s.vq_params.data() + p0);
  }

  KiviConfig cfg_;
  int batch_, kv_heads_, dim_;
  AsymmetricQuantSpec kspec_, vspec_;  // fp16 arithmetic, add_min, no clamp (defaults)
  std::vector<KiviHeadState> heads_;
  bool prefilled_ = false;
};

}  // namespace kvsift
