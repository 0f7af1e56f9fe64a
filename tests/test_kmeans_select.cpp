// kmeans_select (docs/algorithms.md §3.3): hand-computed seeding/ties, and clustered data whose
// survivors are known independently (the row nearest each true cluster mean).
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/backend/cpu/kmeans_select.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {
std::vector<std::int32_t> ids(std::initializer_list<std::int32_t> v) { return v; }
}  // namespace

TEST_CASE("kmeans_select keeps every row when k >= n", "[kmeans]") {
  const std::vector<float> pts{1, 2, 3, 4, 5, 6};  // [3, 2]
  REQUIRE(kmeans_select(pts.data(), 3, 2, 3) == ids({0, 1, 2}));
  REQUIRE(kmeans_select(pts.data(), 3, 2, 7) == ids({0, 1, 2}));
  REQUIRE(kmeans_select(nullptr, 0, 2, 0).empty());
}

TEST_CASE("farthest-point seeding starts at row 0 (no Lloyd iterations)", "[kmeans]") {
  // 1-D points 0, 1, 2, 10, 11. Seed 0 = row 0; farthest from it is 11 (row 4); then the
  // distances to {0, 11} are 1, 4, 1 for rows 1, 2, 3, so row 2 is next.
  const std::vector<float> pts{0, 1, 2, 10, 11};
  KMeansSelectConfig seeds_only;
  seeds_only.max_iterations = 0;
  REQUIRE(kmeans_select(pts.data(), 5, 1, 2, seeds_only) == ids({0, 4}));
  REQUIRE(kmeans_select(pts.data(), 5, 1, 3, seeds_only) == ids({0, 2, 4}));
}

TEST_CASE("Lloyd iterations move centroids to cluster means; ties go to the lower index",
          "[kmeans]") {
  // Clusters {0, 1, 2} (mean 1 -> row 1) and {10, 11} (mean 10.5: rows 3 and 4 tie -> row 3).
  const std::vector<float> pts{0, 1, 2, 10, 11};
  REQUIRE(kmeans_select(pts.data(), 5, 1, 2) == ids({1, 3}));
}

TEST_CASE("identical rows: empty clusters reseed and survivors stay distinct", "[kmeans]") {
  // Every row is the same point: both centroids sit on it, all rows join centroid 0 (tie), the
  // empty centroid 1 is reseeded, and both centroids want row 0 -> the second takes row 1.
  const std::vector<float> pts{3, -1, 3, -1, 3, -1, 3, -1};  // [4, 2]
  REQUIRE(kmeans_select(pts.data(), 4, 2, 2) == ids({0, 1}));
  REQUIRE(kmeans_select(pts.data(), 4, 2, 3) == ids({0, 1, 2}));
}

TEST_CASE("well separated clusters: one survivor each, the row nearest the true mean", "[kmeans]") {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> centre(-50.0f, 50.0f);
  std::uniform_real_distribution<float> jitter(-0.5f, 0.5f);
  std::uniform_int_distribution<int> size(3, 20);  // two members would tie exactly
  const int dim = 16, clusters = 8;
  for (int trial = 0; trial < 5; ++trial) {
    std::vector<float> pts;
    std::vector<int> label;
    std::vector<std::vector<float>> centres(clusters, std::vector<float>(dim));
    for (auto& c : centres) {
      for (auto& x : c) x = centre(rng);
    }
    // Interleave cluster members so the input order is not grouped.
    std::vector<int> sizes(clusters);
    for (auto& s : sizes) s = size(rng);
    for (int round = 0; round < 20; ++round) {
      for (int c = 0; c < clusters; ++c) {
        if (round >= sizes[c]) continue;
        for (int d = 0; d < dim; ++d) pts.push_back(centres[c][d] + jitter(rng));
        label.push_back(c);
      }
    }
    const std::int64_t n = static_cast<std::int64_t>(label.size());
    // Oracle: per cluster, the member nearest its mean (double precision, lowest index on ties).
    std::vector<std::int32_t> expected;
    for (std::int64_t i = 0; i < n; ++i) {
      const int c = label[i];
      std::vector<double> mean(dim, 0.0);
      int count = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        if (label[j] != c) continue;
        ++count;
        for (int d = 0; d < dim; ++d) mean[d] += pts[j * dim + d];
      }
      double best = std::numeric_limits<double>::infinity();
      std::int64_t best_j = -1;
      for (std::int64_t j = 0; j < n; ++j) {
        if (label[j] != c) continue;
        double s = 0;
        for (int d = 0; d < dim; ++d) s += std::pow(pts[j * dim + d] - mean[d] / count, 2);
        if (s < best) best = s, best_j = j;
      }
      if (best_j == i) expected.push_back(static_cast<std::int32_t>(i));
    }
    REQUIRE(expected.size() == clusters);
    const auto got = kmeans_select(pts.data(), n, dim, clusters);
    REQUIRE(got == expected);
    REQUIRE(kmeans_select(pts.data(), n, dim, clusters) == got);  // deterministic
  }
}

TEST_CASE("kmeans_select returns k distinct sorted rows on random data", "[kmeans]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> pts(128 * 64);
  for (auto& x : pts) x = g(rng);
  for (std::int64_t k : {1, 4, 8, 16, 32, 64, 127}) {
    const auto got = kmeans_select(pts.data(), 128, 64, k);
    REQUIRE(static_cast<std::int64_t>(got.size()) == k);
    for (std::size_t i = 1; i < got.size(); ++i) REQUIRE(got[i] > got[i - 1]);
    REQUIRE(got.front() >= 0);
    REQUIRE(got.back() < 128);
  }
}

TEST_CASE("kmeans_select rejects bad input with clear errors", "[kmeans][errors]") {
  const std::vector<float> pts{0, 1, 2, 3};
  REQUIRE_THROWS_WITH(kmeans_select(pts.data(), 4, 1, 0), Contains("k=0"));
  REQUIRE_THROWS_WITH(kmeans_select(pts.data(), 4, 0, 2), Contains("dim=0"));
  std::vector<float> bad = pts;
  bad[2] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(kmeans_select(bad.data(), 4, 1, 2), Contains("row 2"));
  KMeansSelectConfig cfg;
  cfg.max_iterations = -1;
  REQUIRE_THROWS_WITH(kmeans_select(pts.data(), 4, 1, 2, cfg), Contains("max_iterations"));
  REQUIRE_THROWS_AS(kmeans_select(nullptr, 4, 1, 2), Error);
}
