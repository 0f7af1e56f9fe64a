#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/dtype.hpp"

using namespace kvsift;

namespace {
// Independent oracle for f32 -> bf16: round the discarded 16 bits by comparing with the halfway
// point in double precision (exact for these magnitudes).
std::uint16_t bf16_oracle(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0;  // NaN handled separately
  const std::uint32_t lo = u & 0xffff0000u;
  const std::uint32_t hi = lo + 0x10000u;
  float flo, fhi;
  std::memcpy(&flo, &lo, 4);
  std::memcpy(&fhi, &hi, 4);
  const double dlo = std::fabs(double(f) - double(flo));
  const double dhi = std::isinf(fhi) ? std::fabs(double(f) - double(flo)) * 2 + 1  // handled below
                                     : std::fabs(double(fhi) - double(f));
  if ((u & 0xffffu) == 0) return static_cast<std::uint16_t>(lo >> 16);
  if ((u & 0xffffu) > 0x8000u) return static_cast<std::uint16_t>(hi >> 16);
  if ((u & 0xffffu) < 0x8000u) return static_cast<std::uint16_t>(lo >> 16);
  (void)dlo;
  (void)dhi;
  return static_cast<std::uint16_t>(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);
}
}  // namespace

TEST_CASE("f16 conversion round-trips every finite half exactly", "[dtype]") {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = f16_bits_to_float(static_cast<std::uint16_t>(h));
    const std::uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 31 && mant != 0) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::isnan(f16_bits_to_float(float_to_f16_bits(f))));
    } else {
      REQUIRE(float_to_f16_bits(f) == h);
    }
  }
}

TEST_CASE("f16 rounds to nearest even, saturates to inf, keeps NaN", "[dtype]") {
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  REQUIRE(float_to_f16_bits(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
  // 1 + 3*2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9 (even): rounds up.
  REQUIRE(float_to_f16_bits(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
  REQUIRE(float_to_f16_bits(65504.0f) == 0x7bff);
  REQUIRE(float_to_f16_bits(65519.0f) == 0x7bff);
  REQUIRE(float_to_f16_bits(65520.0f) == 0x7c00);
  REQUIRE(float_to_f16_bits(-1e30f) == 0xfc00);
  REQUIRE(float_to_f16_bits(std::ldexp(1.0f, -24)) == 0x0001);       // smallest subnormal
  REQUIRE(float_to_f16_bits(std::ldexp(1.0f, -25)) == 0x0000);       // tie to even: 0
  REQUIRE(float_to_f16_bits(std::ldexp(3.0f, -25)) == 0x0002);       // 1.5 ulps -> 2
  REQUIRE(float_to_f16_bits(-0.0f) == 0x8000);
  const std::uint16_t nan = float_to_f16_bits(std::numeric_limits<float>::quiet_NaN());
  REQUIRE((nan & 0x7c00) == 0x7c00);
  REQUIRE((nan & 0x03ff) != 0);
}

TEST_CASE("bf16 conversion matches a round-to-nearest-even oracle", "[dtype]") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(f))));
      continue;
    }
    REQUIRE(float_to_bf16_bits(f) == bf16_oracle(f));
  }
  REQUIRE(float_to_bf16_bits(1.0f) == 0x3f80);
  REQUIRE(bf16_bits_to_float(0x3f80) == 1.0f);
  REQUIRE(std::isinf(bf16_bits_to_float(float_to_bf16_bits(3.4e38f))));
}

TEST_CASE("dtype names parse and unknown names are rejected", "[dtype]") {
  REQUIRE(parse_dtype("bf16") == DType::bf16);
  REQUIRE(parse_dtype("float16") == DType::f16);
  REQUIRE_THROWS_AS(parse_dtype("fp8"), Error);
  try {
    parse_dtype("fp8");
  } catch (const Error& e) {
    REQUIRE(std::string(e.what()).find("fp8") != std::string::npos);
  }
}

