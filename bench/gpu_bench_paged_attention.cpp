// ThinKV path on the GPU (docs/algorithms.md §3.4): decode attention over the device Continuous
// Thinking table, R1-Llama-8B shapes (32 query heads, 8 KV heads, head_dim 128), blocks of 32
// slots (--block N), R4 E4 T2 formats by default (NVFP4 for reasoning and execution segments,
// ternary for transitions; --fp8-reasoning makes reasoning blocks FP8), segments of 128 tokens with
// random thought types, exactly half of every head's tokens evicted (mask bits; staged tokens
// dropped; a random half per head, the same positions in every sequence). The batch's tables are
// placed by a metadata-only host table and quantized on the device (as in cuda::DeviceThinKV); one
// host table with data holds sequence 0 for the dense copy, so the setup costs ~2 µs per token and
// sequence on the host instead of the host codec's ~25. Per sequence length (default 4K 8K 16K 32K)
// and batch (default 1 8 64), all in one run, CUDA events, median of 50 after 5 warm-up launches:
//   new    cuda::paged_decode_attention_batch: the split-sequence tensor-core kernel, one launch
//          for the whole batch (page tables uploaded once, outside the timing);
//   old    cuda::paged_decode_attention_tiled, once per sequence (its API uploads the sequence's
//          page table on every call, as it always did);
//   dense  cuda::dense_split_decode_attention_bf16 over the same retained tokens, dequantized
//          and gathered contiguously in bf16 ([batch, 8, kept, 128]): the same split-sequence
//          tensor-core design (GQA group served by one read of each tile, cp.async copies) without
//          paging or dequantization;
//   floor  the bytes the paged kernel must read (codes and scales of every block of every head,
//          eviction masks, frame offsets, page table; the few staged rows are left out) at the
//          device-to-device copy bandwidth
//          measured by cudaMemcpyAsync in this run (read + write bytes per second).
// Also printed: max |new − dense| and |new − old| over the outputs, the device append cost per
// token, the pool bytes that differ before and after eviction (must be 0: eviction only sets
// mask bits; -1 with --evict steady, where appends and evictions interleave), the time of
// cuda::paged_attention_sparsity (ThinKV §3.1) over the same batch: sparsity_us without a logits
// scratch (two sweeps), spars1_us with one (one sweep), and the slots a head holds per kept token.
//
// Usage: gpu_bench_paged_attention [--fp8-reasoning] [--batch 1,8,64] [--min-tiles 1,2,4]
//                                  [--evict end|steady] [--refill run|regroup|regroup:F]
//                                  [--block 16|32|...] [tokens ...]
// --min-tiles: DecodeAttentionConfig::min_tiles_per_warp for the new and the dense kernel, each
// value a row of its own (default 1, the library's default).
// --evict steady: each 128-token segment loses a random half of its tokens per head as soon as it
// is written, so the groups of later segments meet the holes (default end: half of every head's
// tokens after all appends, when no refill can happen). --refill: the table's refill rule
// (docs/thinkv.md §6; default run): with regroup, later groups fill pinned runs' holes.
// --block: slots per block (default 32; a multiple of 16): smaller blocks return memory sooner
// (docs/thinkv.md §6) and give the kernel shorter tiles.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_timing.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/paged_reads.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/paged/thought_block_table.hpp"

using namespace kvsift;
using bench::DeviceArray;

