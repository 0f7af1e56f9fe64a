// PagedKVView: the FlashInfer-style CSR page table — lengths from pages and the last page's fill,
// element addressing through the page indices, and validation of malformed tables.
#include <cstdint>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/paged_kv_view.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {
// Two sequences over 5 pages of 4 tokens, 2 KV heads, head_dim 3: sequence 0 owns pages {3, 0}
// with 2 tokens in its last page (6 tokens), sequence 1 owns {1, 4, 2} with 4 (12 tokens).
struct Table {
  std::vector<float> k, v;
  std::vector<std::int32_t> indptr{0, 2, 5}, indices{3, 0, 1, 4, 2}, last{2, 4};
  PagedKVView<float> view;
  Table() : k(5 * 2 * 4 * 3), v(k.size()) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(i);
      v[i] = -static_cast<float>(i);
    }
    view.k_pages = k.data();
    view.v_pages = v.data();
    view.indptr = indptr.data();
    view.indices = indices.data();
    view.last_page_len = last.data();
    view.batch = 2;
    view.num_pages = 5;
    view.kv_heads = 2;
    view.page_size = 4;
    view.head_dim = 3;
  }
};
}  // namespace

TEST_CASE("PagedKVView lengths and addressing follow the page table", "[paged_view]") {
  Table t;
  REQUIRE_NOTHROW(t.view.validate());
  REQUIRE(t.view.get_length(0) == 6);
  REQUIRE(t.view.get_length(1) == 12);
  // Token 5 of sequence 0 is entry 1 of its second page (page id 0); head 1.
  // Offset = ((page * kv_heads + head) * page_size + entry) * head_dim = ((0*2+1)*4+1)*3 = 15.
  REQUIRE(t.view.k_ptr(0, 1, 5) == t.k.data() + 15);
  REQUIRE(t.view.v_ptr(0, 1, 5)[2] == -17.0f);
  // Token 9 of sequence 1: table entry 9 / 4 = 2 -> page id 2, entry 1, head 0:
  // ((2*2+0)*4+1)*3 = 51.
  REQUIRE(t.view.k_ptr(1, 0, 9) == t.k.data() + 51);
  REQUIRE(t.view.num_pages_of(1) == 3);
}

TEST_CASE("PagedKVView::validate names the malformed entry", "[paged_view][errors]") {
  Table t;
  SECTION("page id out of range") {
    t.indices[3] = 5;
    REQUIRE_THROWS_WITH(t.view.validate(), Contains("indices[3] = 5 outside [0, num_pages = 5)"));
  }
  SECTION("last page overfilled") {
    t.last[1] = 5;
    REQUIRE_THROWS_WITH(t.view.validate(), Contains("last_page_len[1] = 5 outside [1, 4]"));
  }
  SECTION("indptr decreasing") {
    t.indptr = {0, 3, 2};
    t.view.indptr = t.indptr.data();
    REQUIRE_THROWS_WITH(t.view.validate(), Contains("indptr decreases at 1 (3 -> 2)"));
  }
  SECTION("indptr not starting at 0") {
    t.indptr[0] = 1;
    REQUIRE_THROWS_WITH(t.view.validate(), Contains("indptr[0] = 1, expected 0"));
  }
  SECTION("bad sizes") {
    t.view.page_size = 0;
    REQUIRE_THROWS_WITH(t.view.validate(), Contains("page_size (0)"));
  }
}
