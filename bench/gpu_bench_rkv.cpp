// R-KV's compression (docs/algorithms.md §1.1-§1.3) on the GPU, per layer and per 32-layer
// decode step, against two floors measured in the same run: the HBM floor (the bytes that must
// cross HBM once, at the device-to-device copy bandwidth) and the compute floor of the
// near-duplicate search (its worst-case FLOPs at the bf16 mma.sync peak).
//
// Shapes are R1-Llama-8B attention: 32 query / 8 KV heads, head_dim 128, bf16, window 8; a step
// runs at the decode trigger, S = budget + buffer (128) tokens (§1.3). Grid (all restrictable from
// the command line): batch {1, 8, 32, 64, 128} × budget {1024, 2048, 4096} × keys {random,
// structured}.
//
//   layer  cuda::rkv_select + cuda::compact_device_rows on one layer: the device path, the plan
//          never leaves the GPU (device time, CUDA events; "select" is rkv_select alone).
//   step   kvsift::device_backend().rkv_compress_step over 32 layers, as Policy::compress_step
//          calls it: selection in chunks of layers, one compaction of every layer, one host wait
//          for the kept lengths (device time between events around the call, so it includes that
//          wait and the host-side launches).
// Compaction is in place, so the keys are regenerated on the device before every repetition (a
// pure function of the seed: bit-identical each time) and a 256 MiB buffer is read to evict
// them from L2; neither is timed. Values are generated once (their content does not change the
// work). The caches of each configuration are allocated for it and freed after it; a
// configuration that does not fit prints "skipped: memory".
//
// Keys (bench/gpu_rkv_inputs.hpp):
//   random      i.i.d. N(0, 1): cosines ~ N(0, 1/D), no row ever reaches the 0.5 threshold, so the
//               search never exits early: its worst case.
//   structured  per (sequence, KV head) a shared direction a·g (g ~ N(0, I_D), a ~ U[0.5, 3]) plus
//               N(0, 1) noise per element, and 20 % planted near-duplicates (an earlier row plus
//               0.1·N(0, 1), cosine > 0.99), as real keys have; most rows find a match in the
//               first tiles they search, so the search exits early. No RoPE.
// A check at start-up measures both generators' cosine statistics on the device's own output.
//
// Usage: gpu_bench_rkv [--batches 1,64] [--budgets 1024] [--keys random,structured]
//                      [--search tc|fp32|both] [--layers 32] [--reps N] [--out FILE] [--smoke]
//                      [--mag-range 0.5,3] [--dup-fraction 0.2]
// (bare integers are read as batches, the old usage). --smoke runs one tiny configuration.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "gpu_rkv_inputs.hpp"
#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"

using namespace kvsift;

