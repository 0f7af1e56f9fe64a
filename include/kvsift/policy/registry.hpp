// Choosing a policy at run time by name, as an engine reads it from its config.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/policy/policy.hpp"

namespace kvsift {

// The knobs shared by the baselines (ALGORITHMS.md §4 defaults). Each policy maps them onto its
// own validated XxxConfig; policy-specific settings are set on those configs directly.
struct PolicyOptions {
  int budget = 1024;         // tokens kept per (sequence, KV head) after a compression
  int window = 8;            // observation window W (always kept)
  int buffer = 128;          // decode steps between compressions once the budget is reached
  int kernel = 7;            // pooling kernel of the window importance
  float mix_lambda = 0.1f;   // R-KV λ: importance vs redundancy
  float threshold = 0.5f;    // R-KV redundancy cosine threshold
  int sink = 4;              // StreamingLLM sink tokens
};

// Known names: "fullkv", "streaming", "h2o", "snapkv", "rkv". Throws kvsift::Error naming the
// unknown name and listing the known ones.
std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyOptions& options);
std::vector<std::string> policy_names();

}  // namespace kvsift
