// ThoughtBlockTable (docs/algorithms.md §3.4): allocation by hand-worked examples, soft eviction
// that moves no byte, slot reuse that leaves survivors bit-identical, quantization against the
// quant/ whole-tensor path, byte accounting, and the error messages.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "kvsift/policy/thinkv/segment_evictor.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

ThoughtBlockTableConfig full_precision(std::int32_t heads, std::int32_t dim, std::int32_t slots,
                                       std::int32_t blocks) {
  ThoughtBlockTableConfig c;
  c.kv_heads = heads;
  c.head_dim = dim;
  c.block_size = slots;
  c.num_blocks = blocks;
  c.reasoning = c.execution = c.transition = BlockFormat::f32;
  return c;
}

// A token whose every element encodes (position, head, channel), so reads can be checked exactly.
std::vector<float> token_rows(std::int32_t position, std::int32_t heads, std::int32_t dim,
                              float sign) {
  std::vector<float> x(static_cast<std::size_t>(heads * dim));
  for (std::int32_t h = 0; h < heads; ++h)
    for (std::int32_t d = 0; d < dim; ++d)
      x[h * dim + d] = sign * (position * 1000.0f + h * 100 + d);
  return x;
}

std::int32_t append_marked(ThoughtBlockTable& t, std::int32_t seq, SlotAddress* where = nullptr) {
  const std::int32_t pos = t.length(seq);
  const auto& c = t.config();
  const std::vector<float> k = token_rows(pos, c.kv_heads, c.head_dim, 1.0f);
  const std::vector<float> v = token_rows(pos, c.kv_heads, c.head_dim, -1.0f);
  return t.append(seq, k.data(), v.data(), c.kv_heads, c.head_dim, where);
}

bool same(SlotAddress a, std::int32_t block, std::int32_t slot) {
  return a.block == block && a.slot == slot;
}

std::vector<float> random_rows(std::mt19937& rng, std::size_t n, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

// Appends n tokens of random keys and values (normal, unit scale) to the open segment of `seq`.
void append_random(ThoughtBlockTable& t, std::int32_t seq, std::mt19937& rng, int n) {
  const std::int32_t H = t.config().kv_heads, D = t.config().head_dim;
  for (int i = 0; i < n; ++i) {
    const std::vector<float> k = random_rows(rng, static_cast<std::size_t>(H * D));
    const std::vector<float> v = random_rows(rng, static_cast<std::size_t>(H * D));
    t.append(seq, k.data(), v.data(), H, D);
  }
}

// Evicts each live token of every KV head of `seq` with probability tenths / 10.
void evict_random(ThoughtBlockTable& t, std::int32_t seq, std::mt19937& rng, unsigned tenths) {
  for (std::int32_t h = 0; h < t.config().kv_heads; ++h) {
    std::vector<std::int32_t> gone;
    for (const ResidentToken& r : t.resident_tokens(seq, h))
      if (rng() % 10 < tenths) gone.push_back(r.position);
    t.evict_positions(seq, h, gone);
  }
}

// Same tokens in the same order: position, segment and address.
bool same_tokens(const std::vector<ResidentToken>& x, const std::vector<ResidentToken>& y) {
  return std::equal(x.begin(), x.end(), y.begin(), y.end(),
                    [](const ResidentToken& a, const ResidentToken& b) {
                      return a.position == b.position && a.segment == b.segment &&
                             a.address.block == b.address.block && a.address.slot == b.address.slot;
                    });
}

// The tokens of `all` in segment `seg`, in their order (what a segment's scan must return).
std::vector<ResidentToken> of_segment(const std::vector<ResidentToken>& all, std::int32_t seg) {
  std::vector<ResidentToken> out;
  for (const ResidentToken& r : all)
    if (r.segment == seg) out.push_back(r);
  return out;
}

}  // namespace

TEST_CASE("config validation names the offending values", "[thought_block_table]") {
  ThoughtBlockTableConfig c;
  REQUIRE_NOTHROW(c.validate());
  c.block_size = 24;
  REQUIRE_THROWS_WITH(c.validate(), Contains("block_size (24)") && Contains("multiple of 16"));
  c = ThoughtBlockTableConfig{};
  c.block_size = 512;
  REQUIRE_THROWS_WITH(c.validate(), Contains("block_size (512)"));
  c = ThoughtBlockTableConfig{};
  c.head_dim = 20;
  REQUIRE_THROWS_WITH(c.validate(), Contains("head_dim (20)"));
  c = ThoughtBlockTableConfig{};
  c.num_blocks = 0;
  REQUIRE_THROWS_WITH(c.validate(),
                      Contains("num_blocks must be in [1, kMaxPoolBlocks = 1048576], got 0"));
  c.num_blocks = 2147483647;  // used to attempt a multi-GB frame table
  REQUIRE_THROWS_WITH(c.validate(), Contains("got 2147483647"));
  c = ThoughtBlockTableConfig{};
  c.kv_heads = 2;
  c.global_factors = {1.0f};
  REQUIRE_THROWS_WITH(c.validate(),
                      Contains("global_factors has 1 entries") && Contains("kv_heads = 2"));
  c.global_factors = {1.0f, -3.0f};
  REQUIRE_THROWS_WITH(c.validate(), Contains("global_factors[1] = -3"));
  REQUIRE_THROWS_AS(ThoughtBlockTable(c), Error);
}

