// ThinKV's config (docs/algorithms.md §3, defaults §4), Eigen-free: the pipeline's (ThinKVConfig,
// validate() and the pieces' configs defined in src/thinkv.cpp) and the registry's batched one
// (ThinKVPolicyConfig). The pieces' config types are declared here and defined with the pieces.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/paged/block_codec.hpp"
#include "kvsift/paged/refill_rule.hpp"

namespace kvsift {

struct ThoughtClassifierConfig;
struct SegmentEvictorConfig;
struct ThoughtBlockTableConfig;

struct ThinKVConfig {
  // Model geometry. Defaults: DeepSeek-R1-Distill-Qwen-7B (28 layers, 28 query heads, 4 KV heads).
  int num_layers = 28;
  int kv_heads = 4;
  int q_heads = 28;    // a multiple of kv_heads (grouped-query attention)
  int head_dim = 128;  // a multiple of 16 (quantization groups, §3.2)

  int budget = 1024;  // k: tokens per (layer, KV head), prompt included, above which Rule 2 runs
  int refresh = 128;  // τ: decode steps per thought label = tokens per segment (§4)

  // Thresholds θ1 < θ2 and the calibrated layers L*: model-specific, no defaults. Run
  // `kvsift calibrate` and copy its output here (docs/thinkv.md §3).
  float theta1 = std::numeric_limits<float>::quiet_NaN();
  float theta2 = std::numeric_limits<float>::quiet_NaN();
  std::vector<int> calibrated_layers;  // L*, each in [0, num_layers)

  std::vector<int> schedule{64, 32, 16, 8, 4};  // R: tokens kept after the n-th demotion (§4)
  bool evict_prompt = false;                    // the prompt (segment 0) is protected (§3.3)
  int kmeans_iterations = 10;                   // Lloyd iterations at most (§3.3)

  // Continuous Thinking block table (§3.4) and TBQ precision per type (§3.2, default R4 E4 T2).
  int block_size = 32;     // slots per block: a multiple of 16 in [16, 256]
  int pool_blocks = 1024;  // blocks per layer's pool
  BlockFormat reasoning = BlockFormat::nvfp4;
  BlockFormat execution = BlockFormat::nvfp4;
  BlockFormat transition = BlockFormat::ternary;
  // NVFP4 global factor g per (layer, KV head): empty = 1 everywhere, else [num_layers, kv_heads].
  std::vector<float> global_factors;
  // Dtype of the tables' 16-bit staging of not yet quantized tokens (§3.4): bf16 or f16.
  DType staging = DType::bf16;
  // Refill of quantized blocks (paged/refill_rule.hpp): run (default, §3.4) or the regroup
  // experiment (docs/thinkv.md §6), which re-quantizes a partly evicted group only when it has at
  // least regroup_min_free (1..15) free slots.
  RefillRule refill = RefillRule::run;
  int regroup_min_free = 8;

  // Throws kvsift::Error naming the field and its value.
  void validate() const;

  // The pieces' own configs, derived from this one.
  ThoughtClassifierConfig classifier_config() const;
  SegmentEvictorConfig evictor_config() const;
  ThoughtBlockTableConfig table_config(int layer) const;
};

// ThinKV's registry config: the pipeline's config plus the batch it serves.
struct ThinKVPolicyConfig {
  std::int64_t batch = 1;  // sequences, one ThinKV pipeline each
  ThinKVConfig pipeline;

  void validate() const {
    KVSIFT_CHECK(batch >= 1, "ThinKVPolicyConfig: batch must be >= 1, got ", batch);
    pipeline.validate();
  }
};

}  // namespace kvsift
