// Reads of the device Continuous Thinking table that ThinKV's decisions need: the keys of chosen
// tokens (k-means on a demoted segment, §3.3) and the step's attention sparsity (§3.1). See
// include/kvsift/backend/cuda/paged_reads.hpp.
//
// Both decode keys with the CPU codec's arithmetic (the gather kernel through dequantize_group
// itself, the sparsity kernel through decode_channel: the same products of the same factors, one
// 16-slot key group per thread), so the fp32 keys are the CPU's bit for bit, and the sparsity
// kernel sums every dot product over head_dim in index order with __fmul_rn / __fadd_rn, as the
// host loop q[d] * k[d] does. Max and integer counts do not depend on the order of the tokens.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/backend/cpu/attention_sparsity.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_reads.hpp"
#include "kvsift/backend/cuda/workspace.hpp"
#include "kvsift/quant/e2m1.hpp"
#include "kvsift/quant/e4m3.hpp"
#include "kvsift/quant/e8m0.hpp"
#include "kvsift/quant/group_codec.hpp"
#include "kvsift/quant/ternary.hpp"
#include "mma.cuh"
#include "paged_batch_refs.cuh"

namespace kvsift::cuda {
namespace {

using detail::PagedHeadLayout;
using detail::PagedLayouts;

constexpr int kGatherThreads = 128;

// paged_sparsity_kernel: 128 threads decode kRoundUnits = 2 16-slot units (32 slots) per round;
// lane s of warp w takes slot s of the round for the query heads w, w + 4, w + 8, w + 12 of the
// current block of 16 (those below the GQA group), so each key row read from shared memory serves
// up to 4 dot products, each query read is a broadcast, and a group of 4 (R1-Llama-8B) keeps all
// four warps busy with one head each. Two units per round (not 4 or 8) keeps the CTA at 34 KB of
// shared memory, 6 per SM: measured fastest at batch 64 and 800 (docs/thinkv.md §10,
// bench/RESULTS.md run 55).
constexpr int kSparsityThreads = 128;
constexpr int kRoundUnits = 2;
constexpr int kRoundSlots = kRoundUnits * 16;  // one warp's lanes
constexpr int kHeadsPerThread = 4;
constexpr int kHeadsPerBlock = (kSparsityThreads / kRoundSlots) * kHeadsPerThread;  // 16
constexpr int kMaxSparsityGroup = 64;
static_assert(kRoundSlots == 32, "a warp's lanes are a round's slots (warp-only reductions)");

// Bytes of one unit's stage: the largest quantized unit (FP8: 16 code bytes per channel) plus
// its scales.
__host__ __device__ constexpr int unit_stage_bytes(int D) { return 17 * D; }

// Dynamic shared memory of paged_sparsity_kernel, in this order: the head block's queries
// [16, D] f32, the round's keys [32, D + 4] f32 (rows 16-byte aligned for float4 reads; a row
// stride of 4 banks mod 32 keeps 8 consecutive rows on distinct banks), two stages of raw key
// bytes [2, kRoundUnits, 17·D].
struct SparsityShared {
  std::size_t keys, stages, bytes;
  __host__ __device__ constexpr explicit SparsityShared(int D)
      : keys(static_cast<std::size_t>(kHeadsPerBlock) * D * 4),
        stages(keys + static_cast<std::size_t>(kRoundSlots) * (D + 4) * 4),
        bytes(stages + 2 * static_cast<std::size_t>(kRoundUnits) * unit_stage_bytes(D)) {}
};

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
  float* logits;                      // [batch, q_heads, max_slots] or null
  long long max_slots;
  int q_heads, group, head_dim;
  float scale, log_ratio;
};

// The logits of one key row (sK, [D] f32) for NH query heads w, w + 4, ... of the block's queries
// sQ [16, D]: each dot product summed over head_dim in index order with __fmul_rn / __fadd_rn, as
// the host loop dot += q[d] * k[d] does.
template <int NH>
__device__ __forceinline__ void row_logits(const float* kr, const float* sQ, int warp, int D,
                                           float scale, float* logit) {
  const float4* k4 = reinterpret_cast<const float4*>(kr);
  float dot[NH] = {};
#pragma unroll 2
  for (int d4 = 0; d4 < D / 4; ++d4) {
    const float4 k = k4[d4];
#pragma unroll
    for (int j = 0; j < NH; ++j) {
      const float4 x = reinterpret_cast<const float4*>(sQ + (warp + 4 * j) * D)[d4];
      dot[j] = __fadd_rn(dot[j], __fmul_rn(x.x, k.x));
      dot[j] = __fadd_rn(dot[j], __fmul_rn(x.y, k.y));
      dot[j] = __fadd_rn(dot[j], __fmul_rn(x.z, k.z));
      dot[j] = __fadd_rn(dot[j], __fmul_rn(x.w, k.w));
    }
  }
#pragma unroll
  for (int j = 0; j < NH; ++j) logit[j] = __fmul_rn(dot[j], scale);
}

// Units are the 16-slot groups of the sequence's blocks in page-table order, then its three
// staging streams; a quantized unit's raw key bytes are D · code bytes of codes + D scales.
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

// The 16 values of one channel's key group, out[i · stride] = value of slot i: the CPU codec's
// products of the same exact factors (dequantize_group: the same floats), but from one vector load
// of the group's codes (NVFP4 8 bytes, FP8 16, ternary 4: aligned, as the stage is) and fully
// unrolled, the E2M1 values read from a 16-entry table (e2m1[c] = e2m1_to_float(c), -0 included).
__device__ __forceinline__ void decode_channel(QuantFormat q, const std::uint8_t* codes,
                                               std::uint8_t scale_code, float global_factor,
                                               const float* e2m1, float* out, int stride) {
  if (q == QuantFormat::nvfp4) {
    const float step = nvfp4_step(scale_code, global_factor);
    const uint2 w = *reinterpret_cast<const uint2*>(codes);  // value i: bits 4i of the 64
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      out[i * stride] = e2m1[((i < 8 ? w.x : w.y) >> (4 * (i % 8))) & 0xfu] * step;
    }
  } else if (q == QuantFormat::fp8) {
    const float scale = e8m0_to_float(scale_code);
    const uint4 w = *reinterpret_cast<const uint4*>(codes);
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      out[i * stride] =
          e4m3_to_float(static_cast<std::uint8_t>(words[i / 4] >> (8 * (i % 4)))) * scale;
    }
  } else {
    const float alpha = e4m3_to_float(scale_code);
    const unsigned w = *reinterpret_cast<const unsigned*>(codes);  // value i: bits 2i
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      out[i * stride] = ternary_sign(static_cast<std::uint8_t>((w >> (2 * i)) & 0x3u)) * alpha;
    }
  }
}

