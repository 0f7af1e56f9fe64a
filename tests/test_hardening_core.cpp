// Regression tests of issue 13's core defects: overflowing sizes, negative/zero strides, aliasing
// K/V in compact(), a default KeepPlan, an all-pads mask, and quantized tensors whose
// tokens × channels wraps. Every input is crafted here; the expected outcomes are the rules of the
// headers (an error naming the field and value), not values produced by the code under test.
#include <cstdint>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/paged_kv_view.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/policy/skipkv/batch_grouper.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
}

TEST_CASE("checked_mul and checked_add name the field on overflow and negatives") {
  REQUIRE(checked_mul(std::int64_t{3}, std::int64_t{4}, "x") == 12);
  REQUIRE(checked_mul(std::int64_t{0}, kMax, "x") == 0);
  REQUIRE_THROWS_WITH(
      checked_mul(std::int64_t{1} << 32, std::int64_t{1} << 31, "tokens * channels"),
      Contains("tokens * channels: 4294967296 * 2147483648 overflows int64"));
  REQUIRE_THROWS_WITH(checked_mul(std::int64_t{-2}, std::int64_t{3}, "rows"),
                      Contains("rows: negative operand in -2 * 3"));
  REQUIRE_THROWS_WITH(checked_add(kMax, std::int64_t{1}, "offset"), Contains("offset: "));
  REQUIRE(checked_add(kMax - 1, std::int64_t{1}, "offset") == kMax);
  const std::size_t big = std::numeric_limits<std::size_t>::max();
  REQUIRE_THROWS_WITH(checked_mul(big, std::size_t{2}, "bytes"), Contains("overflows size_t"));
  REQUIRE_THROWS_WITH(checked_size(-1, "count"), Contains("count is negative (-1)"));
  REQUIRE_THROWS_WITH(check_fits(1000, 4, 3999, "codes"),
                      Contains("codes: 1000 elements of 4 bytes need 4000 bytes, only 3999"));
  const std::int64_t shape[3] = {2, -5, 3};
  REQUIRE_THROWS_WITH(checked_product(shape, 3, "shape"), Contains("extent 1 is negative (-5)"));
}

TEST_CASE("TensorView::validate rejects negative extents, bad strides and overflowing spans") {
  float buf[16] = {};
  TensorView v = TensorView::contiguous(buf, DType::f32, Device::cpu, {2, 2, 4});
  REQUIRE_NOTHROW(v.validate("v"));
  REQUIRE(v.span_elements() == 16);

  TensorView neg = v;
  neg.stride[1] = -4;
  REQUIRE_THROWS_WITH(neg.validate("keys"), Contains("keys: stride[1] must be >= 1, got -4"));
  TensorView zero = v;
  zero.stride[0] = 0;
  REQUIRE_THROWS_WITH(zero.validate("keys"), Contains("stride[0] must be >= 1, got 0"));
  TensorView negshape = v;
  negshape.shape[2] = -3;
  REQUIRE_THROWS_WITH(negshape.validate("values"), Contains("values: shape[2] is negative (-3)"));
  TensorView huge = v;
  huge.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40, 4, 0};
  REQUIRE_THROWS_WITH(huge.validate("keys"), Contains("overflows int64"));
  // An extent of 1 may carry any stride (it is never multiplied by an index > 0).
  TensorView one = v;
  one.shape[0] = 1;
  one.stride[0] = 0;
  REQUIRE_NOTHROW(one.validate("v"));
  // contiguous() of an empty extent keeps every stride positive.
  const TensorView empty = TensorView::contiguous(buf, DType::f32, Device::cpu, {3, 0, 4});
  REQUIRE(empty.stride[0] == 4);
  REQUIRE(empty.stride[1] == 4);
  REQUIRE_NOTHROW(empty.validate("empty"));
  REQUIRE(empty.span_elements() == 0);
  REQUIRE(empty.is_contiguous());
  REQUIRE(v.is_contiguous());
  REQUIRE_THROWS_WITH(TensorView::contiguous(buf, DType::f32, Device::cpu, {kMax / 2, 4, 1}),
                      Contains("element count"));
}

