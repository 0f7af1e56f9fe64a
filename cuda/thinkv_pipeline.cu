// The ThinKV pipeline on the device (include/kvsift/backend/cuda/thinkv_pipeline.hpp): host
// metadata (schedules, metadata-only tables), device data (DevicePagedTable per layer), and the
// device reads that the decisions need (paged_reads.hpp, kmeans_select.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <memory>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/kmeans_select.hpp"
#include "kvsift/backend/cuda/paged_reads.hpp"
#include "kvsift/backend/cuda/thinkv_pipeline.hpp"
#include "kvsift/backend/cuda/workspace.hpp"

namespace kvsift::cuda {
namespace {

// Tokens (all sequences together) written per append launch: bounds the scratch a long prompt
// needs (its rows are transposed into [token, kv_heads, head_dim] order chunk by chunk).
constexpr std::int64_t kChunkTokens = 2048;
// Demoted (sequence, layer, KV head) segments selected per k-means launch.
constexpr std::int64_t kProblemsPerChunk = 256;

std::int64_t per_sequence_chunk(std::int32_t batch) {
  return std::max<std::int64_t>(1, kChunkTokens / batch);
}

ThoughtBlockTableConfig layer_table_config(const ThinKVConfig& config, int layer,
                                           std::int32_t batch) {
  ThoughtBlockTableConfig c = config.table_config(layer);
  c.num_blocks = config.pool_blocks * batch;  // the CPU pipeline's per-sequence pool, shared
  c.holds_data = false;
  return c;
}

void check_config(const ThinKVConfig& config, std::int32_t batch) {
  const char* fn = "cuda::DeviceThinKV";
  config.validate();
  KVSIFT_CHECK(batch >= 1 && batch <= 65535, fn, ": batch (", batch, ") outside [1, 65535]");
  KVSIFT_CHECK(config.refresh <= kKMeansMaxPoints, fn, ": refresh (", config.refresh,
               ") must be <= ", kKMeansMaxPoints, " (a segment is one k-means problem)");
  KVSIFT_CHECK(config.head_dim <= kKMeansMaxDim, fn, ": head_dim (", config.head_dim,
               ") must be <= ", kKMeansMaxDim);
  for (int k : config.schedule) {
    KVSIFT_CHECK(k <= kKMeansMaxClusters, fn, ": schedule entry ", k, " exceeds ",
                 kKMeansMaxClusters, " survivors (the device k-means' limit)");
  }
  KVSIFT_CHECK(!config.evict_prompt, fn,
               ": evict_prompt = true is not supported on the device (the prompt segment can "
               "exceed one k-means problem of ",
               kKMeansMaxPoints, " tokens)");
  KVSIFT_CHECK(config.staging == kPagedStagingDType, fn, ": staging must be ",
               dtype_name(kPagedStagingDType), " on the device, got ", dtype_name(config.staging));
  KVSIFT_CHECK(static_cast<std::int64_t>(config.pool_blocks) * batch <= 0x7fffffff, fn,
               ": pool_blocks * batch overflows");
}

// Where everything lives in the caller's buffer.
struct Layout {
  PagedTableSizes sizes;
  std::size_t layer_bytes = 0;     // one layer's table memory
  std::size_t page_bytes = 0;      // one layer's uploaded page tables (paged_batch_bytes at most)
  std::size_t sparsity_bytes = 0;  // [L*, batch, q_heads] f32
  std::size_t means_bytes = 0;     // [L*, batch] f32: the step's per-layer means
  std::int64_t logit_slots = 0;    // slots per head the sparsity's logits scratch holds
  std::size_t logits_bytes = 0;    // [batch, q_heads, logit_slots] f32
  std::size_t scratch_bytes = 0;
  std::size_t total = 0;
};

std::size_t table_memory_bytes(const PagedTableSizes& s, std::int32_t kv_heads) {
  return align_up(static_cast<std::size_t>(s.storage_bytes)) +
         align_up(static_cast<std::size_t>(s.mask_bytes)) +
         align_up(static_cast<std::size_t>(s.position_bytes)) +
         align_up(static_cast<std::size_t>(s.frame_offset_bytes)) +
         2 * align_up(static_cast<std::size_t>(s.staging_bytes)) +
         align_up(static_cast<std::size_t>(s.staged_mask_bytes)) +
         align_up(static_cast<std::size_t>(kv_heads) * 4);
}

PagedTableMemory carve_table(WorkspaceCarver& c, const PagedTableSizes& s, std::int32_t kv_heads) {
  PagedTableMemory m;
  m.storage = c.take<std::uint8_t>(static_cast<std::size_t>(s.storage_bytes));
  m.free_masks = c.take<std::uint64_t>(static_cast<std::size_t>(s.mask_bytes / 8));
  m.positions = c.take<std::uint8_t>(static_cast<std::size_t>(s.position_bytes));
  m.frame_offsets = c.take<std::int64_t>(static_cast<std::size_t>(s.frame_offset_bytes / 8));
  const std::size_t staged = static_cast<std::size_t>(s.staging_bytes) / sizeof(PagedStaging);
  m.staged_keys = c.take<PagedStaging>(staged);
  m.staged_values = c.take<PagedStaging>(staged);
  m.staged_masks = c.take<std::uint32_t>(static_cast<std::size_t>(s.staged_mask_bytes / 4));
  m.global_factors = c.take<float>(static_cast<std::size_t>(kv_heads));
  return m;
}

Layout layout_of(const ThinKVConfig& config, std::int32_t batch) {
  check_config(config, batch);
  Layout L;
  const ThoughtBlockTableConfig tc = layer_table_config(config, 0, batch);
  L.sizes = paged_table_sizes(tc, batch);
  L.layer_bytes = table_memory_bytes(L.sizes, config.kv_heads);
  const std::size_t H = static_cast<std::size_t>(config.kv_heads);
  const std::size_t D = static_cast<std::size_t>(config.head_dim);
  const std::size_t B = static_cast<std::size_t>(batch);
  L.sparsity_bytes = align_up(config.calibrated_layers.size() * B *
                              static_cast<std::size_t>(config.q_heads) * sizeof(float));
  L.means_bytes = align_up(config.calibrated_layers.size() * B * sizeof(float));
  // The sparsity computes each logit once for sequences whose blocks span up to twice
  // budget + refresh tokens (holes left by evictions included); longer ones compute twice.
  const std::int64_t span = 2 * (static_cast<std::int64_t>(config.budget) + config.refresh);
  L.logit_slots =
      paged_sparsity_slots((span + config.block_size - 1) / config.block_size, config.block_size);
  L.logits_bytes = align_up(B * static_cast<std::size_t>(config.q_heads) *
                            static_cast<std::size_t>(L.logit_slots) * sizeof(float));
  // Append: the recorded plan (append_workspace_bytes' terms, each bounded per token and head)
  // and the prompt rows transposed into token order.
  const std::size_t T = static_cast<std::size_t>(per_sequence_chunk(batch)) * B;
  const std::size_t append = align_up(T * sizeof(detail::PagedFreshFrame)) +
                             align_up(T * H * sizeof(detail::PagedRowWrite)) +
                             align_up(T * H * sizeof(detail::PagedStreamTask)) +
                             align_up(T * H * sizeof(detail::PagedStreamOp)) +
                             align_up(T * H * sizeof(detail::PagedSeal)) +
                             2 * align_up(T * H * D * sizeof(float));
  // Demotions: sources, fp32 keys, k-means descriptors and survivors of one chunk of problems.
  const std::size_t P = static_cast<std::size_t>(kProblemsPerChunk);
  const std::size_t kmeans =
      paged_gather_keys_workspace_bytes(static_cast<std::int64_t>(P) * kKMeansMaxPoints) +
      align_up(P * kKMeansMaxPoints * D * sizeof(float)) +
      align_up(kmeans_select_workspace_bytes(static_cast<std::int64_t>(P))) +
      align_up(P * kKMeansMaxClusters * sizeof(std::int32_t)) +
      align_up(H * kKMeansMaxPoints * 16);  // evictions of one (layer, head)
  L.scratch_bytes = std::max(append, kmeans);
  // paged_batch_bytes with every block of the layer's pools in use.
  const std::size_t blocks = static_cast<std::size_t>(tc.num_blocks);
  L.page_bytes = 2 * align_up(blocks * 4) + align_up((B + 1) * 4) + align_up(B * 4);
  L.total = static_cast<std::size_t>(config.num_layers) * (L.layer_bytes + L.page_bytes) +
            L.sparsity_bytes + L.means_bytes + L.logits_bytes + L.scratch_bytes;
  return L;
}

template <class T>
__global__ void prompt_rows_kernel(const T* __restrict__ src,  // [batch, H, n, D]
                                   T* __restrict__ dst,        // [batch, chunk, H, D]
                                   std::int64_t n, std::int64_t first, std::int64_t chunk,
                                   std::int64_t H, std::int64_t D, std::int64_t total) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t d = e % D, h = (e / D) % H, i = (e / (D * H)) % chunk,
                       b = e / (D * H * chunk);
    dst[e] = src[((b * H + h) * n + first + i) * D + d];
  }
}