// Unit r's 16 keys -> sK [16, Dp]: quantized ones decoded from their stage `st` (decode_channel,
// one channel per thread), staged and f32 ones read from global memory.
__device__ void unit_keys(const SparsityArgs& a, const UnitRef& r, const std::uint8_t* st, int h,
                          int Dp, const float* e2m1, float* sK) {
  const int D = a.head_dim;
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
    decode_channel(q, st + c * cb, st[16 * D + c], gf, e2m1, sK + c, Dp);
  }
}

// Issues the copies of round r's units (refs [r·kRoundUnits, ...) below `run`) into stage r % 2
// and commits them as one group (possibly empty: one group per round keeps the count).
__device__ void stage_round(const SparsityArgs& a, const UnitRef* refs, int r, int run,
                            std::uint8_t* stages) {
  std::uint8_t* st = stages + (r % 2) * kRoundUnits * unit_stage_bytes(a.head_dim);
  for (int k = 0; k < kRoundUnits && r * kRoundUnits + k < run; ++k) {
    stage_unit(a, refs[r * kRoundUnits + k], st + k * unit_stage_bytes(a.head_dim));
  }
  detail::cp_async_commit();
}

// x reduced over the warp (every lane gets the result).
template <class T, class Op>
__device__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// CTA (KV head, sequence). For each block of 16 query heads: a sweep over the units computes every
// logit and the maximum; with the logits scratch (and a sequence within max_slots) each thread
// keeps its logits there and counts them below max + ln 0.01 from it, otherwise a second sweep
// recomputes them. A sweep reads the unit descriptions kSparsityThreads at a time (one per thread)
// and copies a round's raw key bytes with cp.async into one of two stages while the previous
// round's logits are computed. Lane s owns slot s of every round, i.e. the sequence's slots
// s, s + 32, ...: the same ones in every sweep, so a head's reductions stay within one warp.
__global__ void __launch_bounds__(kSparsityThreads) paged_sparsity_kernel(SparsityArgs a) {
  extern __shared__ __align__(16) float smem[];
  const int h = blockIdx.x, b = blockIdx.y, D = a.head_dim, G = a.group, Dp = D + 4;
  const SparsityShared lay(D);
  float* sQ = smem;                                                                // [16, D]
  float* sK = reinterpret_cast<float*>(reinterpret_cast<char*>(smem) + lay.keys);  // [32, Dp]
  std::uint8_t* stages = reinterpret_cast<std::uint8_t*>(smem) + lay.stages;
  __shared__ UnitRef refs[kSparsityThreads];
  __shared__ float e2m1[16];  // read after the first run's barriers
  if (threadIdx.x < 16) e2m1[threadIdx.x] = e2m1_to_float(static_cast<std::uint8_t>(threadIdx.x));
  const int seq = a.t.seq_ids[b], first = a.t.block_begin[b];
  const int block_units = (a.t.block_begin[b + 1] - first) * (a.t.block_size / 16);
  const int units = block_units + kPagedThoughtTypes;
  const bool single = a.logits != nullptr && static_cast<long long>(units) * 16 <= a.max_slots;
  const int warp = threadIdx.x / 32, s = threadIdx.x % 32;  // slot s of the round
  const int su = s / 16, si = s % 16;                       // unit of the round, slot of the unit
  int n = 0;  // live slots of the head (counted in the first sweep)
  const auto fmax_op = [](float x, float y) { return fmaxf(x, y); };
  const auto add_op = [](int x, int y) { return x + y; };
  for (int g0 = 0; g0 < G; g0 += kHeadsPerBlock) {
    // This warp's heads g0 + warp + 4j, j < nh (the same for the whole warp).
    const int nh = max(0, min(kHeadsPerThread, (G - g0 - warp + 3) / 4));
    __syncthreads();  // sQ is no longer read
    const float* q = a.query + (static_cast<std::int64_t>(b) * a.q_heads + h * G + g0) * D;
    for (int e = threadIdx.x; e < kHeadsPerBlock * D; e += blockDim.x) {
      sQ[e] = g0 + e / D < G ? q[e] : 0.0f;
    }
    float* kept[kHeadsPerThread];  // this thread's logits of head j in the scratch
    float mx[kHeadsPerThread], cut[kHeadsPerThread];
    int count[kHeadsPerThread];
    unsigned nan = 0;  // bit j: a NaN logit of head j
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
      kept[j] =
          single
              ? a.logits + (static_cast<std::int64_t>(b) * a.q_heads + h * G + g0 + warp + 4 * j) *
                               a.max_slots
              : nullptr;
      mx[j] = -INFINITY;
      count[j] = 0;
    }
    for (int pass = 0; pass < (single ? 1 : 2); ++pass) {
      const bool counting_n = pass == 0 && g0 == 0;
      for (int u0 = 0; u0 < units; u0 += kSparsityThreads) {
        const int run = min(kSparsityThreads, units - u0);
        const int rounds = (run + kRoundUnits - 1) / kRoundUnits;
        __syncthreads();  // the previous run's descriptions and stages are no longer read
        if (threadIdx.x < run)
          refs[threadIdx.x] = unit_ref(a, seq, first, block_units, u0 + threadIdx.x, h);
        __syncthreads();
        stage_round(a, refs, 0, run, stages);
        for (int r = 0; r < rounds; ++r) {
          stage_round(a, refs, r + 1, run, stages);  // nothing past the run
          detail::cp_async_wait<1>();  // round r's bytes have landed (this thread's copies)
          __syncthreads();             // ... everyone's; and sK is no longer read
          const std::uint8_t* st = stages + (r % 2) * kRoundUnits * unit_stage_bytes(D);
          for (int k = 0; k < kRoundUnits && r * kRoundUnits + k < run; ++k) {
            const UnitRef& ref = refs[r * kRoundUnits + k];
            if (ref.live != 0)
              unit_keys(a, ref, st + k * unit_stage_bytes(D), h, Dp, e2m1, sK + k * 16 * Dp);
          }
          __syncthreads();
          const int ui = r * kRoundUnits + su;
          if (ui >= run) continue;
          const long long slot = static_cast<long long>(u0 + ui) * 16 + si;
          float logit[kHeadsPerThread];
          const bool live = (refs[ui].live >> si) & 1u;
          if (!live) {
            if (single) {  // a dead slot is never counted (NaN < cut is false)
#pragma unroll
              for (int j = 0; j < kHeadsPerThread; ++j) {
                if (j < nh) kept[j][slot] = NAN;
              }
            }
            continue;
          }
          if (counting_n) ++n;
          const float* kr = sK + s * Dp;
          switch (nh) {
            case 1:
              row_logits<1>(kr, sQ, warp, D, a.scale, logit);
              break;
            case 2:
              row_logits<2>(kr, sQ, warp, D, a.scale, logit);
              break;
            case 3:
              row_logits<3>(kr, sQ, warp, D, a.scale, logit);
              break;
            case 4:
              row_logits<4>(kr, sQ, warp, D, a.scale, logit);
              break;
            default:
              continue;  // no head of this block in this warp
          }
#pragma unroll
          for (int j = 0; j < kHeadsPerThread; ++j) {
            if (j >= nh) break;
            if (pass == 0) {
              nan |= isnan(logit[j]) ? 1u << j : 0u;
              mx[j] = fmaxf(mx[j], logit[j]);
              if (single) kept[j][slot] = logit[j];
            } else {
              count[j] += logit[j] < cut[j] ? 1 : 0;
            }
          }
        }
        detail::cp_async_wait<0>();
      }
      // Max and integer counts do not depend on the order of the slots.
#pragma unroll
      for (int j = 0; j < kHeadsPerThread; ++j) {
        if (pass == 0) {
          mx[j] = warp_reduce(mx[j], fmax_op);
          cut[j] = __fadd_rn(mx[j], a.log_ratio);
        } else {
          count[j] = warp_reduce(count[j], add_op);
        }
      }
      if (pass == 0) {
        nan = static_cast<unsigned>(
            warp_reduce(static_cast<int>(nan), [](int x, int y) { return x | y; }));
        if (g0 == 0) n = warp_reduce(n, add_op);  // each warp saw every slot once
      }
    }
    if (single) {  // the count from the kept logits: this thread's own writes
      for (long long slot = s; slot < static_cast<long long>(units) * 16; slot += 32) {
#pragma unroll
        for (int j = 0; j < kHeadsPerThread; ++j) {
          if (j < nh) count[j] += kept[j][slot] < cut[j] ? 1 : 0;
        }
      }
#pragma unroll
      for (int j = 0; j < kHeadsPerThread; ++j) count[j] = warp_reduce(count[j], add_op);
    }
    if (s != 0) continue;
#pragma unroll
    for (int j = 0; j < kHeadsPerThread; ++j) {
      if (j >= nh) break;
      const bool bad = ((nan >> j) & 1u) != 0 || n == 0 || !isfinite(mx[j]);
      a.out[static_cast<std::int64_t>(b) * a.q_heads + h * G + g0 + warp + 4 * j] =
          bad ? NAN : __fdiv_rn(static_cast<float>(count[j]), static_cast<float>(n));
    }
  }
}

}  // namespace

