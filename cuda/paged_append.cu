// Continuous Thinking on the device (docs/algorithms.md §3.4): the host bookkeeping of
// DevicePagedTable (replaying the CPU ThoughtBlockTable's decisions: staging, group refill into
// the lowest free 16-slot run, new blocks, blocks freed when all their slots are evicted, pools
// per format), the append kernels and the eviction kernel.
//
// Why a batch is race-free:
//   - f32 rows: a slot is written at most once per batch (the host mask is cleared at record time
//     and a second write into a live slot is rejected), so rows of distinct (token, head) pairs
//     are distinct bytes; their mask words are updated with atomicAnd.
//   - staged tokens and seals: all ops of one (sequence, type, head) stream run in one CTA, in
//     recording order, separated by __syncthreads (a seal reads the 16 rows its stage ops wrote,
//     the next stage op may reuse a row the seal has read). Distinct streams touch distinct
//     staging rows and distinct (frame, head) bytes (a block has one thought type and one owner),
//     so CTAs never share a byte; masks are updated with atomicAnd all the same.
//   - fresh frames are initialised by the first launch of the batch, before any write into them
//     (stream order).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/paged/block_codec.hpp"
#include "kvsift/quant/group_codec.hpp"

namespace kvsift::cuda {
namespace {

using detail::PagedEviction;
using detail::PagedFreshFrame;
using detail::PagedHeadLayout;
using detail::PagedLayouts;
using detail::PagedRowWrite;
using detail::PagedSeal;
using detail::PagedStagedMask;
using detail::PagedStreamOp;
using detail::PagedStreamTask;

constexpr int kThreads = 256;
constexpr int kStreamThreads = 128;

// A frame the CPU table has just taken: zero bytes, every slot free, positions -1 (as
// ThoughtBlockTable::take_frame), and its byte offset published. One CTA per frame.
__global__ void init_frames_kernel(std::uint8_t* __restrict__ storage,
                                   std::uint64_t* __restrict__ masks,
                                   std::uint8_t* __restrict__ positions,
                                   std::int64_t* __restrict__ frame_offsets, int kv_heads,
                                   int block_size, int mask_words, PagedLayouts layouts,
                                   const PagedFreshFrame* __restrict__ fresh) {  // [gridDim.x]
  const PagedFreshFrame f = fresh[blockIdx.x];
  const std::int64_t frame = f.frame;
  // Every (block, head) section is a multiple of 16 bytes and offsets are 256-aligned.
  uint4* base = reinterpret_cast<uint4*>(storage + f.offset);
  const std::int64_t units = kv_heads * layouts.by_format[f.format].head_bytes / 16;
  for (std::int64_t i = threadIdx.x; i < units; i += blockDim.x) base[i] = make_uint4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < kv_heads * mask_words; i += blockDim.x) {
    const int w = i % mask_words;
    const int bits = min(64, block_size - 64 * w);
    masks[frame * kv_heads * mask_words + i] = bits == 64 ? ~0ull : ((1ull << bits) - 1ull);
  }
  std::uint8_t* frame_positions = positions + frame * kv_heads * block_size * kSlotPositionBytes;
  for (int i = threadIdx.x; i < kv_heads * block_size * kSlotPositionBytes; i += blockDim.x) {
    frame_positions[i] = 0xFF;  // every slot kUnwrittenSlotPosition
  }
  if (threadIdx.x == 0) frame_offsets[frame] = f.offset;
}

// f32 blocks: one thread per (token, head, 16-channel chunk) copies 16 keys and values; chunk 0
// writes the position and marks the slot live.
template <class T>
__global__ void write_rows_kernel(std::uint8_t* __restrict__ storage,
                                  std::uint64_t* __restrict__ masks,
                                  std::uint8_t* __restrict__ positions, int mask_words,
                                  int kv_heads, int block_size, int head_dim,
                                  std::int64_t value_offset,    // f32 values within a head
                                  const T* __restrict__ key,    // [tokens, kv_heads, head_dim]
                                  const T* __restrict__ value,  // [tokens, kv_heads, head_dim]
                                  const PagedRowWrite* __restrict__ rows, int n_rows) {
  const int chunks = head_dim / kQuantGroupSize;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<std::int64_t>(n_rows) * chunks) return;
  const PagedRowWrite r = rows[t / chunks];
  const int cb = static_cast<int>(t % chunks);
  std::uint8_t* base = storage + r.base;
  const std::int64_t in =
      (static_cast<std::int64_t>(r.token) * kv_heads + r.head) * head_dim + cb * kQuantGroupSize;
  float* k = reinterpret_cast<float*>(base) + static_cast<std::int64_t>(r.slot) * head_dim;
  float* v =
      reinterpret_cast<float*>(base + value_offset) + static_cast<std::int64_t>(r.slot) * head_dim;
#pragma unroll
  for (int i = 0; i < kQuantGroupSize; ++i) {
    k[cb * kQuantGroupSize + i] = to_float(key[in + i]);
    v[cb * kQuantGroupSize + i] = to_float(value[in + i]);
  }
  if (cb == 0) {
    const std::int64_t fh = static_cast<std::int64_t>(r.frame) * kv_heads + r.head;
    store_slot_position(positions, fh * block_size + r.slot, r.position);
    atomicAnd(reinterpret_cast<unsigned long long*>(&masks[fh * mask_words + r.slot / 64]),
              ~(1ull << (r.slot % 64)));
  }
}

