// The host half of cuda::download_keep_plan — keep_plan_from_slot_rows — on hand-written slot
// rows: ragged kept counts, kUnusedSlot padding, and every fault it must name. It touches no device
// memory, so this runs without a GPU (an ordinary CI test, like cuda_backend_registered).
#include <cstdint>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

constexpr std::int32_t U = cuda::kUnusedSlot;

// A host view of 2 sequences x 2 KV heads, capacity 8; only shape and lengths are read.
struct Cache {
  std::vector<float> k = std::vector<float>(2 * 2 * 8 * 1), v = k;
  std::vector<std::int32_t> lengths;
  KVCacheView view() {
    return make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 2, 2, 8, 1,
                              lengths.data());
  }
};

}  // namespace

TEST_CASE("keep_plan_from_slot_rows closes up padded rows into the plan", "[cuda][plan]") {
  // Budget 4, window 1. Sequence 0 (7 tokens) keeps 4 in each head; sequence 1 (3 tokens, under
  // the budget) keeps all 3, padded with one unused slot.
  Cache c;
  c.lengths = {7, 3};
  const std::vector<std::int32_t> rows = {0, 2, 5, 6, /**/ 1, 2, 4, 6,  // sequence 0, heads 0, 1
                                          0, 1, 2, U, /**/ 0, 1, 2, U};
  const KeepPlan plan = cuda::keep_plan_from_slot_rows(c.view(), rows, 4, 1);
  REQUIRE(plan.kept_lengths() == std::vector<std::int32_t>{4, 3});
  REQUIRE(plan.source_lengths() == std::vector<std::int32_t>{7, 3});
  REQUIRE(plan.indptr() == std::vector<std::int64_t>{0, 4, 8, 11, 14});
  REQUIRE(plan.slots() == std::vector<std::int32_t>{0, 2, 5, 6, 1, 2, 4, 6, 0, 1, 2, 0, 1, 2});
  REQUIRE(plan.window() == 1);
  REQUIRE(plan.capacity() == 8);
}

TEST_CASE("keep_plan_from_slot_rows names every fault", "[cuda][plan]") {
  Cache c;
  c.lengths = {7, 3};
  const auto fails = [&](std::vector<std::int32_t> rows, const char* needle) {
    REQUIRE_THROWS_WITH(cuda::keep_plan_from_slot_rows(c.view(), std::move(rows), 4, 1),
                        Contains(needle));
  };
  fails({0, 2, 5, 6, 1, 2, 4, 6, 0, 1, 2, U, cuda::kNanScoreSlot, 1, 2, U},
        "row (b=1, h=1) has a NaN score");
  fails({0, 2, 5, 6, 1, U, 4, 6, 0, 1, 2, U, 0, 1, 2, U},
        "row (b=0, h=1) has slot 4 after an unused entry at 1");
  fails({0, 2, 5, 6, 1, 2, 6, U, 0, 1, 2, U, 0, 1, 2, U},
        "heads of sequence 0 keep different counts (4 vs 3 in head 1)");
  fails({0, 2, 5, 6, 1, 4, 2, 6, 0, 1, 2, U, 0, 1, 2, U}, "not sorted and unique");
  fails({0, 2, 5, 6, 1, 2, 4, 5, 0, 1, 2, U, 0, 1, 2, U}, "drops window token 6");
  fails({0, 2, 5, 6}, "4 slots for [batch=2, kv_heads=2, budget=4]");
  REQUIRE_THROWS_WITH(cuda::keep_plan_from_slot_rows(c.view(), {}, 0, 1),
                      Contains("budget (0) must be > 0"));
}
