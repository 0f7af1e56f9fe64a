// One R-KV scoring call as `kvsift score --policy rkv` reports it, whatever device ran it: the
// score tensors, the plan and the compacted K/V, all in host memory. The CPU run is here; the CUDA
// run is in score_cuda.hpp. compare_rkv_runs() checks a run against another with the golden
// tolerances (golden/README.md), which is what `kvsift score --device cuda --compare-cpu` and the
// GPU test tests/cuda/test_tool_score_cuda.cpp rely on.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "kvsift/core/compact.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/step_inputs.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"

namespace kvsift::tool {

// Everything one R-KV call computes, dense and in host memory. n = seq − window candidates.
struct RKVRun {
  std::int64_t batch = 0, kv_heads = 0, seq = 0, dim = 0, window = 0;
  DType dtype = DType::f32;
  bool compressed = false;             // some sequence was over the budget
  std::vector<float> importance;       // [batch, kv_heads, n] a (docs/algorithms.md §1.1)
  std::vector<float> redundancy;       // [batch, kv_heads, n] R with the window sliced off
  std::vector<float> redundancy_full;  // [batch, kv_heads, seq] R over all tokens (§1.2)
  std::vector<float> score;            // [batch, kv_heads, n] λ·a − (1−λ)·R (§1.3)
  KeepPlan plan;
  // [batch, kv_heads, seq, dim] in `dtype`, after compaction: the first plan.kept_length(b) rows
  // of each (b, h) are the kept tokens in slot order; the rest are stale.
  std::vector<std::uint8_t> keys, values;

  std::int64_t candidates() const { return seq - window; }
  std::size_t row_bytes() const { return static_cast<std::size_t>(dim) * dtype_size(dtype); }
};

// Checks the shared preconditions of a run: a contiguous host cache whose sequences all hold
// `capacity` tokens (golden cases are never ragged; pads go through valid_mask) and S > W.
//   kv       host [batch, kv_heads, S, head_dim]
//   queries  host [batch, q_heads, W, head_dim]
inline void check_rkv_run_inputs(const KVCacheView& kv, const TensorView& queries,
                                 const RKVConfig& cfg) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cpu, "R-KV run: the cache must be in host memory");
  KVSIFT_CHECK(kv.keys.is_contiguous() && kv.values.is_contiguous(),
               "R-KV run: keys and values must be contiguous [batch, kv_heads, S, head_dim]");
  for (std::int64_t b = 0; b < kv.batch(); ++b)
    KVSIFT_CHECK(kv.length(b) == kv.capacity(), "R-KV run: sequence ", b, " holds ", kv.length(b),
                 " tokens, expected all ", kv.capacity());
  KVSIFT_CHECK(queries.rank == 4 && queries.shape[0] == kv.batch() &&
                   queries.shape[3] == kv.head_dim() && queries.is_contiguous(),
               "R-KV run: queries must be contiguous [batch = ", kv.batch(),
               ", q_heads, W, head_dim = ", kv.head_dim(), "], got [", queries.shape_string(), "]");
  KVSIFT_CHECK(queries.shape[2] == cfg.window, "R-KV run: window (", cfg.window,
               ") must equal the queries' W (", queries.shape[2], ")");
  KVSIFT_CHECK(kv.capacity() > cfg.window, "R-KV run: S (", kv.capacity(),
               ") must exceed the window (", cfg.window, ")");
}

// An empty run shaped for `kv` (contiguous host [batch, kv_heads, S, head_dim]) and `window`.
inline RKVRun shaped_run(const KVCacheView& kv, std::int64_t window) {
  RKVRun run;
  run.batch = kv.batch(), run.kv_heads = kv.kv_heads(), run.seq = kv.capacity();
  run.dim = kv.head_dim(), run.window = window, run.dtype = kv.dtype();
  return run;
}

inline std::vector<float> dense_scores(const cpu::ScoreTensor& s, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(s.batch() * s.kv_heads() * n));
  for (std::int64_t b = 0; b < s.batch(); ++b)
    for (std::int64_t h = 0; h < s.kv_heads(); ++h)
      std::copy(s.row(b, h), s.row(b, h) + n, out.begin() + (b * s.kv_heads() + h) * n);
  return out;
}

