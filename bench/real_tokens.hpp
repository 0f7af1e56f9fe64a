// Real R1-Qwen token ids for the SkipKV benchmarks: the MATH-500 prompts and solutions of
// ../shared/data (math500_r1qwen_tokens.tsv) back to back, so sentence lengths are real. Empty
// when the data directory has no such file; each benchmark says what it uses instead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kvsift::bench {

inline std::vector<std::int32_t> read_math500_r1qwen_tokens() {
  std::vector<std::int32_t> ids;
  std::ifstream in(std::string(KVSIFT_DATA_DIR) + "/math500_r1qwen_tokens.tsv");
  std::string line;
  while (std::getline(in, line)) {
    std::replace(line.begin(), line.end(), '\t', ' ');
    std::istringstream is(line);
    long v;
    while (is >> v) ids.push_back(static_cast<std::int32_t>(v));
  }
  return ids;
}

}  // namespace kvsift::bench
