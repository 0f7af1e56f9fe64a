// SentenceTracker: SkipKV's sentence bookkeeping for one sequence (docs/algorithms.md §2.1-2.2).
// Splits the token stream into sentences at host-supplied delimiter ids, labels "check"
// (non-executive) sentences by keyword ids, turns each sentence's hidden states into a unit
// embedding, and at compression triggers marks earlier sentences that a newer one repeats.
// The tracker works in generation space (token positions); SegmentTable maps its sentences into
// each head's cache.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/config/sentence_tracker_config.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/tensor_view.hpp"

namespace kvsift {

// A closed sentence of one sequence.
struct Sentence {
  std::int64_t start = 0;  // first position (generation space, pads counted)
  std::int64_t end = 0;    // last position, the delimiter; inclusive
  bool check = false;      // contains a keyword id: non-executive (§2.1)
  float lambda = -1.0f;    // redundancy mark λ_i (§2.2); < 0 = not redundant
  bool redundant() const { return lambda >= 0.0f; }
};

// One mark written at a trigger: sentence `earlier` repeats `later` with PSS `pss` (= its λ).
struct RedundancyMark {
  std::int64_t earlier = 0;
  std::int64_t later = 0;
  float pss = 0.0f;
};

class SentenceTracker {
 public:
  explicit SentenceTracker(SentenceTrackerConfig config);

  const SentenceTrackerConfig& config() const { return config_; }

  // Left padding: `pads` positions that belong to no sentence. Only before the first token.
  void add_padding(std::int64_t pads);

  // Appends tokens (prompt or decode), each advancing the position by one.
  void observe(const std::int32_t* tokens, std::int64_t n);  // hidden_size == 0 only
  // `hidden`: [n, hidden_size], f32/f16/bf16 on the CPU, any strides: row t is token t's state.
  void observe(const std::int32_t* tokens, std::int64_t n, const TensorView& hidden);
  // `hidden`: contiguous [n, hidden_size] of `dtype`.
  void observe(const std::int32_t* tokens, std::int64_t n, const void* hidden, DType dtype);
  void observe(const std::vector<std::int32_t>& tokens) {
    observe(tokens.data(), static_cast<std::int64_t>(tokens.size()));
  }

  // The compression trigger (§2.2): every sentence closed since the last trigger (j ascending) is
  // compared with every earlier sentence i (i ascending, including earlier new ones); PSS(i, j)
  // = v̂_i · v̂_j > τ marks i with λ_i = PSS, so when several later sentences match i the last
  // comparison in that order wins. Marks accumulate for the life of the sequence. Returns the
  // marks written, in the order written.
  std::vector<RedundancyMark> mark_redundant();

  // Applies a mark decided elsewhere (e.g. the golden case's [batch, start, end, λ] rows): the
  // closed sentence spanning exactly [start, end] gets λ (λ = -1 clears the mark). Throws for an
  // unknown span or a λ that is neither -1 nor finite and >= 0.
  void set_mark(std::int64_t start, std::int64_t end, float lambda);

  std::int64_t position() const { return position_; }  // positions seen, pads included
  std::int64_t padding() const { return padding_; }
  std::int64_t open_start() const { return open_start_; }  // first position of the open sentence
  bool open_is_check() const { return open_check_; }
  const std::vector<Sentence>& sentences() const { return sentences_; }  // closed, in order
  std::int64_t num_sentences() const { return static_cast<std::int64_t>(sentences_.size()); }
  std::int64_t check_count() const { return check_count_; }  // N_o of §2.5
  std::int64_t redundant_count() const;
  // Sentences closed since the last mark_redundant() call.
  std::int64_t pending_count() const { return num_sentences() - compared_; }
  // The unit embedding v̂ of closed sentence i: [hidden_size] (hidden_size > 0 only).
  const float* embedding(std::int64_t i) const;

 private:
  bool is_delimiter(std::int32_t id) const;
  bool is_keyword(std::int32_t id) const;
  void check_token_batch(const std::int32_t* tokens, std::int64_t n) const;
  template <class T>
  void add_hidden_row(const TensorView& hidden, std::int64_t t);
  void advance(std::int32_t token);  // segmentation of one token, after its hidden was summed

  SentenceTrackerConfig config_;
  std::vector<std::int32_t> sorted_delimiters_;
  std::vector<std::int32_t> sorted_keywords_;
  std::int64_t position_ = 0;
  std::int64_t padding_ = 0;
  std::int64_t open_start_ = 0;
  bool open_check_ = false;
  std::int64_t open_count_ = 0;
  std::vector<double> open_sum_;  // [hidden_size] running sum of the open sentence's states
  std::vector<Sentence> sentences_;
  std::vector<float> embeddings_;  // [num_sentences, hidden_size]
  std::int64_t check_count_ = 0;
  std::int64_t compared_ = 0;  // sentences already compared at a trigger
};

// Applies externally decided marks to a batch of trackers: `rows` is [n, 4] of
// (batch, start, end, λ), the layout of the golden case `skipkv_sentences` (λ = -1: not
// redundant). Throws for a batch index outside the trackers or an unknown sentence.
inline void apply_sentence_marks(std::vector<SentenceTracker>& trackers,
                                 const float* rows,  // [n, 4]
                                 std::int64_t n) {
  KVSIFT_CHECK(n >= 0 && (n == 0 || rows != nullptr), "apply_sentence_marks: bad rows (n = ", n,
               ")");
  for (std::int64_t r = 0; r < n; ++r) {
    const float* row = rows + 4 * r;
    const float b = row[0];
    KVSIFT_CHECK(b >= 0.0f && b < static_cast<float>(trackers.size()) && b == std::floor(b),
                 "apply_sentence_marks: row ", r, " names sequence ", b, ", there are ",
                 trackers.size());
    for (int c = 1; c <= 2; ++c) {
      // Casting a non-finite or huge float to an integer is undefined: reject it first.
      KVSIFT_CHECK(std::isfinite(row[c]) && std::fabs(row[c]) < 2147483648.0f,
                   "apply_sentence_marks: row ", r, " has ", c == 1 ? "start " : "end ", row[c]);
    }
    trackers[static_cast<std::size_t>(b)].set_mark(static_cast<std::int64_t>(row[1]),
                                                   static_cast<std::int64_t>(row[2]), row[3]);
  }
}

// Row b of a [batch, seq, hidden] view as a [seq, hidden] view (no copy), to feed one sequence's
// tracker from a batched forward pass.
inline TensorView batch_row(const TensorView& hidden,  // [batch, seq, hidden]
                            std::int64_t b) {
  KVSIFT_CHECK(hidden.rank == 3, "batch_row: expected a [batch, seq, hidden] view, got rank ",
               hidden.rank, " ", hidden.shape_string());
  KVSIFT_CHECK(b >= 0 && b < hidden.shape[0], "batch_row: row ", b, " outside [0, ",
               hidden.shape[0], ")");
  TensorView row = hidden;
  row.data =
      static_cast<char*>(hidden.data) + static_cast<std::ptrdiff_t>(b * hidden.stride[0]) *
                                            static_cast<std::ptrdiff_t>(dtype_size(hidden.dtype));
  row.rank = 2;
  row.shape = {hidden.shape[1], hidden.shape[2], 0, 0};
  row.stride = {hidden.stride[1], hidden.stride[2], 0, 0};
  return row;
}

}  // namespace kvsift
