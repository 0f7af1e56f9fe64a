// SentenceTracker (docs/algorithms.md §2.1-2.2): segmentation, check labels, sentence embeddings
// and the pairwise-similarity redundancy marks of SkipKV.
#include "kvsift/policy/skipkv/sentence_tracker.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

namespace kvsift {

namespace {
// fp32 dot product (docs/algorithms.md: scoring math in fp32) with eight independent partial sums,
// so the compiler can vectorize it and long vectors lose less to rounding than one running sum.
float dot_f32(const float* a, const float* b, std::int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[k + l] * b[k + l];
  for (; k < n; ++k) part[0] += a[k] * b[k];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}
}  // namespace

void SentenceTokens::validate() const {
  KVSIFT_CHECK(
      !delimiters.empty(),
      "SentenceTokens: delimiters is empty (at least one sentence-ending token id needed)");
  for (std::int32_t d : delimiters) {
    KVSIFT_CHECK(d >= 0, "SentenceTokens: delimiter id ", d, " is negative");
  }
  for (std::int32_t k : keywords) {
    KVSIFT_CHECK(k >= 0, "SentenceTokens: keyword id ", k, " is negative");
    KVSIFT_CHECK(std::find(delimiters.begin(), delimiters.end(), k) == delimiters.end(),
                 "SentenceTokens: token id ", k, " is both a delimiter and a keyword");
  }
}

void SentenceTrackerConfig::validate() const {
  tokens.validate();
  KVSIFT_CHECK(hidden_size >= 0, "SentenceTrackerConfig: hidden_size (", hidden_size,
               ") must be >= 0");
  KVSIFT_CHECK(tau >= 0.0f && tau <= 1.0f, "SentenceTrackerConfig: tau (", tau,
               ") must lie in [0, 1]");
}

SentenceTracker::SentenceTracker(SentenceTrackerConfig config) : config_(std::move(config)) {
  config_.validate();
  sorted_delimiters_ = config_.tokens.delimiters;
  sorted_keywords_ = config_.tokens.keywords;
  std::sort(sorted_delimiters_.begin(), sorted_delimiters_.end());
  std::sort(sorted_keywords_.begin(), sorted_keywords_.end());
  open_sum_.assign(static_cast<std::size_t>(config_.hidden_size), 0.0);
}

bool SentenceTracker::is_delimiter(std::int32_t id) const {
  return std::binary_search(sorted_delimiters_.begin(), sorted_delimiters_.end(), id);
}
bool SentenceTracker::is_keyword(std::int32_t id) const {
  return std::binary_search(sorted_keywords_.begin(), sorted_keywords_.end(), id);
}

void SentenceTracker::add_padding(std::int64_t pads) {
  KVSIFT_CHECK(pads >= 0, "SentenceTracker::add_padding: pads (", pads, ") must be >= 0");
  KVSIFT_CHECK(position_ == padding_, "SentenceTracker::add_padding: ", position_ - padding_,
               " tokens were already observed; left padding must come first");
  padding_ += pads;
  position_ += pads;
  open_start_ = position_;
}

void SentenceTracker::check_token_batch(const std::int32_t* tokens, std::int64_t n) const {
  KVSIFT_CHECK(n >= 0, "SentenceTracker::observe: token count (", n, ") must be >= 0");
  KVSIFT_CHECK(n == 0 || tokens != nullptr, "SentenceTracker::observe: tokens is null for n = ", n);
}

void SentenceTracker::advance(std::int32_t token) {
  if (is_keyword(token)) open_check_ = true;
  const std::int64_t p = position_++;
  if (!is_delimiter(token)) return;
  // A delimiter at p closes [start, p] (§2.1); the next sentence starts at p + 1.
  Sentence s;
  s.start = open_start_;
  s.end = p;
  s.check = open_check_;
  sentences_.push_back(s);
  if (s.check) ++check_count_;
  const std::int64_t hs = config_.hidden_size;
  if (hs > 0) {
    // v_s = mean of the states, v̂_s = v_s / (||v_s|| + 1e-8); the 1/count cancels in the
    // direction but not in the epsilon, so it is kept.
    double norm2 = 0.0;
    const double inv = 1.0 / static_cast<double>(open_count_);
    for (std::int64_t k = 0; k < hs; ++k) {
      const double m = open_sum_[k] * inv;
      norm2 += m * m;
    }
    const double scale = inv / (std::sqrt(norm2) + 1e-8);
    for (std::int64_t k = 0; k < hs; ++k) {
      embeddings_.push_back(static_cast<float>(open_sum_[k] * scale));
    }
    std::fill(open_sum_.begin(), open_sum_.end(), 0.0);
  }
  open_start_ = p + 1;
  open_check_ = false;
  open_count_ = 0;
}

void SentenceTracker::observe(const std::int32_t* tokens, std::int64_t n) {
  KVSIFT_CHECK(config_.hidden_size == 0, "SentenceTracker::observe: hidden states required ",
               "(hidden_size = ", config_.hidden_size, ") but none were given");
  check_token_batch(tokens, n);
  for (std::int64_t t = 0; t < n; ++t) advance(tokens[t]);
}

template <class T>
void SentenceTracker::add_hidden_row(const TensorView& hidden, std::int64_t t) {
  const T* row = hidden.ptr<T>(t);
  const std::int64_t step = hidden.stride[1];
  for (std::int64_t k = 0; k < config_.hidden_size; ++k) {
    open_sum_[k] += static_cast<double>(to_float(row[k * step]));
  }
  ++open_count_;
}

void SentenceTracker::observe(const std::int32_t* tokens, std::int64_t n,
                              const TensorView& hidden) {
  KVSIFT_CHECK(config_.hidden_size > 0, "SentenceTracker::observe: hidden states given but ",
               "the tracker was built with hidden_size = 0 (segmentation only)");
  check_token_batch(tokens, n);
  KVSIFT_CHECK(hidden.rank == 2, "SentenceTracker::observe: hidden must be [tokens, hidden], got ",
               "rank ", hidden.rank, " ", hidden.shape_string());
  KVSIFT_CHECK(hidden.shape[0] == n && hidden.shape[1] == config_.hidden_size,
               "SentenceTracker::observe: hidden is ", hidden.shape_string(), ", expected [", n,
               ", ", config_.hidden_size, "] (tokens, hidden_size)");
  KVSIFT_CHECK(hidden.device == Device::cpu, "SentenceTracker::observe: hidden must be on the CPU");
  KVSIFT_CHECK(n == 0 || hidden.data != nullptr, "SentenceTracker::observe: hidden data is null");
  if (n > 0) hidden.validate("SentenceTracker::observe: hidden");
  // Checked before any state changes: a NaN or inf would poison the sentence's mean embedding
  // and every PSS compared with it, silently (NaN > τ is false, so no mark, no error).
  for (std::int64_t t = 0; t < n; ++t) {
    KVSIFT_DISPATCH_DTYPE(hidden.dtype, T, [&] {
      const T* row = hidden.ptr<T>(t);
      for (std::int64_t k = 0; k < config_.hidden_size; ++k) {
        const float x = to_float(row[k * hidden.stride[1]]);
        KVSIFT_CHECK(std::isfinite(x), "SentenceTracker::observe: hidden[", t, ", ", k, "] = ", x,
                     " is not finite (token ", t, " of ", n, ", position ", position_ + t, ")");
      }
    });
  }
  for (std::int64_t t = 0; t < n; ++t) {
    KVSIFT_DISPATCH_DTYPE(hidden.dtype, T, [&] { add_hidden_row<T>(hidden, t); });
    advance(tokens[t]);
  }
}

void SentenceTracker::observe(const std::int32_t* tokens, std::int64_t n, const void* hidden,
                              DType dtype) {
  observe(tokens, n,
          TensorView::contiguous(const_cast<void*>(hidden), dtype, Device::cpu,
                                 {n, config_.hidden_size}));
}

std::vector<RedundancyMark> SentenceTracker::mark_redundant() {
  std::vector<RedundancyMark> marks;
  const std::int64_t n = num_sentences();
  const std::int64_t hs = config_.hidden_size;
  if (hs > 0) {
    for (std::int64_t j = compared_; j < n; ++j) {
      const float* vj = embedding(j);
      for (std::int64_t i = 0; i < j; ++i) {
        const float* vi = embedding(i);
        const float dot = dot_f32(vi, vj, hs);
        const float pss = dot;
        if (pss > config_.tau) {
          sentences_[i].lambda = pss;  // the earlier sentence goes; the later one stays
          marks.push_back(RedundancyMark{i, j, pss});
        }
      }
    }
  }
  compared_ = n;
  return marks;
}

void SentenceTracker::set_mark(std::int64_t start, std::int64_t end, float lambda) {
  KVSIFT_CHECK(lambda == -1.0f || (std::isfinite(lambda) && lambda >= 0.0f),
               "SentenceTracker::set_mark: lambda (", lambda, ") for sentence [", start, ", ", end,
               "] must be -1 (not redundant) or finite and >= 0");
  const auto it =
      std::lower_bound(sentences_.begin(), sentences_.end(), start,
                       [](const Sentence& s, std::int64_t pos) { return s.start < pos; });
  KVSIFT_CHECK(it != sentences_.end() && it->start == start && it->end == end,
               "SentenceTracker::set_mark: no closed sentence spans [", start, ", ", end, "] (",
               sentences_.size(), " sentences closed, position ", position_, ")");
  it->lambda = lambda;
}

std::int64_t SentenceTracker::redundant_count() const {
  return std::count_if(sentences_.begin(), sentences_.end(),
                       [](const Sentence& s) { return s.redundant(); });
}

const float* SentenceTracker::embedding(std::int64_t i) const {
  KVSIFT_CHECK(config_.hidden_size > 0,
               "SentenceTracker::embedding: no embeddings with hidden_size = 0");
  KVSIFT_CHECK(i >= 0 && i < num_sentences(), "SentenceTracker::embedding: sentence ", i,
               " outside [0, ", num_sentences(), ")");
  return embeddings_.data() + i * config_.hidden_size;
}

}  // namespace kvsift