// One CTA per (sequence, type, head) stream: its ops in order. A stage op writes the token's key
// and value rows at 16 bits (from_float<PagedStaging>, the CPU staging's rounding); a seal then
// quantizes the 16 rows, in position order, exactly as quantize_token_group does on the CPU:
// keys per channel (16 slots), values per token (16 channels), each with its own fresh scale.
// A regroup seal fills only the run's free slots from staging and re-quantizes its survivors too.
template <class T>
__global__ void __launch_bounds__(kStreamThreads)
    stream_ops_kernel(std::uint8_t* __restrict__ storage, std::uint64_t* __restrict__ masks,
                      std::uint8_t* __restrict__ positions,
                      PagedStaging* __restrict__ staged_keys,    // [streams, 16, head_dim]
                      PagedStaging* __restrict__ staged_values,  // [streams, 16, head_dim]
                      std::uint32_t* __restrict__ staged_masks,  // [streams]
                      int mask_words, int kv_heads, int block_size, int head_dim,
                      PagedLayouts layouts, const float* __restrict__ global_factors,
                      const T* __restrict__ key,    // [tokens, kv_heads, head_dim]
                      const T* __restrict__ value,  // [tokens, kv_heads, head_dim]
                      const PagedStreamTask* __restrict__ tasks,
                      const PagedStreamOp* __restrict__ ops, const PagedSeal* __restrict__ seals) {
  const PagedStreamTask task = tasks[blockIdx.x];
  const int D = head_dim, per_token = D / kQuantGroupSize;
  PagedStaging* sk = staged_keys + task.stream * kQuantGroupSize * D;
  PagedStaging* sv = staged_values + task.stream * kQuantGroupSize * D;
  const float gf = global_factors[task.head];
  for (int o = task.first; o < task.first + task.count; ++o) {
    const PagedStreamOp& op = ops[o];
    const std::int64_t in = (static_cast<std::int64_t>(op.token) * kv_heads + task.head) * D;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
      sk[op.row * D + c] = from_float<PagedStaging>(to_float(key[in + c]));
      sv[op.row * D + c] = from_float<PagedStaging>(to_float(value[in + c]));
    }
    __syncthreads();  // the seal below reads rows other threads wrote
    if (op.seal >= 0) {
      const PagedSeal& seal = seals[op.seal];
      const PagedHeadLayout& L = layouts.by_format[seal.format];
      const QuantFormat q = quant_format_of(static_cast<BlockFormat>(seal.format));
      std::uint8_t* base = storage + seal.base;
      const int group = seal.first_slot / kQuantGroupSize;
      // A regroup's survivors enter as their dequantized rows (what attention reads), exactly as
      // ThoughtBlockTable::regroup_run: each thread reads the one group it then rewrites.
      float x[kQuantGroupSize];
      for (int c = threadIdx.x; c < D; c += blockDim.x) {  // key group (slot group, channel c)
        const std::int64_t g = static_cast<std::int64_t>(group) * D + c;
        if (seal.regroup) {
          dequantize_group(q, base + g * L.code_bytes, base[L.key_scales + g], gf, kQuantGroupSize,
                           x, 1);
        }
        for (int i = 0; i < kQuantGroupSize; ++i) {
          if (seal.order[i] >= 0) x[i] = to_float(sk[seal.order[i] * D + c]);
        }
        base[L.key_scales + g] =
            quantize_group(q, x, 1, kQuantGroupSize, gf, base + g * L.code_bytes);
      }
      for (int k = threadIdx.x; k < kQuantGroupSize * per_token; k += blockDim.x) {
        const int i = k / per_token, b = k % per_token;  // value group (slot first + i, block b)
        const std::int64_t g = static_cast<std::int64_t>(seal.first_slot + i) * per_token + b;
        std::uint8_t* codes = base + L.value_codes + g * L.code_bytes;
        if (seal.order[i] < 0) {
          dequantize_group(q, codes, base[L.value_scales + g], gf, kQuantGroupSize, x, 1);
        } else {
          const PagedStaging* row = sv + seal.order[i] * D + b * kQuantGroupSize;
          for (int j = 0; j < kQuantGroupSize; ++j) x[j] = to_float(row[j]);
        }
        base[L.value_scales + g] = quantize_group(q, x, 1, kQuantGroupSize, gf, codes);
      }
      const std::int64_t fh = static_cast<std::int64_t>(seal.frame) * kv_heads + task.head;
      if (threadIdx.x < kQuantGroupSize && seal.positions[threadIdx.x] >= 0) {
        store_slot_position(positions, fh * block_size + seal.first_slot + threadIdx.x,
                            seal.positions[threadIdx.x]);
      }
      if (threadIdx.x == 0) {
        atomicAnd(
            reinterpret_cast<unsigned long long*>(&masks[fh * mask_words + seal.first_slot / 64]),
            ~(0xffffull << (seal.first_slot % 64)));
      }
      __syncthreads();  // the next op may overwrite a row this seal has read
    }
  }
  if (threadIdx.x == 0) staged_masks[task.stream] = task.final_mask;
}

// Items [0, n_slots): eviction bits; items [n_slots, n_slots + n_staged): staged masks.
__global__ void evict_kernel(std::uint64_t* __restrict__ masks,
                             std::uint32_t* __restrict__ staged_masks, int kv_heads, int mask_words,
                             const PagedEviction* __restrict__ list, int n_slots,
                             const PagedStagedMask* __restrict__ staged, int n_staged) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_slots) {
    const PagedEviction e = list[i];
    atomicOr(reinterpret_cast<unsigned long long*>(
                 &masks[(static_cast<std::int64_t>(e.frame) * kv_heads + e.head) * mask_words +
                        e.slot / 64]),
             1ull << (e.slot % 64));
  } else if (i < n_slots + n_staged) {
    const PagedStagedMask s = staged[i - n_slots];
    staged_masks[s.stream] = s.mask;
  }
}

template <class T>
std::size_t bytes_of(std::size_t n) {
  return align_up(n * sizeof(T));
}

// Where the arrays of an append plan lie in its pinned upload and in the workspace, each aligned
// as WorkspaceCarver aligns: byte offsets of fresh, rows, tasks, ops and seals, then the end.
struct PlanLayout {
  std::size_t fresh = 0, rows = 0, tasks = 0, ops = 0, seals = 0, end = 0;
};
PlanLayout plan_layout(std::size_t fresh, std::size_t rows, std::size_t tasks, std::size_t ops,
                       std::size_t seals) {
  PlanLayout at;
  at.rows = at.fresh + bytes_of<PagedFreshFrame>(fresh);
  at.tasks = at.rows + bytes_of<PagedRowWrite>(rows);
  at.ops = at.tasks + bytes_of<PagedStreamTask>(tasks);
  at.seals = at.ops + bytes_of<PagedStreamOp>(ops);
  at.end = at.seals + bytes_of<PagedSeal>(seals);
  return at;
}
PlanLayout plan_layout(const detail::PagedAppendPlan& p) {
  return plan_layout(p.fresh.size(), p.rows.size(), p.tasks.size(), p.ops.size(), p.seals.size());
}

template <class T>
void pack(std::uint8_t* to, const std::vector<T>& host) {
  if (!host.empty()) std::memcpy(to, host.data(), host.size() * sizeof(T));
}

