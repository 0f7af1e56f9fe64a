// Host side of the R-KV CUDA pipeline (docs/algorithms.md §1.1–§1.3): validation, workspace layout,
// the joint score λ·a − (1−λ)·R, and the download of selected slots into a KeepPlan.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "batch_runs.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "rkv_kernels.cuh"

namespace kvsift::cuda {

void check_cuda_rkv_config(const RKVConfig& cfg, const char* op) {
  cfg.validate();
  KVSIFT_CHECK(cfg.gqa == GqaReduce::max, op,
               ": RKVConfig.gqa = mean is not supported by the CUDA backend (max only)");
  KVSIFT_CHECK(cfg.sink == 0, op, ": RKVConfig.sink = ", cfg.sink,
               " is not supported by the CUDA backend (0 only)");
}

namespace detail {
namespace {

// Shared-memory bounds of the kernels' dynamic parts (window statistics, head_dim sums).
constexpr int kMaxWindow = 4096;
constexpr int kMaxHeadDim = 4096;

__global__ void joint_score_kernel(const float* __restrict__ importance,  // [rows, n]
                                   const float* __restrict__ redundancy,  // [rows, length]
                                   std::int64_t total, int n, int length, float mix_lambda,
                                   float* __restrict__ score) {  // [rows, n]
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= total) return;
  const std::int64_t row = e / n, j = e % n;
  // The same expression as the CPU reference (policy/baselines/rkv.hpp), term by term.
  score[e] = mix_lambda * importance[e] - (1.0f - mix_lambda) * redundancy[row * length + j];
}

}  // namespace

void launch_joint_score(const float* importance, const float* redundancy, int rows, int n,
                        int length, float mix_lambda, float* score, cudaStream_t stream) {
  const std::int64_t total = static_cast<std::int64_t>(rows) * n;
  if (total == 0) return;
  joint_score_kernel<<<static_cast<unsigned>((total + kBlockThreads - 1) / kBlockThreads),
                       kBlockThreads, 0, stream>>>(importance, redundancy, total, n, length,
                                                   mix_lambda, score);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

namespace {

struct CallShape {
  std::int64_t layers = 1, batch = 0, kv_heads = 0, window = 0, head_dim = 0;
  std::int64_t length = 0;            // S = max_b S_b: the pitch of every per-token buffer
  std::vector<std::int32_t> lengths;  // [batch] S_b (a host copy of layer 0's)
  bool tensor_core = false;           // the tensor-core search runs (asked for, and head_dim fits)
  std::int64_t n() const { return length > window ? length - window : 0; }
  std::int64_t sequences() const { return layers * batch; }
  std::int64_t rows() const { return sequences() * kv_heads; }
  // The shape of the run's slice of the batch: the kernels see equal lengths there.
  CallShape run(const LengthRun& r) const {
    CallShape c = *this;
    c.batch = r.count;
    c.length = r.length;
    c.lengths.assign(static_cast<std::size_t>(r.count), r.length);
    return c;
  }
};

// Everything rkv_* check of one layer before touching the device. `op` names the caller.
CallShape check_layer(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
                      const std::string& op) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cuda, op, ": the cache is in host memory (device ",
               device_name(kv.device()), "); use the CPU scorers");
  KVSIFT_CHECK(queries.data != nullptr, op, ": queries have no data (null pointer)");
  KVSIFT_CHECK(queries.device == Device::cuda, op, ": queries are in host memory");
  KVSIFT_CHECK(queries.rank == 4, op, ": queries must be [batch, q_heads, window, head_dim], got ",
               queries.shape_string());
  KVSIFT_CHECK(queries.shape[0] == kv.batch(), op, ": queries batch (", queries.shape[0],
               ") != keys batch (", kv.batch(), ")");
  KVSIFT_CHECK(queries.shape[3] == kv.head_dim(), op, ": queries head_dim (", queries.shape[3],
               ") != keys head_dim (", kv.head_dim(), ")");
  KVSIFT_CHECK(kv.kv_heads() > 0 && queries.shape[1] > 0 && queries.shape[1] % kv.kv_heads() == 0,
               op, ": queries q_heads (", queries.shape[1],
               ") must be a positive multiple of kv_heads (", kv.kv_heads(), ")");
  KVSIFT_CHECK(queries.shape[2] == cfg.window, op, ": queries hold ", queries.shape[2],
               " window rows, config window is ", cfg.window);
  KVSIFT_CHECK(queries.dtype == kv.dtype(), op, ": queries dtype ", dtype_name(queries.dtype),
               " != keys dtype ", dtype_name(kv.dtype()),
               " (this version needs one storage dtype)");
  KVSIFT_CHECK(cfg.window <= kMaxWindow, op, ": window (", cfg.window, ") exceeds ", kMaxWindow);
  KVSIFT_CHECK(kv.head_dim() >= 1 && kv.head_dim() <= kMaxHeadDim, op, ": head_dim (",
               kv.head_dim(), ") must be in [1, ", kMaxHeadDim, "]");
  KVSIFT_CHECK(kv.capacity() <= 0x7fffffff, op, ": capacity (", kv.capacity(),
               ") must fit in int32 slot indices");
  CallShape s;
  s.batch = kv.batch();
  s.kv_heads = kv.kv_heads();
  s.window = cfg.window;
  s.head_dim = kv.head_dim();
  s.lengths.assign(kv.lengths, kv.lengths + kv.batch());
  for (std::int32_t len : s.lengths) s.length = std::max<std::int64_t>(s.length, len);
  return s;
}

// The checks of a whole step: every layer as above, and all layers alike (shape, dtype, strides,
// lengths, one shared padding mask), since the kernels address them through one set of strides.
CallShape check_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                     const RKVConfig& cfg, const char* op) {
  check_cuda_rkv_config(cfg, op);
  KVSIFT_CHECK(n_layers >= 1 && n_layers <= kMaxStepLayers, op, ": n_layers (", n_layers,
               ") must be in [1, ", kMaxStepLayers, "]");
  KVSIFT_CHECK(layers != nullptr && queries != nullptr, op,
               ": layers and queries must point to n_layers views, got null");
  CallShape s = check_layer(layers[0], queries[0], cfg, op);
  for (int l = 1; l < n_layers; ++l) {
    const std::string op_l = std::string(op) + " (layer " + std::to_string(l) + ")";
    const CallShape sl = check_layer(layers[l], queries[l], cfg, op_l);
    const KVCacheView &kv = layers[l], &kv0 = layers[0];
    KVSIFT_CHECK(kv.keys.shape == kv0.keys.shape && kv.dtype() == kv0.dtype(), op_l, ": keys ",
                 kv.keys.shape_string(), " ", dtype_name(kv.dtype()), " differ from layer 0's ",
                 kv0.keys.shape_string(), " ", dtype_name(kv0.dtype()));
    KVSIFT_CHECK(kv.keys.stride == kv0.keys.stride && kv.values.stride == kv0.values.stride, op_l,
                 ": key/value strides differ from layer 0's (all layers need one layout)");
    for (std::int64_t b = 0; b < s.batch; ++b) {
      KVSIFT_CHECK(sl.lengths[b] == s.lengths[b], op_l, ": lengths[", b, "] = ", sl.lengths[b],
                   " != layer 0's ", s.lengths[b], " (a sequence has one length in every layer)");
    }
    KVSIFT_CHECK(
        kv.valid_mask == kv0.valid_mask, op_l,
        ": valid_mask differs from layer 0's (the mask is per sequence: one for all layers)");
    KVSIFT_CHECK(queries[l].shape == queries[0].shape && queries[l].stride == queries[0].stride,
                 op_l, ": queries ", queries[l].shape_string(),
                 " (or their strides) differ from layer 0's ", queries[0].shape_string());
  }
  s.layers = n_layers;
  s.tensor_core = cfg.tensor_core_search && tc_search_supported(static_cast<int>(s.head_dim));
  KVSIFT_CHECK(s.sequences() <= 65535 && s.kv_heads <= 65535, op, ": n_layers * batch (",
               s.sequences(), ") and kv_heads (", s.kv_heads, ") must be <= 65535 (grid limits)");
  return s;
}

