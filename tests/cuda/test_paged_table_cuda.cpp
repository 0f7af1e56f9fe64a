// The device Continuous Thinking table (kvsift::cuda::DevicePagedTable, docs/algorithms.md §3.4)
// against the CPU reference ThoughtBlockTable, driven by the same random operations:
//   - append: after every batch the device bytes of every block equal block_storage() bit for bit
//     (tokens staged at 16 bits, keys and values, until 16 of one type arrive in a head; the group
//     then quantized on the device with fresh scales into the lowest free 16-slot run), the device
//     masks equal free_mask(), slot positions and staged rows equal the CPU's, and the device
//     table's resident bytes equal resident_bytes();
//   - eviction: mask bits or staged rows only, the whole device pool byte-identical before and
//     after; blocks left with no live slot go back to their pool on both sides;
//   - append through prepare_append (the plan packed ahead, in pinned memory) every other batch;
//   - attention: cuda::paged_decode_attention equals the CPU paged_decode_attention (1e-4
//     relative) and a dense double-precision oracle over the retained tokens read back from the
//     CPU table; the dense bf16 kernel equals the same kind of oracle.
// Formats f32, NVFP4 (with and without global factors), FP8, ternary; f32 and bf16 inputs; block
// sizes 16, 32, 80, 144 (a mask word boundary inside a tile row), sequence release and frame reuse
// (stale bytes must be re-zeroed), splits forced from 1 to many; both refill rules (with regroup,
// a pinned run's survivors re-quantized on the device with the new tokens, bit for bit as on the
// CPU).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/paged_table.hpp"
#include "kvsift/paged/paged_attention.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "paged_mirror.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using test::DeviceBuffer;

namespace {

using test::PagedMirror;

void require_same_blocks(const ThoughtBlockTable& cpu, PagedMirror& dev, std::int32_t seq) {
  test::require_same_table(cpu, dev, seq);
  test::require_same_bytes(cpu, dev);
}

// Dense attention over the retained tokens (read back from the CPU table), two-pass, in double.
std::vector<float> dense_oracle(const ThoughtBlockTable& cpu, std::int32_t seq,
                                const std::vector<float>& query,  // [q_heads, D]
                                std::int64_t q_heads, float scale) {
  const std::int64_t H = cpu.config().kv_heads, D = cpu.config().head_dim, G = q_heads / H;
  std::vector<float> out(static_cast<std::size_t>(q_heads * D), 0.0f);
  std::vector<float> k(D), v(D);
  for (std::int64_t h = 0; h < H; ++h) {
    std::vector<std::vector<float>> K, V;
    for (const ResidentToken& t : cpu.resident_tokens(seq, static_cast<std::int32_t>(h))) {
      cpu.read_token(seq, static_cast<std::int32_t>(h), t.address, k.data(), v.data());
      K.push_back(k);
      V.push_back(v);
    }
    if (K.empty()) continue;
    test::dense_attention_double(query.data(), h, G, D, scale, K, V, out);
  }
  return out;
}

void require_close(const std::vector<float>& got, const std::vector<float>& want, float tol,
                   const char* what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= tol * (1.0f + std::fabs(want[i])))) {
      INFO(what << ": element " << i << " got " << got[i] << " want " << want[i]);
      REQUIRE(std::fabs(got[i] - want[i]) <= tol * (1.0f + std::fabs(want[i])));
    }
  }
}

// Runs the device attention for `seq` with NaN-poisoned output.
std::vector<float> device_attention(PagedMirror& dev, std::int32_t seq,
                                    const std::vector<float>& query, std::int64_t q_heads,
                                    float scale, std::int32_t target_ctas) {
  const std::int64_t D = dev.table.config().head_dim;
  cuda::DecodeAttentionConfig ac;
  ac.target_ctas = target_ctas;
  DeviceBuffer<float> q(query), out(query.size());
  KVSIFT_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.size() * 4));
  DeviceBuffer<std::uint8_t> ws(
      cuda::paged_decode_attention_workspace_bytes(dev.table, seq, q_heads, ac));
  cuda::paged_decode_attention(dev.table, seq, q.get(), q_heads, D, scale, out.get(), ws.get(),
                               ws.size(), nullptr, ac);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

// Writes the recorded batch (K/V rows in recording order, [tokens, H, D], bf16-representable when
// bf16) through DevicePagedTable::append in f32 or bf16, and clears the rows.
void append_batch(PagedMirror& dev, std::vector<float>& batch_k, std::vector<float>& batch_v,
                  bool bf16, DeviceBuffer<std::uint8_t>& ws) {
  if (bf16) {
    std::vector<bf16_t> k(batch_k.size()), v(batch_v.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = from_float<bf16_t>(batch_k[i]);
      v[i] = from_float<bf16_t>(batch_v[i]);
    }
    DeviceBuffer<bf16_t> dk(k), dv(v);
    dev.table.append(dk.get(), dv.get(), DType::bf16, ws.get(), ws.size(), nullptr);
  } else {
    DeviceBuffer<float> dk(batch_k), dv(batch_v);
    dev.table.append(dk.get(), dv.get(), DType::f32, ws.get(), ws.size(), nullptr);
  }
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  batch_k.clear();
  batch_v.clear();
}

