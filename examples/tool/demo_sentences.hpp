// Where sentences end in the demo's decode: either in a real token stream (MATH-500 prompts and
// reference solutions, tokenized for R1-Distill-Qwen) cut at the real sentence delimiters, or, when
// no stream is available, at synthetic lengths. Only the boundaries (and the token ids, for later
// keyword-aware policies) come from real text; keys, values and queries stay synthetic.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"
#include "kvsift/core/parse_number.hpp"

namespace kvsift::demo {

// Last token id of "\n" ".\n" ")\n" "\n\n" ".\n\n" ")\n\n" "?\n\n" in the R1-Distill-Qwen
// vocabulary (shared/data/README.md; docs/algorithms.md §2.1: a delimiter closes the sentence it
// ends).
inline const std::vector<std::int32_t>& r1qwen_sentence_delimiters() {
  static const std::vector<std::int32_t> ids = {198, 624, 340, 271, 382, 692, 1939};
  return ids;
}

// One sequence's sentence structure over generation positions [0, length).
struct SentencePlan {
  std::vector<std::int32_t> token_ids;  // [length] real ids, or -1 for a synthetic stream
  std::vector<std::int32_t>
      sentence_ends;  // exclusive end of each sentence, ascending; last = length

  std::int64_t length() const { return static_cast<std::int64_t>(token_ids.size()); }
  std::int64_t sentences() const { return static_cast<std::int64_t>(sentence_ends.size()); }
  std::int32_t sentence_start(std::int64_t s) const { return s == 0 ? 0 : sentence_ends[s - 1]; }
  std::int32_t sentence_length(std::int64_t s) const {
    return sentence_ends[s] - sentence_start(s);
  }
};

// Cuts `tokens` (already `length` long) after every delimiter id (docs/algorithms.md §2.1: the
// delimiter belongs to the sentence it closes). An unfinished last sentence ends at the stream's
// end.
inline SentencePlan sentence_plan_from_tokens(std::vector<std::int32_t> tokens,
                                              const std::vector<std::int32_t>& delimiters) {
  SentencePlan plan;
  plan.token_ids = std::move(tokens);
  const auto n = static_cast<std::int32_t>(plan.token_ids.size());
  for (std::int32_t p = 0; p < n; ++p) {
    for (std::int32_t d : delimiters) {
      if (plan.token_ids[p] == d) {
        plan.sentence_ends.push_back(p + 1);
        break;
      }
    }
  }
  if (n > 0 && (plan.sentence_ends.empty() || plan.sentence_ends.back() != n)) {
    plan.sentence_ends.push_back(n);
  }
  return plan;
}

// Synthetic boundaries: lengths cycle through a fixed, seed-rotated pattern in [6, 53] (mean ~28,
// near the real median) so that a run without the data file still has varied sentences.
inline SentencePlan synthetic_sentence_plan(std::int64_t length, std::uint64_t seed) {
  KVSIFT_CHECK(length >= 1, "synthetic_sentence_plan: length must be >= 1, got ", length);
  SentencePlan plan;
  plan.token_ids.assign(static_cast<std::size_t>(length), -1);
  std::uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  std::int64_t pos = 0;
  while (pos < length) {
    state =
        state * 6364136223846793005ull + 1442695040888963407ull;  // LCG: only lengths depend on it
    pos += 6 + static_cast<std::int64_t>((state >> 33) % 48);
    plan.sentence_ends.push_back(static_cast<std::int32_t>(pos < length ? pos : length));
  }
  return plan;
}

// The MATH-500 token file: one problem per line, prompt ids, a tab, solution ids (space-separated).
// Returns each problem's prompt followed by its solution, as one id list per problem.
inline std::vector<std::vector<std::int32_t>> load_token_streams(const std::string& path) {
  // A regular file of bounded size (read_file_bytes refuses directories, devices, FIFOs).
  const std::vector<std::uint8_t> bytes = read_file_bytes(path);
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::vector<std::vector<std::int32_t>> problems;
  std::string line;
  std::int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    for (char& c : line) {
      if (c == '\t') c = ' ';
    }
    std::istringstream fields(line);
    std::vector<std::int32_t> ids;
    std::string field;
    while (fields >> field) {
      ids.push_back(parse_integer<std::int32_t>(
          field, "token file '" + path + "' line " + std::to_string(line_no) + ": token id", 0));
    }
    problems.push_back(std::move(ids));
  }
  KVSIFT_CHECK(!problems.empty(), "token file '", path, "' holds no problems");
  return problems;
}

// A `length`-token stream for sequence `sequence` of a batch: consecutive problems (prompt then
// solution, as a model would see them), starting at a problem picked by seed and sequence so the
// batch's sequences differ, wrapping around the data set as needed.
inline std::vector<std::int32_t> token_stream_for_sequence(
    const std::vector<std::vector<std::int32_t>>& problems, std::int64_t length, std::uint64_t seed,
    std::int64_t sequence) {
  KVSIFT_CHECK(!problems.empty(), "token_stream_for_sequence: no problems");
  KVSIFT_CHECK(length >= 1, "token_stream_for_sequence: length must be >= 1, got ", length);
  const std::size_t n = problems.size();
  std::size_t p =
      static_cast<std::size_t>((seed * 131 + static_cast<std::uint64_t>(sequence) * 37) % n);
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(length));
  for (std::size_t guard = 0; static_cast<std::int64_t>(out.size()) < length;
       ++guard, p = (p + 1) % n) {
    KVSIFT_CHECK(guard < n + static_cast<std::size_t>(length), "token streams are all empty");
    for (std::int32_t id : problems[p]) {
      if (static_cast<std::int64_t>(out.size()) == length) break;
      out.push_back(id);
    }
  }
  return out;
}

}  // namespace kvsift::demo
