// SegmentEvictor: ThinKV's Think-Before-you-Evict (TBE, docs/algorithms.md §3.3). It keeps the
// segment bookkeeping of one sequence (one segment per 128-step refresh interval, with its thought
// type) and decides, step by step, which segments are demoted and to how many tokens. Which tokens
// of a demoted segment survive is decided per (layer, KV head) by kmeans_select on the segment's
// post-RoPE keys; the result is a KeepPlan for a contiguous cache (plan_segment_eviction) or
// per-(layer, head) eviction marks for a paged cache that only sets eviction bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/backend/cpu/kmeans_select.hpp"
#include "kvsift/config/thought_type.hpp"

namespace kvsift {

// The floor of the retention schedule: removing a segment entirely makes models loop (§3.3).
inline constexpr int kSegmentFloor = 4;

struct SegmentEvictorConfig {
  std::vector<int> schedule{64, 32, 16, 8, 4};  // R: tokens kept after the n-th demotion (§4)
  int budget = 1024;          // k: tokens per (sequence, KV head) above which Rule 2 demotes
  int segment_length = 128;   // tokens per segment = the thought refresh interval τ (§4)
  bool evict_prompt = false;  // the prompt (segment 0) is protected by default (our choice)

  void validate() const {
    KVSIFT_CHECK(!schedule.empty(), "SegmentEvictorConfig: schedule is empty (expected e.g. ",
                 "{64, 32, 16, 8, 4})");
    for (std::size_t i = 0; i < schedule.size(); ++i) {
      KVSIFT_CHECK(schedule[i] >= kSegmentFloor, "SegmentEvictorConfig: schedule[", i,
                   "] = ", schedule[i], " is below the floor of ", kSegmentFloor, " tokens");
      KVSIFT_CHECK(i == 0 || schedule[i] < schedule[i - 1], "SegmentEvictorConfig: schedule must ",
                   "strictly decrease, but schedule[", i - 1, "] = ", schedule[i - 1],
                   " and schedule[", i, "] = ", schedule[i]);
    }
    KVSIFT_CHECK(budget > 0, "SegmentEvictorConfig: budget must be > 0, got ", budget);
    KVSIFT_CHECK(segment_length > 0, "SegmentEvictorConfig: segment_length must be > 0, got ",
                 segment_length);
  }
};

// One segment of a sequence: the prompt (index 0) or one refresh interval of decode tokens.
struct Segment {
  ThoughtType type = ThoughtType::reasoning;
  bool is_prompt = false;
  std::int32_t start = 0;   // generation-space position of its first token
  std::int32_t length = 0;  // tokens generated into it (|S|)
  std::int32_t kept = 0;    // tokens it holds in the cache now
  int demotions = 0;        // n: how many times it was demoted
};

// A segment whose resident token count shrinks in this step. `cache_begin` is the slot of its
// first resident token in the contiguous cache as it is at the start of the step (every segment
// keeps the same count in every layer and head, so one offset serves them all).
struct SegmentChange {
  int segment = 0;
  std::int32_t cache_begin = 0;
  std::int32_t kept_before = 0;
  std::int32_t kept_after = 0;
};

// What one decode step did. `cache_before` counts the new token: it is the cache length the
// engine holds when it applies the step's plan.
struct EvictionStep {
  std::int64_t step = 0;        // 0-based decode step
  bool opened_segment = false;  // this token started a new segment
  bool rule1 = false;           // a T segment started and demoted every earlier segment
  int rule2_demotions = 0;      // demotions made for the budget
  bool over_budget = false;     // still above budget: every candidate is at the floor
  std::int32_t cache_before = 0;
  std::int32_t cache_after = 0;
  std::vector<SegmentChange> changes;  // sorted by segment (and so by cache_begin)

  bool evicted() const { return !changes.empty(); }
};

class SegmentEvictor {
 public:
  // `prompt_length` tokens are already in the cache as segment 0.
  SegmentEvictor(SegmentEvictorConfig config, std::int32_t prompt_length)
      : config_(std::move(config)) {
    config_.validate();
    KVSIFT_CHECK(prompt_length >= 0, "SegmentEvictor: prompt_length must be >= 0, got ",
                 prompt_length);
    Segment prompt;
    prompt.is_prompt = true;
    prompt.length = prompt.kept = prompt_length;
    segments_.push_back(prompt);
    cache_length_ = prompt_length;
  }

