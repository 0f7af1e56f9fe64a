// Internal launchers of the R-KV CUDA pipeline, shared between cuda/*.cu (not installed). The
// public entry points in kvsift/backend/cuda/rkv_scoring.hpp validate every argument first; these
// launchers assume valid, device-resident inputs and only check the CUDA calls they make.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "quotient_rn.cuh"

namespace kvsift::cuda::detail {

inline constexpr int kBlockThreads = 256;  // every R-KV kernel runs 256-thread blocks
inline constexpr int kKeySumRows = 128;    // rows per partial sum of the unit keys

// Partial sums of the unit keys per (b, h) for a sequence of `length` tokens.
inline int key_sum_chunks(int length) { return (length + kKeySumRows - 1) / kKeySumRows; }

// The layers of one compression step, scored together (docs/algorithms.md §1.3 selects in every
// layer independently, so a step is a batch of n_layers · batch sequences). Sequence z = layer ·
// batch
// + b; every layer has the same shape, dtype, strides, lengths and padding mask (the public entry
// points check it), so only the base pointers differ.
struct StepView {
  const KVCacheView* layers;  // [n_layers]
  const TensorView* queries;  // [n_layers] or nullptr (compaction needs no queries)
  int n_layers;
  const KVCacheView& first() const { return layers[0]; }
  int batch() const { return static_cast<int>(layers[0].batch()); }
  int sequences() const { return n_layers * batch(); }
};

// At most this many layers per call: their base pointers travel as kernel parameters (1 KiB).
inline constexpr int kMaxStepLayers = 128;

// Base of sequence z of one tensor of a step, in bytes: base[z / batch] + (z % batch)·stride_b.
struct StepBases {
  char* base[kMaxStepLayers];
  std::int64_t stride_b;  // bytes between the sequences of one layer
  int batch;              // sequences per layer
  template <class T>
  __host__ __device__ T* seq(int z) const {
    return reinterpret_cast<T*>(base[z / batch] + (z % batch) * stride_b);
  }
};

// StepBases of the step's keys, values or queries (`which` picks the tensor of a layer).
template <class Which>
StepBases step_bases(const StepView& step, Which which) {
  StepBases s{};
  const TensorView& t0 = which(0);
  s.stride_b = t0.stride[0] * static_cast<std::int64_t>(dtype_size(t0.dtype));
  s.batch = step.batch();
  for (int l = 0; l < step.n_layers; ++l) s.base[l] = static_cast<char*>(which(l).data);
  return s;
}
inline StepBases key_bases(const StepView& step) {
  return step_bases(step, [&](int l) -> const TensorView& { return step.layers[l].keys; });
}
inline StepBases value_bases(const StepView& step) {
  return step_bases(step, [&](int l) -> const TensorView& { return step.layers[l].values; });
}
inline StepBases query_bases(const StepView& step) {
  return step_bases(step, [&](int l) -> const TensorView& { return step.queries[l]; });
}

// The unit keys k̂ = K / (||K|| + 1e-8) (docs/algorithms.md §1.2 steps 1 and 6) are never stored in
// fp32: the normalisation keeps each row's divisor ||K|| + 1e-8 exactly as it computed it (0 marks
// a pad). The readers that need the exact values (the fp32 search, the tensor-core search's
// re-checks and spared cosines, the key sums for head_dim > 256) divide again — IEEE division is
// deterministic, so they see the float a stored copy would hold — and the column means divide
// their dot products once per row. Writing and re-reading an fp32 copy cost more than that.
struct UnitKeys {
  StepBases keys;         // the step's key tensors
  std::int64_t stride_h;  // elements between heads
  std::int64_t stride_s;  // elements between slots
  const float* denom;     // [sequences, kv_heads, length]; 0 for pads
  int kv_heads, length;
};

UnitKeys unit_keys_of(const StepView& step, int length, const float* denom);

// Row i of k̂, as fp32 values with the reference's arithmetic K[d] / (||K|| + 1e-8).
template <class T>
struct UnitRow {
  const T* k;
  float den;
  __device__ __forceinline__ float operator[](int d) const {
    return den == 0.0f ? 0.0f : to_float(k[d]) / den;
  }
  // operator[] of a channel x already converted to float, from y = 1 / den: the same bits
  // (quotient_rn.cuh), one reciprocal per row instead of a division per channel.
  __device__ __forceinline__ float unit_channel(float x, float y) const {
    return den == 0.0f ? 0.0f : quotient_rn(x, den, y);
  }
};

// The rows of one (sequence, head) bh = z · kv_heads + h, resolved once per block.
template <class T>
struct UnitHead {
  const T* k;             // row 0
  std::int64_t stride_s;  // elements between rows
  const float* den;       // [length]
  __device__ __forceinline__ UnitRow<T> row(int i) const { return {k + i * stride_s, den[i]}; }
};

template <class T>
__device__ __forceinline__ UnitHead<T> unit_head(const UnitKeys& u, std::int64_t bh) {
  const int z = static_cast<int>(bh / u.kv_heads), h = static_cast<int>(bh % u.kv_heads);
  return {u.keys.seq<const T>(z) + h * u.stride_h, u.stride_s, u.denom + bh * u.length};
}

// Window importance a (docs/algorithms.md §1.1) of all sequences of the step, each of `length`
// tokens; z = layer · batch + b below.
//   queries     per layer [batch, q_heads, window, head_dim], keys' dtype
//   logits      [z, kv_heads, window, length − window] scratch: GQA-max logits
//   pre_pool    [z, kv_heads, length − window] scratch: window-mean attention A
//   importance  [z, kv_heads, length − window] output a
// logits_ready: `logits` already holds the GQA-max logits (the one key pass wrote them), so only
// the softmax, window mean and pooling run.
void launch_window_importance(const StepView& step, int length, int kernel, float* logits,
                              float* pre_pool, float* importance, cudaStream_t stream,
                              bool logits_ready = false);

// The logit of a pad key (docs/algorithms.md §1.1 step 5).
inline constexpr float kPadLogit = -1e9f;

// True when the window logits may take the tensor-core path (cuda/window_importance.cu): 16-bit
// storage, group · window <= 64 query rows, head_dim <= 128 and a multiple of 8, rows of keys and
// queries on 16-byte boundaries in every layer. Requires step.queries.
bool mma_logits_supported(const StepView& step, int group, int window);

// Key redundancy R over all `length` tokens (docs/algorithms.md §1.2 steps 1–5, before the slice)
// of every sequence z = layer · batch + b of the step.
//   denom       [z, kv_heads, length] scratch: each row's ||K|| + 1e-8 (0: pad), see UnitKeys
//   unit16      tc_unit16_count(z · kv_heads, length, head_dim) scratch: fp16 k̂ for the
//               tensor-core search; nullptr when it does not run (then the fp32 search does)
//   tc_reached  [z, kv_heads, tc_row_tiles(length)] scratch of the tensor-core search, or nullptr
//   spared      [z, kv_heads, length] scratch: fixed-point sums of spared cosines per column
//   partial     [z, kv_heads, key_sum_chunks(length), head_dim] scratch: sums of k̂ per chunk
//   redundancy  [z, kv_heads, length] output R
//   window_logits  [z, kv_heads, window, length − window] or nullptr: see launch_key_pass.
// Returns true when it wrote `window_logits`.
bool launch_key_redundancy(const StepView& step, int length, float threshold, bool faithful,
                           float* denom, void* unit16, int* tc_reached, unsigned long long* spared,
                           float* partial, float* redundancy, cudaStream_t stream,
                           float* window_logits = nullptr);

// The one pass over the keys (cuda/key_pass.cu): for every row of every sequence of the step its
// divisor ||K|| + 1e-8 (0: pad), the fp16 unit key when unit16 is not null, and the per-chunk sums
// of the unit keys, reading each key once with 16-byte accesses. Layouts as launch_key_redundancy's
// scratch above:
//   denom    [z, kv_heads, length]
//   unit16   tc_unit16_count(z · kv_heads, length, head_dim) fp16 (the search's tile images,
//            cuda/tc_unit_images.cuh), or nullptr; only with tc_search_supported(head_dim)
//   partial  [z, kv_heads, key_sum_chunks(length), head_dim]
// Returns false, having enqueued nothing, when the keys' layout does not allow 16-byte accesses
// (head_dim not a multiple of 8 or above 256, a stride or base not 16-byte aligned, unit16 not
// 16-byte aligned); the caller then runs the scalar kernels of key_redundancy.cu.
// With `window_logits` [z, kv_heads, window, length − window] not null, step.queries set and
// mma_logits_supported, the same pass also writes the window logits (§1.1 steps 1 and 5: GQA max
// of q·k / sqrt(D), pads −1e9) bit for bit as launch_window_importance computes them, and sets
// *logits_written (when given) to true; otherwise to false.
bool launch_key_pass(const StepView& step, int length, float* denom, void* unit16, float* partial,
                     cudaStream_t stream, float* window_logits = nullptr,
                     bool* logits_written = nullptr);

// True when the step's keys allow 16-byte row accesses (cuda/key_vec.cuh): head_dim a multiple of
// 8 and at most 256, every layer's base and the batch, head and slot strides 16-byte aligned.
bool key_rows_vectorizable(const StepView& step);

// The scalar kernels launch_key_pass replaced (one warp per row, 2-byte reads), same outputs and
// layouts; they serve the layouts it refuses, and the tests and benchmark compare against them.
void launch_key_rows_scalar(const StepView& step, int length, float* denom, void* unit16,
                            float* partial, cudaStream_t stream);

// rbar_j = (total·k̂_j − k̂_j·k̂_j − spared_j) / S (docs/algorithms.md §1.2 step 4), total = the
// chunk partials added in chunk order; `vectorized` (requires key_rows_vectorizable) reads the
// rows with 16-byte accesses, otherwise one warp per row with 2-byte reads.
//   denom [z, kv_heads, length]; spared [z, kv_heads, length] 32.32 fixed point;
//   partial [z, kv_heads, key_sum_chunks(length), head_dim]; rbar [z, kv_heads, length]
void launch_column_means(const StepView& step, int length, const float* denom,
                         const unsigned long long* spared, const float* partial, float* rbar,
                         bool vectorized, cudaStream_t stream);

// The tensor-core last-match search (cuda/key_redundancy_tc.cu) handles head_dim <= 128 that are
// multiples of 4; for others launch_key_redundancy uses the fp32 search.
bool tc_search_supported(int head_dim);

// True when the device runs the search's wgmma code (Hopper's sm_90a build of
// key_redundancy_tc.cu), false when its mma.sync code (any other target). Synchronises.
bool tc_search_uses_wgmma();

// Bound on |fp16 tensor-core cosine − fp32 path cosine| of two unit keys, head_dim terms (the
// derivation is at the top of key_redundancy_tc.cu).
double tc_cosine_margin(int head_dim);

// Row tiles of the tensor-core search: `reached` below holds one int per (b, h, row tile).
int tc_row_tiles(int length);

// Elements (fp16) of the unit keys the tensor-core search reads, for `heads` = sequences ·
// kv_heads heads of `length` rows, stored as its tile images (cuda/tc_unit_images.cuh: whole
// 256-row tiles of 64 or 128 channels, zero past head_dim and past `length`); and the index in
// such a buffer of channel d of row i of head bh. Host-side, for the scratch and the tests.
std::int64_t tc_unit16_count(std::int64_t heads, int length, int head_dim);
std::int64_t tc_unit16_index(std::int64_t bh, int i, int d, int length, int head_dim);
// Throws kvsift::Error when unit16 is set for a head_dim outside tc_search_supported.
void require_unit16_scope(const void* unit16, int head_dim);

// Tensor-core search for r_i = max{ j != i : C[i,j] > threshold } (docs/algorithms.md §1.2 step 3),
// identical to the fp32 search; adds the spared fp32 cosines C[i, r_i] (faithful: C[i, 0] of
// unmatched rows) to `spared` in 32.32 fixed point. Requires tc_search_supported(head_dim).
//   unit     the unit keys (storage dtype `dtype`), read for the exact fp32 re-checks
//   unit16   tc_unit16_count(batch · kv_heads, length, head_dim): the fp16 (RNE) unit keys
//   spared   [batch, kv_heads, length] accumulated into (zero it first)
//   match    [batch, kv_heads, length] scratch, then r_i (−1: row i has no match)
//   reached  [batch, kv_heads, tc_row_tiles(length)] scratch
// `vectorized` (requires key_rows_vectorizable of the keys) reads the re-checks' rows in 16-byte
// loads; both ways give the same bits. `pair_slots`, for the tests: how many re-checks a block
// may defer at a time (−1: as many as it has room for; 0: none); every value gives the same bits.
void launch_last_match_tc(const UnitKeys& unit, DType dtype, const void* unit16, int batch,
                          int kv_heads, int length, int head_dim, float threshold, bool faithful,
                          bool vectorized, unsigned long long* spared, int* match, int* reached,
                          cudaStream_t stream, int pair_slots = -1);

// score[b, h, j] = λ·a[b, h, j] − (1−λ)·R[b, h, j] for j < n; `redundancy` rows hold `length`.
//   importance, score [batch * kv_heads, n]; redundancy [batch * kv_heads, length]
void launch_joint_score(const float* importance, const float* redundancy, int rows, int n,
                        int length, float mix_lambda, float* score, cudaStream_t stream);

// Top-(budget − window) selection of every row (select_topk_slots), for `rows` = sequences ·
// kv_heads rows of `length` tokens whose padding mask row is (row / kv_heads) % mask_batch.
//   scores [rows, score_pitch] (−1: length − window), the first length − window used;
//   valid_mask [mask_batch, capacity] or nullptr; slots [rows, budget]
void launch_select_topk(const float* scores, const std::uint8_t* valid_mask, int mask_batch,
                        int sequences, int kv_heads, std::int64_t capacity, int length, int budget,
                        int window, std::int32_t* slots, cudaStream_t stream,
                        std::int64_t score_pitch = -1);

// The no-op plan: rows 0 .. length − 1, then kUnusedSlot up to `budget`.
//   slots [rows, budget]
void launch_keep_all_slots(int rows, int length, int budget, std::int32_t* slots,
                           cudaStream_t stream);

}  // namespace kvsift::cuda::detail
