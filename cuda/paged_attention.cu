// The tiled decode attention over the device Continuous Thinking table (docs/algorithms.md §3.4),
// kept as the fallback of cuda/paged_attention_split.cu (f32 blocks, GQA groups > 8, other
// head_dims) and as the "old" column of the benchmark, and the same body over a dense bf16 cache.
//
// Split-KV (flash-decoding): CTA (KV head h, split s) walks its run of 32-slot tiles. For each
// tile with a live slot it dequantizes keys and values into shared memory (per the block's
// format), computes the logits of the GQA group's query heads, and folds them into a running
// max / sum / accumulator (online softmax, FlashAttention). Evicted and never-written slots get
// logit −inf and weight exactly 0, and their (stale) data is never multiplied in. The sequence's
// staged tokens (16-bit keys and values waiting for their 16-token group, §3.4) are three more
// units after the blocks' tiles, one per thought type, read in fp32 from the staging rows (exact),
// their live rows given by the staged mask. A second kernel merges the splits per query head. Every
// reduction runs in a fixed order, so results are deterministic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/quant/group_codec.hpp"

namespace kvsift::cuda {
namespace {

using detail::PagedHeadLayout;
using detail::PagedLayouts;

constexpr int kThreads = 128;  // 4 warps
constexpr int kTile = 32;      // slots per tile: one warp lane per slot in the softmax step
constexpr int kMaxHeadDim = 256;
constexpr std::size_t kMaxSharedBytes = 227 * 1024;  // Hopper's per-block opt-in limit

__device__ __forceinline__ unsigned low_bits(int n) {
  return n >= 32 ? 0xffffffffu : ((1u << n) - 1u);
}

// Copies one group's packed codes (cb = 4, 8 or 16 bytes, naturally aligned: every section of a
// (block, head) is a multiple of 16 bytes) into registers with one vector load.
__device__ __forceinline__ void load_codes(const std::uint8_t* p, int cb, std::uint8_t* out) {
  if (cb == 16) {
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(p);
  } else if (cb == 8) {
    *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(p);
  } else {
    *reinterpret_cast<std::uint32_t*>(out) = *reinterpret_cast<const std::uint32_t*>(p);
  }
}

// Tiles of the CT table: unit u < block_units = (block u / tiles_per_block, tile u %
// tiles_per_block); unit block_units + t = the staged rows of thought type t.
struct PagedTiles {
  const std::uint8_t* storage;
  const std::int64_t* frame_offsets;  // [num_blocks] byte offset of each frame in storage
  const std::uint64_t* masks;         // [num_blocks, kv_heads, mask_words]
  const PagedStaging* staged_keys;    // this sequence's [3 types, kv_heads, 16, head_dim]
  const PagedStaging* staged_values;  // this sequence's [3 types, kv_heads, 16, head_dim]
  const std::uint32_t* staged_masks;  // this sequence's [3 types, kv_heads]
  const float* global_factors;        // [kv_heads]
  const std::int32_t* frames;         // [blocks] page table
  const std::int32_t* meta;           // [blocks] format | type << 4
  PagedLayouts layouts;
  int kv_heads, block_size, head_dim, mask_words, tiles_per_block, block_units;

  __device__ unsigned live(int unit, int h, int* n) const {
    if (unit >= block_units) {  // staged rows: bit r = row r holds a token
      *n = 16;
      return staged_masks[(unit - block_units) * kv_heads + h] & 0xffffu;
    }
    const int block = unit / tiles_per_block, start = (unit % tiles_per_block) * kTile;
    *n = min(kTile, block_size - start);
    const std::int64_t frame = frames[block];
    const std::uint64_t word = masks[(frame * kv_heads + h) * mask_words + start / 64];
    return ~static_cast<unsigned>(word >> (start % 64)) & low_bits(*n);  // free bit = 1
  }

