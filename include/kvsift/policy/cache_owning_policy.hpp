// The second engine-facing interface: methods that own their KV storage instead of planning over
// the engine's (ThinKV keeps paged, quantized, thought-typed block tables and evicts by setting
// bits, docs/algorithms.md §3.4). The engine hands them every K/V it produces and asks them for
// attention; there is no select() / compact(). Per decode step:
//   for each layer: policy->append(layer, k, v);          // k, v [batch, kv_heads, 1, head_dim]
//                   policy->observe(layer_obs);           // needs() says what (queries)
//                   policy->attention(layer, q, out);     // q, out [batch, q_heads, 1, head_dim]
//   policy->end_step();                                   // the method's own eviction
// The prompt goes in first with prefill() (every layer). Memory is accounted by the method:
// resident_bytes() is what its storage holds, fullkv_fp16_bytes() what an fp16 cache of the same
// tokens would. Registered in the same table as Policy (MethodInfo::owns_cache); build one with
// make_cache_owning_policy(name, json).
//
// Storage in device memory (ThinKV; docs/thinkv.md §9): before the prompt, the engine asks
// device_memory_bytes() (0: the method runs on the host only), allocates that much device memory
// and hands it over with place_on_device({memory, bytes, stream}); from then on every tensor is a
// device view, all work is enqueued on that stream, and attention() takes its scratch through the
// attention_with_workspace() (attention_workspace_bytes(layer) bytes). K/V never cross the bus.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/exec_context.hpp"
#include "kvsift/core/observation.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

class CacheOwningPolicy {
 public:
  virtual ~CacheOwningPolicy() = default;
  virtual std::string_view name() const = 0;
  // The Needs bits observe() reads (kNeedsAppend is implied by append()).
  virtual unsigned needs() const = 0;
  virtual std::int64_t batch() const = 0;

  // Tensors are host f32 (any strides) — or, once placed on the device, contiguous device views
  // (K/V f32 or bf16, queries and outputs f32).
  // The prompt of one layer, before any decode append:
  //   keys, values  [batch, kv_heads, n, head_dim] post-RoPE
  virtual void prefill(int layer, const TensorView& keys, const TensorView& values) = 0;
  // The step's token of one layer, each layer exactly once per step:
  //   keys, values  [batch, kv_heads, 1, head_dim] post-RoPE
  virtual void append(int layer, const TensorView& keys, const TensorView& values) = 0;
  // Per-layer observations after append(): obs.queries [batch, q_heads, 1, head_dim] f32.
  virtual void observe(const Observation& obs) = 0;
  // Closes the step for every sequence (the method's own eviction). True when some evicted.
  virtual bool end_step() = 0;
  // Decode attention of one layer over its resident tokens (host storage; on the device:
  // attention_with_workspace):
  //   queries  [batch, q_heads, 1, head_dim] f32;  out  [batch, q_heads, 1, head_dim] f32
  virtual void attention(int layer, const TensorView& queries, const TensorView& out) const = 0;

  // --- storage in device memory (see the top comment) -------------------------------------------
  // Device bytes the storage needs for batch() sequences; 0 when the method has no device path.
  virtual std::size_t device_memory_bytes() const { return 0; }
  // ctx.workspace: device memory of device_memory_bytes() bytes, 256-byte aligned, owned by the
  // caller for the policy's lifetime; ctx.stream: where all later work is enqueued. Only before
  // the prompt (nothing appended yet).
  virtual void place_on_device(const ExecContext& ctx) {
    (void)ctx;
    KVSIFT_CHECK(false, name(), " keeps its cache on the host only (device_memory_bytes() == 0)");
  }
  virtual bool on_device() const { return false; }
  // Scratch attention() needs on the device for `layer` at the current step (0 on the host).
  virtual std::size_t attention_workspace_bytes(int layer) const {
    (void)layer;
    return 0;
  }
  // attention() with device scratch in ctx.workspace (ctx.stream is the placement's stream);
  // on the host the context is not used.
  virtual void attention_with_workspace(int layer, const TensorView& queries, const TensorView& out,
                                        const ExecContext& ctx) const {
    (void)ctx;
    attention(layer, queries, out);
  }

  // Memory: bytes the method's storage of `layer` holds (codes, scales, metadata), all layers,
  // and an fp16 K+V cache of the same tokens for comparison.
  virtual std::int64_t resident_bytes(int layer) const = 0;
  virtual std::int64_t resident_bytes() const = 0;
  virtual std::int64_t fullkv_fp16_bytes() const = 0;
  // Sorted generation positions resident in (layer, sequence, KV head).
  virtual std::vector<std::int32_t> resident_positions(int layer, std::int64_t seq,
                                                       std::int64_t kv_head) const = 0;
};

}  // namespace kvsift
