// The regroup refill experiment of the ThoughtBlockTable (paged/refill_rule.hpp, docs/thinkv.md §6
// "Experiment: regroup in place"): which run is chosen, which staged tokens go where, survivors
// keep slot / position / segment, the re-quantized group equals an independent call of
// quantize_token_group over (survivors' dequantized rows ∪ new tokens) in slot order, and a group
// re-quantized from its own dequantized rows decodes to them again.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/paged/thought_block_table.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

constexpr std::int32_t kDim = 16;

ThoughtBlockTableConfig regroup_config(std::int32_t slots, std::int32_t min_free,
                                       RefillRule rule = RefillRule::regroup) {
  ThoughtBlockTableConfig c;
  c.kv_heads = 1;
  c.head_dim = kDim;
  c.block_size = slots;
  c.num_blocks = 8;
  c.reasoning = BlockFormat::nvfp4;
  c.execution = BlockFormat::fp8;
  c.transition = BlockFormat::ternary;
  c.refill = rule;
  c.regroup_min_free = min_free;
  return c;
}

// Keys and values of the token at `position` (one head): random, fixed by the position.
void token(std::int32_t position, std::vector<float>& k, std::vector<float>& v) {
  std::mt19937 rng(static_cast<std::uint32_t>(1000 + position));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  k.resize(kDim);
  v.resize(kDim);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
}

SlotAddress append_token(ThoughtBlockTable& t, std::int32_t seq) {
  std::vector<float> k, v;
  token(t.length(seq), k, v);
  SlotAddress where;
  t.append(seq, k.data(), v.data(), 1, kDim, &where);
  return where;
}

float bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// Keeps, in head 0, only these positions among [0, length): evicts the rest.
void keep_only(ThoughtBlockTable& t, std::int32_t seq, std::int32_t length,
               const std::vector<std::int32_t>& keep) {
  std::vector<std::int32_t> evict;
  for (std::int32_t p = 0; p < length; ++p)
    if (std::find(keep.begin(), keep.end(), p) == keep.end()) evict.push_back(p);
  t.evict_positions(seq, 0, evict);
}

std::int32_t position_at(const ThoughtBlockTable& t, std::int32_t seq, std::int32_t block,
                         std::int32_t slot) {
  for (const ResidentToken& r : t.resident_tokens(seq, 0))
    if (r.address.block == block && r.address.slot == slot) return r.position;
  return -1;
}

}  // namespace

