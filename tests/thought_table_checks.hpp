// Checks shared by the CPU and GPU tests of the Continuous Thinking table: two tables (or two
// sequences of them) that must hold the same tokens in the same places.
#pragma once

#include <cstdint>
#include <vector>

#include "catch.hpp"
#include "kvsift/paged/thought_block_table.hpp"

namespace kvsift::test {

// The resident tokens of every KV head — addresses, positions, segments, in the table's order —
// of sequence `want_seq` of `want` and sequence `got_seq` of `got` are the same.
inline void require_same_resident_tokens(const ThoughtBlockTable& want, std::int32_t want_seq,
                                         const ThoughtBlockTable& got, std::int32_t got_seq) {
  for (std::int32_t h = 0; h < want.config().kv_heads; ++h) {
    const std::vector<ResidentToken> w = want.resident_tokens(want_seq, h);
    const std::vector<ResidentToken> g = got.resident_tokens(got_seq, h);
    REQUIRE(g.size() == w.size());
    for (std::size_t i = 0; i < w.size(); ++i) {
      INFO("head " << h << " token " << i);
      REQUIRE(g[i].position == w[i].position);
      REQUIRE(g[i].segment == w[i].segment);
      REQUIRE(g[i].address.block == w[i].address.block);
      REQUIRE(g[i].address.slot == w[i].address.slot);
    }
  }
}

}  // namespace kvsift::test