TEST_CASE("tokens fill the lowest free slot of their type, per kv head", "[thought_block_table]") {
  ThoughtBlockTable t(full_precision(2, 16, 16, 8));
  const std::int32_t seq = t.create_sequence();
  REQUIRE(t.open_segment(seq, ThoughtType::reasoning) == 0);
  std::vector<SlotAddress> where(2);
  for (int i = 0; i < 20; ++i) {
    REQUIRE(append_marked(t, seq, where.data()) == i);
    REQUIRE(same(where[0], i / 16, i % 16));
    REQUIRE(same(where[1], i / 16, i % 16));
  }
  REQUIRE(t.num_blocks(seq) == 2);
  REQUIRE(t.used_blocks() == 2);
  // Heads evict different tokens (TBE is per (layer, KV head)).
  t.evict_positions(seq, 0, {10, 3});
  t.evict(seq, 1, SlotAddress{0, 5});
  REQUIRE(t.free_mask(seq, 0, 0)[0] == ((1u << 3) | (1u << 10)));
  REQUIRE(t.free_mask(seq, 0, 1)[0] == (1u << 5));
  // Block 1 has slots 0..3 written; 4..15 never written count as free.
  REQUIRE(t.free_mask(seq, 1, 0)[0] == 0xfff0u);

  append_marked(t, seq, where.data());  // position 20
  REQUIRE(same(where[0], 0, 3));
  REQUIRE(same(where[1], 0, 5));
  append_marked(t, seq, where.data());  // 21
  REQUIRE(same(where[0], 0, 10));
  REQUIRE(same(where[1], 1, 4));
  append_marked(t, seq, where.data());  // 22
  REQUIRE(same(where[0], 1, 4));
  REQUIRE(same(where[1], 1, 5));

  // A new thought type never lands in another type's hole: it takes a new block.
  t.evict(seq, 0, SlotAddress{0, 0});
  REQUIRE(t.open_segment(seq, ThoughtType::execution) == 1);
  append_marked(t, seq, where.data());  // 23
  REQUIRE(same(where[0], 2, 0));
  REQUIRE(same(where[1], 2, 0));
  REQUIRE(t.block_info(seq, 2).type == ThoughtType::execution);
  REQUIRE(t.block_info(seq, 0).type == ThoughtType::reasoning);
  // Back to reasoning: the hole at (0, 0) in head 0 is reused first.
  REQUIRE(t.open_segment(seq, ThoughtType::reasoning) == 2);
  REQUIRE(t.segment_start(seq, 2) == 24);
  append_marked(t, seq, where.data());  // 24
  REQUIRE(same(where[0], 0, 0));
  REQUIRE(same(where[1], 1, 6));
  REQUIRE(t.num_blocks(seq) == 3);

  // The reused slots now hold the new tokens' data and metadata.
  std::vector<float> k(16), v(16);
  t.read_token(seq, 0, SlotAddress{0, 0}, k.data(), v.data());
  REQUIRE(k[7] == 24 * 1000.0f + 7);
  REQUIRE(v[7] == -(24 * 1000.0f + 7));
  t.read_token(seq, 1, SlotAddress{0, 5}, k.data(), v.data());
  REQUIRE(k[0] == 20 * 1000.0f + 100);
  const std::vector<ResidentToken> seg2 = t.resident_tokens(seq, 0, 2);
  REQUIRE(seg2.size() == 1);
  REQUIRE(seg2[0].position == 24);
  REQUIRE(t.segment_mask(seq, 0, 0, 2)[0] == 1u);
  REQUIRE(t.segment_mask(seq, 0, 0, 0)[0] == (0xffffu & ~1u));  // 3 and 10 reused by segment 0
  REQUIRE(t.live_tokens(seq, 0) == 25 - 3);  // 25 appended, 3 evicted (their slots reused)
  REQUIRE(t.live_tokens(seq, 1) == 25 - 1);
}

TEST_CASE("a new block is taken only when some head has no free slot", "[thought_block_table]") {
  ThoughtBlockTable t(full_precision(2, 16, 16, 4));
  const std::int32_t seq = t.create_sequence();
  t.open_segment(seq, ThoughtType::transition);
  for (int i = 0; i < 16; ++i) append_marked(t, seq);
  REQUIRE(t.num_blocks(seq) == 1);
  // Head 0 frees a slot, head 1 frees nothing: the next token needs a block for head 1 only.
  t.evict(seq, 0, SlotAddress{0, 9});
  std::vector<SlotAddress> where(2);
  append_marked(t, seq, where.data());
  REQUIRE(t.num_blocks(seq) == 2);
  REQUIRE(same(where[0], 0, 9));
  REQUIRE(same(where[1], 1, 0));
  REQUIRE(t.free_mask(seq, 1, 0)[0] == 0xffffu);  // untouched in head 0
  REQUIRE(t.free_mask(seq, 1, 1)[0] == 0xfffeu);
  // Head 0 goes on in the new block now that its old one is full again.
  append_marked(t, seq, where.data());
  REQUIRE(same(where[0], 1, 0));
  REQUIRE(same(where[1], 1, 1));
  REQUIRE(t.num_blocks(seq) == 2);
}

TEST_CASE("eviction moves no byte of any block", "[thought_block_table]") {
  std::mt19937 rng(7);
  for (const BlockFormat fmt :
       {BlockFormat::f32, BlockFormat::nvfp4, BlockFormat::ternary, BlockFormat::fp8}) {
    ThoughtBlockTableConfig c;
    c.kv_heads = 3;
    c.head_dim = 32;
    c.block_size = 32;
    c.num_blocks = 16;
    c.reasoning = c.execution = c.transition = fmt;
    ThoughtBlockTable t(c);
    const std::int32_t seq = t.create_sequence();
    t.open_segment(seq, ThoughtType::reasoning);
    // 100 tokens: quantized formats hold 6 whole groups in 3 blocks and stage 4 tokens.
    for (int i = 0; i < 100; ++i) {
      const std::vector<float> k = random_rows(rng, 96), v = random_rows(rng, 96);
      t.append(seq, k.data(), v.data(), 3, 32);
    }
    std::vector<std::vector<std::uint8_t>> before;
    std::vector<std::vector<float>> reads_before;
    for (std::int32_t b = 0; b < t.num_blocks(seq); ++b) before.push_back(t.block_storage(seq, b));
    std::vector<float> k(32), v(32);
    for (std::int32_t h = 0; h < 3; ++h) {
      for (const ResidentToken& r : t.resident_tokens(seq, h)) {
        t.read_token(seq, h, r.address, k.data(), v.data());
        reads_before.push_back(k);
        reads_before.push_back(v);
      }
    }
    // Evict a random half of every head, chosen independently per head.
    std::vector<std::vector<std::int32_t>> evicted(3);
    for (std::int32_t h = 0; h < 3; ++h) {
      for (std::int32_t p = 0; p < 100; ++p)
        if (rng() % 2) evicted[h].push_back(p);
      t.evict_positions(seq, h, evicted[h]);
    }
    for (std::int32_t b = 0; b < t.num_blocks(seq); ++b)
      REQUIRE(t.block_storage(seq, b) == before[b]);
    // Every survivor reads back bit-identically (staged keys included).
    std::size_t i = 0;
    for (std::int32_t h = 0; h < 3; ++h) {
      std::int64_t live = 0;
      for (std::int32_t p = 0; p < 100; ++p) {
        // resident_tokens lists slots in (block, slot) order = position order before any reuse.
        const bool gone = std::binary_search(evicted[h].begin(), evicted[h].end(), p);
        if (gone) {
          i += 2;
          continue;
        }
        const bool staged = is_quantized(fmt) && p >= 96;
        const SlotAddress a = staged ? SlotAddress{kStagedBlock, p} : SlotAddress{p / 32, p % 32};
        t.read_token(seq, h, a, k.data(), v.data());
        REQUIRE(k == reads_before[i++]);
        REQUIRE(v == reads_before[i++]);
        ++live;
      }
      REQUIRE(t.live_tokens(seq, h) == live);
      // resident_positions: the survivors' positions, ascending, staged ones included.
      std::vector<std::int32_t> kept;
      for (std::int32_t p = 0; p < 100; ++p)
        if (!std::binary_search(evicted[h].begin(), evicted[h].end(), p)) kept.push_back(p);
      REQUIRE(t.resident_positions(seq, h) == kept);
    }
  }
}

