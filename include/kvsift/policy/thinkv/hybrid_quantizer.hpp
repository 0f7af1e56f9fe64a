// ThinKV's Think Before you Quantize (TBQ, docs/algorithms.md §3.2): a KV cache stream per (layer,
// KV head) whose tokens are quantized with the precision of their thought type, default R4 E4 T2 (R
// and E as NVFP4, T as ternary; FP8 "R8" is an option per type).
//
// Layout (KIVI): keys are grouped per channel over 16 consecutive tokens, values per token over 16
// consecutive channels; one 8-bit scale per group (quant/format.hpp). New tokens wait in a
// full-precision buffer (keys and values) until 16 have arrived, then are quantized together.
//
// Groups never span thought types (our choice): when a token of another type arrives while the
// buffer holds k < 16 tokens, those k tokens are quantized at once as a short chunk with the
// precision of their own type; its key groups are padded with zeros to 16 tokens (zeros change
// neither amax nor the ternary choice) and cost a full group's bytes. Reasons: every group then has
// one precision, which the Continuous Thinking paged cache needs (§3.4: a block holds one type),
// and no R token is ever stored at T precision because it shared a group with T tokens. The cost is
// at most one padded key group per channel per type change, i.e. per 128-token refresh (§3.1).
//
// Byte accounting is exact for what the stream stores: codes + scales + the buffer in
// `buffer_dtype`. The fp32 NVFP4 global factors (two per stream) are metadata, reported apart.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/config/thought_type.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/limits.hpp"
#include "kvsift/quant/format.hpp"
#include "kvsift/quant/group_codec.hpp"

namespace kvsift {

struct HybridQuantizerConfig {
  int num_layers = 1;
  int num_kv_heads = 1;
  int head_dim = 128;                                    // a multiple of 16
  QuantFormat reasoning_format = QuantFormat::nvfp4;     // R4 (docs/algorithms.md §4)
  QuantFormat execution_format = QuantFormat::nvfp4;     // E4
  QuantFormat transition_format = QuantFormat::ternary;  // T2
  DType buffer_dtype = DType::f32;  // how the full-precision buffer stores tokens
  float key_global_factor = 1.0f;   // NVFP4 g of every stream's keys until set_global_factors()
  float value_global_factor = 1.0f;

  void validate() const {
    KVSIFT_CHECK(num_layers > 0 && num_layers <= kMaxLayers, "num_layers (", num_layers,
                 ") must be in [1, kMaxLayers = ", kMaxLayers, "]");
    KVSIFT_CHECK(num_kv_heads > 0, "num_kv_heads (", num_kv_heads, ") must be > 0");
    KVSIFT_CHECK(head_dim > 0 && head_dim % kQuantGroupSize == 0, "head_dim (", head_dim,
                 ") must be a positive multiple of ", kQuantGroupSize);
    for (QuantFormat f : {reasoning_format, execution_format, transition_format}) {
      KVSIFT_CHECK(f == QuantFormat::nvfp4 || f == QuantFormat::fp8 || f == QuantFormat::ternary,
                   "unknown quantization format code ", int(f));
    }
    KVSIFT_CHECK(std::isfinite(key_global_factor) && key_global_factor > 0.0f,
                 "key_global_factor (", key_global_factor, ") must be finite and > 0");
    KVSIFT_CHECK(std::isfinite(value_global_factor) && value_global_factor > 0.0f,
                 "value_global_factor (", value_global_factor, ") must be finite and > 0");
  }

  QuantFormat format_for(ThoughtType t) const {
    switch (t) {
      case ThoughtType::reasoning:
        return reasoning_format;
      case ThoughtType::execution:
        return execution_format;
      case ThoughtType::transition:
        return transition_format;
    }
    KVSIFT_FAIL("unknown thought type code ", int(t));
  }
};

// 1..16 consecutive tokens of one thought type in one stream, quantized together.
struct QuantizedChunk {
  ThoughtType type = ThoughtType::reasoning;
  QuantFormat format = QuantFormat::nvfp4;
  int tokens = 0;                          // 16, or fewer when a type change cut the group short
  std::vector<std::uint8_t> key_codes;     // [head_dim, code_bytes]: channel c's 16-token group
  std::vector<std::uint8_t> key_scales;    // [head_dim]
  std::vector<std::uint8_t> value_codes;   // [tokens, head_dim / 16, code_bytes]
  std::vector<std::uint8_t> value_scales;  // [tokens, head_dim / 16]
};

struct QuantBytes {
  std::int64_t code_bytes = 0;
  std::int64_t scale_bytes = 0;
  std::int64_t buffer_bytes = 0;
  std::int64_t global_factor_bytes = 0;  // metadata: 2 fp32 per stream, not in total()