TEST_CASE("regroup fills a pinned run's free slots and re-quantizes the whole group",
          "[thought_block_table][regroup]") {
  ThoughtBlockTable t(regroup_config(32, 8));
  const std::int32_t seq = t.create_sequence();
  t.open_segment(seq, ThoughtType::reasoning);
  for (int i = 0; i < 32; ++i) append_token(t, seq);  // groups 0 and 1 of block 0
  REQUIRE(t.num_blocks(seq) == 1);
  // Group 0 keeps slots 3 and 9 (f = 14); group 1 keeps slots 16..25 (f = 6 < min_free 8).
  std::vector<std::int32_t> keep{3, 9};
  for (std::int32_t p = 16; p < 26; ++p) keep.push_back(p);
  keep_only(t, seq, 32, keep);

  // The survivors as attention reads them now, and the block's bytes.
  std::vector<float> old_k(32 * kDim), old_v(32 * kDim);
  t.dequantize_block(seq, 0, 0, old_k.data(), old_v.data());
  const std::vector<std::uint8_t> before = t.block_storage(seq, 0);

  // A new segment of the same type: the new tokens are segment 1, the survivors segment 0.
  t.open_segment(seq, ThoughtType::reasoning);
  for (int i = 0; i < 15; ++i) {
    const SlotAddress w = append_token(t, seq);
    REQUIRE(w.block == kStagedBlock);
  }
  REQUIRE(t.block_storage(seq, 0) == before);  // nothing written before the group completes
  // Position 47 completes a group. No fully free run: the pinned run 0 (f = 14) takes the 14
  // oldest (32..45); 46 and 47 stay staged; no block is taken.
  const SlotAddress w = append_token(t, seq);
  CHECK(w.block == kStagedBlock);
  CHECK(w.slot == 47);
  CHECK(t.num_blocks(seq) == 1);
  CHECK(t.refill_stats().regroups == 1);
  CHECK(t.refill_stats().survivors_requantized == 2);
  CHECK(t.refill_stats().runs == 2);

  // Slots and positions: survivors where they were, new tokens in ascending free slots.
  const std::vector<std::int32_t> free_slots{0, 1, 2, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15};
  for (std::size_t i = 0; i < free_slots.size(); ++i)
    CHECK(position_at(t, seq, 0, free_slots[i]) == 32 + static_cast<std::int32_t>(i));
  CHECK(position_at(t, seq, 0, 3) == 3);
  CHECK(position_at(t, seq, 0, 9) == 9);
  for (const ResidentToken& r : t.resident_tokens(seq, 0))
    CHECK(r.segment == (r.position < 32 ? 0 : 1));
  CHECK(t.live_tokens(seq, 0) == 2 + 10 + 16);
  const std::vector<ResidentToken> staged = t.resident_tokens(seq, 0);
  CHECK(staged[staged.size() - 2].address.block == kStagedBlock);
  CHECK(staged[staged.size() - 2].position == 46);
  CHECK(staged.back().position == 47);

  // Oracle: the group quantizer over the expected rows, written into the old bytes.
  std::vector<float> rows_k(16 * kDim), rows_v(16 * kDim);
  int next = 0;
  for (int s = 0; s < 16; ++s) {
    if (s == 3 || s == 9) {
      std::copy_n(&old_k[s * kDim], kDim, &rows_k[s * kDim]);
      std::copy_n(&old_v[s * kDim], kDim, &rows_v[s * kDim]);
      continue;
    }
    std::vector<float> k, v;
    token(32 + next++, k, v);
    for (int d = 0; d < kDim; ++d) {  // staged at bf16 (the default staging dtype)
      rows_k[s * kDim + d] = bf16(k[d]);
      rows_v[s * kDim + d] = bf16(v[d]);
    }
  }
  QuantizedGroup g;
  quantize_token_group(BlockFormat::nvfp4, rows_k.data(), rows_v.data(), kDim, kDim, 1.0f, g);
  std::vector<std::uint8_t> expected = before;
  write_token_group(BlockHeadLayout{BlockFormat::nvfp4, 32, kDim}, expected.data(), 0,
                    g.key_codes.data(), g.key_scales.data(), g.value_codes.data(),
                    g.value_scales.data());
  CHECK(t.block_storage(seq, 0) == expected);  // group 1 (f = 6) bit-identical too

  // Less memory than the default rule on the same stream (which takes a second block).
  ThoughtBlockTable r(regroup_config(32, 8, RefillRule::run));
  const std::int32_t rs = r.create_sequence();
  r.open_segment(rs, ThoughtType::reasoning);
  for (int i = 0; i < 32; ++i) append_token(r, rs);
  keep_only(r, rs, 32, keep);
  r.open_segment(rs, ThoughtType::reasoning);
  for (int i = 0; i < 16; ++i) append_token(r, rs);
  CHECK(r.num_blocks(rs) == 2);
  CHECK(r.refill_stats().regroups == 0);
  CHECK(t.resident_bytes().total() < r.resident_bytes().total());
}