  // keys -> sK [n, head_dim + 1] (padded: conflict-free row reads), values -> sV [n, head_dim]
  __device__ void load(int unit, int h, int n, float* sK, float* sV) const {
    const int D = head_dim, Dp = D + 1;
    if (unit >= block_units) {  // 16-bit staged rows, exact in fp32
      const std::int64_t row0 = static_cast<std::int64_t>((unit - block_units) * kv_heads + h) * 16;
      const PagedStaging* k = staged_keys + row0 * D;
      const PagedStaging* v = staged_values + row0 * D;
      for (int idx = threadIdx.x; idx < 16 * D; idx += blockDim.x) {
        const int i = idx / D, d = idx % D;
        sK[i * Dp + d] = to_float(k[idx]);
        sV[idx] = to_float(v[idx]);
      }
      return;
    }
    const int block = unit / tiles_per_block, start = (unit % tiles_per_block) * kTile;
    const std::int64_t frame = frames[block];
    const int format = meta[block] & 0xf;
    const PagedHeadLayout& L = layouts.by_format[format];
    const std::uint8_t* base = storage + frame_offsets[frame] + h * L.head_bytes;
    if (static_cast<BlockFormat>(format) == BlockFormat::f32) {
      const float* k = reinterpret_cast<const float*>(base) + static_cast<std::int64_t>(start) * D;
      const float* v = reinterpret_cast<const float*>(base + L.value_codes) +
                       static_cast<std::int64_t>(start) * D;
      for (int idx = threadIdx.x; idx < n * D; idx += blockDim.x) {
        const int i = idx / D, d = idx % D;
        sK[i * Dp + d] = k[idx];
        sV[idx] = v[idx];
      }
      return;
    }
    const QuantFormat q = quant_format_of(static_cast<BlockFormat>(format));
    const float gf = global_factors[h];
    alignas(16) std::uint8_t codes[16];
    // Keys: groups of 16 slots of one channel (KIVI per-channel). Every group in a block is a
    // whole one (§3.4); never-written groups are zero bytes (masked anyway).
    for (int k = threadIdx.x; k < (n / 16) * D; k += blockDim.x) {
      const int local = k / D, c = k % D, sg = start / 16 + local;
      float* dst = sK + local * 16 * Dp + c;
      const std::int64_t g = static_cast<std::int64_t>(sg) * D + c;
      load_codes(base + g * L.code_bytes, L.code_bytes, codes);
      dequantize_group(q, codes, base[L.key_scales + g], gf, 16, dst, Dp);
    }
    // Values: groups of 16 channels of one slot (per token).
    const int per_token = D / 16;
    for (int k = threadIdx.x; k < n * per_token; k += blockDim.x) {
      const int s = k / per_token, cb = k % per_token;
      const std::int64_t g = static_cast<std::int64_t>(start + s) * per_token + cb;
      load_codes(base + L.value_codes + g * L.code_bytes, L.code_bytes, codes);
      dequantize_group(q, codes, base[L.value_scales + g], gf, 16, sV + s * D + cb * 16, 1);
    }
  }
};

// Tiles of a dense bf16 cache [kv_heads, tokens, head_dim]: unit u = tokens 32u .. 32u + 31.
struct DenseBf16Tiles {
  const bf16_t* keys;
  const bf16_t* values;
  std::int64_t tokens;
  int head_dim;