  std::int64_t total() const { return code_bytes + scale_bytes + buffer_bytes; }
  QuantBytes& operator+=(const QuantBytes& o) {
    code_bytes += o.code_bytes;
    scale_bytes += o.scale_bytes;
    buffer_bytes += o.buffer_bytes;
    global_factor_bytes += o.global_factor_bytes;
    return *this;
  }
};

class HybridQuantizer {
 public:
  explicit HybridQuantizer(const HybridQuantizerConfig& config) : config_(config) {
    config_.validate();
    streams_.resize(static_cast<std::size_t>(config_.num_layers) * config_.num_kv_heads);
    for (Stream& s : streams_) {
      s.key_global_factor = config_.key_global_factor;
      s.value_global_factor = config_.value_global_factor;
    }
  }

  const HybridQuantizerConfig& config() const { return config_; }

  // NVFP4 global factors g of one stream (e.g. nvfp4_calibrated_global_factor of its amax, from a
  // calibration pass). One g per stream, so it can only be set before its first chunk exists.
  void set_global_factors(int layer, int head, float key_g, float value_g) {
    KVSIFT_CHECK(std::isfinite(key_g) && key_g > 0.0f && std::isfinite(value_g) && value_g > 0.0f,
                 "global factors (key ", key_g, ", value ", value_g, ") must be finite and > 0");
    Stream& s = stream(layer, head);
    KVSIFT_CHECK(s.chunks.empty(), "set_global_factors: layer ", layer, " head ", head,
                 " already has ", s.chunks.size(),
                 " quantized chunk(s); set global factors before the first");
    s.key_global_factor = key_g;
    s.value_global_factor = value_g;
  }
  float key_global_factor(int layer, int head) const {
    return stream(layer, head).key_global_factor;
  }
  float value_global_factor(int layer, int head) const {
    return stream(layer, head).value_global_factor;
  }

  // Appends one token to the stream of (layer, head). key, value: [head_dim], finite.
  template <class T>
  void append(int layer, int head, ThoughtType type, const T* key, const T* value) {
    Stream& s = stream(layer, head);
    const int d = config_.head_dim;
    (void)config_.format_for(type);  // rejects an invalid type code before anything changes
    for (int c = 0; c < d; ++c) {
      KVSIFT_CHECK(std::isfinite(to_float(key[c])) && std::isfinite(to_float(value[c])), "token ",
                   num_tokens(layer, head), " of layer ", layer, " head ", head,
                   " has a non-finite key or value at channel ", c, " (key ", to_float(key[c]),
                   ", value ", to_float(value[c]), ")");
    }
    if (s.buffered > 0 && s.buffer_type != type) quantize_buffer(s);
    s.buffer_type = type;
    for (int c = 0; c < d; ++c) {
      s.key_buffer.push_back(round_to_buffer(to_float(key[c])));
      s.value_buffer.push_back(round_to_buffer(to_float(value[c])));
    }
    if (++s.buffered == kQuantGroupSize) quantize_buffer(s);
  }

  // One decode step of one layer: every KV head gets a token of the same thought type.
  template <class T>
  void append_step(int layer, ThoughtType type,
                   const T* keys,      // [num_kv_heads, head_dim]
                   const T* values) {  // [num_kv_heads, head_dim]
    const std::int64_t d = config_.head_dim;
    for (int h = 0; h < config_.num_kv_heads; ++h) {
      append(layer, h, type, keys + h * d, values + h * d);
    }
  }

  // Quantizes a partial buffer now (a short chunk), e.g. at the end of a sequence.
  void flush(int layer, int head) {
    Stream& s = stream(layer, head);
    if (s.buffered > 0) quantize_buffer(s);
  }

  std::int64_t num_tokens(int layer, int head) const {
    const Stream& s = stream(layer, head);
    return s.quantized_tokens + s.buffered;
  }
  int buffered_tokens(int layer, int head) const { return stream(layer, head).buffered; }
  const std::vector<QuantizedChunk>& chunks(int layer, int head) const {
    return stream(layer, head).chunks;
  }

  // The stream's tokens in order, decoded to fp32 (buffered tokens as stored).
  void dequantize(int layer, int head,
                  float* keys,            // [num_tokens, head_dim]
                  float* values) const {  // [num_tokens, head_dim]
    const Stream& s = stream(layer, head);
    const int d = config_.head_dim, blocks = d / kQuantGroupSize;
    std::int64_t t0 = 0;
    for (const QuantizedChunk& ch : s.chunks) {
      const int cb = code_bytes_per_group(ch.format);
      for (int c = 0; c < d; ++c) {
        dequantize_group(ch.format, &ch.key_codes[c * cb], ch.key_scales[c], s.key_global_factor,
                         ch.tokens, keys + t0 * d + c, d);
      }
      for (int t = 0; t < ch.tokens; ++t) {
        for (int b = 0; b < blocks; ++b) {
          const int g = t * blocks + b;
          dequantize_group(ch.format, &ch.value_codes[g * cb], ch.value_scales[g],
                           s.value_global_factor, kQuantGroupSize,
                           values + (t0 + t) * d + b * kQuantGroupSize, 1);
        }
      }
      t0 += ch.tokens;
    }
    for (std::size_t i = 0; i < s.key_buffer.size(); ++i) {
      keys[t0 * d + static_cast<std::int64_t>(i)] = s.key_buffer[i];
      values[t0 * d + static_cast<std::int64_t>(i)] = s.value_buffer[i];
    }
  }

