// Attention sparsity (ThinKV, docs/algorithms.md §3.1): hand-computed rows, a hand-built GQA cache,
// and a naive softmax oracle (double precision, explicit probabilities) on random caches.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cpu/attention_sparsity.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using Catch::Matchers::WithinAbs;

TEST_CASE("sparsity of a probability row counts weights below 1% of the largest", "[sparsity]") {
  // max 0.5 -> cut 0.005: 0.004 and 0.0049 are sparse, 0.006 is not.
  const std::vector<float> p{0.5f, 0.004f, 0.006f, 0.2f, 0.0049f};
  CHECK(sparsity_from_probabilities(p.data(), 5) == 2.0f / 5.0f);
  const std::vector<float> uniform(8, 0.125f);
  CHECK(sparsity_from_probabilities(uniform.data(), 8) == 0.0f);
  const std::vector<float> one_hot{0, 0, 1, 0};
  CHECK(sparsity_from_probabilities(one_hot.data(), 4) == 0.75f);
}

TEST_CASE("sparsity of a logit row: logit < max + ln 0.01", "[sparsity]") {
  // max 1, cut 1 - 4.60517 = -3.60517: -5, -4, -4.5 are sparse.
  const std::vector<float> l{0.0f, -5.0f, -4.0f, -4.5f, 1.0f};
  CHECK(sparsity_from_logits(l.data(), 5) == 3.0f / 5.0f);
  // -3.6 sits just above the cut, -3.61 just below.
  const std::vector<float> edge{1.0f, -3.6f, -3.61f};
  CHECK(sparsity_from_logits(edge.data(), 3) == 1.0f / 3.0f);
}

TEST_CASE("attention_sparsity over a hand-built GQA cache", "[sparsity]") {
  // D = 4, scale 1/2. Keys (x, 0, 0, 0) and a query (2, 0, 0, 0) give logits x.
  // kv head 0: x = 0, -5, -4, -4.5, 1; kv head 1: x = 0, 0, 0, -10, 0.
  const std::int64_t D = 4, S = 6;
  std::vector<float> keys(2 * S * D, 0.0f), values(keys.size(), 0.0f);
  const float x0[] = {0, -5, -4, -4.5f, 1}, x1[] = {0, 0, 0, -10, 0};
  for (int j = 0; j < 5; ++j) {
    keys[(0 * S + j) * D] = x0[j];
    keys[(1 * S + j) * D] = x1[j];
  }
  std::int32_t len = 5;
  const KVCacheView kv =
      make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, 1, 2, S, D, &len);
  // Query heads 0, 1 read KV head 0; 2, 3 read KV head 1 (G = 2).
  std::vector<float> q(4 * D, 0.0f);
  q[0 * D] = 2;   // logits x0: 3/5 sparse
  q[1 * D] = -2;  // logits -x0: max 5, cut 0.395: 0 and -1 sparse -> 2/5
  q[2 * D] = 2;   // logits x1: -10 sparse -> 1/5
  // head 3: zero query, all logits 0 -> 0/5
  const TensorView qv = TensorView::contiguous(q.data(), DType::f32, Device::cpu, {1, 4, D});
  const auto s = attention_sparsity(kv, qv);
  REQUIRE(s.size() == 1);
  CHECK_THAT(s[0], WithinAbs((0.6 + 0.4 + 0.2 + 0.0) / 4, 1e-6));

  // The same query as the last row of a [batch, q_heads, W, D] window.
  std::vector<float> window(4 * 3 * D, 7.0f);
  for (int h = 0; h < 4; ++h) {
    for (int d = 0; d < D; ++d) window[(h * 3 + 2) * D + d] = q[h * D + d];
  }
  const TensorView wv =
      TensorView::contiguous(window.data(), DType::f32, Device::cpu, {1, 4, 3, D});
  CHECK(attention_sparsity(kv, wv)[0] == s[0]);
}

namespace {
// Oracle: explicit softmax in double over the valid keys, then p_j < 0.01 * max p.
double oracle_sparsity(const std::vector<float>& keys, const std::vector<float>& q, std::int64_t b,
                       std::int64_t Hkv, std::int64_t Hq, std::int64_t S, std::int64_t D, int len,
                       const std::vector<std::uint8_t>& mask) {
  double total = 0;
  for (std::int64_t qh = 0; qh < Hq; ++qh) {
    const std::int64_t h = qh * Hkv / Hq;
    std::vector<double> logit;
    for (int j = 0; j < len; ++j) {
      if (!mask[b * S + j]) continue;
      double dot = 0;
      for (std::int64_t d = 0; d < D; ++d) {
        dot += double(q[(b * Hq + qh) * D + d]) * keys[((b * Hkv + h) * S + j) * D + d];
      }
      logit.push_back(dot / std::sqrt(double(D)));
    }
    double mx = -1e300, z = 0;
    for (double l : logit) mx = std::max(mx, l);
    for (double l : logit) z += std::exp(l - mx);
    double pmax = 0;
    for (double l : logit) pmax = std::max(pmax, std::exp(l - mx) / z);
    int sparse = 0;
    for (double l : logit) sparse += std::exp(l - mx) / z < 0.01 * pmax;
    total += double(sparse) / logit.size();
  }
  return total / Hq;
}
}  // namespace

