// Key redundancy (docs/algorithms.md §1.2): the O(S·D) column-sum path against a naive O(S²·D)
// evaluation of the full cosine matrix, hand-computed cases for the sparing rule and the
// faithful column-0 fallback, padding, and the error paths.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cpu/key_redundancy.hpp"
#include "random_cache.hpp"

using namespace kvsift;
using kvsift_test::RandomCache;

namespace {

// Literal §1.2 for one (b, h) in double: the whole matrix C, the last match per row, zeroing,
// column means, softmax over all S.
std::vector<double> oracle_redundancy(const RandomCache& c, int b, int h, double threshold,
                                      bool faithful) {
  const int s = c.lengths[b], dim = static_cast<int>(c.keys.d3);
  std::vector<std::vector<double>> kn(s, std::vector<double>(dim));
  for (int i = 0; i < s; ++i) {
    double norm = 0.0;
    for (int d = 0; d < dim; ++d) {
      kn[i][d] = c.valid(b, i) ? c.keys.at(b, h, i, d) : 0.0;
      norm += kn[i][d] * kn[i][d];
    }
    for (double& x : kn[i]) x /= std::sqrt(norm) + 1e-8;
  }
  std::vector<std::vector<double>> cm(s, std::vector<double>(s, 0.0));
  for (int i = 0; i < s; ++i)
    for (int j = 0; j < s; ++j)
      for (int d = 0; d < dim && i != j; ++d) cm[i][j] += kn[i][d] * kn[j][d];
  for (int i = 0; i < s; ++i) {
    int last = -1;
    for (int j = 0; j < s; ++j)
      if (cm[i][j] > threshold) last = j;
    if (last >= 0) {
      cm[i][last] = 0.0;
    } else if (faithful) {
      cm[i][0] = 0.0;
    }
  }
  std::vector<double> r(s, 0.0);
  for (int j = 0; j < s; ++j) {
    for (int i = 0; i < s; ++i) r[j] += cm[i][j];
    r[j] /= s;
  }
  const double m = *std::max_element(r.begin(), r.end());
  double z = 0.0;
  for (double& x : r) z += (x = std::exp(x - m));
  for (double& x : r) x /= z;
  return r;
}

// Keys clustered around a few directions, so many pairs exceed the threshold and matches fall
// in every search block.
void make_clustered(RandomCache& c, std::mt19937& rng, int clusters, float noise) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  const auto& k = c.keys;
  std::vector<std::vector<float>> centers(clusters, std::vector<float>(k.d3));
  for (auto& cen : centers)
    for (float& x : cen) x = n(rng);
  std::uniform_int_distribution<int> pick(0, clusters - 1);
  for (std::int64_t b = 0; b < k.d0; ++b)
    for (std::int64_t h = 0; h < k.d1; ++h)
      for (std::int64_t j = 0; j < k.d2; ++j) {
        const auto& cen = centers[pick(rng)];
        for (std::int64_t d = 0; d < k.d3; ++d)
          c.keys.set(k.index(b, h, j, d), cen[d] + noise * n(rng));
      }
}

void check_against_oracle(RandomCache& c, const KeyRedundancyConfig& cfg) {
  const cpu::ScoreTensor r = cpu::redundancy_full(c.view(), cfg);
  for (std::int64_t b = 0; b < c.keys.d0; ++b) {
    REQUIRE(r.count(b) == c.lengths[b]);
    for (std::int64_t h = 0; h < c.keys.d1; ++h) {
      const std::vector<double> ref =
          oracle_redundancy(c, static_cast<int>(b), static_cast<int>(h), cfg.threshold,
                            cfg.mode == RedundancyMode::faithful);
      for (int j = 0; j < r.count(b); ++j) {
        INFO("b=" << b << " h=" << h << " j=" << j);
        CHECK(std::fabs(r.at(b, h, j) - ref[j]) <= 1e-8 + 1e-5 * ref[j]);
      }
    }
  }
}

}  // namespace

TEST_CASE("column-sum redundancy equals the naive O(S^2 D) evaluation", "[redundancy]") {
  std::mt19937 rng(5);
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const RedundancyMode modes[] = {RedundancyMode::sound, RedundancyMode::faithful};
  for (DType dt : dtypes) {
    for (RedundancyMode mode : modes) {
      SECTION(std::string("clustered keys over several search blocks, ") +
              std::string(dtype_name(dt)) +
              (mode == RedundancyMode::sound ? " sound" : " faithful")) {
        RandomCache c(dt, 2, 2, 300, 16, rng);
        make_clustered(c, rng, 12, 0.6f);
        c.lengths = {300, 173};
        check_against_oracle(c, {0.5f, mode});
      }
    }
  }
  SECTION("random keys: almost no matches, the fallback everywhere (faithful)") {
    RandomCache c(DType::f32, 1, 2, 90, 32, rng);
    check_against_oracle(c, {0.5f, RedundancyMode::faithful});
    check_against_oracle(c, {0.5f, RedundancyMode::sound});
  }
  SECTION("other thresholds") {
    RandomCache c(DType::f32, 1, 1, 150, 8, rng);
    make_clustered(c, rng, 5, 1.5f);
    check_against_oracle(c, {0.8f, RedundancyMode::sound});
    check_against_oracle(c, {0.1f, RedundancyMode::faithful});
  }
  SECTION("left padding: pad keys are zeroed (cosine 0 with everything)") {
    RandomCache c(DType::f32, 3, 2, 80, 16, rng);
    make_clustered(c, rng, 6, 1.0f);
    c.left_pad({0, 11, 37});
    check_against_oracle(c, {0.5f, RedundancyMode::faithful});
    check_against_oracle(c, {0.5f, RedundancyMode::sound});
  }
}

