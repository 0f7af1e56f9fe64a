// Continuous Thinking on the device (docs/algorithms.md §3.4): the host bookkeeping of
// DevicePagedTable, the append kernels (value rows quantized per token, key groups staged until
// their 16th slot arrives and then quantized per channel, keys of reused slots written under the
// sealed group's scales) and the eviction kernel (mask bits only).
//
// Why the batch is race-free:
//   - a slot is written at most once per batch (record_append rejects a second write), so value
//     rows, f32 key rows and key elements of distinct (token, head) pairs are distinct bytes;
//   - packed key codes (2 NVFP4 or 4 ternary slots per byte) are shared by the slots of one key
//     group, so all of a batch's writes into one (frame, head, key group) form one task, and one
//     thread per channel applies them in order (each channel is its own group of codes);
//   - the (sequence, type, head) staging rows are shared by consecutive key groups: a batch can
//     seal group A and start group B. Sealing tasks run first (launch 1) and read the rows staged
//     by earlier batches plus this batch's keys straight from the input; pure staging tasks run
//     after them (launch 2). Within one (sequence, type, head) at most one group is staging in a
//     batch, because slots are filled lowest first (docs/continuous_thinking.md, choice 8).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/paged/block_codec.hpp"
#include "kvsift/quant/group_codec.hpp"

namespace kvsift::cuda {
namespace {

using detail::PagedEviction;
using detail::PagedHeadLayout;
using detail::PagedKeyEntry;
using detail::PagedKeyTask;
using detail::PagedLayouts;
using detail::PagedRowWrite;

constexpr int kThreads = 256;

__device__ __forceinline__ QuantFormat quant_of(int block_format) {
  return quant_format_of(static_cast<BlockFormat>(block_format));
}

// A frame the CPU table has just taken: zero bytes, every slot free, key groups unsealed (sealed
// from the start in f32 blocks), as ThoughtBlockTable::take_frame does. One CTA per frame.
__global__ void init_frames_kernel(std::uint8_t* __restrict__ storage, std::int64_t frame_stride,
                                   std::uint64_t* __restrict__ masks,
                                   std::uint32_t* __restrict__ sealed, int kv_heads, int block_size,
                                   int mask_words,
                                   const std::int32_t* __restrict__ frames,     // [n]
                                   const std::int32_t* __restrict__ formats) {  // [n]
  const std::int64_t frame = frames[blockIdx.x];
  uint4* base = reinterpret_cast<uint4*>(storage + frame * frame_stride);  // stride % 256 == 0
  const std::int64_t units = frame_stride / 16;
  for (std::int64_t i = threadIdx.x; i < units; i += blockDim.x) base[i] = make_uint4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < kv_heads * mask_words; i += blockDim.x) {
    const int w = i % mask_words;
    const int bits = min(64, block_size - 64 * w);
    masks[frame * kv_heads * mask_words + i] = bits == 64 ? ~0ull : ((1ull << bits) - 1ull);
  }
  for (int h = threadIdx.x; h < kv_heads; h += blockDim.x) {
    sealed[frame * kv_heads + h] =
        static_cast<BlockFormat>(formats[blockIdx.x]) == BlockFormat::f32 ? ~0u : 0u;
  }
}

// One thread per (token, head, 16-channel chunk): the value group (quantized per token, §3.2 /
// KIVI), or for f32 blocks 16 raw keys and values. Chunk 0 marks the slot live.
template <class T>
__global__ void write_rows_kernel(std::uint8_t* __restrict__ storage, std::int64_t frame_stride,
                                  std::uint64_t* __restrict__ masks, int mask_words, int kv_heads,
                                  int head_dim, PagedLayouts layouts,
                                  const float* __restrict__ global_factors,  // [kv_heads]
                                  const T* __restrict__ key,    // [tokens, kv_heads, head_dim]
                                  const T* __restrict__ value,  // [tokens, kv_heads, head_dim]
                                  const PagedRowWrite* __restrict__ rows, int n_rows) {
  const int chunks = head_dim / kQuantGroupSize;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<std::int64_t>(n_rows) * chunks) return;
  const PagedRowWrite r = rows[t / chunks];
  const int cb = static_cast<int>(t % chunks);
  const PagedHeadLayout& L = layouts.by_format[r.format];
  std::uint8_t* base = storage + r.frame * frame_stride + r.head * L.head_bytes;
  const std::int64_t in =
      (static_cast<std::int64_t>(r.token) * kv_heads + r.head) * head_dim + cb * kQuantGroupSize;
  if (static_cast<BlockFormat>(r.format) == BlockFormat::f32) {
    float* k = reinterpret_cast<float*>(base) + static_cast<std::int64_t>(r.slot) * head_dim;
    float* v = reinterpret_cast<float*>(base + L.value_codes) +
               static_cast<std::int64_t>(r.slot) * head_dim;
#pragma unroll
    for (int i = 0; i < kQuantGroupSize; ++i) {
      k[cb * kQuantGroupSize + i] = to_float(key[in + i]);
      v[cb * kQuantGroupSize + i] = to_float(value[in + i]);
    }
  } else {
    const std::int64_t g = static_cast<std::int64_t>(r.slot) * chunks + cb;  // channel-axis group
    base[L.value_scales + g] =
        quantize_group(quant_of(r.format), value + in, 1, kQuantGroupSize, global_factors[r.head],
                       base + L.value_codes + g * L.code_bytes);
  }
  if (cb == 0) {
    atomicAnd(reinterpret_cast<unsigned long long*>(
                  &masks[(r.frame * static_cast<std::int64_t>(kv_heads) + r.head) * mask_words +
                         r.slot / 64]),
              ~(1ull << (r.slot % 64)));
  }
}

