// Deterministic k-means selection of representative tokens: ThinKV's rule for which tokens of a
// demoted segment survive (docs/algorithms.md §3.3). Implemented in src/kmeans_select.cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace kvsift {

struct KMeansSelectConfig {
  int max_iterations = 10;  // Lloyd iterations at most (docs/algorithms.md §3.3)

  // Throws kvsift::Error naming the value.
  void validate() const;
};

// Picks `k` distinct rows of `points` that represent them: k-means with K = k, then for every
// centroid the real row nearest to it. Deterministic by construction (docs/algorithms.md §3.3, our
// choice):
//  - seeding: farthest-point, starting from row 0 (the segment's first token); each next seed is
//    the not-yet-chosen row with the largest squared distance to its nearest seed, ties to the
//    lower index;
//  - at most `max_iterations` Lloyd iterations in fp32, stopping early once no assignment
//    changes; a point joins the nearest centroid, ties to the lower centroid index;
//  - an empty cluster is reseeded with the row farthest from its own centroid (ties to the lower
//    index; a row already used for a reseed in this iteration is skipped);
//  - the survivors: centroids in index order each take the nearest row not yet taken (ties to the
//    lower index), so two centroids never share one token.
// Returns the chosen row indices sorted ascending. k >= n keeps every row; k must be >= 1 when
// n > 0. `points`: [n, dim] fp32, row-major.
std::vector<std::int32_t> kmeans_select(const float* points, std::int64_t n, std::int64_t dim,
                                        std::int64_t k, const KMeansSelectConfig& config = {});

}  // namespace kvsift
