// Choosing a policy at run time by name, as an engine reads it from its config.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/policy/policy.hpp"

namespace kvsift {

// The knobs shared by the baselines (docs/algorithms.md §4 defaults). Each policy maps them onto its
// own validated XxxConfig; policy-specific settings are set on those configs directly.
struct PolicyOptions {
  int budget = 1024;        // tokens kept per (sequence, KV head) after a compression
  int window = 8;           // observation window W (always kept)
  int buffer = 128;         // decode steps between compressions once the budget is reached
  int kernel = 7;           // pooling kernel of the window importance
  float mix_lambda = 0.1f;  // R-KV λ: importance vs redundancy
  float threshold = 0.5f;   // R-KV redundancy cosine threshold
  int sink = 4;             // StreamingLLM sink tokens
  // SkipKV: width of the final-norm last-layer hidden states the host will pass to
  // SkipKV::observe(). 0 (default): segmentation only — no sentence embeddings, so no redundancy
  // marks and SkipKV's plans are R-KV's plus its sentence bookkeeping.
  std::int64_t hidden_size = 0;
};

// Known names: "fullkv", "streaming", "h2o", "snapkv", "rkv", "skipkv". Throws kvsift::Error naming
// the unknown name and listing the known ones.
// "skipkv" is a kvsift::SkipKV (skipkv.hpp) with batch = 0 (sized from the sequences it observes
// before its first select()), any layer count, R1-Distill-Qwen sentence ids, τ and steering at
// their defaults, no steering vector, and hidden_size from the options. Unlike the others it must
// observe() every token of every sequence before select() (dynamic_cast to SkipKV to reach it).
std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyOptions& options);
std::vector<std::string> policy_names();

}  // namespace kvsift
