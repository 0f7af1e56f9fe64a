// The split-sequence paged decode attention (cuda::paged_decode_attention_batch, docs/algorithms.md
// §3.4) against independent CPU oracles:
//   - ternary blocks: dense softmax attention in double over the tokens obtained by dequantizing
//     every block with the CPU codec (ThoughtBlockTable::dequantize_block) and keeping the slots
//     whose eviction bit is clear, plus the staged 16-bit tokens (keys and values, staged_rows);
//   - mixed NVFP4 / ternary blocks with NVFP4 global factors: the CPU reference
//     paged_decode_attention, per sequence (FP8 blocks take the tiled kernel, checked as a
//     fallback).
// Covered: a batch of 3 sequences of different lengths, GQA groups 1, 2, 4 and 8, head_dim 64,
// 128 and 256 (every head_dim the register-direct kernel takes), blocks of 32 and 48 slots (a
// 16-slot tile), staged (not yet quantized) tokens, random evictions, a run of 8 blocks with every
// slot evicted in one head (whole splits without a live slot), a head with at most one live slot
// per 16-slot group (whole dead groups inside live tiles), one sequence with no live token in a
// head, splits forced from few to many, and warps walking more than 64 tiles; the merge of more
// than 1,000 partials (through the dense kernel, which shares it). head_dim 32 and the
// other shapes the kernel does not take are checked on the tiled fallback.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/paged/paged_attention.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "paged_mirror.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

using Mirror = test::PagedMirror;

// Dense softmax attention in double over the live slots of every block, each block dequantized
// by the CPU codec. query [q_heads, D] -> [q_heads, D]; zeros for a KV head without live slots.
std::vector<float> dequantized_dense_oracle(const ThoughtBlockTable& cpu, std::int32_t seq,
                                            const float* query, std::int64_t q_heads, float scale) {
  const std::int64_t H = cpu.config().kv_heads, D = cpu.config().head_dim, G = q_heads / H;
  const std::int32_t B = cpu.config().block_size;
  std::vector<float> out(static_cast<std::size_t>(q_heads * D), 0.0f);
  std::vector<float> bk(static_cast<std::size_t>(B * D)), bv(bk.size());
  for (std::int64_t h = 0; h < H; ++h) {
    std::vector<std::vector<float>> K, V;
    for (std::int32_t b = 0; b < cpu.num_blocks(seq); ++b) {
      cpu.dequantize_block(seq, b, static_cast<std::int32_t>(h), bk.data(), bv.data());
      const std::uint64_t* free = cpu.free_mask(seq, b, static_cast<std::int32_t>(h));
      for (std::int32_t s = 0; s < B; ++s) {
        if ((free[s / 64] >> (s % 64)) & 1u) continue;
        K.emplace_back(bk.begin() + s * D, bk.begin() + (s + 1) * D);
        V.emplace_back(bv.begin() + s * D, bv.begin() + (s + 1) * D);
      }
    }
    std::vector<float> sk, sv;  // the staged tokens, at 16 bits
    cpu.staged_rows(seq, static_cast<std::int32_t>(h), sk, sv);
    for (std::size_t i = 0; i * D < sk.size(); ++i) {
      K.emplace_back(sk.begin() + i * D, sk.begin() + (i + 1) * D);
      V.emplace_back(sv.begin() + i * D, sv.begin() + (i + 1) * D);
    }
    if (K.empty()) continue;
    test::dense_attention_double(query, h, G, D, scale, K, V, out);
  }
  return out;
}

void require_close(const std::vector<float>& got, const std::vector<float>& want,
                   std::size_t offset, float tol, const char* what) {
  std::size_t bad = 0, first = want.size();
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!(std::fabs(got[offset + i] - want[i]) <= tol * (1.0f + std::fabs(want[i])))) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad > 0) {
    INFO(what << ": " << bad << " of " << want.size() << " elements differ; first at " << first
              << " got " << got[offset + first] << " want " << want[first]);
    REQUIRE(bad == 0);
  }
}

