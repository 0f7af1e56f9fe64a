// SegmentTable: where each tracked sentence ("segment") of a sequence lives in the cache, per
// (layer, sequence, KV head). Sentences are found in generation space (token positions of the
// sequence); heads evict differently, so one sentence owns a different cache-space range in each
// head. The update rules are docs/algorithms.md §2.3 (SkipKV's range bookkeeping):
//   before eviction  append the sentences closed since the last eviction;
//   after eviction   remap every range through the plan's sorted kept slots, drop empty ones.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/limits.hpp"

namespace kvsift {

// A sentence's generation-space span: token positions [start, end], both inclusive.
struct GenSpan {
  std::int64_t start = 0;
  std::int64_t end = 0;
};

// One sentence's cache-space range in one head: slots [lo, hi], both inclusive.
struct CacheRange {
  std::int64_t sentence = 0;  // the sentence's id: its index in the sequence's sentence list
  std::int64_t lo = 0;
  std::int64_t hi = 0;
};

// A redundant sentence still mapped in a head: the scorer subtracts `lambda` over [lo, hi]
// (docs/algorithms.md §2.4).
struct PenaltyRange {
  std::int64_t lo = 0;
  std::int64_t hi = 0;
  float lambda = 0.0f;
};

// [batch * kv_heads] lists of penalty ranges, one list per (sequence, KV head) row.
using SentencePenalties = std::vector<std::vector<PenaltyRange>>;

class SegmentTable {
 public:
  SegmentTable() = default;
  SegmentTable(std::int64_t layers, std::int64_t batch, std::int64_t kv_heads)
      : layers_(layers), batch_(batch), kv_heads_(kv_heads) {
    KVSIFT_CHECK(layers > 0 && batch > 0 && kv_heads > 0, "SegmentTable: layers (", layers,
                 "), batch (", batch, ") and kv_heads (", kv_heads, ") must all be > 0");
    KVSIFT_CHECK(layers <= kMaxLayers, "SegmentTable: layers (", layers,
                 ") exceeds kMaxLayers = ", kMaxLayers);
    // The row count is checked before anything is allocated: it must not wrap.
    heads_.resize(
        checked_size(checked_mul(checked_mul(layers, batch, "SegmentTable: layers * batch"),
                                 kv_heads, "SegmentTable: layers * batch * kv_heads"),
                     "SegmentTable rows"));
    next_sentence_.assign(static_cast<std::size_t>(layers * batch), 0);
    last_gen_end_.assign(static_cast<std::size_t>(layers * batch), -1);
    first_position_.assign(static_cast<std::size_t>(batch), 0);
  }

  std::int64_t layers() const { return layers_; }
  std::int64_t batch() const { return batch_; }
  std::int64_t kv_heads() const { return kv_heads_; }

  // Left padding: sequence b's first sentence starts at `position` (its pad count). Only needed
  // when an eviction can happen before b's first sentence closes; must be set before any append.
  void set_first_position(std::int64_t b, std::int64_t position) {
    check_batch(b, "set_first_position");
    KVSIFT_CHECK(position >= 0, "SegmentTable::set_first_position: position (", position,
                 ") must be >= 0");
    for (std::int64_t l = 0; l < layers_; ++l) {
      KVSIFT_CHECK(next_sentence_[seq_index(l, b)] == 0 && !any_evicted(l, b),
                   "SegmentTable::set_first_position: sequence ", b,
                   " already has sentences or evictions in layer ", l);
    }
    first_position_[b] = position;
  }