  __device__ unsigned live(int unit, int, int* n) const {
    const std::int64_t left = tokens - static_cast<std::int64_t>(unit) * kTile;
    *n = left < kTile ? static_cast<int>(left) : kTile;
    return low_bits(*n);
  }
  __device__ void load(int unit, int h, int n, float* sK, float* sV) const {
    const int D = head_dim, Dp = D + 1, pairs = D / 2;
    const std::int64_t row0 =
        static_cast<std::int64_t>(h) * tokens + static_cast<std::int64_t>(unit) * kTile;
    const std::uint32_t* k = reinterpret_cast<const std::uint32_t*>(keys + row0 * D);
    const std::uint32_t* v = reinterpret_cast<const std::uint32_t*>(values + row0 * D);
    for (int idx = threadIdx.x; idx < n * pairs; idx += blockDim.x) {
      const int i = idx / pairs, d = 2 * (idx % pairs);
      const std::uint32_t kk = k[idx], vv = v[idx];
      sK[i * Dp + d] = bf16_bits_to_float(static_cast<std::uint16_t>(kk & 0xffffu));
      sK[i * Dp + d + 1] = bf16_bits_to_float(static_cast<std::uint16_t>(kk >> 16));
      sV[i * D + d] = bf16_bits_to_float(static_cast<std::uint16_t>(vv & 0xffffu));
      sV[i * D + d + 1] = bf16_bits_to_float(static_cast<std::uint16_t>(vv >> 16));
    }
  }
};

std::size_t shared_bytes(int group, int head_dim) {
  const std::size_t floats = static_cast<std::size_t>(group) * head_dim * 2 +        // sQ, sAcc
                             static_cast<std::size_t>(kTile) * (2 * head_dim + 1) +  // sK, sV
                             static_cast<std::size_t>(group) * kTile +               // sP
                             static_cast<std::size_t>(group) * 3;  // max, sum, rescale
  return floats * sizeof(float);
}

// Grid (kv_heads, splits), kThreads threads. Partial results per (split, query head):
// acc = Σ_live exp(logit − m)·v (unnormalised), m = running max, l = Σ exp(logit − m).
template <class Tiles>
__global__ void __launch_bounds__(kThreads)
    decode_attention_kernel(Tiles tiles, const float* __restrict__ query,  // [q_heads, D]
                            int group, int head_dim, float softmax_scale, int units,
                            int units_per_split,
                            float* __restrict__ part_acc,   // [splits, q_heads, D]
                            float* __restrict__ part_ml) {  // [splits, q_heads, 2]
  extern __shared__ float smem[];
  const int D = head_dim, Dp = D + 1, h = blockIdx.x, split = blockIdx.y;
  const int q_heads = gridDim.x * group;
  float* sQ = smem;                // [G, D]
  float* sAcc = sQ + group * D;    // [G, D]
  float* sK = sAcc + group * D;    // [kTile, D + 1]
  float* sV = sK + kTile * Dp;     // [kTile, D]
  float* sP = sV + kTile * D;      // [G, kTile]
  float* sM = sP + group * kTile;  // [G]
  float* sL = sM + group;          // [G]
  float* sR = sL + group;          // [G]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    sQ[i] = query[static_cast<std::int64_t>(h) * group * D + i];
    sAcc[i] = 0.0f;
  }
  for (int g = threadIdx.x; g < group; g += blockDim.x) {
    sM[g] = -INFINITY;
    sL[g] = 0.0f;
  }
  __syncthreads();
  const int u0 = split * units_per_split, u1 = min(units, u0 + units_per_split);
  for (int u = u0; u < u1; ++u) {
    int n = 0;
    const unsigned live = tiles.live(u, h, &n);  // the same in every thread
    if (live == 0) continue;
    tiles.load(u, h, n, sK, sV);
    __syncthreads();
    // Logits: one (query head, slot) pair per thread; dead slots get −inf.
    for (int p = threadIdx.x; p < group * kTile; p += blockDim.x) {
      const int g = p / kTile, i = p % kTile;
      float logit = -INFINITY;
      if ((live >> i) & 1u) {
        const float* qv = sQ + g * D;
        const float* kv = sK + i * Dp;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qv[d] * kv[d];
        logit = dot * softmax_scale;
      }
      sP[p] = logit;
    }
    __syncthreads();
    // Online softmax, one warp per query head, one lane per slot.
    for (int g = warp; g < group; g += warps) {
      const float x = sP[g * kTile + lane];
      float mx = x;
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = sM[g], m_new = fmaxf(m_old, mx);  // finite: the tile has a live slot
      const float p = ((live >> lane) & 1u) ? expf(x - m_new) : 0.0f;
      float sum = p;
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      sP[g * kTile + lane] = p;
      // Lane 0 rewrites sM[g], which every lane read as m_old above: the shuffles exchange
      // registers only, so without this barrier (independent thread scheduling) nothing orders
      // another lane's read before lane 0's write.
      __syncwarp();
      if (lane == 0) {
        const float r = expf(m_old - m_new);  // 0 for the first live tile (m_old = −inf)
        sR[g] = r;
        sL[g] = sL[g] * r + sum;
        sM[g] = m_new;
      }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < group * D; p += blockDim.x) {
      const int g = p / D, d = p % D;
      float a = sAcc[p] * sR[g];
      for (int i = 0; i < n; ++i) {
        const float w = sP[g * kTile + i];
        if (w > 0.0f) a += w * sV[i * D + d];  // dead slots' stale data never enters
      }
      sAcc[p] = a;
    }
    __syncthreads();
  }
  for (int p = threadIdx.x; p < group * D; p += blockDim.x) {
    const int g = p / D;
    part_acc[(static_cast<std::int64_t>(split) * q_heads + h * group + g) * D + p % D] = sAcc[p];
  }
  for (int g = threadIdx.x; g < group; g += blockDim.x) {
    const std::int64_t o = (static_cast<std::int64_t>(split) * q_heads + h * group + g) * 2;
    part_ml[o] = sM[g];
    part_ml[o + 1] = sL[g];
  }
}

// One CTA per query head: out = Σ_s acc_s·e^{m_s − m} / Σ_s l_s·e^{m_s − m}; zero without live.
__global__ void merge_splits_kernel(const float* __restrict__ part_acc,
                                    const float* __restrict__ part_ml, int splits, int q_heads,
                                    int head_dim, float* __restrict__ out) {  // [q_heads, D]
  const int qh = blockIdx.x;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    const std::int64_t o = (static_cast<std::int64_t>(s) * q_heads + qh) * 2;
    if (part_ml[o + 1] > 0.0f) m = fmaxf(m, part_ml[o]);
  }
  float denom = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const std::int64_t o = (static_cast<std::int64_t>(s) * q_heads + qh) * 2;
    if (part_ml[o + 1] > 0.0f) denom += part_ml[o + 1] * expf(part_ml[o] - m);
  }
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float a = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const std::int64_t o = (static_cast<std::int64_t>(s) * q_heads + qh) * 2;
      if (part_ml[o + 1] > 0.0f) {
        a += part_acc[(static_cast<std::int64_t>(s) * q_heads + qh) * head_dim + d] *
             expf(part_ml[o] - m);
      }
    }
    out[static_cast<std::int64_t>(qh) * head_dim + d] = a * inv;
  }
}

