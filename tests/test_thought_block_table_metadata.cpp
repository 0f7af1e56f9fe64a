// The metadata-only ThoughtBlockTable (holds_data = false), the host half of the device ThinKV
// pipeline (docs/thinkv.md §9): driven through the same random history as a table that holds
// the data, it must place every token in the same (block, slot) of every head, keep the same
// masks, positions, segments, pool and byte accounting — while holding no K/V byte and refusing
// every read of data; under both refill rules (run, and the regroup experiment).
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "thought_table_checks.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

ThoughtBlockTableConfig mixed_config(bool holds_data) {
  ThoughtBlockTableConfig c;
  c.kv_heads = 3;
  c.head_dim = 32;
  c.block_size = 32;
  c.num_blocks = 64;
  c.reasoning = BlockFormat::nvfp4;
  c.execution = BlockFormat::f32;  // one type written at once, slot by slot
  c.transition = BlockFormat::ternary;
  c.holds_data = holds_data;
  return c;
}

void require_same_placement(const ThoughtBlockTable& data, const ThoughtBlockTable& meta,
                            std::int32_t seq) {
  const std::int32_t H = data.config().kv_heads, W = data.mask_words();
  REQUIRE(meta.num_blocks(seq) == data.num_blocks(seq));
  REQUIRE(meta.free_blocks() == data.free_blocks());
  for (std::int32_t b = 0; b < data.num_blocks(seq); ++b) {
    const BlockInfo want = data.block_info(seq, b), got = meta.block_info(seq, b);
    REQUIRE(got.frame == want.frame);
    REQUIRE(got.type == want.type);
    REQUIRE(got.format == want.format);
    for (std::int32_t h = 0; h < H; ++h)
      for (std::int32_t w = 0; w < W; ++w)
        REQUIRE(meta.free_mask(seq, b, h)[w] == data.free_mask(seq, b, h)[w]);
  }
  kvsift::test::require_same_resident_tokens(data, seq, meta, seq);
  const TableBytes a = data.resident_bytes(), m = meta.resident_bytes();
  REQUIRE(m.codes == a.codes);
  REQUIRE(m.scales == a.scales);
  REQUIRE(m.metadata == a.metadata);
  REQUIRE(m.staging == a.staging);
}

// Drives both tables through one random history (18 segments of random thought types, 40 tokens
// each, then random evictions) and checks after every segment that they agree. Returns the data
// table's refill counts.
RefillStats run_history(ThoughtBlockTableConfig data_config, ThoughtBlockTableConfig meta_config) {
  ThoughtBlockTable data(std::move(data_config)), meta(std::move(meta_config));
  const std::int32_t s = data.create_sequence();
  REQUIRE(meta.create_sequence() == s);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int32_t H = 3, D = 32;
  std::vector<float> k(static_cast<std::size_t>(H * D)), v(k.size());
  std::vector<SlotAddress> want(H), got(H);
  std::int64_t evictions = 0, frees = 0;
  for (int segment = 0; segment < 18; ++segment) {
    const ThoughtType type = static_cast<ThoughtType>(rng() % 3);
    REQUIRE(meta.open_segment(s, type) == data.open_segment(s, type));
    for (int t = 0; t < 40; ++t) {
      for (float& x : k) x = normal(rng);
      for (float& x : v) x = normal(rng);
      const std::int32_t p = data.append(s, k.data(), v.data(), H, D, want.data());
      REQUIRE(meta.append(s, nullptr, nullptr, H, D, got.data()) == p);
      for (std::int32_t h = 0; h < H; ++h) {
        REQUIRE(got[h].block == want[h].block);
        REQUIRE(got[h].slot == want[h].slot);
      }
    }
    // Evict a random half of each head's tokens of a random earlier segment (block slots and
    // staged tokens alike), as TBE would; every third segment, all of them, so that blocks empty.
    const std::int32_t victim = static_cast<std::int32_t>(rng() % (segment + 1));
    const bool all = segment % 3 == 2;
    const std::int32_t used_before = data.used_blocks();
    for (std::int32_t h = 0; h < H; ++h) {
      std::vector<std::int32_t> positions;
      for (const ResidentToken& r : data.resident_tokens(s, h, victim))
        if (all || rng() % 2 == 0) positions.push_back(r.position);
      data.evict_positions(s, h, positions);
      meta.evict_positions(s, h, positions);
      evictions += static_cast<std::int64_t>(positions.size());
    }
    frees += used_before > data.used_blocks();
    INFO("segment " << segment);
    require_same_placement(data, meta, s);
  }
  // The history exercised what it claims to: evictions and blocks returned to the pool.
  REQUIRE(evictions > 200);
  REQUIRE(frees > 0);
  // No K/V byte is held: the blocks carry masks and positions only, staging positions only.
  const TableBytes held = meta.allocated_bytes(), full = data.allocated_bytes();
  REQUIRE(held.codes == 0);
  REQUIRE(held.scales == 0);
  REQUIRE(held.metadata == full.metadata);
  REQUIRE(held.staging > 0);
  REQUIRE(held.staging < full.staging);
  const RefillStats& a = data.refill_stats();
  const RefillStats& m = meta.refill_stats();
  REQUIRE(m.runs == a.runs);
  REQUIRE(m.regroups == a.regroups);
  REQUIRE(m.survivors_requantized == a.survivors_requantized);
  return a;
}

}  // namespace

