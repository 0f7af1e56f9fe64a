// SkipKV's adaptive steering config (docs/algorithms.md §2.5), shared by the CPU controller and
// the CUDA update.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift {

struct SteeringConfig {
  int layer = 20;        // R1-Qwen-7B and R1-Llama-8B: 20; R1-Qwen-14B: 35
  float alpha0 = 1.25f;  // α0 (the paper's runs use 1.0 or 1.25)
  float gamma = 0.02f;   // γ: strength added per check sentence
  // Token ids of "<think>" and "</think>" (R1-Distill-Qwen vocabulary by default).
  std::vector<std::int32_t> think_start = {151648};
  std::vector<std::int32_t> think_end = {151649};
  // Ids of tokens that contain "\n\n" (thought boundaries): the "\n\n"-ending sentence
  // delimiters "\n\n" ".\n\n" ")\n\n" "?\n\n" of shared/data/README.md.
  std::vector<std::int32_t> boundary = {271, 382, 692, 1939};

  static SteeringConfig r1_qwen_7b() { return SteeringConfig{}; }
  static SteeringConfig r1_qwen_14b() {
    SteeringConfig c;
    c.layer = 35;
    return c;
  }
  // The think-tag ids are the added tokens of DeepSeek-R1-Distill-Llama-8B's tokenizer.
  static SteeringConfig r1_llama_8b() {
    SteeringConfig c;
    c.think_start = {128013};
    c.think_end = {128014};
    c.boundary = {271, 382, 696, 1980};
    return c;
  }

  void validate() const {
    KVSIFT_CHECK(layer >= 0, "SteeringConfig: layer (", layer, ") must be >= 0");
    KVSIFT_CHECK(std::isfinite(alpha0) && std::isfinite(gamma), "SteeringConfig: alpha0 (", alpha0,
                 ") and gamma (", gamma, ") must be finite");
    KVSIFT_CHECK(!think_start.empty() && !think_end.empty(),
                 "SteeringConfig: think_start and think_end ids must be given (",
                 think_start.size(), " and ", think_end.size(), " ids)");
    KVSIFT_CHECK(!boundary.empty(),
                 "SteeringConfig: boundary (the ids of tokens containing "
                 "\"\\n\\n\") is empty, so steering would never apply");
    for (std::int32_t id : think_start) {
      KVSIFT_CHECK(std::find(think_end.begin(), think_end.end(), id) == think_end.end(),
                   "SteeringConfig: token id ", id, " is both think_start and think_end");
    }
  }
};

}  // namespace kvsift