  const SegmentEvictorConfig& config() const { return config_; }
  const std::vector<Segment>& segments() const { return segments_; }
  std::int32_t cache_length() const { return cache_length_; }
  std::int64_t steps() const { return steps_; }

  // Tokens a segment of `length` tokens keeps after `demotions` demotions: min(|S|, R[n-1]),
  // and past the end of the schedule its last entry (>= the floor of 4) (§3.3).
  std::int32_t retained(std::int32_t length, int demotions) const {
    if (demotions <= 0) return length;
    const std::size_t i = std::min<std::size_t>(demotions, config_.schedule.size()) - 1;
    return std::min<std::int32_t>(length, config_.schedule[i]);
  }

  // One decode step: the new token joins the open segment, or opens a new segment of type
  // `label` (the classifier's label for this interval) every `segment_length` tokens. Then:
  //  Rule 1: if the token opened a T segment, every earlier segment is demoted one step;
  //  Rule 2: otherwise (docs/algorithms.md §3.3: not on a step where Rule 1 fired), while the cache
  //          exceeds the budget, the least important closed segment (lowest ρ, then oldest) that
  //          can still shrink is demoted. When no candidate can shrink, it stops and reports
  //          `over_budget`. A cache still above budget after Rule 1 is trimmed at the next step.
  // The open segment is never a Rule 2 candidate (our choice), nor is the prompt unless
  // `evict_prompt`.
  EvictionStep append_token(ThoughtType label) {
    EvictionStep out;
    out.step = steps_;
    const bool open_full =
        segments_.size() == 1 || segments_.back().length >= config_.segment_length;
    if (open_full) {
      Segment s;
      s.type = label;
      s.start = segments_.back().start + segments_.back().length;
      segments_.push_back(s);
      out.opened_segment = true;
    }
    Segment& open = segments_.back();
    ++open.length;
    open.kept = retained(open.length, open.demotions);
    ++cache_length_;
    out.cache_before = cache_length_;

    const std::vector<std::int32_t> kept_before = kept_counts();
    if (out.opened_segment && label == ThoughtType::transition) {
      out.rule1 = true;
      const std::size_t first = config_.evict_prompt ? 0 : 1;
      for (std::size_t i = first; i + 1 < segments_.size(); ++i) demote(i);
    }
    while (!out.rule1 && cache_length_ > config_.budget) {
      const int victim = rule2_victim();
      if (victim < 0) {
        out.over_budget = true;
        break;
      }
      demote(static_cast<std::size_t>(victim));
      ++out.rule2_demotions;
    }

    std::int32_t begin = 0;
    for (std::size_t i = 0; i < segments_.size(); ++i) {
      if (segments_[i].kept < kept_before[i]) {
        out.changes.push_back({static_cast<int>(i), begin, kept_before[i], segments_[i].kept});
      }
      begin += kept_before[i];
    }
    out.cache_after = cache_length_;
    ++steps_;
    return out;
  }

 private:
  std::vector<std::int32_t> kept_counts() const {
    std::vector<std::int32_t> k;
    for (const Segment& s : segments_) k.push_back(s.kept);
    return k;
  }

  void demote(std::size_t i) {
    Segment& s = segments_[i];
    ++s.demotions;
    const std::int32_t now = retained(s.length, s.demotions);
    cache_length_ -= s.kept - now;
    s.kept = now;
  }

  // Lowest ρ first, then the oldest; only closed segments whose next demotion frees a token, so
  // the loop ends once every candidate sits at its floor. The prompt ranks as R (our choice).
  int rule2_victim() const {
    int best = -1;
    for (std::size_t i = 0; i + 1 < segments_.size(); ++i) {
      const Segment& s = segments_[i];
      if (s.is_prompt && !config_.evict_prompt) continue;
      if (retained(s.length, s.demotions + 1) >= s.kept) continue;
      // Strictly lower ρ replaces the best so far, so among equals the oldest wins.
      if (best < 0 || importance(type_of(i)) < importance(type_of(best))) {
        best = static_cast<int>(i);
      }
    }
    return best;
  }
  ThoughtType type_of(std::size_t i) const {
    return segments_[i].is_prompt ? ThoughtType::reasoning : segments_[i].type;
  }