TEST_CASE("refill takes only a whole free 16-slot run; survivors stay bit-identical",
          "[thought_block_table]") {
  std::mt19937 rng(11);
  ThoughtBlockTableConfig c;  // default R4 E4 T2
  c.kv_heads = 2;
  c.head_dim = 16;
  c.block_size = 16;
  c.num_blocks = 8;
  ThoughtBlockTable t(c);
  const std::int32_t seq = t.create_sequence();
  auto append_random = [&](std::vector<SlotAddress>* where = nullptr) {
    const std::vector<float> k = random_rows(rng, 32, 3.0f), v = random_rows(rng, 32);
    t.append(seq, k.data(), v.data(), 2, 16, where ? where->data() : nullptr);
  };
  t.open_segment(seq, ThoughtType::reasoning);
  for (int i = 0; i < 16; ++i) append_random();  // block 0 (R)
  t.open_segment(seq, ThoughtType::transition);
  for (int i = 0; i < 16; ++i) append_random();  // block 1 (T)
  REQUIRE(t.num_blocks(seq) == 2);
  auto snapshot = [&](std::int32_t h) {
    std::vector<std::vector<float>> out;
    std::vector<float> k(16), v(16);
    for (const ResidentToken& r : t.resident_tokens(seq, h)) {
      t.read_token(seq, h, r.address, k.data(), v.data());
      out.push_back(k);
      out.push_back(v);
    }
    return out;
  };
  // Head 0 frees the whole T group (positions 16..31) and two R slots; head 1 frees two slots.
  std::vector<std::int32_t> all_t;
  for (std::int32_t p = 16; p < 32; ++p) all_t.push_back(p);
  all_t.push_back(2);
  all_t.push_back(7);
  t.evict_positions(seq, 0, all_t);
  t.evict_positions(seq, 1, {0, 30});
  REQUIRE(t.num_blocks(seq) == 2);  // block 1 still has live slots in head 1
  const auto before0 = snapshot(0), before1 = snapshot(1);
  const auto tokens0 = t.resident_tokens(seq, 0), tokens1 = t.resident_tokens(seq, 1);
  const std::vector<std::uint8_t> block0 = t.block_storage(seq, 0);
  // 15 new T tokens wait in the staging buffer: no slot, no block.
  std::vector<SlotAddress> where(2);
  for (int i = 0; i < 15; ++i) {
    append_random(&where);
    REQUIRE(same(where[0], kStagedBlock, 32 + i));
    REQUIRE(same(where[1], kStagedBlock, 32 + i));
  }
  REQUIRE(t.num_blocks(seq) == 2);
  REQUIRE(t.live_tokens(seq, 0) == 14 + 15);
  // The 16th completes the group: head 0 refills the free run of block 1, head 1 (whose holes are
  // single slots inside quantized groups) takes a new T block. The new token is each group's last.
  append_random(&where);
  REQUIRE(same(where[0], 1, 15));
  REQUIRE(same(where[1], 2, 15));
  REQUIRE(t.num_blocks(seq) == 3);
  REQUIRE(t.block_info(seq, 2).type == ThoughtType::transition);
  REQUIRE(t.block_storage(seq, 0) == block0);
  // The old tokens are where they were and decode to the same bits.
  std::vector<float> k(16), v(16);
  for (std::int32_t h = 0; h < 2; ++h) {
    const auto& tokens = h == 0 ? tokens0 : tokens1;
    const auto& before = h == 0 ? before0 : before1;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      REQUIRE(t.is_live(seq, h, tokens[i].address));
      t.read_token(seq, h, tokens[i].address, k.data(), v.data());
      REQUIRE(k == before[2 * i]);
      REQUIRE(v == before[2 * i + 1]);
    }
  }
}

TEST_CASE("a block whose slots are all evicted returns to the pool and is reused",
          "[thought_block_table]") {
  std::mt19937 rng(5);
  ThoughtBlockTableConfig c;  // R4 E4 T2
  c.kv_heads = 2;
  c.head_dim = 16;
  c.block_size = 32;
  c.num_blocks = 4;
  ThoughtBlockTable t(c);
  const std::int32_t seq = t.create_sequence();
  auto append_random = [&] {
    const std::vector<float> k = random_rows(rng, 32), v = random_rows(rng, 32);
    t.append(seq, k.data(), v.data(), 2, 16);
  };
  t.open_segment(seq, ThoughtType::reasoning);
  for (int i = 0; i < 64; ++i) append_random();  // blocks 0, 1 (frames 0, 1)
  t.open_segment(seq, ThoughtType::transition);
  for (int i = 0; i < 32; ++i) append_random();  // block 2 (frame 2)
  REQUIRE(t.num_blocks(seq) == 3);
  REQUIRE(t.free_blocks() == 1);
  const TableBytes full = t.allocated_bytes();
  // Positions 0..31 (block 0) leave head 0 entirely, but head 1 keeps one: nothing is freed.
  std::vector<std::int32_t> first;
  for (std::int32_t p = 0; p < 32; ++p) first.push_back(p);
  t.evict_positions(seq, 0, first);
  t.evict_positions(seq, 1, std::vector<std::int32_t>(first.begin(), first.end() - 1));
  REQUIRE(t.num_blocks(seq) == 3);
  REQUIRE(t.free_blocks() == 1);
  // The last live slot goes: frame 0 is returned and its storage released.
  const std::vector<std::uint8_t> block2 = t.block_storage(seq, 2);
  const auto survivors = t.resident_tokens(seq, 0);
  t.evict(seq, 1, SlotAddress{0, 31});
  REQUIRE(t.num_blocks(seq) == 2);
  REQUIRE(t.free_blocks() == 2);
  REQUIRE(t.block_info(seq, 0).frame == 1);  // later blocks move down in the page table
  REQUIRE(t.block_info(seq, 1).frame == 2);
  REQUIRE(t.block_storage(seq, 1) == block2);  // nothing moved
  const BlockBytes nvfp4 = block_bytes(BlockFormat::nvfp4, 32, 16, 2);
  REQUIRE(full.total() - t.allocated_bytes().total() == nvfp4.total() + 4);  // + page entry
  REQUIRE(t.resident_bytes().total() == t.allocated_bytes().total());
  // The next whole group of a new type takes the lowest free frame again.
  t.open_segment(seq, ThoughtType::execution);
  for (int i = 0; i < 16; ++i) append_random();
  REQUIRE(t.num_blocks(seq) == 3);
  REQUIRE(t.block_info(seq, 2).frame == 0);
  REQUIRE(t.block_info(seq, 2).type == ThoughtType::execution);
  REQUIRE(t.live_tokens(seq, 0) == static_cast<std::int64_t>(survivors.size()) + 16);
}