// Copies the cache and compacts the copy with `run.plan` into run.keys / run.values.
//   kv  contiguous host [batch, kv_heads, S, head_dim] the plan was made for
inline void compact_copy(RKVRun& run, const KVCacheView& kv) {
  const std::size_t bytes = static_cast<std::size_t>(kv.keys.numel()) * dtype_size(kv.dtype());
  run.keys.assign(static_cast<const std::uint8_t*>(kv.keys.data),
                  static_cast<const std::uint8_t*>(kv.keys.data) + bytes);
  run.values.assign(static_cast<const std::uint8_t*>(kv.values.data),
                    static_cast<const std::uint8_t*>(kv.values.data) + bytes);
  std::vector<std::int32_t> lengths(kv.lengths, kv.lengths + kv.batch());
  std::vector<std::uint8_t> mask;
  if (kv.valid_mask != nullptr)
    mask.assign(kv.valid_mask, kv.valid_mask + kv.batch() * kv.capacity());
  compact(make_kv_cache_view(run.keys.data(), run.values.data(), kv.dtype(), Device::cpu, run.batch,
                             run.kv_heads, run.seq, run.dim, lengths.data(),
                             mask.empty() ? nullptr : mask.data()),
          run.plan);
}

// The four score tensors of a CPU scorer (RKVScores or SentenceScores), made dense in `run`.
template <class Scores>
inline void take_dense_scores(RKVRun& run, const Scores& s) {
  const std::int64_t n = run.candidates();
  run.importance = dense_scores(s.importance, n);
  run.redundancy = dense_scores(s.redundancy, n);
  run.redundancy_full = dense_scores(s.redundancy_full, run.seq);
  run.score = dense_scores(s.score, n);
}

// The CPU reference: cpu::rkv_scores for the tensors, RKV::select for the plan (so sequences at or
// under the budget keep everything, §1.3), kvsift::compact on a copy of the cache.
inline RKVRun run_rkv_cpu(const KVCacheView& kv, const TensorView& queries, const RKVConfig& cfg) {
  check_rkv_run_inputs(kv, queries, cfg);
  RKVRun run = shaped_run(kv, cfg.window);
  take_dense_scores(run, cpu::rkv_scores(kv, queries, cfg));
  RKV policy(cfg);
  run.plan = policy.select(StepInputs{0, kv, queries});
  run.plan.validate();
  run.compressed = !run.plan.keeps_everything();
  compact_copy(run, kv);
  return run;
}

// The CPU SkipKV eq. 6 run (SentenceScorer::scores / select, docs/algorithms.md §2.4) as an RKVRun:
// the same tensors, `score` carrying the sentence penalties and the pad mode.
//   kv         contiguous host [batch, kv_heads, S, head_dim], every sequence S tokens
//   queries    host [batch, q_heads, W, head_dim]
//   penalties  [batch * kv_heads] penalty ranges per (b, h), or empty: none
inline RKVRun run_skipkv_cpu(const KVCacheView& kv, const TensorView& queries,
                             const SentenceScorerConfig& sc, const SentencePenalties& penalties) {
  check_rkv_run_inputs(kv, queries, sc.rkv);
  const SentenceScorer scorer(sc);
  RKVRun run = shaped_run(kv, sc.rkv.window);
  take_dense_scores(run, scorer.scores(kv, queries, penalties));
  run.plan = scorer.select(kv, queries, penalties);
  run.plan.validate();
  run.compressed = !run.plan.keeps_everything();
  compact_copy(run, kv);
  return run;
}

// Queries widened to f32 ([batch, q_heads, W, head_dim]), narrowed back to `dtype` for the GPU,
// which takes them in the keys' dtype. Exact when the case stored them in `dtype` (callers check).
inline std::vector<std::uint8_t> queries_in_dtype(const std::vector<float>& queries, DType dtype) {
  std::vector<std::uint8_t> out(queries.size() * dtype_size(dtype));
  KVSIFT_DISPATCH_DTYPE(dtype, T, [&] {
    T* dst = reinterpret_cast<T*>(out.data());
    for (std::size_t i = 0; i < queries.size(); ++i) dst[i] = from_float<T>(queries[i]);
  });
  return out;
}