TEST_CASE("redundancy on a hand-computed three-token case", "[redundancy]") {
  // k0 = (1, 0), k1 = (0.3, 1), k2 = (1, 0.1). Cosines: C01 = 0.287348, C02 = 0.995037,
  // C12 = 0.381228. Row 0 matches 2, row 2 matches 0, row 1 matches nothing.
  // Sound column sums: [C10, C01 + C21, C12] = [0.287348, 0.668576, 0.381228];
  // faithful also zeroes C[1, 0]: column 0 becomes 0. log(R_j / R_k) = (colsum_j - colsum_k) / 3.
  std::mt19937 rng(0);
  RandomCache c(DType::f32, 1, 1, 3, 2, rng);
  const float k[3][2] = {{1, 0}, {0.3f, 1}, {1, 0.1f}};
  for (int j = 0; j < 3; ++j)
    for (int d = 0; d < 2; ++d) c.keys.set(c.keys.index(0, 0, j, d), k[j][d]);
  const cpu::ScoreTensor sound = cpu::redundancy_full(c.view(), {0.5f, RedundancyMode::sound});
  const cpu::ScoreTensor faithful =
      cpu::redundancy_full(c.view(), {0.5f, RedundancyMode::faithful});
  auto log_ratio = [](const cpu::ScoreTensor& r, int j, int k) {
    return std::log(double(r.at(0, 0, j)) / r.at(0, 0, k));
  };
  CHECK(std::fabs(log_ratio(sound, 1, 2) - (0.668576 - 0.381228) / 3) < 1e-5);
  CHECK(std::fabs(log_ratio(sound, 0, 2) - (0.287348 - 0.381228) / 3) < 1e-5);
  CHECK(std::fabs(log_ratio(faithful, 1, 2) - (0.668576 - 0.381228) / 3) < 1e-5);
  CHECK(std::fabs(log_ratio(faithful, 0, 2) - (0.0 - 0.381228) / 3) < 1e-5);
  CHECK(std::fabs(sound.at(0, 0, 0) + sound.at(0, 0, 1) + sound.at(0, 0, 2) - 1.0f) < 1e-6f);
}

TEST_CASE("window-sliced redundancy is the full softmax without the window", "[redundancy]") {
  std::mt19937 rng(9);
  RandomCache c(DType::bf16, 2, 3, 40, 8, rng);
  c.lengths = {40, 25};
  const KeyRedundancyConfig cfg{0.5f, RedundancyMode::sound};
  const cpu::ScoreTensor full = cpu::redundancy_full(c.view(), cfg);
  const cpu::ScoreTensor sliced = cpu::key_redundancy(c.view(), cfg, 8);
  for (int b = 0; b < 2; ++b) {
    REQUIRE(sliced.count(b) == c.lengths[b] - 8);
    for (int h = 0; h < 3; ++h)
      for (int j = 0; j < sliced.count(b); ++j) CHECK(sliced.at(b, h, j) == full.at(b, h, j));
  }
  const std::uint8_t active[2] = {0, 1};
  const cpu::ScoreTensor only1 = cpu::key_redundancy(c.view(), cfg, 8, active);
  CHECK(only1.count(0) == 0);
  CHECK(only1.count(1) == 17);
  CHECK(only1.at(1, 2, 5) == full.at(1, 2, 5));
}

TEST_CASE("redundancy rejects bad input", "[redundancy][errors]") {
  std::mt19937 rng(2);
  RandomCache c(DType::f16, 1, 2, 20, 8, rng);
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_WITH(cpu::redundancy_full(c.view(), {1.5f}),
                      Contains("threshold") && Contains("1.5"));
  REQUIRE_THROWS_WITH(cpu::key_redundancy(c.view(), {}, 21),
                      Contains("window (21)") && Contains("(20)"));
  c.keys.set(c.keys.index(0, 1, 3, 2), std::nanf(""));
  REQUIRE_THROWS_WITH(cpu::redundancy_full(c.view(), {}),
                      Contains("keys") && Contains("[0, 1, 3, 2]"));
}