TEST_CASE("quantized blocks match the quant/ whole-tensor path", "[thought_block_table]") {
  std::mt19937 rng(3);
  const std::int32_t S = 32, D = 32;
  for (const BlockFormat fmt : {BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary}) {
    ThoughtBlockTableConfig c;
    c.kv_heads = 1;
    c.head_dim = D;
    c.block_size = S;
    c.num_blocks = 2;
    c.execution = fmt;
    c.global_factors = {fmt == BlockFormat::nvfp4 ? 37.0f : 1.0f};
    ThoughtBlockTable t(c);
    const std::int32_t seq = t.create_sequence();
    t.open_segment(seq, ThoughtType::execution);
    // Channel magnitudes differ (the outlier channels KIVI's per-channel keys are made for).
    // Values are rounded to bf16 first: what the 16-bit staging stores exactly.
    auto bf16 = [](float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); };
    std::vector<float> K(S * D), V = random_rows(rng, S * D);
    for (float& x : V) x = bf16(x);
    for (std::int32_t s = 0; s < S; ++s)
      for (std::int32_t d = 0; d < D; ++d)
        K[s * D + d] = bf16(random_rows(rng, 1)[0] * (1 + d % 5));
    std::vector<float> k(D), v(D);
    for (std::int32_t s = 0; s < S; ++s) {
      t.append(seq, &K[s * D], &V[s * D], 1, D);
      if (s == 20) {
        // Tokens 16..20 wait for their group, at 16 bits: exact for bf16 inputs.
        t.read_token(seq, 0, SlotAddress{kStagedBlock, 18}, k.data(), v.data());
        REQUIRE(std::equal(k.begin(), k.end(), &K[18 * D]));
        REQUIRE(std::equal(v.begin(), v.end(), &V[18 * D]));
      }
    }
    const QuantFormat qf = quant_format_of(fmt);
    const float g = c.global_factors[0];
    const QuantizedTensor qk = quantize_tensor(K.data(), S, D, qf, GroupAxis::token, g);
    const QuantizedTensor qv = quantize_tensor(V.data(), S, D, qf, GroupAxis::channel, g);
    const std::vector<float> k_hat = dequantize_tensor(qk), v_hat = dequantize_tensor(qv);
    std::vector<float> keys(S * D), values(S * D);
    t.dequantize_block(seq, 0, 0, keys.data(), values.data());
    REQUIRE(keys == k_hat);
    REQUIRE(values == v_hat);

    // A single freed slot is never refilled (its group's scales belong to other tokens): the next
    // token waits in staging. Freeing the whole first group and appending 16 tokens four times as
    // large refills it with fresh scales: the block then equals the whole-tensor path over the
    // new contents.
    t.evict(seq, 0, SlotAddress{0, 5});
    std::vector<float> X(16 * D);
    for (float& x : X) x = bf16(random_rows(rng, 1, 4.0f)[0]);
    t.append(seq, &X[0], &V[0], 1, D);
    REQUIRE_FALSE(t.is_live(seq, 0, SlotAddress{0, 5}));
    REQUIRE(t.is_live(seq, 0, SlotAddress{kStagedBlock, S}));
    std::vector<std::int32_t> rest;
    for (std::int32_t p = 0; p < 16; ++p)
      if (p != 5) rest.push_back(p);
    t.evict_positions(seq, 0, rest);
    for (std::int32_t i = 1; i < 16; ++i) t.append(seq, &X[i * D], &V[i * D], 1, D);
    REQUIRE(t.num_blocks(seq) == 1);
    for (std::int32_t i = 0; i < 16 * D; ++i) K[i] = X[i];
    const QuantizedTensor rk = quantize_tensor(K.data(), S, D, qf, GroupAxis::token, g);
    const QuantizedTensor rv = quantize_tensor(V.data(), S, D, qf, GroupAxis::channel, g);
    t.dequantize_block(seq, 0, 0, keys.data(), values.data());
    REQUIRE(keys == dequantize_tensor(rk));
    REQUIRE(values == dequantize_tensor(rv));
  }
}