// Golden tolerance of every score tensor (golden/README.md).
inline bool within_golden_tolerance(double x, double ref) {
  return std::fabs(x - ref) <= 1e-6 + 1e-4 * std::fabs(ref);
}

// How far one output of a run is from the reference run's.
struct OutputDiff {
  std::string name;
  double max_abs = 0, max_rel = 0;  // rel: |x − ref| / |ref| over entries with ref != 0
  std::int64_t outside = 0;         // entries outside the golden tolerance (NaNs included)
  std::int64_t count = 0;
};

inline OutputDiff diff_output(const std::string& name, const std::vector<float>& ours,
                              const std::vector<float>& ref) {
  KVSIFT_CHECK(ours.size() == ref.size(), "compare: output '", name, "' has ", ours.size(),
               " entries, the reference ", ref.size());
  OutputDiff d;
  d.name = name;
  d.count = static_cast<std::int64_t>(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double x = ours[i], y = ref[i], abs = std::fabs(x - y);
    if (!(abs <= 1e-6 + 1e-4 * std::fabs(y))) ++d.outside;  // written so NaN counts as outside
    if (std::isnan(abs)) continue;
    d.max_abs = std::max(d.max_abs, abs);
    if (y != 0) d.max_rel = std::max(d.max_rel, abs / std::fabs(y));
  }
  return d;
}

// A run against a reference run of the same case (golden/README.md rules): scores within
// tolerance; kept sets equal except for tokens whose reference score is within tolerance of the
// score at the cut (the (budget − W)-th largest valid candidate), where float order may swap
// neighbours; compacted K/V rows bit-identical for every slot both runs kept.
struct RKVComparison {
  std::vector<OutputDiff> outputs;  // importance, redundancy, redundancy_full, score
  bool kept_lengths_equal = false;
  std::int64_t kept_slots = 0;           // slots the reference keeps, all rows
  std::int64_t kept_differ = 0;          // slots kept by exactly one of the runs
  std::int64_t kept_differ_off_cut = 0;  // ... of them not within tolerance of the cut
  std::int64_t kv_rows_compared = 0;     // (b, h, slot) kept by both
  std::int64_t kv_rows_differ = 0;       // ... whose compacted key or value row differs in a bit
  double kv_max_abs = 0;                 // largest |difference| of those rows' elements

  bool ok() const {
    for (const OutputDiff& d : outputs)
      if (d.outside != 0) return false;
    return kept_lengths_equal && kept_differ_off_cut == 0 && kv_rows_differ == 0;
  }
};

