// ThinKV's one quantizer (Think Before you Quantize, docs/algorithms.md §3.2, with Continuous
// Thinking's refill rule, §3.4): new tokens wait in a 16-bit staging buffer per (thought type,
// KV head) until a whole quantization group of 16 tokens of that type has arrived; that group is
// then quantized with its own fresh scales (KIVI layout: keys per channel over the 16 tokens,
// values per token over 16 channels). A token is never encoded under another group's scale.
//
// The ThoughtBlockTable owns one per sequence and writes each finished group into a group-aligned
// run of 16 free slots of a block of its type; tests drive it directly.
//
// Choices (our choice, docs/thinkv.md §6):
//  - One buffer per thought type: a group never mixes types (a block has one precision), and a
//    partial group is never padded or flushed early when the type changes: it waits for the next
//    tokens of its type, so every stored group is a whole one with 16 real tokens.
//  - Staged tokens are live tokens: TBE may evict one (evict()), which simply drops it.
//  - The staging dtype is bf16 by default: the models ThinKV targets (R1-Llama-8B, R1-Qwen-7B/14B)
//    keep their KV cache in bf16, so bf16 staging stores their keys exactly and cannot overflow;
//    f16 (3 more mantissa bits, range ±65504) is the option for f16 engines.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kvsift/config/thought_type.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/paged/block_bytes.hpp"
#include "kvsift/quant/group_codec.hpp"

namespace kvsift {

struct StagedGroupQuantizerConfig {
  std::int32_t kv_heads = 8;
  std::int32_t head_dim = 128;  // a multiple of 16
  DType staging = DType::bf16;  // f16 or bf16
  // TBQ precision per thought type (R4 E4 T2 by default); f32 types are never staged.
  BlockFormat reasoning = BlockFormat::nvfp4;
  BlockFormat execution = BlockFormat::nvfp4;
  BlockFormat transition = BlockFormat::ternary;
  std::vector<float> global_factors;  // NVFP4 g per KV head: empty = 1
  // false: positions and counts only, no rows (a device table holds the data and seals the
  // groups; cuda::DeviceThinKV). take_group() then hands out positions only.
  bool holds_data = true;

