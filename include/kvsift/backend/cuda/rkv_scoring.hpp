// kvsift::cuda R-KV scoring and selection (docs/algorithms.md §1.1–§1.3) on a device KV cache:
// window importance a, key redundancy R, the joint score λ·a − (1−λ)·R and the per-(sequence,
// KV head) top-(budget − W) selection, emitted as sorted slot rows ready to become a KeepPlan.
//
// FlashInfer-style Plan/Run: rkv_workspace_bytes() says how much device scratch a call needs, the
// engine hands it over, and rkv_score() / rkv_select() only enqueue work on the given stream (no
// cudaMalloc, no synchronisation). download_keep_plan() is the one call that waits for the stream.
//
// Scope:
//   - ragged batches: every sequence b is scored over its own S_b = kv.lengths[b] tokens (host),
//     with left pads through kv.valid_mask, exactly as the CPU reference. The kernels run once per
//     run of consecutive sequences of equal length (one run, hence one set of launches, for the
//     common equal-length batch); per-token outputs are laid out with the batch's longest
//     sequence as pitch, S = max_b S_b, and row b uses its first S_b − W (or S_b) entries;
//   - queries must have the keys' storage dtype (f32, f16 or bf16; math is fp32 throughout);
//   - of RKVConfig the kernels support gqa = max and sink = 0 (the R-KV defaults of §1.3; max
//     pooling and the window mean are fixed); other values raise kvsift::Error naming the field.
// Results are deterministic: every reduction runs in a fixed order, and the one scatter (sparing
// each row's last near-duplicate, §1.2 step 3) accumulates in 64-bit fixed point.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvsift/config/rkv_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda {

// Checks that `cfg` is valid and within what the CUDA kernels implement (gqa max, sink 0);
// throws kvsift::Error naming the field otherwise. `op` names the caller in the message.
void check_cuda_rkv_config(const RKVConfig& cfg, const char* op);

// Where rkv_score() writes; every buffer is device memory, fp32, contiguous, with S = max_b S_b
// the pitch (the longest sequence) and n = S − W; row (b, h) fills its first S_b − W (or S_b)
// entries and leaves the rest untouched.
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
// Dominated, with the tensor-core search, by an fp16 copy of the normalised keys [batch, kv_heads,
// S, head_dim rounded up to 16] (the keys' own size for 16-bit storage), plus the window logits
// [batch, kv_heads, W, S − W] fp32 and a few fp32 values per token, S = max_b S_b.
//   kv       device cache, keys [batch, kv_heads, capacity, head_dim]
//   queries  device [batch, q_heads, window, head_dim], the last W decode queries
std::size_t rkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                const RKVConfig& cfg);

// Validates on the host, then enqueues the R-KV scores of every sequence on `stream`, each over
// its own S_b tokens. Requires S_b > W for every b. Throws kvsift::Error (nothing enqueued) for
// bad shapes, an unsupported config, host memory, a null score output or a workspace that is too
// small.
void rkv_score(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
               const RKVScoreOutputs& out, void* workspace, std::size_t workspace_bytes,
               cudaStream_t stream);

// Scores and selects: writes `slots` [batch, kv_heads, budget] int32 (device) where every row is
// ascending: the top (budget − W) valid candidates by score (ties: lower index first), then the W
// window slots S_b − W .. S_b − 1, then kUnusedSlot up to `budget` when pads left too few
// candidates. A sequence with S_b <= budget is not scored (docs/algorithms.md §1.3 no-op): its
// rows are 0 .. S_b − 1 followed by kUnusedSlot. Returns true when at least one sequence was
// scored, false when every sequence kept everything. `scores` (device [batch, kv_heads, S − W],
// S = max_b S_b, or nullptr) receives the joint scores of the scored sequences when given (rows
// of the others are untouched).
bool rkv_select(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
                std::int32_t* slots, float* scores, void* workspace, std::size_t workspace_bytes,
                cudaStream_t stream);

// All layers of one compression step in one set of launches: layer l's cache is layers[l], its
// window queries queries[l]. Each layer is scored and selected independently (docs/algorithms.md
// §1.3), exactly as rkv_select() on that layer alone would, but the kernels see n_layers · batch
// sequences at once, so a small batch still fills the GPU and pays the launch latency once per
// step instead of once per layer. The layers must agree in shape, dtype, strides and per-sequence
// lengths and share one padding mask (it is per sequence); 1 <= n_layers <= 128 (call again for
// more) and n_layers · batch <= 65535. Throws kvsift::Error naming the layer otherwise.
//   layers   [n_layers] device caches, keys [batch, kv_heads, capacity, head_dim] each
//   queries  [n_layers] device [batch, q_heads, window, head_dim]
//   slots    device [n_layers, batch, kv_heads, budget] int32, rows as in rkv_select()
//   scores   device [n_layers, batch, kv_heads, S − W] fp32 or nullptr, S = max_b S_b
// Returns false when every sequence has S_b <= budget (every row keeps everything).
std::size_t rkv_step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                     int n_layers, const RKVConfig& cfg);
bool rkv_select_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                     const RKVConfig& cfg, std::int32_t* slots, float* scores, void* workspace,
                     std::size_t workspace_bytes, cudaStream_t stream);

// The selection step alone, reusable by any score-based policy (SnapKV, H2O), on a ragged batch:
//   scores      device [batch, kv_heads, max_b lengths[b] − window] fp32; row (b, h) holds
//               lengths[b] − window candidates
//   lengths     host [batch] S_b, each in [0, capacity]
//   valid_mask  device [batch, capacity] (1 = real token) or nullptr
//   slots       device [batch, kv_heads, budget] int32, rows as in rkv_select(): a sequence with
//               S_b <= budget keeps 0 .. S_b − 1, the others their top (budget − window) valid
//               candidates and their window
// Requires budget > window >= 1.
void select_topk_slots(const float* scores, const std::int32_t* lengths,
                       const std::uint8_t* valid_mask, int batch, int kv_heads,
                       std::int64_t capacity, int budget, int window, std::int32_t* slots,
                       cudaStream_t stream);

// Waits for `stream`, downloads `slots` [batch, kv_heads, budget] (as rkv_select() wrote them for
// `kv` at its current per-sequence lengths, host kv.lengths) and builds the KeepPlan, each
// sequence with its own source length S_b and kept count. Throws kvsift::Error naming the row when
// a row holds kNanScoreSlot (a NaN score), is not ascending, or the heads of one sequence disagree
// on the kept count.
KeepPlan download_keep_plan(const KVCacheView& kv, const std::int32_t* slots, int budget,
                            int window, cudaStream_t stream);

// download_keep_plan's host half, on slot rows already in host memory: rows [batch, kv_heads,
// budget] as rkv_select() writes them (each row ascending, then kUnusedSlot padding) become the
// KeepPlan, same checks and errors. The rows are closed up in place and moved into the plan.
KeepPlan keep_plan_from_slot_rows(const KVCacheView& kv, std::vector<std::int32_t> rows,
                                  int budget, int window);

}  // namespace kvsift::cuda
