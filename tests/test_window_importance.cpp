// Window importance (docs/algorithms.md §1.1) against a direct double-precision evaluation of the
// formula, hand-computed cases, and the error paths.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cpu/window_importance.hpp"
#include "random_cache.hpp"

using namespace kvsift;
using kvsift_test::OwnedTensor;
using kvsift_test::RandomCache;

namespace {

// Literal §1.1, one (b, h), in double: logits per query head, GQA-reduced, softmax over the
// tokens before the window, reduced over the window, pooled.
std::vector<double> oracle_importance(const RandomCache& c, const OwnedTensor& q, int b, int h,
                                      const WindowImportanceConfig& cfg) {
  const int hq = static_cast<int>(q.d1), w_len = static_cast<int>(q.d2);
  const int dim = static_cast<int>(q.d3), group = hq / static_cast<int>(c.keys.d1);
  const int n = c.lengths[b] - w_len;
  std::vector<double> a(n, 0.0);
  for (int w = 0; w < w_len; ++w) {
    std::vector<double> logit(n);
    for (int j = 0; j < n; ++j) {
      double best = -std::numeric_limits<double>::infinity(), sum = 0.0;
      for (int g = 0; g < group; ++g) {
        double dot = 0.0;
        for (int d = 0; d < dim; ++d)
          dot += double(q.at(b, h * group + g, w, d)) * c.keys.at(b, h, j, d);
        dot /= std::sqrt(double(dim));
        if (!c.valid(b, j)) dot = -1e9;
        best = std::max(best, dot);
        sum += dot;
      }
      logit[j] = cfg.gqa == GqaReduce::max ? best : sum / group;
    }
    const double m = *std::max_element(logit.begin(), logit.end());
    double z = 0.0;
    for (double& x : logit) z += (x = std::exp(x - m));
    for (int j = 0; j < n; ++j) a[j] += logit[j] / z;
  }
  if (cfg.reduction == WindowReduce::mean)
    for (double& x : a) x /= w_len;
  std::vector<double> pooled(n);
  const int half = cfg.kernel / 2;
  for (int j = 0; j < n; ++j) {
    double best = -1.0, sum = 0.0;
    for (int i = j - half; i <= j + half; ++i) {
      if (i < 0 || i >= n) continue;  // max: available entries; avg: zero padding
      best = std::max(best, a[i]);
      sum += a[i];
    }
    pooled[j] = cfg.pooling == Pooling::max ? best : sum / cfg.kernel;
  }
  return pooled;
}

void check_against_oracle(DType dtype, int batch, int hkv, int group, int cap, int dim, int window,
                          const WindowImportanceConfig& cfg, std::mt19937& rng,
                          const std::vector<int>& lengths, const std::vector<int>& pads) {
  RandomCache c(dtype, batch, hkv, cap, dim, rng);
  for (int b = 0; b < batch; ++b) c.lengths[b] = lengths[b];
  if (!pads.empty()) c.left_pad(pads);
  OwnedTensor q(dtype, batch, hkv * group, window, dim);
  q.randomize(rng, 2.0f);  // sharper attention than unit scale
  const cpu::ScoreTensor a = cpu::window_importance(c.view(), q.view(), cfg);
  for (int b = 0; b < batch; ++b) {
    REQUIRE(a.count(b) == lengths[b] - window);
    for (int h = 0; h < hkv; ++h) {
      const std::vector<double> ref = oracle_importance(c, q, b, h, cfg);
      for (int j = 0; j < a.count(b); ++j) {
        INFO("b=" << b << " h=" << h << " j=" << j);
        CHECK(std::fabs(a.at(b, h, j) - ref[j]) <= 1e-7 + 1e-4 * std::fabs(ref[j]));
      }
    }
  }
}

}  // namespace

TEST_CASE("window importance matches a direct evaluation of §1.1", "[importance]") {
  std::mt19937 rng(11);
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  for (DType dt : dtypes) {
    SECTION(std::string("R-KV defaults, GQA, per-sequence lengths, ") +
            std::string(dtype_name(dt))) {
      WindowImportanceConfig cfg;  // window 8, kernel 7, max, max, mean
      check_against_oracle(dt, 2, 2, 4, 70, 32, 8, cfg, rng, {70, 41}, {});
    }
  }
  SECTION("mean GQA, average pooling, summed window (SnapKV-style), kernel 5") {
    WindowImportanceConfig cfg{6, 5, GqaReduce::mean, Pooling::avg, WindowReduce::sum};
    check_against_oracle(DType::f32, 1, 3, 2, 50, 16, 6, cfg, rng, {50}, {});
  }
  SECTION("kernel 1 is no pooling, MHA") {
    WindowImportanceConfig cfg{4, 1};
    check_against_oracle(DType::bf16, 1, 2, 1, 30, 8, 4, cfg, rng, {30}, {});
  }
  SECTION("left padding: pad keys get logit -1e9 before the GQA max") {
    WindowImportanceConfig cfg;
    check_against_oracle(DType::f32, 3, 2, 2, 60, 16, 8, cfg, rng, {60, 60, 60}, {0, 9, 30});
  }
}

