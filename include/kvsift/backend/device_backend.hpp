// The CUDA backend as host code sees it: an interface with no CUDA types, so the policies, the
// C API and the tool can reach the GPU paths without including CUDA headers. kvsift::cuda
// implements it (cuda/device_backend.cpp) and registers itself when it is linked; a binary built
// without kvsift::cuda gets a kvsift::Error saying so the first time a device view reaches a
// policy or compact().
//
// Every call validates on the host before it enqueues anything on ctx.stream and carves its
// scratch from ctx.workspace (sized by the matching *_workspace_bytes). Calls that return a
// KeepPlan wait for the stream once, to download the kept slots. Batches may be ragged (each
// sequence its own kv.lengths[b], left pads through kv.valid_mask), as on the CPU: a sequence at
// or below the budget keeps everything, the others are scored. Config fields the kernels do not
// implement (R-KV sink > 0, gqa = mean) raise kvsift::Error naming the field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvsift/backend/device_thinkv.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/config/sentence_scorer_config.hpp"
#include "kvsift/config/thinkv_config.hpp"
#include "kvsift/core/exec_context.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // compact() on device views: moves kept rows in place; lengths (host) rewritten.
  virtual std::size_t compact_workspace_bytes(const KeepPlan& plan) const = 0;
  virtual void compact(const KVCacheView& kv, const KeepPlan& plan,
                       const ExecContext& ctx) const = 0;
  // What compact() can need for any plan over `kv` at its current lengths (sizing a workspace
  // before the plan exists).
  virtual std::size_t compact_workspace_bound(const KVCacheView& kv) const = 0;

  // R-KV (§1.3) on a device cache.
  //   kv       keys/values [batch, kv_heads, capacity, head_dim] device; lengths host
  //   queries  [batch, q_heads, window, head_dim] device
  virtual std::size_t rkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                          const RKVConfig& cfg) const = 0;
  virtual KeepPlan rkv_select(const KVCacheView& kv, const TensorView& queries,
                              const RKVConfig& cfg, const ExecContext& ctx) const = 0;
  // R-KV's whole compression step (Policy::compress_step): every layer selected and compacted
  // on the device, the kept rows never leave it; one host wait per step (the kept lengths).
  // The layers share shape, strides, lengths and one padding mask.
  //   layers   [n_layers] device caches; queries [n_layers] device window queries
  virtual std::size_t rkv_step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                               int n_layers, const RKVConfig& cfg) const = 0;
  virtual void rkv_compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                                 const RKVConfig& cfg, const ExecContext& ctx) const = 0;

  // SkipKV's eq. 6 selection (§2.4) on a device cache; penalties from the host range maps.
  virtual std::size_t skipkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                             const SentenceScorerConfig& cfg,
                                             const SentencePenalties& penalties) const = 0;
  virtual KeepPlan skipkv_select(const KVCacheView& kv, const TensorView& queries,
                                 const SentenceScorerConfig& cfg,
                                 const SentencePenalties& penalties,
                                 const ExecContext& ctx) const = 0;

  // SkipKV's whole compression step (SkipKV::compress_step): every layer selected by eq. 6 with
  // its own penalties, then all layers compacted in one launch sequence; one host wait per step,
  // which downloads what the host range maps need: the kept count of every sequence and the kept
  // slot rows of every layer. The layers share shape, strides, lengths and one padding mask.
  //   layers     [n_layers] device caches; queries [n_layers] device window queries
  //   penalties  rows (layer, b, h) of every layer, at most `max_ranges` ranges in all
  //   out        kept [batch]: tokens each sequence keeps in every layer, -1 for a sequence with a
  //              NaN score in some layer (left untouched in every layer, lengths not rewritten;
  //              the caller raises). slots [n_layers, batch, kv_heads, row_stride = budget]:
  //              row (l, b, h) holds its kept slots ascending in its first kept[b] entries (the
  //              rest unspecified; rows of a kept[b] < 0 sequence are unspecified).
  // Layers' host lengths are rewritten to the kept counts (NaN sequences excepted). An error
  // raised before the wait leaves every cache untouched.
  struct SkipKVStepRows {
    std::vector<std::int32_t> kept;
    std::vector<std::int32_t> slots;
    int row_stride = 0;
  };
  virtual std::size_t skipkv_step_workspace_bytes(const KVCacheView* layers,
                                                  const TensorView* queries, int n_layers,
                                                  const SentenceScorerConfig& cfg,
                                                  std::int64_t max_ranges) const = 0;
  virtual void skipkv_compress_step(const KVCacheView* layers, const TensorView* queries,
                                    int n_layers, const SentenceScorerConfig& cfg,
                                    const StepPenalties& penalties, SkipKVStepRows& out,
                                    const ExecContext& ctx) const = 0;

  // Copies `bytes` from device memory `src` to host memory `dst` on ctx.stream and waits for it
  // (work enqueued earlier on the stream finishes first), so the host may read `dst` on return.
  // The generic op behind the methods whose device path stages their inputs to the host and runs
  // the CPU reference (policy/device_staging.hpp). ctx.workspace is not used.
  virtual void copy_to_host(void* dst, const void* src, std::size_t bytes,
                            const ExecContext& ctx) const = 0;

  // ThinKV's whole pipeline with its cache on the device (device_thinkv.hpp): the device bytes
  // it needs for `batch` sequences (config validated, device limits checked), and the pipeline
  // itself, its storage carved from ctx.workspace (at least thinkv_memory_bytes, 256-byte
  // aligned, owned by the caller for the pipeline's lifetime), all work on ctx.stream. The
  // defaults raise kvsift::Error: a backend without a ThinKV pipeline.
  virtual std::size_t thinkv_memory_bytes(const ThinKVConfig& config, std::int64_t batch) const;
  virtual std::unique_ptr<DeviceThinKVPipeline> make_thinkv(const ThinKVConfig& config,
                                                            std::int64_t batch,
                                                            const ExecContext& ctx) const;
};

// The registered backend; throws kvsift::Error when kvsift::cuda is not linked.
const DeviceBackend& device_backend();
// True when kvsift::cuda is linked and registered (it says nothing about a device being present).
bool has_device_backend();
// Called once by kvsift::cuda at static initialisation.
void register_device_backend(const DeviceBackend* backend);

}  // namespace kvsift
