// A plain-text table with aligned columns: the first column left-aligned (names), the others
// right-aligned (numbers), cells joined by " | " and a dashed rule under the header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "demo_metrics.hpp"
#include "demo_runner.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::demo {

class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header) : header_(std::move(header)) {}

  void add_row(std::vector<std::string> row) {
    KVSIFT_CHECK(row.size() == header_.size(), "TextTable: row has ", row.size(), " cells, header ",
                 header_.size());
    rows_.push_back(std::move(row));
  }

  void print(std::ostream& os) const {
    std::vector<std::size_t> width(header_.size());
    for (std::size_t c = 0; c < header_.size(); ++c) {
      width[c] = header_[c].size();
      for (const auto& r : rows_) width[c] = std::max(width[c], r[c].size());
    }
    const auto line = [&](const std::vector<std::string>& cells) {
      for (std::size_t c = 0; c < cells.size(); ++c) {
        const std::string pad(width[c] - cells[c].size(), ' ');
        if (c) os << " | ";
        os << (c == 0 ? cells[c] + pad : pad + cells[c]);
      }
      os << '\n';
    };
    line(header_);
    for (std::size_t c = 0; c < width.size(); ++c)
      os << (c ? "-+-" : "") << std::string(width[c], '-');
    os << '\n';
    for (const auto& r : rows_) line(r);
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// Greedy word wrap at `width` columns; a word longer than the width gets a line of its own.
inline std::string wrap_text(const std::string& text, std::size_t width) {
  std::istringstream words(text);
  std::string word, out, line;
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += line + '\n';
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  return out + line + '\n';
}

inline std::string format_fixed(double v, int decimals) {
  if (std::isnan(v)) return "-";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// "12.3% / 87.7%": shares of evicted tokens that left as whole sentences and as fragments.
inline std::string eviction_split(const EvictionShape& e) {
  const double n = static_cast<double>(e.evicted());
  return format_fixed(100.0 * static_cast<double>(e.whole_sentence_tokens) / n, 1) + "% / " +
         format_fixed(100.0 * static_cast<double>(e.fragment_tokens) / n, 1) + "%";
}

// The demo's table: one row per policy, plus any columns the policies' adapters add.
inline TextTable demo_table(const DemoResult& result, int recall_k) {
  std::vector<std::string> header = {"policy",
                                     "resident KV",
                                     "% FullKV",
                                     "peak KV",
                                     "compressions",
                                     "evicting layer-steps",
                                     "ms/compression",
                                     "recall@" + std::to_string(recall_k),
                                     "evicted as whole sentences / fragments"};
  std::vector<std::string> extras;  // union of the adapters' extra headers, first-seen order
  for (const auto& p : result.policies) {
    for (const auto& kv : p.extra_columns) {
      if (std::find(extras.begin(), extras.end(), kv.first) == extras.end())
        extras.push_back(kv.first);
    }
  }
  header.insert(header.end(), extras.begin(), extras.end());
  TextTable table(header);
  for (const auto& p : result.policies) {
    const double share = result.full_bytes ? 100.0 * static_cast<double>(p.end_bytes) /
                                                 static_cast<double>(result.full_bytes)
                                           : 0.0;
    const std::int64_t evicted = p.evictions.evicted();
    std::vector<std::string> row = {
        p.name,
        format_bytes(static_cast<double>(p.end_bytes)),
        format_fixed(share, 1) + "%",
        format_bytes(static_cast<double>(p.peak_bytes)),
        std::to_string(p.compressions),
        p.layer_steps ? format_fixed(100.0 * p.evictions_per_layer_step(), 2) + "%" : "-",
        format_fixed(p.ms_per_compression(), 3),
        format_fixed(p.recall(), 3),
        evicted ? eviction_split(p.evictions) : "-"};
    for (const auto& h : extras) {
      std::string cell = "-";
      for (const auto& kv : p.extra_columns) {
        if (kv.first == h) cell = kv.second;
      }
      row.push_back(cell);
    }
    table.add_row(std::move(row));
  }
  return table;
}

}  // namespace kvsift::demo
