// `kvsift group`: SkipKV batch grouping (docs/algorithms.md §2.6) of a prefill-lengths file. Prints how
// much left padding batching in data-set order costs, how much sorting by prefill length saves,
// the first few batches, and (with --budget) the effective budget per request when pads are
// force-kept as in the SkipKV reference.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "args.hpp"
#include "command.hpp"
#include "kvsift/policy/skipkv/batch_grouper.hpp"

namespace kvsift::tool {
namespace {

constexpr long kDefaultWindow = 8;  // docs/algorithms.md §4
constexpr long kDefaultShowGroups = 5;
constexpr std::size_t kMaxListed = 12;  // lengths listed per batch before eliding the rest

void print_help() {
  std::printf(
      "usage: kvsift group --lengths FILE --batch-size N [--budget B] [--window W]\n"
      "                    [--show-groups K]\n\n"
      "Groups requests into batches sorted by prefill length (SkipKV batch grouping) and reports\n"
      "the left padding before (batches in file order) and after grouping.\n\n"
      "  --lengths FILE     prefill lengths, one positive integer per line, in data-set order\n"
      "  --batch-size N     requests per batch (the last batch holds the remainder)\n"
      "  --budget B         also report the effective budget B' = B - pad (pads force-kept)\n"
      "  --window W         observation window, B' must exceed it (default %ld)\n"
      "  --show-groups K    print the first K batches after grouping (default %ld)\n",
      kDefaultWindow, kDefaultShowGroups);
}

// 68941 -> "68,941": the totals are compared by eye with published numbers.
std::string with_commas(std::int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string list_of(const std::vector<std::int64_t>& values) {
  std::string s = "[";
  for (std::size_t i = 0; i < values.size() && i < kMaxListed; ++i) {
    s += (i ? " " : "") + std::to_string(values[i]);
  }
  if (values.size() > kMaxListed) s += " ... +" + std::to_string(values.size() - kMaxListed);
  return s + "]";
}

// Min and mean of B - pad over all requests, and how many requests the pads leave with B' <= W
// (those the faithful mode could not serve; effective_budget() rejects them).
std::int64_t print_budget_line(const char* label, const std::vector<std::int64_t>& pads,
                               std::int64_t budget, std::int64_t window) {
  std::int64_t min_budget = budget, sum = 0, starved = 0;
  for (std::int64_t pad : pads) {
    const std::int64_t b = budget - pad;
    min_budget = std::min(min_budget, b);
    sum += b;
    starved += b <= window ? 1 : 0;
  }
  std::printf("  %-22s min %lld, mean %.1f, requests with B' <= W: %lld of %zu\n", label,
              static_cast<long long>(min_budget), static_cast<double>(sum) / pads.size(),
              static_cast<long long>(starved), pads.size());
  return min_budget;
}

int run_group(const std::vector<std::string>& argv) {
  for (const std::string& a : argv) {
    if (a == "--help" || a == "-h") {
      print_help();
      return 0;
    }
  }
  const Args args(argv, {"lengths", "batch-size", "budget", "window", "show-groups"});
  const std::string path = args.required("lengths");
  KVSIFT_CHECK(args.has("batch-size"), "missing required flag --batch-size");
  const long batch_size = args.integer("batch-size", 0);
  const long show = args.integer("show-groups", kDefaultShowGroups);
  const long window = args.integer("window", kDefaultWindow);
  KVSIFT_CHECK(show >= 0, "--show-groups must be >= 0, got ", show);
  KVSIFT_CHECK(window >= 0, "--window must be >= 0, got ", window);
  const bool has_budget = args.has("budget");
  const long budget = args.integer("budget", 0);
  KVSIFT_CHECK(!has_budget || budget > window, "--budget (", budget, ") must exceed --window (",
               window, ")");

  const std::vector<std::int64_t> lengths = read_prefill_lengths(path);
  const BatchGrouper grouper(BatchGrouperConfig{batch_size, true});
  const BatchGroups g = grouper.group(lengths);
  const BatchGroups unsorted = BatchGrouper(BatchGrouperConfig{batch_size, false}).group(lengths);

  const std::size_t n = lengths.size();
  std::printf("kvsift group: %s\n", path.c_str());
  std::printf("  requests               %zu\n", n);
  std::printf("  batch size             %ld (%zu batches, the last holds %zu)\n", batch_size,
              g.batches.size(), g.batches.back().size());
  std::printf("  real tokens            %s\n", with_commas(g.real_tokens).c_str());
  std::printf("  padding before         %s (%.1f%% of real; batches in file order)\n",
              with_commas(g.padding_unsorted).c_str(), 100.0 * g.padding_unsorted / g.real_tokens);
  std::printf("  padding after          %s (%.1f%% of real; sorted by prefill length)\n",
              with_commas(g.padding_sorted).c_str(), 100.0 * g.padding_sorted / g.real_tokens);
  if (g.padding_sorted > 0) {
    std::printf("  reduction              %.2fx\n",
                static_cast<double>(g.padding_unsorted) / g.padding_sorted);
  } else {
    std::printf("  reduction              no padding left after grouping\n");
  }

  const std::size_t listed =
      std::min<std::size_t>(static_cast<std::size_t>(show), g.batches.size());
  if (listed > 0) std::printf("first %zu batches after grouping:\n", listed);
  for (std::size_t b = 0; b < listed; ++b) {
    std::vector<std::int64_t> lens, pads;
    for (std::int64_t p : g.batches[b]) {
      lens.push_back(lengths[p]);
      pads.push_back(g.pad[p]);
    }
    std::int64_t pad_sum = 0;
    for (std::int64_t pad : pads) pad_sum += pad;
    std::printf("  batch %zu: %zu requests, max %lld, padding %lld\n", b, lens.size(),
                static_cast<long long>(lens.back()), static_cast<long long>(pad_sum));
    std::printf("    lengths %s\n    pads    %s\n", list_of(lens).c_str(), list_of(pads).c_str());
  }

  if (has_budget) {
    std::printf("effective budget B' = B - pad (B = %ld, W = %ld, pads force-kept):\n", budget,
                window);
    const std::int64_t min_before =
        print_budget_line("before grouping", unsorted.pad, budget, window);
    const std::int64_t min_after = print_budget_line("after grouping", g.pad, budget, window);
    if (std::min(min_before, min_after) < 0) {
      std::printf("  (B' < 0: the pads alone exceed the budget; the default mode excludes pads)\n");
    }
  }
  return 0;
}

const RegisterCommand reg{
    {"group", "batch grouping by prefill length: padding before/after", &run_group}};

}  // namespace
}  // namespace kvsift::tool