// Appends one token (k, v: [H, D], rounded to bf16 first when `bf16`) to `seq` of both tables and
// its rows to the batch being recorded.
void append_token(ThoughtBlockTable& cpu, PagedMirror& dev, std::int32_t seq, std::vector<float> k,
                  std::vector<float> v, bool bf16, std::vector<float>& batch_k,
                  std::vector<float>& batch_v) {
  if (bf16) {
    for (float& x : k) x = to_float(from_float<bf16_t>(x));
    for (float& x : v) x = to_float(from_float<bf16_t>(x));
  }
  std::vector<SlotAddress> where(static_cast<std::size_t>(cpu.config().kv_heads));
  cpu.append(seq, k.data(), v.data(), cpu.config().kv_heads, cpu.config().head_dim, where.data());
  dev.table.record_append(cpu, seq, where.data());
  batch_k.insert(batch_k.end(), k.begin(), k.end());
  batch_v.insert(batch_v.end(), v.begin(), v.end());
}

// The device paged attention of `seq` for `query` ([q_heads, D]) against the CPU's and the dense
// oracle over the retained tokens.
void check_attention(const ThoughtBlockTable& cpu, PagedMirror& dev, std::int32_t seq,
                     const std::vector<float>& query, std::int64_t q_heads, float scale,
                     std::int32_t target_ctas) {
  std::vector<float> want(query.size());
  paged_decode_attention(cpu, seq, query.data(), q_heads, cpu.config().head_dim, scale,
                         want.data());
  const std::vector<float> got = device_attention(dev, seq, query, q_heads, scale, target_ctas);
  require_close(got, want, 1e-4f, "device vs CPU paged attention");
  require_close(got, dense_oracle(cpu, seq, query, q_heads, scale), 1e-4f,
                "device paged vs dense oracle over retained tokens");
}

// One sequence of a CPU table with 2 KV heads of head_dim 32 and its mirror, fed by hand: add()
// appends and records n tokens (keys N(0, key_scale²), values N(0, 1)), flush() writes them on
// the device and checks every block against the CPU's.
struct TwoHeadFeed {
  ThoughtBlockTable& cpu;
  PagedMirror& dev;
  std::int32_t seq;
  std::mt19937 rng;
  std::normal_distribution<float> normal;
  std::vector<float> ks, vs;  // [tokens, 2, 32]

  void add(int n, float key_scale) {
    for (int i = 0; i < n; ++i) {
      std::vector<float> k(64), v(64);
      for (float& x : k) x = normal(rng) * key_scale;
      for (float& x : v) x = normal(rng);
      append_token(cpu, dev, seq, k, v, false, ks, vs);
    }
  }
  void flush() {
    DeviceBuffer<std::uint8_t> ws(dev.table.append_workspace_bytes());
    append_batch(dev, ks, vs, false, ws);
    require_same_blocks(cpu, dev, seq);
  }
};

struct Scenario {
  ThoughtBlockTableConfig cfg;
  std::int64_t group = 1;  // query heads per KV head
  bool bf16_input = false;
};

// Random appends in batches, per-head evictions (reuse), segment switches, sequence release and
// re-creation, queries; checks bytes, masks and attention throughout. Returns how the CPU table
// refilled its quantized blocks.
RefillStats run_scenario(const Scenario& sc, std::uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint32_t>(n)); };
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const ThoughtBlockTableConfig& cfg = sc.cfg;
  const std::int64_t H = cfg.kv_heads, D = cfg.head_dim, q_heads = H * sc.group;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  INFO("seed " << seed << " kv_heads " << H << " q_heads " << q_heads << " head_dim " << D
               << " block_size " << cfg.block_size << " formats "
               << block_format_name(cfg.reasoning) << "/" << block_format_name(cfg.execution) << "/"
               << block_format_name(cfg.transition) << (sc.bf16_input ? " bf16" : " f32")
               << " input");
  ThoughtBlockTable cpu(cfg);
  PagedMirror dev(cfg, 2);
  std::int32_t seqs[2] = {cpu.create_sequence(), cpu.create_sequence()};
  for (std::int32_t s : seqs) cpu.open_segment(s, ThoughtType::reasoning);

  // The batch being recorded: K/V rows in recording order.
  std::vector<float> batch_k, batch_v;  // [tokens, H, D] (bf16-representable in bf16 mode)
  int flushes = 0;
  auto flush = [&]() {
    if (dev.table.pending_tokens() == 0) return;
    DeviceBuffer<std::uint8_t> ws(dev.table.append_workspace_bytes());
    if (flushes++ % 2 == 0) {  // every other batch through prepare_append: the same plan
      const std::int32_t pending = dev.table.pending_tokens();
      dev.table.prepare_append();
      REQUIRE(dev.table.pending_tokens() == pending);
      REQUIRE(dev.table.append_workspace_bytes() == ws.size());
    }
    append_batch(dev, batch_k, batch_v, sc.bf16_input, ws);
  };

  int checks = 0;
  for (int step = 0; step < steps; ++step) {
    const std::int32_t seq = seqs[pick(2)];
    const int op = pick(20);
    if (op == 0) {
      cpu.open_segment(seq, static_cast<ThoughtType>(pick(3)));
    } else if (op <= 11) {
      // Append: mostly N(0, 2²) keys, sometimes an outlier (dominates its groups' scales) or a
      // zero key (zero scales).
      std::vector<float> k(static_cast<std::size_t>(H * D)), v(k.size());
      const int kind = pick(12);
      for (float& x : k) x = kind == 0 ? 0.0f : normal(rng) * (kind == 1 ? 60.0f : 2.0f);
      for (float& x : v) x = normal(rng) * (kind == 2 ? 30.0f : 1.0f);
      append_token(cpu, dev, seq, k, v, sc.bf16_input, batch_k, batch_v);
    } else if (op <= 13) {
      flush();
      require_same_blocks(cpu, dev, seq);
      ++checks;
    } else if (op <= 16) {
      // Evict a random subset of one head's live tokens (staged ones included): bits only, and
      // sometimes (pick(4) == 0) a whole head, which frees blocks once every head is empty.
      flush();
      const std::int32_t h = pick(static_cast<int>(H));
      const int odds = pick(4) == 0 ? 1 : 3;
      std::vector<SlotAddress> victims;
      for (const ResidentToken& t : cpu.resident_tokens(seq, h)) {
        if (pick(odds) == 0) victims.push_back(t.address);
      }
      const std::vector<std::uint8_t> before = dev.storage.download();
      test::evict_both(cpu, dev, seq, h, victims);
      const bool storage_unchanged = dev.storage.download() == before;
      REQUIRE(storage_unchanged);
      require_same_blocks(cpu, dev, seq);
    } else if (op <= 18) {
      flush();
      std::vector<float> q(static_cast<std::size_t>(q_heads * D));
      for (float& x : q) x = normal(rng);
      const std::int32_t ctas[3] = {1, 5, 264};
      check_attention(cpu, dev, seq, q, q_heads, scale, ctas[pick(3)]);
      ++checks;
    } else if (pick(4) == 0) {
      // Release and re-create: the frames go back to the pool and are handed out again with
      // stale bytes, which the device must zero as the CPU table does.
      flush();
      cpu.release_sequence(seq);
      dev.table.release_sequence(seq, nullptr);
      const std::int32_t again = cpu.create_sequence();
      REQUIRE(again == seq);
      cpu.open_segment(seq, static_cast<ThoughtType>(pick(3)));
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      require_same_blocks(cpu, dev, seq);
    }
  }
  flush();
  for (std::int32_t s : seqs) require_same_blocks(cpu, dev, s);
  REQUIRE(checks > 0);
  return cpu.refill_stats();
}

