// RaaS's per-step scoring math (backend/cpu/raas_scores.hpp, docs/algorithms.md §5.4) against
// hand-computed values.
#include <cmath>
#include <cstdint>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cpu/raas_scores.hpp"

using namespace kvsift::cpu;

TEST_CASE("RaaS token scores: max over the group of the softmax weight, pads excluded",
          "[raas][scores]") {
  // dim 4 (scale 1/2), q0 = [2, 0, 0, 0] reads channel 0 and q1 = [0, 2, 0, 0] channel 1, so the
  // logits are the keys' channel values.
  const std::vector<float> q = {2, 0, 0, 0, 0, 2, 0, 0};  // [group 2, dim 4]
  const float l2 = std::log(2.0f), l3 = std::log(3.0f);
  const std::vector<float> keys = {
      0,  l3, 0, 0,  // slot 0
      l3, 0,  0, 0,  // slot 1
      0,  l2, 0, 0,  // slot 2
      10, 10, 0, 0,  // slot 3: a pad, whatever its key
  };
  const std::vector<std::uint8_t> valid = {1, 1, 1, 0};
  std::vector<float> out(4, -1.0f);
  raas::token_scores(q.data(), 2, keys.data(), valid.data(), 4, 4, out.data());
  // q0: exp(0, ln3, 0) = 1, 3, 1 -> 1/5, 3/5, 1/5. q1: exp(ln3, 0, ln2) = 3, 1, 2 -> 1/2, 1/6, 1/3.
  CHECK(out[0] == Approx(0.5f));         // max(1/5, 1/2)
  CHECK(out[1] == Approx(0.6f));         // max(3/5, 1/6)
  CHECK(out[2] == Approx(1.0f / 3.0f));  // max(1/5, 1/3)
  CHECK(out[3] == 0.0f);

  // Without a mask (q0 only) the pad's logit 2 * 10 / 2 = 10 dominates: weights change.
  raas::token_scores(q.data(), 1, keys.data(), nullptr, 4, 4, out.data());
  const float z = 1 + 3 + 1 + std::exp(10.0f);
  CHECK(out[3] == Approx(std::exp(10.0f) / z));
  CHECK(out[1] == Approx(3.0f / z));
}

TEST_CASE("RaaS page mode: per-page key min/max and Quest's bound", "[raas][scores]") {
  // dim 2, pages of 2 over 3 tokens: page 0 = tokens 0-1, page 1 = token 2 (partial).
  const std::vector<float> keys = {1, -2, 3, 0, -1, 5};  // [3, 2]
  std::vector<float> kmin(4), kmax(4);
  raas::page_key_bounds(keys.data(), 3, 2, 2, kmin.data(), kmax.data());
  CHECK(kmin == std::vector<float>{1, -2, -1, 5});
  CHECK(kmax == std::vector<float>{3, 0, -1, 5});

  const std::vector<float> q = {1, -1, -2, 0.5f};  // [group 2, dim 2]
  std::vector<float> bound(2);
  raas::page_bounds(q.data(), 2, kmin.data(), kmax.data(), 2, 2, bound.data());
  // Page 0: q0 max(1*3, 1*1) + max(-1*0, -1*-2) = 3 + 2 = 5; q1 max(-6, -2) + max(0, -1) = -2.
  CHECK(bound[0] == 5.0f);
  // Page 1: q0 -1 + -5 = -6; q1 2 + 2.5 = 4.5.
  CHECK(bound[1] == 4.5f);
}

TEST_CASE("RaaS refresh: the top ceil(n/2) units by score get t, ties to the lower unit",
          "[raas][scores]") {
  CHECK(raas::top_half_count(0) == 0);
  CHECK(raas::top_half_count(1) == 1);
  CHECK(raas::top_half_count(4) == 2);
  CHECK(raas::top_half_count(5) == 3);

  const std::vector<float> s = {0.1f, 0.5f, 0.5f, 0.2f, 0.9f};
  std::vector<std::int32_t> ts = {1, 1, 1, 1, 1};
  CHECK(raas::refresh_top_half(s.data(), 5, 7, ts.data()) == 3);
  CHECK(ts == std::vector<std::int32_t>{1, 7, 7, 1, 7});  // 0.9, then both 0.5s

  const std::vector<float> flat = {0.3f, 0.3f, 0.3f, 0.3f};
  std::vector<std::int32_t> ts2 = {0, 0, 0, 0};
  CHECK(raas::refresh_top_half(flat.data(), 4, 2, ts2.data()) == 2);
  CHECK(ts2 == std::vector<std::int32_t>{2, 2, 0, 0});

  const std::vector<float> a = {0.1f, 0.25f, 0.3f};
  std::vector<std::int32_t> ts3 = {0, 0, 0};
  CHECK(raas::refresh_above(a.data(), 3, 0.25f, 4, ts3.data()) == 2);
  CHECK(ts3 == std::vector<std::int32_t>{0, 4, 4});
}

TEST_CASE("RaaS eviction: the evictable unit with the oldest timestamp, ties to the lower",
          "[raas][scores]") {
  const std::vector<std::int32_t> ts = {5, 2, 2, 1};
  const std::vector<std::uint8_t> evictable = {1, 1, 1, 0};  // unit 3 (ts 1) is protected
  CHECK(raas::oldest_unit(ts.data(), evictable.data(), 4) == 1);
  const std::vector<std::uint8_t> none = {0, 0, 0, 0};
  CHECK(raas::oldest_unit(ts.data(), none.data(), 4) == -1);
}
