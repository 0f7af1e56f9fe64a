// kvsift::cuda R-KV scoring and selection (docs/algorithms.md §1.1–§1.3) on a device KV cache:
// window importance a, key redundancy R, the joint score λ·a − (1−λ)·R and the per-(sequence,
// KV head) top-(budget − W) selection, emitted as sorted slot rows ready to become a KeepPlan.
//
// FlashInfer-style Plan/Run: rkv_workspace_bytes() says how much device scratch a call needs, the
// engine hands it over, and rkv_score() / rkv_select() only enqueue work on the given stream (no
// cudaMalloc, no synchronisation). download_keep_plan() is the one call that waits for the stream.
//
// Scope of this first version:
//   - every sequence of the batch must hold the same number of tokens, S = kv.lengths[0] (left
//     padding through kv.valid_mask is supported); unequal lengths raise kvsift::Error;
//   - queries must have the keys' storage dtype (f32, f16 or bf16; math is fp32 throughout);
//   - GQA reduction max, max pooling, window mean, no sink tokens (the R-KV defaults of §1.3).
// Results are deterministic: every reduction runs in a fixed order, and the one scatter (sparing
// each row's last near-duplicate, §1.2 step 3) accumulates in 64-bit fixed point.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda {

// R-KV parameters, defaults from docs/algorithms.md §4.
struct RKVScoringConfig {
  int budget = 1024;        // tokens per (sequence, KV head) after compression, window included
  int window = 8;           // W: observation-window queries; the last W tokens are always kept
  int kernel = 7;           // max-pooling kernel of the importance, odd (§1.1 step 4)
  float mix_lambda = 0.1f;  // λ of score = λ·a − (1−λ)·R (§1.3)
  float threshold = 0.5f;   // cosine above which two keys are near-duplicates (§1.2 step 3)
  bool faithful = false;    // true: the reference's r_i = 0 fallback zeroes C[i, 0] (§1.2)
  // true (default): find each row's last near-duplicate (§1.2 step 3) with bf16 tensor-core tiles
  // and exact fp32 re-checks near the threshold: the same r_i as the fp32 search, several times
  // faster. Needs head_dim <= 128 and a multiple of 4; other head_dims use the fp32 search anyway.
  // false: the fp32 tile search everywhere (the plain reference arithmetic, for cross-checks).
  bool tensor_core_search = true;

  void validate() const {
    KVSIFT_CHECK(window >= 1, "RKVScoringConfig: window must be >= 1, got ", window);
    KVSIFT_CHECK(budget > window, "RKVScoringConfig: budget (", budget, ") must exceed window (",
                 window, ")");
    KVSIFT_CHECK(kernel >= 1 && kernel % 2 == 1,
                 "RKVScoringConfig: kernel must be odd and >= 1, got ", kernel);
    KVSIFT_CHECK(mix_lambda >= 0.0f && mix_lambda <= 1.0f,
                 "RKVScoringConfig: mix_lambda must be in [0, 1], got ", mix_lambda);
    KVSIFT_CHECK(threshold >= -1.0f && threshold <= 1.0f,
                 "RKVScoringConfig: threshold must be in [-1, 1], got ", threshold);
  }
};

// Where rkv_score() writes; every buffer is device memory, fp32, contiguous, with S the common
// sequence length and n = S − W the candidates before the window.
struct RKVScoreOutputs {
  float* score = nullptr;       // [batch, kv_heads, n] λ·a − (1−λ)·R; required
  float* importance = nullptr;  // [batch, kv_heads, n] a (§1.1); optional (nullptr: not kept)
  float* redundancy = nullptr;  // [batch, kv_heads, S] R = softmax over all S, window included
                                // (§1.2 step 5 before the slice); optional
};

// Slot value that marks "no token" at the end of a row: a padded sequence keeps fewer than
// `budget` tokens (pads are never kept, docs/algorithms.md §2.4 default mode).
inline constexpr std::int32_t kUnusedSlot = -1;
// Slot value filling a whole row whose scores contain a NaN; download_keep_plan() rejects it.
inline constexpr std::int32_t kNanScoreSlot = -2;

