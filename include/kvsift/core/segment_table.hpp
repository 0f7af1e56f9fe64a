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

// The penalty ranges of every layer of one compression step, flat (a CSR): row
// r = (layer * batch + b) * kv_heads + h owns ranges[indptr[r] .. indptr[r + 1]), in the order
// SegmentTable::penalty_ranges lists them. Built on the host, uploaded to the device in one piece.
struct StepPenalties {
  std::int64_t layers = 0, batch = 0, kv_heads = 0;
  std::vector<std::int64_t> indptr;  // [layers * batch * kv_heads + 1]
  std::vector<PenaltyRange> ranges;  // [indptr.back()]
};

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
    for (std::int64_t b = 0; b < batch_; ++b)
      for (std::int64_t h = 0; h < kv_heads_; ++h)
        remap_head(layer, b, h, plan.row(b, h), plan.row_size(b, h));
  }

  // apply_plan() for plans held as fixed-stride rows (the device step's download): row (b, h)
  // is rows[(b * kv_heads + h) * row_stride ..], its first kept[b] entries the sorted kept slots.
  // A sequence with kept[b] == source[b] keeps everything and its rows are not read (a sequence
  // the step left untouched is passed that way).
  //   rows    [batch, kv_heads, row_stride]
  //   kept    [batch] kept slots per row;  source [batch] tokens each sequence held
  void apply_rows(std::int64_t layer, const std::int32_t* rows, std::int64_t row_stride,
                  const std::int32_t* kept, const std::int32_t* source) {
    check_layer(layer, "apply_rows");
    for (std::int64_t b = 0; b < batch_; ++b) {
      KVSIFT_CHECK(
          kept[b] >= 0 && kept[b] <= source[b] && (kept[b] == source[b] || kept[b] <= row_stride),
          "SegmentTable::apply_rows: sequence ", b, " keeps ", kept[b], " of ", source[b],
          " tokens in rows of ", row_stride, " slots");
      for (std::int64_t h = 0; h < kv_heads_; ++h) {
        if (kept[b] == source[b]) {
          keep_everything(layer, b, h, source[b]);
        } else {
          remap_head(layer, b, h, rows + (b * kv_heads_ + h) * row_stride, kept[b]);
        }
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
    append_penalty_ranges(layer, b, h, sentences, out);
    return out;
  }
  // The same ranges appended to `out` (a flat CSR under construction, no list per row).
  template <class SentenceLike>
  void append_penalty_ranges(std::int64_t layer, std::int64_t b, std::int64_t h,
                             const std::vector<SentenceLike>& sentences,
                             std::vector<PenaltyRange>& out) const {
    const std::int64_t known = static_cast<std::int64_t>(sentences.size());
    for (const CacheRange& r : ranges(layer, b, h)) {
      KVSIFT_CHECK(r.sentence < known, "SegmentTable::penalty_ranges: sentence ", r.sentence,
                   " of sequence ", b, " is mapped but only ", known, " sentences were given");
      const float lambda = sentences[r.sentence].lambda;
      if (lambda >= 0.0f) out.push_back(PenaltyRange{r.lo, r.hi, lambda});
    }
  }

 private:
  struct Head {
    std::vector<CacheRange> ranges;  // ascending, disjoint
    bool evicted = false;
    std::int64_t frontier = 0;  // first cache slot past every mapped sentence (after evictions)
  };

  // Marks the head evicted on its first plan: everything not yet mapped starts where the next
  // sentence would.
  void begin_eviction(Head& head, std::int64_t b) const {
    if (head.evicted) return;
    head.frontier = head.ranges.empty() ? first_position_[b] : head.ranges.back().hi + 1;
    head.evicted = true;
  }

  // First element of the ascending [first, last) that is not `less` than x, for answers near
  // `first`: strides of 16 until the answer is within one, then a branchless binary search of
  // those 16 (conditional moves, no mispredicted branches). Remapping a head's ranges asks
  // hundreds of such questions per row, each a few slots past the last answer. Same answer as
  // std::lower_bound (less = <) or std::upper_bound (less = <=).
  template <class Less>
  static const std::int32_t* search_near(const std::int32_t* first, const std::int32_t* last,
                                         std::int64_t x, Less less) {
    constexpr std::ptrdiff_t kSpan = 16;
    while (last - first > kSpan && less(first[kSpan - 1], x)) first += kSpan;
    std::ptrdiff_t n = std::min(kSpan, last - first);
    if (n == 0) return first;
    while (n > 1) {
      const std::ptrdiff_t half = n / 2;
      first = less(first[half], x) ? first + half : first;
      n -= half;
    }
    return first + (less(*first, x) ? 1 : 0);
  }

  // §2.3 after eviction for one head, P = p[0 .. n) ascending: lo' = lower_bound(P, lo),
  // hi' = upper_bound(P, hi) - 1 for every range. The ranges are ascending and disjoint, so each
  // search starts where the previous one ended; sentences usually tile the sequence (lo = the
  // previous hi + 1), and then lo' is that very position.
  void remap_head(std::int64_t layer, std::int64_t b, std::int64_t h, const std::int32_t* p,
                  std::int64_t n) {
    Head& head = heads_[head_index(layer, b, h)];
    begin_eviction(head, b);
    const auto lt = [](std::int32_t v, std::int64_t x) { return v < x; };
    const auto le = [](std::int32_t v, std::int64_t x) { return v <= x; };
    const std::int32_t* const p_end = p + n;
    // upper_bound(P, prev_hi) = lower_bound(P, prev_hi + 1); P = p (slots >= 0) for prev_hi = -1
    const std::int32_t* cur = p;
    std::int64_t prev_hi = -1;
    std::size_t kept = 0;
    for (const CacheRange& r : head.ranges) {
      // Start points are only taken when the ranges are ordered as append() keeps them, so the
      // answers are lower_bound / upper_bound over the whole row whatever the table holds.
      const std::int32_t* lo_it = r.lo == prev_hi + 1 ? cur
                                  : r.lo > prev_hi    ? search_near(cur, p_end, r.lo, lt)
                                                      : std::lower_bound(p, p_end, r.lo);
      const std::int32_t* hi_it =
          r.hi >= r.lo ? search_near(lo_it, p_end, r.hi, le) : std::upper_bound(p, p_end, r.hi);
      cur = hi_it;
      prev_hi = r.hi;
      const std::int64_t lo = lo_it - p, hi = (hi_it - p) - 1;
      if (lo <= hi) head.ranges[kept++] = CacheRange{r.sentence, lo, hi};
    }
    head.ranges.resize(kept);
    // The unmapped tail (the open sentence's kept tokens) starts after the kept slots that lay
    // before it; equals the last surviving range's hi + 1 whenever nothing lies between.
    head.frontier = std::lower_bound(p, p_end, head.frontier) - p;
  }

  // remap_head() with P = 0 .. source - 1 (the head kept everything): ranges stay, the frontier
  // is clipped to the cache.
  void keep_everything(std::int64_t layer, std::int64_t b, std::int64_t h, std::int64_t source) {
    Head& head = heads_[head_index(layer, b, h)];
    begin_eviction(head, b);
    std::size_t kept = 0;
    for (const CacheRange& r : head.ranges) {
      const std::int64_t lo = std::min(std::max<std::int64_t>(r.lo, 0), source);
      const std::int64_t hi = std::min(std::max<std::int64_t>(r.hi + 1, 0), source) - 1;
      if (lo <= hi) head.ranges[kept++] = CacheRange{r.sentence, lo, hi};
    }
    head.ranges.resize(kept);
    head.frontier = std::min(std::max<std::int64_t>(head.frontier, 0), source);
  }

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