TEST_CASE("a group re-quantized from its own dequantized rows decodes to the same rows",
          "[thought_block_table][regroup]") {
  // Why a regroup's cost is in the keys alone: values are grouped per token, so a survivor's value
  // groups are re-quantized from its dequantized values only, and that returns them unchanged in
  // every block format. NVFP4 and ternary even give back the same bytes; FP8 may not (a maximum
  // that rounded down can lower the power-of-two scale, doubling the codes: same values).
  constexpr int D = 64, S = kQuantGroupSize;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (BlockFormat f : {BlockFormat::nvfp4, BlockFormat::fp8, BlockFormat::ternary}) {
    INFO(block_format_name(f));
    const BlockHeadLayout L{f, S, D};
    bool same_bytes = true;
    for (int trial = 0; trial < 60; ++trial) {
      std::vector<float> k(S * D), v(S * D);
      for (float& x : k) x = normal(rng) * static_cast<float>(1 + trial % 5);
      for (float& x : v) x = normal(rng) * static_cast<float>(1 + trial % 3);
      auto encode = [&](const float* keys, const float* values) {
        QuantizedGroup g;
        quantize_token_group(f, keys, values, D, D, 1.0f, g);
        std::vector<std::uint8_t> bytes(static_cast<std::size_t>(L.bytes()));
        write_token_group(L, bytes.data(), 0, g.key_codes.data(), g.key_scales.data(),
                          g.value_codes.data(), g.value_scales.data());
        return bytes;
      };
      const std::vector<std::uint8_t> once = encode(k.data(), v.data());
      std::vector<float> k1(S * D), v1(S * D), k2(S * D), v2(S * D);
      dequantize_block_head(L, once.data(), 1.0f, k1.data(), v1.data());
      const std::vector<std::uint8_t> twice = encode(k1.data(), v1.data());
      dequantize_block_head(L, twice.data(), 1.0f, k2.data(), v2.data());
      REQUIRE(k2 == k1);
      REQUIRE(v2 == v1);
      same_bytes = same_bytes && twice == once;
    }
    if (f != BlockFormat::fp8) CHECK(same_bytes);
  }
}

TEST_CASE("regroup prefers a fully free run, then the most free slots, lowest first",
          "[thought_block_table][regroup]") {
  SECTION("a fully free run is taken as today: no survivor touched") {
    ThoughtBlockTable t(regroup_config(32, 1));
    const std::int32_t seq = t.create_sequence();
    t.open_segment(seq, ThoughtType::reasoning);
    for (int i = 0; i < 32; ++i) append_token(t, seq);
    keep_only(t, seq, 32, {5});  // run 0 pinned (f = 15), run 1 fully free
    std::vector<float> k0(kDim), v0(kDim), k1(kDim), v1(kDim);
    t.read_token(seq, 0, SlotAddress{0, 5}, k0.data(), v0.data());
    for (int i = 0; i < 16; ++i) append_token(t, seq);
    CHECK(t.refill_stats().regroups == 0);
    CHECK(position_at(t, seq, 0, 16) == 32);
    CHECK(position_at(t, seq, 0, 31) == 47);
    // The survivor reads back bit-identically (its group was not re-quantized).
    t.read_token(seq, 0, SlotAddress{0, 5}, k1.data(), v1.data());
    CHECK(k1 == k0);
    CHECK(v1 == v0);
  }
  SECTION("the pinned run with the most free slots; ties go to the lowest") {
    ThoughtBlockTable t(regroup_config(64, 8));
    const std::int32_t seq = t.create_sequence();
    t.open_segment(seq, ThoughtType::reasoning);
    for (int i = 0; i < 64; ++i) append_token(t, seq);
    // f per run: run 0: 10, run 1: 12, run 2: 12, run 3: 9.
    std::vector<std::int32_t> keep{0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 32, 33, 34, 35};
    for (std::int32_t p = 48; p < 55; ++p) keep.push_back(p);
    keep_only(t, seq, 64, keep);
    for (int i = 0; i < 16; ++i) append_token(t, seq);
    CHECK(t.refill_stats().regroups == 1);
    CHECK(t.refill_stats().survivors_requantized == 4);
    for (std::int32_t s = 20; s < 32; ++s) CHECK(position_at(t, seq, 0, s) == 64 + (s - 20));
    CHECK(position_at(t, seq, 0, 36) == -1);  // run 2 untouched
    CHECK(t.live_tokens(seq, 0) == 21 + 16);  // 4 still staged
  }
  SECTION("no pinned run reaches regroup_min_free: a new block, as today") {
    ThoughtBlockTable t(regroup_config(32, 8));
    const std::int32_t seq = t.create_sequence();
    t.open_segment(seq, ThoughtType::reasoning);
    for (int i = 0; i < 32; ++i) append_token(t, seq);
    std::vector<std::int32_t> keep;
    for (std::int32_t p = 0; p < 32; ++p)
      if (p % 16 < 9) keep.push_back(p);  // f = 7 in both runs
    keep_only(t, seq, 32, keep);
    for (int i = 0; i < 16; ++i) append_token(t, seq);
    CHECK(t.refill_stats().regroups == 0);
    CHECK(t.num_blocks(seq) == 2);
  }
  SECTION("a pinned run of another type is never used") {
    ThoughtBlockTable t(regroup_config(32, 1));
    const std::int32_t seq = t.create_sequence();
    t.open_segment(seq, ThoughtType::execution);
    for (int i = 0; i < 32; ++i) append_token(t, seq);
    keep_only(t, seq, 32, {0, 16});
    t.open_segment(seq, ThoughtType::reasoning);
    for (int i = 0; i < 16; ++i) append_token(t, seq);
    CHECK(t.refill_stats().regroups == 0);
    CHECK(t.num_blocks(seq) == 2);
    CHECK(t.block_info(seq, 1).type == ThoughtType::reasoning);
  }
}