  BlockFormat format_of(ThoughtType t) const {
    return t == ThoughtType::reasoning   ? reasoning
           : t == ThoughtType::execution ? execution
                                         : transition;
  }
  float global_factor(std::int32_t head) const {
    return global_factors.empty() ? 1.0f : global_factors[static_cast<std::size_t>(head)];
  }
  void validate() const {
    KVSIFT_CHECK(kv_heads > 0, "StagedGroupQuantizerConfig: kv_heads must be > 0, got ", kv_heads);
    KVSIFT_CHECK(head_dim > 0 && head_dim % kQuantGroupSize == 0,
                 "StagedGroupQuantizerConfig: head_dim (", head_dim,
                 ") must be a positive multiple of ", kQuantGroupSize);
    KVSIFT_CHECK(staging == DType::f16 || staging == DType::bf16,
                 "StagedGroupQuantizerConfig: staging dtype must be f16 or bf16, got ",
                 dtype_name(staging));
    KVSIFT_CHECK(
        global_factors.empty() || static_cast<std::int64_t>(global_factors.size()) == kv_heads,
        "StagedGroupQuantizerConfig: global_factors has ", global_factors.size(),
        " entries, expected 0 or kv_heads = ", kv_heads);
  }
};

// 16 tokens of one (thought type, KV head), quantized together with their own scales.
struct QuantizedGroup {
  BlockFormat format = BlockFormat::nvfp4;
  std::int32_t positions[kQuantGroupSize] = {};  // generation positions, ascending
  std::vector<std::uint8_t> key_codes;           // [head_dim, code bytes]: channel c's group
  std::vector<std::uint8_t> key_scales;          // [head_dim]
  std::vector<std::uint8_t> value_codes;         // [16, head_dim / 16, code bytes]
  std::vector<std::uint8_t> value_scales;        // [16, head_dim / 16]
};

// The group quantization itself (the one definition the table, the pipeline and the tests use):
// keys, values [16, head_dim] (rows `row_stride` floats apart) → out's codes and fresh scales.
inline void quantize_token_group(BlockFormat format, const float* keys, const float* values,
                                 std::int64_t head_dim, std::int64_t row_stride,
                                 float global_factor, QuantizedGroup& out) {
  KVSIFT_CHECK(is_quantized(format), "quantize_token_group: format f32 is not quantized");
  const QuantFormat q = quant_format_of(format);
  const int cb = code_bytes_per_group(q);
  const std::int64_t per_token = head_dim / kQuantGroupSize;
  out.format = format;
  out.key_codes.assign(static_cast<std::size_t>(head_dim * cb), 0);
  out.key_scales.assign(static_cast<std::size_t>(head_dim), 0);
  out.value_codes.assign(static_cast<std::size_t>(kQuantGroupSize * per_token * cb), 0);
  out.value_scales.assign(static_cast<std::size_t>(kQuantGroupSize * per_token), 0);
  for (std::int64_t c = 0; c < head_dim; ++c) {
    out.key_scales[static_cast<std::size_t>(c)] =
        quantize_group(q, keys + c, static_cast<long>(row_stride), kQuantGroupSize, global_factor,
                       &out.key_codes[static_cast<std::size_t>(c * cb)]);
  }
  for (std::int64_t t = 0; t < kQuantGroupSize; ++t) {
    for (std::int64_t b = 0; b < per_token; ++b) {
      const std::size_t g = static_cast<std::size_t>(t * per_token + b);
      out.value_scales[g] =
          quantize_group(q, values + t * row_stride + b * kQuantGroupSize, 1L, kQuantGroupSize,
                         global_factor, &out.value_codes[g * static_cast<std::size_t>(cb)]);
    }
  }
}

class StagedGroupQuantizer {
 public:
  explicit StagedGroupQuantizer(StagedGroupQuantizerConfig config) : config_(std::move(config)) {
    config_.validate();
    const std::size_t streams = static_cast<std::size_t>(kStagedThoughtTypes * config_.kv_heads);
    // Allocated once at full size: this is the buffer resident_bytes() reports (block_bytes.hpp).
    if (config_.holds_data) {
      keys_.assign(streams * kQuantGroupSize * static_cast<std::size_t>(config_.head_dim), 0);
      values_.assign(keys_.size(), 0);
    }
    positions_.assign(streams * kQuantGroupSize, -1);
    count_.assign(streams, 0);
  }

  const StagedGroupQuantizerConfig& config() const { return config_; }

  // Stages one token of one KV head; returns true when (type, head) then holds a whole group.
  // key, value: [head_dim], finite (ignored, and may be null, without holds_data). Positions must
  // grow within a stream.
  bool stage(ThoughtType type, std::int32_t head, std::int32_t position, const float* key,
             const float* value) {
    const std::size_t s = stream(type, head, "stage");
    KVSIFT_CHECK(count_[s] < kQuantGroupSize,
                 "StagedGroupQuantizer::stage: ", thought_type_name(type), " stream of kv head ",
                 head, " already holds a whole group (call take_group first)");
    KVSIFT_CHECK(count_[s] == 0 || positions_[s * kQuantGroupSize + count_[s] - 1] < position,
                 "StagedGroupQuantizer::stage: position ", position, " does not follow ",
                 positions_[s * kQuantGroupSize + count_[s] - 1]);
    if (config_.holds_data) {
      const std::int64_t D = config_.head_dim;
      KVSIFT_CHECK(key != nullptr && value != nullptr,
                   "StagedGroupQuantizer::stage: key and value must not be null");
      for (std::int64_t d = 0; d < D; ++d) {
        KVSIFT_CHECK(std::isfinite(key[d]) && std::isfinite(value[d]),
                     "StagedGroupQuantizer::stage: kv head ", head, " channel ", d,
                     " is not finite (key ", key[d], ", value ", value[d], ")");
      }
      const std::size_t row = (s * kQuantGroupSize + count_[s]) * static_cast<std::size_t>(D);
      for (std::int64_t d = 0; d < D; ++d) {
        keys_[row + d] = to_bits(key[d]);
        values_[row + d] = to_bits(value[d]);
      }
    }
    positions_[s * kQuantGroupSize + count_[s]] = position;
    return ++count_[s] == kQuantGroupSize;
  }