TEST_CASE("a metadata-only table places every token as the table with data does",
          "[thought_block_table][metadata]") {
  REQUIRE(run_history(mixed_config(true), mixed_config(false)).regroups == 0);
}

TEST_CASE("a metadata-only table regroups as the table with data does",
          "[thought_block_table][metadata][regroup]") {
  // The host half of the device table's regroup (cuda/paged_append.cu): same pinned runs, same
  // staged tokens into the same slots, same positions.
  ThoughtBlockTableConfig data = mixed_config(true), meta = mixed_config(false);
  data.refill = meta.refill = RefillRule::regroup;
  data.regroup_min_free = meta.regroup_min_free = 4;
  const RefillStats stats = run_history(data, meta);
  INFO("regroups " << stats.regroups << ", runs " << stats.runs);
  REQUIRE(stats.regroups >= 5);
}

TEST_CASE("a metadata-only table refuses reads of data",
          "[thought_block_table][metadata][errors]") {
  ThoughtBlockTable meta(mixed_config(false));
  const std::int32_t s = meta.create_sequence();
  meta.open_segment(s, ThoughtType::execution);  // f32: the token lands in a block at once
  SlotAddress where[3];
  meta.append(s, nullptr, nullptr, 3, 32, where);
  meta.open_segment(s, ThoughtType::reasoning);  // quantized: the next token is staged
  meta.append(s, nullptr, nullptr, 3, 32);
  std::vector<float> key(32), value(32), rows(32 * 32);
  std::vector<std::int32_t> positions;
  const char* why = "metadata only (holds_data = false)";
  REQUIRE_THROWS_WITH(meta.read_token(s, 0, where[0], key.data(), value.data()), Contains(why));
  REQUIRE_THROWS_WITH(meta.read_token(s, 0, SlotAddress{kStagedBlock, 1}, key.data(), value.data()),
                      Contains(why));
  REQUIRE_THROWS_WITH(meta.dequantize_block(s, 0, 0, rows.data(), rows.data()), Contains(why));
  REQUIRE_THROWS_WITH(meta.segment_keys(s, 0, 0, key, positions), Contains(why));
  REQUIRE_THROWS_WITH(meta.staged_rows(s, 0, key, value), Contains(why));
  REQUIRE_THROWS_WITH(meta.block_storage(s, 0), Contains(why));
  // Placement and inspection still work.
  REQUIRE(meta.resident_tokens(s, 0).size() == 2);
  REQUIRE(meta.live_tokens(s, 2) == 2);

  // A table with data still needs the data.
  ThoughtBlockTable data(mixed_config(true));
  const std::int32_t d = data.create_sequence();
  data.open_segment(d, ThoughtType::reasoning);
  REQUIRE_THROWS_WITH(data.append(d, nullptr, nullptr, 3, 32), Contains("must not be null"));
}
