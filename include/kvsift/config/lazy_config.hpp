// LazyEviction's config (docs/algorithms.md §5.3). Eigen-free, shared by the CPU reference, the
// registry and the replay tool.
#pragma once

#include "kvsift/core/error.hpp"

namespace kvsift {

// How the per-token step counters TS and MRI are stored and scored.
enum class LazyCounters {
  int32,  // exact integer steps; the score's arithmetic in fp32
  fp16,   // every counter and every score operation rounded to fp16 (the reference under fp16
          // weights: past step 2048 odd steps round to even ones)
};

// Which attention weights a token's hits are read from.
enum class LazyScope {
  kv_head,  // per KV head: a = max over the head's GQA group of query heads (one cache per KV head)
  query_head,  // the reference's layout: keys repeated to the query heads before caching, so the
               // cache has one head per query head (kv_heads must equal q_heads)
};

struct LazyConfig {
  int budget = 1024;    // B_cap: cache size after an eviction
  int window = 128;     // W: eviction period in steps, and the most recent tokens always kept
  float alpha = 1e-3f;  // hit threshold on a softmax weight
  LazyCounters counters = LazyCounters::int32;
  LazyScope scope = LazyScope::kv_head;

  void validate() const {
    KVSIFT_CHECK(window >= 1, "LazyConfig: window must be >= 1, got ", window);
    KVSIFT_CHECK(budget > window, "LazyConfig: budget (", budget, ") must exceed window (", window,
                 ")");
    KVSIFT_CHECK(alpha > 0.0 && alpha <= 1.0, "LazyConfig: alpha must be in (0, 1], got ", alpha);
  }
};

}  // namespace kvsift