struct SplitPlan {
  int units = 0, units_per_split = 1, splits = 1;
};

SplitPlan plan_splits(std::int64_t units, std::int64_t kv_heads, const DecodeAttentionConfig& cfg) {
  SplitPlan p;
  p.units = static_cast<int>(units);
  const std::int64_t per = (units * kv_heads + cfg.target_ctas - 1) / cfg.target_ctas;
  // At most 65535 splits: the split index is gridDim.y.
  const std::int64_t at_least = (units + 65534) / 65535;
  p.units_per_split = static_cast<int>(std::max<std::int64_t>({1, per, at_least}));
  p.splits = std::max(1, (p.units + p.units_per_split - 1) / p.units_per_split);
  return p;
}

std::size_t partial_bytes(const SplitPlan& p, std::int64_t q_heads, std::int64_t head_dim) {
  return align_up(static_cast<std::size_t>(p.splits * q_heads * head_dim) * sizeof(float)) +
         align_up(static_cast<std::size_t>(p.splits * q_heads * 2) * sizeof(float));
}

void check_attention_args(const char* fn, std::int64_t kv_heads, std::int64_t q_heads,
                          std::int64_t head_dim, float softmax_scale, const float* query,
                          float* out) {
  KVSIFT_CHECK(q_heads > 0 && q_heads % kv_heads == 0, fn, ": q_heads (", q_heads,
               ") must be a positive multiple of kv_heads (", kv_heads, ")");
  KVSIFT_CHECK(head_dim > 0 && head_dim % 16 == 0 && head_dim <= kMaxHeadDim, fn, ": head_dim (",
               head_dim, ") must be a multiple of 16 in [16, ", kMaxHeadDim, "]");
  KVSIFT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0.0f, fn, ": softmax_scale (",
               softmax_scale, ") must be finite and > 0");
  KVSIFT_CHECK(query != nullptr && out != nullptr, fn, ": query and out must not be null");
  const std::size_t smem =
      shared_bytes(static_cast<int>(q_heads / kv_heads), static_cast<int>(head_dim));
  KVSIFT_CHECK(smem <= kMaxSharedBytes, fn, ": a GQA group of ", q_heads / kv_heads,
               " query heads at head_dim ", head_dim, " needs ", smem,
               " bytes of shared memory (limit ", kMaxSharedBytes, ")");
}