std::size_t key_sums_count(const CallShape& s) {
  return static_cast<std::size_t>(s.rows() * key_sum_chunks(static_cast<int>(s.length)) *
                                  s.head_dim);
}

std::size_t unit16_count(const CallShape& s) {
  return static_cast<std::size_t>(
      tc_unit16_count(s.rows(), static_cast<int>(s.length), static_cast<int>(s.head_dim)));
}
std::size_t tc_reached_count(const CallShape& s) {
  return static_cast<std::size_t>(s.rows() * tc_row_tiles(static_cast<int>(s.length)));
}

// The workspace pieces, carved in this order by every call so the sizes always agree.
struct Workspace {
  float* logits;               // [batch, kv_heads, window, n]
  float* pre_pool;             // [batch, kv_heads, n]
  float* importance;           // [batch, kv_heads, n]
  float* denom;                // [batch, kv_heads, S]: ||K|| + 1e-8 per key (UnitKeys)
  void* unit16;                // tc_unit16_count(batch · kv_heads, S, head_dim) fp16, or null
  int* tc_reached;             // [batch, kv_heads, tc_row_tiles(S)], or null
  unsigned long long* spared;  // [batch, kv_heads, S]
  float* key_sums;             // [batch, kv_heads, key_sum_chunks(S), head_dim]
  float* redundancy;           // [batch, kv_heads, S]
  float* score;                // [batch, kv_heads, n]
};