namespace {

constexpr int kKVHeads = 8, kQHeads = 32, kHeadDim = 128, kSegment = 128;
constexpr int kWarmup = 5, kReps = 50;
constexpr int kAppendBatch = 4096;  // tokens per device append (each one syncs)

struct Options {
  bool fp8_reasoning = false;
  // --evict steady: each segment loses half of its tokens as soon as it is written (a random half
  // per head), so later groups can refill the holes; default: half of everything at the end.
  bool steady = false;
  RefillRule refill = RefillRule::run;
  int regroup_min_free = 8;
  int block = 32;  // --block: slots per block (a multiple of 16; the table checks it)
  std::vector<int> min_tiles = {1};
  std::vector<int> batches = {1, 8, 64};
  std::vector<int> lengths = {4096, 8192, 16384, 32768};
};

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

std::vector<float> download(const DeviceArray<float>& d, std::size_t n) {
  std::vector<float> h(n);
  KVSIFT_CUDA_CHECK(cudaMemcpy(h.data(), d.get(), n * 4, cudaMemcpyDeviceToHost));
  return h;
}

void run(int tokens, const Options& opt, double copy_bw, cudaStream_t stream) {
  const int max_batch = *std::max_element(opt.batches.begin(), opt.batches.end());
  ThoughtBlockTableConfig cfg;  // R4 E4 T2 by default
  cfg.kv_heads = kKVHeads;
  cfg.head_dim = kHeadDim;
  cfg.block_size = opt.block;
  if (opt.fp8_reasoning) cfg.reasoning = BlockFormat::fp8;
  cfg.refill = opt.refill;
  cfg.regroup_min_free = opt.regroup_min_free;
  // Per sequence: its tokens plus one partly filled block per type, plus slack. `meta` places the
  // whole batch (metadata only, as cuda::DeviceThinKV's host tables do: the device quantizes);
  // `ref` holds sequence 0's data too, for the dense copy. Every sequence gets the same tokens,
  // types and evicted positions, so sequence 0's kept tokens are every sequence's.
  ThoughtBlockTableConfig ref_cfg = cfg;
  ref_cfg.num_blocks = tokens / opt.block + 8;
  cfg.num_blocks = max_batch * ref_cfg.num_blocks;
  cfg.holds_data = false;
  ThoughtBlockTable meta(cfg), ref(ref_cfg);
  const cuda::PagedTableSizes sizes = cuda::paged_table_sizes(cfg, max_batch);
  DeviceArray<std::uint8_t> storage(static_cast<std::size_t>(sizes.storage_bytes));
  DeviceArray<std::uint64_t> masks(static_cast<std::size_t>(sizes.mask_bytes / 8));
  DeviceArray<std::uint8_t> positions(static_cast<std::size_t>(sizes.position_bytes));
  DeviceArray<std::int64_t> offsets(static_cast<std::size_t>(sizes.frame_offset_bytes / 8));
  const std::size_t staged_rows =
      static_cast<std::size_t>(sizes.staging_bytes) / sizeof(cuda::PagedStaging);
  DeviceArray<cuda::PagedStaging> staged_keys(staged_rows), staged_values(staged_rows);
  DeviceArray<std::uint32_t> staged_masks(static_cast<std::size_t>(sizes.staged_mask_bytes / 4));
  DeviceArray<float> factors(kKVHeads);
  cuda::DevicePagedTable dev(
      cfg, max_batch,
      cuda::PagedTableMemory{storage.get(), masks.get(), positions.get(), offsets.get(),
                             staged_keys.get(), staged_values.get(), staged_masks.get(),
                             factors.get()});
  dev.initialize(stream);

  // One random token stream (bf16-representable) appended to every sequence: the same content in
  // different frames, so batch items never share cache lines.
  std::mt19937 rng(1234 + tokens);
  std::normal_distribution<float> normal;
  const std::size_t row = static_cast<std::size_t>(kKVHeads) * kHeadDim;
  std::vector<bf16_t> stream_k(static_cast<std::size_t>(tokens) * row), stream_v(stream_k.size());
  for (std::size_t i = 0; i < stream_k.size(); ++i) {
    stream_k[i] = from_float<bf16_t>(2.0f * normal(rng));
    stream_v[i] = from_float<bf16_t>(normal(rng));
  }
  std::vector<ThoughtType> types;
  for (int s = 0; s < (tokens + kSegment - 1) / kSegment; ++s) {
    types.push_back(static_cast<ThoughtType>(rng() % 3));
  }
  DeviceArray<bf16_t> dk(stream_k.size()), dv(stream_v.size());
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(dk.get(), stream_k.data(), stream_k.size() * 2, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(dv.get(), stream_v.data(), stream_v.size() * 2, cudaMemcpyHostToDevice));
  double append_ms = 0;
  const auto setup0 = std::chrono::steady_clock::now();
  std::unique_ptr<DeviceArray<std::uint8_t>> append_ws, evict_ws;
  std::vector<SlotAddress> where(kKVHeads);
  std::vector<std::int32_t> seqs;
  // Writes the recorded batch, its rows `rows_k`, `rows_v` on the device ([pending, H, D] bf16).
  const auto write_batch = [&](const bf16_t* rows_k, const bf16_t* rows_v) {
    if (!append_ws || append_ws->size() < dev.append_workspace_bytes()) {  // grown only
      append_ws = std::make_unique<DeviceArray<std::uint8_t>>(2 * dev.append_workspace_bytes());
    }
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto h0 = std::chrono::steady_clock::now();
    dev.append(rows_k, rows_v, DType::bf16, append_ws->get(), append_ws->size(), stream);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    append_ms +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
  };
  const auto append_ref = [&](int t) {  // token t of the stream into the reference, with data
    std::vector<float> k(row), v(row);
    if (t % kSegment == 0) ref.open_segment(0, types[static_cast<std::size_t>(t / kSegment)]);
    for (std::size_t i = 0; i < row; ++i) {
      k[i] = to_float(stream_k[static_cast<std::size_t>(t) * row + i]);
      v[i] = to_float(stream_v[static_cast<std::size_t>(t) * row + i]);
    }
    ref.append(0, k.data(), v.data(), kKVHeads, kHeadDim, where.data());
  };
  const auto append_meta = [&](std::int32_t seq, int t) {  // and into the batch's tables
    if (t % kSegment == 0) meta.open_segment(seq, types[static_cast<std::size_t>(t / kSegment)]);
    meta.append(seq, nullptr, nullptr, kKVHeads, kHeadDim, where.data());
    dev.record_append(meta, seq, where.data());
  };
  // Evicts these positions (sorted) of head h from the reference and every sequence; `segment`
  // >= 0: they all lie in that segment.
  const auto evict = [&](const std::vector<std::int32_t>& victim_positions, int h, int segment) {
    ref.evict_positions(0, h, victim_positions);
    for (std::int32_t seq : seqs) {
      std::vector<SlotAddress> victims;
      for (const ResidentToken& t :
           segment < 0 ? meta.resident_tokens(seq, h) : meta.resident_tokens(seq, h, segment)) {
        if (std::binary_search(victim_positions.begin(), victim_positions.end(), t.position)) {
          victims.push_back(t.address);
        }
      }
      meta.evict_positions(seq, h, victim_positions);  // bits first: the addresses stay valid
      const std::size_t need = dev.evict_workspace_bytes(victims.size());
      if (!evict_ws || evict_ws->size() < need) {
        evict_ws = std::make_unique<DeviceArray<std::uint8_t>>(2 * need);
      }
      dev.evict(seq, h, victims, evict_ws->get(), evict_ws->size(), stream);
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  };
  // A random half of these positions, sorted.
  const auto half_of = [&](std::vector<std::int32_t> positions) {
    std::shuffle(positions.begin(), positions.end(), rng);
    positions.resize(positions.size() / 2);
    std::sort(positions.begin(), positions.end());
    return positions;
  };
  std::int64_t moved = -1;  // pool bytes eviction changed (measured in the end mode only)
  for (int b = 0; b < max_batch; ++b) seqs.push_back(meta.create_sequence());
  ref.create_sequence();
  if (!opt.steady) {
    for (int t = 0; t < tokens; ++t) append_ref(t);
    for (std::int32_t seq : seqs) {
      int first = 0;  // first token of the pending device batch
      for (int t = 0; t < tokens; ++t) {
        append_meta(seq, t);
        if (dev.pending_tokens() == kAppendBatch || t + 1 == tokens) {
          write_batch(dk.get() + static_cast<std::size_t>(first) * row,
                      dv.get() + static_cast<std::size_t>(first) * row);
          first = t + 1;
        }
      }
    }
    // Exactly half of each head's tokens: a random half per head, the same positions in every
    // sequence. Eviction must not change a byte of the pool.
    std::vector<std::uint8_t> pool(static_cast<std::size_t>(sizes.storage_bytes));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    KVSIFT_CUDA_CHECK(cudaMemcpy(pool.data(), storage.get(), pool.size(), cudaMemcpyDeviceToHost));
    const std::vector<std::uint8_t> before = pool;
    for (int h = 0; h < kKVHeads; ++h) evict(half_of(ref.resident_positions(0, h)), h, -1);
    KVSIFT_CUDA_CHECK(cudaMemcpy(pool.data(), storage.get(), pool.size(), cudaMemcpyDeviceToHost));
    moved = 0;
    for (std::size_t i = 0; i < pool.size(); ++i) moved += pool[i] != before[i];
  } else {
    // Segment by segment: its tokens into every sequence (one device batch: the segment's rows
    // once per sequence), then half of them out, per head.
    DeviceArray<bf16_t> seg_k(static_cast<std::size_t>(max_batch) * kSegment * row),
        seg_v(seg_k.size());
    for (int t0 = 0; t0 < tokens; t0 += kSegment) {
      const int t1 = std::min(tokens, t0 + kSegment);
      for (int t = t0; t < t1; ++t) append_ref(t);
      const std::size_t seg_rows = static_cast<std::size_t>(t1 - t0) * row;
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        for (int t = t0; t < t1; ++t) append_meta(seqs[b], t);
        KVSIFT_CUDA_CHECK(cudaMemcpyAsync(seg_k.get() + b * seg_rows,
                                          dk.get() + static_cast<std::size_t>(t0) * row,
                                          seg_rows * 2, cudaMemcpyDeviceToDevice, stream));
        KVSIFT_CUDA_CHECK(cudaMemcpyAsync(seg_v.get() + b * seg_rows,
                                          dv.get() + static_cast<std::size_t>(t0) * row,
                                          seg_rows * 2, cudaMemcpyDeviceToDevice, stream));
      }
      write_batch(seg_k.get(), seg_v.get());
      const int segment = t0 / kSegment;
      for (int h = 0; h < kKVHeads; ++h) {
        std::vector<std::int32_t> positions;
        for (const ResidentToken& r : ref.resident_tokens(0, h, segment))
          positions.push_back(r.position);
        evict(half_of(positions), h, segment);
      }
    }
  }
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    KVSIFT_CHECK(meta.num_blocks(seqs[b]) == ref.num_blocks(0), "bench: sequence ", b, " has ",
                 meta.num_blocks(seqs[b]), " blocks, the reference ", ref.num_blocks(0));
  }

