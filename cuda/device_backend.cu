// kvsift::cuda as the DeviceBackend of backend/device_backend.hpp: the host-side glue that lets
// policies, the C API and the tool reach the kernels without CUDA headers. Each selection is
// workspace layout + score + select + download_keep_plan; nothing here allocates device memory.
//
// kvsift::cuda is a static library, so a consumer that never names a symbol of this file would
// not link it and the registration below would never run. The anchor symbol fixes that: the
// kvsift_cuda target's INTERFACE link options carry --undefined=kvsift_cuda_backend_anchor, which
// makes every program linked against kvsift::cuda (in the build tree or through find_package)
// pull this object file in.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/rkv_step.hpp"
#include "kvsift/backend/cuda/sentence_scoring.hpp"
#include "kvsift/backend/cuda/thinkv_pipeline.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/backend/device_backend.hpp"

extern "C" {
// Referenced by the link option --undefined=kvsift_cuda_backend_anchor (see the top comment).
int kvsift_cuda_backend_anchor = 0;
}

namespace kvsift::cuda {
namespace {

cudaStream_t stream_of(const ExecContext& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

// Device slot rows [batch, kv_heads, budget] int32 that selection writes and the plan reads back.
std::size_t slot_bytes(const KVCacheView& kv, int budget) {
  return align_up(static_cast<std::size_t>(std::max<std::int64_t>(kv.batch() * kv.kv_heads(), 1)) *
                  static_cast<std::size_t>(budget) * sizeof(std::int32_t));
}

bool any_over_budget(const KVCacheView& kv, int budget) {
  for (std::int64_t b = 0; b < kv.batch(); ++b)
    if (kv.length(b) > budget) return true;
  return false;
}

// Device kept lengths [batch] int32 that a step's compaction writes and the host reads back.
std::size_t lengths_bytes(const KVCacheView& kv) {
  return align_up(static_cast<std::size_t>(std::max<std::int64_t>(kv.batch(), 1)) *
                  sizeof(std::int32_t));
}

// skipkv_compress_step's workspace: [slot rows of every layer | kept lengths | penalty CSR of
// every layer (indptr, ranges) | selection scratch of one layer]. The layers are selected one
// after the other (each its own launches, no host wait between them), so one layer's scratch is
// reused; the penalties are uploaded once for the step.
struct SkipKVStepLayout {
  std::size_t slots_b = 0, lengths_b = 0, indptr_b = 0, ranges_b = 0, scratch_b = 0;
  std::size_t total() const { return slots_b + lengths_b + indptr_b + ranges_b + scratch_b; }
};
SkipKVStepLayout skipkv_step_layout(const KVCacheView* layers, const TensorView* queries,
                                    int n_layers, const SentenceScorerConfig& cfg,
                                    std::int64_t ranges) {
  const char* op = "DeviceBackend::skipkv_compress_step";
  KVSIFT_CHECK(n_layers >= 1 && n_layers <= 128, op, ": n_layers (", n_layers,
               ") must be in [1, 128]; call once per group of layers");
  KVSIFT_CHECK(layers != nullptr && queries != nullptr, op, ": layers or queries is null");
  KVSIFT_CHECK(ranges >= 0, op, ": penalty range count (", ranges, ") must be >= 0");
  const KVCacheView& kv0 = layers[0];
  kv0.validate();
  const std::int64_t rows = std::max<std::int64_t>(kv0.batch() * kv0.kv_heads(), 1);
  SkipKVStepLayout w;
  w.slots_b = align_up(static_cast<std::size_t>(n_layers) * static_cast<std::size_t>(rows) *
                       static_cast<std::size_t>(cfg.rkv.budget) * sizeof(std::int32_t));
  w.lengths_b = lengths_bytes(kv0);
  w.indptr_b = align_up((static_cast<std::size_t>(n_layers) * static_cast<std::size_t>(rows) + 1) *
                        sizeof(std::int64_t));
  w.ranges_b = align_up(static_cast<std::size_t>(ranges) * sizeof(PenaltyRange));
  for (int l = 0; l < n_layers; ++l) {
    const KVCacheView& kv = layers[l];
    kv.validate();
    KVSIFT_CHECK(kv.keys.shape == kv0.keys.shape && kv.dtype() == kv0.dtype() &&
                     kv.keys.stride == kv0.keys.stride && kv.values.stride == kv0.values.stride,
                 op, ": layer ", l, " keys ", kv.keys.shape_string(),
                 " differ from layer 0's in shape, dtype or strides");
    KVSIFT_CHECK(kv.valid_mask == kv0.valid_mask, op, ": layer ", l,
                 " valid_mask differs from layer 0's (the mask is per sequence: one for all "
                 "layers)");
    for (std::int64_t b = 0; b < kv0.batch(); ++b)
      KVSIFT_CHECK(kv.length(b) == kv0.length(b), op, ": layer ", l, " holds ", kv.length(b),
                   " tokens of sequence ", b, ", layer 0 ", kv0.length(b),
                   " (one step compresses layers of equal lengths)");
    w.scratch_b = std::max(w.scratch_b, cuda::skipkv_workspace_bytes(kv, queries[l], cfg));
  }
  return w;
}

// The step's penalties: made for these layers, a CSR whose ranges build_penalty_csr() would
// accept (0 <= lo <= hi, finite λ).
void check_step_penalties(const StepPenalties& p, const KVCacheView& kv0, int n_layers,
                          const char* op) {
  KVSIFT_CHECK(p.layers == n_layers && p.batch == kv0.batch() && p.kv_heads == kv0.kv_heads(), op,
               ": penalties were built for layers=", p.layers, ", batch=", p.batch,
               ", kv_heads=", p.kv_heads, " but the step has layers=", n_layers,
               ", batch=", kv0.batch(), ", kv_heads=", kv0.kv_heads());
  const std::size_t rows = static_cast<std::size_t>(n_layers * kv0.batch() * kv0.kv_heads());
  KVSIFT_CHECK(p.indptr.size() == rows + 1 && p.indptr[0] == 0 &&
                   p.indptr[rows] == static_cast<std::int64_t>(p.ranges.size()),
               op, ": penalty indptr has ", p.indptr.size(), " entries (", rows + 1,
               " expected) and must run from 0 to the ", p.ranges.size(), " ranges");
  for (std::size_t r = 0; r < rows; ++r)
    KVSIFT_CHECK(p.indptr[r] <= p.indptr[r + 1], op, ": penalty indptr decreases at row ", r);
  for (std::size_t i = 0; i < p.ranges.size(); ++i) {
    const PenaltyRange& q = p.ranges[i];
    KVSIFT_CHECK(q.lo >= 0 && q.lo <= q.hi && std::isfinite(q.lambda), op, ": penalty range ", i,
                 " [", q.lo, ", ", q.hi, "] lambda ", q.lambda,
                 " must have 0 <= lo <= hi and a finite lambda");
  }
}

// ThinKVPolicy's device pipeline: engine tensors checked here (device, contiguous, the shapes
// the config fixes), then handed to cuda::DeviceThinKV.
class CudaThinKV final : public DeviceThinKVPipeline {
 public:
  CudaThinKV(const ThinKVConfig& config, std::int64_t batch, const ExecContext& ctx)
      : impl_(config, static_cast<std::int32_t>(batch), ctx.workspace, ctx.workspace_bytes,
              stream_of(ctx)) {}

  void prefill(int layer, const TensorView& keys, const TensorView& values) override {
    check_kv(keys, values, -1, "prefill");
    impl_.prefill(layer, keys.data, values.data, keys.dtype, keys.shape[2]);
  }
  void append(int layer, const TensorView& keys, const TensorView& values) override {
    check_kv(keys, values, 1, "append");
    impl_.append(layer, keys.data, values.data, keys.dtype);
  }
  bool observe_query(int layer, const TensorView& queries) override {
    if (!impl_.needs_sparsity(layer)) return false;
    check_queries(queries, "observe queries");
    return impl_.observe_query(layer, static_cast<const float*>(queries.data));
  }
  std::vector<EvictionStep> end_step() override { return impl_.end_step(); }

  std::size_t attention_workspace_bytes(int layer) const override {
    return impl_.attention_workspace_bytes(layer);
  }
  void attention(int layer, const TensorView& queries, const TensorView& out, void* workspace,
                 std::size_t workspace_bytes) const override {
    check_queries(queries, "attention queries");
    check_queries(out, "attention out");
    impl_.attention(layer, static_cast<const float*>(queries.data), static_cast<float*>(out.data),
                    workspace, workspace_bytes);
  }

  std::int64_t resident_bytes(int layer) const override {
    return impl_.device_table(layer).resident_bytes(impl_.table(layer)).total();
  }
  std::int64_t resident_bytes() const override { return impl_.resident_bytes().total(); }
  std::int64_t fullkv_fp16_bytes() const override { return impl_.fullkv_fp16_bytes(); }
  std::vector<std::int32_t> resident_positions(int layer, std::int64_t seq,
                                               std::int64_t kv_head) const override {
    KVSIFT_CHECK(
        seq >= 0 && seq < impl_.batch() && kv_head >= 0 && kv_head < impl_.config().kv_heads,
        "ThinKVPolicy::resident_positions: sequence ", seq, " / kv head ", kv_head, " outside [0, ",
        impl_.batch(), ") x [0, ", impl_.config().kv_heads, ")");
    return impl_.table(layer).resident_positions(static_cast<std::int32_t>(seq),
                                                 static_cast<std::int32_t>(kv_head));
  }
  std::int64_t evicting_layer_steps() const override {
    std::int64_t n = 0;
    for (std::int32_t b = 0; b < impl_.batch(); ++b)
      n += impl_.schedule(b).eviction_counter().evicting();
    return n;
  }
  std::int64_t total_layer_steps() const override {
    std::int64_t n = 0;
    for (std::int32_t b = 0; b < impl_.batch(); ++b)
      n += impl_.schedule(b).eviction_counter().total();
    return n;
  }

 private:
  // keys/values: device [batch, kv_heads, n, head_dim] f32 or bf16, contiguous, n = `n` if >= 0.
  void check_kv(const TensorView& k, const TensorView& v, std::int64_t n, const char* fn) const {
    const ThinKVConfig& c = impl_.config();
    for (const TensorView* t : {&k, &v}) {
      KVSIFT_CHECK(
          t->data != nullptr && t->rank == 4 && t->device == Device::cuda && t->is_contiguous() &&
              t->shape[0] == impl_.batch() && t->shape[1] == c.kv_heads &&
              (n < 0 || t->shape[2] == n) && t->shape[3] == c.head_dim &&
              (t->dtype == DType::f32 || t->dtype == DType::bf16),
          "ThinKVPolicy::", fn, " (on the device): ", t == &k ? "keys" : "values",
          " must be a contiguous device f32/bf16 [batch = ", impl_.batch(),
          ", kv_heads = ", c.kv_heads, ", ", n < 0 ? std::string("n") : std::to_string(n),
          ", head_dim = ", c.head_dim, "] view, got ", t->shape_string(), " ", dtype_name(t->dtype),
          " on ", device_name(t->device), t->is_contiguous() ? "" : " (strided)");
    }
    KVSIFT_CHECK(k.shape == v.shape && k.dtype == v.dtype, "ThinKVPolicy::", fn, ": keys ",
                 k.shape_string(), " ", dtype_name(k.dtype), " and values ", v.shape_string(), " ",
                 dtype_name(v.dtype), " differ");
  }
  // queries/out: device f32 [batch, q_heads, 1, head_dim], contiguous.
  void check_queries(const TensorView& t, const char* what) const {
    const ThinKVConfig& c = impl_.config();
    KVSIFT_CHECK(t.data != nullptr && t.rank == 4 && t.device == Device::cuda &&
                     t.is_contiguous() && t.dtype == DType::f32 && t.shape[0] == impl_.batch() &&
                     t.shape[1] == c.q_heads && t.shape[2] == 1 && t.shape[3] == c.head_dim,
                 "ThinKVPolicy (on the device): ", what,
                 " must be a contiguous device f32 [batch = ", impl_.batch(),
                 ", q_heads = ", c.q_heads, ", 1, head_dim = ", c.head_dim, "] view, got ",
                 t.shape_string(), " ", dtype_name(t.dtype), " on ", device_name(t.device),
                 t.is_contiguous() ? "" : " (strided)");
  }

  DeviceThinKV impl_;
};

// The backend's own layouts, carved from ctx.workspace in this order:
//   rkv_select     [slot rows | rkv scratch]
//   skipkv_select  [slot rows | penalty CSR | skipkv scratch]
//   skipkv_compress_step  see SkipKVStepLayout
class CudaBackend final : public DeviceBackend {
 public:
  std::size_t compact_workspace_bytes(const KeepPlan& plan) const override {
    return cuda::compact_workspace_bytes(plan);
  }
  void compact(const KVCacheView& kv, const KeepPlan& plan, const ExecContext& ctx) const override {
    cuda::compact(kv, plan, ctx.workspace, ctx.workspace_bytes, stream_of(ctx));
  }
  std::size_t compact_workspace_bound(const KVCacheView& kv) const override {
    // cuda::compact_workspace_bytes of the largest plan: every row keeps max_b S_b slots.
    const auto rows = static_cast<std::size_t>(kv.batch() * kv.kv_heads());
    std::int64_t longest = 0;
    for (std::int64_t b = 0; b < kv.batch(); ++b)
      longest = std::max<std::int64_t>(longest, kv.length(b));
    return align_up((rows + 1) * sizeof(std::int64_t)) +
           align_up(std::max<std::size_t>(rows * static_cast<std::size_t>(longest), 1) *
                    sizeof(std::int32_t));
  }

  std::size_t rkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                  const RKVConfig& cfg) const override {
    return slot_bytes(kv, cfg.budget) + cuda::rkv_workspace_bytes(kv, queries, cfg);
  }
  KeepPlan rkv_select(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
                      const ExecContext& ctx) const override {
    const char* op = "DeviceBackend::rkv_select";
    const std::size_t need = rkv_workspace_bytes(kv, queries, cfg);       // validates everything
    if (!any_over_budget(kv, cfg.budget)) return KeepPlan::keep_all(kv);  // §1.3: nothing moves
    KVSIFT_CHECK(ctx.workspace != nullptr && ctx.workspace_bytes >= need, op, ": workspace of ",
                 ctx.workspace_bytes, " bytes is too small (", need, " needed)");
    const std::size_t slots_b = slot_bytes(kv, cfg.budget);
    char* base = static_cast<char*>(ctx.workspace);
    auto* slots = reinterpret_cast<std::int32_t*>(base);
    cuda::rkv_select(kv, queries, cfg, slots, nullptr, base + slots_b,
                     ctx.workspace_bytes - slots_b, stream_of(ctx));
    return download_keep_plan(kv, slots, cfg.budget, cfg.window, stream_of(ctx));
  }

  // rkv_compress_step's workspace: [kept lengths | cuda::rkv_compress_step's own layout].
  std::size_t rkv_step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                       int n_layers, const RKVConfig& cfg) const override {
    const std::size_t step = cuda::rkv_compress_step_layout(layers, queries, n_layers, cfg).total();
    return lengths_bytes(layers[0]) + step;
  }
  void rkv_compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                         const RKVConfig& cfg, const ExecContext& ctx) const override {
    const char* op = "DeviceBackend::rkv_compress_step";
    const std::size_t need = rkv_step_workspace_bytes(layers, queries, n_layers, cfg);  // validates
    const KVCacheView& kv0 = layers[0];
    if (!any_over_budget(kv0, cfg.budget)) return;  // §1.3: nothing moves
    KVSIFT_CHECK(ctx.workspace != nullptr && ctx.workspace_bytes >= need, op, ": workspace of ",
                 ctx.workspace_bytes, " bytes is too small (", need, " needed)");
    char* base = static_cast<char*>(ctx.workspace);
    auto* new_lengths = reinterpret_cast<std::int32_t*>(base);
    const std::size_t len_b = lengths_bytes(kv0);
    cuda::rkv_compress_step(layers, queries, n_layers, cfg, base + len_b,
                            ctx.workspace_bytes - len_b, new_lengths, stream_of(ctx));
    std::vector<std::int32_t> kept(static_cast<std::size_t>(kv0.batch()));
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(kept.data(), new_lengths, kept.size() * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToHost, stream_of(ctx)));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
    std::string nan_rows;
    for (std::size_t b = 0; b < kept.size(); ++b) {
      if (kept[b] < 0) {
        nan_rows += (nan_rows.empty() ? "" : ", ") + std::to_string(b);
        continue;
      }
      for (int l = 0; l < n_layers; ++l) layers[l].lengths[b] = kept[b];
    }
    KVSIFT_CHECK(nan_rows.empty(), op, ": NaN scores in sequence(s) ", nan_rows,
                 "; those sequences were left untouched in every layer, the others compacted");
  }

  std::size_t skipkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                     const SentenceScorerConfig& cfg,
                                     const SentencePenalties& penalties) const override {
    const SentencePenaltyCsr csr = build_penalty_csr(penalties, kv.batch(), kv.kv_heads());
    return slot_bytes(kv, cfg.rkv.budget) + align_up(sentence_penalty_workspace_bytes(csr)) +
           cuda::skipkv_workspace_bytes(kv, queries, cfg);
  }
  KeepPlan skipkv_select(const KVCacheView& kv, const TensorView& queries,
                         const SentenceScorerConfig& cfg, const SentencePenalties& penalties,
                         const ExecContext& ctx) const override {
    const char* op = "DeviceBackend::skipkv_select";
    const SentencePenaltyCsr csr = build_penalty_csr(penalties, kv.batch(), kv.kv_heads());
    const std::size_t slots_b = slot_bytes(kv, cfg.rkv.budget);
    const std::size_t pen_b = align_up(sentence_penalty_workspace_bytes(csr));
    const std::size_t need = slots_b + pen_b + cuda::skipkv_workspace_bytes(kv, queries, cfg);
    if (!any_over_budget(kv, cfg.rkv.budget)) return KeepPlan::keep_all(kv);  // §1.3: nothing moves
    KVSIFT_CHECK(ctx.workspace != nullptr && ctx.workspace_bytes >= need, op, ": workspace of ",
                 ctx.workspace_bytes, " bytes is too small (", need, " needed)");
    char* base = static_cast<char*>(ctx.workspace);
    auto* slots = reinterpret_cast<std::int32_t*>(base);
    // `csr` outlives the copies: download_keep_plan() below waits for the stream.
    const SentencePenaltiesDevice d_pen =
        upload_sentence_penalties(csr, base + slots_b, pen_b, stream_of(ctx));
    cuda::skipkv_select(kv, queries, cfg, d_pen, slots, nullptr, base + slots_b + pen_b,
                        ctx.workspace_bytes - slots_b - pen_b, stream_of(ctx));
    return download_keep_plan(kv, slots, cfg.rkv.budget, cfg.rkv.window, stream_of(ctx));
  }

  std::size_t skipkv_step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                          int n_layers, const SentenceScorerConfig& cfg,
                                          std::int64_t max_ranges) const override {
    return skipkv_step_layout(layers, queries, n_layers, cfg, max_ranges).total();
  }
  void skipkv_compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                            const SentenceScorerConfig& cfg, const StepPenalties& penalties,
                            SkipKVStepRows& out, const ExecContext& ctx) const override {
    const char* op = "DeviceBackend::skipkv_compress_step";
    // Everything is validated before anything is enqueued: an error leaves every cache as it was.
    const SkipKVStepLayout w = skipkv_step_layout(
        layers, queries, n_layers, cfg, static_cast<std::int64_t>(penalties.ranges.size()));
    const KVCacheView& kv0 = layers[0];
    check_step_penalties(penalties, kv0, n_layers, op);
    const int budget = cfg.rkv.budget;
    const std::int64_t batch = kv0.batch(), heads = kv0.kv_heads(), rows = batch * heads;
    const std::size_t slot_count = static_cast<std::size_t>(n_layers) *
                                   static_cast<std::size_t>(rows) *
                                   static_cast<std::size_t>(budget);
    out.row_stride = budget;
    out.kept.assign(kv0.lengths, kv0.lengths + batch);
    out.slots.resize(slot_count);
    if (!any_over_budget(kv0, budget)) {  // §1.3: nothing moves; every row keeps 0 .. S_b - 1
      for (std::int64_t r = 0; r < n_layers * rows; ++r) {
        std::int32_t* row = out.slots.data() + r * budget;
        for (std::int32_t i = 0; i < kv0.length(r % rows / heads); ++i) row[i] = i;
      }
      return;
    }
    KVSIFT_CHECK(ctx.workspace != nullptr && ctx.workspace_bytes >= w.total(), op,
                 ": workspace of ", ctx.workspace_bytes, " bytes is too small (", w.total(),
                 " needed)");
    char* base = static_cast<char*>(ctx.workspace);
    auto* slots = reinterpret_cast<std::int32_t*>(base);
    auto* new_lengths = reinterpret_cast<std::int32_t*>(base + w.slots_b);
    auto* d_indptr = reinterpret_cast<std::int64_t*>(base + w.slots_b + w.lengths_b);
    auto* d_ranges = reinterpret_cast<PenaltyRange*>(base + w.slots_b + w.lengths_b + w.indptr_b);
    void* scratch = base + w.slots_b + w.lengths_b + w.indptr_b + w.ranges_b;
    const cudaStream_t stream = stream_of(ctx);
    const std::int64_t count = static_cast<std::int64_t>(penalties.ranges.size());
    // `penalties` outlives the copies: the wait below comes before this returns.
    if (count > 0) {
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_indptr, penalties.indptr.data(),
                                        penalties.indptr.size() * sizeof(std::int64_t),
                                        cudaMemcpyHostToDevice, stream));
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_ranges, penalties.ranges.data(),
                                        penalties.ranges.size() * sizeof(PenaltyRange),
                                        cudaMemcpyHostToDevice, stream));
    }
    // Select every layer (its rows of the indptr index the shared ranges absolutely), then
    // compact them all at once: a sequence with a NaN row in any layer is left untouched in every
    // layer.
    for (int l = 0; l < n_layers; ++l) {
      SentencePenaltiesDevice d;
      d.batch = batch;
      d.kv_heads = heads;
      if (count > 0) {
        d.count = count;
        d.indptr = d_indptr + static_cast<std::int64_t>(l) * rows;
        d.ranges = d_ranges;
      }
      cuda::skipkv_select(layers[l], queries[l], cfg, d, slots + l * rows * budget, nullptr,
                          scratch, w.scratch_b, stream);
    }
    cuda::compact_device_rows_step(layers, n_layers, slots, budget, new_lengths, stream);
    // The one wait of the step: kept counts and every layer's kept rows (the range maps' input).
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(out.kept.data(), new_lengths,
                                      out.kept.size() * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToHost, stream));
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(out.slots.data(), slots, slot_count * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToHost, stream));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (std::int64_t b = 0; b < batch; ++b) {
      if (out.kept[b] < 0) continue;  // NaN: left untouched, reported to the caller
      for (int l = 0; l < n_layers; ++l) layers[l].lengths[b] = out.kept[b];
    }
  }

  void copy_to_host(void* dst, const void* src, std::size_t bytes,
                    const ExecContext& ctx) const override {
    if (bytes == 0) return;
    KVSIFT_CHECK(dst != nullptr && src != nullptr,
                 "DeviceBackend::copy_to_host: null pointer (dst ", dst, ", src ", src, ") for ",
                 bytes, " bytes");
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(ctx)));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  }

  std::size_t thinkv_memory_bytes(const ThinKVConfig& config, std::int64_t batch) const override {
    KVSIFT_CHECK(batch >= 1 && batch <= 65535, "ThinKVPolicy: batch (", batch,
                 ") outside [1, 65535] on the device");
    return DeviceThinKV::memory_bytes(config, static_cast<std::int32_t>(batch));
  }
  std::unique_ptr<DeviceThinKVPipeline> make_thinkv(const ThinKVConfig& config, std::int64_t batch,
                                                    const ExecContext& ctx) const override {
    KVSIFT_CHECK(batch >= 1 && batch <= 65535, "ThinKVPolicy: batch (", batch,
                 ") outside [1, 65535] on the device");
    return std::make_unique<CudaThinKV>(config, batch, ctx);
  }
};

const CudaBackend g_cuda_backend;

// Static initialisation of this object file (linked thanks to the anchor): registers the backend.
[[maybe_unused]] const bool g_registered = (register_device_backend(&g_cuda_backend), true);

}  // namespace
}  // namespace kvsift::cuda