  QuantBytes bytes(int layer, int head) const {
    const Stream& s = stream(layer, head);
    QuantBytes b;
    for (const QuantizedChunk& ch : s.chunks) {
      b.code_bytes += static_cast<std::int64_t>(ch.key_codes.size() + ch.value_codes.size());
      b.scale_bytes += static_cast<std::int64_t>(ch.key_scales.size() + ch.value_scales.size());
    }
    b.buffer_bytes = static_cast<std::int64_t>(s.buffered) * 2 * config_.head_dim *
                     static_cast<std::int64_t>(dtype_size(config_.buffer_dtype));
    b.global_factor_bytes = 2 * 4;
    return b;
  }
  QuantBytes bytes() const {
    QuantBytes total;
    for (int l = 0; l < config_.num_layers; ++l)
      for (int h = 0; h < config_.num_kv_heads; ++h) total += bytes(l, h);
    return total;
  }

 private:
  struct Stream {
    std::vector<QuantizedChunk> chunks;
    std::vector<float> key_buffer, value_buffer;  // [buffered, head_dim], rounded to buffer_dtype
    int buffered = 0;
    ThoughtType buffer_type = ThoughtType::reasoning;
    std::int64_t quantized_tokens = 0;
    float key_global_factor = 1.0f, value_global_factor = 1.0f;
  };

  Stream& stream(int layer, int head) {
    check_stream(layer, head);
    return streams_[static_cast<std::size_t>(layer) * config_.num_kv_heads + head];
  }
  const Stream& stream(int layer, int head) const {
    check_stream(layer, head);
    return streams_[static_cast<std::size_t>(layer) * config_.num_kv_heads + head];
  }
  void check_stream(int layer, int head) const {
    KVSIFT_CHECK(layer >= 0 && layer < config_.num_layers, "layer (", layer, ") out of range [0, ",
                 config_.num_layers, ")");
    KVSIFT_CHECK(head >= 0 && head < config_.num_kv_heads, "head (", head, ") out of range [0, ",
                 config_.num_kv_heads, ")");
  }

  float round_to_buffer(float x) const {
    switch (config_.buffer_dtype) {
      case DType::f32:
        return x;
      case DType::f16:
        return f16_bits_to_float(float_to_f16_bits(x));
      case DType::bf16:
        return bf16_bits_to_float(float_to_bf16_bits(x));
    }
    return x;
  }

  void quantize_buffer(Stream& s) {
    const int d = config_.head_dim, blocks = d / kQuantGroupSize, n = s.buffered;
    QuantizedChunk ch;
    ch.type = s.buffer_type;
    ch.format = config_.format_for(s.buffer_type);
    ch.tokens = n;
    const int cb = code_bytes_per_group(ch.format);
    ch.key_codes.assign(static_cast<std::size_t>(d) * cb, 0);
    ch.key_scales.assign(static_cast<std::size_t>(d), 0);
    ch.value_codes.assign(static_cast<std::size_t>(n) * blocks * cb, 0);
    ch.value_scales.assign(static_cast<std::size_t>(n) * blocks, 0);
    for (int c = 0; c < d; ++c) {  // keys: channel c over the chunk's tokens (short: zero-padded)
      ch.key_scales[c] = quantize_group(ch.format, s.key_buffer.data() + c, d, n,
                                        s.key_global_factor, &ch.key_codes[c * cb]);
    }
    for (int t = 0; t < n; ++t) {  // values: token t over 16 channels at a time
      for (int b = 0; b < blocks; ++b) {
        const int g = t * blocks + b;
        ch.value_scales[g] =
            quantize_group(ch.format, s.value_buffer.data() + t * d + b * kQuantGroupSize, 1,
                           kQuantGroupSize, s.value_global_factor, &ch.value_codes[g * cb]);
      }
    }
    s.chunks.push_back(std::move(ch));
    s.quantized_tokens += n;
    s.buffered = 0;
    s.key_buffer.clear();
    s.value_buffer.clear();
  }

  HybridQuantizerConfig config_;
  std::vector<Stream> streams_;
};

}  // namespace kvsift
