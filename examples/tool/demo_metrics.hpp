// What the demo measures: FullKV's top-k attended tokens (the reference), the share of them a
// compressed cache still holds (recall@k), and how evicted tokens left — as whole sentences or as
// fragments of sentences that stay partly resident.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "demo_generator.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::demo {

// Top-k generation positions by attention logit. Softmax is monotone, so the top-k by logit is the
// top-k by attention weight; ties go to the lower position. `keys` [n, head_dim].
inline std::vector<std::int32_t> top_k_attended(const float* query, const float* keys,
                                                std::int64_t n, int head_dim, int k) {
  std::vector<std::pair<float, std::int32_t>> scored(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    const float* key = keys + j * head_dim;
    float dot = 0;
    for (int d = 0; d < head_dim; ++d) dot += query[d] * key[d];
    scored[j] = {dot, static_cast<std::int32_t>(j)};
  }
  const std::int64_t m = std::min<std::int64_t>(k, n);
  std::partial_sort(scored.begin(), scored.begin() + m, scored.end(),
                    [](const auto& a, const auto& b) {
                      return a.first > b.first || (a.first == b.first && a.second < b.second);
                    });
  std::vector<std::int32_t> top(static_cast<std::size_t>(m));
  for (std::int64_t i = 0; i < m; ++i) top[i] = scored[i].second;
  return top;
}

// Share of `top` found in `resident` (sorted ascending): |top ∩ resident| / |top|.
inline double recall_of(const std::vector<std::int32_t>& top, const std::int32_t* resident,
                        std::int64_t n_resident) {
  if (top.empty()) return 1.0;
  std::int64_t hit = 0;
  for (std::int32_t p : top) hit += std::binary_search(resident, resident + n_resident, p);
  return static_cast<double>(hit) / static_cast<double>(top.size());
}

// The uncompressed cache every policy is compared with: all keys, as stored (dtype-rounded), in
// generation order. Values are not needed: recall only asks where attention goes.
class FullKVReference {
 public:
  FullKVReference(int layers, int batch, int kv_heads, int head_dim, std::int64_t length)
      : layers_(layers), batch_(batch), kv_heads_(kv_heads), head_dim_(head_dim), length_(length) {
    keys_.resize(static_cast<std::size_t>(layers) * batch * kv_heads * length * head_dim);
  }

  void append(const DecodeStep& step) {
    KVSIFT_CHECK(step.position == appended_, "FullKVReference: step ", step.position,
                 " appended out of order (expected ", appended_, ")");
    for (int l = 0; l < layers_; ++l) {
      for (int b = 0; b < batch_; ++b) {
        for (int h = 0; h < kv_heads_; ++h) {
          std::copy(step.key(l, b, h), step.key(l, b, h) + head_dim_,
                    row(l, b, h) + appended_ * head_dim_);
        }
      }
    }
    ++appended_;
  }

  // [layers, batch, q_heads] lists of FullKV's top-k positions for the queries of `step` (the last
  // appended step), over every token so far, the step's own included.
  std::vector<std::vector<std::int32_t>> top_k(const DecodeStep& step, int k) const {
    const int G = step.q_heads / kv_heads_;
    std::vector<std::vector<std::int32_t>> out;
    out.reserve(static_cast<std::size_t>(layers_) * batch_ * step.q_heads);
    for (int l = 0; l < layers_; ++l) {
      for (int b = 0; b < batch_; ++b) {
        for (int q = 0; q < step.q_heads; ++q) {
          out.push_back(
              top_k_attended(step.query(l, b, q), row(l, b, q / G), appended_, head_dim_, k));
        }
      }
    }
    return out;
  }

  std::int64_t tokens() const { return appended_; }

 private:
  float* row(int l, int b, int h) {
    return keys_.data() +
           ((static_cast<std::size_t>(l) * batch_ + b) * kv_heads_ + h) * length_ * head_dim_;
  }
  const float* row(int l, int b, int h) const {
    return keys_.data() +
           ((static_cast<std::size_t>(l) * batch_ + b) * kv_heads_ + h) * length_ * head_dim_;
  }

  int layers_, batch_, kv_heads_, head_dim_;
  std::int64_t length_;
  std::int64_t appended_ = 0;
  std::vector<float> keys_;  // [layers, batch, kv_heads, length, head_dim]
};

// How evicted tokens left one (layer, sequence, head) row in one compression. A token leaves "as a
// whole sentence" when its sentence was closed, fully resident before the compression and is fully
// gone after it; any other evicted token is a fragment (part of its sentence stays, or the sentence
// had already lost tokens, or it was still open).
struct EvictionShape {
  std::int64_t whole_sentence_tokens = 0;
  std::int64_t fragment_tokens = 0;
  std::int64_t evicted() const { return whole_sentence_tokens + fragment_tokens; }
};

// `before` / `after`: resident generation positions, ascending; `after` a subset of `before`.
// `now`: tokens generated so far (sentences ending at or before it are closed).
inline EvictionShape eviction_shape(const std::int32_t* before, std::int64_t n_before,
                                    const std::int32_t* after, std::int64_t n_after,
                                    const SentencePlan& plan, std::int64_t now) {
  EvictionShape shape;
  std::int64_t i = 0, a = 0;
  while (i < n_before) {
    // One run of `before` within a single sentence s.
    const std::int32_t pos = before[i];
    const auto s = static_cast<std::int64_t>(
        std::upper_bound(plan.sentence_ends.begin(), plan.sentence_ends.end(), pos) -
        plan.sentence_ends.begin());
    const std::int32_t end = plan.sentence_ends[s];
    std::int64_t resident_before = 0, kept = 0;
    for (; i < n_before && before[i] < end; ++i) {
      ++resident_before;
      while (a < n_after && after[a] < before[i]) ++a;
      if (a < n_after && after[a] == before[i]) ++kept;
    }
    const std::int64_t evicted = resident_before - kept;
    const bool whole = kept == 0 && end <= now && resident_before == plan.sentence_length(s);
    (whole ? shape.whole_sentence_tokens : shape.fragment_tokens) += evicted;
  }
  return shape;
}

// "1.25 MiB": binary units, three significant digits.
inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf,
                u == 0 ? "%.0f %s"
                       : (bytes < 10    ? "%.2f %s"
                          : bytes < 100 ? "%.1f %s"
                                        : "%.0f %s"),
                bytes, units[u]);
  return buf;
}

}  // namespace kvsift::demo