TEST_CASE("resident bytes count codes, scales, metadata and staging", "[thought_block_table]") {
  ThoughtBlockTableConfig c;  // R4 E4 T2
  c.kv_heads = 2;
  c.head_dim = 16;
  c.block_size = 16;
  c.num_blocks = 4;
  ThoughtBlockTable t(c);
  const TableBytes empty = t.resident_bytes();
  REQUIRE(empty.total() == 0);
  const std::int32_t seq = t.create_sequence();
  std::vector<float> k(32, 0.5f), v(32, -0.25f);
  t.open_segment(seq, ThoughtType::reasoning);
  for (int i = 0; i < 16; ++i) t.append(seq, k.data(), v.data(), 2, 16);
  t.open_segment(seq, ThoughtType::transition);
  for (int i = 0; i < 17; ++i) t.append(seq, k.data(), v.data(), 2, 16);  // one T token staged
  const TableBytes b = t.resident_bytes();
  // NVFP4 block, per head: 16 key groups + 16 value groups, 8 code bytes and 1 scale each.
  // Ternary block, per head: 32 groups, 4 code bytes and 1 scale each.
  REQUIRE(b.codes == 2 * (32 * 8) + 2 * (32 * 4));
  REQUIRE(b.scales == 2 * 32 + 2 * 32);
  // Per block: header (type, format, owner, frame: 10) and per head the mask (8) and 16 slot
  // positions at 3 B (48); one global factor per head; the sequence: 2 page-table entries, 2
  // segments and its length.
  REQUIRE(b.metadata == 2 * (10 + 2 * (8 + 48)) + 2 * 4 + (2 * 4 + 2 * 5 + 4));
  // Staging: 3 types x 2 heads x 16 tokens x (key + value at 2 B + a 4 B position).
  REQUIRE(b.staging == 3 * 2 * 16 * (2 * 16 * 2 + 4));
  REQUIRE(t.allocated_bytes().total() == b.total());
  // Same tokens in full precision: 16 slots x 16 channels x (key + value) x 4 bytes per head.
  ThoughtBlockTable f(full_precision(2, 16, 16, 4));
  const std::int32_t s2 = f.create_sequence();
  f.open_segment(s2, ThoughtType::reasoning);
  f.append(s2, k.data(), v.data(), 2, 16);
  REQUIRE(f.resident_bytes().codes == 2 * 16 * 16 * 2 * 4);
  REQUIRE(f.resident_bytes().scales == 0);
  REQUIRE(f.resident_bytes().staging == 0);
}

TEST_CASE("resident bytes equal the blocks actually held, per format, after churn",
          "[thought_block_table]") {
  // A mixed workload (types change, random evictions free whole blocks, holes are refilled); then
  // the bytes are recomputed here from the blocks the table holds, with the formulas written out
  // independently of block_bytes.hpp: per (block, head), S slots, D channels,
  //   nvfp4   codes S·D/16 key groups + S·D/16 value groups, 8 B each; one scale byte per group
  //   fp8     16 B per group;  ternary 4 B per group;  f32  2·S·D·4 B, no scales
  //   metadata per (block, head): mask ceil(S/64)·8 + S·4 positions; per block a 10 B header.
  std::mt19937 rng(21);
  ThoughtBlockTableConfig c;
  c.kv_heads = 3;
  c.head_dim = 32;
  c.block_size = 48;
  c.num_blocks = 64;
  c.execution = BlockFormat::fp8;
  ThoughtBlockTable t(c);
  const std::int32_t seq = t.create_sequence();
  const ThoughtType types[] = {ThoughtType::reasoning, ThoughtType::execution,
                               ThoughtType::transition};
  for (int round = 0; round < 12; ++round) {
    t.open_segment(seq, types[rng() % 3]);
    append_random(t, seq, rng, 40);
    evict_random(t, seq, rng, 7);
  }
  const std::int64_t S = 48, D = 32, H = 3, groups = 2 * S * D / 16;
  std::int64_t codes = 0, scales = 0, metadata = 0;
  bool nvfp4 = false;
  for (std::int32_t b = 0; b < t.num_blocks(seq); ++b) {
    const BlockFormat f = t.block_info(seq, b).format;
    const std::int64_t per_group = f == BlockFormat::nvfp4 ? 8 : f == BlockFormat::fp8 ? 16 : 4;
    codes += H * groups * per_group;
    scales += H * groups;
    metadata += H * (8 + S * 3) + 10;  // mask word, 3 B positions, header
    nvfp4 = nvfp4 || f == BlockFormat::nvfp4;
    REQUIRE(static_cast<std::int64_t>(t.block_storage(seq, b).size()) ==
            H * groups * (per_group + 1));
  }
  REQUIRE(t.used_blocks() == t.num_blocks(seq));
  REQUIRE(t.num_blocks(seq) < 12 * 40 / 48 * 3);  // freed blocks came back
  metadata += (nvfp4 ? 4 * H : 0) + 4 * t.num_blocks(seq) + 5 * 12 + 4;
  const TableBytes r = t.resident_bytes(), a = t.allocated_bytes();
  REQUIRE(r.codes == codes);
  REQUIRE(r.scales == scales);
  REQUIRE(r.metadata == metadata);
  REQUIRE(r.staging == 3 * H * 16 * (2 * D * 2 + 4));
  REQUIRE(a.codes == r.codes);
  REQUIRE(a.scales == r.scales);
  REQUIRE(a.metadata == r.metadata);
  REQUIRE(a.staging == r.staging);
}

TEST_CASE("a segment's tokens are found by skipping blocks outside its positions",
          "[thought_block_table]") {
  // Two sequences whose segments change type, leave groups staged, lose tokens and refill the
  // holes (so blocks hold positions of several segments): after every round each segment's
  // resident_tokens, which skips the blocks that never held one of its positions, equals the full
  // scan filtered by segment (same tokens, same order).
  std::mt19937 rng(5);
  ThoughtBlockTableConfig c;
  c.kv_heads = 3;
  c.head_dim = 32;
  c.block_size = 32;
  c.num_blocks = 96;
  ThoughtBlockTable t(c);
  t.create_sequence();
  t.create_sequence();
  const ThoughtType types[] = {ThoughtType::reasoning, ThoughtType::execution,
                               ThoughtType::transition};
  std::int64_t compared = 0;
  for (int round = 0; round < 10; ++round) {
    for (std::int32_t seq = 0; seq < 2; ++seq) {
      t.open_segment(seq, types[rng() % 3]);
      append_random(t, seq, rng, 40);
      evict_random(t, seq, rng, 6);
    }
    for (std::int32_t seq = 0; seq < 2; ++seq) {
      for (std::int32_t h = 0; h < 3; ++h) {
        const std::vector<ResidentToken> all = t.resident_tokens(seq, h);
        for (std::int32_t seg = 0; seg <= t.num_segments(seq); ++seg) {  // one past the last too
          const std::vector<ResidentToken> want = of_segment(all, seg);
          REQUIRE(same_tokens(t.resident_tokens(seq, h, seg), want));
          compared += static_cast<std::int64_t>(want.size());
        }
      }
    }
  }
  REQUIRE(compared > 1000);
  // Holes were refilled by later segments: some block holds live tokens of two segments.
  bool mixed = false;
  for (std::int32_t seq = 0; seq < 2; ++seq) {
    for (std::int32_t h = 0; h < 3; ++h) {
      const std::vector<ResidentToken> all = t.resident_tokens(seq, h);
      for (const ResidentToken& x : all)
        for (const ResidentToken& y : all)
          mixed = mixed || (x.address.block >= 0 && x.address.block == y.address.block &&
                            x.segment != y.segment);
    }
  }
  REQUIRE(mixed);
}