  int staged_count(ThoughtType type, std::int32_t head) const {
    return count_[stream(type, head, "staged_count")];
  }
  // Staged token i (0 .. staged_count - 1, in position order) of (type, head) as stored.
  std::int32_t staged_position(ThoughtType type, std::int32_t head, int i) const {
    return positions_[entry(type, head, i, "staged_position")];
  }
  void staged_token(ThoughtType type, std::int32_t head, int i, float* key,  // [head_dim]
                    float* value) const {                                    // [head_dim]
    check_holds_data("staged_token");
    const std::size_t row =
        entry(type, head, i, "staged_token") * static_cast<std::size_t>(config_.head_dim);
    for (std::int64_t d = 0; d < config_.head_dim; ++d) {
      key[d] = from_bits(keys_[row + d]);
      value[d] = from_bits(values_[row + d]);
    }
  }
  // The staged token at `position` in (type, head), or -1.
  int find(ThoughtType type, std::int32_t head, std::int32_t position) const {
    const std::size_t s = stream(type, head, "find");
    for (int i = 0; i < count_[s]; ++i)
      if (positions_[s * kQuantGroupSize + i] == position) return i;
    return -1;
  }
  // Drops staged token i of (type, head) (TBE evicted it before its group was quantized).
  void evict(ThoughtType type, std::int32_t head, int i) {
    const std::size_t e = entry(type, head, i, "evict");
    const std::size_t s = stream(type, head, "evict");
    const std::size_t last = s * kQuantGroupSize + count_[s] - 1;
    const std::size_t D = static_cast<std::size_t>(config_.head_dim);
    for (std::size_t j = e; j < last; ++j) {  // keep position order
      positions_[j] = positions_[j + 1];
      if (!config_.holds_data) continue;
      std::copy_n(&keys_[(j + 1) * D], D, &keys_[j * D]);
      std::copy_n(&values_[(j + 1) * D], D, &values_[j * D]);
    }
    positions_[last] = -1;
    --count_[s];
  }

  // Removes the n oldest staged tokens of (type, head) and hands them out as stored (decoded from
  // the staging dtype), for the table's regroup refill (thought_block_table.hpp): the caller
  // quantizes them together with a partly evicted group's survivors, never under old scales.
  // keys, values: [n, head_dim] (null, and not written, without holds_data); positions: [n],
  // ascending.
  void take_oldest(ThoughtType type, std::int32_t head, int n, float* keys, float* values,
                   std::int32_t* positions) {
    const std::size_t s = stream(type, head, "take_oldest");
    KVSIFT_CHECK(n >= 1 && n <= count_[s], "StagedGroupQuantizer::take_oldest: n = ", n,
                 " outside [1, ", count_[s], "] (", thought_type_name(type), " stream of kv head ",
                 head, ")");
    const std::size_t D = static_cast<std::size_t>(config_.head_dim);
    const std::size_t first = s * kQuantGroupSize;
    for (int i = 0; i < n; ++i) {
      if (config_.holds_data) staged_token(type, head, i, keys + i * D, values + i * D);
      positions[i] = positions_[first + i];
    }
    const int left = count_[s] - n;
    for (int j = 0; j < left; ++j) {  // the rest move to the front, in position order
      positions_[first + j] = positions_[first + j + n];
      if (!config_.holds_data) continue;
      std::copy_n(&keys_[(first + j + n) * D], D, &keys_[(first + j) * D]);
      std::copy_n(&values_[(first + j + n) * D], D, &values_[(first + j) * D]);
    }
    std::fill_n(&positions_[first + left], kQuantGroupSize - left, -1);
    count_[s] = left;
  }

