// The LazyEviction reference stream (docs/algorithms.md §5.3, golden/README.md "LazyEviction"):
// the released code's layout, one cache per query head (keys repeated to the query heads), no
// compression of the prefill, decode step t = 1..N appends token P + t − 1 and attends with query
// t, eviction after use every W steps over the budget. Every attention operation is rounded to the
// model dtype (logits and scaling in the dtype, softmax in fp32, weights rounded to the dtype).
// Used by the golden test and `kvsift replay`; it records what the golden cases pin.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/policy/baselines/lazy_counters.hpp"

namespace kvsift::lazy {

struct StreamShape {
  std::int64_t q_heads = 0, kv_heads = 0, head_dim = 0, prefill = 0, steps = 0;
};

// One eviction's record, per query head.
struct EvictionRecord {
  std::int64_t step = 0;
  std::vector<std::vector<std::int32_t>> cand_pos, kept_pos;  // [q_heads][...]
  std::vector<std::vector<float>> cand_score, cand_ts, cand_mri, kept_ts, kept_mri;
};

struct StreamResult {
  std::vector<std::int32_t> hit_count;  // [steps, q_heads]
  std::vector<EvictionRecord> evictions;
  std::vector<std::vector<std::int32_t>> final_pos;  // [q_heads][n_final]
  std::vector<std::vector<float>> final_ts, final_mri;
};

// prefill_keys [1, kv_heads, prefill, head_dim], decode_keys [1, kv_heads, steps, head_dim],
// decode_queries [1, q_heads, steps, head_dim], all fp32 holding values of `dtype`'s grid.
// cfg.counters: fp16 for fp16 models (the counters live in the model dtype).
inline StreamResult run_stream(const StreamShape& s, const LazyConfig& cfg, bool fp16,
                               const std::vector<float>& prefill_keys,
                               const std::vector<float>& decode_keys,
                               const std::vector<float>& decode_queries) {
  cfg.validate();
  KVSIFT_CHECK(s.q_heads >= 1 && s.kv_heads >= 1 && s.q_heads % s.kv_heads == 0,
               "lazy stream: q_heads (", s.q_heads, ") must be a multiple of kv_heads (",
               s.kv_heads, ")");
  KVSIFT_CHECK(s.head_dim >= 1 && s.prefill >= 0 && s.steps >= 1, "lazy stream: head_dim ",
               s.head_dim, ", prefill_len ", s.prefill, ", decode_steps ", s.steps,
               " (need head_dim >= 1, prefill_len >= 0, decode_steps >= 1)");
  const std::int64_t D = s.head_dim, P = s.prefill, N = s.steps, group = s.q_heads / s.kv_heads;
  KVSIFT_CHECK(prefill_keys.size() == std::size_t(s.kv_heads * P * D) &&
                   decode_keys.size() == std::size_t(s.kv_heads * N * D) &&
                   decode_queries.size() == std::size_t(s.q_heads * N * D),
               "lazy stream: tensor sizes ", prefill_keys.size(), ", ", decode_keys.size(), ", ",
               decode_queries.size(), " disagree with the shape");
  const LazyCounters c = cfg.counters;
  const auto rd = [fp16](double x) {
    const float f = static_cast<float>(x);
    return fp16 ? f16_bits_to_float(float_to_f16_bits(f)) : f;
  };
  const float scale = rd(std::sqrt(double(D)));
  StreamResult out;
  out.hit_count.assign(std::size_t(N * s.q_heads), 0);
  std::vector<std::vector<std::int32_t>> pos(std::size_t(s.q_heads));  // original positions
  std::vector<Row> rows(std::size_t(s.q_heads));
  for (auto& p : pos)
    for (std::int64_t i = 0; i < P; ++i) p.push_back(std::int32_t(i));
  const auto key = [&](std::int64_t kvh, std::int32_t p) {
    return p < P ? &prefill_keys[std::size_t((kvh * P + p) * D)]
                 : &decode_keys[std::size_t((kvh * N + (p - P)) * D)];
  };
  std::vector<double> logit;
  std::vector<std::uint8_t> hit;
  for (std::int64_t t = 1; t <= N; ++t) {
    EvictionRecord rec;
    rec.step = t;
    bool evicted = false;
    for (std::int64_t h = 0; h < s.q_heads; ++h) {
      auto& p = pos[std::size_t(h)];
      Row& row = rows[std::size_t(h)];
      p.push_back(std::int32_t(P + t - 1));
      const std::int64_t n = std::int64_t(p.size());
      append_tokens(row, n, t == 1 ? 0 : counter_of_step(c, t - 1));
      const float* q = &decode_queries[std::size_t((h * N + (t - 1)) * D)];
      logit.assign(std::size_t(n), 0.0);
      double mx = -INFINITY;
      for (std::int64_t i = 0; i < n; ++i) {
        const float* k = key(h / group, p[std::size_t(i)]);
        float dot = 0.0f;  // fp32 accumulation, as the matmul's
        for (std::int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
        logit[std::size_t(i)] = rd(double(rd(dot)) / double(scale));
        mx = std::max(mx, logit[std::size_t(i)]);
      }
      double sum = 0.0;
      for (double& l : logit) sum += (l = std::exp(l - mx));
      hit.assign(std::size_t(n), 0);
      for (std::int64_t i = 0; i < n; ++i)
        hit[std::size_t(i)] = double(rd(float(logit[std::size_t(i)] / sum))) >= cfg.alpha;
      out.hit_count[std::size_t((t - 1) * s.q_heads + h)] =
          std::int32_t(record_hits(row, hit.data(), t, c));
      if (n <= cfg.budget || t % cfg.window != 0) continue;
      evicted = true;
      std::vector<float> sc(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n - cfg.window; ++i)
        sc[std::size_t(i)] = score(row.ts[std::size_t(i)], row.mri[std::size_t(i)], t, c);
      rec.cand_pos.emplace_back(p.begin(), p.end() - cfg.window);
      rec.cand_score.emplace_back(sc.begin(), sc.end() - cfg.window);
      rec.cand_ts.emplace_back(row.ts.begin(), row.ts.end() - cfg.window);
      rec.cand_mri.emplace_back(row.mri.begin(), row.mri.end() - cfg.window);
      const std::vector<std::int32_t> slots = kept_slots(sc, 0, n, cfg.budget, cfg.window);
      std::vector<std::int32_t> kept;
      for (std::int32_t sl : slots) kept.push_back(p[std::size_t(sl)]);
      p = kept;
      follow(row, slots);
      rec.kept_pos.push_back(p);
      rec.kept_ts.emplace_back(row.ts.begin(), row.ts.end());
      rec.kept_mri.emplace_back(row.mri.begin(), row.mri.end());
    }
    if (evicted) out.evictions.push_back(std::move(rec));
  }
  for (std::int64_t h = 0; h < s.q_heads; ++h) {
    out.final_pos.push_back(pos[std::size_t(h)]);
    out.final_ts.emplace_back(rows[std::size_t(h)].ts.begin(), rows[std::size_t(h)].ts.end());
    out.final_mri.emplace_back(rows[std::size_t(h)].mri.begin(), rows[std::size_t(h)].mri.end());
  }
  return out;
}

}  // namespace kvsift::lazy
