// ThinKV's pipeline with its cache in device memory, as host code sees it (no CUDA types): what
// ThinKVPolicy drives once it is placed on the device (CacheOwningPolicy::place_on_device).
// kvsift::cuda implements it over cuda::DeviceThinKV (backend/cuda/thinkv_pipeline.hpp,
// docs/thinkv.md §9) and hands it out through DeviceBackend::make_thinkv. Every tensor is a
// contiguous device view; all work is enqueued on the stream the pipeline was made with, and
// end_step() waits for it once (the step's sparsities, then the survivors when TBE acts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvsift/core/tensor_view.hpp"
#include "kvsift/policy/thinkv/segment_evictor.hpp"

namespace kvsift {

class DeviceThinKVPipeline {
 public:
  virtual ~DeviceThinKVPipeline() = default;

  //   keys, values  device [batch, kv_heads, n, head_dim] f32 or bf16, contiguous (post-RoPE)
  virtual void prefill(int layer, const TensorView& keys, const TensorView& values) = 0;
  //   keys, values  device [batch, kv_heads, 1, head_dim] f32 or bf16, contiguous
  virtual void append(int layer, const TensorView& keys, const TensorView& values) = 0;
  // The step's sparsity of an L* layer; false (nothing done) outside L*.
  //   queries  device [batch, q_heads, 1, head_dim] f32, contiguous
  virtual bool observe_query(int layer, const TensorView& queries) = 0;
  // TBE's step of every sequence, [batch].
  virtual std::vector<EvictionStep> end_step() = 0;

  virtual std::size_t attention_workspace_bytes(int layer) const = 0;
  //   queries, out  device [batch, q_heads, 1, head_dim] f32, contiguous;
  //   workspace     device, attention_workspace_bytes(layer) bytes
  virtual void attention(int layer, const TensorView& queries, const TensorView& out,
                         void* workspace, std::size_t workspace_bytes) const = 0;

  // Memory as ThinKV reports it (paged/block_bytes.hpp), all sequences.
  virtual std::int64_t resident_bytes(int layer) const = 0;
  virtual std::int64_t resident_bytes() const = 0;
  virtual std::int64_t fullkv_fp16_bytes() const = 0;
  virtual std::vector<std::int32_t> resident_positions(int layer, std::int64_t seq,
                                                       std::int64_t kv_head) const = 0;
  // (sequence, layer, step) triples with some eviction, and all of them.
  virtual std::int64_t evicting_layer_steps() const = 0;
  virtual std::int64_t total_layer_steps() const = 0;
};

}  // namespace kvsift