Workspace carve_workspace(const CallShape& s, void* base, std::size_t bytes, const char* op) {
  WorkspaceCarver carve(base, bytes, op);
  const std::size_t rn = static_cast<std::size_t>(s.rows() * s.n());
  const std::size_t rs = static_cast<std::size_t>(s.rows() * s.length);
  Workspace w;
  w.logits = carve.take<float>(rn * static_cast<std::size_t>(s.window));
  w.pre_pool = carve.take<float>(rn);
  w.importance = carve.take<float>(rn);
  w.denom = carve.take<float>(rs);
  w.unit16 = s.tensor_core ? carve.take<std::uint16_t>(unit16_count(s)) : nullptr;
  w.tc_reached = s.tensor_core ? carve.take<int>(tc_reached_count(s)) : nullptr;
  w.spared = carve.take<unsigned long long>(rs);
  w.key_sums = carve.take<float>(key_sums_count(s));
  w.redundancy = carve.take<float>(rs);
  w.score = carve.take<float>(rn);
  return w;
}

std::size_t workspace_bytes_for(const CallShape& s) {
  const std::size_t tc_bytes = s.tensor_core ? align_up(unit16_count(s) * sizeof(std::uint16_t)) +
                                                   align_up(tc_reached_count(s) * sizeof(int))
                                             : 0;
  const std::size_t rn = static_cast<std::size_t>(s.rows() * s.n());
  const std::size_t rs = static_cast<std::size_t>(s.rows() * s.length);
  return align_up(rn * s.window * sizeof(float)) + 3 * align_up(rn * sizeof(float)) +
         align_up(rs * sizeof(float)) + align_up(rs * sizeof(float)) +
         align_up(rs * sizeof(unsigned long long)) + align_up(key_sums_count(s) * sizeof(float)) +
         tc_bytes;
}