TEST_CASE("evict_slots equals evicting one head at a time with addresses of each moment",
          "[thought_block_table]") {
  // Two tables with the same history of two sequences (types change, groups staged, holes
  // refilled); each round evicts the same random tokens of both sequences and all heads: `batch`
  // with one evict_slots call on the addresses of before the round, `one_by_one` per (sequence,
  // head) through evict_positions, which looks the addresses up after each call's releases.
  std::mt19937 rng(5);
  ThoughtBlockTableConfig c;
  c.kv_heads = 3;
  c.head_dim = 32;
  c.block_size = 32;
  c.num_blocks = 96;
  ThoughtBlockTable batch(c), one_by_one(c);
  for (ThoughtBlockTable* t : {&batch, &one_by_one}) {
    t->create_sequence();
    t->create_sequence();
  }
  const ThoughtType types[] = {ThoughtType::reasoning, ThoughtType::execution,
                               ThoughtType::transition};
  int released = 0, staged_evicted = 0;
  for (int round = 0; round < 10; ++round) {
    for (std::int32_t seq = 0; seq < 2; ++seq) {
      const ThoughtType type = types[rng() % 3];
      batch.open_segment(seq, type);
      one_by_one.open_segment(seq, type);
      for (int i = 0; i < 40; ++i) {
        const std::vector<float> k = random_rows(rng, 96), v = random_rows(rng, 96);
        batch.append(seq, k.data(), v.data(), 3, 32);
        one_by_one.append(seq, k.data(), v.data(), 3, 32);
      }
    }
    std::vector<EvictionSlot> slots;
    std::vector<std::vector<std::int32_t>> gone(6);  // [seq, head]
    for (std::int32_t seq = 0; seq < 2; ++seq) {
      for (std::int32_t h = 0; h < 3; ++h) {
        for (const ResidentToken& r : batch.resident_tokens(seq, h)) {
          if (rng() % 10 >= 6) continue;
          slots.push_back(EvictionSlot{seq, h, r.address});
          gone[static_cast<std::size_t>(seq * 3 + h)].push_back(r.position);
          staged_evicted += r.address.block == kStagedBlock;
        }
      }
    }
    std::shuffle(slots.begin(), slots.end(), rng);  // the order does not matter
    const std::int32_t used = batch.used_blocks();
    batch.evict_slots(slots);
    released += used - batch.used_blocks();
    for (std::int32_t seq = 0; seq < 2; ++seq)
      for (std::int32_t h = 0; h < 3; ++h)
        one_by_one.evict_positions(seq, h, gone[static_cast<std::size_t>(seq * 3 + h)]);
    REQUIRE(batch.free_blocks() == one_by_one.free_blocks());
    for (std::int32_t seq = 0; seq < 2; ++seq) {
      REQUIRE(batch.num_blocks(seq) == one_by_one.num_blocks(seq));
      for (std::int32_t b = 0; b < batch.num_blocks(seq); ++b) {
        REQUIRE(batch.block_info(seq, b).frame == one_by_one.block_info(seq, b).frame);
        for (std::int32_t h = 0; h < 3; ++h) {
          const std::uint64_t* x = batch.free_mask(seq, b, h);
          REQUIRE(std::equal(x, x + batch.mask_words(), one_by_one.free_mask(seq, b, h)));
        }
        REQUIRE(batch.block_storage(seq, b) == one_by_one.block_storage(seq, b));
      }
      for (std::int32_t h = 0; h < 3; ++h)
        REQUIRE(batch.resident_positions(seq, h) == one_by_one.resident_positions(seq, h));
    }
    // The scans that skip blocks by their position bounds find what a full scan filtered finds.
    for (std::int32_t seq = 0; seq < 2; ++seq) {
      for (std::int32_t h = 0; h < 3; ++h) {
        const std::vector<ResidentToken> all = batch.resident_tokens(seq, h);
        for (std::int32_t seg = 0; seg < batch.num_segments(seq); ++seg) {
          REQUIRE(same_tokens(batch.resident_tokens(seq, h, seg), of_segment(all, seg)));
        }
        const std::int32_t first = static_cast<std::int32_t>(rng() % 400);
        const std::int32_t last = first + static_cast<std::int32_t>(rng() % 200);
        std::vector<ResidentToken> want;
        for (const ResidentToken& r : all)
          if (r.position >= first && r.position <= last) want.push_back(r);
        REQUIRE(same_tokens(batch.resident_tokens_between(seq, h, first, last), want));
        // Into a caller's buffer: cleared first (it still holds the whole head's tokens).
        std::vector<ResidentToken> buffer = all;
        batch.resident_tokens_between(seq, h, first, last, buffer);
        REQUIRE(same_tokens(buffer, want));
      }
    }
  }
  REQUIRE(released > 0);        // blocks went back to the pool inside a batch
  REQUIRE(staged_evicted > 0);  // and staged tokens left their buffers

  // Errors name the token and change nothing.
  const ResidentToken live = batch.resident_tokens(1, 2).front();
  const std::int32_t blocks = batch.num_blocks(1);
  const std::vector<std::int32_t> before = batch.resident_positions(1, 2);
  REQUIRE_THROWS_WITH(
      batch.evict_slots({{1, 2, live.address}, {1, 2, live.address}}),
      Contains("in kv head 2 of sequence 1 is not live") && Contains("or listed twice"));
  REQUIRE_THROWS_WITH(batch.evict_slots({{1, 2, live.address}, {1, 2, SlotAddress{blocks, 0}}}),
                      Contains("block " + std::to_string(blocks) + " of sequence 1 outside"));
  REQUIRE_THROWS_WITH(
      batch.evict_slots({{1, 2, live.address}, {1, 2, SlotAddress{kStagedBlock, 99999}}}),
      Contains("position 99999 is not staged in kv head 2 of sequence 1"));
  REQUIRE_THROWS_WITH(batch.evict_slots({{1, 2, live.address}, {4, 0, live.address}}),
                      Contains("unknown sequence 4"));
  REQUIRE_THROWS_WITH(batch.evict_slots({{1, 3, live.address}}), Contains("kv head 3 outside"));
  REQUIRE(batch.resident_positions(1, 2) == before);
  std::vector<EvictionSlot> staged_twice;
  for (const ResidentToken& r : batch.resident_tokens(0, 1)) {
    if (r.address.block == kStagedBlock) staged_twice = {{0, 1, r.address}, {0, 1, r.address}};
  }
  REQUIRE(staged_twice.size() == 2);
  REQUIRE_THROWS_WITH(batch.evict_slots(staged_twice),
                      Contains("staged position " + std::to_string(staged_twice[0].address.slot) +
                               " of kv head 1 of sequence 0 is listed twice"));
  REQUIRE(batch.resident_tokens(0, 1).size() == one_by_one.resident_tokens(0, 1).size());
  batch.evict_slots({{1, 2, live.address}});
  REQUIRE_THROWS_WITH(batch.evict_slots({{1, 2, live.address}}), Contains("is not live"));
}