void prompt_rows(const void* src, void* dst, DType dtype, std::int64_t batch, std::int64_t n,
                 std::int64_t first, std::int64_t chunk, std::int64_t H, std::int64_t D,
                 cudaStream_t stream) {
  const std::int64_t total = batch * chunk * H * D;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((total + 255) / 256, 4096));
  if (dtype == DType::f32) {
    prompt_rows_kernel<<<blocks, 256, 0, stream>>>(
        static_cast<const float*>(src), static_cast<float*>(dst), n, first, chunk, H, D, total);
  } else {
    prompt_rows_kernel<<<blocks, 256, 0, stream>>>(
        static_cast<const bf16_t*>(src), static_cast<bf16_t*>(dst), n, first, chunk, H, D, total);
  }
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

// Per (L* layer i, sequence b) of this step: the mean of its q_heads sparsities, summed in double
// in head order and divided as the host does (ThinKV::observe_query), so the value is the host's
// bit for bit. sparsity [n = L* · batch, q_heads] -> means [n].
__global__ void step_means_kernel(const float* __restrict__ sparsity, int n, int q_heads,
                                  float* __restrict__ means) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n) return;
  double total = 0.0;
  for (int q = 0; q < q_heads; ++q) total += sparsity[static_cast<std::int64_t>(r) * q_heads + q];
  means[r] = static_cast<float>(total / q_heads);
}

void check_kv(const void* keys, const void* values, DType dtype, const char* fn) {
  KVSIFT_CHECK(keys != nullptr && values != nullptr, fn, ": keys and values must not be null");
  KVSIFT_CHECK(dtype == DType::f32 || dtype == DType::bf16, fn,
               ": keys/values must be f32 or bf16, got ", dtype_name(dtype));
}

}  // namespace

struct DeviceThinKV::Problem {
  std::int32_t seq = 0, layer = 0, head = 0, segment = 0;
  std::int32_t target = 0;  // tokens kept (TBE's kept_after)
  std::int32_t n = 0;       // the segment's resident tokens, (block, slot) order then staged,
  std::int64_t first = 0;   // at [first, first + n) of the layer's addresses and sources
};