//   valid_mask  host [batch, seq] (1 = real token) or nullptr, as the runs saw it
inline RKVComparison compare_rkv_runs(const RKVRun& ours, const RKVRun& ref, const RKVConfig& cfg,
                                      const std::uint8_t* valid_mask) {
  KVSIFT_CHECK(ours.batch == ref.batch && ours.kv_heads == ref.kv_heads && ours.seq == ref.seq &&
                   ours.dim == ref.dim && ours.window == ref.window && ours.dtype == ref.dtype,
               "compare: the two runs are not of the same case");
  RKVComparison c;
  c.outputs = {diff_output("importance", ours.importance, ref.importance),
               diff_output("redundancy", ours.redundancy, ref.redundancy),
               diff_output("redundancy_full", ours.redundancy_full, ref.redundancy_full),
               diff_output("score", ours.score, ref.score)};
  c.kept_lengths_equal = ours.plan.kept_lengths() == ref.plan.kept_lengths();
  const std::int64_t n = ref.candidates();
  const std::size_t row = ref.row_bytes();
  for (std::int64_t b = 0; b < ref.batch; ++b) {
    const std::uint8_t* valid = valid_mask == nullptr ? nullptr : valid_mask + b * ref.seq;
    for (std::int64_t h = 0; h < ref.kv_heads; ++h) {
      const std::int64_t r = b * ref.kv_heads + h;
      const std::int32_t* ref_row = ref.plan.row(b, h);
      const std::int32_t* our_row = ours.plan.row(b, h);
      const std::int64_t ref_n = ref.plan.row_size(b, h), our_n = ours.plan.row_size(b, h);
      c.kept_slots += ref_n;
      std::vector<std::int32_t> diff;
      std::set_symmetric_difference(our_row, our_row + our_n, ref_row, ref_row + ref_n,
                                    std::back_inserter(diff));
      c.kept_differ += static_cast<std::int64_t>(diff.size());
      if (!diff.empty()) {
        // The cut: the (budget − W)-th largest reference score among valid candidates.
        std::vector<float> cand;
        for (std::int64_t j = 0; j < n; ++j)
          if (valid == nullptr || valid[j]) cand.push_back(ref.score[r * n + j]);
        std::sort(cand.begin(), cand.end(), std::greater<float>());
        const std::size_t keep =
            std::min<std::size_t>(cand.size(), static_cast<std::size_t>(cfg.budget - cfg.window));
        const bool has_cut = ref.compressed && keep > 0;
        for (std::int32_t j : diff) {
          const bool near_cut = has_cut && j >= 0 && j < n &&
                                within_golden_tolerance(ref.score[r * n + j], cand[keep - 1]);
          c.kept_differ_off_cut += near_cut ? 0 : 1;
        }
      }
      // Compacted rows of the slots both kept: row i of a run holds its plan's i-th slot.
      for (std::int64_t i = 0, k = 0; i < ref_n; ++i) {
        while (k < our_n && our_row[k] < ref_row[i]) ++k;
        if (k == our_n || our_row[k] != ref_row[i]) continue;
        const std::size_t a = static_cast<std::size_t>(r * ours.seq + k) * row;
        const std::size_t e = static_cast<std::size_t>(r * ref.seq + i) * row;
        ++c.kv_rows_compared;
        if (std::memcmp(&ours.keys[a], &ref.keys[e], row) == 0 &&
            std::memcmp(&ours.values[a], &ref.values[e], row) == 0)
          continue;
        ++c.kv_rows_differ;
        KVSIFT_DISPATCH_DTYPE(ref.dtype, T, [&] {
          const T* ok = reinterpret_cast<const T*>(&ours.keys[a]);
          const T* rk = reinterpret_cast<const T*>(&ref.keys[e]);
          const T* ov = reinterpret_cast<const T*>(&ours.values[a]);
          const T* rv = reinterpret_cast<const T*>(&ref.values[e]);
          for (std::int64_t d = 0; d < ref.dim; ++d) {
            c.kv_max_abs =
                std::max<double>(c.kv_max_abs, std::fabs(to_float(ok[d]) - to_float(rk[d])));
            c.kv_max_abs =
                std::max<double>(c.kv_max_abs, std::fabs(to_float(ov[d]) - to_float(rv[d])));
          }
        });
      }
    }
  }
  return c;
}

// Prints `--compare-cpu`'s report (a GPU run against the CPU run); returns cmp.ok().
inline bool print_rkv_comparison(const RKVComparison& cmp) {
  std::printf(
      "compare-cpu: cuda vs cpu (scores: |x - ref| <= 1e-6 + 1e-4*|ref|; kept sets: equal up "
      "to near-cut swaps; compacted K/V: bit-identical on common slots)\n");
  std::printf("  %-16s %12s %12s %18s\n", "output", "max abs", "max rel", "outside / count");
  for (const OutputDiff& d : cmp.outputs)
    std::printf("  %-16s %12.3e %12.3e %8lld / %-8lld\n", d.name.c_str(), d.max_abs, d.max_rel,
                static_cast<long long>(d.outside), static_cast<long long>(d.count));
  std::printf(
      "  keep_sorted: %lld kept slots (window included), %lld kept by one device only, %lld of "
      "them away from the cut; kept lengths %s\n",
      static_cast<long long>(cmp.kept_slots), static_cast<long long>(cmp.kept_differ),
      static_cast<long long>(cmp.kept_differ_off_cut), cmp.kept_lengths_equal ? "equal" : "DIFFER");
  std::printf("  compacted_keys/values: %lld rows kept by both, %lld differ (max abs %.3e)\n",
              static_cast<long long>(cmp.kv_rows_compared),
              static_cast<long long>(cmp.kv_rows_differ), cmp.kv_max_abs);
  std::printf("compare-cpu: %s\n", cmp.ok() ? "PASS" : "FAIL (outside the golden tolerances)");
  return cmp.ok();
}

}  // namespace kvsift::tool