  SegmentEvictorConfig config_;
  std::vector<Segment> segments_;
  std::int32_t cache_length_ = 0;
  std::int64_t steps_ = 0;
};

// Share of (layer, step) pairs in which some eviction happened (ThinKV reports about 5% for TBE
// against about 83% for R-KV).
class EvictionCounter {
 public:
  void record(bool evicted) {
    ++total_;
    evicting_ += evicted ? 1 : 0;
  }
  // One decode step over `layers` layers: TBE's decisions are the same in every layer.
  void record_step(const EvictionStep& step, int layers) {
    KVSIFT_CHECK(layers > 0, "EvictionCounter: layers must be > 0, got ", layers);
    for (int l = 0; l < layers; ++l) record(step.evicted());
  }
  std::int64_t evicting() const { return evicting_; }
  std::int64_t total() const { return total_; }
  double fraction() const { return total_ == 0 ? 0.0 : static_cast<double>(evicting_) / total_; }

 private:
  std::int64_t evicting_ = 0;
  std::int64_t total_ = 0;
};

namespace detail {
// Reads rows [begin, begin + n) of one (b, h) into fp32: [n, head_dim].
inline std::vector<float> segment_keys_f32(const KVCacheView& kv, std::int64_t b, std::int64_t h,
                                           std::int32_t begin, std::int32_t n) {
  const std::int64_t dim = kv.head_dim();
  std::vector<float> out(static_cast<std::size_t>(n) * dim);
  KVSIFT_DISPATCH_DTYPE(kv.dtype(), T, [&] {
    for (std::int32_t i = 0; i < n; ++i) {
      const T* row = kv.keys.ptr<T>(b, h, begin + i);
      for (std::int64_t d = 0; d < dim; ++d) out[i * dim + d] = to_float(row[d]);
    }
  });
  return out;
}

// Sorted kept cache slots of one (b, h) after the step's demotions.
inline std::vector<std::int32_t> kept_slots(const KVCacheView& kv, std::int64_t b, std::int64_t h,
                                            const EvictionStep& step,
                                            const KMeansSelectConfig& kmeans) {
  std::vector<std::int32_t> slots;
  std::int32_t next = 0;
  for (const SegmentChange& c : step.changes) {
    for (; next < c.cache_begin; ++next) slots.push_back(next);
    const std::vector<float> keys = segment_keys_f32(kv, b, h, c.cache_begin, c.kept_before);
    for (std::int32_t i :
         kmeans_select(keys.data(), c.kept_before, kv.head_dim(), c.kept_after, kmeans)) {
      slots.push_back(c.cache_begin + i);
    }
    next = c.cache_begin + c.kept_before;
  }
  for (; next < step.cache_before; ++next) slots.push_back(next);
  return slots;
}

inline void check_step_matches(const KVCacheView& kv, std::int64_t b, const EvictionStep& step) {
  KVSIFT_CHECK(kv.lengths[b] == step.cache_before, "plan_segment_eviction: sequence ", b, " holds ",
               kv.lengths[b], " tokens but its eviction step was made for ", step.cache_before);
  std::int32_t end = 0;
  for (const SegmentChange& c : step.changes) {
    KVSIFT_CHECK(c.cache_begin >= end && c.kept_after >= 0 && c.kept_after <= c.kept_before &&
                     c.cache_begin + c.kept_before <= step.cache_before,
                 "plan_segment_eviction: sequence ", b, " change of segment ", c.segment,
                 " (cache_begin ", c.cache_begin, ", kept ", c.kept_before, " -> ", c.kept_after,
                 ") is out of order or outside the cache of ", step.cache_before, " tokens");
    end = c.cache_begin + c.kept_before;
    // Heads choose different survivors, so a pad inside a demoted segment could end up at
    // different positions per head, which no single padding-mask row can describe.
    for (std::int32_t s = c.cache_begin; s < end; ++s) {
      KVSIFT_CHECK(kv.is_valid(b, s), "plan_segment_eviction: sequence ", b, " slot ", s,
                   " is a pad inside demoted segment ", c.segment,
                   "; keep the prompt protected when the cache is left-padded");
    }
  }
}
}  // namespace detail

// The KeepPlan of one layer of a contiguous cache for this step: every sequence b applies
// steps[b] (from its own SegmentEvictor); the survivors of each demoted segment are chosen per KV
// head by kmeans_select on its post-RoPE keys. Left pads, if any, must lie in a protected prompt.
inline KeepPlan plan_segment_eviction(const KVCacheView& kv, const std::vector<EvictionStep>& steps,
                                      const KMeansSelectConfig& kmeans = {}) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cpu,
               "plan_segment_eviction: the cache is in device memory; this is the CPU reference");
  KVSIFT_CHECK(static_cast<std::int64_t>(steps.size()) == kv.batch(),
               "plan_segment_eviction: ", steps.size(), " eviction steps for a batch of ",
               kv.batch());
  std::vector<std::int32_t> source, kept;
  for (std::int64_t b = 0; b < kv.batch(); ++b) {
    detail::check_step_matches(kv, b, steps[b]);
    std::int32_t removed = 0;
    for (const SegmentChange& c : steps[b].changes) removed += c.kept_before - c.kept_after;
    source.push_back(kv.lengths[b]);
    kept.push_back(kv.lengths[b] - removed);
  }
  KeepPlan plan(kv.batch(), kv.kv_heads(), kv.capacity(), source, kept, 0);
  for (std::int64_t b = 0; b < kv.batch(); ++b) {
    for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
      plan.append_row(detail::kept_slots(kv, b, h, steps[b], kmeans));
    }
  }
  return plan;
}