struct DeviceThinKV::LayerDemotions {
  struct DestroyEvent {
    void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
  };
  std::vector<Problem> problems;  // the step's, in layer_problems' order
  // Every problem's tokens, problem after problem: their addresses before the step's evictions
  // and where their keys are (one allocation per layer and step, not three per problem).
  std::vector<SlotAddress> addresses;
  std::vector<PagedKeySource> sources;
  std::int32_t stride = 1;        // survivors per problem in `chosen`
  // Pinned [problems, stride] int32: the k-means survivors, copied from the device (a download
  // buffer: only fill() is used, to grow it).
  PinnedUpload chosen;
  std::unique_ptr<CUevent_st, DestroyEvent> selected;  // recorded after the survivors' copy
  std::vector<EvictionSlot> slots;                     // addresses of before the step
  DevicePagedTable::DeviceEvictions device;            // what the device table still has to set
};

std::size_t DeviceThinKV::memory_bytes(const ThinKVConfig& config, std::int32_t batch) {
  return layout_of(config, batch).total;
}

DeviceThinKV::DeviceThinKV(const ThinKVConfig& config, std::int32_t batch, void* memory,
                           std::size_t memory_bytes, cudaStream_t stream)
    : config_(config), batch_(batch), stream_(stream) {
  const Layout L = layout_of(config_, batch_);
  KVSIFT_CHECK(memory != nullptr && memory_bytes >= L.total, "cuda::DeviceThinKV: memory of ",
               memory_bytes, " bytes at ", memory, " is too small (", L.total,
               " needed: memory_bytes())");
  WorkspaceCarver carver(memory, memory_bytes, "cuda::DeviceThinKV");
  schedules_.reserve(static_cast<std::size_t>(batch_));
  for (std::int32_t b = 0; b < batch_; ++b) schedules_.emplace_back(config_);
  tables_.reserve(static_cast<std::size_t>(config_.num_layers));
  devices_.reserve(static_cast<std::size_t>(config_.num_layers));
  for (int l = 0; l < config_.num_layers; ++l) {
    const ThoughtBlockTableConfig tc = layer_table_config(config_, l, batch_);
    tables_.emplace_back(tc);
    for (std::int32_t b = 0; b < batch_; ++b) {
      tables_.back().create_sequence();  // id b
      // The prompt is segment 0, stored at R precision (as ThinKV).
      tables_.back().open_segment(b, ThoughtType::reasoning);
    }
    devices_.emplace_back(tc, batch_, carve_table(carver, L.sizes, config_.kv_heads));
    devices_.back().initialize(stream_);
  }
  sparsity_ = carver.take<float>(L.sparsity_bytes / sizeof(float));
  means_ = carver.take<float>(L.means_bytes / sizeof(float));
  logits_ = carver.take<float>(L.logits_bytes / sizeof(float));
  logit_slots_ = L.logit_slots;
  // The ring of the interval's per-step means: pinned, so their copies stay asynchronous.
  means_per_step_ = static_cast<std::int64_t>(config_.calibrated_layers.size()) * batch_;
  float* ring = nullptr;
  KVSIFT_CUDA_CHECK(cudaMallocHost(
      &ring, std::max<std::size_t>(1, static_cast<std::size_t>(config_.refresh) *
                                          static_cast<std::size_t>(means_per_step_)) *
                 sizeof(float)));
  host_means_.reset(ring);
  scratch_ = carver.take<std::uint8_t>(L.scratch_bytes);
  scratch_bytes_ = L.scratch_bytes;
  page_bytes_ = L.page_bytes;
  demotions_.resize(static_cast<std::size_t>(config_.num_layers));
  for (LayerDemotions& d : demotions_) {
    cudaEvent_t e = nullptr;
    KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    d.selected.reset(e);
  }
  pages_.resize(static_cast<std::size_t>(config_.num_layers));
  placed_.assign(static_cast<std::size_t>(config_.num_layers), 0);
  placing_.resize(static_cast<std::size_t>(config_.num_layers));
  for (PageTables& p : pages_) p.memory = carver.take<std::uint8_t>(page_bytes_);
}

void DeviceThinKV::check_layer(int layer, const char* fn) const {
  KVSIFT_CHECK(layer >= 0 && layer < config_.num_layers, "cuda::DeviceThinKV::", fn, ": layer ",
               layer, " outside [0, num_layers = ", config_.num_layers, ")");
}

// Places `tokens_per_sequence` tokens of every sequence (sequence-major) in the host table and
// records them on the device table. A new block per token is the most any token takes, so a pool
// with fewer free blocks than that is refused before anything changes.
void DeviceThinKV::check_pool(int layer, std::int64_t tokens_per_sequence, const char* fn) const {
  const ThoughtBlockTable& t = tables_[static_cast<std::size_t>(layer)];
  // A sequence takes a new block only when a 16-token group seals (or an f32 token arrives)
  // with no free room of its type, and a block holds at least one group.
  const std::int64_t need =
      batch_ *
      std::min<std::int64_t>(tokens_per_sequence, tokens_per_sequence / kQuantGroupSize + 1);
  KVSIFT_CHECK(t.free_blocks() >= need, "cuda::DeviceThinKV::", fn, ": layer ", layer, " has ",
               t.free_blocks(), " free blocks; writing ", tokens_per_sequence,
               " tokens of each of ", batch_, " sequences may take up to ", need,
               " (raise pool_blocks)");
}

void DeviceThinKV::record_tokens(int layer, std::int64_t tokens_per_sequence, const char* fn) {
  ThoughtBlockTable& t = tables_[static_cast<std::size_t>(layer)];
  DevicePagedTable& dev = devices_[static_cast<std::size_t>(layer)];
  check_pool(layer, tokens_per_sequence, fn);
  std::vector<SlotAddress> where(static_cast<std::size_t>(config_.kv_heads));
  for (std::int32_t b = 0; b < batch_; ++b) {
    for (std::int64_t i = 0; i < tokens_per_sequence; ++i) {
      t.append(b, nullptr, nullptr, config_.kv_heads, config_.head_dim, where.data());
      dev.record_append(t, b, where.data());
    }
  }
}