  // Before an eviction of `layer` (§2.3): appends, in every KV head of sequence b, the range of
  // the next sentence of b (its id is sentences_appended(layer, b)). `current_pos` is the number
  // of positions b has now (pads included), `cache_len` the tokens its cache holds in this layer.
  //   - a head never evicted: cache range = generation range;
  //   - afterwards: lo = one past the previous mapped sentence (the previous range's hi + 1),
  //     hi = cache_len - current_pos + gen_end, since everything generated after the last
  //     eviction sits contiguously at the cache tail; the range is added only if hi < cache_len.
  // Sentences must arrive in order, each after the previous one.
  void append(std::int64_t layer, std::int64_t b, GenSpan span, std::int64_t current_pos,
              std::int64_t cache_len) {
    check_layer(layer, "append");
    check_batch(b, "append");
    const std::size_t s = seq_index(layer, b);
    const std::int64_t id = next_sentence_[s];
    KVSIFT_CHECK(span.start >= 0 && span.start <= span.end, "SegmentTable::append: sentence ", id,
                 " of sequence ", b, " has span [", span.start, ", ", span.end, "]");
    KVSIFT_CHECK(span.start > last_gen_end_[s], "SegmentTable::append: sentence ", id,
                 " of sequence ", b, " starts at ", span.start,
                 ", not after the previous sentence's end ", last_gen_end_[s]);
    KVSIFT_CHECK(span.end < current_pos, "SegmentTable::append: sentence ", id, " of sequence ", b,
                 " ends at ", span.end, ", at or past current_pos = ", current_pos);
    KVSIFT_CHECK(cache_len >= 0 && cache_len <= current_pos, "SegmentTable::append: cache_len (",
                 cache_len, ") outside [0, current_pos = ", current_pos, "]");
    for (std::int64_t h = 0; h < kv_heads_; ++h) {
      Head& head = heads_[head_index(layer, b, h)];
      std::int64_t lo = span.start, hi = span.end;
      if (head.evicted) {
        lo = head.frontier;
        hi = cache_len - current_pos + span.end;
      }
      // After an eviction a span can fall short of the tail only through misuse (a sentence
      // closed before the last eviction appended after it); such a range maps nothing.
      if (hi < cache_len && lo <= hi) {
        head.ranges.push_back(CacheRange{id, lo, hi});
        head.frontier = hi + 1;
      }
    }
    next_sentence_[s] = id + 1;
    last_gen_end_[s] = span.end;
  }

  // Appends sentences[sentences_appended(layer, b) ..] (anything with .start and .end members,
  // e.g. the SentenceTracker's closed sentences), so a host can call it once per trigger.
  template <class SentenceLike>
  void append_closed(std::int64_t layer, std::int64_t b, const std::vector<SentenceLike>& sentences,
                     std::int64_t current_pos, std::int64_t cache_len) {
    check_layer(layer, "append_closed");
    check_batch(b, "append_closed");
    const std::int64_t n = static_cast<std::int64_t>(sentences.size());
    const std::int64_t from = next_sentence_[seq_index(layer, b)];
    KVSIFT_CHECK(n >= from, "SegmentTable::append_closed: sequence ", b, " has ", n,
                 " sentences, but ", from, " are already mapped in layer ", layer);
    for (std::int64_t i = from; i < n; ++i) {
      append(layer, b, GenSpan{sentences[i].start, sentences[i].end}, current_pos, cache_len);
    }
  }

  // After an eviction of `layer` (§2.3): for each (b, h), with P the plan's sorted kept slots
  // (window included), lo' = lower_bound(P, lo), hi' = upper_bound(P, hi) - 1; a range with
  // lo' > hi' lost every token in that head and is dropped. Rows of sequences that keep
  // everything remap to themselves.
  void apply_plan(std::int64_t layer, const KeepPlan& plan) {
    check_layer(layer, "apply_plan");
    KVSIFT_CHECK(plan.batch() == batch_ && plan.kv_heads() == kv_heads_,
                 "SegmentTable::apply_plan: plan is [batch=", plan.batch(),
                 ", kv_heads=", plan.kv_heads(), "], table is [batch=", batch_,
                 ", kv_heads=", kv_heads_, "]");
    KVSIFT_CHECK(plan.complete(), "SegmentTable::apply_plan: plan has only ", plan.rows_appended(),
                 " of ", batch_ * kv_heads_, " rows");
    for (std::int64_t b = 0; b < batch_; ++b) {
      for (std::int64_t h = 0; h < kv_heads_; ++h) {
        const std::int32_t* p = plan.row(b, h);
        const std::int32_t* p_end = p + plan.row_size(b, h);
        Head& head = heads_[head_index(layer, b, h)];
        if (!head.evicted) {
          // First eviction: everything not yet mapped starts where the next sentence would.
          head.frontier = head.ranges.empty() ? first_position_[b] : head.ranges.back().hi + 1;
          head.evicted = true;
        }
        std::size_t kept = 0;
        for (const CacheRange& r : head.ranges) {
          const std::int64_t lo = std::lower_bound(p, p_end, r.lo) - p;
          const std::int64_t hi = (std::upper_bound(p, p_end, r.hi) - p) - 1;
          if (lo <= hi) head.ranges[kept++] = CacheRange{r.sentence, lo, hi};
        }
        head.ranges.resize(kept);
        // The unmapped tail (the open sentence's kept tokens) starts after the kept slots that
        // lay before it; equals the last surviving range's hi + 1 whenever nothing lies between.
        head.frontier = std::lower_bound(p, p_end, head.frontier) - p;
      }
    }
  }

  // The mapped ranges of (layer, b, h), ascending.
  const std::vector<CacheRange>& ranges(std::int64_t layer, std::int64_t b, std::int64_t h) const {
    check_layer(layer, "ranges");
    check_batch(b, "ranges");
    check_head(h, "ranges");
    return heads_[head_index(layer, b, h)].ranges;
  }