TEST_CASE("sequences share the pool; released blocks are handed out again",
          "[thought_block_table]") {
  ThoughtBlockTable t(full_precision(1, 16, 16, 3));
  const std::int32_t a = t.create_sequence(), b = t.create_sequence();
  REQUIRE(a == 0);
  REQUIRE(b == 1);
  t.open_segment(a, ThoughtType::reasoning);
  t.open_segment(b, ThoughtType::reasoning);
  for (int i = 0; i < 17; ++i) append_marked(t, a);
  append_marked(t, b);
  REQUIRE(t.free_blocks() == 0);
  REQUIRE(t.block_info(a, 1).frame == 1);
  REQUIRE(t.block_info(b, 0).frame == 2);
  t.release_sequence(a);
  REQUIRE(t.free_blocks() == 2);
  REQUIRE_FALSE(t.has_sequence(a));
  REQUIRE(t.create_sequence() == 0);  // the lowest unused id
  t.open_segment(0, ThoughtType::execution);
  append_marked(t, 0);
  REQUIRE(t.block_info(0, 0).frame == 0);
  REQUIRE(t.block_info(0, 0).type == ThoughtType::execution);
  std::vector<float> k(16), v(16);
  t.read_token(0, 0, SlotAddress{0, 0}, k.data(), v.data());
  REQUIRE(k[3] == 3.0f);  // position 0 of the new sequence, not the old data
}

TEST_CASE("errors name the values and change nothing", "[thought_block_table]") {
  ThoughtBlockTable t(full_precision(2, 16, 16, 2));
  const std::int32_t seq = t.create_sequence();
  std::vector<float> k(32, 1.0f), v(32, 1.0f);
  REQUIRE_THROWS_WITH(t.append(seq, k.data(), v.data(), 2, 16),
                      Contains("sequence 0 has no open segment"));
  t.open_segment(seq, ThoughtType::reasoning);
  REQUIRE_THROWS_WITH(
      t.append(seq, k.data(), v.data(), 2, 8),
      Contains("[kv_heads=2, head_dim=8]") && Contains("expects [kv_heads=2, head_dim=16]"));
  REQUIRE_THROWS_WITH(t.append(seq, k.data(), v.data(), 4, 8), Contains("kv_heads=4"));
  k[17] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(t.append(seq, k.data(), v.data(), 2, 16),
                      Contains("kv head 1 channel 1 is not finite"));
  k[17] = 1.0f;
  REQUIRE(t.length(seq) == 0);

  for (int i = 0; i < 32; ++i) t.append(seq, k.data(), v.data(), 2, 16);
  REQUIRE_THROWS_WITH(t.append(seq, k.data(), v.data(), 2, 16),
                      Contains("block pool exhausted") && Contains("all 2 blocks") &&
                          Contains("sequence 0 needs a new R block"));
  REQUIRE(t.length(seq) == 32);
  // Only head 0 has a hole: the token still needs a block for head 1, so nothing is written.
  t.evict(seq, 0, SlotAddress{1, 3});
  REQUIRE_THROWS_WITH(t.append(seq, k.data(), v.data(), 2, 16), Contains("pool exhausted"));
  REQUIRE_FALSE(t.is_live(seq, 0, SlotAddress{1, 3}));
  REQUIRE(t.length(seq) == 32);

  REQUIRE_THROWS_WITH(t.evict(seq, 0, SlotAddress{1, 3}),
                      Contains("slot 3 of block 1 in kv head 0 of sequence 0 is not live"));
  REQUIRE_THROWS_WITH(t.evict(seq, 0, SlotAddress{2, 0}),
                      Contains("block 2 of sequence 0 outside [0, 2)"));
  REQUIRE_THROWS_WITH(t.evict(seq, 0, SlotAddress{0, 16}),
                      Contains("slot 16 of block 0 outside [0, block_size = 16)"));
  REQUIRE_THROWS_WITH(t.evict(seq, 2, SlotAddress{0, 0}), Contains("kv head 2 outside [0, 2)"));
  // evict_positions checks every position before setting any bit.
  REQUIRE_THROWS_WITH(t.evict_positions(seq, 0, {4, 19}),
                      Contains("position 19 is not resident in kv head 0 of sequence 0"));
  REQUIRE(t.is_live(seq, 0, SlotAddress{0, 4}));
  REQUIRE_THROWS_WITH(t.evict_positions(seq, 1, {4, 4}), Contains("position 4 is listed twice"));
  REQUIRE(t.is_live(seq, 1, SlotAddress{0, 4}));
  REQUIRE_THROWS_WITH(t.evict_positions(seq, 1, {40}), Contains("position 40 is not resident"));

  REQUIRE_THROWS_WITH(t.append(5, k.data(), v.data(), 2, 16), Contains("unknown sequence 5"));
  REQUIRE_THROWS_WITH(t.open_segment(-1, ThoughtType::reasoning), Contains("unknown sequence -1"));
  t.release_sequence(seq);
  REQUIRE_THROWS_WITH(t.num_blocks(seq), Contains("unknown sequence 0 (0 sequences are active)"));
  REQUIRE_THROWS_WITH(t.release_sequence(seq), Contains("unknown sequence 0"));
}