TEST_CASE("attention_sparsity matches a softmax oracle on random GQA caches with pads",
          "[sparsity]") {
  std::mt19937 rng(42);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const std::int64_t B = 2, Hkv = 2, Hq = 8, S = 200, D = 32;
  std::vector<float> keys(B * Hkv * S * D), values(keys.size(), 0.0f), q(B * Hq * D);
  for (auto& x : keys) x = 2.0f * g(rng);
  for (auto& x : q) x = 2.0f * g(rng);
  std::int32_t lens[2] = {200, 137};
  std::vector<std::uint8_t> mask(B * S, 1);
  for (int j = 0; j < 11; ++j) mask[S + j] = 0;  // sequence 1 is left-padded
  const KVCacheView kv = make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, B,
                                            Hkv, S, D, lens, mask.data());
  const TensorView qv = TensorView::contiguous(q.data(), DType::f32, Device::cpu, {B, Hq, D});
  const auto s = attention_sparsity(kv, qv);
  for (int b = 0; b < B; ++b) {
    const double want = oracle_sparsity(keys, q, b, Hkv, Hq, S, D, lens[b], mask);
    CHECK_THAT(s[b], WithinAbs(want, 1e-6));
    CHECK(want > 0.05);  // the data exercise the test (not all-dense rows)
  }

  // An f16 cache equals the oracle on the f16-rounded keys.
  std::vector<f16_t> keys16(keys.size()), values16(keys.size(), f16_t{0});
  std::vector<float> rounded(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys16[i] = from_float<f16_t>(keys[i]);
    rounded[i] = to_float(keys16[i]);
  }
  const KVCacheView kv16 = make_kv_cache_view(keys16.data(), values16.data(), DType::f16,
                                              Device::cpu, B, Hkv, S, D, lens, mask.data());
  const auto s16 = attention_sparsity(kv16, qv);
  for (int b = 0; b < B; ++b) {
    CHECK_THAT(s16[b],
               WithinAbs(oracle_sparsity(rounded, q, b, Hkv, Hq, S, D, lens[b], mask), 1e-6));
  }
}

TEST_CASE("attention_sparsity_from_probabilities averages heads over each sequence's keys",
          "[sparsity]") {
  // [batch 2, q_heads 2, seq 4]
  const std::vector<float> p{0.9f,  0.001f, 0.099f, 0.0f,     // b0 h0: 2 of 4 sparse
                             0.25f, 0.25f,  0.25f,  0.25f,    // b0 h1: 0 of 4
                             0.0f,  0.5f,   0.5f,   0.0001f,  // b1 h0: first is a pad, 3 keys
                             0.0f,  0.98f,  0.001f, 0.019f};  // b1 h1: 1 of 3
  std::int32_t lens[2] = {4, 4};
  const std::uint8_t mask[8] = {1, 1, 1, 1, 0, 1, 1, 1};
  const TensorView pv =
      TensorView::contiguous(const_cast<float*>(p.data()), DType::f32, Device::cpu, {2, 2, 4});
  const auto s = attention_sparsity_from_probabilities(pv, lens, mask);
  CHECK_THAT(s[0], WithinAbs((0.5 + 0.0) / 2, 1e-6));
  CHECK_THAT(s[1], WithinAbs((1.0 / 3 + 1.0 / 3) / 2, 1e-6));
  lens[0] = 2;  // only the first two entries of sequence 0: 0.9, 0.001 -> 1/2 and 0/2
  CHECK_THAT(attention_sparsity_from_probabilities(pv, lens, mask)[0], WithinAbs(0.25, 1e-6));
}

TEST_CASE("attention_sparsity rejects bad shapes and values", "[sparsity][errors]") {
  std::vector<float> keys(1 * 2 * 4 * 4, 0.5f), values(keys.size());
  std::int32_t len = 4;
  const KVCacheView kv =
      make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, 1, 2, 4, 4, &len);
  std::vector<float> q(3 * 4);
  const TensorView q3 = TensorView::contiguous(q.data(), DType::f32, Device::cpu, {1, 3, 4});
  REQUIRE_THROWS_WITH(attention_sparsity(kv, q3),
                      Contains("q_heads (3)") && Contains("kv_heads (2)"));
  const TensorView qd = TensorView::contiguous(q.data(), DType::f32, Device::cpu, {1, 2, 6});
  REQUIRE_THROWS_WITH(attention_sparsity(kv, qd), Contains("do not match"));
  len = 0;
  const TensorView q2 = TensorView::contiguous(q.data(), DType::f32, Device::cpu, {1, 2, 4});
  REQUIRE_THROWS_WITH(attention_sparsity(kv, q2), Contains("no valid keys"));

  const std::vector<float> nan_row{1.0f, std::numeric_limits<float>::quiet_NaN()};
  REQUIRE_THROWS_WITH(sparsity_from_probabilities(nan_row.data(), 2), Contains("probs[1]"));
  REQUIRE_THROWS_WITH(sparsity_from_logits(nan_row.data(), 2), Contains("logits[1] is NaN"));
  const std::vector<float> zeros(3, 0.0f);
  REQUIRE_THROWS_WITH(sparsity_from_probabilities(zeros.data(), 3), Contains("every weight"));
  REQUIRE_THROWS_WITH(sparsity_from_probabilities(zeros.data(), 0), Contains("n=0"));
  std::int32_t lens[1] = {9};
  std::vector<float> p(1 * 1 * 4, 0.25f);
  const TensorView pv = TensorView::contiguous(p.data(), DType::f32, Device::cpu, {1, 1, 4});
  REQUIRE_THROWS_WITH(attention_sparsity_from_probabilities(pv, lens),
                      Contains("lengths[0] = 9 outside [1, seq = 4]"));
}