// Runs the batched split kernel over `seqs` (one query row block per sequence) with NaN-poisoned
// output and returns [batch, q_heads, D].
std::vector<float> run_batch(Mirror& dev, const std::vector<std::int32_t>& seqs,
                             const std::vector<float>& query, std::int64_t q_heads, float scale,
                             const cuda::DecodeAttentionConfig& ac) {
  const std::int64_t D = dev.table.config().head_dim;
  const auto n = static_cast<std::int32_t>(seqs.size());
  DeviceBuffer<std::uint8_t> view_ws(cuda::paged_batch_bytes(dev.table, seqs.data(), n));
  const cuda::PagedBatch batch =
      cuda::upload_paged_batch(dev.table, seqs.data(), n, view_ws.get(), view_ws.size(), nullptr);
  REQUIRE(cuda::paged_split_kernel_applies(dev.table, batch, q_heads));
  DeviceBuffer<float> q(query), out(query.size());
  KVSIFT_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.size() * 4));
  DeviceBuffer<std::uint8_t> ws(
      cuda::paged_decode_attention_batch_workspace_bytes(dev.table, batch, q_heads, ac));
  cuda::paged_decode_attention_batch(dev.table, batch, q.get(), q_heads, D, scale, out.get(),
                                     ws.get(), ws.size(), nullptr, ac);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

}  // namespace

TEST_CASE("split paged attention: ternary blocks equal dense attention over dequantized tokens") {
  const ThoughtBlockTableConfig cfg = test::table_config(
      2, 128, 32, BlockFormat::ternary, BlockFormat::ternary, BlockFormat::ternary, 128);
  const std::int64_t q_heads = 8;  // GQA group 4
  std::mt19937 rng(11);
  ThoughtBlockTable cpu(cfg);
  Mirror dev(cfg, 3);
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {700, 333, 1100}, rng);
  // Sanity of the scenario itself: blocks 0-7 of head 0 of sequence 0 are all evicted, and some
  // tokens are still staged (not yet quantized) in every sequence.
  for (std::int32_t b = 0; b < 8; ++b) {
    const std::uint64_t* free = cpu.free_mask(seqs[0], b, 0);
    REQUIRE((free[0] & 0xffffffffull) == 0xffffffffull);
  }
  for (std::int32_t s : seqs) {
    std::int64_t staged = 0;
    for (std::int32_t h = 0; h < 2; ++h) {
      for (const ResidentToken& t : cpu.resident_tokens(s, h)) staged += t.address.block < 0;
    }
    INFO("sequence " << s);
    REQUIRE(staged > 0);
  }
  std::normal_distribution<float> normal;
  std::vector<float> query(seqs.size() * static_cast<std::size_t>(q_heads) * 128);
  for (float& x : query) x = normal(rng);
  const float scale = 1.0f / std::sqrt(128.0f);
  for (int variant = 0; variant < 3; ++variant) {
    cuda::DecodeAttentionConfig ac;
    // 1 and 2 tiles per warp: many splits, and the masked blocks 0-7 fill whole splits (4 and 8
    // tiles per CTA); target_ctas 1: one split per sequence, long runs per warp.
    ac.min_tiles_per_warp = variant == 0 ? 1 : variant == 1 ? 2 : 4;
    ac.target_ctas = variant == 2 ? 1 : 528;
    INFO("min_tiles_per_warp " << ac.min_tiles_per_warp << " target_ctas " << ac.target_ctas);
    const std::vector<float> got = run_batch(dev, seqs, query, q_heads, scale, ac);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      INFO("batch item " << i);
      const std::size_t off = i * static_cast<std::size_t>(q_heads) * 128;
      require_close(got, dequantized_dense_oracle(cpu, seqs[i], query.data() + off, q_heads, scale),
                    off, 1e-4f, "split kernel vs dense attention over dequantized tokens");
      std::vector<float> ref(static_cast<std::size_t>(q_heads) * 128);
      paged_decode_attention(cpu, seqs[i], query.data() + off, q_heads, 128, scale, ref.data());
      require_close(got, ref, off, 1e-4f, "split kernel vs CPU paged attention");
    }
  }
}