// The scoring proper, after validation: writes `score` and, when given, importance/redundancy.
void enqueue_scores(const StepView& step, const RKVConfig& cfg, const CallShape& s,
                    const Workspace& w, float* score, float* importance, float* redundancy,
                    cudaStream_t stream) {
  float* a = importance != nullptr ? importance : w.importance;
  float* r = redundancy != nullptr ? redundancy : w.redundancy;
  const int length = static_cast<int>(s.length);
  // The key redundancy first: its one pass over the keys also writes the window logits when the
  // tensor-core logits apply, so the importance then reads them instead of the keys again. The
  // two use disjoint scratch, so the order changes no result.
  const bool faithful = cfg.redundancy == RedundancyMode::faithful;
  const bool logits_ready =
      launch_key_redundancy(step, length, cfg.threshold, faithful, w.denom, w.unit16, w.tc_reached,
                            w.spared, w.key_sums, r, stream, w.logits);
  launch_window_importance(step, length, cfg.kernel, w.logits, w.pre_pool, a, stream, logits_ready);
  launch_joint_score(a, r, static_cast<int>(s.rows()), static_cast<int>(s.n()), length,
                     cfg.mix_lambda, score, stream);
}

}  // namespace
}  // namespace detail

std::size_t rkv_step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                     int n_layers, const RKVConfig& cfg) {
  return detail::workspace_bytes_for(
      detail::check_step(layers, queries, n_layers, cfg, "rkv_step_workspace_bytes"));
}

std::size_t rkv_workspace_bytes(const KVCacheView& kv, const TensorView& queries,
                                const RKVConfig& cfg) {
  return detail::workspace_bytes_for(
      detail::check_step(&kv, &queries, 1, cfg, "rkv_workspace_bytes"));
}

namespace detail {
namespace {

// The slice of a run's sequences in every layer of the step, with their queries.
struct RunViews {
  std::vector<KVCacheView> layers;
  std::vector<TensorView> queries;
  StepView step() const {
    return StepView{layers.data(), queries.data(), static_cast<int>(layers.size())};
  }
};

RunViews run_views(const KVCacheView* layers, const TensorView* queries, int n_layers,
                   const LengthRun& r) {
  RunViews v;
  for (int l = 0; l < n_layers; ++l) {
    v.layers.push_back(batch_slice(layers[l], r.first, r.count));
    v.queries.push_back(batch_slice(queries[l], r.first, r.count));
  }
  return v;
}

// `rows` rows of `width` floats from a packed run buffer into the caller's pitched output.
void copy_rows(float* dst, std::int64_t dst_pitch, const float* src, std::int64_t width,
               std::int64_t rows, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(dst_pitch) * sizeof(float), src,
                                      static_cast<std::size_t>(width) * sizeof(float),
                                      static_cast<std::size_t>(width) * sizeof(float),
                                      static_cast<std::size_t>(rows), cudaMemcpyDeviceToDevice,
                                      stream));
}

}  // namespace
}  // namespace detail

void rkv_score(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
               const RKVScoreOutputs& out, void* workspace, std::size_t workspace_bytes,
               cudaStream_t stream) {
  using namespace detail;
  const CallShape s = check_step(&kv, &queries, 1, cfg, "rkv_score");
  KVSIFT_CHECK(out.score != nullptr, "rkv_score: out.score must be a device pointer, got null");
  if (s.batch == 0) return;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    KVSIFT_CHECK(s.lengths[b] > cfg.window, "rkv_score: lengths[", b, "] (", s.lengths[b],
                 ") must exceed the window (", cfg.window, ")");
  }
  // The whole-batch layout is checked up front; every run's own is smaller.
  const Workspace whole = carve_workspace(s, workspace, workspace_bytes, "rkv_score");
  const std::vector<LengthRun> runs = equal_length_runs(s.lengths.data(), s.batch);
  if (runs.size() == 1) {
    enqueue_scores(StepView{&kv, &queries, 1}, cfg, s, whole, out.score, out.importance,
                   out.redundancy, stream);
    return;
  }
  for (const LengthRun& r : runs) {  // runs reuse the scratch one after the other on `stream`
    const CallShape rs = s.run(r);
    const Workspace w = carve_workspace(rs, workspace, workspace_bytes, "rkv_score");
    const RunViews v = run_views(&kv, &queries, 1, r);
    enqueue_scores(v.step(), cfg, rs, w, w.score, w.importance, w.redundancy, stream);
    const std::int64_t rows = r.count * s.kv_heads, row0 = r.first * s.kv_heads;
    copy_rows(out.score + row0 * s.n(), s.n(), w.score, rs.n(), rows, stream);
    if (out.importance != nullptr)
      copy_rows(out.importance + row0 * s.n(), s.n(), w.importance, rs.n(), rows, stream);
    if (out.redundancy != nullptr)
      copy_rows(out.redundancy + row0 * s.length, s.length, w.redundancy, rs.length, rows, stream);
  }
}