template <class Tiles>
void launch_decode(const Tiles& tiles, const SplitPlan& plan, std::int64_t kv_heads,
                   std::int64_t q_heads, std::int64_t head_dim, const float* query,
                   float softmax_scale, float* out, WorkspaceCarver& carver, cudaStream_t stream) {
  float* part_acc = carver.take<float>(static_cast<std::size_t>(plan.splits * q_heads * head_dim));
  float* part_ml = carver.take<float>(static_cast<std::size_t>(plan.splits * q_heads * 2));
  const int group = static_cast<int>(q_heads / kv_heads);
  const std::size_t smem = shared_bytes(group, static_cast<int>(head_dim));
  if (smem > 48 * 1024) {
    KVSIFT_CUDA_CHECK(cudaFuncSetAttribute(decode_attention_kernel<Tiles>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)));
  }
  const dim3 grid(static_cast<unsigned>(kv_heads), static_cast<unsigned>(plan.splits));
  decode_attention_kernel<Tiles><<<grid, kThreads, smem, stream>>>(
      tiles, query, group, static_cast<int>(head_dim), softmax_scale, plan.units,
      plan.units_per_split, part_acc, part_ml);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
  merge_splits_kernel<<<static_cast<unsigned>(q_heads), 128, 0, stream>>>(
      part_acc, part_ml, plan.splits, static_cast<int>(q_heads), static_cast<int>(head_dim), out);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

// The blocks' tiles, then one unit per thought type for the staged rows.
std::int64_t paged_units(const DevicePagedTable& t, std::int32_t seq) {
  const std::int64_t tiles_per_block = (t.config().block_size + kTile - 1) / kTile;
  return static_cast<std::int64_t>(t.num_blocks(seq)) * tiles_per_block + kPagedThoughtTypes;
}

}  // namespace

std::size_t paged_decode_attention_tiled_workspace_bytes(const DevicePagedTable& table,
                                                         std::int32_t seq, std::int64_t q_heads,
                                                         const DecodeAttentionConfig& cfg) {
  cfg.validate();
  const SplitPlan plan = plan_splits(paged_units(table, seq), table.config().kv_heads, cfg);
  const std::size_t blocks = static_cast<std::size_t>(table.num_blocks(seq));
  return 2 * align_up(blocks * sizeof(std::int32_t)) +
         partial_bytes(plan, q_heads, table.config().head_dim);
}