namespace {
template <class T>
void check_compaction_keeps_planned_rows_bit_for_bit() {
  const int B = 2, H = 3, C = 20, D = 5;
  std::vector<T> k(B * H * C * D), v(B * H * C * D);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  for (auto& x : k) x = from_float<T>(nd(rng));
  for (auto& x : v) x = from_float<T>(nd(rng));
  const std::vector<T> k0 = k, v0 = v;
  std::vector<std::int32_t> lens = {17, 20};
  auto kv = make_kv_cache_view(k.data(), v.data(), dtype_of<T>::value, Device::cpu, B, H, C, D,
                               lens.data());
  KeepPlan plan(B, H, C, lens, {9, 12}, 3);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      // A random sorted subset of the non-window prefix, then the window.
      std::vector<std::int32_t> all(lens[b] - 3);
      for (int i = 0; i < lens[b] - 3; ++i) all[i] = i;
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<std::int32_t> row(all.begin(), all.begin() + (plan.kept_length(b) - 3));
      std::sort(row.begin(), row.end());
      for (int i = 0; i < 3; ++i) row.push_back(lens[b] - 3 + i);
      plan.append_row(row);
    }
  }
  plan.validate();
  compact(kv, plan);
  REQUIRE(lens[0] == 9);
  REQUIRE(lens[1] == 12);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < plan.kept_length(b); ++i) {
        const std::size_t dst = ((b * H + h) * C + i) * D;
        const std::size_t src = ((b * H + h) * C + plan.row(b, h)[i]) * D;
        REQUIRE(std::memcmp(&k[dst], &k0[src], D * sizeof(T)) == 0);
        REQUIRE(std::memcmp(&v[dst], &v0[src], D * sizeof(T)) == 0);
      }
  // Applying the same plan again is a stale plan: the lengths changed.
  REQUIRE_THROWS_AS(compact(kv, plan), Error);
}
}  // namespace

TEST_CASE("compact keeps exactly the planned rows, bit for bit, for every dtype", "[compact]") {
  check_compaction_keeps_planned_rows_bit_for_bit<float>();
  check_compaction_keeps_planned_rows_bit_for_bit<f16_t>();
  check_compaction_keeps_planned_rows_bit_for_bit<bf16_t>();
}