namespace detail {
namespace {

bool select_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                 const RKVConfig& cfg, std::int32_t* slots, float* scores, void* workspace,
                 std::size_t workspace_bytes, cudaStream_t stream, const char* op) {
  const CallShape s = check_step(layers, queries, n_layers, cfg, op);
  KVSIFT_CHECK(slots != nullptr, op, ": slots must be a device pointer, got null");
  if (s.batch == 0) return false;
  const int budget = cfg.budget, heads = static_cast<int>(s.kv_heads);
  // docs/algorithms.md §1.3: a sequence at or below the budget evicts nothing and is not scored.
  const bool any_over = s.length > budget;
  if (any_over) carve_workspace(s, workspace, workspace_bytes, op);  // all checks up front
  const std::vector<LengthRun> runs = equal_length_runs(s.lengths.data(), s.batch);
  const bool whole = runs.size() == 1;  // the common equal-length batch: one set of launches
  for (const LengthRun& r : runs) {
    // Row (l, b, h) of the step's outputs is (l * batch + b) * kv_heads + h.
    auto row0 = [&](int l) { return (l * s.batch + r.first) * s.kv_heads; };
    if (r.length <= budget) {
      if (whole) {
        launch_keep_all_slots(static_cast<int>(s.rows()), r.length, budget, slots, stream);
      } else {
        for (int l = 0; l < n_layers; ++l)
          launch_keep_all_slots(static_cast<int>(r.count * s.kv_heads), r.length, budget,
                                slots + row0(l) * budget, stream);
      }
      continue;
    }
    const CallShape rs = s.run(r);
    const Workspace w = carve_workspace(rs, workspace, workspace_bytes, op);
    const RunViews v = run_views(layers, queries, n_layers, r);
    float* score = (whole && scores != nullptr) ? scores : w.score;
    enqueue_scores(v.step(), cfg, rs, w, score, nullptr, nullptr, stream);
    const KVCacheView& kv = v.layers[0];
    if (whole) {
      launch_select_topk(score, kv.valid_mask, static_cast<int>(s.batch),
                         static_cast<int>(s.sequences()), heads, kv.capacity(), r.length, budget,
                         cfg.window, slots, stream);
      continue;
    }
    for (int l = 0; l < n_layers; ++l) {
      const float* layer_score = score + l * r.count * s.kv_heads * rs.n();
      launch_select_topk(layer_score, kv.valid_mask, static_cast<int>(r.count),
                         static_cast<int>(r.count), heads, kv.capacity(), r.length, budget,
                         cfg.window, slots + row0(l) * budget, stream);
      if (scores != nullptr)
        copy_rows(scores + row0(l) * s.n(), s.n(), layer_score, rs.n(), r.count * s.kv_heads,
                  stream);
    }
  }
  return any_over;
}

}  // namespace
}  // namespace detail

bool rkv_select(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg,
                std::int32_t* slots, float* scores, void* workspace, std::size_t workspace_bytes,
                cudaStream_t stream) {
  return detail::select_step(&kv, &queries, 1, cfg, slots, scores, workspace, workspace_bytes,
                             stream, "rkv_select");
}