// One CTA per key task, one thread per channel (loop): the channel's group of codes belongs to
// this thread alone, so read-modify-writes of packed codes never race.
template <class T>
__global__ void write_keys_kernel(std::uint8_t* __restrict__ storage, std::int64_t frame_stride,
                                  std::uint32_t* __restrict__ sealed,
                                  float* __restrict__ staging_keys, int kv_heads, int head_dim,
                                  PagedLayouts layouts, const float* __restrict__ global_factors,
                                  const T* __restrict__ key,  // [tokens, kv_heads, head_dim]
                                  const PagedKeyTask* __restrict__ tasks, int first_task,
                                  const PagedKeyEntry* __restrict__ entries) {
  const PagedKeyTask task = tasks[first_task + blockIdx.x];
  const PagedHeadLayout& L = layouts.by_format[task.format];
  const QuantFormat q = quant_of(task.format);
  const float gf = global_factors[task.head];
  std::uint8_t* base = storage + task.frame * frame_stride + task.head * L.head_bytes;
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
    const std::int64_t g = static_cast<std::int64_t>(task.group) * head_dim + c;  // token axis
    std::uint8_t* codes = base + g * L.code_bytes;
    if (task.staging < 0) {  // reused slots of a sealed group: its scales stay
      const std::uint8_t scale = base[L.key_scales + g];
      for (int e = task.first; e < task.first + task.count; ++e) {
        const PagedKeyEntry en = entries[e];
        const float x = to_float(
            key[(static_cast<std::int64_t>(en.token) * kv_heads + task.head) * head_dim + c]);
        // The CPU table's own element writers (block_codec.hpp, host/device), so both sides write
        // bit-identical codes under a sealed group's scales.
        kvsift::detail::set_element_code(q, codes, en.row,
                                         kvsift::detail::encode_with_scale(q, x, scale, gf));
      }
      continue;
    }
    float* rows = staging_keys + task.staging;  // [16, head_dim]
    if (!task.seal) {
      for (int e = task.first; e < task.first + task.count; ++e) {
        const PagedKeyEntry en = entries[e];
        rows[en.row * head_dim + c] = to_float(
            key[(static_cast<std::int64_t>(en.token) * kv_heads + task.head) * head_dim + c]);
      }
      continue;
    }
    // The 16th slot arrived: quantize the whole group of this channel at once (TBQ §3.2),
    // taking this batch's keys from the input and earlier ones from the staging rows.
    float group[kQuantGroupSize];
    for (int i = 0; i < kQuantGroupSize; ++i) group[i] = rows[i * head_dim + c];
    for (int e = task.first; e < task.first + task.count; ++e) {
      const PagedKeyEntry en = entries[e];
      group[en.row] = to_float(
          key[(static_cast<std::int64_t>(en.token) * kv_heads + task.head) * head_dim + c]);
    }
    base[L.key_scales + g] = quantize_group(q, group, 1, kQuantGroupSize, gf, codes);
  }
  if (task.seal && threadIdx.x == 0) {
    atomicOr(&sealed[task.frame * static_cast<std::int64_t>(kv_heads) + task.head],
             1u << task.group);
  }
}