namespace {

constexpr int kQHeads = 32, kKVHeads = 8, kHeadDim = 128;
constexpr double kElemBytes = 2.0;                           // bf16
constexpr std::size_t kFlushBytes = std::size_t(256) << 20;  // > 5x an H200's 50 MiB L2
constexpr std::size_t kHeadroomBytes = std::size_t(1) << 30;

enum class Keys { random, structured };
const char* keys_name(Keys k) { return k == Keys::random ? "random" : "structured"; }

struct Options {
  std::vector<int> batches{1, 8, 32, 64, 128};
  std::vector<int> budgets{1024, 2048, 4096};
  std::vector<Keys> keys{Keys::random, Keys::structured};
  std::vector<bool> tensor_core{true};  // RKVConfig::tensor_core_search (the default: true)
  int buffer = 128, window = 8, layers = 32;
  int reps = 0;  // 0: by configuration size (see reps_for)
  bool smoke = false;
  std::string out;
  bench::StructuredKeys structured;
  std::uint64_t seed = 1;
};

// ---------------------------------------------------------------------------------------------
// Floors
// ---------------------------------------------------------------------------------------------
// HBM floor of one layer, in bytes: what a perfect implementation must move through HBM once.
//   keys read once            B·Hkv·S·D     (the search and the window logits need every key)
//   window queries read once  B·Hq·W·D
//   kept value rows read      B·Hkv·budget·D
//   kept key and value rows written   2·B·Hkv·budget·D
// times 2 bytes (bf16). Every kept row is counted as moved (evictions are spread through the
// sequence, so nearly all kept rows change place); kept keys need no second read (they were read
// for the search). A 32-layer step's floor is 32 times this.
double layer_floor_bytes(int batch, int budget, int seq, int window) {
  const double b = batch, d = kHeadDim;
  return kElemBytes *
         (b * kKVHeads * seq * d + b * kQHeads * window * d + 3.0 * b * kKVHeads * budget * d);
}
// The near-duplicate search's worst case (no early exit), per layer: the symmetric search computes
// each pair (i, j), i < j, once: S(S−1)/2 dot products of D multiply-adds per (sequence, KV head).
double layer_search_flop(int batch, int seq) {
  const double s = seq;
  return static_cast<double>(batch) * kKVHeads * s * (s - 1.0) / 2.0 * kHeadDim * 2.0;
}

// ---------------------------------------------------------------------------------------------
// Device memory that may not fit: allocation failure is a result, not an error.
// ---------------------------------------------------------------------------------------------
class DeviceMemory {
 public:
  DeviceMemory() = default;
  ~DeviceMemory() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  // False (and the CUDA error cleared) when the device has no room.
  bool allocate(std::size_t bytes) {
    KVSIFT_CHECK(p_ == nullptr, "DeviceMemory: allocated twice");
    const cudaError_t e = cudaMalloc(&p_, std::max<std::size_t>(bytes, 1));
    if (e != cudaSuccess) {
      p_ = nullptr;
      (void)cudaGetLastError();  // out-of-memory is not sticky: clear it
      return false;
    }
    bytes_ = bytes;
    return true;
  }
  char* get() const { return static_cast<char*>(p_); }
  std::size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------------
std::uint64_t key_seed(const Options& o, int layer) { return o.seed * 0x10001ull + 4ull * layer; }
std::uint64_t value_seed(const Options& o, int layer) { return key_seed(o, layer) + 1; }
std::uint64_t query_seed(const Options& o, int layer) { return key_seed(o, layer) + 2; }

// Keys of one layer [batch, kv_heads, seq, head_dim], regenerated bit-identically on every call.
void fill_keys(const Options& o, Keys keys, int layer, void* dst, int batch, int seq,
               cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(batch) * kKVHeads * seq * kHeadDim;
  if (keys == Keys::random)
    bench::fill_normal_bf16(dst, n, key_seed(o, layer), stream);
  else
    bench::fill_structured_keys_bf16(dst, batch, kKVHeads, seq, kHeadDim, o.structured,
                                     key_seed(o, layer), stream);
}

// Cosine statistics of the generators' own device output (one sequence, every KV head, S rows),
// so the table's key labels are checked on the machine that produced it.
struct KeyStats {
  double near_dup = 0;   // rows with an earlier row at cosine > 0.99
  double any_match = 0;  // rows with some other row above the R-KV threshold
  double mean_cos = 0;   // mean cosine of consecutive rows
};
KeyStats key_stats(const Options& o, Keys keys, int seq, float threshold, cudaStream_t stream) {
  const std::size_t n = static_cast<std::size_t>(kKVHeads) * seq * kHeadDim;
  bench::DeviceArray<bf16_t> d(n);
  fill_keys(o, keys, 0, d.get(), 1, seq, stream);
  std::vector<bf16_t> raw(n);
  KVSIFT_CUDA_CHECK(
      cudaMemcpyAsync(raw.data(), d.get(), n * sizeof(bf16_t), cudaMemcpyDeviceToHost, stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> unit(n);
  for (std::size_t r = 0; r < n / kHeadDim; ++r) {
    double s = 0;
    for (int k = 0; k < kHeadDim; ++k) {
      const float x = to_float(raw[r * kHeadDim + k]);
      unit[r * kHeadDim + k] = x;
      s += double(x) * x;
    }
    const float inv = s > 0 ? static_cast<float>(1.0 / std::sqrt(s)) : 0.0f;
    for (int k = 0; k < kHeadDim; ++k) unit[r * kHeadDim + k] *= inv;
  }
  auto cosine = [&](std::size_t a, std::size_t b) {
    float c = 0;
    for (int k = 0; k < kHeadDim; ++k) c += unit[a * kHeadDim + k] * unit[b * kHeadDim + k];
    return c;
  };
  KeyStats st;
  std::vector<char> matched(static_cast<std::size_t>(kKVHeads) * seq, 0);
  for (int h = 0; h < kKVHeads; ++h) {
    const std::size_t base = static_cast<std::size_t>(h) * seq;
    for (int i = 0; i < seq; ++i) {
      float best = -2.0f;
      for (int j = 0; j < i; ++j) {
        const float c = cosine(base + i, base + j);
        best = std::max(best, c);
        if (c > threshold) matched[base + i] = matched[base + j] = 1;
      }
      if (best > 0.99f) st.near_dup += 1;
      if (i > 0) st.mean_cos += cosine(base + i, base + i - 1);
    }
  }
  for (char m : matched) st.any_match += m;
  const double rows = static_cast<double>(kKVHeads) * seq;
  st.near_dup /= rows;
  st.any_match /= rows;
  st.mean_cos /= static_cast<double>(kKVHeads) * (seq - 1);
  return st;
}

// ---------------------------------------------------------------------------------------------
// One configuration
// ---------------------------------------------------------------------------------------------
struct Row {
  Keys keys;
  bool tensor_core;
  int batch, budget, seq;
  std::string status;  // empty: measured; otherwise "skipped: ..." or "error: ..."
  float select_ms = NAN, layer_ms = NAN, step_ms = NAN;
  double floor_ms = NAN, compute_ms = NAN, flop = NAN;
  int layer_reps = 0, step_reps = 0;
  std::string check;
};

// A CUDA event, destroyed on scope exit (also when a timed call throws).
struct Event {
  cudaEvent_t e = nullptr;
  Event() { KVSIFT_CUDA_CHECK(cudaEventCreate(&e)); }
  ~Event() { cudaEventDestroy(e); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// Repetitions by size: few for the big configurations, so the full grid stays within minutes.
int layer_reps_for(const Options& o, double layer_bytes) {
  if (o.reps > 0) return o.reps;
  if (o.smoke) return 3;
  return layer_bytes <= 256e6 ? 20 : layer_bytes <= 2e9 ? 10 : 5;
}
int step_reps_for(const Options& o, double step_bytes) {
  if (o.reps > 0) return o.reps;
  if (o.smoke) return 2;
  return step_bytes <= 2e9 ? 10 : step_bytes <= 16e9 ? 5 : 3;
}

// Sequence 0's first `budget` rows of every head of one layer's keys (after a compaction: its kept
// keys), to compare the per-layer path with the step.
std::vector<bf16_t> kept_rows_of_sequence0(const bf16_t* keys, int seq, int budget,
                                           cudaStream_t stream) {
  std::vector<bf16_t> out(static_cast<std::size_t>(kKVHeads) * budget * kHeadDim);
  const std::size_t row_bytes = static_cast<std::size_t>(budget) * kHeadDim * sizeof(bf16_t);
  for (int h = 0; h < kKVHeads; ++h)
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(out.data() + static_cast<std::size_t>(h) * budget * kHeadDim,
                                      keys + static_cast<std::size_t>(h) * seq * kHeadDim,
                                      row_bytes, cudaMemcpyDeviceToHost, stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

void run_config(const Options& o, Row& row, double bandwidth, double peak, cudaStream_t stream) {
  const int batch = row.batch, budget = row.budget, seq = row.seq, L = o.layers;
  const std::size_t layer_elems = static_cast<std::size_t>(batch) * kKVHeads * seq * kHeadDim;
  const std::size_t q_elems = static_cast<std::size_t>(batch) * kQHeads * o.window * kHeadDim;
  const double layer_bytes = 2.0 * kElemBytes * static_cast<double>(layer_elems);
  row.floor_ms = layer_floor_bytes(batch, budget, seq, o.window) / bandwidth * 1e3;
  row.flop = layer_search_flop(batch, seq);
  row.compute_ms = row.flop / peak * 1e3;

  // Room for every layer's K, V and queries, the L2 flush buffer and (a guess, checked below
  // when the exact sizes are known) the workspaces.
  const std::size_t cache_bytes = static_cast<std::size_t>(L) * layer_elems * sizeof(bf16_t);
  const std::size_t query_bytes = static_cast<std::size_t>(L) * q_elems * sizeof(bf16_t);
  std::size_t free_b = 0, total_b = 0;
  KVSIFT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const std::size_t want = 2 * cache_bytes + query_bytes + kFlushBytes + kHeadroomBytes;
  if (want > free_b) {
    row.status = "skipped: memory (" + std::to_string(want >> 20) + " MiB needed, " +
                 std::to_string(free_b >> 20) + " MiB free)";
    return;
  }
  DeviceMemory keys, values, queries, flush, sink;
  if (!keys.allocate(cache_bytes) || !values.allocate(cache_bytes) ||
      !queries.allocate(query_bytes) || !flush.allocate(kFlushBytes) ||
      !sink.allocate(sizeof(std::uint32_t))) {
    row.status = "skipped: memory (allocation failed)";
    return;
  }
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(flush.get(), 1, kFlushBytes, stream));
  auto k_of = [&](int l) {
    return reinterpret_cast<bf16_t*>(keys.get()) + static_cast<std::size_t>(l) * layer_elems;
  };
  auto v_of = [&](int l) {
    return reinterpret_cast<bf16_t*>(values.get()) + static_cast<std::size_t>(l) * layer_elems;
  };
  auto q_of = [&](int l) {
    return reinterpret_cast<bf16_t*>(queries.get()) + static_cast<std::size_t>(l) * q_elems;
  };
  for (int l = 0; l < L; ++l) {
    bench::fill_normal_bf16(v_of(l), layer_elems, value_seed(o, l), stream);
    bench::fill_normal_bf16(q_of(l), q_elems, query_seed(o, l), stream);
  }

  RKVConfig cfg;
  cfg.budget = budget;
  cfg.window = o.window;
  cfg.buffer = o.buffer;
  cfg.tensor_core_search = row.tensor_core;

  std::vector<std::vector<std::int32_t>> lengths(static_cast<std::size_t>(L),
                                                 std::vector<std::int32_t>(batch, seq));
  std::vector<KVCacheView> views;
  std::vector<TensorView> qviews;
  for (int l = 0; l < L; ++l) {
    views.push_back(make_kv_cache_view(k_of(l), v_of(l), DType::bf16, Device::cuda, batch, kKVHeads,
                                       seq, kHeadDim, lengths[l].data()));
    qviews.push_back(TensorView::contiguous(q_of(l), DType::bf16, Device::cuda,
                                            {batch, kQHeads, o.window, kHeadDim}));
  }
  auto reset_lengths = [&] {
    for (auto& ln : lengths) std::fill(ln.begin(), ln.end(), seq);
  };
  // Restores the keys of layers [0, n) and evicts them from L2 (a read of 256 MiB: clean lines,
  // so the timed work pays no write-backs of the restore); waits, so the timed work that follows
  // starts on an idle device.
  auto restore = [&](int n) {
    for (int l = 0; l < n; ++l) fill_keys(o, row.keys, l, k_of(l), batch, seq, stream);
    bench::read_flush(flush.get(), kFlushBytes, reinterpret_cast<std::uint32_t*>(sink.get()),
                      stream);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    reset_lengths();
  };

  // --- per layer: rkv_select + compact_device_rows on layer 0 ---------------------------------
  const std::size_t slot_elems = static_cast<std::size_t>(batch) * kKVHeads * budget;
  DeviceMemory layer_ws, slots, new_len;
  const std::size_t layer_ws_b = cuda::rkv_workspace_bytes(views[0], qviews[0], cfg);
  if (!layer_ws.allocate(layer_ws_b) || !slots.allocate(slot_elems * sizeof(std::int32_t)) ||
      !new_len.allocate(static_cast<std::size_t>(batch) * sizeof(std::int32_t))) {
    row.status =
        "skipped: memory (layer workspace of " + std::to_string(layer_ws_b >> 20) + " MiB)";
    return;
  }
  auto* slot_ptr = reinterpret_cast<std::int32_t*>(slots.get());
  auto* len_ptr = reinterpret_cast<std::int32_t*>(new_len.get());
  Event start, mid, stop;
  std::vector<float> t_sel, t_layer;
  row.layer_reps = layer_reps_for(o, layer_bytes);
  const int layer_warmup = o.smoke ? 1 : 2;
  for (int r = 0; r < layer_warmup + row.layer_reps; ++r) {
    restore(1);
    KVSIFT_CUDA_CHECK(cudaEventRecord(start.e, stream));
    const bool scored = cuda::rkv_select(views[0], qviews[0], cfg, slot_ptr, nullptr,
                                         layer_ws.get(), layer_ws.size(), stream);
    KVSIFT_CUDA_CHECK(cudaEventRecord(mid.e, stream));
    cuda::compact_device_rows(views[0], slot_ptr, budget, len_ptr, stream);
    KVSIFT_CUDA_CHECK(cudaEventRecord(stop.e, stream));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(stop.e));
    float a = 0, b = 0;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&a, start.e, mid.e));
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&b, start.e, stop.e));
    KVSIFT_CHECK(scored, "gpu_bench_rkv: rkv_select scored nothing at S ", seq, " > budget ",
                 budget);
    if (r >= layer_warmup) {
      t_sel.push_back(a);
      t_layer.push_back(b);
    }
  }
  row.select_ms = bench::median(t_sel);
  row.layer_ms = bench::median(t_layer);
  std::vector<std::int32_t> kept(static_cast<std::size_t>(batch));
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(kept.data(), len_ptr, kept.size() * sizeof(std::int32_t),
                                    cudaMemcpyDeviceToHost, stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::string check;
  for (int b = 0; b < batch; ++b)
    if (kept[b] != budget) {
      check = "layer kept " + std::to_string(kept[b]) + " != budget (sequence " +
              std::to_string(b) + ")";
      break;
    }
  const std::vector<bf16_t> layer_kept = kept_rows_of_sequence0(k_of(0), seq, budget, stream);

  // --- per step: DeviceBackend::rkv_compress_step over L layers --------------------------------
  const DeviceBackend& backend = device_backend();
  reset_lengths();
  const std::size_t step_ws_b =
      backend.rkv_step_workspace_bytes(views.data(), qviews.data(), L, cfg);
  DeviceMemory step_ws;
  if (!step_ws.allocate(step_ws_b)) {
    row.status = "skipped: memory (step workspace of " + std::to_string(step_ws_b >> 20) + " MiB)";
    return;
  }
  ExecContext ctx;
  ctx.workspace = step_ws.get();
  ctx.workspace_bytes = step_ws.size();
  ctx.stream = stream;
  bench::EventPair step_ev;
  std::vector<float> t_step;
  row.step_reps = step_reps_for(o, layer_bytes * L);
  for (int r = 0; r < 1 + row.step_reps; ++r) {
    restore(L);
    const float ms = step_ev.time_ms(
        [&] { backend.rkv_compress_step(views.data(), qviews.data(), L, cfg, ctx); }, stream);
    if (r >= 1) t_step.push_back(ms);
  }
  row.step_ms = bench::median(t_step);
  for (int l = 0; l < L && check.empty(); ++l)
    for (int b = 0; b < batch; ++b)
      if (lengths[l][b] != budget) {
        check = "step: layer " + std::to_string(l) + " kept " + std::to_string(lengths[l][b]);
        break;
      }
  if (check.empty()) {
    const std::vector<bf16_t> step_kept = kept_rows_of_sequence0(k_of(0), seq, budget, stream);
    for (std::size_t e = 0; e < step_kept.size(); ++e)
      if (step_kept[e].bits != layer_kept[e].bits) {
        check = "layer 0 kept keys differ between layer and step paths (element " +
                std::to_string(e) + ")";
        break;
      }
  }
  row.check = check.empty() ? "ok" : check;
}

// ---------------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------------
std::string fmt(const char* f, double x) {
  if (std::isnan(x)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string table_row(const Row& r, int layers) {
  const std::string head = std::string("| ") + keys_name(r.keys) + " | " +
                           (r.tensor_core ? "tc" : "fp32") + " | " + std::to_string(r.batch) +
                           " | " + std::to_string(r.budget) + " | " + std::to_string(r.seq) + " |";
  if (!r.status.empty()) {  // the status in the first measured column, the other 12 empty
    std::string empty;
    for (int c = 0; c < 12; ++c) empty += " |";
    std::string status = r.status;  // a '|' would split the cell
    std::replace(status.begin(), status.end(), '|', '/');
    return head + " " + status + " |" + empty;
  }
  const double per_layer = r.step_ms / layers;
  return head + " " + fmt("%.3f", r.select_ms) + " | " + fmt("%.3f", r.layer_ms) + " | " +
         fmt("%.3f", r.step_ms) + " | " + fmt("%.3f", per_layer) + " | " + fmt("%.4f", r.floor_ms) +
         " | " + fmt("%.2fx", r.layer_ms / r.floor_ms) + " | " +
         fmt("%.2fx", per_layer / r.floor_ms) + " | " + fmt("%.1f", r.flop * 1e-9) + " | " +
         fmt("%.4f", r.compute_ms) + " | " + fmt("%.2fx", r.layer_ms / r.compute_ms) + " | " +
         fmt("%.2fx", per_layer / r.compute_ms) + " | " + std::to_string(r.layer_reps) + "/" +
         std::to_string(r.step_reps) + " | " + r.check + " |";
}

std::string table_head(int layers) {
  const std::string L = std::to_string(layers);
  return "| keys | search | batch | budget | S | select ms/layer | layer ms | " + L +
         "-layer step ms | step ms/layer | HBM floor ms/layer | layer ÷ HBM floor | step ÷ HBM "
         "floor | search GFLOP/layer (worst case) | compute floor ms/layer | layer ÷ compute "
         "floor | step ÷ compute floor | reps layer/step | check |\n" +
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";
}

// The targets against the rows measured.
std::vector<std::string> target_lines(const std::vector<Row>& rows, int layers) {
  std::vector<std::string> out;
  char buf[256];
  for (const Row& r : rows) {
    if (!r.status.empty()) continue;
    const double per_layer = r.step_ms / layers;
    if (r.batch == 64 && r.budget == 1024) {
      const double limit = r.keys == Keys::structured ? 2.0 : 3.0;
      std::snprintf(buf, sizeof buf,
                    "- batch 64 / budget 1024, %s keys (%s): step %.2fx, layer %.2fx the HBM floor "
                    "(target <= %.0fx): %s",
                    keys_name(r.keys), r.tensor_core ? "tc" : "fp32", per_layer / r.floor_ms,
                    r.layer_ms / r.floor_ms, limit,
                    per_layer / r.floor_ms <= limit ? "PASS" : "FAIL");
      out.push_back(buf);
    }
    if (r.batch == 1 && layers == 32) {
      std::snprintf(buf, sizeof buf,
                    "- batch 1 / budget %d, %s keys (%s): 32-layer step %.3f ms (target < 0.3 ms): "
                    "%s",
                    r.budget, keys_name(r.keys), r.tensor_core ? "tc" : "fp32", r.step_ms,
                    r.step_ms < 0.3 ? "PASS" : "FAIL");
      out.push_back(buf);
    }
  }
  out.push_back("- >= 40x bench/torch_rkv.py at batch 64 / budget 1024: see torch_rkv.py's table");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------
std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

int parse_int(const std::string& s, const char* what) {
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 10);
  KVSIFT_CHECK(!s.empty() && end != nullptr && *end == '\0' && v >= 1 && v <= (1 << 20),
               "gpu_bench_rkv: ", what, " must be a positive integer, got '", s, "'");
  return static_cast<int>(v);
}

float parse_float(const std::string& s, const char* what) {
  char* end = nullptr;
  const float v = std::strtof(s.c_str(), &end);
  KVSIFT_CHECK(!s.empty() && end != nullptr && *end == '\0' && std::isfinite(v) && v >= 0.0f,
               "gpu_bench_rkv: ", what, " must be a non-negative number, got '", s, "'");
  return v;
}

std::vector<int> parse_ints(const std::string& s, const char* what) {
  std::vector<int> out;
  for (const std::string& x : split(s)) out.push_back(parse_int(x, what));
  KVSIFT_CHECK(!out.empty(), "gpu_bench_rkv: ", what, " list is empty");
  return out;
}

const char* kUsage =
    "usage: gpu_bench_rkv [--batches 1,8,32,64,128] [--budgets 1024,2048,4096]\n"
    "                     [--keys random,structured] [--search tc|fp32|both] [--layers 32]\n"
    "                     [--buffer 128] [--reps N] [--seed N] [--out FILE] [--smoke]\n"
    "                     [--mag-range 0.5,3] [--dup-fraction 0.2]  (structured keys)\n";

Options parse_options(int argc, char** argv) {
  Options o;
  bool batches_given = false;
  std::vector<int> bare;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      KVSIFT_CHECK(i + 1 < argc, "gpu_bench_rkv: ", a, " needs a value");
      return argv[++i];
    };
    if (a == "--batches") {
      o.batches = parse_ints(value(), "--batches");
      batches_given = true;
    } else if (a == "--budgets") {
      o.budgets = parse_ints(value(), "--budgets");
    } else if (a == "--keys") {
      o.keys.clear();
      for (const std::string& k : split(value())) {
        KVSIFT_CHECK(k == "random" || k == "structured",
                     "gpu_bench_rkv: --keys takes random and/or structured, got '", k, "'");
        o.keys.push_back(k == "random" ? Keys::random : Keys::structured);
      }
      KVSIFT_CHECK(!o.keys.empty(), "gpu_bench_rkv: --keys list is empty");
    } else if (a == "--search") {
      const std::string s = value();
      KVSIFT_CHECK(s == "tc" || s == "fp32" || s == "both",
                   "gpu_bench_rkv: --search takes tc, fp32 or both, got '", s, "'");
      o.tensor_core = s == "tc"     ? std::vector<bool>{true}
                      : s == "fp32" ? std::vector<bool>{false}
                                    : std::vector<bool>{true, false};
    } else if (a == "--mag-range") {
      const std::vector<std::string> r = split(value());
      KVSIFT_CHECK(r.size() == 2, "gpu_bench_rkv: --mag-range takes MIN,MAX");
      o.structured.mag_min = parse_float(r[0], "--mag-range MIN");
      o.structured.mag_max = parse_float(r[1], "--mag-range MAX");
      KVSIFT_CHECK(o.structured.mag_min <= o.structured.mag_max, "gpu_bench_rkv: --mag-range MIN (",
                   o.structured.mag_min, ") exceeds MAX (", o.structured.mag_max, ")");
    } else if (a == "--dup-fraction") {
      o.structured.dup_fraction = parse_float(value(), "--dup-fraction");
      KVSIFT_CHECK(o.structured.dup_fraction < 1.0f,
                   "gpu_bench_rkv: --dup-fraction must be below 1, got ",
                   o.structured.dup_fraction);
    } else if (a == "--layers") {
      o.layers = parse_int(value(), "--layers");
      KVSIFT_CHECK(o.layers <= 128, "gpu_bench_rkv: --layers must be <= 128, got ", o.layers);
    } else if (a == "--buffer") {
      o.buffer = parse_int(value(), "--buffer");
    } else if (a == "--reps") {
      o.reps = parse_int(value(), "--reps");
    } else if (a == "--seed") {
      o.seed = static_cast<std::uint64_t>(parse_int(value(), "--seed"));
    } else if (a == "--out") {
      o.out = value();
    } else if (a == "--smoke") {
      o.smoke = true;
    } else if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else {
      bare.push_back(parse_int(a, "a bare argument (batch)"));
    }
  }
  if (!bare.empty() && !batches_given) o.batches = bare;
  if (o.smoke) {  // one tiny configuration per key kind, in seconds
    o.batches = {2};
    o.budgets = {256};
    o.layers = std::min(o.layers, 4);
  }
  KVSIFT_CHECK(o.buffer >= o.window, "gpu_bench_rkv: --buffer (", o.buffer,
               ") must be >= the window (", o.window, "), docs/algorithms.md §1.3");
  for (int b : o.budgets)
    KVSIFT_CHECK(b > o.window, "gpu_bench_rkv: budget ", b, " must exceed the window ", o.window);
  for (int b : o.batches)
    KVSIFT_CHECK(static_cast<long>(b) * o.layers <= 65535, "gpu_bench_rkv: batch ", b, " x ",
                 o.layers, " layers exceeds 65535 sequences per step launch");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse_options(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n%s", e.what(), kUsage);
    return 2;
  }
  if (!bench::cuda_device_present()) return 0;
  std::vector<Row> rows;
  std::vector<std::string> header;
  int errors = 0;
  try {
    cudaDeviceProp prop{};
    KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream = nullptr;
    KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));
    const int warm = o.smoke ? 1 : 3, reps = o.smoke ? 3 : 10;
    const double bw = bench::d2d_copy_bandwidth(std::size_t(1) << 30, stream, warm, reps);
    const double peak = bench::mma_sync_peak_flops(stream, warm, reps);
    const float threshold = RKVConfig{}.threshold;
    const KeyStats rs = key_stats(o, Keys::random, 1152, threshold, stream);
    const KeyStats ss = key_stats(o, Keys::structured, 1152, threshold, stream);
    char buf[1024];
    std::snprintf(buf, sizeof buf,
                  "### R-KV compression per layer and per %d-layer step — `gpu_bench_rkv` on %s "
                  "(%d SMs)",
                  o.layers, prop.name, prop.multiProcessorCount);
    header.push_back(buf);
    std::snprintf(buf, sizeof buf,
                  "- Hq %d / Hkv %d, head_dim %d, bf16, window %d, S = budget + %d; search: "
                  "tc = RKVConfig::tensor_core_search (the default), fp32 = the fp32 tile search",
                  kQHeads, kKVHeads, kHeadDim, o.window, o.buffer);
    header.push_back(buf);
    std::snprintf(buf, sizeof buf,
                  "- keys: random = i.i.d. N(0,1); structured = per (sequence, KV head) a·g + "
                  "N(0,1) per element, g ~ N(0, I) shared, a ~ U[%.2g, %.2g], %.0f %% planted "
                  "near-duplicates (an earlier row + %.2g·N(0,1), cosine > 0.99); no RoPE; seed "
                  "%llu",
                  o.structured.mag_min, o.structured.mag_max, 100.0 * o.structured.dup_fraction,
                  o.structured.dup_noise, static_cast<unsigned long long>(o.seed));
    header.push_back(buf);
    std::snprintf(buf, sizeof buf,
                  "- key check (1 sequence x %d heads, S 1152, measured on this device's "
                  "output): random: %.1f %% rows with a near-duplicate (cos > 0.99), %.1f %% "
                  "with a match > %.2g, neighbour cosine %.3f; structured: %.1f %%, %.1f %%, "
                  "%.3f",
                  kKVHeads, 100 * rs.near_dup, 100 * rs.any_match, threshold, rs.mean_cos,
                  100 * ss.near_dup, 100 * ss.any_match, ss.mean_cos);
    header.push_back(buf);
    std::snprintf(buf, sizeof buf,
                  "- layer = cuda::rkv_select + cuda::compact_device_rows on one layer (\"select\" "
                  "alone in its own column); step = DeviceBackend::rkv_compress_step over %d "
                  "layers (selection in chunks of layers, one compaction, one wait for the kept "
                  "lengths); device time between CUDA events, median of the reps after warm-up; "
                  "keys regenerated and L2 flushed (256 MiB read) between reps, not timed",
                  o.layers);
    header.push_back(buf);
    std::snprintf(buf, sizeof buf,
                  "- measured in this run: device-to-device copy bandwidth %.0f GB/s (1 GiB "
                  "cudaMemcpyAsync, read + write bytes); bf16 mma.sync m16n8k16 peak %.0f "
                  "TFLOP/s (register operands, fp32 accumulate: the search's instruction; "
                  "wgmma/cuBLAS peak is higher, see torch_rkv.py)",
                  bw * 1e-9, peak * 1e-12);
    header.push_back(buf);
    header.push_back(
        "- HBM floor per layer = 2 B × (B·Hkv·S·D keys read + B·Hq·W·D queries read + "
        "B·Hkv·budget·D kept values read + 2·B·Hkv·budget·D kept keys and values written) / copy "
        "bandwidth; step floor = layers × that; \"step ÷ floor\" uses step ms / layers");
    header.push_back(
        "- compute floor per layer = B·Hkv · S(S−1)/2 · D · 2 FLOP (the symmetric near-duplicate "
        "search without early exit: random keys' case) / mma.sync peak; structured keys exit "
        "early, so their ratio can fall below 1");
    for (const std::string& h : header) std::printf("%s\n", h.c_str());
    std::printf("\n%s\n", table_head(o.layers).c_str());
    std::fflush(stdout);

    for (Keys keys : o.keys)
      for (bool tc : o.tensor_core)
        for (int budget : o.budgets)
          for (int batch : o.batches) {
            Row row;
            row.keys = keys;
            row.tensor_core = tc;
            row.batch = batch;
            row.budget = budget;
            row.seq = budget + o.buffer;
            try {
              run_config(o, row, bw, peak, stream);
            } catch (const std::exception& e) {
              row.status = std::string("error: ") + e.what();
              ++errors;
              // A sticky error (an illegal address) poisons the context: stop rather than
              // report a table of follow-on failures.
              const cudaError_t sticky = cudaDeviceSynchronize();
              if (sticky != cudaSuccess) {
                rows.push_back(row);
                std::printf("%s\n", table_row(row, o.layers).c_str());
                std::printf("CUDA context lost (%s): stopping\n", cudaGetErrorString(sticky));
                throw;
              }
            }
            rows.push_back(row);
            std::printf("%s\n", table_row(row, o.layers).c_str());
            std::fflush(stdout);
          }
    KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_bench_rkv: %s\n", e.what());
    ++errors;
  }

  const std::vector<std::string> targets = target_lines(rows, o.layers);
  std::printf("\n");
  for (const std::string& t : targets) std::printf("%s\n", t.c_str());
  if (!o.out.empty()) {
    FILE* f = std::fopen(o.out.c_str(), "a");
    if (f == nullptr) {
      std::fprintf(stderr, "gpu_bench_rkv: cannot open %s for appending\n", o.out.c_str());
      return 1;
    }
    for (const std::string& h : header) std::fprintf(f, "%s\n", h.c_str());
    std::fprintf(f, "\n%s\n", table_head(o.layers).c_str());
    for (const Row& r : rows) std::fprintf(f, "%s\n", table_row(r, o.layers).c_str());
    std::fprintf(f, "\n");
    for (const std::string& t : targets) std::fprintf(f, "%s\n", t.c_str());
    std::fprintf(f, "\n");
    std::fclose(f);
  }
  return errors == 0 ? 0 : 1;
}
