// cuda::paged_attention_sparsity (ThinKV §3.1 over the device table) against an independent CPU
// oracle, bit for bit: every resident token of the CPU table read back with its own codec
// (ThoughtBlockTable::read_token), the logits summed on the host in index order (the loop of
// ThinKV::observe_query) and counted by sparsity_from_logits; NaN where that function refuses
// the row (no live token, a NaN logit).
// Covered: NVFP4, FP8, ternary and f32 blocks, NVFP4 global factors, staged 16-bit tokens,
// random evictions, sequences longer than one run of 128 unit descriptions, rounds with fewer
// than 2 units, GQA groups 1, 3, 4, 5, 8, 12 and 20 (a second, partial block of 16 query heads),
// head_dim 64, 128 and 256, blocks of 16, 32 and 48 slots, the batch in an order other than the
// table's, a KV head with no live token, a NaN query in one head, and the argument checks.
// Also the other read of paged_reads.hpp: cuda::paged_gather_keys (host or device sources)
// against read_token, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cpu/attention_sparsity.hpp"
#include "kvsift/backend/cuda/paged_reads.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "paged_mirror.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

// The oracle for one sequence: [q_heads]. query [q_heads, D].
std::vector<float> cpu_sparsity(const ThoughtBlockTable& cpu, std::int32_t seq, const float* query,
                                std::int64_t q_heads, float scale) {
  const std::int64_t H = cpu.config().kv_heads, D = cpu.config().head_dim, G = q_heads / H;
  std::vector<float> out(static_cast<std::size_t>(q_heads));
  std::vector<float> key(static_cast<std::size_t>(D)), value(key.size());
  for (std::int64_t h = 0; h < H; ++h) {
    const std::vector<ResidentToken> tokens =
        cpu.resident_tokens(seq, static_cast<std::int32_t>(h));
    std::vector<float> logits(static_cast<std::size_t>(G) * tokens.size());
    for (std::size_t j = 0; j < tokens.size(); ++j) {
      cpu.read_token(seq, static_cast<std::int32_t>(h), tokens[j].address, key.data(),
                     value.data());
      for (std::int64_t g = 0; g < G; ++g) {
        const float* q = query + (h * G + g) * D;
        float dot = 0.0f;
        for (std::int64_t d = 0; d < D; ++d) dot += q[d] * key[static_cast<std::size_t>(d)];
        logits[static_cast<std::size_t>(g) * tokens.size() + j] = dot * scale;
      }
    }
    for (std::int64_t g = 0; g < G; ++g) {
      float s = NAN;
      try {
        s = sparsity_from_logits(&logits[static_cast<std::size_t>(g) * tokens.size()],
                                 static_cast<std::int64_t>(tokens.size()));
      } catch (const Error&) {
      }
      out[static_cast<std::size_t>(h * G + g)] = s;
    }
  }
  return out;
}

// Where the kernel keeps its logits: no scratch (two sweeps), a scratch every sequence fits in
// (one sweep), or one that only the shorter half fits in (both in one launch).
enum class Scratch { none, all, some };

// The kernel over `seqs` (in that order) with NaN-poisoned output: [seqs, q_heads].
std::vector<float> gpu_sparsity(test::PagedMirror& dev, const std::vector<std::int32_t>& seqs,
                                const std::vector<float>& query, std::int64_t q_heads, float scale,
                                Scratch scratch) {
  const auto n = static_cast<std::int32_t>(seqs.size());
  DeviceBuffer<std::uint8_t> view_ws(cuda::paged_batch_bytes(dev.table, seqs.data(), n));
  const cuda::PagedBatch batch =
      cuda::upload_paged_batch(dev.table, seqs.data(), n, view_ws.get(), view_ws.size(), nullptr);
  DeviceBuffer<float> q(query), out(seqs.size() * static_cast<std::size_t>(q_heads));
  KVSIFT_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.size() * 4));
  std::vector<std::int64_t> slots;
  for (std::int32_t seq : seqs)
    slots.push_back(
        cuda::paged_sparsity_slots(dev.table.num_blocks(seq), dev.table.config().block_size));
  std::sort(slots.begin(), slots.end());
  const std::int64_t max_slots = scratch == Scratch::all ? slots.back() : slots[(n - 1) / 2];
  // Poisoned with -1.7e38: a slot the kernel did not write would be counted below the cut.
  DeviceBuffer<float> logits(scratch == Scratch::none ? 1 : n * q_heads * max_slots);
  KVSIFT_CUDA_CHECK(cudaMemset(logits.get(), 0xfe, logits.size() * 4));
  cuda::paged_attention_sparsity(dev.table, batch, q.get(), q_heads, scale, out.get(), nullptr,
                                 scratch == Scratch::none ? nullptr : logits.get(), max_slots);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

