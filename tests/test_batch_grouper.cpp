// BatchGrouper (docs/algorithms.md §2.6): a hand-worked example, the real MATH-500 totals published in
// shared/data/README.md, and the error paths.
#include <algorithm>
#include <cstdint>
#include <sstream>
#include <vector>

#include "catch.hpp"
#include "kvsift/policy/skipkv/batch_grouper.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

using Groups = std::vector<std::vector<std::int64_t>>;

// Independent oracle: total padding of `lengths` cut into batches of `bs` in the given order,
// walking each request and looking up its batch's longest prompt directly.
std::int64_t padding_oracle(std::vector<std::int64_t> lengths, std::int64_t bs) {
  std::int64_t total = 0;
  for (std::size_t p = 0; p < lengths.size(); ++p) {
    const std::size_t first = p / bs * bs;
    const std::size_t last = std::min(lengths.size(), first + bs);
    total += *std::max_element(lengths.begin() + first, lengths.begin() + last) - lengths[p];
  }
  return total;
}

}  // namespace

TEST_CASE("hand example: five requests in batches of two", "[batch_grouper]") {
  // Data-set order: [5 2] pads 3+0, [9 3] pads 0+6, [7] pads 0 -> 9.
  // Sorted 2 3 | 5 7 | 9 (indices 1 3 | 0 4 | 2): pads 1+0, 2+0, 0 -> 3.
  const std::vector<std::int64_t> lengths = {5, 2, 9, 3, 7};

  SECTION("sorted (the SkipKV grouping)") {
    const BatchGroups g = BatchGrouper({2, true}).group(lengths);
    REQUIRE(g.batches == Groups{{1, 3}, {0, 4}, {2}});
    REQUIRE(g.pad == std::vector<std::int64_t>{2, 1, 0, 0, 0});
    REQUIRE(g.batch_of == std::vector<std::int64_t>{1, 0, 2, 0, 1});
    REQUIRE(g.real_tokens == 26);
    REQUIRE(g.padding == 3);
    REQUIRE(g.padding_sorted == 3);
    REQUIRE(g.padding_unsorted == 9);
  }
  SECTION("data-set order (the ungrouped baseline)") {
    const BatchGroups g = BatchGrouper({2, false}).group(lengths);
    REQUIRE(g.batches == Groups{{0, 1}, {2, 3}, {4}});
    REQUIRE(g.pad == std::vector<std::int64_t>{0, 3, 0, 6, 0});
    REQUIRE(g.padding == 9);
    REQUIRE(g.padding_sorted == 3);
    REQUIRE(g.padding_unsorted == 9);
  }
  SECTION("batch size 1 pads nothing; one batch of all pads to the longest") {
    REQUIRE(BatchGrouper({1, true}).group(lengths).padding_unsorted == 0);
    const BatchGroups all = BatchGrouper({100, true}).group(lengths);
    REQUIRE(all.batches.size() == 1);
    REQUIRE(all.padding == 9 * 5 - 26);
  }
}

TEST_CASE("equal lengths keep data-set order (stable sort)", "[batch_grouper]") {
  const BatchGroups g = BatchGrouper({2, true}).group({4, 4, 1, 4});
  REQUIRE(g.batches == Groups{{2, 0}, {1, 3}});
  REQUIRE(g.pad == std::vector<std::int64_t>{0, 0, 3, 0});
}

TEST_CASE("effective budget with force-kept pads", "[batch_grouper]") {
  REQUIRE(effective_budget(128, 8, 0) == 128);
  REQUIRE(effective_budget(128, 8, 20) == 108);
  REQUIRE(effective_budget(128, 8, 119) == 9);
  REQUIRE_THROWS_WITH(effective_budget(128, 8, 120),
                      Contains("128 - 120 = 8") && Contains("window (8)"));
  REQUIRE_THROWS_WITH(effective_budget(128, 8, -1), Contains("pad must be >= 0, got -1"));
  REQUIRE_THROWS_WITH(effective_budget(128, -2, 0), Contains("window must be >= 0, got -2"));

  const BatchGroups g = BatchGrouper({2, true}).group({5, 2, 9, 3, 7});
  REQUIRE(effective_budgets(g, 16, 4) == std::vector<std::int64_t>{14, 15, 16, 16, 16});
  REQUIRE_THROWS_WITH(effective_budgets(g, 6, 4), Contains("6 - 2 = 4"));
}