TEST_CASE("window importance on hand-computed cases", "[importance]") {
  std::mt19937 rng(1);
  SECTION("zero queries attend uniformly: every score is 1/(S-W)") {
    RandomCache c(DType::f32, 1, 1, 12, 4, rng);
    OwnedTensor q(DType::f32, 1, 1, 2, 4);  // zero-filled
    const cpu::ScoreTensor a = cpu::window_importance(c.view(), q.view(), {2, 3});
    REQUIRE(a.count(0) == 10);
    for (int j = 0; j < 10; ++j) CHECK(std::fabs(a.at(0, 0, j) - 0.1f) < 1e-7f);
  }
  SECTION("one dominant key spreads over the pooling kernel, max pooling") {
    // Keys are unit vectors e0 except key 5 = 40*e1; the query is e1: key 5 takes ~all mass.
    RandomCache c(DType::f32, 1, 1, 12, 2, rng);
    for (int j = 0; j < 12; ++j) {
      c.keys.set(c.keys.index(0, 0, j, 0), j == 5 ? 0.0f : 1.0f);
      c.keys.set(c.keys.index(0, 0, j, 1), j == 5 ? 40.0f : 0.0f);
    }
    OwnedTensor q(DType::f32, 1, 1, 1, 2);
    q.set(1, 1.0f);
    const cpu::ScoreTensor a = cpu::window_importance(c.view(), q.view(), {1, 3});
    for (int j = 0; j < 11; ++j) {
      INFO("j=" << j);
      if (j >= 4 && j <= 6) {
        CHECK(a.at(0, 0, j) > 0.999f);
      } else {
        CHECK(a.at(0, 0, j) < 1e-6f);
      }
    }
  }
  SECTION("pool1d: max over available entries, avg divides by the kernel at edges") {
    std::vector<float> x = {0, 1, 0, 0, 0, 5, 0};
    cpu::detail::pool1d(x.data(), 7, 3, Pooling::max);
    CHECK(x == std::vector<float>{1, 1, 1, 0, 5, 5, 5});
    std::vector<float> y = {3, 0, 0, 0, 6};
    cpu::detail::pool1d(y.data(), 5, 3, Pooling::avg);
    CHECK(y == std::vector<float>{1, 1, 0, 2, 2});
  }
}

TEST_CASE("window importance rejects bad configs and shapes", "[importance][errors]") {
  std::mt19937 rng(3);
  RandomCache c(DType::f32, 1, 2, 20, 8, rng);
  OwnedTensor q(DType::f32, 1, 4, 8, 8);
  q.randomize(rng);
  using Catch::Matchers::Contains;
  SECTION("even kernel") {
    REQUIRE_THROWS_WITH(cpu::window_importance(c.view(), q.view(), {8, 6}),
                        Contains("kernel") && Contains("6"));
  }
  SECTION("head_dim mismatch") {
    OwnedTensor bad(DType::f32, 1, 4, 8, 16);
    REQUIRE_THROWS_WITH(cpu::window_importance(c.view(), bad.view(), {}),
                        Contains("head_dim (16)") && Contains("(8)"));
  }
  SECTION("q_heads not a multiple of kv_heads") {
    OwnedTensor bad(DType::f32, 1, 3, 8, 8);
    REQUIRE_THROWS_WITH(cpu::window_importance(c.view(), bad.view(), {}),
                        Contains("q_heads (3)") && Contains("kv_heads (2)"));
  }
  SECTION("window rows differ from the config") {
    REQUIRE_THROWS_WITH(cpu::window_importance(c.view(), q.view(), {4, 7}),
                        Contains("8 window rows") && Contains("window is 4"));
  }
  SECTION("window longer than a sequence") {
    c.lengths[0] = 5;
    REQUIRE_THROWS_WITH(cpu::window_importance(c.view(), q.view(), {}),
                        Contains("window (8)") && Contains("(5)"));
  }
  SECTION("NaN in keys or queries names the tensor") {
    OwnedTensor nanq = q;
    nanq.set(nanq.index(0, 1, 2, 3), std::nanf(""));
    REQUIRE_THROWS_WITH(cpu::window_importance(c.view(), nanq.view(), {}),
                        Contains("queries") && Contains("[0, 1, 2, 3]"));
    c.keys.set(c.keys.index(0, 1, 4, 0), std::nanf(""));
    REQUIRE_THROWS_WITH(cpu::window_importance(c.view(), q.view(), {}),
                        Contains("keys") && Contains("[0, 1, 4, 0]"));
  }
}