void paged_decode_attention_tiled(const DevicePagedTable& table, std::int32_t seq,
                                  const float* query, std::int64_t q_heads, std::int64_t head_dim,
                                  float softmax_scale, float* out, void* workspace,
                                  std::size_t workspace_bytes, cudaStream_t stream,
                                  const DecodeAttentionConfig& cfg) {
  cfg.validate();
  const ThoughtBlockTableConfig& tc = table.config();
  const char* fn = "cuda::paged_decode_attention_tiled";
  KVSIFT_CHECK(head_dim == tc.head_dim, fn, ": query head_dim (", head_dim,
               ") differs from the table's head_dim (", tc.head_dim, ")");
  check_attention_args(fn, tc.kv_heads, q_heads, head_dim, softmax_scale, query, out);
  KVSIFT_CHECK(table.pending_tokens() == 0, fn, ": ", table.pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  const std::size_t need = paged_decode_attention_tiled_workspace_bytes(table, seq, q_heads, cfg);
  KVSIFT_CHECK(workspace_bytes >= need, fn, ": workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  const std::int32_t blocks = table.num_blocks(seq);
  std::vector<std::int32_t> frames(static_cast<std::size_t>(blocks)),
      meta(static_cast<std::size_t>(blocks));
  for (std::int32_t b = 0; b < blocks; ++b) {
    frames[static_cast<std::size_t>(b)] = table.frame_of(seq, b);
    meta[static_cast<std::size_t>(b)] =
        static_cast<std::int32_t>(table.format_of_block(seq, b)) |
        (static_cast<std::int32_t>(table.type_of_block(seq, b)) << 4);
  }
  WorkspaceCarver carver(workspace, workspace_bytes, fn);
  std::int32_t* d_frames = carver.take<std::int32_t>(frames.size());
  std::int32_t* d_meta = carver.take<std::int32_t>(meta.size());
  if (blocks > 0) {
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_frames, frames.data(), frames.size() * 4,
                                      cudaMemcpyHostToDevice, stream));
    KVSIFT_CUDA_CHECK(
        cudaMemcpyAsync(d_meta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, stream));
  }
  const PagedTableMemory& m = table.memory();
  PagedTiles tiles;
  const std::int64_t streams = static_cast<std::int64_t>(seq) * kPagedThoughtTypes * tc.kv_heads;
  tiles.storage = m.storage;
  tiles.frame_offsets = m.frame_offsets;
  tiles.masks = m.free_masks;
  tiles.staged_keys = m.staged_keys + streams * 16 * tc.head_dim;
  tiles.staged_values = m.staged_values + streams * 16 * tc.head_dim;
  tiles.staged_masks = m.staged_masks + streams;
  tiles.global_factors = m.global_factors;
  tiles.frames = d_frames;
  tiles.meta = d_meta;
  tiles.layouts = detail::paged_layouts(tc);
  tiles.kv_heads = tc.kv_heads;
  tiles.block_size = tc.block_size;
  tiles.head_dim = tc.head_dim;
  tiles.mask_words = table.sizes().mask_words;
  tiles.tiles_per_block = (tc.block_size + kTile - 1) / kTile;
  tiles.block_units = blocks * tiles.tiles_per_block;
  const SplitPlan plan = plan_splits(paged_units(table, seq), tc.kv_heads, cfg);
  launch_decode(tiles, plan, tc.kv_heads, q_heads, head_dim, query, softmax_scale, out, carver,
                stream);
}

std::size_t dense_decode_attention_workspace_bytes(std::int64_t kv_heads, std::int64_t tokens,
                                                   std::int64_t q_heads, std::int64_t head_dim,
                                                   const DecodeAttentionConfig& cfg) {
  cfg.validate();
  KVSIFT_CHECK(kv_heads > 0 && tokens >= 0, "cuda::dense_decode_attention: kv_heads (", kv_heads,
               ") must be > 0 and tokens (", tokens, ") >= 0");
  return partial_bytes(plan_splits((tokens + kTile - 1) / kTile, kv_heads, cfg), q_heads, head_dim);
}

void dense_decode_attention_bf16(const bf16_t* keys, const bf16_t* values, std::int64_t kv_heads,
                                 std::int64_t tokens, const float* query, std::int64_t q_heads,
                                 std::int64_t head_dim, float softmax_scale, float* out,
                                 void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                                 const DecodeAttentionConfig& cfg) {
  const char* fn = "cuda::dense_decode_attention_bf16";
  const std::size_t need =
      dense_decode_attention_workspace_bytes(kv_heads, tokens, q_heads, head_dim, cfg);
  check_attention_args(fn, kv_heads, q_heads, head_dim, softmax_scale, query, out);
  KVSIFT_CHECK(tokens == 0 || (keys != nullptr && values != nullptr), fn,
               ": keys and values must not be null (tokens = ", tokens, ")");
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(keys) % 4 == 0 &&
                   reinterpret_cast<std::uintptr_t>(values) % 4 == 0,
               fn, ": keys and values must be 4-byte aligned");
  KVSIFT_CHECK(workspace_bytes >= need, fn, ": workspace of ", workspace_bytes,
               " bytes is too small (", need, " needed)");
  WorkspaceCarver carver(workspace, workspace_bytes, fn);
  const DenseBf16Tiles tiles{keys, values, tokens, static_cast<int>(head_dim)};
  launch_decode(tiles, plan_splits((tokens + kTile - 1) / kTile, kv_heads, cfg), kv_heads, q_heads,
                head_dim, query, softmax_scale, out, carver, stream);
}

}  // namespace kvsift::cuda
