// Reads of the device Continuous Thinking table that ThinKV's decisions need: the keys of chosen
// tokens (k-means on a demoted segment, §3.3) and the step's attention sparsity (§3.1). See
// include/kvsift/backend/cuda/paged_reads.hpp.
//
// Both decode keys exactly as the CPU table does (dequantize_group of the whole 16-slot key group,
// one channel per thread), so the fp32 keys are the CPU's bit for bit, and the sparsity kernel
// sums every dot product over head_dim in index order with __fmul_rn / __fadd_rn, as the host
// loop q[d] * k[d] does. Max and integer counts do not depend on the order of the tokens.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cpu/attention_sparsity.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_reads.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/quant/group_codec.hpp"
#include "mma.cuh"
#include "paged_batch_refs.cuh"

namespace kvsift::cuda {
namespace {

using detail::PagedHeadLayout;
using detail::PagedLayouts;

constexpr int kGatherThreads = 128;
constexpr int kSparsityThreads = 128;                 // 16 slots x 8 query heads per pass
constexpr int kHeadsPerPass = kSparsityThreads / 16;  // query heads one pass serves
constexpr int kMaxHeadsPerThread = 8;                 // GQA group <= 64

// Shared memory of paged_sparsity_kernel: the query [G, D] and one unit's keys [16, D + 1] in
// fp32, then (16-byte aligned) two stages of raw key bytes.
__host__ __device__ constexpr std::size_t sparsity_stage_offset(int G, int D) {
  return ((static_cast<std::size_t>(G) * D + 16 * static_cast<std::size_t>(D + 1)) * 4 + 15) / 16 *
         16;
}

// Element `slot % 16` of key channel c of a quantized (block, head) at `base`: the whole group is
// decoded as the CPU does, so the value is the CPU's bit for bit.
__device__ float quantized_key(const PagedHeadLayout& L, BlockFormat format,
                               const std::uint8_t* base, int slot, int c, int D, float gf) {
  const std::int64_t g = static_cast<std::int64_t>(slot / 16) * D + c;
  float group[16];
  dequantize_group(quant_format_of(format), base + g * L.code_bytes, base[L.key_scales + g], gf, 16,
                   group, 1);
  return group[slot % 16];
}

struct GatherArgs {
  const std::uint8_t* storage;
  const PagedStaging* staged_keys;
  const float* global_factors;
  PagedLayouts layouts;
  int head_dim;
};

__global__ void gather_keys_kernel(GatherArgs a, const PagedKeySource* __restrict__ sources,
                                   float* __restrict__ out) {  // [rows, head_dim]
  const PagedKeySource s = sources[blockIdx.x];
  const int D = a.head_dim;
  float* row = out + static_cast<std::int64_t>(blockIdx.x) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    if (s.format == kStagedKeySource) {
      row[c] = to_float(a.staged_keys[s.base + c]);
      continue;
    }
    const BlockFormat format = static_cast<BlockFormat>(s.format);
    const std::uint8_t* base = a.storage + s.base;
    if (format == BlockFormat::f32) {
      row[c] = reinterpret_cast<const float*>(base)[static_cast<std::int64_t>(s.slot) * D + c];
    } else {
      row[c] = quantized_key(a.layouts.by_format[s.format], format, base, s.slot, c, D,
                             a.global_factors[s.head]);
    }
  }
}

struct SparsityArgs {
  detail::PagedBatchRefs t;           // the table and the batch
  const PagedStaging* staged_keys;    // [max_sequences, 3, kv_heads, 16, head_dim]
  const std::uint32_t* staged_masks;  // [max_sequences, 3, kv_heads]
  const float* query;                 // [batch, q_heads, head_dim]
  float* out;                         // [batch, q_heads]
  int q_heads, group, head_dim;
  float scale, log_ratio;
};

// Units are the 16-slot groups of the sequence's blocks in page-table order, then its three
// staging streams. Their descriptions are read kSparsityThreads at a time (one per thread) into
// shared memory; the raw key bytes of a quantized unit (codes and scales, D · code bytes + D) are
// copied by cp.async into one of two shared stages while the previous unit's logits are computed,
// so no thread waits on a load issued for the unit it is about to decode.
constexpr int kStagedUnit = -1;  // UnitRef::format of a staging stream

struct UnitRef {
  unsigned live;   // bit i: slot i of the unit is live
  int format;      // BlockFormat, or kStagedUnit
  long long base;  // byte offset of the (block, head) section in storage, or the stream index
  int group;       // 16-slot group of the block
};

__device__ UnitRef unit_ref(const SparsityArgs& a, int seq, int first, int block_units, int u,
                            int h) {
  UnitRef r;
  if (u >= block_units) {
    const std::int64_t stream =
        (static_cast<std::int64_t>(seq) * kPagedThoughtTypes + (u - block_units)) * a.t.kv_heads +
        h;
    r.live = a.staged_masks[stream] & 0xffffu;
    r.format = kStagedUnit;
    r.base = stream;
    r.group = 0;
    return r;
  }
  const int per_block = a.t.block_size / 16, blk = u / per_block, start = (u % per_block) * 16;
  const std::int64_t frame = a.t.frames[first + blk];
  const std::uint64_t word = a.t.masks[(frame * a.t.kv_heads + h) * a.t.mask_words + start / 64];
  r.live = ~static_cast<unsigned>(word >> (start % 64)) & 0xffffu;  // free bit = 1
  r.format = a.t.meta[first + blk] & 0xf;
  r.base = a.t.frame_offsets[frame] + h * a.t.layouts.by_format[r.format].head_bytes;
  r.group = start / 16;
  return r;
}

// Bytes of one stage: the largest quantized unit (FP8: 16 code bytes per channel) plus its scales.
__host__ __device__ constexpr int unit_stage_bytes(int D) { return 17 * D; }

// Issues the copies of unit r's key codes (at st) and scales (at st + 16·D) when it is a live
// quantized unit; staged and f32 units are read directly by unit_keys.
__device__ void stage_unit(const SparsityArgs& a, const UnitRef& r, std::uint8_t* st) {
  if (r.live == 0 || r.format == kStagedUnit ||
      static_cast<BlockFormat>(r.format) == BlockFormat::f32) {
    return;
  }
  const int D = a.head_dim;
  const PagedHeadLayout& L = a.t.layouts.by_format[r.format];
  const std::uint8_t* base = a.t.storage + r.base;
  const int code_bytes = D * L.code_bytes;  // multiples of 16: D is
  const std::uint8_t* codes = base + static_cast<std::int64_t>(r.group) * code_bytes;
  const std::uint8_t* scales = base + L.key_scales + static_cast<std::int64_t>(r.group) * D;
  for (int c = threadIdx.x * 16; c < code_bytes; c += blockDim.x * 16) {
    detail::cp_async16(st + c, codes + c, true);
  }
  for (int c = threadIdx.x * 16; c < D; c += blockDim.x * 16) {
    detail::cp_async16(st + 16 * D + c, scales + c, true);
  }
}

// Unit r's 16 keys -> sK [16, head_dim + 1]: quantized ones decoded from their stage `st` as the
// CPU table decodes them (dequantize_group of the whole group, one channel per thread), staged
// and f32 ones read from global memory.
__device__ void unit_keys(const SparsityArgs& a, const UnitRef& r, const std::uint8_t* st, int h,
                          float* sK) {
  const int D = a.head_dim, Dp = D + 1;
  if (r.format == kStagedUnit) {
    const PagedStaging* k = a.staged_keys + r.base * 16 * D;
    for (int e = threadIdx.x; e < 16 * D; e += blockDim.x)
      sK[(e / D) * Dp + e % D] = to_float(k[e]);
    return;
  }
  if (static_cast<BlockFormat>(r.format) == BlockFormat::f32) {
    const float* k = reinterpret_cast<const float*>(a.t.storage + r.base) +
                     static_cast<std::int64_t>(r.group) * 16 * D;
    for (int e = threadIdx.x; e < 16 * D; e += blockDim.x) sK[(e / D) * Dp + e % D] = k[e];
    return;
  }
  const QuantFormat q = quant_format_of(static_cast<BlockFormat>(r.format));
  const int cb = a.t.layouts.by_format[r.format].code_bytes;
  const float gf = a.t.global_factors[h];
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    dequantize_group(q, st + c * cb, st[16 * D + c], gf, 16, sK + c, Dp);
  }
}