void DeviceThinKV::prefill(int layer, const void* keys, const void* values, DType dtype,
                           std::int64_t n) {
  const char* fn = "prefill";
  check_layer(layer, fn);
  KVSIFT_CHECK(!schedules_[0].started(), "cuda::DeviceThinKV::prefill: layer ", layer,
               ": decoding has started (", steps(), " steps); the prompt must come first");
  KVSIFT_CHECK(n >= 0, "cuda::DeviceThinKV::prefill: n must be >= 0, got ", n);
  if (n == 0) return;
  check_kv(keys, values, dtype, "cuda::DeviceThinKV::prefill");
  const std::int64_t H = config_.kv_heads, D = config_.head_dim;
  const std::int64_t chunk = per_sequence_chunk(batch_);
  // The prompt rows of a chunk in token order, at the end of the scratch; the append plan in
  // front of them.
  const std::size_t rows_bytes =
      align_up(static_cast<std::size_t>(chunk * batch_ * H * D) * dtype_size(dtype));
  for (std::int64_t first = 0; first < n; first += chunk) {
    const std::int64_t c = std::min(chunk, n - first);
    record_tokens(layer, c, fn);
    std::uint8_t* k_rows = scratch_ + (scratch_bytes_ - 2 * rows_bytes);
    std::uint8_t* v_rows = k_rows + rows_bytes;
    prompt_rows(keys, k_rows, dtype, batch_, n, first, c, H, D, stream_);
    prompt_rows(values, v_rows, dtype, batch_, n, first, c, H, D, stream_);
    DevicePagedTable& dev = devices_[static_cast<std::size_t>(layer)];
    dev.append(k_rows, v_rows, dtype, scratch_, scratch_bytes_ - 2 * rows_bytes, stream_);
  }
}

// One layer of the step placed: its sequences' new segments opened, their tokens recorded, and the
// append plan and page tables packed for upload (append() and page_tables() then only copy).
// Touches that layer's table, mirror and page tables only, and reads the step's openings and
// labels.
void DeviceThinKV::place_layer(int layer, const char* fn) {
  ThoughtBlockTable& t = tables_[static_cast<std::size_t>(layer)];
  const std::size_t B = static_cast<std::size_t>(batch_);
  for (std::int32_t b = 0; b < batch_; ++b) {
    if (step_opens_[static_cast<std::size_t>(layer) * B + b]) t.open_segment(b, step_labels_[b]);
  }
  record_tokens(layer, 1, fn);
  devices_[static_cast<std::size_t>(layer)].prepare_append();
  pack_page_tables(layer);
}

int DeviceThinKV::placement_threads() const {
  if (placement_threads_ >= 0) return placement_threads_;
  // ~0.5 µs of host work per sequence and layer: background threads only where they pay.
  if (static_cast<std::int64_t>(batch_) * config_.num_layers < 4096) return 0;
  return static_cast<int>(std::min(4u, std::max(1u, std::thread::hardware_concurrency())));
}

void DeviceThinKV::place_step(const char* fn) {
  finish_placement();  // the last step's threads (their layers were all awaited)
  std::vector<int> layers;
  for (int l = 0; l < config_.num_layers; ++l) {
    if (!placed_[static_cast<std::size_t>(l)]) layers.push_back(l);
  }
  // Every layer's pool is checked before any table changes (record_tokens checks again).
  for (int l : layers) check_pool(l, 1, fn);
  // Which sequences open a segment in which layer, with which label: read from the schedules
  // and marked in them here, on the calling thread; the placers read only these copies.
  const std::size_t B = static_cast<std::size_t>(batch_);
  step_opens_.assign(static_cast<std::size_t>(config_.num_layers) * B, 0);
  step_labels_.resize(B);
  for (std::int32_t b = 0; b < batch_; ++b) step_labels_[b] = schedules_[b].label();
  for (int l : layers) {
    for (std::int32_t b = 0; b < batch_; ++b) {
      const bool opens = schedules_[b].opens_segment(l);
      step_opens_[static_cast<std::size_t>(l) * B + b] = opens;
      if (opens) schedules_[b].segment_opened(l);
    }
    placed_[static_cast<std::size_t>(l)] = 1;
  }
  const int threads = std::min(placement_threads(), static_cast<int>(layers.size()));
  if (threads == 0) {
    for (int l : layers) place_layer(l, fn);
    return;
  }
  // Placer w takes layers w, w + threads, ... in order, so the first layers are ready first; each
  // layer's future reports its end (or its error) to the call that needs the layer.
  auto promises = std::make_shared<std::vector<std::promise<void>>>(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i)
    placing_[static_cast<std::size_t>(layers[i])] = (*promises)[i].get_future();
  for (int w = 0; w < threads; ++w) {
    const auto placer = [this, layers, promises, w, threads, fn] {
      for (std::size_t i = static_cast<std::size_t>(w); i < layers.size();
           i += static_cast<std::size_t>(threads)) {
        try {
          place_layer(layers[i], fn);
          (*promises)[i].set_value();
        } catch (...) {
          (*promises)[i].set_exception(std::current_exception());
        }
      }
    };
    try {
      placers_.emplace_back(placer);
    } catch (const std::system_error&) {
      placer();  // no thread to be had: its layers are placed here, so no future is left unset
    }
  }
}

void DeviceThinKV::await_layer(int layer) const {
  std::future<void>& f = placing_[static_cast<std::size_t>(layer)];
  if (f.valid()) f.get();  // rethrows the placer's error, once
}

void DeviceThinKV::finish_placement() const {
  for (std::future<void>& f : placing_) {
    if (f.valid()) f.wait();
  }
  for (std::thread& t : placers_) t.join();
  placers_.clear();
}

DeviceThinKV::~DeviceThinKV() { finish_placement(); }

void DeviceThinKV::set_placement_threads(int threads) {
  KVSIFT_CHECK(threads >= 0 && threads <= 64,
               "cuda::DeviceThinKV::set_placement_threads: threads (", threads,
               ") outside [0, 64]");
  placement_threads_ = threads;
}