  // The retained tokens dequantized and gathered contiguously in bf16: [max_batch, H, n, D], each
  // sequence a copy of the reference's.
  const std::int64_t n = ref.live_tokens(0, 0);
  const std::size_t per_seq = static_cast<std::size_t>(kKVHeads) * n * kHeadDim;
  std::vector<bf16_t> dense_k(static_cast<std::size_t>(max_batch) * per_seq),
      dense_v(dense_k.size());
  std::vector<float> bk(static_cast<std::size_t>(opt.block) * kHeadDim), bv(bk.size());
  for (int h = 0; h < kKVHeads; ++h) {
    std::int64_t j = 0;
    const std::size_t head0 = static_cast<std::size_t>(h) * n;
    const auto put = [&](const float* key, const float* value) {  // one kept row
      KVSIFT_CHECK(j < n, "bench: head ", h, " keeps more than ", n, " tokens");
      for (int d = 0; d < kHeadDim; ++d) {
        const std::size_t o = (head0 + static_cast<std::size_t>(j)) * kHeadDim + d;
        dense_k[o] = from_float<bf16_t>(key[d]);
        dense_v[o] = from_float<bf16_t>(value[d]);
      }
      ++j;
    };
    for (std::int32_t blk = 0; blk < ref.num_blocks(0); ++blk) {
      ref.dequantize_block(0, blk, h, bk.data(), bv.data());
      const std::uint64_t* free = ref.free_mask(0, blk, h);
      for (int s = 0; s < opt.block; ++s) {
        if (!((free[s / 64] >> (s % 64)) & 1u)) put(&bk[s * kHeadDim], &bv[s * kHeadDim]);
      }
    }
    std::vector<float> sk, sv;  // staged tokens: 16-bit already
    ref.staged_rows(0, h, sk, sv);
    for (std::size_t r = 0; r * kHeadDim < sk.size(); ++r)
      put(&sk[r * kHeadDim], &sv[r * kHeadDim]);
    KVSIFT_CHECK(j == n, "bench: head ", h, " keeps ", j, " tokens, not ", n);
  }
  for (int b = 1; b < max_batch; ++b) {
    std::copy_n(dense_k.begin(), per_seq,
                dense_k.begin() + static_cast<std::ptrdiff_t>(b * per_seq));
    std::copy_n(dense_v.begin(), per_seq,
                dense_v.begin() + static_cast<std::ptrdiff_t>(b * per_seq));
  }
  DeviceArray<bf16_t> ddk(dense_k.size()), ddv(dense_v.size());
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(ddk.get(), dense_k.data(), dense_k.size() * 2, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(ddv.get(), dense_v.data(), dense_v.size() * 2, cudaMemcpyHostToDevice));