__global__ void evict_kernel(std::uint64_t* __restrict__ masks, int kv_heads, int mask_words,
                             const PagedEviction* __restrict__ list, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const PagedEviction e = list[i];
  atomicOr(reinterpret_cast<unsigned long long*>(
               &masks[(static_cast<std::int64_t>(e.frame) * kv_heads + e.head) * mask_words +
                      e.slot / 64]),
           1ull << (e.slot % 64));
}

template <class T>
std::size_t bytes_of(std::size_t n) {
  return align_up(n * sizeof(T));
}

template <class T>
T* upload(WorkspaceCarver& carver, const std::vector<T>& host, cudaStream_t stream) {
  T* d = carver.take<T>(host.size());
  if (!host.empty()) {
    KVSIFT_CUDA_CHECK(
        cudaMemcpyAsync(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  return d;
}

template <class T>
void launch_append(const DevicePagedTable& t, const T* key, const T* value,
                   const std::vector<PagedRowWrite>& rows, const PagedRowWrite* d_rows,
                   const PagedKeyTask* d_tasks, int sealing_tasks, int total_tasks,
                   const PagedKeyEntry* d_entries, cudaStream_t stream) {
  const ThoughtBlockTableConfig& cfg = t.config();
  const PagedTableMemory& m = t.memory();
  const PagedLayouts layouts = detail::paged_layouts(cfg);
  const std::int64_t threads =
      static_cast<std::int64_t>(rows.size()) * (cfg.head_dim / kQuantGroupSize);
  if (threads > 0) {
    write_rows_kernel<T>
        <<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            m.storage, t.sizes().frame_stride, m.free_masks, t.sizes().mask_words, cfg.kv_heads,
            cfg.head_dim, layouts, m.global_factors, key, value, d_rows,
            static_cast<int>(rows.size()));
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
  const int key_threads = std::min(cfg.head_dim, 128);
  const int counts[2] = {sealing_tasks, total_tasks - sealing_tasks};
  const int firsts[2] = {0, sealing_tasks};
  for (int phase = 0; phase < 2; ++phase) {
    if (counts[phase] == 0) continue;
    write_keys_kernel<T><<<counts[phase], key_threads, 0, stream>>>(
        m.storage, t.sizes().frame_stride, m.sealed, m.staging_keys, cfg.kv_heads, cfg.head_dim,
        layouts, m.global_factors, key, d_tasks, firsts[phase], d_entries);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

PagedTableSizes paged_table_sizes(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences) {
  cfg.validate();
  KVSIFT_CHECK(max_sequences > 0, "paged_table_sizes: max_sequences must be > 0, got ",
               max_sequences);
  PagedTableSizes s;
  s.mask_words = (cfg.block_size + 63) / 64;
  std::int64_t largest = 0;
  for (BlockFormat f : {cfg.reasoning, cfg.execution, cfg.transition}) {
    largest = std::max(largest, BlockHeadLayout{f, cfg.block_size, cfg.head_dim}.bytes());
  }
  s.frame_stride = static_cast<std::int64_t>(
      align_up(static_cast<std::size_t>(largest * cfg.kv_heads), kWorkspaceAlign));
  s.storage_bytes = s.frame_stride * cfg.num_blocks;
  s.mask_bytes = static_cast<std::int64_t>(cfg.num_blocks) * cfg.kv_heads * s.mask_words * 8;
  s.sealed_bytes = static_cast<std::int64_t>(cfg.num_blocks) * cfg.kv_heads * 4;
  s.staging_bytes = static_cast<std::int64_t>(max_sequences) * kPagedThoughtTypes * cfg.kv_heads *
                    kQuantGroupSize * cfg.head_dim * 4;
  s.global_factor_bytes = static_cast<std::int64_t>(cfg.kv_heads) * 4;
  return s;
}

DevicePagedTable::DevicePagedTable(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences,
                                   const PagedTableMemory& memory)
    : cfg_(cfg),
      max_sequences_(max_sequences),
      sizes_(paged_table_sizes(cfg, max_sequences)),
      mem_(memory) {
  KVSIFT_CHECK(mem_.storage != nullptr && mem_.free_masks != nullptr && mem_.sealed != nullptr &&
                   mem_.staging_keys != nullptr && mem_.global_factors != nullptr,
               "DevicePagedTable: every PagedTableMemory pointer must be non-null (storage ",
               static_cast<const void*>(mem_.storage), ", free_masks ",
               static_cast<const void*>(mem_.free_masks), ", sealed ",
               static_cast<const void*>(mem_.sealed), ", staging_keys ",
               static_cast<const void*>(mem_.staging_keys), ", global_factors ",
               static_cast<const void*>(mem_.global_factors), ")");
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(mem_.storage) % 16 == 0,
               "DevicePagedTable: storage must be 16-byte aligned, got ",
               static_cast<const void*>(mem_.storage));
  // g = 1 for every head when none are given (ThoughtBlockTableConfig::global_factor).
  if (cfg_.global_factors.empty())
    cfg_.global_factors.assign(static_cast<std::size_t>(cfg_.kv_heads), 1.0f);
  pages_.resize(static_cast<std::size_t>(max_sequences));
  written_.assign(static_cast<std::size_t>(cfg_.num_blocks) * cfg_.kv_heads * groups_per_block(),
                  0);
}

void DevicePagedTable::initialize(cudaStream_t stream) {
  KVSIFT_CUDA_CHECK(
      cudaMemsetAsync(mem_.free_masks, 0xff, static_cast<std::size_t>(sizes_.mask_bytes), stream));
  KVSIFT_CUDA_CHECK(
      cudaMemsetAsync(mem_.sealed, 0, static_cast<std::size_t>(sizes_.sealed_bytes), stream));
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(mem_.staging_keys, 0,
                                    static_cast<std::size_t>(sizes_.staging_bytes), stream));
  // The factors live in cfg_ for the table's lifetime, so the async copy's source stays valid.
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(mem_.global_factors, cfg_.global_factors.data(),
                                    static_cast<std::size_t>(sizes_.global_factor_bytes),
                                    cudaMemcpyHostToDevice, stream));
}

void DevicePagedTable::check_seq(std::int32_t seq, const char* fn) const {
  KVSIFT_CHECK(seq >= 0 && seq < max_sequences_, "DevicePagedTable::", fn, ": sequence ", seq,
               " outside [0, max_sequences = ", max_sequences_, ")");
}

void DevicePagedTable::record_append(const ThoughtBlockTable& table, std::int32_t seq,
                                     const SlotAddress* where) {
  check_seq(seq, "record_append");
  const ThoughtBlockTableConfig& tc = table.config();
  KVSIFT_CHECK(tc.kv_heads == cfg_.kv_heads && tc.head_dim == cfg_.head_dim &&
                   tc.block_size == cfg_.block_size && tc.num_blocks == cfg_.num_blocks &&
                   tc.reasoning == cfg_.reasoning && tc.execution == cfg_.execution &&
                   tc.transition == cfg_.transition,
               "DevicePagedTable::record_append: the CPU table's config (kv_heads ", tc.kv_heads,
               ", head_dim ", tc.head_dim, ", block_size ", tc.block_size, ", num_blocks ",
               tc.num_blocks, ") differs from the mirror's (kv_heads ", cfg_.kv_heads,
               ", head_dim ", cfg_.head_dim, ", block_size ", cfg_.block_size, ", num_blocks ",
               cfg_.num_blocks, ") or in block formats");
  KVSIFT_CHECK(table.has_sequence(seq), "DevicePagedTable::record_append: sequence ", seq,
               " is not active in the CPU table");
  KVSIFT_CHECK(where != nullptr, "DevicePagedTable::record_append: where must not be null");
  std::vector<BlockRef>& pages = pages_[static_cast<std::size_t>(seq)];
  const std::int32_t known = static_cast<std::int32_t>(pages.size());
  const std::int32_t H = cfg_.kv_heads, S = cfg_.block_size, G = groups_per_block();
  // Validate everything before recording anything.
  BlockRef fresh;
  bool takes_block = false;
  for (std::int32_t h = 0; h < H; ++h) {
    const SlotAddress a = where[h];
    KVSIFT_CHECK(a.block >= 0 && a.block <= known && a.block < table.num_blocks(seq),
                 "DevicePagedTable::record_append: kv head ", h, " block ", a.block,
                 " outside [0, ", known, "] (blocks known to the mirror; the CPU table has ",
                 table.num_blocks(seq), ")");
    KVSIFT_CHECK(a.slot >= 0 && a.slot < S, "DevicePagedTable::record_append: kv head ", h,
                 " slot ", a.slot, " outside [0, block_size = ", S, ")");
    if (a.block == known && !takes_block) {
      const BlockInfo info = table.block_info(seq, a.block);
      fresh = BlockRef{info.frame, info.format, info.type};
      takes_block = true;
    }
    const BlockRef& ref = a.block == known ? fresh : pages[static_cast<std::size_t>(a.block)];
    const std::int64_t slot_key = (static_cast<std::int64_t>(ref.frame) * H + h) * S + a.slot;
    KVSIFT_CHECK(!batch_slots_.count(slot_key), "DevicePagedTable::record_append: slot ", a.slot,
                 " of block ", a.block, " in kv head ", h, " of sequence ", seq,
                 " is written twice in one batch (call append() before evicting and refilling)");
    if (is_quantized(ref.format) && a.block < known) {
      const std::int64_t task_key =
          (static_cast<std::int64_t>(ref.frame) * H + h) * G + a.slot / 16;
      const auto it = task_index_.find(task_key);
      KVSIFT_CHECK(it == task_index_.end() || !tasks_[static_cast<std::size_t>(it->second)].seal,
                   "DevicePagedTable::record_append internal error: key group ", a.slot / 16,
                   " of block ", a.block, " in kv head ", h, " sealed earlier in this batch");
    }
  }
  if (takes_block) {
    pages.push_back(fresh);
    fresh_frames_.push_back(fresh.frame);
    fresh_formats_.push_back(static_cast<std::int32_t>(fresh.format));
    std::fill_n(written_.begin() + static_cast<std::ptrdiff_t>(fresh.frame) * H * G, H * G, 0);
  }
  const std::int32_t token = pending_tokens_++;
  for (std::int32_t h = 0; h < H; ++h) {
    const SlotAddress a = where[h];
    const BlockRef& ref = pages[static_cast<std::size_t>(a.block)];
    batch_slots_.insert((static_cast<std::int64_t>(ref.frame) * H + h) * S + a.slot);
    rows_.push_back(
        detail::PagedRowWrite{token, h, ref.frame, a.slot, static_cast<std::int32_t>(ref.format)});
    if (!is_quantized(ref.format)) continue;
    const std::int32_t group = a.slot / 16, row = a.slot % 16;
    const std::size_t wi = (static_cast<std::size_t>(ref.frame) * H + h) * G + group;
    const std::int64_t task_key = static_cast<std::int64_t>(wi);
    auto it = task_index_.find(task_key);
    if (it == task_index_.end()) {
      const bool sealed = written_[wi] == 0xffffu;
      const std::int64_t staging = sealed ? -1
                                          : ((static_cast<std::int64_t>(seq) * kPagedThoughtTypes +
                                              static_cast<int>(ref.type)) *
                                                 H +
                                             h) *
                                                16 * cfg_.head_dim;
      it = task_index_.emplace(task_key, static_cast<std::int32_t>(tasks_.size())).first;
      tasks_.push_back(detail::PagedKeyTask{
          ref.frame, h, group, static_cast<std::int32_t>(ref.format), 0, 0, 0, staging});
    }
    detail::PagedKeyTask& task = tasks_[static_cast<std::size_t>(it->second)];
    entries_.push_back(detail::PagedKeyEntry{it->second, token, row});
    ++task.count;
    if (task.staging >= 0) {
      written_[wi] = static_cast<std::uint16_t>(written_[wi] | (1u << row));
      if (written_[wi] == 0xffffu) task.seal = 1;
    }
  }
}

std::size_t DevicePagedTable::append_workspace_bytes() const {
  return bytes_of<std::int32_t>(fresh_frames_.size()) * 2 +
         bytes_of<detail::PagedRowWrite>(rows_.size()) +
         bytes_of<detail::PagedKeyTask>(tasks_.size()) +
         bytes_of<detail::PagedKeyEntry>(entries_.size());
}

void DevicePagedTable::append(const void* key, const void* value, DType dtype, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream) {
  KVSIFT_CHECK(dtype == DType::f32 || dtype == DType::bf16,
               "DevicePagedTable::append: key/value dtype must be f32 or bf16, got ",
               dtype_name(dtype));
  if (pending_tokens_ == 0) return;
  KVSIFT_CHECK(key != nullptr && value != nullptr, "DevicePagedTable::append: ", pending_tokens_,
               " tokens are recorded but key or value is null");
  const std::size_t need = append_workspace_bytes();
  KVSIFT_CHECK(workspace_bytes >= need, "DevicePagedTable::append: workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  // Sealing and sealed-write tasks first (launch 1), pure staging tasks after (launch 2); the
  // entries of each task become contiguous, in recording order.
  std::vector<std::int32_t> order(tasks_.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int32_t>(i);
  std::stable_partition(order.begin(), order.end(), [&](std::int32_t i) {
    const detail::PagedKeyTask& t = tasks_[static_cast<std::size_t>(i)];
    return t.seal || t.staging < 0;
  });
  std::vector<std::int32_t> new_index(tasks_.size());
  std::vector<detail::PagedKeyTask> tasks(tasks_.size());
  std::int32_t sealing = 0, next = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    detail::PagedKeyTask t = tasks_[static_cast<std::size_t>(order[k])];
    sealing += (t.seal || t.staging < 0) ? 1 : 0;
    t.first = next;
    next += t.count;
    t.count = 0;
    new_index[static_cast<std::size_t>(order[k])] = static_cast<std::int32_t>(k);
    tasks[k] = t;
  }
  std::vector<detail::PagedKeyEntry> entries(entries_.size());
  for (const detail::PagedKeyEntry& e : entries_) {
    detail::PagedKeyTask& t =
        tasks[static_cast<std::size_t>(new_index[static_cast<std::size_t>(e.task)])];
    entries[static_cast<std::size_t>(t.first + t.count++)] =
        detail::PagedKeyEntry{new_index[static_cast<std::size_t>(e.task)], e.token, e.row};
  }

  WorkspaceCarver carver(workspace, workspace_bytes, "DevicePagedTable::append");
  const std::int32_t* d_frames = upload(carver, fresh_frames_, stream);
  const std::int32_t* d_formats = upload(carver, fresh_formats_, stream);
  const detail::PagedRowWrite* d_rows = upload(carver, rows_, stream);
  const detail::PagedKeyTask* d_tasks = upload(carver, tasks, stream);
  const detail::PagedKeyEntry* d_entries = upload(carver, entries, stream);
  if (!fresh_frames_.empty()) {
    init_frames_kernel<<<static_cast<unsigned>(fresh_frames_.size()), kThreads, 0, stream>>>(
        mem_.storage, sizes_.frame_stride, mem_.free_masks, mem_.sealed, cfg_.kv_heads,
        cfg_.block_size, sizes_.mask_words, d_frames, d_formats);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
  const int total = static_cast<int>(tasks.size());
  if (dtype == DType::f32) {
    launch_append(*this, static_cast<const float*>(key), static_cast<const float*>(value), rows_,
                  d_rows, d_tasks, sealing, total, d_entries, stream);
  } else {
    launch_append(*this, static_cast<const bf16_t*>(key), static_cast<const bf16_t*>(value), rows_,
                  d_rows, d_tasks, sealing, total, d_entries, stream);
  }
  pending_tokens_ = 0;
  fresh_frames_.clear();
  fresh_formats_.clear();
  rows_.clear();
  tasks_.clear();
  entries_.clear();
  task_index_.clear();
  batch_slots_.clear();
}

std::size_t DevicePagedTable::evict_workspace_bytes(std::size_t count) const {
  return bytes_of<detail::PagedEviction>(count);
}

void DevicePagedTable::evict(std::int32_t seq, std::int32_t head,
                             const std::vector<SlotAddress>& slots, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream) {
  check_seq(seq, "evict");
  KVSIFT_CHECK(head >= 0 && head < cfg_.kv_heads, "DevicePagedTable::evict: kv head ", head,
               " outside [0, ", cfg_.kv_heads, ")");
  KVSIFT_CHECK(pending_tokens_ == 0, "DevicePagedTable::evict: ", pending_tokens_,
               " recorded tokens are not written yet (call append() first)");
  const std::vector<BlockRef>& pages = pages_[static_cast<std::size_t>(seq)];
  std::vector<detail::PagedEviction> list;
  list.reserve(slots.size());
  for (const SlotAddress& a : slots) {
    KVSIFT_CHECK(a.block >= 0 && a.block < static_cast<std::int32_t>(pages.size()),
                 "DevicePagedTable::evict: block ", a.block, " of sequence ", seq, " outside [0, ",
                 pages.size(), ")");
    KVSIFT_CHECK(a.slot >= 0 && a.slot < cfg_.block_size, "DevicePagedTable::evict: slot ", a.slot,
                 " outside [0, block_size = ", cfg_.block_size, ")");
    list.push_back(
        detail::PagedEviction{pages[static_cast<std::size_t>(a.block)].frame, head, a.slot});
  }
  if (list.empty()) return;
  WorkspaceCarver carver(workspace, workspace_bytes, "DevicePagedTable::evict");
  const detail::PagedEviction* d_list = upload(carver, list, stream);
  const int n = static_cast<int>(list.size());
  evict_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      mem_.free_masks, cfg_.kv_heads, sizes_.mask_words, d_list, n);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void DevicePagedTable::release_sequence(std::int32_t seq) {
  check_seq(seq, "release_sequence");
  KVSIFT_CHECK(pending_tokens_ == 0, "DevicePagedTable::release_sequence: ", pending_tokens_,
               " recorded tokens are not written yet (call append() first)");
  pages_[static_cast<std::size_t>(seq)].clear();
}

std::int32_t DevicePagedTable::num_blocks(std::int32_t seq) const {
  check_seq(seq, "num_blocks");
  return static_cast<std::int32_t>(pages_[static_cast<std::size_t>(seq)].size());
}

std::int32_t DevicePagedTable::frame_of(std::int32_t seq, std::int32_t block) const {
  KVSIFT_CHECK(block >= 0 && block < num_blocks(seq), "DevicePagedTable::frame_of: block ", block,
               " of sequence ", seq, " outside [0, ", num_blocks(seq), ")");
  return pages_[static_cast<std::size_t>(seq)][static_cast<std::size_t>(block)].frame;
}

BlockFormat DevicePagedTable::format_of_block(std::int32_t seq, std::int32_t block) const {
  frame_of(seq, block);
  return pages_[static_cast<std::size_t>(seq)][static_cast<std::size_t>(block)].format;
}

ThoughtType DevicePagedTable::type_of_block(std::int32_t seq, std::int32_t block) const {
  frame_of(seq, block);
  return pages_[static_cast<std::size_t>(seq)][static_cast<std::size_t>(block)].type;
}

}  // namespace kvsift::cuda