void DeviceThinKV::append(int layer, const void* keys, const void* values, DType dtype) {
  const char* fn = "append";
  check_layer(layer, fn);
  check_kv(keys, values, dtype, "cuda::DeviceThinKV::append");
  (void)schedules_[0].opens_segment(layer);  // throws if the layer already has its token
  if (!schedules_[0].started()) {
    // The prompt is complete: every layer must hold the same one.
    const std::int32_t prompt = tables_[0].length(0);
    for (int l = 1; l < config_.num_layers; ++l) {
      KVSIFT_CHECK(tables_[static_cast<std::size_t>(l)].length(0) == prompt,
                   "cuda::DeviceThinKV::append: layer ", l, " has a prompt of ",
                   tables_[static_cast<std::size_t>(l)].length(0), " tokens but layer 0 has ",
                   prompt, "; prefill every layer with the same prompt");
    }
    for (ThinKVSchedule& s : schedules_) s.start(prompt);
  }
  if (!placed_[static_cast<std::size_t>(layer)]) place_step(fn);
  await_layer(layer);
  devices_[static_cast<std::size_t>(layer)].append(keys, values, dtype, scratch_, scratch_bytes_,
                                                   stream_);
  for (ThinKVSchedule& s : schedules_) s.appended(layer);
}

bool DeviceThinKV::needs_sparsity(int layer) const {
  check_layer(layer, "needs_sparsity");
  return schedules_[0].classifier().uses_layer(layer);
}

bool DeviceThinKV::observe_query(int layer, const float* queries) {
  if (!needs_sparsity(layer)) return false;
  KVSIFT_CHECK(queries != nullptr, "cuda::DeviceThinKV::observe_query: queries must not be null");
  KVSIFT_CHECK(std::find(observed_.begin(), observed_.end(), layer) == observed_.end(),
               "cuda::DeviceThinKV::observe_query: layer ", layer, " is already observed in step ",
               steps());
  const DevicePagedTable& dev = devices_[static_cast<std::size_t>(layer)];
  const PagedBatch& pb = page_tables(layer);
  float* out = sparsity_ + observed_.size() * static_cast<std::size_t>(batch_) * config_.q_heads;
  paged_attention_sparsity(dev, pb, queries, config_.q_heads,
                           1.0f / std::sqrt(static_cast<float>(config_.head_dim)), out, stream_,
                           logits_, logit_slots_);
  observed_.push_back(layer);
  return true;
}

std::vector<EvictionStep> DeviceThinKV::end_step() {
  // 1. Validate before anything changes: every layer has its token, every L* layer is observed.
  schedules_[0].check_complete();  // all sequences append together
  finish_placement();              // every layer was appended, so its placement awaited
  for (int l : config_.calibrated_layers) {
    KVSIFT_CHECK(std::find(observed_.begin(), observed_.end(), l) != observed_.end(),
                 "cuda::DeviceThinKV::end_step: calibrated layer ", l, " was not observed in step ",
                 steps(), " (observe_query)");
  }
  // 2. This step's sparsity per (L* layer, sequence): the mean over query heads, in double, as
  // ThinKV::observe_query takes it, computed on the device and copied into this step's slot of
  // the pinned ring. Only the step that closes a refresh interval waits for the ring and reports
  // the interval to the classifiers (§3.1: the other steps' labels do not depend on it).
  const std::int64_t slot = static_cast<std::int64_t>(pending_layers_.size());
  if (!observed_.empty()) {
    const int n = static_cast<int>(observed_.size()) * batch_;
    step_means_kernel<<<(n + 127) / 128, 128, 0, stream_>>>(sparsity_, n, config_.q_heads, means_);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(host_means_.get() + slot * means_per_step_, means_,
                                      static_cast<std::size_t>(n) * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_));
  }
  pending_layers_.push_back(observed_);
  observed_.clear();
  std::vector<EvictionStep> steps(static_cast<std::size_t>(batch_));
  if (!schedules_[0].closes_interval()) {  // all sequences step together
    for (std::int32_t b = 0; b < batch_; ++b) steps[b] = schedules_[b].end_step_deferred();
  } else {
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::int64_t first = schedules_[0].steps() - slot;  // the step in ring slot 0
    for (std::size_t k = 0; k < pending_layers_.size(); ++k) {
      const std::vector<int>& layers = pending_layers_[k];
      const float* m = host_means_.get() + static_cast<std::int64_t>(k) * means_per_step_;
      for (std::size_t i = 0; i < layers.size(); ++i) {
        for (std::int32_t b = 0; b < batch_; ++b) {
          KVSIFT_CHECK(!std::isnan(m[i * batch_ + b]), "cuda::DeviceThinKV::end_step: step ",
                       first + static_cast<std::int64_t>(k), " layer ", layers[i], " sequence ", b,
                       ": a query head without a resident key, or a NaN or infinite logit "
                       "(non-finite queries?)");
        }
      }
    }
    // 3. Label the interval's steps and run TBE on this one.
    std::vector<float> obs;
    for (std::int32_t b = 0; b < batch_; ++b) {
      ThoughtClassifier& c = schedules_[b].classifier();
      for (std::size_t k = 0; k < pending_layers_.size(); ++k) {
        const std::vector<int>& layers = pending_layers_[k];
        const float* m = host_means_.get() + static_cast<std::int64_t>(k) * means_per_step_;
        obs.assign(layers.size(), 0.0f);
        for (std::size_t i = 0; i < layers.size(); ++i) obs[i] = m[i * batch_ + b];
        if (k + 1 < pending_layers_.size()) {
          c.settle_step(layers.data(), obs.data(), static_cast<int>(layers.size()));
        } else {
          for (std::size_t i = 0; i < layers.size(); ++i) c.observe_layer(layers[i], obs[i]);
        }
      }
      steps[b] = schedules_[b].end_step();
    }
    pending_layers_.clear();
  }
  placed_.assign(placed_.size(), 0);  // with the schedules' step: the next step places anew
  for (std::int32_t b = 0; b < batch_; ++b) {
    const std::size_t segments = schedules_[b].evictor().segments().size();
    KVSIFT_CHECK(static_cast<std::int32_t>(segments) == tables_[0].num_segments(b),
                 "cuda::DeviceThinKV::end_step: internal error: TBE has ", segments,
                 " segments but the block table has ", tables_[0].num_segments(b));
  }
  demote(steps);
  return steps;
}