// A history where pinned runs are common (refill = regroup): rounds of 40 tokens of one random
// thought type into one of two sequences, each followed by evicting about a third of one random
// head's tokens; bytes, masks, positions and staged rows checked after every append and eviction,
// attention every fourth round. Returns how the CPU table refilled its quantized blocks.
RefillStats run_regroup_history(const Scenario& sc, std::uint32_t seed, int rounds) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const ThoughtBlockTableConfig& cfg = sc.cfg;
  const std::int64_t H = cfg.kv_heads, D = cfg.head_dim, q_heads = H * sc.group;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  ThoughtBlockTable cpu(cfg);
  PagedMirror dev(cfg, 2);
  const std::int32_t seqs[2] = {cpu.create_sequence(), cpu.create_sequence()};
  std::vector<float> batch_k, batch_v;
  for (int round = 0; round < rounds; ++round) {
    INFO("seed " << seed << " round " << round);
    const std::int32_t seq = seqs[rng() % 2];
    cpu.open_segment(seq, static_cast<ThoughtType>(rng() % 3));
    for (int t = 0; t < 40; ++t) {
      std::vector<float> k(static_cast<std::size_t>(H * D)), v(k.size());
      for (float& x : k) x = normal(rng) * 2.0f;
      for (float& x : v) x = normal(rng);
      append_token(cpu, dev, seq, k, v, sc.bf16_input, batch_k, batch_v);
    }
    DeviceBuffer<std::uint8_t> ws(dev.table.append_workspace_bytes());
    append_batch(dev, batch_k, batch_v, sc.bf16_input, ws);
    require_same_blocks(cpu, dev, seq);
    const std::int32_t h = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(H));
    std::vector<SlotAddress> victims;
    for (const ResidentToken& t : cpu.resident_tokens(seq, h))
      if (rng() % 3 == 0) victims.push_back(t.address);
    test::evict_both(cpu, dev, seq, h, victims);
    require_same_blocks(cpu, dev, seq);
    if (round % 4 == 3) {
      std::vector<float> q(static_cast<std::size_t>(q_heads * D));
      for (float& x : q) x = normal(rng);
      check_attention(cpu, dev, seq, q, q_heads, scale, 5);
    }
  }
  for (std::int32_t s : seqs) require_same_blocks(cpu, dev, s);
  return cpu.refill_stats();
}

ThoughtBlockTableConfig config(int kv_heads, int head_dim, int block_size, BlockFormat r,
                               BlockFormat e, BlockFormat t) {
  ThoughtBlockTableConfig c;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.block_size = block_size;
  c.num_blocks = 96;
  c.reasoning = r;
  c.execution = e;
  c.transition = t;
  return c;
}

}  // namespace

TEST_CASE("device CT table: bytes, masks and attention match the CPU table (R4 E4 T2)") {
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    Scenario sc;
    sc.cfg = config(1 + static_cast<int>(seed % 3), seed % 2 ? 32 : 16, seed % 2 ? 16 : 32,
                    BlockFormat::nvfp4, BlockFormat::nvfp4, BlockFormat::ternary);
    sc.group = 1 + seed % 4;
    sc.bf16_input = seed % 2 == 0;
    run_scenario(sc, seed, 700);
  }
}

