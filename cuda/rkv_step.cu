// The enqueue-only R-KV compression step (backend/cuda/rkv_step.hpp): layout, chunked selection,
// one compaction of every layer.
#include <algorithm>
#include <cstdint>

#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/rkv_step.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::cuda {

RKVStepLayout rkv_compress_step_layout(const KVCacheView* layers, const TensorView* queries,
                                       int n_layers, const RKVConfig& cfg) {
  const char* op = "cuda::rkv_compress_step";
  KVSIFT_CHECK(n_layers >= 1 && n_layers <= 128, op, ": n_layers (", n_layers,
               ") must be in [1, 128]; call once per group of layers");
  KVSIFT_CHECK(layers != nullptr && queries != nullptr, op, ": layers or queries is null");
  const KVCacheView& kv0 = layers[0];
  const std::int64_t batch = std::max<std::int64_t>(kv0.batch(), 1);
  RKVStepLayout w;
  w.chunk = static_cast<int>(std::clamp<std::int64_t>(256 / batch, 1, n_layers));
  w.slots_bytes =
      align_up(static_cast<std::size_t>(n_layers) *
               static_cast<std::size_t>(std::max<std::int64_t>(kv0.batch() * kv0.kv_heads(), 1)) *
               static_cast<std::size_t>(cfg.budget) * sizeof(std::int32_t));
  for (int l = 1; l < n_layers; ++l) {
    for (std::int64_t b = 0; b < kv0.batch(); ++b)
      KVSIFT_CHECK(layers[l].length(b) == kv0.length(b), op, ": layer ", l, " holds ",
                   layers[l].length(b), " tokens of sequence ", b, ", layer 0 ", kv0.length(b),
                   " (one step compresses layers of equal lengths)");
  }
  // Every chunk is validated here (shapes, shared mask); the largest one sizes the scratch.
  for (int l0 = 0; l0 < n_layers; l0 += w.chunk) {
    const int n = std::min(w.chunk, n_layers - l0);
    w.scratch_bytes =
        std::max(w.scratch_bytes, rkv_step_workspace_bytes(layers + l0, queries + l0, n, cfg));
  }
  return w;
}

bool rkv_compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                       const RKVConfig& cfg, void* workspace, std::size_t workspace_bytes,
                       std::int32_t* new_lengths, cudaStream_t stream) {
  const char* op = "cuda::rkv_compress_step";
  const RKVStepLayout w = rkv_compress_step_layout(layers, queries, n_layers, cfg);
  const KVCacheView& kv0 = layers[0];
  bool over = false;
  for (std::int64_t b = 0; b < kv0.batch(); ++b) over = over || kv0.length(b) > cfg.budget;
  if (!over) return false;
  KVSIFT_CHECK(workspace != nullptr && workspace_bytes >= w.total(), op, ": workspace of ",
               workspace_bytes, " bytes is too small (", w.total(), " needed)");
  KVSIFT_CHECK(new_lengths != nullptr, op, ": new_lengths is null (device [", kv0.batch(),
               "] int32 expected)");
  auto* slots = static_cast<std::int32_t*>(workspace);
  void* scratch = static_cast<char*>(workspace) + w.slots_bytes;
  const std::size_t rows =
      static_cast<std::size_t>(kv0.batch() * kv0.kv_heads()) * static_cast<std::size_t>(cfg.budget);
  // Select every layer first, then compact them all at once: a sequence with a NaN row in any
  // layer is then left untouched in every layer.
  for (int l0 = 0; l0 < n_layers; l0 += w.chunk) {
    const int n = std::min(w.chunk, n_layers - l0);
    rkv_select_step(layers + l0, queries + l0, n, cfg, slots + l0 * rows, nullptr, scratch,
                    w.scratch_bytes, stream);
  }
  compact_device_rows_step(layers, n_layers, slots, cfg.budget, new_lengths, stream);
  return true;
}

}  // namespace kvsift::cuda