// The demotion problems of one layer: per sequence with changes and KV head, one scan of the
// resident tokens in the positions its changed segments span serves all of them, each problem's
// tokens in (block, slot) order then staged (resident_tokens' order, as k-means reads them).
void DeviceThinKV::layer_problems(int layer, const std::vector<EvictionStep>& steps,
                                  LayerDemotions& d) const {
  const ThoughtBlockTable& t = tables_[static_cast<std::size_t>(layer)];
  const DevicePagedTable& dev = devices_[static_cast<std::size_t>(layer)];
  std::int64_t tokens = 0;  // TBE's count of the layer's demoted tokens: the lists' sizes
  for (const EvictionStep& step : steps) {
    for (const SegmentChange& c : step.changes) tokens += std::int64_t{c.kept_before};
  }
  d.problems.clear();
  d.addresses.resize(static_cast<std::size_t>(tokens * config_.kv_heads));
  d.sources.resize(d.addresses.size());
  std::int64_t next = 0;       // the next problem's first token
  std::vector<int> change_of;  // segment -> index of its change in the sequence's step, or -1
  std::vector<ResidentToken> scan;
  for (std::int32_t b = 0; b < batch_; ++b) {
    const std::vector<SegmentChange>& changes = steps[static_cast<std::size_t>(b)].changes;
    if (changes.empty()) continue;
    const std::int32_t segments = t.num_segments(b);
    change_of.assign(static_cast<std::size_t>(segments), -1);
    // The positions the changed segments span: blocks holding none of them are not read.
    std::int32_t lowest = std::numeric_limits<std::int32_t>::max(), highest = -1;
    for (std::size_t i = 0; i < changes.size(); ++i) {
      const std::int32_t seg = changes[i].segment;
      KVSIFT_CHECK(seg >= 0 && seg < segments && change_of[static_cast<std::size_t>(seg)] < 0,
                   "cuda::DeviceThinKV::end_step: internal error: segment ", seg,
                   " changed twice or unknown");
      change_of[static_cast<std::size_t>(seg)] = static_cast<int>(i);
      lowest = std::min(lowest, t.segment_start(b, seg));
      highest = std::max(highest, seg + 1 < segments ? t.segment_start(b, seg + 1) - 1
                                                     : std::numeric_limits<std::int32_t>::max());
    }
    for (int h = 0; h < config_.kv_heads; ++h) {
      const std::size_t first = d.problems.size();
      for (const SegmentChange& c : changes) {
        Problem p;
        p.seq = b;
        p.layer = layer;
        p.head = h;
        p.segment = c.segment;
        p.target = c.kept_after;
        p.first = next;
        next += c.kept_before;
        d.problems.push_back(p);
      }
      t.resident_tokens_between(b, h, lowest, highest, scan);
      for (const ResidentToken& r : scan) {
        if (r.segment < 0 || r.segment >= static_cast<std::int32_t>(change_of.size())) continue;
        const int i = change_of[static_cast<std::size_t>(r.segment)];
        if (i < 0) continue;
        Problem& p = d.problems[first + static_cast<std::size_t>(i)];
        KVSIFT_CHECK(p.n < changes[static_cast<std::size_t>(i)].kept_before,
                     "cuda::DeviceThinKV::end_step: internal error: segment ", p.segment,
                     " holds more than the ", changes[static_cast<std::size_t>(i)].kept_before,
                     " tokens TBE expected in layer ", layer, " head ", h);
        const std::size_t k = static_cast<std::size_t>(p.first + p.n++);
        d.addresses[k] = r.address;
        d.sources[k] = dev.key_source(b, h, r.address);
      }
      for (std::size_t i = 0; i < changes.size(); ++i) {
        const Problem& p = d.problems[first + i];
        KVSIFT_CHECK(p.n == changes[i].kept_before,
                     "cuda::DeviceThinKV::end_step: internal error: segment ", p.segment, " holds ",
                     p.n, " tokens in layer ", layer, " head ", h, ", TBE expected ",
                     changes[i].kept_before);
      }
    }
  }
}

namespace {

// Runs f(l) for every layer on `threads` workers, layer l on worker l % threads in layer order
// (on the calling thread, in order, when threads is 0 or no thread can be had). Returns the
// workers' futures: each get() rethrows its worker's first error, after which that worker
// stopped; the others run on (a future from std::async waits for its worker when destroyed).
template <class F>
std::vector<std::future<void>> for_layers(int layers, int threads, F f) {
  std::vector<std::future<void>> workers;
  for (int w = 0; w < threads; ++w) {
    const auto work = [f, w, threads, layers] {  // f by value: workers outlive this call
      for (int l = w; l < layers; l += threads) f(l);
    };
    try {
      workers.push_back(std::async(std::launch::async, work));
    } catch (const std::system_error&) {
      work();  // no thread to be had: its layers run here
    }
  }
  if (threads == 0) {
    for (int l = 0; l < layers; ++l) f(l);
  }
  return workers;
}

// Runs f(l) for every layer on `threads` workers (for_layers) and then(l) on this thread, in layer
// order, as soon as f(l) is done; rethrows the first error met in layer order (the workers are
// awaited first).
template <class F, class G>
void pipeline_layers(int layers, int threads, const F& f, const G& then) {
  std::vector<std::promise<void>> done(static_cast<std::size_t>(layers));
  std::vector<std::future<void>> ready;
  for (std::promise<void>& p : done) ready.push_back(p.get_future());
  std::vector<std::future<void>> workers = for_layers(layers, threads, [&](int l) {
    try {
      f(l);
      done[static_cast<std::size_t>(l)].set_value();
    } catch (...) {
      done[static_cast<std::size_t>(l)].set_exception(std::current_exception());
      throw;
    }
  });
  for (int l = 0; l < layers; ++l) {
    ready[static_cast<std::size_t>(l)].get();  // rethrows f(l)'s error
    then(l);
  }
  for (std::future<void>& w : workers) w.get();
}

}  // namespace