template <class T>
T* upload(WorkspaceCarver& carver, const T* host, std::size_t n, cudaStream_t stream) {
  T* d = carver.take<T>(n);
  if (n > 0) {
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d, host, n * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  return d;
}

template <class T>
T* upload(WorkspaceCarver& carver, const std::vector<T>& host, cudaStream_t stream) {
  return upload(carver, host.data(), host.size(), stream);
}

template <class T>
void launch_append(const DevicePagedTable& t, const T* key, const T* value,
                   const std::vector<PagedRowWrite>& rows, const PagedRowWrite* d_rows, int n_tasks,
                   const PagedStreamTask* d_tasks, const PagedStreamOp* d_ops,
                   const PagedSeal* d_seals, cudaStream_t stream) {
  const ThoughtBlockTableConfig& cfg = t.config();
  const PagedTableMemory& m = t.memory();
  const PagedLayouts layouts = detail::paged_layouts(cfg);
  const std::int64_t threads =
      static_cast<std::int64_t>(rows.size()) * (cfg.head_dim / kQuantGroupSize);
  if (threads > 0) {
    write_rows_kernel<T>
        <<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
            m.storage, m.free_masks, m.positions, t.sizes().mask_words, cfg.kv_heads,
            cfg.block_size, cfg.head_dim,
            layouts.by_format[static_cast<int>(BlockFormat::f32)].value_codes, key, value, d_rows,
            static_cast<int>(rows.size()));
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
  if (n_tasks > 0) {
    stream_ops_kernel<T><<<static_cast<unsigned>(n_tasks), kStreamThreads, 0, stream>>>(
        m.storage, m.free_masks, m.positions, m.staged_keys, m.staged_values, m.staged_masks,
        t.sizes().mask_words, cfg.kv_heads, cfg.block_size, cfg.head_dim, layouts, m.global_factors,
        key, value, d_tasks, d_ops, d_seals);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
}

bool bit_free(const std::uint64_t* mask, std::int32_t slot) {
  return (mask[slot / 64] >> (slot % 64)) & 1u;
}
bool run_free(const std::uint64_t* mask, std::int32_t first) {  // 16 slots, never across words
  return ((mask[first / 64] >> (first % 64)) & 0xffffu) == 0xffffu;
}
// The 16 staging rows of a full stream in the order of their positions (rows: [16]).
void rows_by_position(const std::int32_t* rows, std::int32_t* order) {  // order: [16]
  for (int i = 0; i < kQuantGroupSize; ++i) order[i] = i;
  std::sort(order, order + kQuantGroupSize,
            [&](std::int32_t x, std::int32_t y) { return rows[x] < rows[y]; });
}

}  // namespace

PagedTableSizes paged_table_sizes(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences,
                                  const PagedPoolFrames& pools) {
  cfg.validate();
  KVSIFT_CHECK(max_sequences > 0, "paged_table_sizes: max_sequences must be > 0, got ",
               max_sequences);
  PagedTableSizes s;
  s.mask_words = static_cast<std::int32_t>(block_mask_words(cfg.block_size));
  std::int64_t offset = 0;
  for (int f = 0; f < 4; ++f) {
    const BlockFormat format = static_cast<BlockFormat>(f);
    const bool used =
        cfg.reasoning == format || cfg.execution == format || cfg.transition == format;
    const std::int32_t n = pools.frames[f];
    KVSIFT_CHECK(n >= -1 && n <= cfg.num_blocks, "paged_table_sizes: pool of ",
                 block_format_name(format), " has ", n,
                 " frames (expected -1 or [0, num_blocks = ", cfg.num_blocks, "])");
    s.pool_frames[f] = n < 0 ? (used ? cfg.num_blocks : 0) : n;
    // The one accounting (block_bytes.hpp): codes and scales of every KV head of one block.
    const BlockBytes b = block_bytes(format, cfg.block_size, cfg.head_dim, cfg.kv_heads);
    s.frame_bytes[f] =
        static_cast<std::int64_t>(align_up(static_cast<std::size_t>(b.codes + b.scales), 256));
    s.pool_offset[f] = offset;
    offset += s.frame_bytes[f] * s.pool_frames[f];
  }
  s.storage_bytes = offset;
  const std::int64_t N = cfg.num_blocks, H = cfg.kv_heads;
  s.mask_bytes = N * H * s.mask_words * 8;
  s.position_bytes = N * H * cfg.block_size * kSlotPositionBytes;
  s.frame_offset_bytes = N * 8;
  const std::int64_t streams = static_cast<std::int64_t>(max_sequences) * kPagedThoughtTypes * H;
  s.staging_bytes =
      streams * kQuantGroupSize * cfg.head_dim * static_cast<std::int64_t>(sizeof(PagedStaging));
  s.staged_mask_bytes = streams * 4;
  s.global_factor_bytes = H * 4;
  return s;
}

DevicePagedTable::DevicePagedTable(const ThoughtBlockTableConfig& cfg, std::int32_t max_sequences,
                                   const PagedTableMemory& memory, const PagedPoolFrames& pools)
    : cfg_(cfg),
      max_sequences_(max_sequences),
      sizes_(paged_table_sizes(cfg, max_sequences, pools)),
      mem_(memory) {
  KVSIFT_CHECK(cfg_.staging == kPagedStagingDType, "DevicePagedTable: the CPU table stages in ",
               dtype_name(cfg_.staging), " but the device staging (PagedStaging) is ",
               dtype_name(kPagedStagingDType));
  KVSIFT_CHECK(mem_.storage != nullptr && mem_.free_masks != nullptr && mem_.positions != nullptr &&
                   mem_.frame_offsets != nullptr && mem_.staged_keys != nullptr &&
                   mem_.staged_values != nullptr && mem_.staged_masks != nullptr &&
                   mem_.global_factors != nullptr,
               "DevicePagedTable: every PagedTableMemory pointer must be non-null (storage ",
               static_cast<const void*>(mem_.storage), ", free_masks ",
               static_cast<const void*>(mem_.free_masks), ", positions ",
               static_cast<const void*>(mem_.positions), ", frame_offsets ",
               static_cast<const void*>(mem_.frame_offsets), ", staged_keys ",
               static_cast<const void*>(mem_.staged_keys), ", staged_values ",
               static_cast<const void*>(mem_.staged_values), ", staged_masks ",
               static_cast<const void*>(mem_.staged_masks), ", global_factors ",
               static_cast<const void*>(mem_.global_factors), ")");
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(mem_.storage) % 16 == 0,
               "DevicePagedTable: storage must be 16-byte aligned, got ",
               static_cast<const void*>(mem_.storage));
  // g = 1 for every head when none are given (ThoughtBlockTableConfig::global_factor).
  if (cfg_.global_factors.empty())
    cfg_.global_factors.assign(static_cast<std::size_t>(cfg_.kv_heads), 1.0f);
  seqs_.resize(static_cast<std::size_t>(max_sequences));
  masks_.assign(static_cast<std::size_t>(cfg_.num_blocks) * cfg_.kv_heads * sizes_.mask_words, 0);
  offsets_.assign(static_cast<std::size_t>(cfg_.num_blocks), -1);
  for (int f = 0; f < 4; ++f) {
    for (std::int32_t i = sizes_.pool_frames[f] - 1; i >= 0; --i) pool_free_[f].push_back(i);
  }
  staged_positions_.assign(static_cast<std::size_t>(max_sequences) * kPagedThoughtTypes *
                               cfg_.kv_heads * kQuantGroupSize,
                           -1);
  staged_bits_.assign(static_cast<std::size_t>(max_sequences) * kPagedThoughtTypes * cfg_.kv_heads,
                      0);
  task_of_stream_.assign(
      static_cast<std::size_t>(max_sequences) * kPagedThoughtTypes * cfg_.kv_heads, -1);
}