  // Bytes the paged kernel must read per sequence (all sequences are alike in size).
  double seq_bytes = 0;
  for (std::int32_t blk = 0; blk < meta.num_blocks(seqs[0]); ++blk) {
    seq_bytes += static_cast<double>(
        kKVHeads * dev.head_bytes(meta.block_info(seqs[0], blk).format));  // codes + scales
  }
  seq_bytes += static_cast<double>(meta.num_blocks(seqs[0])) *
               (kKVHeads * 8.0 * sizes.mask_words + 12.0);  // masks, frame offset, page table

  std::fprintf(stderr, "%d tokens x %d sequences: setup (appends, eviction, dense copy) %.1f s\n",
               tokens, max_batch,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - setup0).count());
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (int batch : opt.batches) {
    const std::size_t qn = static_cast<std::size_t>(batch) * kQHeads * kHeadDim;
    std::vector<float> q(qn);
    for (float& x : q) x = normal(rng);
    DeviceArray<float> dq(qn), out_new(qn), out_old(qn), out_dense(qn);
    KVSIFT_CUDA_CHECK(cudaMemcpy(dq.get(), q.data(), qn * 4, cudaMemcpyHostToDevice));

    DeviceArray<std::uint8_t> view_ws(cuda::paged_batch_bytes(dev, seqs.data(), batch));
    const cuda::PagedBatch view =
        cuda::upload_paged_batch(dev, seqs.data(), batch, view_ws.get(), view_ws.size(), stream);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    KVSIFT_CHECK(cuda::paged_split_kernel_applies(dev, view, kQHeads),
                 "bench: the split kernel does not apply");
    // The tiled kernel (one call per sequence) does not depend on min_tiles: measured once.
    std::size_t old_bytes = 0;
    for (int b = 0; b < batch; ++b) {
      old_bytes = std::max(old_bytes, cuda::paged_decode_attention_tiled_workspace_bytes(
                                          dev, seqs[static_cast<std::size_t>(b)], kQHeads));
    }
    DeviceArray<std::uint8_t> ws_old(old_bytes);
    const float old_ms = bench::median_ms(
        [&] {
          for (int b = 0; b < batch; ++b) {
            const std::size_t off = static_cast<std::size_t>(b) * kQHeads * kHeadDim;
            cuda::paged_decode_attention_tiled(
                dev, seqs[static_cast<std::size_t>(b)], dq.get() + off, kQHeads, kHeadDim, scale,
                out_old.get() + off, ws_old.get(), ws_old.size(), stream);
          }
        },
        stream, kWarmup, kReps);
    // ThinKV's attention sparsity (§3.1) over the same batch, one launch: two sweeps of the keys
    // without a logits scratch, one with it (cuda::DeviceThinKV's way).
    DeviceArray<float> sparsity(static_cast<std::size_t>(batch) * kQHeads);
    const float sparsity_ms = bench::median_ms(
        [&] {
          cuda::paged_attention_sparsity(dev, view, dq.get(), kQHeads, scale, sparsity.get(),
                                         stream);
        },
        stream, kWarmup, kReps);
    const std::int64_t slots = cuda::paged_sparsity_slots(meta.num_blocks(seqs[0]), opt.block);
    DeviceArray<float> logits(static_cast<std::size_t>(batch) * kQHeads * slots);
    const float sparsity1_ms = bench::median_ms(
        [&] {
          cuda::paged_attention_sparsity(dev, view, dq.get(), kQHeads, scale, sparsity.get(),
                                         stream, logits.get(), slots);
        },
        stream, kWarmup, kReps);
    for (int tiles : opt.min_tiles) {
      cuda::DecodeAttentionConfig ac;
      ac.min_tiles_per_warp = tiles;
      DeviceArray<std::uint8_t> ws_new(
          cuda::paged_decode_attention_batch_workspace_bytes(dev, view, kQHeads, ac));
      DeviceArray<std::uint8_t> ws_dense(cuda::dense_split_decode_attention_workspace_bytes(
          batch, kKVHeads, n, kQHeads, kHeadDim, ac));

      const float new_ms = bench::median_ms(
          [&] {
            cuda::paged_decode_attention_batch(dev, view, dq.get(), kQHeads, kHeadDim, scale,
                                               out_new.get(), ws_new.get(), ws_new.size(), stream,
                                               ac);
          },
          stream, kWarmup, kReps);
      const float dense_ms = bench::median_ms(
          [&] {
            cuda::dense_split_decode_attention_bf16(
                ddk.get(), ddv.get(), batch, kKVHeads, n, dq.get(), kQHeads, kHeadDim, scale,
                out_dense.get(), ws_dense.get(), ws_dense.size(), stream, ac);
          },
          stream, kWarmup, kReps);
      const std::vector<float> on = download(out_new, qn), oo = download(out_old, qn),
                               od = download(out_dense, qn);
      const double paged_bytes = seq_bytes * batch;
      const double dense_bytes = 2.0 * batch * kKVHeads * static_cast<double>(n) * kHeadDim * 2;
      const double floor_us = paged_bytes / copy_bw * 1e6;
      std::printf(
          "%6d %5d %5d %6lld %9.1f %9.1f %9.1f %9.1f %9.2f %9.2f %9.1f %9.1f %9.1f %8.5f %8.5f "
          "%8.2f %6lld %9.1f %9.1f %10.2f\n",
          tokens, batch, tiles, static_cast<long long>(n), new_ms * 1e3, old_ms * 1e3,
          dense_ms * 1e3, floor_us, new_ms * 1e3 / (dense_ms * 1e3), new_ms * 1e3 / floor_us,
          paged_bytes / 1e6, dense_bytes / 1e6, paged_bytes / (new_ms * 1e-3) / 1e9,
          max_abs_diff(on, od), max_abs_diff(on, oo),
          append_ms * 1e3 / (static_cast<double>(tokens) * max_batch),
          static_cast<long long>(moved), sparsity_ms * 1e3, sparsity1_ms * 1e3,
          static_cast<double>(meta.num_blocks(seqs[0])) * opt.block / static_cast<double>(n));
      std::fflush(stdout);
    }
  }
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> out;
  std::string cur;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == '\0') {
      if (!cur.empty()) out.push_back(std::atoi(cur.c_str()));
      cur.clear();
      if (*p == '\0') break;
    } else {
      cur.push_back(*p);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  std::vector<int> lengths;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--fp8-reasoning") == 0) {
      opt.fp8_reasoning = true;
    } else if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc) {
      opt.batches = parse_list(argv[++i]);
    } else if (std::strcmp(argv[i], "--min-tiles") == 0 && i + 1 < argc) {
      opt.min_tiles = parse_list(argv[++i]);
    } else if (std::strcmp(argv[i], "--block") == 0 && i + 1 < argc) {
      opt.block = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--evict") == 0 && i + 1 < argc) {
      const std::string mode = argv[++i];
      KVSIFT_CHECK(mode == "end" || mode == "steady", "--evict must be end or steady, got '", mode,
                   "'");
      opt.steady = mode == "steady";
    } else if (std::strcmp(argv[i], "--refill") == 0 && i + 1 < argc) {
      const std::string rule = argv[++i];  // run, regroup or regroup:F
      const std::size_t colon = rule.find(':');
      opt.refill = parse_refill_rule(rule.substr(0, colon));
      if (colon != std::string::npos) opt.regroup_min_free = std::atoi(rule.c_str() + colon + 1);
    } else {
      lengths.push_back(std::atoi(argv[i]));
    }
  }
  if (!lengths.empty()) opt.lengths = lengths;
  if (!bench::cuda_device_present()) return 0;
  cudaDeviceProp prop{};
  KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));
  const double copy_bw = bench::d2d_copy_bandwidth(std::size_t{1} << 30, stream, kWarmup, 20);
  std::printf(
      "CT paged decode attention on %s: %s, block %d, Hkv %d / Hq %d, head_dim %d, 50%% evicted "
      "per head (%s), refill %s (f >= %d); D2D copy bandwidth %.0f GB/s (read + write)\n",
      prop.name, opt.fp8_reasoning ? "R8 E4 T2" : "R4 E4 T2", opt.block, kKVHeads, kQHeads,
      kHeadDim, opt.steady ? "each segment as it is written" : "at the end",
      std::string(refill_rule_name(opt.refill)).c_str(), opt.regroup_min_free, copy_bw / 1e9);
  std::printf(
      "new = split-sequence paged kernel (batch API), old = tiled paged kernel per sequence, dense "
      "= split-sequence bf16 kernel over the kept tokens, floor = paged bytes / copy bandwidth\n");
  std::printf("%6s %5s %5s %6s %9s %9s %9s %9s %9s %9s %9s %9s %9s %8s %8s %8s %6s %9s %9s %10s\n",
              "tokens", "batch", "tiles", "kept", "new_us", "old_us", "dense_us", "floor_us",
              "new/dense", "new/floor", "paged_MB", "dense_MB", "new_GB/s", "d(n,dns)", "d(n,old)",
              "app_us/t", "moved", "sparsity_us", "spars1_us", "slots/kept");
  for (int t : opt.lengths) run(t, opt, copy_bw, stream);
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