// The step's demotions, every (sequence, change, layer, KV head), in three passes over the
// layers, each on the placement threads at large batches (at batch 704 a step demotes ~180 K
// segments and evicts ~22 M slots in each table):
//  1. each layer's problems listed (a scan of every sequence's resident tokens per head); this
//     thread enqueues each layer's k-means as soon as it is listed, so the device selects while
//     the later layers are listed;
//  2. each layer's evictions derived from its survivors (after their copy); every layer is
//     checked (a non-finite key) before anything changes;
//  3. each layer's evictions applied to its host table and its device mirror's bookkeeping; this
//     thread enqueues each layer's device bits as soon as it is applied.
// Every address is of before the step: both tables set all the bits of a layer before they
// return any block to a pool.
void DeviceThinKV::demote(const std::vector<EvictionStep>& steps) {
  const int L = config_.num_layers;
  const int threads = std::min(placement_threads(), L);
  const auto demotions = [this](int l) -> LayerDemotions& {
    return demotions_[static_cast<std::size_t>(l)];
  };
  pipeline_layers(
      L, threads, [&](int l) { layer_problems(l, steps, demotions(l)); },
      [&](int l) { select_survivors(l); });
  for (std::future<void>& w : for_layers(L, threads, [&](int l) { layer_evictions(l); })) w.get();
  pipeline_layers(
      L, threads,
      [&](int l) {
        LayerDemotions& d = demotions(l);
        tables_[static_cast<std::size_t>(l)].evict_slots(d.slots);
        d.device = devices_[static_cast<std::size_t>(l)].apply_evictions(d.slots);
        d.slots = {};
      },
      [&](int l) {
        devices_[static_cast<std::size_t>(l)].enqueue_evictions(demotions(l).device, scratch_,
                                                                scratch_bytes_, stream_);
        demotions(l).device = {};
      });
}

// The layer's k-means problems on the device, kProblemsPerChunk per launch, each chunk's
// sources and descriptors copied from pinned memory (alternating buffers, so that enqueueing
// never waits for the stream) and its survivors copied into the layer's pinned `chosen`; the
// layer's event follows the last copy. Every chunk's keys are read before any eviction.
void DeviceThinKV::select_survivors(int layer) {
  LayerDemotions& d = demotions_[static_cast<std::size_t>(layer)];
  const std::vector<Problem>& problems = d.problems;
  if (problems.empty()) return;
  const std::int64_t D = config_.head_dim;
  KMeansSelectConfig kcfg;
  kcfg.max_iterations = config_.kmeans_iterations;
  d.stride = 1;
  for (const Problem& p : problems) {
    KVSIFT_CHECK(p.n <= kKMeansMaxPoints, "cuda::DeviceThinKV::end_step: segment ", p.segment,
                 " holds ", p.n, " tokens, more than one k-means problem (", kKMeansMaxPoints, ")");
    d.stride = std::max(d.stride, std::min(p.n, p.target));
  }
  const std::size_t stride = static_cast<std::size_t>(d.stride);
  std::int32_t* chosen_host = reinterpret_cast<std::int32_t*>(
      d.chosen.fill(problems.size() * stride * sizeof(std::int32_t)));
  const DevicePagedTable& dev = devices_[static_cast<std::size_t>(layer)];
  for (std::size_t first = 0; first < problems.size();
       first += static_cast<std::size_t>(kProblemsPerChunk)) {
    const std::size_t count =
        std::min(problems.size() - first, static_cast<std::size_t>(kProblemsPerChunk));
    // Problem i's keys start at row i * 128 (rows past its tokens repeat its first source).
    const std::size_t rows = count * kKMeansMaxPoints;
    const std::size_t sources_bytes = align_up(rows * sizeof(PagedKeySource));
    const std::size_t upload_bytes = sources_bytes + count * sizeof(KMeansProblem);
    WorkspaceCarver carver(scratch_, scratch_bytes_, "cuda::DeviceThinKV::end_step");
    std::uint8_t* d_upload = carver.take<std::uint8_t>(upload_bytes);
    float* keys = carver.take<float>(rows * static_cast<std::size_t>(D));
    std::int32_t* d_chosen = carver.take<std::int32_t>(count * stride);
    PinnedUpload& up = chunk_uploads_[next_upload_++ % 2];
    std::uint8_t* h_upload = up.fill(upload_bytes);  // waits for its copy of two chunks ago
    auto* sources = reinterpret_cast<PagedKeySource*>(h_upload);
    auto* kp = reinterpret_cast<KMeansProblem*>(h_upload + sources_bytes);
    for (std::size_t i = 0; i < count; ++i) {
      const Problem& p = problems[first + i];
      const PagedKeySource* from = d.sources.data() + p.first;
      PagedKeySource* row = sources + i * kKMeansMaxPoints;
      std::copy(from, from + p.n, row);
      std::fill(row + p.n, row + kKMeansMaxPoints, p.n == 0 ? PagedKeySource{} : from[0]);
      kp[i].points = keys + i * kKMeansMaxPoints * static_cast<std::size_t>(D);
      kp[i].row_stride = D;
      kp[i].n = p.n;
      kp[i].k = p.target;
    }
    const KMeansBounds bounds =
        kmeans_select_bounds(kp, static_cast<std::int64_t>(count), D, d.stride);
    up.copy_to(d_upload, upload_bytes, stream_);
    paged_gather_keys_uploaded(dev, reinterpret_cast<const PagedKeySource*>(d_upload),
                               static_cast<std::int64_t>(rows), keys, stream_);
    kmeans_select_uploaded(reinterpret_cast<const KMeansProblem*>(d_upload + sources_bytes),
                           static_cast<std::int64_t>(count), D, DType::f32, kcfg, bounds, d_chosen,
                           d.stride, stream_);
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(chosen_host + first * stride, d_chosen,
                                      count * stride * sizeof(std::int32_t), cudaMemcpyDeviceToHost,
                                      stream_));
  }
  KVSIFT_CUDA_CHECK(cudaEventRecord(d.selected.get(), stream_));
}

