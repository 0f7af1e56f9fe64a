// kvsift::cuda SkipKV scoring and selection (docs/algorithms.md §2.4, SkipKV eq. 6 as implemented)
// on a device KV cache:
//   S_t = λ·a_t − (1−λ)·R_t − Σ_{redundant sentences i mapped over t} λ_i
// The R-KV part λ·a − (1−λ)·R is rkv_score() itself (rkv_scoring.hpp), not re-implemented here;
// this layer adds the sentence penalty, the pad handling and the §1.3 selection.
//
// The penalties (SegmentTable::penalty_ranges per (b, h), the CPU's SentencePenalties) travel to
// the device as a CSR over the batch * kv_heads rows: build_penalty_csr() validates and flattens
// them on the host, upload_sentence_penalties() copies them into a caller workspace. A range
// counts only while lo < hi < S (as add_sentence_penalty() tests it), and its λ is subtracted over
// [lo, hi] ∩ [0, S − W); ranges overlapping one token subtract in CSR order, exactly the CPU's
// float arithmetic.
//
// Pads (kv.valid_mask == 0), SentenceScorerConfig::pad_mode (config/sentence_scorer_config.hpp):
//   PadMode::faithful  the SkipKV reference: a pad's score is replaced by exactly +100, so the
//                      selection (run without the mask) keeps pads first, in every head the same
//                      ones (ties break by lower index), and they eat budget;
//   PadMode::exclude   the library default: pads keep their computed score and the selection
//                      never keeps them (run with the mask).
//
// Same scope as rkv_scoring.hpp: ragged batches (each sequence over its own S_b = kv.lengths[b],
// per-token outputs pitched by S = max_b S_b), queries in the keys' storage dtype, GQA max (the
// config's gqa = mean raises kvsift::Error). Everything only enqueues on the given stream, except
// upload_sentence_penalties() (which copies from host memory, see there) and download_keep_plan().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/config/sentence_scorer_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift::cuda {

// The score a pad gets in faithful mode; equals kvsift::kFaithfulPadScore of
// policy/skipkv/sentence_scorer.hpp (not included here: that header pulls the Eigen CPU scorers
// into nvcc), which the GPU test checks.
inline constexpr float kSkipKVPadScore = 100.0f;

// The penalties as a host CSR over rows r = b * kv_heads + h: row r's ranges are
// ranges[indptr[r] .. indptr[r + 1]), in the order SentencePenalties listed them.
struct SentencePenaltyCsr {
  std::int64_t batch = 0, kv_heads = 0;
  std::vector<std::int64_t> indptr;  // [batch * kv_heads + 1]
  std::vector<PenaltyRange> ranges;  // [indptr.back()]
};

// Validates and flattens per-(b, h) penalty lists (SentencePenalties of sentence_scorer.hpp:
// [batch * kv_heads] lists in (b, h) row-major order; empty = no penalties). Throws kvsift::Error
// naming the values for a list count other than 0 or batch * kv_heads (penalties for a (b, h) the
// cache does not have), a range with lo < 0 or lo > hi, or a non-finite λ. One-token ranges
// (lo == hi) and ranges past the end are legal: they simply subtract nothing.
SentencePenaltyCsr build_penalty_csr(const std::vector<std::vector<PenaltyRange>>& penalties,
                                     std::int64_t batch, std::int64_t kv_heads);

// The CSR on the device, as upload_sentence_penalties() returns it; a default-constructed one
// (indptr == nullptr) means "no penalties".
struct SentencePenaltiesDevice {
  std::int64_t batch = 0, kv_heads = 0, count = 0;
  const std::int64_t* indptr = nullptr;  // device [batch * kv_heads + 1]
  const PenaltyRange* ranges = nullptr;  // device [count]
};

// Device bytes upload_sentence_penalties() needs for `csr`.
std::size_t sentence_penalty_workspace_bytes(const SentencePenaltyCsr& csr);

// Enqueues the copy of `csr` into `workspace` (device) on `stream` and returns the device view,
// valid while the workspace is. `csr` must stay alive until the stream has passed the copies
// (from pageable memory CUDA stages them before returning, from pinned memory it does not).
// Throws kvsift::Error for an inconsistent CSR or a workspace that is too small.
SentencePenaltiesDevice upload_sentence_penalties(const SentencePenaltyCsr& csr, void* workspace,
                                                  std::size_t workspace_bytes, cudaStream_t stream);

// Device scratch bytes skipkv_score() and skipkv_select() need: rkv_workspace_bytes() plus one
// fp32 score buffer [batch, kv_heads, S − W] (the selection's scores when the caller keeps none),
// S = max_b S_b.
//   kv       device cache, keys [batch, kv_heads, capacity, head_dim]
//   queries  device [batch, q_heads, window, head_dim], the last W decode queries
std::size_t skipkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                   const SentenceScorerConfig& cfg);

// Validates on the host, then enqueues eq. 6 scores of every sequence on `stream`, each over its
// own S_b tokens (row b fills its first S_b − W entries; S = max_b S_b is the pitch):
//   out.score       [batch, kv_heads, S − W]  λ·a − (1−λ)·R − Σ λ_i; faithful pads exactly +100
//   out.importance  [batch, kv_heads, S − W]  a, optional; out.redundancy [batch, kv_heads, S] R,
//                   optional (both as rkv_score() writes them, without penalty or pad score)
// `penalties` from upload_sentence_penalties() for this cache's (batch, kv_heads), or a default
// one for none. Requires S_b > W for every b. Throws kvsift::Error (nothing enqueued) for bad
// shapes, an unsupported config, penalties for another shape, a null score output or a workspace
// that is too small.
void skipkv_score(const KVCacheView& kv, const TensorView& queries, const SentenceScorerConfig& cfg,
                  const SentencePenaltiesDevice& penalties, const RKVScoreOutputs& out,
                  void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// Scores and selects (docs/algorithms.md §2.4 + §1.3): writes `slots` [batch, kv_heads, budget]
// int32 (device), rows ascending as rkv_select() writes them: the top (budget − W) candidates by
// eq. 6 score (ties: lower index), then the W window slots, then kUnusedSlot. Faithful pads compete
// with their +100 score (selection without the mask); in exclude mode pads are never kept and a
// sequence keeps min(budget, real tokens). A sequence with S_b <= budget is not scored: its rows
// are 0 .. S_b − 1 then kUnusedSlot. Returns true when at least one sequence was scored, false
// when all kept everything. `scores` (device [batch, kv_heads, S − W], S = max_b S_b, or
// nullptr) receives the eq. 6 scores of the scored sequences when given. download_keep_plan()
// (rkv_scoring.hpp) turns `slots` into the KeepPlan that compact() takes.
bool skipkv_select(const KVCacheView& kv, const TensorView& queries,
                   const SentenceScorerConfig& cfg, const SentencePenaltiesDevice& penalties,
                   std::int32_t* slots, float* scores, void* workspace, std::size_t workspace_bytes,
                   cudaStream_t stream);

}  // namespace kvsift::cuda