// CTA (KV head, sequence); thread (g0, i) = (threadIdx.x / 16, threadIdx.x % 16) takes slot i of
// every unit for query heads g0, g0 + 8, ... of the group. Two passes over the keys (max, then
// the count below max + ln 0.01): recomputing the logits costs less than a scratch buffer sized
// for the longest sequence.
__global__ void __launch_bounds__(kSparsityThreads) paged_sparsity_kernel(SparsityArgs a) {
  extern __shared__ __align__(16) float smem[];
  const int h = blockIdx.x, b = blockIdx.y, D = a.head_dim, G = a.group, Dp = D + 1;
  float* sQ = smem;          // [G, D]
  float* sK = smem + G * D;  // [16, D + 1]
  std::uint8_t* stages = reinterpret_cast<std::uint8_t*>(smem) + sparsity_stage_offset(G, D);
  __shared__ UnitRef refs[kSparsityThreads];  // the current run of unit descriptions
  const float* q = a.query + (static_cast<std::int64_t>(b) * a.q_heads + h * G) * D;
  for (int e = threadIdx.x; e < G * D; e += blockDim.x) sQ[e] = q[e];
  const int seq = a.t.seq_ids[b], first = a.t.block_begin[b];
  const int block_units = (a.t.block_begin[b + 1] - first) * (a.t.block_size / 16);
  const int units = block_units + kPagedThoughtTypes;
  const int i = threadIdx.x % 16, g0 = threadIdx.x / 16;
  float mx[kMaxHeadsPerThread], cut[kMaxHeadsPerThread];
  int count[kMaxHeadsPerThread];
  bool nan = false;
  int n = 0;
  for (int k = 0; k < kMaxHeadsPerThread; ++k) {
    mx[k] = -INFINITY;
    count[k] = 0;
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (int u0 = 0; u0 < units; u0 += kSparsityThreads) {
      const int run = min(kSparsityThreads, units - u0);
      __syncthreads();  // the previous run's descriptions and stages are no longer read
      if (threadIdx.x < run)
        refs[threadIdx.x] = unit_ref(a, seq, first, block_units, u0 + threadIdx.x, h);
      __syncthreads();
      stage_unit(a, refs[0], stages);
      detail::cp_async_commit();
      for (int j = 0; j < run; ++j) {
        if (j + 1 < run) stage_unit(a, refs[j + 1], stages + ((j + 1) % 2) * unit_stage_bytes(D));
        detail::cp_async_commit();   // possibly empty: one group per unit keeps the count
        detail::cp_async_wait<1>();  // unit j's bytes have landed (this thread's copies)
        __syncthreads();             // ... everyone's; and sK is no longer read
        const UnitRef r = refs[j];
        if (r.live != 0) unit_keys(a, r, stages + (j % 2) * unit_stage_bytes(D), h, sK);
        __syncthreads();
        if (!((r.live >> i) & 1u)) continue;
        if (pass == 0) ++n;  // every 16-lane group counts the live slots itself
        for (int g = g0, k = 0; g < G; g += kHeadsPerPass, ++k) {
          const float* qg = sQ + g * D;
          const float* kr = sK + i * Dp;
          float dot = 0.0f;
          for (int d = 0; d < D; ++d) dot = __fadd_rn(dot, __fmul_rn(qg[d], kr[d]));
          const float logit = __fmul_rn(dot, a.scale);
          if (pass == 0) {
            nan = nan || isnan(logit);
            mx[k] = fmaxf(mx[k], logit);
          } else {
            count[k] += logit < cut[k] ? 1 : 0;
          }
        }
      }
      detail::cp_async_wait<0>();
    }
    // The 16 threads of one g0 are 16 consecutive lanes of a warp.
    for (int k = 0; k < kMaxHeadsPerThread; ++k) {
      for (int off = 8; off > 0; off >>= 1) {
        if (pass == 0) {
          mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], off));
        } else {
          count[k] += __shfl_xor_sync(0xffffffffu, count[k], off);
        }
      }
      if (pass == 0) cut[k] = __fadd_rn(mx[k], a.log_ratio);
    }
  }
  for (int off = 8; off > 0; off >>= 1) {
    n += __shfl_xor_sync(0xffffffffu, n, off);
    nan = __shfl_xor_sync(0xffffffffu, static_cast<int>(nan), off) != 0 || nan;
  }
  // Every lane of a 16-lane group now holds the sequence's live count n (each group counted
  // every live slot once, whatever its query heads).
  if (i != 0) return;
  for (int g = g0, k = 0; g < G; g += kHeadsPerPass, ++k) {
    const bool bad = nan || n == 0 || !isfinite(mx[k]);
    a.out[static_cast<std::int64_t>(b) * a.q_heads + h * G + g] =
        bad ? NAN : __fdiv_rn(static_cast<float>(count[k]), static_cast<float>(n));
  }
}

}  // namespace