TEST_CASE("device CT table: FP8, f32 and mixed formats, NVFP4 global factors") {
  Scenario fp8;
  fp8.cfg = config(2, 32, 32, BlockFormat::fp8, BlockFormat::fp8, BlockFormat::fp8);
  fp8.group = 2;
  run_scenario(fp8, 11, 600);

  Scenario full;
  full.cfg = config(2, 16, 16, BlockFormat::f32, BlockFormat::f32, BlockFormat::f32);
  full.group = 3;
  full.bf16_input = true;
  run_scenario(full, 12, 600);

  Scenario mixed;  // R4 E8 T(f32), per-head g
  mixed.cfg = config(3, 16, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::f32);
  mixed.cfg.global_factors = {37.0f, 0.5f, 448.0f * 6.0f / 9.0f};
  mixed.group = 2;
  run_scenario(mixed, 13, 600);
}

TEST_CASE("device CT table: block sizes with several tiles and mask words, head_dim 128") {
  Scenario s80;  // tiles of 32, 32, 16 slots; the third tile starts in mask word 1
  s80.cfg = config(2, 32, 80, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary);
  s80.group = 4;
  run_scenario(s80, 21, 900);

  Scenario s144;
  s144.cfg = config(1, 16, 144, BlockFormat::ternary, BlockFormat::nvfp4, BlockFormat::f32);
  s144.bf16_input = true;
  run_scenario(s144, 22, 900);

  Scenario wide;
  wide.cfg = config(2, 128, 32, BlockFormat::nvfp4, BlockFormat::nvfp4, BlockFormat::ternary);
  wide.group = 4;
  run_scenario(wide, 23, 500);
}

TEST_CASE("device CT table: refill = regroup re-quantizes pinned runs as the CPU table does") {
  // By hand first. R4, 2 heads, blocks of 32: positions 0-31 fill block 0. Head 0 loses 0-9 (run
  // 0 keeps 6 survivors), head 1 loses 16-23 (run 1 keeps 8). Positions 32-47 (keys ×4) complete
  // a group in both heads with no free run: head 0 regroups run 0 (32-41 into slots 0-9, 42-47
  // stay staged), head 1 run 1 (32-39 into slots 16-23, 40-47 stay staged); no block is taken.
  ThoughtBlockTableConfig cfg =
      config(2, 32, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary);
  cfg.num_blocks = 8;
  cfg.refill = RefillRule::regroup;
  cfg.global_factors = {0.75f, 3.0f};
  ThoughtBlockTable cpu(cfg);
  PagedMirror dev(cfg, 1);
  const std::int32_t seq = cpu.create_sequence();
  TwoHeadFeed feed{cpu, dev, seq, std::mt19937(5), {}, {}, {}};
  cpu.open_segment(seq, ThoughtType::reasoning);
  feed.add(32, 1.0f);
  feed.flush();
  const std::vector<std::uint8_t> sealed = dev.storage.download();
  for (std::int32_t h = 0; h < 2; ++h) {
    std::vector<SlotAddress> victims;
    for (const ResidentToken& t : cpu.resident_tokens(seq, h)) {
      if (h == 0 ? t.position < 10 : t.position >= 16 && t.position < 24)
        victims.push_back(t.address);
    }
    test::evict_both(cpu, dev, seq, h, victims);
  }
  feed.add(16, 4.0f);
  feed.flush();
  REQUIRE(cpu.num_blocks(seq) == 1);
  REQUIRE(cpu.refill_stats().regroups == 2);
  REQUIRE(cpu.refill_stats().survivors_requantized == 6 + 8);
  REQUIRE(dev.table.staged_count(seq, ThoughtType::reasoning, 0) == 6);
  REQUIRE(dev.table.staged_count(seq, ThoughtType::reasoning, 1) == 8);
  for (std::int32_t h = 0; h < 2; ++h) {
    for (const ResidentToken& t : cpu.resident_tokens(seq, h)) {
      if (t.address.block != 0) continue;
      const std::int32_t first_new = h == 0 ? 0 : 16, n_new = h == 0 ? 10 : 8;
      const std::int32_t s = t.address.slot;
      const std::int32_t want = s >= first_new && s < first_new + n_new ? 32 + s - first_new : s;
      INFO("head " << h << " slot " << s);
      REQUIRE(t.position == want);
    }
  }
  // The survivors' codes changed (a second rounding under the new, larger scales).
  REQUIRE(dev.storage.download() != sealed);

  // Then random histories where pinned runs are common, and the general scenario (segment
  // switches, releases, whole-head evictions) under the rule.
  Scenario mixed;  // R4 E8 T2, per-head g, f >= 4
  mixed.cfg = config(3, 32, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary);
  mixed.cfg.global_factors = {37.0f, 0.5f, 2.0f};
  mixed.cfg.refill = RefillRule::regroup;
  mixed.cfg.regroup_min_free = 4;
  mixed.group = 2;
  const RefillStats a = run_regroup_history(mixed, 31, 40);
  INFO("mixed: regroups " << a.regroups << ", runs " << a.runs);
  REQUIRE(a.regroups >= 100);
  run_scenario(mixed, 33, 900);
  Scenario wide;  // bf16 inputs, blocks of 80 (the fifth run in mask word 1), the default f >= 8
  wide.cfg = config(2, 64, 80, BlockFormat::ternary, BlockFormat::nvfp4, BlockFormat::f32);
  wide.cfg.refill = RefillRule::regroup;
  wide.bf16_input = true;
  wide.group = 4;
  const RefillStats b = run_regroup_history(wide, 32, 40);
  INFO("wide: regroups " << b.regroups << ", runs " << b.runs);
  REQUIRE(b.regroups >= 25);
}