void DevicePagedTable::initialize(cudaStream_t stream) {
  KVSIFT_CUDA_CHECK(
      cudaMemsetAsync(mem_.free_masks, 0xff, static_cast<std::size_t>(sizes_.mask_bytes), stream));
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(mem_.positions, 0xff,
                                    static_cast<std::size_t>(sizes_.position_bytes), stream));
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(mem_.frame_offsets, 0xff,
                                    static_cast<std::size_t>(sizes_.frame_offset_bytes), stream));
  KVSIFT_CUDA_CHECK(
      cudaMemsetAsync(mem_.staged_keys, 0, static_cast<std::size_t>(sizes_.staging_bytes), stream));
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(mem_.staged_values, 0,
                                    static_cast<std::size_t>(sizes_.staging_bytes), stream));
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(mem_.staged_masks, 0,
                                    static_cast<std::size_t>(sizes_.staged_mask_bytes), stream));
  // The factors live in cfg_ for the table's lifetime, so the async copy's source stays valid.
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(mem_.global_factors, cfg_.global_factors.data(),
                                    static_cast<std::size_t>(sizes_.global_factor_bytes),
                                    cudaMemcpyHostToDevice, stream));
}

void DevicePagedTable::check_seq(std::int32_t seq, const char* fn) const {
  KVSIFT_CHECK(seq >= 0 && seq < max_sequences_, "DevicePagedTable::", fn, ": sequence ", seq,
               " outside [0, max_sequences = ", max_sequences_, ")");
}

std::uint32_t DevicePagedTable::staged_mask(std::int64_t stream) const {
  return staged_bits_[static_cast<std::size_t>(stream)];
}

SlotAddress DevicePagedTable::regroup_target(const SeqState& st, std::int32_t blocks,
                                             ThoughtType type, std::int32_t head,
                                             int& free_slots) const {
  // ThoughtBlockTable::best_pinned_run on the mirror's masks: the run with the most free slots
  // in [regroup_min_free, 15], lowest block then run on ties; none while a fully free run exists
  // (the CPU table would have sealed there).
  SlotAddress best;
  free_slots = 0;
  for (std::size_t b = 0; b < static_cast<std::size_t>(blocks); ++b) {
    if (st.pages[b].type != type) continue;
    const std::uint64_t* mask = host_mask(st.pages[b].frame, head);
    for (std::int32_t first = 0; first < cfg_.block_size; first += kQuantGroupSize) {
      const int n = __builtin_popcountll((mask[first / 64] >> (first % 64)) & 0xffffu);
      if (n == kQuantGroupSize) return SlotAddress{};
      if (n >= cfg_.regroup_min_free && n > free_slots) {
        best = SlotAddress{static_cast<std::int32_t>(b), first};
        free_slots = n;
      }
    }
  }
  if (best.block < 0) free_slots = 0;
  return best;
}

