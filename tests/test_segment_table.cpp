// SegmentTable (docs/algorithms.md §2.3): hand-built multi-step scenarios with every range worked
// out on paper, a randomized comparison with a slot-by-slot simulation of the cache, the penalty
// lookup, and the error paths.
#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/segment_table.hpp"

using namespace kvsift;

namespace {
struct Span {  // what the table's append_closed() reads from a tracker's sentences
  std::int64_t start, end;
  float lambda = -1.0f;
};

void require_ranges(const SegmentTable& t, std::int64_t layer, std::int64_t b, std::int64_t h,
                    const std::vector<CacheRange>& expected) {
  const auto& got = t.ranges(layer, b, h);
  INFO("layer " << layer << " b " << b << " h " << h);
  REQUIRE(got.size() == expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("range " << i);
    CHECK(got[i].sentence == expected[i].sentence);
    CHECK(got[i].lo == expected[i].lo);
    CHECK(got[i].hi == expected[i].hi);
  }
}

KeepPlan plan_of(std::int64_t cache_len, std::int32_t window,
                 const std::vector<std::vector<std::int32_t>>& rows) {
  const auto kept = static_cast<std::int32_t>(rows[0].size());
  KeepPlan p(1, static_cast<std::int64_t>(rows.size()), 64, {static_cast<std::int32_t>(cache_len)},
             {kept}, window);
  for (const auto& r : rows) p.append_row(r);
  p.validate();
  return p;
}
}  // namespace

TEST_CASE("two evictions: whole sentences dropped, ranges shrink, heads differ, tail appends",
          "[segments]") {
  SegmentTable t(1, 1, 2);
  // Positions 0..11: S0 = [0,3], S1 = [4,6], S2 = [7,9], open from 10.
  std::vector<Span> s = {{0, 3}, {4, 6}, {7, 9}};
  t.append_closed(0, 0, s, /*current_pos=*/12, /*cache_len=*/12);
  for (int h = 0; h < 2; ++h) require_ranges(t, 0, 0, h, {{0, 0, 3}, {1, 4, 6}, {2, 7, 9}});

  // Eviction 1 (window 2): head 0 keeps gen {0,1,4,5,6,9,10,11}, head 1 keeps {1,2,3,7,8,9,10,11}.
  t.apply_plan(0, plan_of(12, 2, {{0, 1, 4, 5, 6, 9, 10, 11}, {1, 2, 3, 7, 8, 9, 10, 11}}));
  require_ranges(t, 0, 0, 0, {{0, 0, 1}, {1, 2, 4}, {2, 5, 5}});
  require_ranges(t, 0, 0, 1, {{0, 0, 2}, {2, 3, 5}});  // S1 evicted whole in head 1: dropped

  // Three decode tokens (12, 13, 14); 13 closes S3 = [10, 13]. Cache 8 + 3 = 11.
  s.push_back({10, 13});
  t.append_closed(0, 0, s, 15, 11);
  // lo = previous hi + 1 = 6, hi = 11 - 15 + 13 = 9: gen 10, 11 (kept) and 12, 13 (the tail).
  require_ranges(t, 0, 0, 0, {{0, 0, 1}, {1, 2, 4}, {2, 5, 5}, {3, 6, 9}});
  require_ranges(t, 0, 0, 1, {{0, 0, 2}, {2, 3, 5}, {3, 6, 9}});

  // Eviction 2 (window 1, slot 10 = gen 14): head 0 keeps slots {0,1,2,3,4,10},
  // head 1 keeps {0,5,7,8,9,10}.
  t.apply_plan(0, plan_of(11, 1, {{0, 1, 2, 3, 4, 10}, {0, 5, 7, 8, 9, 10}}));
  require_ranges(t, 0, 0, 0, {{0, 0, 1}, {1, 2, 4}});  // S2 and S3 gone from head 0
  // Head 1 keeps gen 1 of S0, gen 9 of S2, and gen 11..13 of S3.
  require_ranges(t, 0, 0, 1, {{0, 0, 0}, {2, 1, 1}, {3, 2, 4}});

  // Two more tokens (15, 16); 16 closes S4 = [14, 16]. Cache 6 + 2 = 8, S4 in slots 5..7.
  s.push_back({14, 16});
  t.append_closed(0, 0, s, 17, 8);
  require_ranges(t, 0, 0, 0, {{0, 0, 1}, {1, 2, 4}, {4, 5, 7}});
  require_ranges(t, 0, 0, 1, {{0, 0, 0}, {2, 1, 1}, {3, 2, 4}, {4, 5, 7}});
  CHECK(t.sentences_appended(0, 0) == 5);

  SECTION("penalty lookup and the score-row penalty") {
    s[0].lambda = 0.97f;
    s[3].lambda = 0.96f;
    const auto p0 = t.penalty_ranges(0, 0, 0, s);
    REQUIRE(p0.size() == 1);
    CHECK(p0[0].lo == 0);
    CHECK(p0[0].hi == 1);
    CHECK(p0[0].lambda == 0.97f);
    const auto p1 = t.penalty_ranges(0, 0, 1, s);
    REQUIRE(p1.size() == 2);
    std::vector<float> row(8, 0.5f);
    add_sentence_penalty(row.data(), 8, 8, p1);
    // S0 is down to one slot (lo == hi): no penalty, as the reference's lo < hi < S test says.
    const std::vector<float> expected = {0.5f,         0.5f, 0.5f - 0.96f, 0.5f - 0.96f,
                                         0.5f - 0.96f, 0.5f, 0.5f,         0.5f};
    CHECK(row == expected);
    // A row shorter than the cache (window sliced off) is written only up to its end.
    std::vector<float> shorter(3, 0.0f);
    add_sentence_penalty(shorter.data(), 3, 8, p1);
    CHECK(shorter == std::vector<float>{0.0f, 0.0f, -0.96f});
  }
}