TEST_CASE("device CT eviction moves no byte of block storage") {
  ThoughtBlockTableConfig cfg =
      config(2, 32, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary);
  ThoughtBlockTable cpu(cfg);
  PagedMirror dev(cfg, 1);
  const std::int32_t seq = cpu.create_sequence();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> ks, vs;
  for (int i = 0; i < 150; ++i) {  // all three formats: 3 sealed groups and 2 staged per type
    if (i % 50 == 0) cpu.open_segment(seq, static_cast<ThoughtType>(i / 50));
    std::vector<float> k(64), v(64);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    std::vector<SlotAddress> where(2);
    cpu.append(seq, k.data(), v.data(), 2, 32, where.data());
    dev.table.record_append(cpu, seq, where.data());
    ks.insert(ks.end(), k.begin(), k.end());
    vs.insert(vs.end(), v.begin(), v.end());
  }
  DeviceBuffer<float> dk(ks), dv(vs);
  DeviceBuffer<std::uint8_t> ws(dev.table.append_workspace_bytes());
  dev.table.append(dk.get(), dv.get(), DType::f32, ws.get(), ws.size(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  require_same_blocks(cpu, dev, seq);
  for (int t = 0; t < 3; ++t) {
    for (std::int32_t h = 0; h < 2; ++h) {
      REQUIRE(dev.table.staged_count(seq, static_cast<ThoughtType>(t), h) == 2);
    }
  }

  const std::vector<std::uint8_t> before = dev.storage.download();
  std::int64_t evicted = 0;
  for (std::int32_t h = 0; h < 2; ++h) {
    std::vector<SlotAddress> victims;
    for (const ResidentToken& t : cpu.resident_tokens(seq, h)) {
      if ((t.position + h) % 2 == 0) victims.push_back(t.address);
    }
    test::evict_both(cpu, dev, seq, h, victims);
    evicted += static_cast<std::int64_t>(victims.size());
  }
  REQUIRE(evicted == 150);
  const bool storage_unchanged = dev.storage.download() == before;  // the whole pool
  REQUIRE(storage_unchanged);
  require_same_blocks(cpu, dev, seq);  // masks and staged rows now carry the evictions
  for (int t = 0; t < 3; ++t) {
    for (std::int32_t h = 0; h < 2; ++h) {
      REQUIRE(dev.table.staged_count(seq, static_cast<ThoughtType>(t), h) == 1);
    }
  }
}

TEST_CASE("device CT table: one evict_slots batch over sequences and heads as the CPU table") {
  // Three sequences after random histories with per-head evictions; then one batch evicts about
  // half of every (sequence, head)'s tokens (staged ones included) on both tables, with the
  // addresses of before the batch; blocks emptied inside the batch go back to their pools. The
  // CPU table's evict_slots equals evicting head by head (test_thought_block_table). Then new
  // sequences take the freed blocks, and every table still matches.
  ThoughtBlockTableConfig cfg =
      config(2, 32, 32, BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary);
  cfg.num_blocks = 160;
  ThoughtBlockTable cpu(cfg);
  PagedMirror dev(cfg, 5);
  std::mt19937 rng(17);
  std::vector<std::int32_t> seqs = test::fill_random(cpu, dev, {600, 410, 250}, rng);
  std::vector<EvictionSlot> batch;
  int staged = 0;
  for (std::int32_t s : seqs) {
    for (std::int32_t h = 0; h < 2; ++h) {
      for (const ResidentToken& t : cpu.resident_tokens(s, h)) {
        // Every token of blocks 0-3 of the first sequence (in both heads: they empty) and about
        // half of all others.
        const bool whole = s == seqs[0] && t.address.block >= 0 && t.address.block < 4;
        if (!whole && rng() % 2 == 0) continue;
        batch.push_back(EvictionSlot{s, h, t.address});
        staged += t.address.block == kStagedBlock;
      }
    }
  }
  std::shuffle(batch.begin(), batch.end(), rng);
  REQUIRE(staged > 0);
  DeviceBuffer<std::uint8_t> ws(dev.table.evict_workspace_bytes(batch.size()));
  // Errors first: nothing changes on either side.
  std::vector<EvictionSlot> twice = {batch[0], batch[1], batch[0]};
  REQUIRE_THROWS_WITH(dev.table.evict_slots(twice, ws.get(), ws.size(), nullptr),
                      Contains("listed twice"));
  std::vector<EvictionSlot> bad_seq = {batch[0], EvictionSlot{7, 0, batch[0].address}};
  REQUIRE_THROWS_WITH(dev.table.evict_slots(bad_seq, ws.get(), ws.size(), nullptr),
                      Contains("sequence 7 outside [0, max_sequences = 5)"));
  REQUIRE_THROWS_WITH(dev.table.evict_slots(batch, ws.get(), 0, nullptr),
                      Contains("workspace of 0 bytes is too small"));
  for (std::int32_t s : seqs) test::require_same_table(cpu, dev, s);
  const std::int32_t used = cpu.used_blocks();
  cpu.evict_slots(batch);
  // One call, or its two halves with the device's share enqueued through a workspace of a few
  // evictions (pieces of 16: several launches, the staged masks in the first ones).
  const bool halves = GENERATE(false, true);
  if (!halves) {
    dev.table.evict_slots(batch, ws.get(), ws.size(), nullptr);
  } else {
    const cuda::DevicePagedTable::DeviceEvictions device = dev.table.apply_evictions(batch);
    REQUIRE(device.slots.size() > 64);
    REQUIRE(!device.staged.empty());
    REQUIRE_THROWS_WITH(dev.table.enqueue_evictions(device, ws.get(), 0, nullptr),
                        Contains("workspace of 0 bytes is too small"));
    const std::size_t small = dev.table.evict_workspace_bytes(1);
    REQUIRE(dev.table.evict_workspace_bytes(64) > small);
    dev.table.enqueue_evictions(device, ws.get(), small, nullptr);
  }
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  REQUIRE(cpu.used_blocks() < used);  // blocks emptied by the batch went back to the pools
  for (std::int32_t s : seqs) test::require_same_table(cpu, dev, s);
  test::require_same_bytes(cpu, dev);
  const std::vector<std::int32_t> more = test::fill_random(cpu, dev, {300, 200}, rng);
  for (std::int32_t s : seqs) test::require_same_table(cpu, dev, s);
  for (std::int32_t s : more) test::require_same_table(cpu, dev, s);
}

TEST_CASE("device CT table: freed blocks, refilled runs with fresh scales, per-format pools") {
  // R4 E(f32) T2, 2 heads, blocks of 32: a block holds two 16-token groups.
  ThoughtBlockTableConfig cfg =
      config(2, 32, 32, BlockFormat::nvfp4, BlockFormat::f32, BlockFormat::ternary);
  cfg.num_blocks = 8;
  ThoughtBlockTable cpu(cfg);
  cuda::PagedPoolFrames pools;
  pools.frames[static_cast<int>(BlockFormat::nvfp4)] = 3;
  pools.frames[static_cast<int>(BlockFormat::ternary)] = 2;
  PagedMirror dev(cfg, 1, pools);
  // Pools sized by block_bytes.hpp: a ternary frame takes ternary bytes, f32 gets num_blocks.
  for (BlockFormat f : {BlockFormat::nvfp4, BlockFormat::ternary, BlockFormat::f32}) {
    const BlockBytes b = block_bytes(f, 32, 32, 2);
    const int i = static_cast<int>(f);
    INFO("format " << block_format_name(f));
    REQUIRE(dev.sizes.frame_bytes[i] == (b.codes + b.scales + 255) / 256 * 256);
  }
  REQUIRE(dev.sizes.frame_bytes[static_cast<int>(BlockFormat::ternary)] <
          dev.sizes.frame_bytes[static_cast<int>(BlockFormat::nvfp4)]);
  REQUIRE(dev.sizes.pool_frames[static_cast<int>(BlockFormat::f32)] == 8);
  REQUIRE(dev.sizes.pool_frames[static_cast<int>(BlockFormat::fp8)] == 0);

  const std::int32_t seq = cpu.create_sequence();
  TwoHeadFeed feed{cpu, dev, seq, std::mt19937(17), {}, {}, {}};
  cpu.open_segment(seq, ThoughtType::reasoning);
  feed.add(70, 1.0f);  // 4 groups in 2 NVFP4 blocks, 6 staged; one batch seals 4 groups
  cpu.open_segment(seq, ThoughtType::transition);
  feed.add(20, 1.0f);  // 1 ternary group, 4 staged
  cpu.open_segment(seq, ThoughtType::execution);
  feed.add(3, 1.0f);  // f32 tokens
  feed.flush();
  REQUIRE(cpu.num_blocks(seq) == 4);
  REQUIRE(dev.table.used_frames(BlockFormat::nvfp4) == 2);
  REQUIRE(dev.table.used_frames(BlockFormat::ternary) == 1);
  REQUIRE(dev.table.used_frames(BlockFormat::f32) == 1);
  // page_version counts page-table changes: 4 blocks taken.
  REQUIRE(dev.table.page_version() == 4);

  // Every token of the first NVFP4 block (positions 0-31) in both heads: the block is freed.
  for (std::int32_t h = 0; h < 2; ++h) {
    std::vector<SlotAddress> victims;
    for (const ResidentToken& t : cpu.resident_tokens(seq, h)) {
      if (t.address.block == 0) victims.push_back(t.address);
    }
    REQUIRE(victims.size() == 32);
    test::evict_both(cpu, dev, seq, h, victims);
  }
  REQUIRE(cpu.num_blocks(seq) == 3);
  require_same_blocks(cpu, dev, seq);
  REQUIRE(dev.table.used_frames(BlockFormat::nvfp4) == 1);
  REQUIRE(dev.table.page_version() == 5);  // one block freed

  // Head 0 only: slots 16-31 of the remaining NVFP4 block (positions 48-63): a free run there.
  {
    std::vector<SlotAddress> victims;
    for (const ResidentToken& t : cpu.resident_tokens(seq, 0)) {
      if (t.position >= 48 && t.position < 64) victims.push_back(t.address);
    }
    REQUIRE(victims.size() == 16);
    test::evict_both(cpu, dev, seq, 0, victims);
  }
  REQUIRE(dev.table.page_version() == 5);  // bits only: the page table is unchanged
  // 10 + 6 staged NVFP4 tokens from a shifted distribution (keys ×4): head 0 refills the run
  // with fresh scales, head 1 takes a new block; the freed frame is reused.
  cpu.open_segment(seq, ThoughtType::reasoning);
  feed.add(10, 4.0f);
  feed.flush();
  REQUIRE(dev.table.used_frames(BlockFormat::nvfp4) == 2);
  REQUIRE(dev.table.page_version() == 6);
  // Reasoning tokens until the CPU table takes a fourth NVFP4 block: the mirror's NVFP4 pool holds
  // 3 frames, so that token is refused (nothing recorded), naming the format. Every block taken
  // before is checked byte for byte.
  std::vector<float> k(64), v(64);
  std::vector<SlotAddress> where(2);
  bool refused = false;
  for (int i = 0; i < 200 && !refused; ++i) {
    for (float& x : k) x = feed.normal(feed.rng);
    for (float& x : v) x = feed.normal(feed.rng);
    const std::int32_t blocks_before = cpu.num_blocks(seq);
    cpu.append(seq, k.data(), v.data(), 2, 32, where.data());
    const bool new_block = cpu.num_blocks(seq) > blocks_before;
    if (new_block && dev.table.used_frames(BlockFormat::nvfp4) == 3) {
      const std::int32_t pending = dev.table.pending_tokens();
      REQUIRE_THROWS_WITH(dev.table.record_append(cpu, seq, where.data()),
                          Contains("the nvfp4 pool is exhausted (all 3 frames are in use"));
      REQUIRE(dev.table.pending_tokens() == pending);
      refused = true;
      break;
    }
    dev.table.record_append(cpu, seq, where.data());
    feed.ks.insert(feed.ks.end(), k.begin(), k.end());
    feed.vs.insert(feed.vs.end(), v.begin(), v.end());
    if (new_block) feed.flush();
  }
  REQUIRE(refused);
}

TEST_CASE("dense bf16 decode attention matches a double oracle") {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  for (std::int64_t T : {0, 1, 31, 32, 33, 100, 1000}) {
    const std::int64_t H = 2, G = 3, D = 64, Hq = H * G;
    const float scale = 1.0f / 8.0f;
    std::vector<bf16_t> k(static_cast<std::size_t>(H * T * D)), v(k.size());
    for (auto& x : k) x = from_float<bf16_t>(normal(rng) * 2.0f);
    for (auto& x : v) x = from_float<bf16_t>(normal(rng));
    std::vector<float> q(static_cast<std::size_t>(Hq * D));
    for (float& x : q) x = normal(rng);
    std::vector<float> want(q.size(), 0.0f);
    for (std::int64_t qh = 0; qh < Hq && T > 0; ++qh) {
      const std::int64_t h = qh / G;
      std::vector<double> w(static_cast<std::size_t>(T));
      double mx = -1e300, sum = 0;
      for (std::int64_t j = 0; j < T; ++j) {
        double dot = 0;
        for (std::int64_t d = 0; d < D; ++d)
          dot += double(q[qh * D + d]) * to_float(k[(h * T + j) * D + d]);
        w[j] = dot * scale;
        mx = std::max(mx, w[j]);
      }
      for (double& x : w) sum += (x = std::exp(x - mx));
      for (std::int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (std::int64_t j = 0; j < T; ++j) acc += w[j] * to_float(v[(h * T + j) * D + d]);
        want[qh * D + d] = static_cast<float>(acc / sum);
      }
    }
    for (std::int32_t ctas : {1, 7, 264}) {
      INFO("tokens " << T << " target_ctas " << ctas);
      cuda::DecodeAttentionConfig ac;
      ac.target_ctas = ctas;
      DeviceBuffer<bf16_t> dk(k), dv(v);
      DeviceBuffer<float> dq(q), out(q.size());
      KVSIFT_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.size() * 4));
      DeviceBuffer<std::uint8_t> ws(cuda::dense_decode_attention_workspace_bytes(H, T, Hq, D, ac));
      cuda::dense_decode_attention_bf16(dk.get(), dv.get(), H, T, dq.get(), Hq, D, scale, out.get(),
                                        ws.get(), ws.size(), nullptr, ac);
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      require_close(out.download(), want, 1e-4f, "dense bf16 vs oracle");
    }
  }
}

