// What the quantizers (KIVI, PM-KVQ; docs/algorithms.md §5.1–5.2) add to the cache-owning
// interface (policy/cache_owning_policy.hpp): they evict nothing by design (PM-KVQ only past its
// narrowest width, in graceful mode), they move tokens to narrower codes. A "quantization event"
// is a decode step in which some (layer, sequence) did so for a block of tokens — KIVI: the
// full-precision key buffer of R tokens was flushed into b-bit groups; PM-KVQ: a window of W
// tokens was flushed into the body, or the body's width was halved. (KIVI's value window
// quantizes one token every step past R; that steady trickle is not counted.) Plus the keys
// attention reads, dequantized, for measuring where attention goes (the demo's recall).
// Also the helpers both share: batched engine views in, per-sequence contiguous rows out.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/observation.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "kvsift/policy/cache_owning_policy.hpp"
#include "kvsift/quant/asymmetric_group.hpp"

namespace kvsift {

class QuantizingCachePolicy : public CacheOwningPolicy {
 public:
  // Whether the last end_step() was a quantization event, and how many steps were.
  virtual bool last_step_quantized() const = 0;
  virtual std::int64_t quantization_steps() const = 0;
  // [n, head_dim] the keys attention reads for (layer, sequence, KV head), dequantized (full
  // precision where stored so), in the order of resident_positions(); n = its size.
  virtual std::vector<float> dequantized_keys(int layer, std::int64_t seq,
                                              std::int64_t kv_head) const = 0;
};

namespace quantizer_detail {

// A config after its validate() (throws kvsift::Error naming the field): for member initialisers.
template <class Config>
Config validated(Config c) {
  c.validate();
  return c;
}

// A host f32 [batch, heads, n, head_dim] view (any strides) as contiguous rows in the same order,
// each value rounded to `storage` (the dtype the method's reference stores K/V in). n < 0: any.
// Never empty, so that .data() is a valid pointer even for n = 0.
inline std::vector<float> gather(const TensorView& t, std::int64_t batch, std::int64_t heads,
                                 std::int64_t n, std::int64_t head_dim, DType storage,
                                 const char* who, const char* what) {
  KVSIFT_CHECK(t.data != nullptr && t.rank == 4 && t.dtype == DType::f32 && t.device == Device::cpu,
               who, ": ", what, " must be a host f32 [batch, heads, n, head_dim] view, got ",
               t.shape_string(), " ", dtype_name(t.dtype), " on ", device_name(t.device));
  KVSIFT_CHECK(t.shape[0] == batch && t.shape[1] == heads && (n < 0 || t.shape[2] == n) &&
                   t.shape[3] == head_dim,
               who, ": ", what, " is ", t.shape_string(), ", expected [batch = ", batch,
               ", heads = ", heads, ", ", (n < 0 ? std::string("n") : std::to_string(n)),
               ", head_dim = ", head_dim, "]");
  const std::int64_t rows = t.shape[2];
  std::vector<float> out(
      static_cast<std::size_t>(std::max<std::int64_t>(1, batch * heads * rows * head_dim)));
  std::size_t i = 0;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t d = 0; d < head_dim; ++d) {
          const float x = *t.ptr<float>(b, h, r, d);
          out[i] = round_to_dtype(storage, x);
          // A non-finite value (or one beyond fp16's range, for KIVI) would poison its groups.
          KVSIFT_CHECK(std::isfinite(out[i]), who, ": ", what, "[", b, ", ", h, ", ", r, ", ", d,
                       "] = ", x, " is not finite in ", dtype_name(storage));
          ++i;
        }
  return out;
}

// Checks `out` is a host f32 [batch, q_heads, 1, head_dim] view (before anything is computed).
inline void check_out(const TensorView& out, std::int64_t batch, std::int64_t q_heads,
                      std::int64_t head_dim, const char* who) {
  KVSIFT_CHECK(out.data != nullptr && out.rank == 4 && out.dtype == DType::f32 &&
                   out.device == Device::cpu && out.shape[0] == batch && out.shape[1] == q_heads &&
                   out.shape[2] == 1 && out.shape[3] == head_dim,
               who, "::attention: out must be host f32 [batch = ", batch, ", q_heads = ", q_heads,
               ", 1, head_dim = ", head_dim, "], got ", out.shape_string());
}

// Left pads of the prompt from a step-level observation (obs.pad_counts, [batch]), which must
// come before the first prefill(); later ones must report no pads (only a prompt is padded).
inline void observe_pads(const Observation& obs, bool prefilled, std::vector<std::int64_t>& pads,
                         const char* who) {
  if (obs.layer >= 0 || obs.pad_counts == nullptr) return;
  for (std::size_t b = 0; b < pads.size(); ++b) {
    const std::int32_t p = obs.pad_counts[b];
    KVSIFT_CHECK(p >= 0, who, ": pad_counts[", b, "] must be >= 0, got ", p);
    if (prefilled) {
      KVSIFT_CHECK(p == 0, who, ": pad_counts[", b, "] = ", p,
                   " after prefill(); left pads are given with the prompt, before prefill()");
    } else {
      pads[b] = p;
    }
  }
}

// Which layers have been prefilled and which appended this step: the order every cache-owning
// quantizer enforces (prefill every layer once, then each step append every layer exactly once,
// then end_step()). Errors name the method (`who`) and the layer.
class StepLedger {
 public:
  StepLedger(int num_layers, const char* who)
      : prefilled_(static_cast<std::size_t>(num_layers), false),
        appended_(static_cast<std::size_t>(num_layers), false),
        who_(who) {}

  // check_*() before anything changes, mark_*() once the prefill / append succeeded.
  void check_prefill(std::size_t layer) const {
    KVSIFT_CHECK(!prefilled_[layer], who_, "::prefill: layer ", layer, " was already prefilled");
  }
  void mark_prefilled(std::size_t layer) {
    prefilled_[layer] = true;
    any_prefilled_ = true;
  }
  void check_append(std::size_t layer) const {
    KVSIFT_CHECK(prefilled_[layer], who_, "::append: layer ", layer,
                 " was not prefilled (prefill() every layer first, with 0 tokens for no prompt)");
    KVSIFT_CHECK(!appended_[layer], who_, "::append: layer ", layer,
                 " already appended this step (end_step() closes a step)");
  }
  void mark_appended(std::size_t layer) { appended_[layer] = true; }
  // end_step(): false when no layer appended (an empty step); throws when only some did.
  bool step_complete() const {
    bool any = false, all = true;
    for (bool a : appended_) {
      any = any || a;
      all = all && a;
    }
    if (!any) return false;
    KVSIFT_CHECK(all, who_,
                 "::end_step: some layers were not appended this step (every layer appends "
                 "exactly once per step)");
    return true;
  }
  void close_step() { std::fill(appended_.begin(), appended_.end(), false); }

  bool appended(std::size_t layer) const { return appended_[layer]; }
  bool any_prefilled() const { return any_prefilled_; }

 private:
  std::vector<bool> prefilled_, appended_;  // [num_layers]
  bool any_prefilled_ = false;
  const char* who_;
};

}  // namespace quantizer_detail
}  // namespace kvsift