  // Quantizes the whole staged group of (type, head) with fresh scales and empties the stream
  // (without holds_data: only out.format and out.positions are set; the codes are left empty).
  void take_group(ThoughtType type, std::int32_t head, QuantizedGroup& out) {
    const std::size_t s = stream(type, head, "take_group");
    KVSIFT_CHECK(
        count_[s] == kQuantGroupSize, "StagedGroupQuantizer::take_group: ", thought_type_name(type),
        " stream of kv head ", head, " holds ", count_[s], " of ", kQuantGroupSize, " tokens");
    if (config_.holds_data) {
      const std::size_t D = static_cast<std::size_t>(config_.head_dim);
      std::vector<float> k(kQuantGroupSize * D), v(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = from_bits(keys_[s * kQuantGroupSize * D + i]);
        v[i] = from_bits(values_[s * kQuantGroupSize * D + i]);
      }
      quantize_token_group(config_.format_of(type), k.data(), v.data(), config_.head_dim,
                           config_.head_dim, config_.global_factor(head), out);
    } else {
      out = QuantizedGroup{};
      out.format = config_.format_of(type);
    }
    std::copy_n(&positions_[s * kQuantGroupSize], kQuantGroupSize, out.positions);
    std::fill_n(&positions_[s * kQuantGroupSize], kQuantGroupSize, -1);
    count_[s] = 0;
  }

  // Bytes the buffers hold (block_bytes.hpp's staging_bytes).
  std::int64_t bytes() const {
    return static_cast<std::int64_t>((keys_.size() + values_.size()) * 2 + positions_.size() * 4);
  }

  // A float as staged: rounded to the staging dtype.
  float round(float x) const { return from_bits(to_bits(x)); }

 private:
  void check_holds_data(const char* fn) const {
    KVSIFT_CHECK(config_.holds_data, "StagedGroupQuantizer::", fn,
                 ": this buffer keeps positions only (holds_data = false); its rows are on the "
                 "device");
  }
  std::uint16_t to_bits(float x) const {
    return config_.staging == DType::f16 ? float_to_f16_bits(x) : float_to_bf16_bits(x);
  }
  float from_bits(std::uint16_t b) const {
    return config_.staging == DType::f16 ? f16_bits_to_float(b) : bf16_bits_to_float(b);
  }
  std::size_t stream(ThoughtType type, std::int32_t head, const char* fn) const {
    KVSIFT_CHECK(static_cast<int>(type) < kStagedThoughtTypes, "StagedGroupQuantizer::", fn,
                 ": unknown thought type code ", static_cast<int>(type));
    KVSIFT_CHECK(head >= 0 && head < config_.kv_heads, "StagedGroupQuantizer::", fn, ": kv head ",
                 head, " outside [0, ", config_.kv_heads, ")");
    return static_cast<std::size_t>(static_cast<int>(type) * config_.kv_heads + head);
  }
  std::size_t entry(ThoughtType type, std::int32_t head, int i, const char* fn) const {
    const std::size_t s = stream(type, head, fn);
    KVSIFT_CHECK(i >= 0 && i < count_[s], "StagedGroupQuantizer::", fn, ": staged token ", i,
                 " outside [0, ", count_[s], ")");
    return s * kQuantGroupSize + static_cast<std::size_t>(i);
  }

  StagedGroupQuantizerConfig config_;
  std::vector<std::uint16_t> keys_;      // [3 types, kv_heads, 16, head_dim] staging-dtype bits
  std::vector<std::uint16_t> values_;    // [3 types, kv_heads, 16, head_dim]
  std::vector<std::int32_t> positions_;  // [3 types, kv_heads, 16]
  std::vector<int> count_;               // [3 types, kv_heads]
};

}  // namespace kvsift