TEST_CASE("device CT table: argument errors name the values") {
  ThoughtBlockTableConfig cfg =
      config(2, 16, 16, BlockFormat::nvfp4, BlockFormat::nvfp4, BlockFormat::ternary);
  REQUIRE_THROWS_WITH(cuda::paged_table_sizes(cfg, 0),
                      Contains("max_sequences must be > 0, got 0"));
  REQUIRE_THROWS_WITH(cuda::DevicePagedTable(cfg, 1, cuda::PagedTableMemory{}),
                      Contains("must be non-null"));
  ThoughtBlockTable cpu(cfg);
  PagedMirror dev(cfg, 1);
  const std::int32_t seq = cpu.create_sequence();
  cpu.open_segment(seq, ThoughtType::reasoning);
  std::vector<float> k(32, 1.0f), v(32, 1.0f);
  std::vector<SlotAddress> where(2);
  cpu.append(seq, k.data(), v.data(), 2, 16, where.data());
  REQUIRE_THROWS_WITH(dev.table.record_append(cpu, 3, where.data()),
                      Contains("sequence 3 outside [0, max_sequences = 1)"));
  REQUIRE(where[0].block == kStagedBlock);  // NVFP4: the token waits for its group
  std::vector<SlotAddress> bad = where;
  bad[1].slot = 40;
  REQUIRE_THROWS_WITH(dev.table.record_append(cpu, seq, bad.data()),
                      Contains("position 0 must be staged, but the CPU table put it at block -2 "
                               "slot 40"));
  REQUIRE(dev.table.pending_tokens() == 0);  // nothing recorded on error
  dev.table.record_append(cpu, seq, where.data());
  REQUIRE(dev.table.pending_tokens() == 1);
  REQUIRE_THROWS_WITH(dev.table.evict(seq, 0, {where[0]}, nullptr, 0, nullptr),
                      Contains("1 recorded tokens are not written yet"));
  DeviceBuffer<float> dk(k), dv(v);
  DeviceBuffer<std::uint8_t> ws(dev.table.append_workspace_bytes());
  REQUIRE_THROWS_WITH(
      dev.table.append(dk.get(), dv.get(), DType::f16, ws.get(), ws.size(), nullptr),
      Contains("got f16"));
  REQUIRE_THROWS_WITH(dev.table.append(dk.get(), dv.get(), DType::f32, ws.get(), 0, nullptr),
                      Contains("workspace of 0 bytes is too small"));
  REQUIRE(dev.table.pending_tokens() == 1);
  // A prepared batch: nothing more is recorded, nothing evicted, and append's errors keep it.
  dev.table.prepare_append();
  REQUIRE(dev.table.pending_tokens() == 1);
  REQUIRE_THROWS_WITH(dev.table.prepare_append(),
                      Contains("a batch of 1 tokens is already prepared"));
  REQUIRE_THROWS_WITH(dev.table.record_append(cpu, seq, where.data()),
                      Contains("a batch of 1 tokens is prepared (call append() first)"));
  REQUIRE_THROWS_WITH(dev.table.evict(seq, 0, {where[0]}, nullptr, 0, nullptr),
                      Contains("1 recorded tokens are not written yet"));
  REQUIRE_THROWS_WITH(dev.table.append(dk.get(), dv.get(), DType::f32, ws.get(), 0, nullptr),
                      Contains("workspace of 0 bytes is too small"));
  REQUIRE(dev.table.pending_tokens() == 1);
  dev.table.append(dk.get(), dv.get(), DType::f32, ws.get(), ws.size(), nullptr);
  REQUIRE(dev.table.pending_tokens() == 0);
  dev.table.prepare_append();  // nothing recorded: a no-op
  REQUIRE(dev.table.pending_tokens() == 0);
  DeviceBuffer<std::uint8_t> ews(dev.table.evict_workspace_bytes(1));
  REQUIRE_THROWS_WITH(dev.table.evict(seq, 5, {where[0]}, ews.get(), ews.size(), nullptr),
                      Contains("kv head 5 outside [0, 2)"));
  REQUIRE_THROWS_WITH(dev.table.evict(seq, 0, {SlotAddress{7, 0}}, ews.get(), ews.size(), nullptr),
                      Contains("block 7 of sequence 0 outside [0, 0)"));
  REQUIRE_THROWS_WITH(
      dev.table.evict(seq, 0, {SlotAddress{kStagedBlock, 99}}, ews.get(), ews.size(), nullptr),
      Contains("position 99 is not staged in kv head 0 of sequence 0"));
  REQUIRE_THROWS_WITH(dev.table.evict(seq, 0, {where[0]}, ews.get(), 0, nullptr),
                      Contains("workspace of 0 bytes is too small"));
  cuda::PagedPoolFrames negative;
  negative.frames[1] = -2;
  REQUIRE_THROWS_WITH(cuda::paged_table_sizes(cfg, 1, negative),
                      Contains("pool of nvfp4 has -2 frames"));
  ThoughtBlockTableConfig f16_cfg = cfg;
  f16_cfg.staging = DType::f16;
  REQUIRE_THROWS_WITH(cuda::DevicePagedTable(f16_cfg, 1, cuda::PagedTableMemory{}),
                      Contains("the CPU table stages in f16 but the device staging"));
  DeviceBuffer<float> q(48), out(48);
  REQUIRE_THROWS_WITH(cuda::paged_decode_attention(dev.table, seq, q.get(), 3, 16, 0.25f, out.get(),
                                                   nullptr, 0, nullptr),
                      Contains("q_heads (3) must be a positive multiple of kv_heads (2)"));
  REQUIRE_THROWS_WITH(cuda::paged_decode_attention(dev.table, seq, q.get(), 2, 32, 0.25f, out.get(),
                                                   nullptr, 0, nullptr),
                      Contains("query head_dim (32) differs from the table's head_dim (16)"));
  REQUIRE_THROWS_WITH(cuda::paged_decode_attention(dev.table, seq, q.get(), 2, 16, -1.0f, out.get(),
                                                   nullptr, 0, nullptr),
                      Contains("softmax_scale (-1)"));
  REQUIRE_THROWS_WITH(cuda::paged_decode_attention(dev.table, seq, q.get(), 2, 16, 0.25f, out.get(),
                                                   nullptr, 0, nullptr),
                      Contains("workspace of 0 bytes is too small"));
  REQUIRE_THROWS_WITH(
      cuda::dense_decode_attention_bf16(nullptr, nullptr, 1, 4, q.get(), 1, 272, 0.25f, out.get(),
                                        nullptr, 1 << 20, nullptr),
      Contains("head_dim (272) must be a multiple of 16 in [16, 256]"));
  cuda::DecodeAttentionConfig ac;
  ac.target_ctas = 0;
  REQUIRE_THROWS_WITH(ac.validate(), Contains("target_ctas must be >= 1, got 0"));
}