// The layer's evictions from its survivors (after their copy): of each problem, the tokens
// k-means did not keep, in the problems' order. Changes no table.
void DeviceThinKV::layer_evictions(int layer) {
  LayerDemotions& d = demotions_[static_cast<std::size_t>(layer)];
  d.slots.clear();
  if (d.problems.empty()) return;
  KVSIFT_CUDA_CHECK(cudaEventSynchronize(d.selected.get()));
  const auto* chosen = reinterpret_cast<const std::int32_t*>(d.chosen.fill(0));
  for (std::size_t i = 0; i < d.problems.size(); ++i) {
    const Problem& p = d.problems[i];
    const std::int32_t* row = chosen + i * static_cast<std::size_t>(d.stride);
    KVSIFT_CHECK(row[0] != kNonFiniteKeySlot, "cuda::DeviceThinKV::end_step: layer ", p.layer,
                 " head ", p.head, " of sequence ", p.seq, ": segment ", p.segment,
                 " holds a non-finite key");
    const std::int32_t kept = std::min(p.n, p.target);
    std::int32_t r = 0;
    for (std::int32_t j = 0; j < p.n; ++j) {
      if (r < kept && row[r] == j) {
        ++r;
      } else {
        d.slots.push_back(
            EvictionSlot{p.seq, p.head, d.addresses[static_cast<std::size_t>(p.first + j)]});
      }
    }
  }
  d.problems = {};
  d.addresses = {};
  d.sources = {};
}

void DeviceThinKV::pack_page_tables(int layer) const {
  const DevicePagedTable& dev = devices_[static_cast<std::size_t>(layer)];
  PageTables& p = pages_[static_cast<std::size_t>(layer)];
  if (p.current && p.version == dev.page_version()) return;
  std::vector<std::int32_t> seqs(static_cast<std::size_t>(batch_));
  for (std::int32_t b = 0; b < batch_; ++b) seqs[b] = b;
  p.view = paged_batch_image(dev, seqs.data(), batch_, p.memory, page_bytes_, p.image);
  std::memcpy(p.upload.fill(p.image.size()), p.image.data(), p.image.size());
  p.copy_bytes = p.image.size();
  p.version = dev.page_version();
  p.current = true;
}

const PagedBatch& DeviceThinKV::page_tables(int layer) const {
  check_layer(layer, "page_tables");
  await_layer(layer);
  pack_page_tables(layer);  // done by the layer's placement unless a block changed since
  PageTables& p = pages_[static_cast<std::size_t>(layer)];
  p.upload.copy_to(p.memory, p.copy_bytes, stream_);
  p.copy_bytes = 0;
  return p.view;
}

std::size_t DeviceThinKV::attention_workspace_bytes(int layer) const {
  check_layer(layer, "attention_workspace_bytes");
  return paged_decode_attention_batch_workspace_bytes(devices_[static_cast<std::size_t>(layer)],
                                                      page_tables(layer), config_.q_heads);
}

void DeviceThinKV::attention(int layer, const float* queries, float* out, void* workspace,
                             std::size_t workspace_bytes) const {
  const std::size_t need = attention_workspace_bytes(layer);
  KVSIFT_CHECK(workspace != nullptr && workspace_bytes >= need,
               "cuda::DeviceThinKV::attention: workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  paged_decode_attention_batch(devices_[static_cast<std::size_t>(layer)], page_tables(layer),
                               queries, config_.q_heads, config_.head_dim,
                               1.0f / std::sqrt(static_cast<float>(config_.head_dim)), out,
                               workspace, workspace_bytes, stream_);
}

const ThinKVSchedule& DeviceThinKV::schedule(std::int32_t seq) const {
  KVSIFT_CHECK(seq >= 0 && seq < batch_, "cuda::DeviceThinKV::schedule: sequence ", seq,
               " outside [0, batch = ", batch_, ")");
  return schedules_[static_cast<std::size_t>(seq)];
}

std::int32_t DeviceThinKV::length() const {
  await_layer(0);
  return tables_[0].length(0);
}

const ThoughtBlockTable& DeviceThinKV::table(int layer) const {
  check_layer(layer, "table");
  await_layer(layer);
  return tables_[static_cast<std::size_t>(layer)];
}

const DevicePagedTable& DeviceThinKV::device_table(int layer) const {
  check_layer(layer, "device_table");
  await_layer(layer);
  return devices_[static_cast<std::size_t>(layer)];
}

TableBytes DeviceThinKV::resident_bytes() const {
  for (int l = 0; l < config_.num_layers; ++l) await_layer(l);
  TableBytes sum;
  for (int l = 0; l < config_.num_layers; ++l)
    sum +=
        devices_[static_cast<std::size_t>(l)].resident_bytes(tables_[static_cast<std::size_t>(l)]);
  return sum;
}

std::int64_t DeviceThinKV::fullkv_fp16_bytes() const {
  return static_cast<std::int64_t>(config_.num_layers) * config_.kv_heads * length() *
         config_.head_dim * 2 * 2 * batch_;
}

}  // namespace kvsift::cuda