// Same value, or both NaN.
void require_same(const std::vector<float>& got, const std::vector<float>& want,
                  std::size_t offset) {
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("query head " << i << ": got " << got[offset + i] << " want " << want[i]);
    REQUIRE(((std::isnan(got[offset + i]) && std::isnan(want[i])) || got[offset + i] == want[i]));
  }
}

std::vector<float> random_query(std::size_t n, float sigma, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> q(n);
  for (float& x : q) x = normal(rng);
  return q;
}

// Fills both tables, runs the kernel over the sequences in reverse order, compares every head.
void check_against_cpu(const ThoughtBlockTableConfig& cfg, const std::vector<int>& lengths,
                       std::int64_t q_heads, std::uint32_t seed) {
  std::mt19937 rng(seed);
  ThoughtBlockTable cpu(cfg);
  test::PagedMirror dev(cfg, static_cast<std::int32_t>(lengths.size()));
  std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, lengths, rng);
  std::reverse(seqs.begin(), seqs.end());
  const std::size_t D = static_cast<std::size_t>(cfg.head_dim);
  // sigma 2: peaked enough that some logits fall below max + ln 0.01, flat enough that not all do.
  const std::vector<float> query = random_query(seqs.size() * q_heads * D, 2.0f, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (const Scratch scratch : {Scratch::none, Scratch::all, Scratch::some}) {
    const std::vector<float> got = gpu_sparsity(dev, seqs, query, q_heads, scale, scratch);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      INFO("scratch " << static_cast<int>(scratch) << ", batch item " << i << " (sequence "
                      << seqs[i] << ")");
      const std::vector<float> want =
          cpu_sparsity(cpu, seqs[i], query.data() + i * q_heads * D, q_heads, scale);
      for (float w : want) {
        REQUIRE(w > 0.0f);  // the scenario's own check: tokens on both sides of the cut
        REQUIRE(w < 1.0f);
      }
      require_same(got, want, i * static_cast<std::size_t>(q_heads));
    }
  }
}

}  // namespace

TEST_CASE("paged sparsity equals the CPU table's, bit for bit", "[cuda][thinkv]") {
  SECTION("NVFP4 / FP8 / ternary, head_dim 128, blocks of 32, GQA 1, 4, 5, 12 and 20") {
    // 2,600 tokens: over 80 blocks, 160+ units and 3 staging streams: two runs of descriptions.
    const ThoughtBlockTableConfig cfg = test::table_config(
        2, 128, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary, 400);
    const std::int64_t group = GENERATE(1, 4, 5, 12, 20);
    INFO("GQA group " << group);
    check_against_cpu(cfg, {700, 333, 2600, 45}, 2 * group, 5);
  }
  SECTION("f32 / NVFP4 with global factors / FP8, head_dim 256, blocks of 48, GQA 8") {
    ThoughtBlockTableConfig cfg =
        test::table_config(2, 256, 48, BlockFormat::f32, BlockFormat::nvfp4, BlockFormat::fp8, 200);
    cfg.global_factors = {300.0f, 0.7f};
    check_against_cpu(cfg, {900, 517}, 16, 6);
  }
  SECTION("ternary, head_dim 64, blocks of 16, GQA 3") {
    const ThoughtBlockTableConfig cfg = test::table_config(
        3, 64, 16, BlockFormat::ternary, BlockFormat::ternary, BlockFormat::ternary, 300);
    check_against_cpu(cfg, {1000, 130}, 9, 7);
  }
}