void DevicePagedTable::record_append(const ThoughtBlockTable& table, std::int32_t seq,
                                     const SlotAddress* where) {
  check_seq(seq, "record_append");
  KVSIFT_CHECK(prepared_tokens_ == 0, "DevicePagedTable::record_append: a batch of ",
               prepared_tokens_, " tokens is prepared (call append() first)");
  const ThoughtBlockTableConfig& tc = table.config();
  KVSIFT_CHECK(tc.kv_heads == cfg_.kv_heads && tc.head_dim == cfg_.head_dim &&
                   tc.block_size == cfg_.block_size && tc.num_blocks == cfg_.num_blocks &&
                   tc.reasoning == cfg_.reasoning && tc.execution == cfg_.execution &&
                   tc.transition == cfg_.transition && tc.staging == cfg_.staging &&
                   tc.refill == cfg_.refill && tc.regroup_min_free == cfg_.regroup_min_free,
               "DevicePagedTable::record_append: the CPU table's config (kv_heads ", tc.kv_heads,
               ", head_dim ", tc.head_dim, ", block_size ", tc.block_size, ", num_blocks ",
               tc.num_blocks, ") differs from the mirror's (kv_heads ", cfg_.kv_heads,
               ", head_dim ", cfg_.head_dim, ", block_size ", cfg_.block_size, ", num_blocks ",
               cfg_.num_blocks,
               ") or in block formats, staging dtype or refill rule and its regroup_min_free");
  KVSIFT_CHECK(table.has_sequence(seq), "DevicePagedTable::record_append: sequence ", seq,
               " is not active in the CPU table");
  KVSIFT_CHECK(where != nullptr, "DevicePagedTable::record_append: where must not be null");
  KVSIFT_CHECK(table.length(seq) > 0 && table.num_segments(seq) > 0,
               "DevicePagedTable::record_append: sequence ", seq,
               " has no appended token in the CPU table");
  SeqState& st = seqs_[static_cast<std::size_t>(seq)];
  const ThoughtType type = table.segment_type(seq, table.num_segments(seq) - 1);
  const BlockFormat format = cfg_.format_of(type);
  const bool quantized = is_quantized(format);
  const std::int32_t position = table.length(seq) - 1;
  const std::int32_t known = static_cast<std::int32_t>(st.pages.size());
  const std::int32_t H = cfg_.kv_heads, S = cfg_.block_size;
  const int f = static_cast<int>(format);

  // 1. Validate everything before recording anything: replay the CPU table's rule per head.
  bool takes_block = false;
  for (std::int32_t h = 0; h < H; ++h) {
    const SlotAddress a = where[h];
    int staged = 0;
    if (quantized) {
      staged = __builtin_popcount(staged_mask(stream_index(seq, static_cast<int>(type), h)));
      if (staged == kQuantGroupSize - 1 && a.block == kStagedBlock) {
        // Only a regroup leaves the 16th token staged: the mirror must see the same pinned run.
        int free_slots = 0;
        KVSIFT_CHECK(cfg_.refill == RefillRule::regroup && a.slot == position &&
                         regroup_target(st, known, type, h, free_slots).block >= 0,
                     "DevicePagedTable::record_append: kv head ", h, " of sequence ", seq,
                     " completes a group of ", thought_type_name(type), " tokens at position ",
                     position, " but the CPU table kept it staged (slot ", a.slot,
                     ") and the mirror has no pinned run to regroup (is the mirror out of step?)");
        continue;
      }
      if (staged < kQuantGroupSize - 1) {
        KVSIFT_CHECK(a.block == kStagedBlock && a.slot == position,
                     "DevicePagedTable::record_append: kv head ", h, " of sequence ", seq,
                     " holds ", staged, " staged ", thought_type_name(type),
                     " tokens, so position ", position,
                     " must be staged, but the CPU table put "
                     "it at block ",
                     a.block, " slot ", a.slot, " (is the mirror out of step?)");
        continue;
      }
    }
    KVSIFT_CHECK(a.block >= 0 && a.block <= known && a.block < table.num_blocks(seq),
                 "DevicePagedTable::record_append: kv head ", h, " block ", a.block,
                 " outside [0, ", known, "] (blocks known to the mirror; the CPU table has ",
                 table.num_blocks(seq), ")");
    KVSIFT_CHECK(a.slot >= 0 && a.slot < S, "DevicePagedTable::record_append: kv head ", h,
                 " slot ", a.slot, " outside [0, block_size = ", S, ")");
    const std::int32_t first = quantized ? a.slot - (kQuantGroupSize - 1) : a.slot;
    KVSIFT_CHECK(!quantized || a.slot % kQuantGroupSize == kQuantGroupSize - 1,
                 "DevicePagedTable::record_append: kv head ", h, " completes a ",
                 thought_type_name(type), " group, so its slot must end a 16-slot group, got ",
                 a.slot);
    if (a.block == known) {
      takes_block = true;
      continue;  // a fresh block: every slot free
    }
    const BlockRef& ref = st.pages[static_cast<std::size_t>(a.block)];
    KVSIFT_CHECK(ref.type == type, "DevicePagedTable::record_append: kv head ", h, " block ",
                 a.block, " holds ", thought_type_name(ref.type), " tokens, not ",
                 thought_type_name(type));
    const std::uint64_t* mask = host_mask(ref.frame, h);
    KVSIFT_CHECK(quantized ? run_free(mask, first) : bit_free(mask, first),
                 "DevicePagedTable::record_append: kv head ", h, " slot ", first, " of block ",
                 a.block, " of sequence ", seq,
                 quantized ? " does not start a free 16-slot run" : " is not free",
                 " in the mirror (is the mirror out of step?)");
  }
  BlockRef fresh;
  if (takes_block) {
    const BlockInfo info = table.block_info(seq, known);
    KVSIFT_CHECK(info.type == type && info.format == format,
                 "DevicePagedTable::record_append: the CPU table's new block holds ",
                 thought_type_name(info.type), " tokens, not ", thought_type_name(type));
    KVSIFT_CHECK(info.frame >= 0 && info.frame < cfg_.num_blocks &&
                     offsets_[static_cast<std::size_t>(info.frame)] < 0,
                 "DevicePagedTable::record_append: the CPU table's new block has frame ",
                 info.frame, ", which the mirror holds in use");
    KVSIFT_CHECK(!pool_free_[f].empty(), "DevicePagedTable::record_append: the ",
                 block_format_name(format), " pool is exhausted (all ", sizes_.pool_frames[f],
                 " frames are in use; sequence ", seq, " needs a new block)");
    fresh = BlockRef{info.frame, format, type};
  }

  // 2. Record.
  if (takes_block) {
    const std::int32_t index = pool_free_[f].back();
    pool_free_[f].pop_back();
    const std::int64_t offset = sizes_.pool_offset[f] + index * sizes_.frame_bytes[f];
    offsets_[static_cast<std::size_t>(fresh.frame)] = offset;
    for (std::int32_t h = 0; h < H; ++h) {
      std::uint64_t* mask = host_mask(fresh.frame, h);
      for (std::int32_t w = 0; w < sizes_.mask_words; ++w) {
        const std::int32_t bits = std::min(64, S - 64 * w);
        mask[w] = bits == 64 ? ~0ull : ((1ull << bits) - 1ull);
      }
    }
    st.pages.push_back(fresh);
    ++page_version_;
    fresh_.push_back(PagedFreshFrame{fresh.frame, f, offset});
  }
  const std::int32_t token = pending_tokens_++;
  const std::int64_t head_bytes = this->head_bytes(format);
  for (std::int32_t h = 0; h < H; ++h) {
    const SlotAddress a = where[h];
    if (!quantized) {
      const BlockRef& ref = st.pages[static_cast<std::size_t>(a.block)];
      host_mask(ref.frame, h)[a.slot / 64] &= ~(1ull << (a.slot % 64));
      rows_.push_back(
          PagedRowWrite{token, h, ref.frame, a.slot, position, 0,
                        offsets_[static_cast<std::size_t>(ref.frame)] + h * head_bytes});
      continue;
    }
    const std::int64_t stream = stream_index(seq, static_cast<int>(type), h);
    std::int32_t* rows = &staged_positions_[static_cast<std::size_t>(stream) * kQuantGroupSize];
    std::uint32_t& bits = staged_bits_[static_cast<std::size_t>(stream)];
    // Only a regroup leaves the 16th token staged (rows freed by earlier regroups may lie
    // anywhere, so count them).
    const bool regroups =
        a.block == kStagedBlock && __builtin_popcount(bits) == kQuantGroupSize - 1;
    // The lowest free row (one exists: < 16 staged); kept in a register, not in `op`, until the
    // op is complete.
    std::int32_t row = 0;
    while ((bits >> row) & 1u) ++row;
    rows[row] = position;
    bits |= 1u << row;
    std::int32_t sealed = -1;
    if (regroups) {  // the f oldest staged tokens go into the pinned run's free slots
      int free_slots = 0;
      // Among the blocks before this token's: a block it took is for the other heads only.
      const SlotAddress run = regroup_target(st, known, type, h, free_slots);
      const BlockRef& ref = st.pages[static_cast<std::size_t>(run.block)];
      PagedSeal seal{};
      seal.frame = ref.frame;
      seal.first_slot = run.slot;
      seal.format = f;
      seal.regroup = 1;
      seal.base = offsets_[static_cast<std::size_t>(ref.frame)] + h * head_bytes;
      std::int32_t by_position[kQuantGroupSize];
      rows_by_position(rows, by_position);
      std::uint64_t* mask = host_mask(ref.frame, h);
      int next = 0;
      for (int i = 0; i < kQuantGroupSize; ++i) {
        seal.order[i] = seal.positions[i] = -1;
        if (!bit_free(mask, run.slot + i)) continue;
        const std::int32_t r = by_position[next++];
        seal.order[i] = r;
        seal.positions[i] = rows[r];
      }
      for (int i = 0; i < free_slots; ++i) {
        rows[by_position[i]] = -1;
        bits &= ~(1u << by_position[i]);
      }
      mask[run.slot / 64] &= ~(0xffffull << (run.slot % 64));
      sealed = static_cast<std::int32_t>(seals_.size());
      seals_.push_back(seal);
    } else if (a.block != kStagedBlock) {  // the 16th token: the group is sealed into its run
      const BlockRef& ref = st.pages[static_cast<std::size_t>(a.block)];
      PagedSeal seal{};
      seal.frame = ref.frame;
      seal.first_slot = a.slot - (kQuantGroupSize - 1);
      seal.format = f;
      seal.base = offsets_[static_cast<std::size_t>(ref.frame)] + h * head_bytes;
      rows_by_position(rows, seal.order);
      for (int i = 0; i < kQuantGroupSize; ++i) seal.positions[i] = rows[seal.order[i]];
      std::fill_n(rows, kQuantGroupSize, -1);
      bits = 0;
      host_mask(ref.frame, h)[seal.first_slot / 64] &= ~(0xffffull << (seal.first_slot % 64));
      sealed = static_cast<std::int32_t>(seals_.size());
      seals_.push_back(seal);
    }
    // A dense stream -> task index instead of a map: no allocation per recorded token.
    std::int32_t& task = task_of_stream_[static_cast<std::size_t>(stream)];
    if (task < 0) {
      task = static_cast<std::int32_t>(task_streams_.size());
      task_streams_.push_back(stream);
    }
    op_task_.push_back(task);
    ops_.push_back(PagedStreamOp{token, row, sealed});
  }
}