TEST_CASE("regroup options: validation and names", "[thought_block_table][regroup]") {
  ThoughtBlockTableConfig c = regroup_config(32, 0);
  REQUIRE_THROWS_WITH(c.validate(), Contains("regroup_min_free must be in [1, 15], got 0"));
  c.regroup_min_free = 16;
  REQUIRE_THROWS_WITH(c.validate(), Contains("got 16"));
  c.regroup_min_free = 15;
  REQUIRE_NOTHROW(c.validate());
  CHECK(ThoughtBlockTableConfig{}.refill == RefillRule::run);  // the default is today's rule
  CHECK(parse_refill_rule("regroup") == RefillRule::regroup);
  CHECK(parse_refill_rule("run") == RefillRule::run);
  CHECK(refill_rule_name(RefillRule::regroup) == "regroup");
  REQUIRE_THROWS_WITH(parse_refill_rule("gather"),
                      Contains("unknown refill rule 'gather'") && Contains("run or regroup"));
}

TEST_CASE("take_oldest hands out the oldest staged tokens and keeps the rest in order",
          "[staged_group_quantizer][regroup]") {
  StagedGroupQuantizerConfig c;
  c.kv_heads = 1;
  c.head_dim = kDim;
  StagedGroupQuantizer q(c);
  std::vector<float> k(kDim), v(kDim);
  for (int p = 0; p < 5; ++p) {
    std::fill(k.begin(), k.end(), static_cast<float>(p));
    std::fill(v.begin(), v.end(), static_cast<float>(-p));
    q.stage(ThoughtType::reasoning, 0, 10 + p, k.data(), v.data());
  }
  std::vector<float> ok(3 * kDim), ov(3 * kDim);
  std::int32_t pos[3];
  q.take_oldest(ThoughtType::reasoning, 0, 3, ok.data(), ov.data(), pos);
  CHECK(pos[0] == 10);
  CHECK(pos[2] == 12);
  CHECK(ok[2 * kDim] == 2.0f);
  CHECK(ov[2 * kDim + 5] == -2.0f);
  REQUIRE(q.staged_count(ThoughtType::reasoning, 0) == 2);
  CHECK(q.staged_position(ThoughtType::reasoning, 0, 0) == 13);
  q.staged_token(ThoughtType::reasoning, 0, 1, k.data(), v.data());
  CHECK(k[0] == 4.0f);
  REQUIRE_THROWS_WITH(q.take_oldest(ThoughtType::reasoning, 0, 3, ok.data(), ov.data(), pos),
                      Contains("n = 3 outside [1, 2]"));
}
