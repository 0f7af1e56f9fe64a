// StepInputs: everything a policy reads to plan one layer of one compression step.
#pragma once

#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

struct StepInputs {
  int layer = 0;
  KVCacheView kv;
  // [batch, q_heads, window, head_dim] the last `window` decode queries (post-RoPE), the
  // observation window of SnapKV / R-KV. q_heads must be a multiple of kv.kv_heads() (GQA).
  TensorView window_queries;
};

}  // namespace kvsift