TEST_CASE("MATH-500 (R1-Qwen lengths) reproduces the published padding totals", "[batch_grouper]") {
  const std::vector<std::int64_t> lengths =
      read_prefill_lengths(KVSIFT_DATA_DIR "/math500_prefill_r1qwen.txt");
  REQUIRE(lengths.size() == 500);

  struct Case {
    std::int64_t bs, before, after;
  };
  // shared/data/README.md; the last batch is partial for bs 32 (500 = 15*32 + 20) and bs 64.
  for (const Case c : {Case{10, 68941, 4521}, Case{32, 138935, 12623}, Case{64, 193923, 32911}}) {
    const BatchGroups g = BatchGrouper({c.bs, true}).group(lengths);
    CHECK(g.real_tokens == 62049);
    CHECK(g.padding_unsorted == c.before);
    CHECK(g.padding_sorted == c.after);
    CHECK(g.padding == c.after);
    CHECK(g.batches.size() == static_cast<std::size_t>((500 + c.bs - 1) / c.bs));

    std::vector<std::int64_t> sorted = lengths;
    std::sort(sorted.begin(), sorted.end());
    CHECK(padding_oracle(lengths, c.bs) == c.before);
    CHECK(padding_oracle(sorted, c.bs) == c.after);

    // Each batch's members are ascending by length and every pad reaches the batch maximum.
    for (const auto& batch : g.batches) {
      for (std::size_t i = 1; i < batch.size(); ++i) {
        CHECK(lengths[batch[i - 1]] <= lengths[batch[i]]);
      }
      for (std::int64_t p : batch) CHECK(lengths[p] + g.pad[p] == lengths[batch.back()]);
    }
  }
}

TEST_CASE("bad configs and inputs are rejected with the values named", "[batch_grouper]") {
  REQUIRE_THROWS_WITH(BatchGrouper({0, true}), Contains("batch_size must be >= 1, got 0"));
  REQUIRE_THROWS_WITH(BatchGrouper({-4, false}), Contains("got -4"));
  const BatchGrouper grouper({4, true});
  REQUIRE_THROWS_WITH(grouper.group({}), Contains("prefill_lengths is empty"));
  REQUIRE_THROWS_WITH(grouper.group({3, 0, 2}), Contains("prefill_lengths[1] = 0 must be >= 1"));
}

TEST_CASE("lengths file parsing", "[batch_grouper]") {
  SECTION("spaces, CRLF and blank lines are tolerated") {
    std::istringstream in("12\n  7 \r\n\n3\n\n");
    REQUIRE(parse_prefill_lengths(in, "mem") == std::vector<std::int64_t>{12, 7, 3});
  }
  SECTION("a bad line is named by number and content") {
    std::istringstream in("12\n7\n\nabc\n");
    REQUIRE_THROWS_WITH(parse_prefill_lengths(in, "lens.txt"),
                        Contains("'lens.txt' line 4") && Contains("got 'abc'"));
  }
  SECTION("two numbers, trailing junk, zero and negatives are bad lines") {
    for (const char* text : {"5 6\n", "5x\n", "0\n", "-3\n", "2.5\n"}) {
      std::istringstream in(std::string("1\n") + text);
      REQUIRE_THROWS_WITH(parse_prefill_lengths(in, "f"), Contains("line 2"));
    }
  }
  SECTION("an empty file holds no lengths") {
    std::istringstream in("\n \n");
    REQUIRE_THROWS_WITH(parse_prefill_lengths(in, "empty.txt"),
                        Contains("'empty.txt' holds no lengths"));
  }
  SECTION("a missing file is named") {
    REQUIRE_THROWS_WITH(read_prefill_lengths("no/such/lengths.txt"),
                        Contains("'no/such/lengths.txt'") && Contains("cannot open"));
  }
}