TEST_CASE("left padding: the first sentence maps after the pads even across an early eviction",
          "[segments]") {
  SegmentTable t(1, 1, 1);
  t.set_first_position(0, 3);
  // Positions 0..2 are pads, 3..9 real, no sentence closed yet; evict keeping {0, 4, 6, 8, 9}.
  t.apply_plan(0, plan_of(10, 2, {{0, 4, 6, 8, 9}}));
  // Position 10 closes S0 = [3, 10]: kept gen 4, 6, 8, 9 at slots 1..4, gen 10 at slot 5.
  t.append_closed(0, 0, std::vector<Span>{{3, 10}}, 11, 6);
  require_ranges(t, 0, 0, 0, {{0, 1, 5}});
}

namespace {
// Slot-by-slot oracle: every (b, h) row of the cache as the list of generation positions it
// holds. A sentence's range is [first, last] slot holding one of its positions.
struct CacheSim {
  std::vector<std::vector<std::int64_t>> rows;  // [batch * heads][cache_len]
};
}  // namespace

// Layer 0 takes its plans through apply_plan(), layer 1 through apply_rows() (a sequence that keeps
// everything, early on, takes its identity path).
TEST_CASE("random multi-step runs match a slot-by-slot simulation of the cache", "[segments]") {
  const std::int64_t L = 2, B = 2, H = 3;
  std::mt19937 rng(1234);
  for (int run = 0; run < 20; ++run) {
    SegmentTable table(L, B, H);
    const std::int64_t pads[B] = {0, static_cast<std::int64_t>(rng() % 5)};
    std::vector<std::vector<Span>> sentences(B);
    std::vector<std::int64_t> open_start(B), pos(B);
    std::vector<CacheSim> sim(L);
    for (std::int64_t b = 0; b < B; ++b) {
      table.set_first_position(b, pads[b]);
      open_start[b] = pos[b] = pads[b];
    }
    for (auto& layer : sim) layer.rows.assign(B * H, {});
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t p = 0; p < pads[b]; ++p)
          for (auto& layer : sim) layer.rows[b * H + h].push_back(p);
    const std::int32_t window = 3, budget = 12;
    for (int step = 0; step < 120; ++step) {
      for (std::int64_t b = 0; b < B; ++b) {  // one token per sequence per step
        const std::int64_t p = pos[b]++;
        for (auto& layer : sim)
          for (std::int64_t h = 0; h < H; ++h) layer.rows[b * H + h].push_back(p);
        if (rng() % 4 == 0) {
          sentences[b].push_back({open_start[b], p});
          open_start[b] = p + 1;
        }
      }
      if (step % 9 != 8) continue;  // a compression trigger every 9 steps
      for (std::int64_t l = 0; l < L; ++l) {
        auto& rows = sim[l].rows;
        std::vector<std::int32_t> lens, kept;
        for (std::int64_t b = 0; b < B; ++b) {
          const auto len = static_cast<std::int32_t>(rows[b * H].size());
          table.append_closed(l, b, sentences[b], pos[b], len);
          lens.push_back(len);
          kept.push_back(std::min(len, budget));
        }
        KeepPlan plan(B, H, 1024, lens, kept, window);
        for (std::int64_t b = 0; b < B; ++b) {
          for (std::int64_t h = 0; h < H; ++h) {
            std::vector<std::int32_t> slots(lens[b] - window);
            for (std::int32_t i = 0; i < lens[b] - window; ++i) slots[i] = i;
            std::shuffle(slots.begin(), slots.end(), rng);
            slots.resize(kept[b] - window);
            std::sort(slots.begin(), slots.end());
            for (std::int32_t i = 0; i < window; ++i) slots.push_back(lens[b] - window + i);
            plan.append_row(slots);
            std::vector<std::int64_t> survivors;
            for (std::int32_t s : slots) survivors.push_back(rows[b * H + h][s]);
            rows[b * H + h] = survivors;
          }
        }
        if (l == 0) {
          table.apply_plan(l, plan);
        } else {  // the device step's form: fixed-stride rows, junk past each kept count
          const std::int64_t stride = budget + 2;
          std::vector<std::int32_t> flat(static_cast<std::size_t>(B * H * stride), -9);
          for (std::int64_t b = 0; b < B; ++b)
            for (std::int64_t h = 0; h < H; ++h)
              std::copy(plan.row(b, h), plan.row(b, h) + plan.row_size(b, h),
                        flat.begin() + (b * H + h) * stride);
          table.apply_rows(l, flat.data(), stride, kept.data(), lens.data());
        }
        // Compare every appended sentence in every head with the simulation.
        for (std::int64_t b = 0; b < B; ++b) {
          for (std::int64_t h = 0; h < H; ++h) {
            std::vector<CacheRange> expected;
            const auto& row = rows[b * H + h];
            for (std::size_t id = 0; id < sentences[b].size(); ++id) {
              std::int64_t lo = -1, hi = -1;
              for (std::size_t slot = 0; slot < row.size(); ++slot) {
                if (row[slot] >= sentences[b][id].start && row[slot] <= sentences[b][id].end) {
                  if (lo < 0) lo = static_cast<std::int64_t>(slot);
                  hi = static_cast<std::int64_t>(slot);
                }
              }
              if (lo >= 0) expected.push_back({static_cast<std::int64_t>(id), lo, hi});
            }
            INFO("run " << run << " step " << step);
            require_ranges(table, l, b, h, expected);
          }
        }
      }
    }
  }
}