TEST_CASE("KVCacheView::validate names a negative stride instead of compacting through it") {
  std::vector<float> k(2 * 8 * 4), v(2 * 8 * 4);
  std::int32_t len[1] = {8};
  KVCacheView kv = make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 2, 8, 4, len);
  kv.keys.stride[2] = -4;
  REQUIRE_THROWS_WITH(kv.validate(), Contains("KVCacheView keys: stride[2] must be >= 1, got -4"));
  kv = make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 2, 8, 4, len);
  kv.values.shape = {1, 2, -8, 4};
  kv.keys.shape = kv.values.shape;
  REQUIRE_THROWS_WITH(kv.validate(), Contains("shape[2] is negative (-8)"));
}

TEST_CASE("compact refuses keys and values that share memory") {
  // One buffer holding [K | V] per row would be moved twice: compact must refuse, not corrupt.
  std::vector<float> buf(1 * 1 * 8 * 4, 0.0f);
  std::int32_t len[1] = {8};
  KVCacheView same =
      make_kv_cache_view(buf.data(), buf.data(), DType::f32, Device::cpu, 1, 1, 8, 4, len);
  KeepPlan plan(1, 1, 8, {8}, {4}, 2);
  plan.append_row(std::vector<std::int32_t>{0, 1, 6, 7});
  REQUIRE_THROWS_WITH(compact(same, plan), Contains("overlap in memory"));
  REQUIRE(len[0] == 8);  // nothing moved

  // Values starting half-way into the keys: partly overlapping ranges.
  std::vector<float> big(2 * 8 * 4, 0.0f);
  KVCacheView partial =
      make_kv_cache_view(big.data(), big.data() + 16, DType::f32, Device::cpu, 1, 1, 8, 4, len);
  REQUIRE_THROWS_WITH(compact(partial, plan), Contains("overlap in memory"));

  // A view whose rows overlap themselves (slot stride 2 < head_dim 4).
  std::vector<float> k(64), v(64);
  KVCacheView self =
      make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 1, 8, 4, len);
  self.keys.stride[2] = 2;
  REQUIRE_THROWS_WITH(compact(self, plan), Contains("keys view [1, 1, 8, 4] has overlapping rows"));

  // Separate buffers: allowed, and rows 0, 1, 6, 7 move to the front.
  for (int i = 0; i < 32; ++i) k[i] = static_cast<float>(i);
  KVCacheView ok = make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 1, 8, 4, len);
  compact(ok, plan);
  REQUIRE(len[0] == 4);
  REQUIRE(k[8] == 24.0f);   // slot 6's first element, now at slot 2
  REQUIRE(k[12] == 28.0f);  // slot 7 -> slot 3
}

TEST_CASE("a default-constructed KeepPlan says so instead of 'only -1 of 0 rows'") {
  KeepPlan plan;
  REQUIRE(plan.rows_appended() == 0);
  REQUIRE_THROWS_WITH(plan.validate(), Contains("default-constructed"));
  REQUIRE_THROWS_WITH(plan.append_row(std::vector<std::int32_t>{}),
                      Contains("default-constructed"));
  std::vector<float> k(32), v(32);
  std::int32_t len[1] = {8};
  KVCacheView kv = make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 1, 8, 4, len);
  REQUIRE_THROWS_WITH(compact(kv, plan), Contains("default-constructed"));
  // An absurd head count fails on the overflow, not on a multi-GB reserve.
  REQUIRE_THROWS_WITH(KeepPlan(2, kMax, 8, {0, 0}, {0, 0}, 0), Contains("batch * kv_heads"));
}