TEST_CASE("TBE's eviction marks for a segment apply per head as bits", "[thought_block_table]") {
  std::mt19937 rng(21);
  ThoughtBlockTable t(full_precision(2, 16, 16, 8));
  const std::int32_t seq = t.create_sequence();
  t.open_segment(seq, ThoughtType::reasoning);
  std::vector<std::vector<float>> keys_by_head(2);
  for (int i = 0; i < 8; ++i) append_marked(t, seq);  // segment 0: positions 0..7
  t.open_segment(seq, ThoughtType::execution);
  for (int i = 0; i < 40; ++i) {  // segment 1: positions 8..47
    const std::vector<float> k = random_rows(rng, 32), v = random_rows(rng, 32);
    t.append(seq, k.data(), v.data(), 2, 16);
    for (int h = 0; h < 2; ++h)
      keys_by_head[h].insert(keys_by_head[h].end(), &k[h * 16], &k[h * 16 + 16]);
  }
  t.evict_positions(seq, 1, {9, 30});  // heads already differ before TBE runs
  for (std::int32_t h = 0; h < 2; ++h) {
    std::vector<float> keys;
    std::vector<std::int32_t> positions;
    t.segment_keys(seq, h, 1, keys, positions);
    REQUIRE(positions.size() == (h == 0 ? 40u : 38u));
    for (std::size_t i = 0; i < positions.size(); ++i) {
      const std::size_t row = static_cast<std::size_t>(positions[i] - 8) * 16;
      REQUIRE(std::equal(&keys[i * 16], &keys[i * 16 + 16], &keys_by_head[h][row]));
    }
    const std::vector<std::int32_t> marks = segment_eviction_marks(
        keys.data(), positions.data(), static_cast<std::int64_t>(positions.size()), 16, 8);
    t.evict_positions(seq, h, marks);
    REQUIRE(t.resident_tokens(seq, h, 1).size() == 8);
    REQUIRE(t.resident_tokens(seq, h, 0).size() == 8);  // the other segment is untouched
  }
  REQUIRE_THROWS_WITH(
      [&] {
        std::vector<float> k;
        std::vector<std::int32_t> p;
        t.segment_keys(seq, 0, 2, k, p);
      }(),
      Contains("segment 2 of sequence 0 outside [0, 2)"));
}

TEST_CASE("block formats: names, every accepted spelling, and unknown names", "[table][errors]") {
  const std::vector<std::pair<std::string, BlockFormat>> spellings = {
      {"f32", BlockFormat::f32}, {"full", BlockFormat::f32},        {"32", BlockFormat::f32},
      {"16", BlockFormat::f32},  {"nvfp4", BlockFormat::nvfp4},     {"fp4", BlockFormat::nvfp4},
      {"4", BlockFormat::nvfp4}, {"fp8", BlockFormat::fp8},         {"e4m3", BlockFormat::fp8},
      {"8", BlockFormat::fp8},   {"ternary", BlockFormat::ternary}, {"2", BlockFormat::ternary}};
  for (const auto& [name, format] : spellings) {
    INFO(name);
    REQUIRE(parse_block_format(name) == format);
  }
  REQUIRE(block_format_name(BlockFormat::f32) == "f32");
  REQUIRE(block_format_name(BlockFormat::nvfp4) == "nvfp4");
  REQUIRE(block_format_name(BlockFormat::fp8) == "fp8");
  REQUIRE(block_format_name(BlockFormat::ternary) == "ternary");
  for (BlockFormat f : {BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary}) {
    REQUIRE(block_format_of(quant_format_of(f)) == f);
    REQUIRE(parse_block_format(block_format_name(f)) == f);
  }
  REQUIRE_THROWS_WITH(parse_block_format("int4"),
                      Catch::Matchers::Contains("unknown block format 'int4'"));
  REQUIRE_THROWS_WITH(parse_quant_format("f32"),
                      Catch::Matchers::Contains("unknown quantization format 'f32'"));
}

TEST_CASE("slot positions: 3 little-endian bytes, -1 for a never-written slot",
          "[thought_block_table]") {
  REQUIRE(kMaxSlotPosition == 16777214);
  std::vector<std::uint8_t> bytes(4 * kSlotPositionBytes, 0x5A);
  store_slot_position(bytes.data(), 1, 0x123456);
  REQUIRE(bytes == std::vector<std::uint8_t>{0x5A, 0x5A, 0x5A, 0x56, 0x34, 0x12, 0x5A, 0x5A, 0x5A,
                                             0x5A, 0x5A, 0x5A});  // neighbours untouched
  store_slot_position(bytes.data(), 2, kUnwrittenSlotPosition);
  REQUIRE((bytes[6] == 0xFF && bytes[7] == 0xFF && bytes[8] == 0xFF));
  for (const std::int32_t p : {0, 1, 255, 256, 65535, 65536, 0x7FFFFF, 0x800000, kMaxSlotPosition,
                               kUnwrittenSlotPosition}) {
    store_slot_position(bytes.data(), 3, p);
    REQUIRE(load_slot_position(bytes.data(), 3) == p);
    REQUIRE(load_slot_position(bytes.data(), 1) == 0x123456);
  }
}

TEST_CASE("append refuses a position past the 3-byte slot position limit",
          "[thought_block_table][errors]") {
  // One head, 16-slot f32 blocks without data: each block is evicted as soon as it is full, so the
  // pool never runs dry and 16.7M appends take a few seconds at most.
  ThoughtBlockTableConfig c = full_precision(1, 16, 16, 2);
  c.holds_data = false;
  ThoughtBlockTable t(c);
  const std::int32_t seq = t.create_sequence();
  t.open_segment(seq, ThoughtType::execution);
  std::vector<std::int32_t> block(16);
  for (std::int32_t p = 0; p <= kMaxSlotPosition; ++p) {
    t.append(seq, nullptr, nullptr, 1, 16);
    if (p % 16 == 15) {
      for (std::int32_t i = 0; i < 16; ++i) block[static_cast<std::size_t>(i)] = p - 15 + i;
      t.evict_positions(seq, 0, block);
    }
  }
  // 16,777,215 = 16 · 1,048,575 + 15 tokens: the last 15 are resident with their exact positions.
  REQUIRE(t.length(seq) == kMaxSlotPosition + 1);
  const std::vector<std::int32_t> resident = t.resident_positions(seq, 0);
  REQUIRE(resident.size() == 15);
  REQUIRE(resident.front() == kMaxSlotPosition - 14);
  REQUIRE(resident.back() == kMaxSlotPosition);
  const TableBytes before = t.resident_bytes();
  REQUIRE_THROWS_WITH(
      t.append(seq, nullptr, nullptr, 1, 16),
      Contains("sequence 0 already holds 16777215 positions") && Contains("3-byte slot position"));
  REQUIRE(t.length(seq) == kMaxSlotPosition + 1);  // nothing changed
  REQUIRE(t.resident_bytes().total() == before.total());
  REQUIRE(t.resident_positions(seq, 0) == resident);
}