std::size_t paged_gather_keys_workspace_bytes(std::int64_t rows) {
  KVSIFT_CHECK(rows >= 0, "cuda::paged_gather_keys: rows must be >= 0, got ", rows);
  return align_up(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)) *
                  sizeof(PagedKeySource));
}

void paged_gather_keys(const DevicePagedTable& table, const PagedKeySource* sources,
                       std::int64_t rows, float* out, void* workspace, std::size_t workspace_bytes,
                       cudaStream_t stream) {
  const char* fn = "cuda::paged_gather_keys";
  KVSIFT_CHECK(rows >= 0 && rows <= 0x7fffffff, fn, ": rows (", rows, ") outside [0, 2^31)");
  if (rows == 0) return;
  KVSIFT_CHECK(sources != nullptr && out != nullptr, fn, ": sources and out must not be null");
  KVSIFT_CHECK(table.pending_tokens() == 0, fn, ": ", table.pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  const ThoughtBlockTableConfig& tc = table.config();
  for (std::int64_t r = 0; r < rows; ++r) {
    const PagedKeySource& s = sources[r];
    KVSIFT_CHECK((s.format == kStagedKeySource || (s.format >= 0 && s.format < 4)) && s.head >= 0 &&
                     s.head < tc.kv_heads && s.slot >= 0 && s.slot < tc.block_size && s.base >= 0,
                 fn, ": source ", r, " (format ", s.format, ", head ", s.head, ", slot ", s.slot,
                 ") does not come from DevicePagedTable::key_source");
  }
  WorkspaceCarver carver(workspace, workspace_bytes, fn);
  PagedKeySource* d_sources = carver.take<PagedKeySource>(static_cast<std::size_t>(rows));
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_sources, sources,
                                    static_cast<std::size_t>(rows) * sizeof(PagedKeySource),
                                    cudaMemcpyHostToDevice, stream));
  const PagedTableMemory& m = table.memory();
  const GatherArgs args{m.storage, m.staged_keys, m.global_factors, detail::paged_layouts(tc),
                        tc.head_dim};
  gather_keys_kernel<<<static_cast<unsigned>(rows), kGatherThreads, 0, stream>>>(args, d_sources,
                                                                                 out);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void paged_attention_sparsity(const DevicePagedTable& table, const PagedBatch& batch,
                              const float* query, std::int64_t q_heads, float softmax_scale,
                              float* out, cudaStream_t stream) {
  const char* fn = "cuda::paged_attention_sparsity";
  const ThoughtBlockTableConfig& tc = table.config();
  KVSIFT_CHECK(batch.batch >= 1 && batch.block_begin != nullptr, fn, ": the batch (", batch.batch,
               " sequences) was not uploaded (upload_paged_batch)");
  KVSIFT_CHECK(query != nullptr && out != nullptr, fn, ": query and out must not be null");
  KVSIFT_CHECK(q_heads > 0 && q_heads % tc.kv_heads == 0 &&
                   q_heads / tc.kv_heads <= kHeadsPerPass * kMaxHeadsPerThread,
               fn, ": q_heads (", q_heads, ") must be a positive multiple of kv_heads (",
               tc.kv_heads, ") with a GQA group of at most ", kHeadsPerPass * kMaxHeadsPerThread);
  KVSIFT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0.0f, fn, ": softmax_scale (",
               softmax_scale, ") must be positive and finite");
  KVSIFT_CHECK(table.pending_tokens() == 0, fn, ": ", table.pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  const PagedTableMemory& m = table.memory();
  SparsityArgs a;
  a.t = detail::paged_batch_refs(table, batch);
  a.staged_keys = m.staged_keys;
  a.staged_masks = m.staged_masks;
  a.query = query;
  a.out = out;
  a.q_heads = static_cast<int>(q_heads);
  a.group = static_cast<int>(q_heads / tc.kv_heads);
  a.head_dim = tc.head_dim;
  a.scale = softmax_scale;
  a.log_ratio = std::log(kSparsityRatio);  // the host's constant, as sparsity_from_logits uses it
  const std::size_t smem = sparsity_stage_offset(a.group, tc.head_dim) +
                           2 * static_cast<std::size_t>(unit_stage_bytes(tc.head_dim));
  const std::size_t limit = 48 * 1024 - kSparsityThreads * sizeof(UnitRef);  // minus the static
  KVSIFT_CHECK(smem <= limit, fn, ": GQA group ", a.group, " x head_dim ", tc.head_dim, " needs ",
               smem, " bytes of dynamic shared memory (at most ", limit, ")");
  const dim3 grid(static_cast<unsigned>(tc.kv_heads), static_cast<unsigned>(batch.batch));
  paged_sparsity_kernel<<<grid, kSparsityThreads, smem, stream>>>(a);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvsift::cuda