std::size_t paged_gather_keys_workspace_bytes(std::int64_t rows) {
  KVSIFT_CHECK(rows >= 0, "cuda::paged_gather_keys: rows must be >= 0, got ", rows);
  return align_up(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)) *
                  sizeof(PagedKeySource));
}

namespace {

// paged_gather_keys' checks of everything but the sources; false: nothing to gather.
bool check_gather(const DevicePagedTable& table, const PagedKeySource* sources, std::int64_t rows,
                  const float* out) {
  const char* fn = "cuda::paged_gather_keys";
  KVSIFT_CHECK(rows >= 0 && rows <= 0x7fffffff, fn, ": rows (", rows, ") outside [0, 2^31)");
  if (rows == 0) return false;
  KVSIFT_CHECK(sources != nullptr && out != nullptr, fn, ": sources and out must not be null");
  KVSIFT_CHECK(table.pending_tokens() == 0, fn, ": ", table.pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  return true;
}

}  // namespace

void paged_gather_keys(const DevicePagedTable& table, const PagedKeySource* sources,
                       std::int64_t rows, float* out, void* workspace, std::size_t workspace_bytes,
                       cudaStream_t stream) {
  const char* fn = "cuda::paged_gather_keys";
  if (!check_gather(table, sources, rows, out)) return;
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
  paged_gather_keys_uploaded(table, d_sources, rows, out, stream);
}

void paged_gather_keys_uploaded(const DevicePagedTable& table, const PagedKeySource* sources,
                                std::int64_t rows, float* out, cudaStream_t stream) {
  if (!check_gather(table, sources, rows, out)) return;
  const ThoughtBlockTableConfig& tc = table.config();
  const PagedTableMemory& m = table.memory();
  const GatherArgs args{m.storage, m.staged_keys, m.global_factors, detail::paged_layouts(tc),
                        tc.head_dim};
  gather_keys_kernel<<<static_cast<unsigned>(rows), kGatherThreads, 0, stream>>>(args, sources,
                                                                                 out);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void paged_attention_sparsity(const DevicePagedTable& table, const PagedBatch& batch,
                              const float* query, std::int64_t q_heads, float softmax_scale,
                              float* out, cudaStream_t stream, float* logits,
                              std::int64_t max_slots) {
  const char* fn = "cuda::paged_attention_sparsity";
  const ThoughtBlockTableConfig& tc = table.config();
  KVSIFT_CHECK(batch.batch >= 1 && batch.block_begin != nullptr, fn, ": the batch (", batch.batch,
               " sequences) was not uploaded (upload_paged_batch)");
  KVSIFT_CHECK(query != nullptr && out != nullptr, fn, ": query and out must not be null");
  KVSIFT_CHECK(
      q_heads > 0 && q_heads % tc.kv_heads == 0 && q_heads / tc.kv_heads <= kMaxSparsityGroup, fn,
      ": q_heads (", q_heads, ") must be a positive multiple of kv_heads (", tc.kv_heads,
      ") with a GQA group of at most ", kMaxSparsityGroup);
  KVSIFT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0.0f, fn, ": softmax_scale (",
               softmax_scale, ") must be positive and finite");
  KVSIFT_CHECK(table.pending_tokens() == 0, fn, ": ", table.pending_tokens(),
               " recorded tokens are not written yet (call append() first)");
  const PagedTableMemory& m = table.memory();
  SparsityArgs a;
  a.t = detail::paged_batch_refs(table, batch);
  a.staged_keys = m.staged_keys;
  a.staged_masks = m.staged_masks;
  KVSIFT_CHECK(logits == nullptr || max_slots > 0, fn, ": max_slots (", max_slots,
               ") must be positive with a logits scratch");
  a.query = query;
  a.out = out;
  a.logits = logits;
  a.max_slots = logits == nullptr ? 0 : max_slots;
  a.q_heads = static_cast<int>(q_heads);
  a.group = static_cast<int>(q_heads / tc.kv_heads);
  a.head_dim = tc.head_dim;
  a.scale = softmax_scale;
  a.log_ratio = std::log(kSparsityRatio);  // the host's constant, as sparsity_from_logits uses it
  // 34 KB at head_dim 128 and 67 KB at 256 (above the 48 KB default): the kernel is allowed the
  // device's whole opt-in size once per device and thread (the same value every time, so
  // concurrent callers cannot lower it for each other).
  const std::size_t smem = SparsityShared(tc.head_dim).bytes;
  static thread_local int device_done = -1;
  static thread_local std::size_t limit = 0;
  int device = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  if (device != device_done) {
    int optin = 0;
    KVSIFT_CUDA_CHECK(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attr{};
    KVSIFT_CUDA_CHECK(cudaFuncGetAttributes(&attr, paged_sparsity_kernel));
    limit = static_cast<std::size_t>(optin) - attr.sharedSizeBytes;  // less the static arrays
    KVSIFT_CUDA_CHECK(cudaFuncSetAttribute(paged_sparsity_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(limit)));
    device_done = device;
  }
  KVSIFT_CHECK(smem <= limit, fn, ": head_dim ", tc.head_dim, " needs ", smem,
               " bytes of dynamic shared memory, the device allows ", limit);
  const dim3 grid(static_cast<unsigned>(tc.kv_heads), static_cast<unsigned>(batch.batch));
  paged_sparsity_kernel<<<grid, kSparsityThreads, smem, stream>>>(a);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvsift::cuda
