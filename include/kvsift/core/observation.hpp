// Observation: what a policy may read every decode step, besides the cache itself. An engine
// fills what it has; each method reads what it needs (Policy::needs() says which) and a method
// that needs a field it never got refuses to select rather than degrade silently.
#pragma once

#include <cstdint>

#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

// What a method reads in observe(): a bit set.
enum Needs : unsigned {
  kNeedsNothing = 0,
  kNeedsQueries = 1u << 0,  // per layer: the step's queries (H2O's attention, ThinKV's sparsity)
  kNeedsTokens = 1u << 1,   // once per step: the appended token ids (SkipKV's sentences)
  kNeedsHidden = 1u << 2,   // once per step: final-norm last-layer hidden states (SkipKV)
  kNeedsAppend = 1u << 3,   // per layer: the appended K/V themselves (cache-owning ThinKV)
};

struct Observation {
  // The layer this observation belongs to, or -1 for the step-level part (tokens, hidden).
  int layer = -1;
  // The layer's cache after this step's K/V were appended (per-layer observations). A step-level
  // observation may set it too (any layer's cache): its batch says how many rows token_ids has
  // when last_hidden is not given.
  KVCacheView kv;
  // [batch, q_heads, n, head_dim] the step's n queries of `layer` (post-RoPE).
  TensorView queries;
  // Rows of token_ids; 0: from kv (when set) or last_hidden.
  std::int64_t batch = 0;
  // [batch, n] token ids appended this step, host memory; n = num_tokens.
  const std::int32_t* token_ids = nullptr;
  std::int64_t num_tokens = 0;
  // [batch] left pads among those n tokens (a padded prompt), host; nullptr: none.
  const std::int32_t* pad_counts = nullptr;
  // [batch, n, hidden] final-norm last-layer hidden states of those tokens.
  TensorView last_hidden;
};

}  // namespace kvsift