std::size_t DevicePagedTable::append_workspace_bytes() const {
  if (prepared_tokens_ > 0) return prepared_bytes_;
  return plan_layout(fresh_.size(), rows_.size(), task_streams_.size(), ops_.size(), seals_.size())
      .end;
}

void DevicePagedTable::prepare_append() {
  KVSIFT_CHECK(prepared_tokens_ == 0, "DevicePagedTable::prepare_append: a batch of ",
               prepared_tokens_, " tokens is already prepared (call append() first)");
  if (pending_tokens_ == 0) return;
  // The buffer first (the only step that can fail): the recording is intact on error.
  std::uint8_t* to = upload_.fill(append_workspace_bytes());
  const std::int32_t tokens = pending_tokens_;
  const detail::PagedAppendPlan& plan = take_append_plan();
  const PlanLayout at = plan_layout(plan);
  pack(to + at.fresh, plan.fresh);
  pack(to + at.rows, plan.rows);
  pack(to + at.tasks, plan.tasks);
  pack(to + at.ops, plan.ops);
  pack(to + at.seals, plan.seals);
  prepared_tokens_ = tokens;
  prepared_bytes_ = at.end;
}

void DevicePagedTable::append(const void* key, const void* value, DType dtype, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream) {
  KVSIFT_CHECK(dtype == DType::f32 || dtype == DType::bf16,
               "DevicePagedTable::append: key/value dtype must be f32 or bf16, got ",
               dtype_name(dtype));
  if (pending_tokens() == 0) return;
  KVSIFT_CHECK(key != nullptr && value != nullptr, "DevicePagedTable::append: ", pending_tokens(),
               " tokens are recorded but key or value is null");
  const std::size_t need = append_workspace_bytes();
  KVSIFT_CHECK(workspace_bytes >= need, "DevicePagedTable::append: workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  if (prepared_tokens_ == 0) prepare_append();
  // The whole plan in one copy from pinned memory, so the call does not wait for it.
  const detail::PagedAppendPlan& plan = plan_;
  const PlanLayout at = plan_layout(plan);
  WorkspaceCarver carver(workspace, workspace_bytes, "DevicePagedTable::append");
  std::uint8_t* d = carver.take<std::uint8_t>(at.end);
  upload_.copy_to(d, at.end, stream);
  prepared_tokens_ = 0;
  const auto* d_fresh = reinterpret_cast<const PagedFreshFrame*>(d + at.fresh);
  const auto* d_rows = reinterpret_cast<const PagedRowWrite*>(d + at.rows);
  const auto* d_tasks = reinterpret_cast<const PagedStreamTask*>(d + at.tasks);
  const auto* d_ops = reinterpret_cast<const PagedStreamOp*>(d + at.ops);
  const auto* d_seals = reinterpret_cast<const PagedSeal*>(d + at.seals);
  if (!plan.fresh.empty()) {
    init_frames_kernel<<<static_cast<unsigned>(plan.fresh.size()), kThreads, 0, stream>>>(
        mem_.storage, mem_.free_masks, mem_.positions, mem_.frame_offsets, cfg_.kv_heads,
        cfg_.block_size, sizes_.mask_words, detail::paged_layouts(cfg_), d_fresh);
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
  const int n_tasks = static_cast<int>(plan.tasks.size());
  if (dtype == DType::f32) {
    launch_append(*this, static_cast<const float*>(key), static_cast<const float*>(value),
                  plan.rows, d_rows, n_tasks, d_tasks, d_ops, d_seals, stream);
  } else {
    launch_append(*this, static_cast<const bf16_t*>(key), static_cast<const bf16_t*>(value),
                  plan.rows, d_rows, n_tasks, d_tasks, d_ops, d_seals, stream);
  }
}

const detail::PagedAppendPlan& DevicePagedTable::take_append_plan() {
  detail::PagedAppendPlan& p = plan_;
  // Each stream's ops contiguous, in recording order (a counting sort by task).
  p.tasks.resize(task_streams_.size());
  for (std::size_t t = 0; t < p.tasks.size(); ++t) {
    const std::int64_t s = task_streams_[t];
    p.tasks[t] =
        PagedStreamTask{s, static_cast<std::int32_t>(s % cfg_.kv_heads), 0, 0, staged_mask(s)};
  }
  for (const std::int32_t t : op_task_) ++p.tasks[static_cast<std::size_t>(t)].count;
  for (std::size_t t = 1; t < p.tasks.size(); ++t)
    p.tasks[t].first = p.tasks[t - 1].first + p.tasks[t - 1].count;
  p.ops.resize(ops_.size());
  next_op_.resize(p.tasks.size());
  for (std::size_t t = 0; t < p.tasks.size(); ++t) next_op_[t] = p.tasks[t].first;
  for (std::size_t o = 0; o < ops_.size(); ++o) p.ops[next_op_[op_task_[o]]++] = ops_[o];
  // The rest moves over as recorded; the recording keeps the plan's old buffers, emptied.
  p.fresh.swap(fresh_);
  p.rows.swap(rows_);
  p.seals.swap(seals_);
  pending_tokens_ = 0;
  fresh_.clear();
  rows_.clear();
  for (const std::int64_t s : task_streams_) task_of_stream_[static_cast<std::size_t>(s)] = -1;
  task_streams_.clear();
  ops_.clear();
  op_task_.clear();
  seals_.clear();
  return p;
}

std::size_t DevicePagedTable::evict_workspace_bytes(std::size_t count) const {
  return bytes_of<PagedEviction>(count) + bytes_of<PagedStagedMask>(count);
}

void DevicePagedTable::release_frame(std::int32_t frame, BlockFormat format) {
  const int f = static_cast<int>(format);
  std::int64_t& offset = offsets_[static_cast<std::size_t>(frame)];
  const std::int32_t index =
      static_cast<std::int32_t>((offset - sizes_.pool_offset[f]) / sizes_.frame_bytes[f]);
  offset = -1;
  // Kept sorted with the lowest index on top (back), as the CPU pool.
  std::vector<std::int32_t>& pool = pool_free_[f];
  pool.insert(std::upper_bound(pool.begin(), pool.end(), index,
                               [](std::int32_t x, std::int32_t y) { return x > y; }),
              index);
}

void DevicePagedTable::evict(std::int32_t seq, std::int32_t head,
                             const std::vector<SlotAddress>& slots, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream) {
  std::vector<EvictionSlot> batch;
  batch.reserve(slots.size());
  for (const SlotAddress& a : slots) batch.push_back(EvictionSlot{seq, head, a});
  evict_slots(batch, workspace, workspace_bytes, stream);
}

void DevicePagedTable::evict_slots(const std::vector<EvictionSlot>& slots, void* workspace,
                                   std::size_t workspace_bytes, cudaStream_t stream) {
  KVSIFT_CHECK(pending_tokens() == 0, "DevicePagedTable::evict: ", pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  KVSIFT_CHECK(workspace_bytes >= evict_workspace_bytes(slots.size()),
               "DevicePagedTable::evict: workspace of ", workspace_bytes, " bytes is too small (",
               evict_workspace_bytes(slots.size()), " needed)");
  enqueue_evictions(apply_evictions(slots), workspace, workspace_bytes, stream);
}

DevicePagedTable::DeviceEvictions DevicePagedTable::apply_evictions(
    const std::vector<EvictionSlot>& slots) {
  KVSIFT_CHECK(pending_tokens() == 0, "DevicePagedTable::evict: ", pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  // 1. Sequences, heads and addresses; staged tokens found, none listed twice.
  std::vector<PagedEviction> list;
  std::vector<std::pair<std::int64_t, int>> staged;  // (stream, row)
  std::vector<std::int32_t> touched;                 // sequences, in runs
  list.reserve(slots.size());
  for (const EvictionSlot& e : slots) {
    check_seq(e.seq, "evict");
    KVSIFT_CHECK(e.head >= 0 && e.head < cfg_.kv_heads, "DevicePagedTable::evict: kv head ", e.head,
                 " outside [0, ", cfg_.kv_heads, ")");
    if (touched.empty() || touched.back() != e.seq) touched.push_back(e.seq);
    const SlotAddress& a = e.address;
    if (a.block == kStagedBlock) {
      bool found = false;
      for (int t = 0; t < kPagedThoughtTypes && !found; ++t) {
        const std::int64_t s = stream_index(e.seq, t, e.head);
        for (int r = 0; r < kQuantGroupSize && !found; ++r) {
          found = staged_positions_[static_cast<std::size_t>(s) * kQuantGroupSize + r] == a.slot;
          if (found) staged.emplace_back(s, r);
        }
      }
      KVSIFT_CHECK(found, "DevicePagedTable::evict: position ", a.slot,
                   " is not staged in kv head ", e.head, " of sequence ", e.seq);
      continue;
    }
    const SeqState& st = seqs_[static_cast<std::size_t>(e.seq)];
    KVSIFT_CHECK(a.block >= 0 && a.block < static_cast<std::int32_t>(st.pages.size()),
                 "DevicePagedTable::evict: block ", a.block, " of sequence ", e.seq,
                 " outside [0, ", st.pages.size(), ")");
    KVSIFT_CHECK(a.slot >= 0 && a.slot < cfg_.block_size, "DevicePagedTable::evict: slot ", a.slot,
                 " outside [0, block_size = ", cfg_.block_size, ")");
    list.push_back(
        PagedEviction{st.pages[static_cast<std::size_t>(a.block)].frame, e.head, a.slot});
  }
  std::sort(staged.begin(), staged.end());
  KVSIFT_CHECK(std::adjacent_find(staged.begin(), staged.end()) == staged.end(),
               "DevicePagedTable::evict: a staged token is listed twice");
  // 2. Apply on the host: each slot's bit, found live as it is set (so a slot listed twice finds
  // its own bit; on an error the bits set so far are cleared again and nothing has changed); the
  // staged rows; then the blocks left empty in every head go back to their pools.
  for (std::size_t i = 0; i < list.size(); ++i) {
    const PagedEviction& e = list[i];
    std::uint64_t& word = host_mask(e.frame, e.head)[e.slot / 64];
    const std::uint64_t bit = 1ull << (e.slot % 64);
    if (word & bit) {
      for (std::size_t j = 0; j < i; ++j)
        host_mask(list[j].frame, list[j].head)[list[j].slot / 64] &= ~(1ull << (list[j].slot % 64));
      KVSIFT_CHECK(false, "DevicePagedTable::evict: slot ", e.slot, " of frame ", e.frame,
                   " in kv head ", e.head,
                   " is not live (already evicted, never written, or listed twice)");
    }
    word |= bit;
  }
  DeviceEvictions out;
  out.slots = std::move(list);
  std::vector<PagedStagedMask>& masks = out.staged;
  for (const auto& sr : staged) {
    staged_positions_[static_cast<std::size_t>(sr.first) * kQuantGroupSize + sr.second] = -1;
    staged_bits_[static_cast<std::size_t>(sr.first)] &= ~(1u << sr.second);
  }
  for (std::size_t i = 0; i < staged.size(); ++i) {  // sorted: one mask per stream
    if (i == 0 || staged[i].first != staged[i - 1].first) {
      masks.push_back(PagedStagedMask{staged[i].first, staged_mask(staged[i].first)});
    }
  }
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (const std::int32_t seq : touched) release_empty_blocks(seq);
  return out;
}

// 3. The device: bits and staged masks, as many per launch as the workspace holds (the bits are
// independent: pieces in any order give the same masks).
void DevicePagedTable::enqueue_evictions(const DeviceEvictions& e, void* workspace,
                                         std::size_t workspace_bytes, cudaStream_t stream) {
  const std::size_t total = std::max(e.slots.size(), e.staged.size());
  if (total == 0) return;
  KVSIFT_CHECK(evict_workspace_bytes(1) <= workspace_bytes,
               "DevicePagedTable::evict: workspace of ", workspace_bytes, " bytes is too small (",
               evict_workspace_bytes(1), " needed at least)");
  std::size_t piece = 1;  // the largest count whose workspace fits
  while (piece < total && evict_workspace_bytes(2 * piece) <= workspace_bytes) piece *= 2;
  for (std::size_t first = 0; first < total; first += piece) {
    const auto count = [&](std::size_t size) {
      return first < size ? std::min(piece, size - first) : std::size_t{0};
    };
    const std::size_t n = count(e.slots.size()), n_staged = count(e.staged.size());
    WorkspaceCarver carver(workspace, workspace_bytes, "DevicePagedTable::evict");
    const PagedEviction* d_list =
        upload(carver, e.slots.data() + std::min(first, e.slots.size()), n, stream);
    const PagedStagedMask* d_staged =
        upload(carver, e.staged.data() + std::min(first, e.staged.size()), n_staged, stream);
    evict_kernel<<<static_cast<unsigned>((n + n_staged + kThreads - 1) / kThreads), kThreads, 0,
                   stream>>>(mem_.free_masks, mem_.staged_masks, cfg_.kv_heads, sizes_.mask_words,
                             d_list, static_cast<int>(n), d_staged, static_cast<int>(n_staged));
    KVSIFT_CUDA_CHECK(cudaGetLastError());
  }
}

// Returns the blocks of `seq` left with no live slot in any head to their pools.
void DevicePagedTable::release_empty_blocks(std::int32_t seq) {
  SeqState& st = seqs_[static_cast<std::size_t>(seq)];
  std::vector<BlockRef> kept;
  for (const BlockRef& ref : st.pages) {
    bool empty = true;
    for (std::int32_t h = 0; h < cfg_.kv_heads && empty; ++h) {
      const std::uint64_t* mask = host_mask(ref.frame, h);
      for (std::int32_t w = 0; w < sizes_.mask_words && empty; ++w) {
        const std::int32_t bits = std::min(64, cfg_.block_size - 64 * w);
        empty = mask[w] == (bits == 64 ? ~0ull : ((1ull << bits) - 1ull));
      }
    }
    if (empty) {
      release_frame(ref.frame, ref.format);  // the device frame is re-initialised when reused
    } else {
      kept.push_back(ref);
    }
  }
  if (kept.size() != st.pages.size()) ++page_version_;
  st.pages.swap(kept);
}

void DevicePagedTable::release_sequence(std::int32_t seq, cudaStream_t stream) {
  check_seq(seq, "release_sequence");
  KVSIFT_CHECK(pending_tokens() == 0, "DevicePagedTable::release_sequence: ", pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  SeqState& st = seqs_[static_cast<std::size_t>(seq)];
  for (const BlockRef& ref : st.pages) release_frame(ref.frame, ref.format);
  if (!st.pages.empty()) ++page_version_;
  st = SeqState{};
  const std::int64_t first = stream_index(seq, 0, 0);
  const std::int64_t streams = static_cast<std::int64_t>(kPagedThoughtTypes) * cfg_.kv_heads;
  std::fill_n(staged_positions_.begin() + first * kQuantGroupSize, streams * kQuantGroupSize, -1);
  std::fill_n(staged_bits_.begin() + first, streams, 0u);
  KVSIFT_CUDA_CHECK(
      cudaMemsetAsync(mem_.staged_masks + first, 0, static_cast<std::size_t>(streams) * 4, stream));
}

std::int32_t DevicePagedTable::num_blocks(std::int32_t seq) const {
  check_seq(seq, "num_blocks");
  return static_cast<std::int32_t>(seqs_[static_cast<std::size_t>(seq)].pages.size());
}

std::int32_t DevicePagedTable::frame_of(std::int32_t seq, std::int32_t block) const {
  KVSIFT_CHECK(block >= 0 && block < num_blocks(seq), "DevicePagedTable::frame_of: block ", block,
               " of sequence ", seq, " outside [0, ", num_blocks(seq), ")");
  return seqs_[static_cast<std::size_t>(seq)].pages[static_cast<std::size_t>(block)].frame;
}

BlockFormat DevicePagedTable::format_of_block(std::int32_t seq, std::int32_t block) const {
  frame_of(seq, block);
  return seqs_[static_cast<std::size_t>(seq)].pages[static_cast<std::size_t>(block)].format;
}

ThoughtType DevicePagedTable::type_of_block(std::int32_t seq, std::int32_t block) const {
  frame_of(seq, block);
  return seqs_[static_cast<std::size_t>(seq)].pages[static_cast<std::size_t>(block)].type;
}

std::int64_t DevicePagedTable::block_offset(std::int32_t seq, std::int32_t block) const {
  return offsets_[static_cast<std::size_t>(frame_of(seq, block))];
}

PagedKeySource DevicePagedTable::key_source(std::int32_t seq, std::int32_t head,
                                            SlotAddress a) const {
  check_seq(seq, "key_source");
  KVSIFT_CHECK(head >= 0 && head < cfg_.kv_heads, "DevicePagedTable::key_source: kv head ", head,
               " outside [0, ", cfg_.kv_heads, ")");
  KVSIFT_CHECK(pending_tokens() == 0, "DevicePagedTable::key_source: ", pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  PagedKeySource src;
  src.head = head;
  if (a.block == kStagedBlock) {
    for (int t = 0; t < kPagedThoughtTypes; ++t) {
      const std::int64_t s = stream_index(seq, t, head);
      for (int r = 0; r < kQuantGroupSize; ++r) {
        if (staged_positions_[static_cast<std::size_t>(s) * kQuantGroupSize + r] == a.slot) {
          src.base = (s * kQuantGroupSize + r) * cfg_.head_dim;
          return src;
        }
      }
    }
    KVSIFT_CHECK(false, "DevicePagedTable::key_source: position ", a.slot,
                 " is not staged in kv head ", head, " of sequence ", seq);
  }
  const SeqState& st = seqs_[static_cast<std::size_t>(seq)];
  KVSIFT_CHECK(a.block >= 0 && a.block < static_cast<std::int32_t>(st.pages.size()) &&
                   a.slot >= 0 && a.slot < cfg_.block_size,
               "DevicePagedTable::key_source: block ", a.block, " slot ", a.slot, " of sequence ",
               seq, " outside [0, ", st.pages.size(), ") x [0, block_size = ", cfg_.block_size,
               ")");
  const BlockRef& ref = st.pages[static_cast<std::size_t>(a.block)];
  KVSIFT_CHECK(!bit_free(host_mask(ref.frame, head), a.slot), "DevicePagedTable::key_source: slot ",
               a.slot, " of block ", a.block, " in kv head ", head, " of sequence ", seq,
               " is not live");
  src.base = offsets_[static_cast<std::size_t>(ref.frame)] + head * head_bytes(ref.format);
  src.format = static_cast<std::int32_t>(ref.format);
  src.slot = a.slot;
  return src;
}

int DevicePagedTable::staged_count(std::int32_t seq, ThoughtType type, std::int32_t head) const {
  check_seq(seq, "staged_count");
  KVSIFT_CHECK(head >= 0 && head < cfg_.kv_heads, "DevicePagedTable::staged_count: kv head ", head,
               " outside [0, ", cfg_.kv_heads, ")");
  return __builtin_popcount(staged_mask(stream_index(seq, static_cast<int>(type), head)));
}

std::int32_t DevicePagedTable::used_frames(BlockFormat format) const {
  const int f = static_cast<int>(format);
  return sizes_.pool_frames[f] - static_cast<std::int32_t>(pool_free_[f].size());
}

TableBytes DevicePagedTable::resident_bytes(const ThoughtBlockTable& table) const {
  TableBytes out;
  bool any_nvfp4 = false;
  const bool stages =
      is_quantized(cfg_.reasoning) || is_quantized(cfg_.execution) || is_quantized(cfg_.transition);
  for (std::int32_t seq = 0; seq < max_sequences_; ++seq) {
    const SeqState& st = seqs_[static_cast<std::size_t>(seq)];
    if (!table.has_sequence(seq)) continue;
    for (const BlockRef& ref : st.pages) {
      const BlockBytes b = block_bytes(ref.format, cfg_.block_size, cfg_.head_dim, cfg_.kv_heads);
      out.codes += b.codes;
      out.scales += b.scales;
      out.metadata += b.metadata;
      any_nvfp4 = any_nvfp4 || ref.format == BlockFormat::nvfp4;
    }
    out.metadata +=
        page_table_bytes(static_cast<std::int64_t>(st.pages.size()), table.num_segments(seq));
    if (stages) out.staging += staging_bytes(cfg_.kv_heads, cfg_.head_dim);
  }
  if (any_nvfp4) out.metadata += global_factor_bytes(cfg_.kv_heads);
  return out;
}

}  // namespace kvsift::cuda