TEST_CASE("an all-pads mask plans and compacts to empty sequences without UB") {
  // Sequence of 8 slots, every one a pad, over a budget of 4: nothing real to keep.
  std::vector<float> k(2 * 8 * 4, 1.0f), v(2 * 8 * 4, 2.0f);
  std::vector<std::uint8_t> mask(8, 0);
  std::int32_t len[1] = {8};
  KVCacheView kv =
      make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 2, 8, 4, len, mask.data());
  TopKSelection sel;
  sel.budget = 4;
  sel.window = 2;
  const KeepPlan plan = cpu::plan_from_scores(kv, nullptr, sel);
  REQUIRE(plan.kept_length(0) == 0);
  REQUIRE(plan.row_size(0, 0) == 0);
  REQUIRE(plan.row_size(0, 1) == 0);
  REQUIRE_NOTHROW(plan.validate());
  compact(kv, plan);
  REQUIRE(len[0] == 0);
}

TEST_CASE("ScoreTensor checks its shape before allocating") {
  REQUIRE_THROWS_WITH(cpu::ScoreTensor(-1, 2, 3), Contains("ScoreTensor: batch is negative (-1)"));
  REQUIRE_THROWS_WITH(cpu::ScoreTensor(std::int64_t{1} << 40, std::int64_t{1} << 40, 1 << 20),
                      Contains("overflows int64"));
}

TEST_CASE("PagedKVView rejects a pool whose element count overflows") {
  PagedKVView<float> p;
  std::int32_t indptr[1] = {0}, last[1] = {0};
  p.indptr = indptr;
  p.last_page_len = last;
  p.num_pages = std::numeric_limits<std::int32_t>::max();
  p.kv_heads = std::numeric_limits<std::int32_t>::max();
  p.page_size = std::numeric_limits<std::int32_t>::max();
  p.head_dim = std::numeric_limits<std::int32_t>::max();
  REQUIRE_THROWS_WITH(p.validate(), Contains("page pool"));
  p.num_pages = -1;
  REQUIRE_THROWS_WITH(p.validate(), Contains("num_pages (-1)"));
}

TEST_CASE("a quantized tensor whose tokens x channels wraps is refused, not dequantized") {
  // 2^32 x 2^32 wraps int64 to 0 groups: the 0-byte codes would have passed the byte counts and
  // the group offsets would have addressed wild memory (the 612-byte crash of issue 13).
  QuantizedTensor q;
  q.format = QuantFormat::fp8;
  q.grid = KiviGrid{std::int64_t{1} << 32, std::int64_t{1} << 32, GroupAxis::token};
  REQUIRE_THROWS_WITH(validate_quantized(q), Contains("tokens * channels"));
  REQUIRE_THROWS_WITH(dequantize_tensor(q), Contains("tokens * channels"));
  // Huge but non-wrapping: the byte-count check refuses before the output is allocated.
  q.grid = KiviGrid{std::int64_t{1} << 24, std::int64_t{1} << 24, GroupAxis::channel};
  REQUIRE_THROWS_WITH(dequantize_tensor(q), Contains("fp8 codes hold 0 bytes, expected"));
  q.grid = KiviGrid{16, 16, static_cast<GroupAxis>(7)};
  q.codes.assign(16 * 16, 0);
  q.scales.assign(16, 0);
  REQUIRE_THROWS_WITH(validate_quantized(q), Contains("group axis code 7"));
}

TEST_CASE("batch grouping totals near 2^63 are errors, not negative numbers") {
  BatchGrouperConfig c;
  c.batch_size = 1;
  const std::int64_t half = std::int64_t{1} << 62;
  REQUIRE_THROWS_WITH(BatchGrouper(c).group({half, half, 1}),
                      Contains("BatchGrouper: sum of prefill_lengths"));
  c.batch_size = 3;
  REQUIRE_THROWS_WITH(BatchGrouper(c).group({kMax - 2, 1, 1}),
                      Contains("BatchGrouper: total padding"));
  REQUIRE(BatchGrouper(c).group({5, 3, 1}).padding == 2 + 4);
}

TEST_CASE("per-layer tables refuse absurd layer counts and wrapping row counts") {
  REQUIRE_THROWS_WITH(SegmentTable(2000, 1, 1),
                      Contains("layers (2000) exceeds kMaxLayers = 1024"));
  REQUIRE_THROWS_WITH(SegmentTable(1, std::int64_t{1} << 40, std::int64_t{1} << 40),
                      Contains("SegmentTable: layers * batch * kv_heads"));
}