TEST_CASE("paged sparsity: NaN for a head without live tokens and for a NaN query only",
          "[cuda][thinkv]") {
  const ThoughtBlockTableConfig cfg = test::table_config(
      2, 64, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary, 100);
  const std::int64_t q_heads = 8, D = 64;  // GQA 4
  std::mt19937 rng(8);
  ThoughtBlockTable cpu(cfg);
  test::PagedMirror dev(cfg, 2);
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {400, 150}, rng);
  std::vector<SlotAddress> all;  // every live token of KV head 1 of the second sequence
  for (const ResidentToken& t : cpu.resident_tokens(seqs[1], 1)) all.push_back(t.address);
  test::evict_both(cpu, dev, seqs[1], 1, all);
  std::vector<float> query = random_query(2 * q_heads * D, 2.0f, rng);
  query[1 * D + 7] = std::nanf("");  // query head 1 of the first sequence
  const float scale = 0.125f;
  const std::vector<float> got = gpu_sparsity(dev, seqs, query, q_heads, scale, Scratch::all);
  for (std::size_t i = 0; i < 2; ++i) {
    INFO("batch item " << i);
    const std::vector<float> want =
        cpu_sparsity(cpu, seqs[i], query.data() + i * q_heads * D, q_heads, scale);
    require_same(got, want, i * q_heads);
  }
  // The oracle's NaNs are where they should be, and nowhere else.
  for (std::int64_t q = 0; q < q_heads; ++q) {
    INFO("query head " << q);
    CHECK(std::isnan(got[static_cast<std::size_t>(q)]) == (q == 1));
    CHECK(std::isnan(got[static_cast<std::size_t>(q_heads + q)]) == (q >= 4));
  }
}

TEST_CASE("paged sparsity rejects bad arguments", "[cuda][thinkv]") {
  const ThoughtBlockTableConfig cfg =
      test::table_config(2, 64, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary, 20);
  std::mt19937 rng(9);
  ThoughtBlockTable cpu(cfg);
  test::PagedMirror dev(cfg, 1);
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {100}, rng);
  DeviceBuffer<std::uint8_t> view_ws(cuda::paged_batch_bytes(dev.table, seqs.data(), 1));
  const cuda::PagedBatch batch =
      cuda::upload_paged_batch(dev.table, seqs.data(), 1, view_ws.get(), view_ws.size(), nullptr);
  DeviceBuffer<float> q(2 * 65 * 64), out(2 * 65);
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_WITH(
      cuda::paged_attention_sparsity(dev.table, batch, q.get(), 3, 0.125f, out.get(), nullptr),
      Contains("q_heads (3) must be a positive multiple of kv_heads (2)"));
  REQUIRE_THROWS_WITH(
      cuda::paged_attention_sparsity(dev.table, batch, q.get(), 130, 0.125f, out.get(), nullptr),
      Contains("GQA group of at most 64"));
  REQUIRE_THROWS_WITH(
      cuda::paged_attention_sparsity(dev.table, batch, q.get(), 4, 0.0f, out.get(), nullptr),
      Contains("softmax_scale (0) must be positive"));
  REQUIRE_THROWS_WITH(
      cuda::paged_attention_sparsity(dev.table, batch, nullptr, 4, 0.125f, out.get(), nullptr),
      Contains("query and out must not be null"));
  REQUIRE_THROWS_WITH(cuda::paged_attention_sparsity(dev.table, batch, q.get(), 4, 0.125f,
                                                     out.get(), nullptr, out.get(), 0),
                      Contains("max_slots (0) must be positive with a logits scratch"));
}