TEST_CASE("split paged attention: a head without live tokens gives zeros") {
  const ThoughtBlockTableConfig cfg = test::table_config(
      2, 64, 32, BlockFormat::ternary, BlockFormat::nvfp4, BlockFormat::ternary, 32);
  std::mt19937 rng(5);
  ThoughtBlockTable cpu(cfg);
  Mirror dev(cfg, 1);
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {200}, rng);
  std::vector<SlotAddress> all;
  for (const ResidentToken& t : cpu.resident_tokens(seqs[0], 1)) all.push_back(t.address);
  test::evict_both(cpu, dev, seqs[0], 1, all);
  std::vector<float> query(4 * 64);
  std::normal_distribution<float> normal;
  for (float& x : query) x = normal(rng);
  cuda::DecodeAttentionConfig ac;
  ac.min_tiles_per_warp = 1;
  const std::vector<float> got = run_batch(dev, seqs, query, 4, 0.125f, ac);
  for (std::size_t i = 2 * 64; i < got.size(); ++i) {
    INFO("element " << i);
    REQUIRE(got[i] == 0.0f);
  }
  require_close(got, dequantized_dense_oracle(cpu, seqs[0], query.data(), 4, 0.125f), 0, 1e-4f,
                "split kernel vs dense oracle");
}

TEST_CASE("split paged attention: NVFP4 and ternary blocks with global factors") {
  // (FP8 blocks take the tiled kernel: see split_kernel_takes in cuda/paged_attention_split.cu.)
  for (int block_size : {16, 32, 48}) {  // one 16-slot tile, one 32-slot tile, one of each
    ThoughtBlockTableConfig cfg = test::table_config(2, 64, block_size, BlockFormat::nvfp4,
                                                     BlockFormat::ternary, BlockFormat::nvfp4, 128);
    cfg.global_factors = {300.0f, 0.7f};
    const std::int64_t q_heads = 16;  // GQA group 8
    std::mt19937 rng(static_cast<std::uint32_t>(block_size));
    ThoughtBlockTable cpu(cfg);
    Mirror dev(cfg, 2);
    const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {900, 517}, rng);
    std::normal_distribution<float> normal;
    std::vector<float> query(seqs.size() * static_cast<std::size_t>(q_heads) * 64);
    for (float& x : query) x = normal(rng);
    for (int tiles : {1, 4}) {
      cuda::DecodeAttentionConfig ac;
      ac.min_tiles_per_warp = tiles;
      INFO("block_size " << block_size << " min_tiles_per_warp " << tiles);
      const std::vector<float> got = run_batch(dev, seqs, query, q_heads, 0.125f, ac);
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        INFO("batch item " << i);
        const std::size_t off = i * static_cast<std::size_t>(q_heads) * 64;
        std::vector<float> ref(static_cast<std::size_t>(q_heads) * 64);
        paged_decode_attention(cpu, seqs[i], query.data() + off, q_heads, 64, 0.125f, ref.data());
        require_close(got, ref, off, 1e-4f, "split kernel vs CPU paged attention");
        require_close(got,
                      dequantized_dense_oracle(cpu, seqs[i], query.data() + off, q_heads, 0.125f),
                      off, 1e-4f, "split kernel vs dense oracle");
      }
    }
  }
}

