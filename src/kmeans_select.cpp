// Deterministic k-means token selection (docs/algorithms.md §3.3); see kmeans_select.hpp for the rules.
#include "kvsift/backend/cpu/kmeans_select.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsift/core/error.hpp"

namespace kvsift {

void KMeansSelectConfig::validate() const {
  KVSIFT_CHECK(max_iterations >= 0, "KMeansSelectConfig: max_iterations must be >= 0, got ",
               max_iterations);
}

namespace {

// fp32 squared Euclidean distance, as the spec asks for fp32 Lloyd iterations.
float squared_distance(const float* a, const float* b, std::int64_t dim) {
  float s = 0.0f;
  for (std::int64_t d = 0; d < dim; ++d) {
    const float t = a[d] - b[d];
    s += t * t;
  }
  return s;
}

// Index of the centroid nearest to `point`; ties go to the lower centroid index because only a
// strictly smaller distance replaces the current best.
std::int64_t nearest_centroid(const float* point, const std::vector<float>& centroids,
                              std::int64_t k, std::int64_t dim, float* best_distance) {
  std::int64_t best = 0;
  float best_d = std::numeric_limits<float>::infinity();
  for (std::int64_t c = 0; c < k; ++c) {
    const float d = squared_distance(point, centroids.data() + c * dim, dim);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  *best_distance = best_d;
  return best;
}

// Farthest-point seeding from row 0. Seeds are distinct rows even when rows coincide: each next
// seed is the best among rows not chosen yet.
std::vector<std::int64_t> farthest_point_seeds(const float* points, std::int64_t n,
                                               std::int64_t dim, std::int64_t k) {
  std::vector<std::int64_t> seeds{0};
  std::vector<char> chosen(n, 0);
  chosen[0] = 1;
  std::vector<float> nearest(n);
  for (std::int64_t i = 0; i < n; ++i) nearest[i] = squared_distance(points + i * dim, points, dim);
  while (static_cast<std::int64_t>(seeds.size()) < k) {
    std::int64_t best = -1;
    for (std::int64_t i = 0; i < n; ++i) {
      if (!chosen[i] && (best < 0 || nearest[i] > nearest[best])) best = i;
    }
    seeds.push_back(best);
    chosen[best] = 1;
    for (std::int64_t i = 0; i < n; ++i) {
      nearest[i] =
          std::min(nearest[i], squared_distance(points + i * dim, points + best * dim, dim));
    }
  }
  return seeds;
}

}  // namespace

std::vector<std::int32_t> kmeans_select(const float* points, std::int64_t n, std::int64_t dim,
                                        std::int64_t k, const KMeansSelectConfig& config) {
  config.validate();
  KVSIFT_CHECK(n >= 0 && dim > 0, "kmeans_select: need n >= 0 and dim > 0, got n=", n,
               " dim=", dim);
  KVSIFT_CHECK(n <= std::numeric_limits<std::int32_t>::max(), "kmeans_select: n=", n,
               " does not fit int32 indices");
  KVSIFT_CHECK(n == 0 || points != nullptr, "kmeans_select: points is null with n=", n);
  KVSIFT_CHECK(k >= 1 || n == 0, "kmeans_select: k must be >= 1, got k=", k, " for n=", n);
  std::vector<std::int32_t> kept;
  if (k >= n) {
    for (std::int64_t i = 0; i < n; ++i) kept.push_back(static_cast<std::int32_t>(i));
    return kept;
  }
  for (std::int64_t i = 0; i < n * dim; ++i) {
    KVSIFT_CHECK(std::isfinite(points[i]), "kmeans_select: non-finite key value ", points[i],
                 " at row ", i / dim, ", dim ", i % dim);
  }

  std::vector<float> centroids(k * dim);
  const std::vector<std::int64_t> seeds = farthest_point_seeds(points, n, dim, k);
  for (std::int64_t c = 0; c < k; ++c) {
    std::copy(points + seeds[c] * dim, points + (seeds[c] + 1) * dim, centroids.begin() + c * dim);
  }

  std::vector<std::int64_t> assignment(n, -1);
  std::vector<float> distance(n);
  std::vector<std::int64_t> counts(k);
  std::vector<float> sums(k * dim);
  for (int iter = 0; iter < config.max_iterations; ++iter) {
    bool changed = false;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t c = nearest_centroid(points + i * dim, centroids, k, dim, &distance[i]);
      changed = changed || c != assignment[i];
      assignment[i] = c;
    }
    if (!changed) break;
    std::fill(counts.begin(), counts.end(), 0);
    std::fill(sums.begin(), sums.end(), 0.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      ++counts[assignment[i]];
      for (std::int64_t d = 0; d < dim; ++d) sums[assignment[i] * dim + d] += points[i * dim + d];
    }
    std::vector<char> used_for_reseed(n, 0);
    for (std::int64_t c = 0; c < k; ++c) {
      if (counts[c] > 0) {
        for (std::int64_t d = 0; d < dim; ++d) {
          centroids[c * dim + d] = sums[c * dim + d] / static_cast<float>(counts[c]);
        }
        continue;
      }
      // Empty cluster: move it onto the worst-served row, the classic farthest-point repair.
      std::int64_t far = -1;
      for (std::int64_t i = 0; i < n; ++i) {
        if (!used_for_reseed[i] && (far < 0 || distance[i] > distance[far])) far = i;
      }
      used_for_reseed[far] = 1;
      std::copy(points + far * dim, points + (far + 1) * dim, centroids.begin() + c * dim);
    }
  }

  // Survivors: each centroid, in index order, takes the nearest row that no earlier centroid took.
  std::vector<char> taken(n, 0);
  for (std::int64_t c = 0; c < k; ++c) {
    std::int64_t best = -1;
    float best_d = std::numeric_limits<float>::infinity();
    for (std::int64_t i = 0; i < n; ++i) {
      if (taken[i]) continue;
      const float d = squared_distance(points + i * dim, centroids.data() + c * dim, dim);
      if (best < 0 || d < best_d) {
        best = i;
        best_d = d;
      }
    }
    taken[best] = 1;
    kept.push_back(static_cast<std::int32_t>(best));
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}

}  // namespace kvsift
