// R-KV's config (docs/algorithms.md §1.3), shared by the CPU reference and the CUDA backend.
#pragma once

#include "kvsift/config/options.hpp"
#include "kvsift/config/scoring.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

struct RKVConfig {
  int budget = 1024;        // tokens per (sequence, KV head) after a compression
  int window = 8;           // observation window W, always kept
  int buffer = 128;         // decode steps between compressions (>= window)
  int kernel = 7;           // max-pooling kernel of the importance (odd)
  float mix_lambda = 0.1f;  // λ; R-KV's class default 0.07 is a value, not the default (§1.3)
  float threshold = 0.5f;   // redundancy cosine threshold
  int sink = 0;             // first tokens always kept (R-KV passes 4 but ignores it)
  RedundancyMode redundancy = RedundancyMode::sound;  // faithful: the reference's column-0 quirk
  GqaReduce gqa = GqaReduce::max;
  // CUDA-backend option (the CPU reference ignores it). true (default): find each row's last
  // near-duplicate (§1.2 step 3) with bf16 tensor-core tiles and exact fp32 re-checks near the
  // threshold: the same r_i as the fp32 search, several times faster (head_dim <= 128 and a
  // multiple of 4; other head_dims use the fp32 search anyway). false: the fp32 tile search
  // everywhere (the plain reference arithmetic, for cross-checks).
  bool tensor_core_search = true;

  void validate() const {
    KVSIFT_CHECK(window >= 1, "RKVConfig: window must be >= 1, got ", window);
    KVSIFT_CHECK(sink >= 0, "RKVConfig: sink must be >= 0, got ", sink);
    KVSIFT_CHECK(budget > window + sink, "RKVConfig: budget (", budget,
                 ") must exceed window + sink (", window, " + ", sink, ")");
    KVSIFT_CHECK(buffer >= window, "RKVConfig: buffer (", buffer, ") must be >= window (", window,
                 ")");
    KVSIFT_CHECK(mix_lambda >= 0.0f && mix_lambda <= 1.0f,
                 "RKVConfig: mix_lambda must be in [0, 1], got ", mix_lambda);
    importance_config().validate();
    redundancy_config().validate();
  }
  WindowImportanceConfig importance_config() const {
    WindowImportanceConfig c;
    c.window = window;
    c.kernel = kernel;
    c.gqa = gqa;
    return c;
  }
  KeyRedundancyConfig redundancy_config() const { return {threshold, redundancy}; }
  TopKSelection selection() const { return {budget, window, sink}; }
};

}  // namespace kvsift
