// RaaS's config (docs/algorithms.md §5.4). Eigen-free, shared by the CPU reference and the
// registry.
#pragma once

#include "kvsift/core/error.hpp"

namespace kvsift {

// What one timestamp covers.
enum class RaasUnit {
  token,  // one token; scored by its attention weight
  page,   // `page_size` consecutive decode tokens; scored by Quest's bound over the page's key
          // min/max, evicted whole
};

// Which units a decode step stamps with the current step t.
enum class RaasRefresh {
  top_half,  // the top ceil(n / 2) units by score (the paper's adaptive alpha)
  alpha,     // every unit whose attention weight reaches `alpha` (token mode only: a page's score
             // is a bound on a logit, not a weight)
};

struct RaasConfig {
  int budget = 1024;  // real tokens per sequence after a compression (the pinned prompt included)
  int window = 8;     // the newest decode tokens, never evicted
  int buffer = 1;     // compress once a sequence holds budget + buffer slots; 1: every step the
                      // cache exceeds the budget, as the paper
  RaasUnit unit = RaasUnit::token;
  int page_size = 16;  // tokens per page (page mode)
  RaasRefresh refresh = RaasRefresh::top_half;
  float alpha = 1e-4f;  // the absolute threshold (refresh alpha)

  // Tokens per unit.
  int unit_tokens() const { return unit == RaasUnit::page ? page_size : 1; }

  void validate() const {
    KVSIFT_CHECK(window >= 0, "RaasConfig: window must be >= 0, got ", window);
    KVSIFT_CHECK(buffer >= 1, "RaasConfig: buffer must be >= 1, got ", buffer);
    KVSIFT_CHECK(page_size >= 1, "RaasConfig: page_size must be >= 1, got ", page_size);
    // The newest tokens no eviction may touch: the window, and in page mode the partial page
    // plus the rest of the pages the window reaches, at most window + page_size − 1. A budget
    // above that always leaves an evictable unit once the decode tokens exceed it.
    const int protected_max = window + unit_tokens() - 1;
    KVSIFT_CHECK(budget > protected_max, "RaasConfig: budget (", budget,
                 ") must exceed window + tokens per unit - 1 (", protected_max, ": window ", window,
                 ", unit ", unit == RaasUnit::page ? "page of " : "token of ", unit_tokens(), ")");
    KVSIFT_CHECK(alpha > 0.0f && alpha <= 1.0f, "RaasConfig: alpha must be in (0, 1], got ", alpha);
    KVSIFT_CHECK(refresh != RaasRefresh::alpha || unit == RaasUnit::token,
                 "RaasConfig: refresh alpha needs unit token (a page's score is a bound on a "
                 "logit, not an attention weight), got unit page");
  }
};

}  // namespace kvsift
