// KIVI's config (docs/algorithms.md §5.1). Eigen-free.
#pragma once

#include <cstdint>

#include "kvsift/core/error.hpp"

namespace kvsift {

struct KiviConfig {
  int k_bits = 2;  // 2, 4 (8 accepted: 4 codes per int32 word)
  int v_bits = 2;
  int group_size = 32;        // G: tokens per key group, channels per value group
  int residual_length = 128;  // R: full-precision key buffer / value window

  void validate() const {
    KVSIFT_CHECK(k_bits == 2 || k_bits == 4 || k_bits == 8,
                 "KiviConfig: k_bits must be 2, 4 or 8, got ", k_bits);
    KVSIFT_CHECK(v_bits == 2 || v_bits == 4 || v_bits == 8,
                 "KiviConfig: v_bits must be 2, 4 or 8, got ", v_bits);
    // A group fills whole int32 words (32 / bits codes each), as the reference's packing requires.
    KVSIFT_CHECK(
        group_size >= 1 && group_size % (32 / k_bits) == 0 && group_size % (32 / v_bits) == 0,
        "KiviConfig: group_size (", group_size, ") must be a positive multiple of 32 / bits (",
        32 / k_bits, " for k_bits, ", 32 / v_bits, " for v_bits)");
    KVSIFT_CHECK(residual_length >= 1 && residual_length % group_size == 0,
                 "KiviConfig: residual_length (", residual_length,
                 ") must be a positive multiple of group_size (", group_size, ")");
  }
};

// KIVI behind the cache-owning interface (policy/quantizers/kivi_policy.hpp): the model's geometry
// (defaults: DeepSeek-R1-Distill-Qwen-7B, as ThinKV's) and one KiviConfig for every layer.
struct KiviPolicyConfig {
  std::int64_t batch = 1;
  int num_layers = 28;
  int kv_heads = 4;
  int q_heads = 28;  // a multiple of kv_heads (grouped-query attention)
  int head_dim = 128;
  KiviConfig kivi;

  void validate() const {
    KVSIFT_CHECK(batch >= 1 && batch <= (std::int64_t{1} << 30),
                 "KiviPolicyConfig: batch must be in [1, 2^30], got ", batch);
    KVSIFT_CHECK(num_layers >= 1, "KiviPolicyConfig: num_layers must be >= 1, got ", num_layers);
    KVSIFT_CHECK(kv_heads >= 1, "KiviPolicyConfig: kv_heads must be >= 1, got ", kv_heads);
    KVSIFT_CHECK(q_heads >= 1 && q_heads % kv_heads == 0, "KiviPolicyConfig: q_heads (", q_heads,
                 ") must be a positive multiple of kv_heads (", kv_heads, ")");
    kivi.validate();
    KVSIFT_CHECK(head_dim >= 1 && head_dim % kivi.group_size == 0, "KiviPolicyConfig: head_dim (",
                 head_dim, ") must be a positive multiple of group_size (", kivi.group_size, ")");
  }
};

}  // namespace kvsift