TEST_CASE("split paged attention: head_dim 128 and 256, GQA groups 1, 2, 8, sparse tiles") {
  // NVFP4 (with global factors) and ternary blocks of 48 slots: tiles of 32 and 16 slots. In head
  // 1 of sequence 0 only slot 3 of each 16-slot group may stay live, so tiles hold one or two live
  // slots and some 16-slot groups of a live tile are entirely dead (skipped by the kernel).
  const int head_dim = GENERATE(128, 256);
  const std::int64_t group = GENERATE(1, 2, 8);
  ThoughtBlockTableConfig cfg = test::table_config(2, head_dim, 48, BlockFormat::nvfp4,
                                                   BlockFormat::ternary, BlockFormat::nvfp4, 64);
  cfg.global_factors = {300.0f, 0.7f};
  const std::int64_t q_heads = 2 * group;
  std::mt19937 rng(static_cast<std::uint32_t>(head_dim + group));
  ThoughtBlockTable cpu(cfg);
  Mirror dev(cfg, 2);
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {620, 290}, rng);
  std::vector<SlotAddress> sparse;
  for (const ResidentToken& t : cpu.resident_tokens(seqs[0], 1)) {
    if (t.address.block >= 0 && t.address.slot % 16 != 3) sparse.push_back(t.address);
  }
  test::evict_both(cpu, dev, seqs[0], 1, sparse);
  std::int64_t live_blocked = 0;
  for (const ResidentToken& t : cpu.resident_tokens(seqs[0], 1)) {
    live_blocked += t.address.block >= 0;
  }
  REQUIRE(live_blocked > 0);
  std::normal_distribution<float> normal;
  const std::size_t per_seq = static_cast<std::size_t>(q_heads) * head_dim;
  std::vector<float> query(seqs.size() * per_seq);
  for (float& x : query) x = normal(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int tiles : {1, 3}) {
    cuda::DecodeAttentionConfig ac;
    ac.min_tiles_per_warp = tiles;
    INFO("head_dim " << head_dim << " group " << group << " min_tiles_per_warp " << tiles);
    const std::vector<float> got = run_batch(dev, seqs, query, q_heads, scale, ac);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      INFO("batch item " << i);
      const std::size_t off = i * per_seq;
      std::vector<float> ref(per_seq);
      paged_decode_attention(cpu, seqs[i], query.data() + off, q_heads, head_dim, scale,
                             ref.data());
      require_close(got, ref, off, 1e-4f, "split kernel vs CPU paged attention");
      require_close(got, dequantized_dense_oracle(cpu, seqs[i], query.data() + off, q_heads, scale),
                    off, 1e-4f, "split kernel vs dense oracle");
    }
  }
}

TEST_CASE("split paged attention: runs of more than 64 tiles per warp, dead tiles among them") {
  // One split per sequence (target_ctas 1): each warp of sequence 0 walks ~78 tiles, so the tile
  // descriptions are read in three runs of 32 and the copy of tile it + 1 into the other stage
  // crosses each run boundary. In head 1, blocks 120-135 (tiles 30-33 of every warp) are evicted
  // entirely: tiles skipped on either side of the boundary at 32.
  ThoughtBlockTableConfig cfg = test::table_config(2, 64, 32, BlockFormat::nvfp4,
                                                   BlockFormat::ternary, BlockFormat::nvfp4, 400);
  cfg.global_factors = {40.0f, 1.0f};
  const std::int64_t q_heads = 8;  // GQA group 4
  std::mt19937 rng(77);
  ThoughtBlockTable cpu(cfg);
  Mirror dev(cfg, 2);
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {10000, 200}, rng);
  std::vector<SlotAddress> run;
  for (const ResidentToken& t : cpu.resident_tokens(seqs[0], 1)) {
    if (t.address.block >= 120 && t.address.block < 136) run.push_back(t.address);
  }
  REQUIRE(!run.empty());
  test::evict_both(cpu, dev, seqs[0], 1, run);
  std::normal_distribution<float> normal;
  const std::size_t per_seq = static_cast<std::size_t>(q_heads) * 64;
  std::vector<float> query(seqs.size() * per_seq);
  for (float& x : query) x = normal(rng);
  cuda::DecodeAttentionConfig ac;
  ac.target_ctas = 1;
  const std::vector<float> got = run_batch(dev, seqs, query, q_heads, 0.125f, ac);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    INFO("batch item " << i);
    const std::size_t off = i * per_seq;
    std::vector<float> ref(per_seq);
    paged_decode_attention(cpu, seqs[i], query.data() + off, q_heads, 64, 0.125f, ref.data());
    require_close(got, ref, off, 1e-4f, "split kernel vs CPU paged attention");
    require_close(got, dequantized_dense_oracle(cpu, seqs[i], query.data() + off, q_heads, 0.125f),
                  off, 1e-4f, "split kernel vs dense oracle");
  }
}

