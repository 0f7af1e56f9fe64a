// kvsift::cuda asymmetric min-max group codec: KIVI (docs/algorithms.md §5.1) and PM-KVQ (§5.2)
// quantize / dequantize on device tensors, and PM-KVQ's exact integer right-shift requantization
// (ERS, 16 → 8 → 4 → 2 bits), bit for bit the host codec of quant/asymmetric_group.hpp and
// quant/pmkvq_codec.hpp: the same codes, the same packed words, the same scales and zero points,
// the same dequantized floats.
//
// Bit-identity rule: every operation of the host codec is done on the GPU in fp32 (or in the
// emulated fp16/bf16 of AsymmetricQuantSpec::arith, rounded by the shared host/device conversions
// of core/dtype.hpp) in the same order, with explicitly rounded intrinsics (__fsub_rn, __fdiv_rn,
// __fmul_rn, __fadd_rn) and the file compiled with -fmad=false, so no multiply-add is ever fused
// (the host build targets baseline x86-64, which has no FMA). The one thing that may differ is
// the SIGN of a zero scale or zero point: fmin(+0, −0) may return either zero on either side; the
// value, every code and every dequantized float are unaffected (q·s is +0, and +0 ± ±0 is +0).
//
// Layout. The input is a contiguous device tensor x [slabs, tokens, channels] (a slab is one KV
// head of one sequence, i.e. [batch·kv_heads, tokens, head_dim]). Groups of `group` elements run
// along one axis (quant/kivi_layout.hpp GroupAxis); the last group of an axis whose extent is
// not a multiple of `group` is partial (it holds the remaining elements and is quantized alone,
// as asym_quantize_group with that count):
//   GroupAxis::token   (KIVI keys, "per channel"): group gb of channel d holds tokens
//                      [gb·G, min((gb+1)·G, tokens)). Packing unit = one channel of one slab:
//                      words   [slabs, channels, ceil(tokens / per)]
//                      params  [slabs, channels, ceil(tokens / G)]
//   GroupAxis::channel (KIVI values, "per token"; PM-KVQ keys and values): group gc of token t
//                      holds channels [gc·G, min((gc+1)·G, channels)). Packing unit = one token:
//                      words   [slabs, tokens, ceil(channels / per)]
//                      params  [slabs, tokens, ceil(channels / G)]
// per = word_bits / bits codes per word, packed as quant/asymmetric_group.hpp pack_codes packs one
// unit (PackOrder::lsb_first: code j at bits [b·j, b·j + b), KIVI's int32 words; msb_first: code 0
// in the top bits, PM-KVQ's int16 words); a unit's partial last word is zero-filled. G must be a
// multiple of `per` so that every group owns whole words (KiviConfig requires it; PM-KVQ's G = 128
// satisfies it at every width): for PM-KVQ this is also the per-group packing of pack_msb_first.
// Words are uint32 for word_bits = 32 and uint16 for word_bits = 16 (the int32/int16 words of the
// references reinterpreted). Scales and zero points are fp32 numbers (already rounded to `arith`).
//
// All calls validate on the host (throwing kvsift::Error naming the argument, nothing enqueued),
// then only enqueue on `stream`: no allocation, no synchronisation, no workspace. Non-finite inputs
// give unspecified codes (as on the host).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/tensor_view.hpp"
#include "kvsift/quant/asymmetric_group.hpp"
#include "kvsift/quant/kivi_layout.hpp"

namespace kvsift::cuda {

// The packed form of a [slabs, tokens, channels] tensor (device memory owned by the caller).
struct DeviceAsymPacked {
  AsymmetricQuantSpec spec;  // bits, zero convention, arithmetic, scale clamp
  GroupAxis axis = GroupAxis::token;
  int group = 32;                          // G
  int word_bits = 32;                      // 32 (uint32 words) or 16 (uint16 words)
  PackOrder order = PackOrder::lsb_first;  // KIVI lsb_first, PM-KVQ msb_first
  std::int64_t slabs = 0, tokens = 0, channels = 0;
  void* words = nullptr;    // device [slabs, units, words_per_unit()] uint32 or uint16
  float* scales = nullptr;  // device [slabs, units, groups_per_unit()]
  float* zeros = nullptr;   // device [slabs, units, groups_per_unit()]