TEST_CASE("SegmentTable rejects bad shapes, plans and spans with clear errors", "[errors]") {
  {
    SegmentTable t(1, 1, 1);
    const std::vector<std::int32_t> rows = {0, 1, 2}, kept = {4}, source = {10};
    REQUIRE_THROWS_WITH(t.apply_rows(0, rows.data(), 3, kept.data(), source.data()),
                        Catch::Matchers::Contains("sequence 0 keeps 4 of 10 tokens in rows of 3"));
    REQUIRE_THROWS_WITH(t.apply_rows(1, rows.data(), 3, kept.data(), source.data()),
                        Catch::Matchers::Contains("apply_rows: layer 1 outside [0, 1)"));
  }
  REQUIRE_THROWS_WITH(SegmentTable(1, 0, 2), Catch::Matchers::Contains("batch (0)"));
  SegmentTable t(2, 1, 2);
  REQUIRE_THROWS_WITH(t.append(2, 0, {0, 3}, 10, 10),
                      Catch::Matchers::Contains("layer 2 outside [0, 2)"));
  REQUIRE_THROWS_WITH(t.append(0, 1, {0, 3}, 10, 10),
                      Catch::Matchers::Contains("sequence 1 outside [0, 1)"));
  REQUIRE_THROWS_WITH(t.append(0, 0, {4, 3}, 10, 10), Catch::Matchers::Contains("span [4, 3]"));
  REQUIRE_THROWS_WITH(t.append(0, 0, {0, 10}, 10, 10),
                      Catch::Matchers::Contains("ends at 10, at or past current_pos = 10"));
  REQUIRE_THROWS_WITH(t.append(0, 0, {0, 3}, 10, 11),
                      Catch::Matchers::Contains("cache_len (11) outside [0, current_pos = 10]"));
  t.append(0, 0, {0, 3}, 10, 10);
  REQUIRE_THROWS_WITH(
      t.append(0, 0, {2, 5}, 10, 10),
      Catch::Matchers::Contains("starts at 2, not after the previous sentence's end 3"));
  REQUIRE_THROWS_WITH(t.set_first_position(0, 2), Catch::Matchers::Contains("already has"));
  REQUIRE_THROWS_WITH(t.append_closed(0, 0, std::vector<Span>{}, 10, 10),
                      Catch::Matchers::Contains("has 0 sentences, but 1 are already mapped"));
  REQUIRE_THROWS_WITH(t.penalty_ranges(0, 0, 0, std::vector<Span>{}),
                      Catch::Matchers::Contains("sentence 0 of sequence 0 is mapped but only 0"));
  REQUIRE_THROWS_WITH(t.ranges(0, 0, 2), Catch::Matchers::Contains("kv head 2 outside [0, 2)"));

  KeepPlan three_heads(1, 3, 16, {10}, {4}, 1);
  REQUIRE_THROWS_WITH(t.apply_plan(0, three_heads),
                      Catch::Matchers::Contains("plan is [batch=1, kv_heads=3]"));
  KeepPlan partial(1, 2, 16, {10}, {4}, 1);
  partial.append_row({0, 1, 2, 9});
  REQUIRE_THROWS_WITH(t.apply_plan(0, partial), Catch::Matchers::Contains("only 1 of 2 rows"));
  REQUIRE(t.ranges(0, 0, 0).size() == 1);  // rejected plans leave the table as it was

  std::vector<float> row(4, 0.0f);
  REQUIRE_THROWS_WITH(add_sentence_penalty(row.data(), 5, 4, {}),
                      Catch::Matchers::Contains("row_len (5) outside [0, cache_len = 4]"));
  REQUIRE_THROWS_WITH(add_sentence_penalty(row.data(), 4, 4, {{0, 2, NAN}}),
                      Catch::Matchers::Contains("non-finite lambda"));
}