TEST_CASE("split paged attention: shapes it does not take run the tiled kernel") {
  // f32 blocks, FP8 blocks, a GQA group of 16, and head_dim 32 (the register-direct kernel takes
  // 64, 128 and 256): the batch entry point falls back per sequence.
  const BlockFormat first = GENERATE(BlockFormat::f32, BlockFormat::fp8, BlockFormat::ternary);
  ThoughtBlockTableConfig cfg =
      test::table_config(1, 32, 32, first, BlockFormat::nvfp4, BlockFormat::ternary, 64);
  std::mt19937 rng(3);
  ThoughtBlockTable cpu(cfg);
  Mirror dev(cfg, 2);
  // Whole 80-token segments of the first type (its format `first`), so that sealed groups of
  // that format sit in blocks, not only in the 16-bit staging.
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {300, 170}, rng, {0, 1, 0, 2});
  std::int32_t first_blocks = 0;
  for (std::int32_t s : seqs)
    for (std::int32_t k = 0; k < dev.table.num_blocks(s); ++k)
      first_blocks += dev.table.format_of_block(s, k) == first ? 1 : 0;
  REQUIRE(first_blocks > 0);
  for (std::int64_t q_heads : {4, 16}) {
    std::vector<float> query(seqs.size() * static_cast<std::size_t>(q_heads) * 32);
    std::normal_distribution<float> normal;
    for (float& x : query) x = normal(rng);
    DeviceBuffer<std::uint8_t> view_ws(cuda::paged_batch_bytes(dev.table, seqs.data(), 2));
    const cuda::PagedBatch batch =
        cuda::upload_paged_batch(dev.table, seqs.data(), 2, view_ws.get(), view_ws.size(), nullptr);
    REQUIRE_FALSE(cuda::paged_split_kernel_applies(dev.table, batch, q_heads));
    DeviceBuffer<float> q(query), out(query.size());
    DeviceBuffer<std::uint8_t> ws(
        cuda::paged_decode_attention_batch_workspace_bytes(dev.table, batch, q_heads));
    cuda::paged_decode_attention_batch(dev.table, batch, q.get(), q_heads, 32, 0.2f, out.get(),
                                       ws.get(), ws.size(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = out.download();
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const std::size_t off = i * static_cast<std::size_t>(q_heads) * 32;
      std::vector<float> ref(static_cast<std::size_t>(q_heads) * 32);
      paged_decode_attention(cpu, seqs[i], query.data() + off, q_heads, 32, 0.2f, ref.data());
      require_close(got, ref, off, 1e-4f, "fallback vs CPU paged attention");
    }
  }
}

namespace {

// Softmax attention in double over contiguous bf16 K/V [B, H, T, D] for queries [B, H·G, D].
std::vector<float> dense_bf16_oracle(const std::vector<bf16_t>& k, const std::vector<bf16_t>& v,
                                     const std::vector<float>& q, std::int64_t B, std::int64_t H,
                                     std::int64_t G, std::int64_t T, std::int64_t D, float scale) {
  const std::int64_t Hq = H * G;
  std::vector<float> want(q.size(), 0.0f);
  for (std::int64_t b = 0; b < B && T > 0; ++b) {
    for (std::int64_t qh = 0; qh < Hq; ++qh) {
      const std::int64_t kv = (b * H + qh / G) * T;
      std::vector<double> w(static_cast<std::size_t>(T));
      double mx = -1e300, sum = 0;
      for (std::int64_t j = 0; j < T; ++j) {
        double dot = 0;
        for (std::int64_t d = 0; d < D; ++d)
          dot += double(q[(b * Hq + qh) * D + d]) * to_float(k[(kv + j) * D + d]);
        w[j] = dot * scale;
        mx = std::max(mx, w[j]);
      }
      for (double& x : w) sum += (x = std::exp(x - mx));
      for (std::int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (std::int64_t j = 0; j < T; ++j) acc += w[j] * to_float(v[(kv + j) * D + d]);
        want[(b * Hq + qh) * D + d] = static_cast<float>(acc / sum);
      }
    }
  }
  return want;
}

// Runs the dense split kernel; `parts_above` > 0 requires more than that many partials per query
// head (read off the workspace size: part_acc and part_ml hold rows · (D + 2) floats).
std::vector<float> run_dense(const std::vector<bf16_t>& k, const std::vector<bf16_t>& v,
                             const std::vector<float>& q, std::int64_t B, std::int64_t H,
                             std::int64_t G, std::int64_t T, std::int64_t D, float scale,
                             const cuda::DecodeAttentionConfig& ac, std::int64_t parts_above = 0) {
  const std::int64_t Hq = H * G;
  DeviceBuffer<bf16_t> dk(std::max<std::size_t>(k.size(), 8)),
      dv(std::max<std::size_t>(v.size(), 8));
  if (!k.empty()) {
    KVSIFT_CUDA_CHECK(cudaMemcpy(dk.get(), k.data(), k.size() * 2, cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(dv.get(), v.data(), v.size() * 2, cudaMemcpyHostToDevice));
  }
  DeviceBuffer<float> dq(q), out(q.size());
  KVSIFT_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.size() * 4));
  DeviceBuffer<std::uint8_t> ws(
      cuda::dense_split_decode_attention_workspace_bytes(B, H, T, Hq, D, ac));
  if (parts_above > 0) {
    REQUIRE(ws.size() > static_cast<std::size_t>(parts_above * B * Hq * (D + 2) * 4 + 512));
  }
  cuda::dense_split_decode_attention_bf16(dk.get(), dv.get(), B, H, T, dq.get(), Hq, D, scale,
                                          out.get(), ws.get(), ws.size(), nullptr, ac);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

}  // namespace