  int codes_per_word() const { return word_bits / spec.bits; }
  // A unit is a channel (token axis) or a token (channel axis); its codes run along the axis.
  std::int64_t units_per_slab() const { return axis == GroupAxis::token ? channels : tokens; }
  std::int64_t unit_extent() const { return axis == GroupAxis::token ? tokens : channels; }
  std::int64_t words_per_unit() const {
    return (unit_extent() + codes_per_word() - 1) / codes_per_word();
  }
  std::int64_t groups_per_unit() const { return (unit_extent() + group - 1) / group; }
  std::int64_t num_words() const { return slabs * units_per_slab() * words_per_unit(); }
  std::int64_t num_groups() const { return slabs * units_per_slab() * groups_per_unit(); }
  std::int64_t word_bytes() const { return num_words() * (word_bits / 8); }

  // Throws kvsift::Error naming the field for an invalid spec, non-positive or overflowing
  // shapes, word_bits not 16/32, bits not dividing word_bits, G not a multiple of the codes per
  // word, or a null pointer.
  void validate(const char* op) const;
};

// How dequantize() computes x̂ (before the one rounding to the output dtype):
//   f32          quant/asymmetric_group.hpp asym_dequantize: q·s + m (add_min) or q·s − z
//                (subtract_zero) in fp32 (KIVI, PM-KVQ's fake backend pmkvq::dequantize_f32)
//   pmkvq_bf16   pmkvq::dequantize_bf16: bf16(bf16(bf16(q)·s) − z) (PM-KVQ's real backend)
enum class AsymDequantMode : std::uint8_t { f32, pmkvq_bf16 };

// Quantizes x into q.words / q.scales / q.zeros.
//   x  device [q.slabs, q.tokens, q.channels], f32/f16/bf16, contiguous
void asym_quantize(const TensorView& x, const DeviceAsymPacked& q, cudaStream_t stream);

// Decodes q into out; the f32 value of `mode` rounded once to out's dtype (round to nearest even).
//   out  device [q.slabs, q.tokens, q.channels], f32/f16/bf16, contiguous
void asym_dequantize(const DeviceAsymPacked& q, AsymDequantMode mode, const TensorView& out,
                     cudaStream_t stream);

// KIVI's two groupings (keys per channel over G tokens, values per token over G channels), fp16
// arithmetic, add_min zeros, no scale clamp, int32 words LSB first: the spec KiviStream uses.
DeviceAsymPacked kivi_keys_layout(int bits, int group, std::int64_t slabs, std::int64_t tokens,
                                  std::int64_t channels);
DeviceAsymPacked kivi_values_layout(int bits, int group, std::int64_t slabs, std::int64_t tokens,
                                    std::int64_t channels);

// PM-KVQ's quantizer Q_n (pmkvq::quant_spec: subtract_zero, s clamped to [1e-5, 1e5] rounded to
// the arithmetic, fp32 quotient at 16 bits) per token over G channels, int16 words MSB first.
// bf16_arith: true for the real backend (bf16 inputs), false for the fake backend (fp32).
DeviceAsymPacked pmkvq_layout(int n_bits, bool bf16_arith, int group, std::int64_t slabs,
                              std::int64_t tokens, std::int64_t channels);

// PM-KVQ's exact right shift from `from_bits` to `to_bits` (both in {16, 8, 4, 2}, to < from),
// applied once per halving, as PmkvqRealStream::flush / halve_body do: for w = from/2 down to to,
// q ← ((2^{2w} − 2^w + 1)·q + 2^{3w−1} − 2^{2w−1} + 2^{w−1}) >> 3w (pmkvq::ers_code) and
// s ← bf16(s·(2^w + 1)) (pmkvq::ers_scale); zero points are unchanged.
//   in_words   device [count / (16 / from_bits)] uint16, MSB first (count codes, whole words)
//   out_words  device [count / (16 / to_bits)] uint16, MSB first; must not overlap in_words
//   scales     device [groups] fp32, updated in place (may be nullptr when groups == 0)
// count must be a multiple of 16 / to_bits (whole output words: a PM-KVQ token of head_dim
// channels, head_dim a multiple of 8, always is).
void pmkvq_requantize(const std::uint16_t* in_words, int from_bits, std::int64_t count,
                      std::uint16_t* out_words, int to_bits, float* scales, std::int64_t groups,
                      cudaStream_t stream);

}  // namespace kvsift::cuda