// Device scratch bytes rkv_score() and rkv_select() need for this cache, these queries and cfg.
// Dominated, with the tensor-core search, by a bf16 copy of the normalised keys [batch, kv_heads,
// S, head_dim rounded up to 16] (the keys' own size for 16-bit storage), plus the window logits
// [batch, kv_heads, W, S − W] fp32 and a few fp32 values per token.
//   kv       device cache, keys [batch, kv_heads, capacity, head_dim]
//   queries  device [batch, q_heads, window, head_dim], the last W decode queries
std::size_t rkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                const RKVScoringConfig& cfg);

// Validates on the host, then enqueues the R-KV scores of every sequence on `stream`.
// Requires S > W. Throws kvsift::Error (nothing enqueued) for bad shapes, unequal lengths, host
// memory, a null score output or a workspace that is too small.
void rkv_score(const KVCacheView& kv, const TensorView& queries, const RKVScoringConfig& cfg,
               const RKVScoreOutputs& out, void* workspace, std::size_t workspace_bytes,
               cudaStream_t stream);

// Scores and selects: writes `slots` [batch, kv_heads, budget] int32 (device) where every row is
// ascending: the top (budget − W) valid candidates by score (ties: lower index first), then the W
// window slots S − W .. S − 1, then kUnusedSlot up to `budget` when pads left too few candidates.
// When S <= budget nothing is scored (docs/algorithms.md §1.3 no-op): every row is 0 .. S − 1 followed
// by kUnusedSlot, and the function returns false; otherwise true. `scores` (device [batch,
// kv_heads, S − W] or nullptr) receives the joint scores when given.
bool rkv_select(const KVCacheView& kv, const TensorView& queries, const RKVScoringConfig& cfg,
                std::int32_t* slots, float* scores, void* workspace, std::size_t workspace_bytes,
                cudaStream_t stream);

// All layers of one compression step in one set of launches: layer l's cache is layers[l], its
// window queries queries[l]. Each layer is scored and selected independently (docs/algorithms.md §1.3),
// exactly as rkv_select() on that layer alone would, but the kernels see n_layers · batch
// sequences at once, so a small batch still fills the GPU and pays the launch latency once per
// step instead of once per layer. The layers must agree in shape, dtype, strides and lengths and
// share one padding mask (it is per sequence); 1 <= n_layers <= 128 (call again for more) and
// n_layers · batch <= 65535. Throws kvsift::Error naming the layer otherwise.
//   layers   [n_layers] device caches, keys [batch, kv_heads, capacity, head_dim] each
//   queries  [n_layers] device [batch, q_heads, window, head_dim]
//   slots    device [n_layers, batch, kv_heads, budget] int32, rows as in rkv_select()
//   scores   device [n_layers, batch, kv_heads, S − W] fp32 or nullptr
// Returns false (every row keeps everything) when S <= budget.
std::size_t rkv_step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                     int n_layers, const RKVScoringConfig& cfg);
bool rkv_select_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                     const RKVScoringConfig& cfg, std::int32_t* slots, float* scores,
                     void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// The selection step alone, reusable by any score-based policy (SnapKV, H2O):
//   scores      device [batch, kv_heads, length − window] fp32
//   valid_mask  device [batch, capacity] (1 = real token) or nullptr
//   slots       device [batch, kv_heads, budget] int32, rows as in rkv_select()
// Requires length > budget > window.
void select_topk_slots(const float* scores, const std::uint8_t* valid_mask, int batch, int kv_heads,
                       std::int64_t capacity, int length, int budget, int window,
                       std::int32_t* slots, cudaStream_t stream);

// Waits for `stream`, downloads `slots` [batch, kv_heads, budget] (as rkv_select() wrote them for
// `kv` at its current lengths) and builds the KeepPlan. Throws kvsift::Error naming the row when a
// row holds kNanScoreSlot (a NaN score), is not ascending, or the heads of one sequence disagree
// on the kept count.
KeepPlan download_keep_plan(const KVCacheView& kv, const std::int32_t* slots, int budget,
                            int window, cudaStream_t stream);

}  // namespace kvsift::cuda