TEST_CASE("KeepPlan::validate names the fault", "[plan]") {
  auto expect_error = [](const KeepPlan& p, const char* needle) {
    try {
      p.validate();
      FAIL("no error");
    } catch (const Error& e) {
      INFO(e.what());
      REQUIRE(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  {
    KeepPlan p(1, 1, 10, {10}, {4}, 2);
    p.append_row({0, 3, 3, 9});
    expect_error(p, "not sorted");
  }
  {
    KeepPlan p(1, 1, 10, {10}, {4}, 2);
    p.append_row({0, 3, 7, 9});
    expect_error(p, "drops window token 8");
  }
  {
    KeepPlan p(1, 1, 10, {10}, {4}, 2);
    p.append_row({0, 3, 8, 10});
    expect_error(p, "outside [0, length = 10)");
  }
  {
    KeepPlan p(1, 2, 10, {10}, {4}, 2);
    p.append_row({0, 3, 8, 9});
    expect_error(p, "only 1 of 2 rows");
  }
  {  // the fault in the second row, first slot; and a duplicate in the first row's first pair
    KeepPlan p(1, 2, 10, {10}, {4}, 2);
    p.append_row({0, 3, 8, 9});
    p.append_row({-1, 3, 8, 9});
    expect_error(p, "row (b=0, h=1) slot[0] = -1 outside");
    KeepPlan q(1, 1, 10, {10}, {4}, 2);
    q.append_row({2, 2, 8, 9});
    expect_error(q, "not sorted and unique at 1 (2, 2)");
  }
  KeepPlan p(1, 1, 10, {10}, {4}, 2);
  REQUIRE_THROWS_WITH(p.append_row({1, 2, 3}),
                      Catch::Matchers::Contains("has 3 slots, expected kept_lengths[0] = 4"));
  REQUIRE_THROWS_AS(KeepPlan(1, 1, 10, {11}, {4}, 2), Error);
}

TEST_CASE("KeepPlan::set_rows takes every row at once, as append_row stores them", "[plan]") {
  // Sequence 0 keeps 3 of 5 tokens in each of its 2 heads, sequence 1 keeps 2 of 4.
  const std::vector<std::int32_t> rows = {0, 3, 4, 1, 3, 4, 2, 3, 0, 3};
  KeepPlan by_rows(2, 2, 6, {5, 4}, {3, 2}, 1);
  by_rows.append_row({0, 3, 4});
  by_rows.append_row({1, 3, 4});
  by_rows.append_row({2, 3});
  by_rows.append_row({0, 3});
  KeepPlan at_once(2, 2, 6, {5, 4}, {3, 2}, 1);
  at_once.set_rows(rows);
  at_once.validate();
  REQUIRE(at_once.indptr() == by_rows.indptr());
  REQUIRE(at_once.slots() == by_rows.slots());
  REQUIRE(at_once.row_size(1, 0) == 2);
  REQUIRE(at_once.row(1, 1)[1] == 3);

  KeepPlan short_by_one(2, 2, 6, {5, 4}, {3, 2}, 1);
  REQUIRE_THROWS_WITH(short_by_one.set_rows({0, 3, 4}),
                      Catch::Matchers::Contains("3 slots, the kept lengths need 10"));
  REQUIRE(short_by_one.rows_appended() == 0);  // nothing was set
  KeepPlan started(2, 2, 6, {5, 4}, {3, 2}, 1);
  started.append_row({0, 3, 4});
  REQUIRE_THROWS_WITH(started.set_rows(rows), Catch::Matchers::Contains("1 rows are set"));
  KeepPlan unsorted(2, 2, 6, {5, 4}, {3, 2}, 1);
  unsorted.set_rows({0, 3, 4, 3, 1, 4, 2, 3, 0, 3});
  REQUIRE_THROWS_WITH(unsorted.validate(), Catch::Matchers::Contains("row (b=0, h=1)"));

  // A plan that passed is not checked again, but one whose rows were moved away is.
  at_once.validate();
  const KeepPlan taken = std::move(at_once);
  taken.validate();
  REQUIRE_THROWS_WITH(at_once.validate(), Catch::Matchers::Contains("the plan is empty"));
}

TEST_CASE("compact rejects a plan from another cache and leaves the cache untouched", "[compact]") {
  std::vector<float> k(1 * 1 * 8 * 2), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = v[i] = float(i);
  std::vector<std::int32_t> lens = {8};
  auto kv = make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, 1, 8, 2, lens.data());
  KeepPlan other(1, 2, 8, {8}, {4}, 1);  // made for 2 KV heads
  other.append_row({0, 1, 2, 7});
  other.append_row({0, 1, 2, 7});
  const auto before = k;
  REQUIRE_THROWS_WITH(compact(kv, other), Catch::Matchers::Contains("kv_heads=2"));
  REQUIRE(k == before);
  REQUIRE(lens[0] == 8);
}

TEST_CASE("compact rewrites the padding mask and refuses pads kept unevenly across heads",
          "[compact]") {
  const int H = 2, C = 6, D = 1;
  std::vector<float> k(H * C * D), v(H * C * D);
  for (int i = 0; i < H * C; ++i) k[i] = v[i] = float(i);
  std::vector<std::int32_t> lens = {6};
  std::vector<std::uint8_t> mask = {0, 0, 1, 1, 1, 1};
  auto kv = make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 1, H, C, D,
                               lens.data(), mask.data());
  KeepPlan uneven(1, H, C, {6}, {3}, 1);
  uneven.append_row({0, 2, 5});
  uneven.append_row({2, 3, 5});
  REQUIRE_THROWS_WITH(compact(kv, uneven), Catch::Matchers::Contains("pads at different positions"));
  KeepPlan even(1, H, C, {6}, {3}, 1);
  even.append_row({1, 3, 5});
  even.append_row({0, 2, 5});
  compact(kv, even);
  REQUIRE(mask[0] == 0);
  REQUIRE(mask[1] == 1);
  REQUIRE(mask[2] == 1);
  REQUIRE(k[0] == 1.0f);
  REQUIRE(k[C + 1] == float(C + 2));
}

TEST_CASE("KVCacheView rejects lengths beyond capacity and mismatched buffers", "[view]") {
  std::vector<float> k(2 * 4 * 3), v(k.size());
  std::vector<std::int32_t> lens = {4, 5};
  REQUIRE_THROWS_WITH(
      make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 2, 1, 4, 3, lens.data()),
      Catch::Matchers::Contains("lengths[1] = 5"));
  lens[1] = 4;
  auto kv = make_kv_cache_view(k.data(), v.data(), DType::f32, Device::cpu, 2, 1, 4, 3, lens.data());
  kv.values.dtype = DType::bf16;
  REQUIRE_THROWS_WITH(kv.validate(), Catch::Matchers::Contains("values dtype bf16"));
}