  std::int64_t sentences_appended(std::int64_t layer, std::int64_t b) const {
    check_layer(layer, "sentences_appended");
    check_batch(b, "sentences_appended");
    return next_sentence_[seq_index(layer, b)];
  }

  // The per-token penalty lookup of §2.4: the redundant sentences still mapped in (layer, b, h),
  // as (lo, hi, λ). `sentences[id].lambda` is the mark of sentence `id`; λ < 0 = not redundant.
  template <class SentenceLike>
  std::vector<PenaltyRange> penalty_ranges(std::int64_t layer, std::int64_t b, std::int64_t h,
                                           const std::vector<SentenceLike>& sentences) const {
    std::vector<PenaltyRange> out;
    for (const CacheRange& r : ranges(layer, b, h)) {
      KVSIFT_CHECK(r.sentence < static_cast<std::int64_t>(sentences.size()),
                   "SegmentTable::penalty_ranges: sentence ", r.sentence, " of sequence ", b,
                   " is mapped but only ", sentences.size(), " sentences were given");
      const float lambda = sentences[r.sentence].lambda;
      if (lambda >= 0.0f) out.push_back(PenaltyRange{r.lo, r.hi, lambda});
    }
    return out;
  }

 private:
  struct Head {
    std::vector<CacheRange> ranges;  // ascending, disjoint
    bool evicted = false;
    std::int64_t frontier = 0;  // first cache slot past every mapped sentence (after evictions)
  };

  std::size_t seq_index(std::int64_t layer, std::int64_t b) const {
    return static_cast<std::size_t>(layer * batch_ + b);
  }
  std::size_t head_index(std::int64_t layer, std::int64_t b, std::int64_t h) const {
    return static_cast<std::size_t>((layer * batch_ + b) * kv_heads_ + h);
  }
  bool any_evicted(std::int64_t layer, std::int64_t b) const {
    for (std::int64_t h = 0; h < kv_heads_; ++h)
      if (heads_[head_index(layer, b, h)].evicted) return true;
    return false;
  }
  void check_layer(std::int64_t layer, const char* fn) const {
    KVSIFT_CHECK(layer >= 0 && layer < layers_, "SegmentTable::", fn, ": layer ", layer,
                 " outside [0, ", layers_, ")");
  }
  void check_batch(std::int64_t b, const char* fn) const {
    KVSIFT_CHECK(b >= 0 && b < batch_, "SegmentTable::", fn, ": sequence ", b, " outside [0, ",
                 batch_, ")");
  }
  void check_head(std::int64_t h, const char* fn) const {
    KVSIFT_CHECK(h >= 0 && h < kv_heads_, "SegmentTable::", fn, ": kv head ", h, " outside [0, ",
                 kv_heads_, ")");
  }

  std::int64_t layers_ = 0;
  std::int64_t batch_ = 0;
  std::int64_t kv_heads_ = 0;
  std::vector<Head> heads_;                   // [layers * batch * kv_heads]
  std::vector<std::int64_t> next_sentence_;   // [layers * batch] ids appended so far
  std::vector<std::int64_t> last_gen_end_;    // [layers * batch] end of the last appended span
  std::vector<std::int64_t> first_position_;  // [batch] pad count: where sentence 0 starts
};

// Adds the sentence penalty of docs/algorithms.md §2.4 into one (b, h) score row:
// score[t] -= λ_i for every redundant range [lo, hi] containing t. As in the reference, a range
// counts only while it is still mapped, lo < hi < cache_len (so a one-token sentence gets no
// penalty). `row_len` may be shorter than cache_len (the window sliced off): writes stop there.
inline void add_sentence_penalty(float* score,  // [row_len]
                                 std::int64_t row_len, std::int64_t cache_len,
                                 const std::vector<PenaltyRange>& ranges) {
  KVSIFT_CHECK(row_len >= 0 && row_len <= cache_len, "add_sentence_penalty: row_len (", row_len,
               ") outside [0, cache_len = ", cache_len, "]");
  for (const PenaltyRange& r : ranges) {
    KVSIFT_CHECK(std::isfinite(r.lambda), "add_sentence_penalty: range [", r.lo, ", ", r.hi,
                 "] has non-finite lambda ", r.lambda);
    if (!(r.lo >= 0 && r.lo < r.hi && r.hi < cache_len)) continue;
    const std::int64_t stop = std::min(r.hi + 1, row_len);
    for (std::int64_t t = r.lo; t < stop; ++t) score[t] -= r.lambda;
  }
}

}  // namespace kvsift
