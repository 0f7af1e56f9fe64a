// BatchGrouper: SkipKV's batch grouping (docs/algorithms.md §2.6). Batched decoding left-pads every
// prompt to the longest one in its batch, and the SkipKV reference force-keeps pads in the
// compressed cache (score +100, docs/algorithms.md §2.4 "Padding"), so each pad eats one slot of
// the budget. Sorting requests by prefill length before cutting them into batches puts similar
// lengths together, which removes most of the padding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <istream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "kvsift/core/checked_math.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"

namespace kvsift {

struct BatchGrouperConfig {
  // Requests per batch; the last batch holds the remainder. docs/algorithms.md §4 gives no default:
  // 1 (no batching, hence no padding) is the neutral choice **(our choice)**.
  std::int64_t batch_size = 1;
  // Sort ascending by prefill length before batching (the SkipKV grouping); false keeps data-set
  // order, the ungrouped baseline.
  bool sort = true;

  void validate() const {
    KVSIFT_CHECK(batch_size >= 1, "BatchGrouperConfig.batch_size must be >= 1, got ", batch_size);
  }
};

struct BatchGroups {
  // Request indices (positions in the input) per batch, in batch order; within a batch in the
  // order the requests were taken (ascending length when sorted, data-set order otherwise).
  std::vector<std::vector<std::int64_t>> batches;
  std::vector<std::int64_t> pad;  // [requests] left pads of request p: max in batch - prefill_p
  std::vector<std::int64_t> batch_of;  // [requests] which batch request p landed in
  std::int64_t real_tokens = 0;        // sum of prefill lengths
  std::int64_t padding = 0;            // sum of `pad`: the padding of this grouping
  std::int64_t padding_unsorted = 0;   // padding with batches in data-set order (before grouping)
  std::int64_t padding_sorted = 0;     // padding with batches sorted by length (after grouping)
};

namespace detail {

// Cuts `order` (request indices) into consecutive batches of `batch_size` and fills pads.
inline std::int64_t batch_in_order(const std::vector<std::int64_t>& lengths,  // [requests]
                                   const std::vector<std::int64_t>& order,    // [requests]
                                   std::int64_t batch_size, BatchGroups* out) {
  std::int64_t total = 0;
  const auto n = static_cast<std::int64_t>(order.size());
  for (std::int64_t start = 0; start < n; start += batch_size) {
    const std::int64_t stop = std::min(n, start + batch_size);
    std::int64_t longest = 0;
    for (std::int64_t i = start; i < stop; ++i) longest = std::max(longest, lengths[order[i]]);
    std::vector<std::int64_t> members;
    for (std::int64_t i = start; i < stop; ++i) {
      const std::int64_t p = order[i];
      const std::int64_t pad = longest - lengths[p];
      total = checked_add(total, pad, "BatchGrouper: total padding");
      if (out) {
        out->pad[p] = pad;
        out->batch_of[p] = static_cast<std::int64_t>(out->batches.size());
        members.push_back(p);
      }
    }
    if (out) out->batches.push_back(std::move(members));
  }
  return total;
}

}  // namespace detail

class BatchGrouper {
 public:
  explicit BatchGrouper(BatchGrouperConfig config) : config_(config) { config_.validate(); }

  const BatchGrouperConfig& config() const { return config_; }

  // prefill_lengths: [requests] prompt lengths in tokens, data-set order, each >= 1.
  BatchGroups group(const std::vector<std::int64_t>& prefill_lengths) const {
    KVSIFT_CHECK(!prefill_lengths.empty(), "BatchGrouper: prefill_lengths is empty");
    const auto n = static_cast<std::int64_t>(prefill_lengths.size());
    for (std::int64_t p = 0; p < n; ++p) {
      KVSIFT_CHECK(prefill_lengths[p] >= 1, "BatchGrouper: prefill_lengths[", p,
                   "] = ", prefill_lengths[p], " must be >= 1");
    }

    std::vector<std::int64_t> dataset_order(n);
    std::iota(dataset_order.begin(), dataset_order.end(), 0);
    // Stable, so equal lengths keep data-set order and the grouping is reproducible.
    std::vector<std::int64_t> sorted_order = dataset_order;
    std::stable_sort(sorted_order.begin(), sorted_order.end(), [&](std::int64_t a, std::int64_t b) {
      return prefill_lengths[a] < prefill_lengths[b];
    });

    BatchGroups g;
    g.pad.assign(n, 0);
    g.batch_of.assign(n, 0);
    // Lengths near 2^63 used to wrap the totals negative: overflow is an error naming the sum.
    for (std::int64_t len : prefill_lengths)
      g.real_tokens = checked_add(g.real_tokens, len, "BatchGrouper: sum of prefill_lengths");
    g.padding_unsorted =
        detail::batch_in_order(prefill_lengths, dataset_order, config_.batch_size, nullptr);
    g.padding_sorted =
        detail::batch_in_order(prefill_lengths, sorted_order, config_.batch_size, nullptr);
    g.padding = detail::batch_in_order(prefill_lengths, config_.sort ? sorted_order : dataset_order,
                                       config_.batch_size, &g);
    return g;
  }

 private:
  BatchGrouperConfig config_;
};

// Effective budget of a request whose `pad` left pads are force-kept (SkipKV faithful mode,
// docs/algorithms.md §2.6): B' = B - pad. The window must still fit, so B' <= window is an error.
inline std::int64_t effective_budget(std::int64_t budget, std::int64_t window, std::int64_t pad) {
  KVSIFT_CHECK(window >= 0, "effective_budget: window must be >= 0, got ", window);
  KVSIFT_CHECK(pad >= 0, "effective_budget: pad must be >= 0, got ", pad);
  KVSIFT_CHECK(budget - pad > window, "effective budget B - pad = ", budget, " - ", pad, " = ",
               budget - pad, " must exceed window (", window, "): the pads leave no room to score");
  return budget - pad;
}

// effective_budget() of every request of a grouping: [requests].
inline std::vector<std::int64_t> effective_budgets(const BatchGroups& groups, std::int64_t budget,
                                                   std::int64_t window) {
  std::vector<std::int64_t> out;
  out.reserve(groups.pad.size());
  for (std::int64_t pad : groups.pad) out.push_back(effective_budget(budget, window, pad));
  return out;
}

// Reads a lengths file: one positive integer per line (surrounding spaces allowed; blank lines
// skipped, so a trailing newline is harmless). `what` names the source in errors.
inline std::vector<std::int64_t> parse_prefill_lengths(std::istream& in, const std::string& what) {
  std::vector<std::int64_t> lengths;
  std::string line;
  for (std::int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (!line.empty() && line.back() == '\r') line.pop_back();  // files written on Windows
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    std::istringstream fields(line);
    long long value = 0;
    std::string rest;
    const bool ok = static_cast<bool>(fields >> value) && !(fields >> rest) && value >= 1;
    KVSIFT_CHECK(ok, "lengths file '", what, "' line ", line_no,
                 ": expected one positive integer, got '", line, "'");
    lengths.push_back(value);
  }
  KVSIFT_CHECK(!lengths.empty(), "lengths file '", what, "' holds no lengths");
  return lengths;
}

// Regular files only, size-capped (core/file_io.hpp): a directory, a FIFO or /dev/zero is an
// error naming the path, not a hang or an endless read.
inline std::vector<std::int64_t> read_prefill_lengths(const std::string& path) {
  const std::vector<std::uint8_t> bytes = read_file_bytes(path);
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  return parse_prefill_lengths(in, path);
}

}  // namespace kvsift