bool rkv_select_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                     const RKVConfig& cfg, std::int32_t* slots, float* scores, void* workspace,
                     std::size_t workspace_bytes, cudaStream_t stream) {
  return detail::select_step(layers, queries, n_layers, cfg, slots, scores, workspace,
                             workspace_bytes, stream, "rkv_select_step");
}

KeepPlan keep_plan_from_slot_rows(const KVCacheView& kv, std::vector<std::int32_t> rows, int budget,
                                  int window) {
  const char* op = "keep_plan_from_slot_rows";
  kv.validate();
  const std::int64_t batch = kv.batch(), heads = kv.kv_heads();
  KVSIFT_CHECK(budget > 0 && window >= 0, op, ": budget (", budget, ") must be > 0 and window (",
               window, ") >= 0");
  KVSIFT_CHECK(static_cast<std::int64_t>(rows.size()) == batch * heads * budget, op, ": ",
               rows.size(), " slots for [batch=", batch, ", kv_heads=", heads, ", budget=", budget,
               "]");
  std::vector<std::int32_t> source(kv.lengths, kv.lengths + batch), kept(batch, 0);
  auto row_length = [&](std::int64_t b, std::int64_t h) {
    const std::int32_t* row = rows.data() + (b * heads + h) * budget;
    std::int64_t n = 0;
    while (n < budget && row[n] != kUnusedSlot) {
      KVSIFT_CHECK(row[n] != kNanScoreSlot, op, ": row (b=", b, ", h=", h, ") has a NaN score");
      ++n;
    }
    for (std::int64_t i = n; i < budget; ++i) {
      KVSIFT_CHECK(row[i] == kUnusedSlot, op, ": row (b=", b, ", h=", h, ") has slot ", row[i],
                   " after an unused entry at ", n);
    }
    return n;
  };
  for (std::int64_t b = 0; b < batch; ++b) {
    kept[b] = static_cast<std::int32_t>(row_length(b, 0));
    for (std::int64_t h = 1; h < heads; ++h) {
      const std::int64_t n = row_length(b, h);
      KVSIFT_CHECK(n == kept[b], op, ": heads of sequence ", b, " keep different counts (", kept[b],
                   " vs ", n, " in head ", h, ")");
    }
  }
  KeepPlan plan(batch, heads, kv.capacity(), source, kept, window);
  // The rows closed up in place (row r's kept[r / heads] slots move down to where the rows before
  // it end) and handed to the plan: no second copy of a buffer that is 2 MiB at batch 64.
  std::size_t end = 0;
  for (std::int64_t r = 0; r < batch * heads; ++r) {
    const std::size_t n = static_cast<std::size_t>(kept[r / heads]);
    const std::size_t from = static_cast<std::size_t>(r * budget);
    if (from != end) std::copy_n(rows.begin() + from, n, rows.begin() + end);
    end += n;
  }
  rows.resize(end);
  plan.set_rows(std::move(rows));
  plan.validate();  // sorted, unique, in range, window kept
  return plan;
}

KeepPlan download_keep_plan(const KVCacheView& kv, const std::int32_t* slots, int budget,
                            int window, cudaStream_t stream) {
  kv.validate();
  KVSIFT_CHECK(budget > 0 && window >= 0, "download_keep_plan: budget (", budget,
               ") must be > 0 and window (", window, ") >= 0");
  KVSIFT_CHECK(slots != nullptr || kv.batch() == 0,
               "download_keep_plan: slots must be a device pointer, got null");
  std::vector<std::int32_t> host(static_cast<std::size_t>(kv.batch() * kv.kv_heads() * budget));
  if (!host.empty()) {
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(host.data(), slots, host.size() * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToHost, stream));
  }
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  return keep_plan_from_slot_rows(kv, std::move(host), budget, window);
}

}  // namespace kvsift::cuda