TEST_CASE("paged_gather_keys and its uploaded form read every live key as the CPU table does",
          "[cuda][thinkv]") {
  // NVFP4 with global factors, FP8 and ternary blocks, staged tokens, evictions in one head: the
  // keys of every live token of both sequences and heads, through host sources (checked, copied
  // by the call) and through sources already on the device, against read_token bit for bit.
  using Catch::Matchers::Contains;
  ThoughtBlockTableConfig cfg = test::table_config(2, 128, 32, BlockFormat::nvfp4, BlockFormat::fp8,
                                                   BlockFormat::ternary, 100);
  cfg.global_factors = {300.0f, 0.7f};
  std::mt19937 rng(11);
  ThoughtBlockTable cpu(cfg);
  test::PagedMirror dev(cfg, 2);
  const std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {300, 170}, rng);
  std::vector<SlotAddress> half;  // every other live token of KV head 1 of the first sequence
  const std::vector<ResidentToken> head1 = cpu.resident_tokens(seqs[0], 1);
  for (std::size_t i = 0; i < head1.size(); i += 2) half.push_back(head1[i].address);
  test::evict_both(cpu, dev, seqs[0], 1, half);
  const std::size_t D = 128;
  std::vector<cuda::PagedKeySource> sources;
  std::vector<float> want;
  int staged = 0;
  for (std::int32_t seq : seqs) {
    for (std::int32_t h = 0; h < 2; ++h) {
      for (const ResidentToken& t : cpu.resident_tokens(seq, h)) {
        sources.push_back(dev.table.key_source(seq, h, t.address));
        std::vector<float> key(D), value(D);
        cpu.read_token(seq, h, t.address, key.data(), value.data());
        want.insert(want.end(), key.begin(), key.end());
        staged += t.address.block == kStagedBlock;
      }
    }
  }
  REQUIRE(staged > 0);
  const auto rows = static_cast<std::int64_t>(sources.size());
  DeviceBuffer<std::uint8_t> ws(cuda::paged_gather_keys_workspace_bytes(rows));
  DeviceBuffer<float> from_host(want.size()), from_device(want.size());
  cuda::paged_gather_keys(dev.table, sources.data(), rows, from_host.get(), ws.get(), ws.size(),
                          nullptr);
  DeviceBuffer<cuda::PagedKeySource> uploaded(sources);
  cuda::paged_gather_keys_uploaded(dev.table, uploaded.get(), rows, from_device.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  for (const DeviceBuffer<float>* out : {&from_host, &from_device}) {
    const std::vector<float> got = out->download();
    std::size_t differ = 0;
    for (std::size_t i = 0; i < want.size(); ++i) differ += std::memcmp(&got[i], &want[i], 4) != 0;
    INFO((out == &from_host ? "host sources" : "device sources"));
    REQUIRE(differ == 0);
  }
  // Errors name the argument; nothing is enqueued.
  std::vector<cuda::PagedKeySource> bad = sources;
  bad[3].format = 9;
  REQUIRE_THROWS_WITH(cuda::paged_gather_keys(dev.table, bad.data(), rows, from_host.get(),
                                              ws.get(), ws.size(), nullptr),
                      Contains("source 3 (format 9") &&
                          Contains("does not come from DevicePagedTable::key_source"));
  REQUIRE_THROWS_WITH(cuda::paged_gather_keys(dev.table, sources.data(), rows, from_host.get(),
                                              ws.get(), ws.size() / 2, nullptr),
                      Contains("is too small"));
  REQUIRE_THROWS_WITH(
      cuda::paged_gather_keys_uploaded(dev.table, uploaded.get(), -1, from_device.get(), nullptr),
      Contains("rows (-1) outside [0, 2^31)"));
  REQUIRE_THROWS_WITH(
      cuda::paged_gather_keys_uploaded(dev.table, nullptr, rows, from_device.get(), nullptr),
      Contains("sources and out must not be null"));
}
