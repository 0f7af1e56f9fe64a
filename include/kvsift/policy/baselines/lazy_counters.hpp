// LazyEviction's per-token state and arithmetic (docs/algorithms.md §5.3): the last-hit step TS,
// the maximum recurrence interval MRI, the hit update, the eviction score and the kept slots.
// Host code, one cache row (one head of one sequence) at a time; shared by the Policy
// (lazy_eviction.hpp) and the reference stream (lazy_stream.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvsift/config/lazy_config.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::lazy {

// Rounds to the counters' arithmetic: fp16 for LazyCounters::fp16, fp32 otherwise.
inline float round_to(LazyCounters c, double x) {
  const float f = static_cast<float>(x);
  return c == LazyCounters::fp16 ? f16_bits_to_float(float_to_f16_bits(f)) : f;
}

// The step t as a counter value. fp16 counters overflow past 65504; refuse rather than store inf.
inline std::int32_t counter_of_step(LazyCounters c, std::int64_t t) {
  KVSIFT_CHECK(t >= 0 && t <= (c == LazyCounters::fp16 ? 65504 : INT32_MAX), "LazyEviction: step ",
               t, " outside the range of the ", c == LazyCounters::fp16 ? "fp16" : "int32",
               " step counters");
  return static_cast<std::int32_t>(round_to(c, static_cast<double>(t)));
}

// One row's counters; slot i is the i-th cached token (cache order = original position order).
struct Row {
  std::vector<std::int32_t> ts, mri;
  std::int64_t size() const { return static_cast<std::int64_t>(ts.size()); }
};

// Grows the row to n tokens: new tokens start with TS = `start` (0 at the first step, t − 1
// later) and MRI = 0.
inline void append_tokens(Row& row, std::int64_t n, std::int32_t start) {
  KVSIFT_CHECK(n >= row.size(), "LazyEviction: the cache shrank from ", row.size(), " to ", n,
               " tokens without an eviction plan");
  row.ts.resize(static_cast<std::size_t>(n), start);
  row.mri.resize(static_cast<std::size_t>(n), 0);
}

// A hit (w >= alpha) at step t: TS <- t, MRI <- max(MRI, t − TS_old), in the counters'
// arithmetic. `hit` [n] 1 for the tokens hit this step. Returns the number of hits.
inline std::int64_t record_hits(Row& row, const std::uint8_t* hit, std::int64_t t, LazyCounters c) {
  const std::int32_t now = counter_of_step(c, t);
  std::int64_t hits = 0;
  for (std::int64_t i = 0; i < row.size(); ++i) {
    if (!hit[i]) continue;
    ++hits;
    const auto gap = static_cast<std::int32_t>(round_to(c, double(now) - double(row.ts[i])));
    row.mri[i] = std::max(row.mri[i], gap);
    row.ts[i] = now;
  }
  return hits;
}

// The released code's score at step t, every operation rounded to the counters' arithmetic:
// 2/(1 + exp(1 + (t − TS)/(MRI + 1e-5))) + (MRI == 0 ? 0 : 2/(1 + exp(MRI − 1))).
// In fp16 (t − TS)/1e-5 overflows to +inf when MRI == 0 and the first term is 0.
inline float score(std::int32_t ts, std::int32_t mri, std::int64_t t, LazyCounters c) {
  const float a = round_to(c, double(t) - double(ts));
  const float b = round_to(c, double(mri) + 1e-5);
  const float r = round_to(c, double(a) / double(b));
  const float e = round_to(c, std::exp(double(round_to(c, 1.0 + double(r)))));
  const float first = round_to(c, 2.0 / double(round_to(c, 1.0 + double(e))));
  if (mri == 0) return first;
  const float e2 = round_to(c, std::exp(double(round_to(c, double(mri) - 1.0))));
  const float second = round_to(c, 2.0 / double(round_to(c, 1.0 + double(e2))));
  return round_to(c, double(first) + double(second));
}

// Slots kept by an eviction of a row of n > budget valid tokens whose first `first` slots are
// padding (never kept, never counted): the budget − window highest-scoring candidates (all valid
// tokens but the `window` most recent; equal scores: the lower slot first) and the `window` most
// recent, ascending. `scores` [n] (candidates' entries read only).
inline std::vector<std::int32_t> kept_slots(const std::vector<float>& scores, std::int64_t first,
                                            std::int64_t n, int budget, int window) {
  const std::int64_t cand_end = n - window;
  std::vector<std::int32_t> cand(
      static_cast<std::size_t>(std::max<std::int64_t>(0, cand_end - first)));
  std::iota(cand.begin(), cand.end(), static_cast<std::int32_t>(first));
  const std::size_t keep =
      std::min<std::size_t>(cand.size(), static_cast<std::size_t>(budget - window));
  std::partial_sort(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(keep), cand.end(),
                    [&](std::int32_t x, std::int32_t y) {
                      return scores[x] != scores[y] ? scores[x] > scores[y] : x < y;
                    });
  cand.resize(keep);
  for (std::int64_t i = std::max(first, cand_end); i < n; ++i)
    cand.push_back(static_cast<std::int32_t>(i));
  std::sort(cand.begin(), cand.end());
  return cand;
}

// Moves the counters the way compact() moves the rows: kept slot i takes slot slots[i].
inline void follow(Row& row, const std::vector<std::int32_t>& slots) {
  Row out;
  for (std::int32_t s : slots) out.ts.push_back(row.ts[s]), out.mri.push_back(row.mri[s]);
  row = std::move(out);
}

}  // namespace kvsift::lazy