TEST_CASE("dense split attention (the benchmark's baseline) equals a double oracle") {
  const std::int64_t B = 2, H = 2, G = 4, D = 64, Hq = H * G;
  const float scale = 0.125f;
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  for (std::int64_t T : {0, 5, 77, 300}) {
    std::vector<bf16_t> k(static_cast<std::size_t>(B * H * T * D)), v(k.size());
    for (bf16_t& x : k) x = from_float<bf16_t>(normal(rng));
    for (bf16_t& x : v) x = from_float<bf16_t>(normal(rng));
    std::vector<float> q(static_cast<std::size_t>(B * Hq * D));
    for (float& x : q) x = normal(rng);
    const std::vector<float> want = dense_bf16_oracle(k, v, q, B, H, G, T, D, scale);
    for (int tiles : {1, 4}) {
      INFO("tokens " << T << " min_tiles_per_warp " << tiles);
      cuda::DecodeAttentionConfig ac;
      ac.min_tiles_per_warp = tiles;
      require_close(run_dense(k, v, q, B, H, G, T, D, scale, ac), want, 0, 1e-4f,
                    "dense split vs double oracle");
    }
  }
}

TEST_CASE("merge of 313 partials per query head (10 chunks of 32 weights)") {
  // One sequence, one KV head, 40,000 tokens: 1,250 tiles, one per warp, 313 splits of 4 warps,
  // each CTA's four warps folded into one partial, so the merge folds 313 partials in 9 full
  // chunks of 32 weights and a last one of 25 (three groups of 8 loads and one of a single row);
  // the two query heads leave two of the merge CTA's four warps without a head.
  const std::int64_t B = 1, H = 1, G = 2, D = 64, T = 40000;
  const float scale = 0.125f;
  std::mt19937 rng(31);
  std::normal_distribution<float> normal;
  std::vector<bf16_t> k(static_cast<std::size_t>(B * H * T * D)), v(k.size());
  for (bf16_t& x : k) x = from_float<bf16_t>(2.0f * normal(rng));
  for (bf16_t& x : v) x = from_float<bf16_t>(normal(rng));
  std::vector<float> q(static_cast<std::size_t>(B * H * G * D));
  for (float& x : q) x = normal(rng);
  cuda::DecodeAttentionConfig ac;
  ac.min_tiles_per_warp = 1;
  require_close(run_dense(k, v, q, B, H, G, T, D, scale, ac, 312),
                dense_bf16_oracle(k, v, q, B, H, G, T, D, scale), 0, 1e-4f,
                "dense split (313 partials) vs double oracle");
}
