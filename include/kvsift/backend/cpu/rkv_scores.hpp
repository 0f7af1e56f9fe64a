// R-KV's joint score on the CPU (docs/algorithms.md §1.3): score_j = λ·a_j − (1−λ)·R_j of window
// importance (§1.1) and key redundancy (§1.2). The reference the R-KV policy, SkipKV's scorer
// and the CUDA backend's tests compare against.
#pragma once

#include <cstdint>

#include "kvsift/backend/cpu/key_redundancy.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/window_importance.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

// Every intermediate of the R-KV score, [batch, kv_heads, capacity] each.
struct RKVScores {
  cpu::ScoreTensor importance;       // a, count S_b − W
  cpu::ScoreTensor redundancy_full;  // R over all S_b tokens, count S_b
  cpu::ScoreTensor redundancy;       // R without the window, count S_b − W
  cpu::ScoreTensor score;            // λ·a − (1−λ)·R, count S_b − W
};

namespace cpu {

// Scores of the sequences marked in `active` ([batch] or nullptr: all).
//   kv.keys  [batch, kv_heads, capacity, head_dim]
//   queries  [batch, q_heads, window, head_dim]
inline RKVScores rkv_scores(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
                            const std::uint8_t* active = nullptr) {
  cfg.validate();
  RKVScores s;
  s.importance = window_importance(kv, queries, cfg.importance_config(), active);
  s.redundancy_full = redundancy_full(kv, cfg.redundancy_config(), active);
  s.redundancy = slice_window(s.redundancy_full, cfg.window);
  s.score = ScoreTensor(kv.batch(), kv.kv_heads(), kv.capacity());
  for (std::int64_t b = 0; b < kv.batch(); ++b) {
    const std::int32_t n = s.importance.count(b);
    for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
      const float* a = s.importance.row(b, h);
      const float* r = s.redundancy.row(b, h);
      float* out = s.score.row(b, h);
      for (std::int32_t j = 0; j < n; ++j)
        out[j] = cfg.mix_lambda * a[j] - (1.0f - cfg.mix_lambda) * r[j];
    }
    s.score.set_count(b, n);
  }
  return s;
}

}  // namespace cpu

}  // namespace kvsift