// The same decision as eviction marks, for a cache that only sets eviction bits: for every
// (b, h) in row-major order, the sorted cache slots evicted this step.
inline std::vector<std::vector<std::int32_t>> segment_eviction_marks(
    const KVCacheView& kv, const std::vector<EvictionStep>& steps,
    const KMeansSelectConfig& kmeans = {}) {
  const KeepPlan plan = plan_segment_eviction(kv, steps, kmeans);
  std::vector<std::vector<std::int32_t>> marks;
  for (std::int64_t b = 0; b < kv.batch(); ++b) {
    for (std::int64_t h = 0; h < kv.kv_heads(); ++h) {
      std::vector<std::int32_t> evicted;
      const std::int32_t* row = plan.row(b, h);
      std::int64_t r = 0;
      for (std::int32_t s = 0; s < plan.source_length(b); ++s) {
        if (r < plan.row_size(b, h) && row[r] == s) {
          ++r;
        } else {
          evicted.push_back(s);
        }
      }
      marks.push_back(std::move(evicted));
    }
  }
  return marks;
}

// One demoted segment of one (layer, KV head) in a paged cache: its resident tokens' keys and
// generation-space positions in, the positions to mark evicted out (sorted).
// keys: [n, head_dim] fp32, positions: [n].
inline std::vector<std::int32_t> segment_eviction_marks(const float* keys,
                                                        const std::int32_t* positions,
                                                        std::int64_t n, std::int64_t head_dim,
                                                        std::int64_t target,
                                                        const KMeansSelectConfig& kmeans = {}) {
  KVSIFT_CHECK(target >= std::min<std::int64_t>(n, kSegmentFloor),
               "segment_eviction_marks: target ", target, " is below the floor of ", kSegmentFloor,
               " tokens (segment holds ", n, ")");
  const std::vector<std::int32_t> keep = kmeans_select(keys, n, head_dim, target, kmeans);
  std::vector<std::int32_t> evicted;
  std::size_t r = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (r < keep.size() && keep[r] == i) {
      ++r;
    } else {
      evicted.push_back(positions[i]);
    }
  }
  std::sort(evicted.begin(), evicted.end());
  return evicted;
}

}  // namespace kvsift
