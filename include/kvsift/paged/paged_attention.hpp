// CPU reference decode attention over a ThoughtBlockTable (docs/algorithms.md §3.4): one query
// token attends to every live slot of its sequence's blocks, block by block, each block dequantized
// by its own format (its thought type's precision). Evicted-but-not-yet-overwritten slots are
// masked out by the eviction bitmask; tokens still in the staging buffer (§3.4) are read at 16 bits
// alongside the blocks. RoPE is already applied to the stored keys, so the result does not
// depend on where tokens sit: it equals dense attention over the retained tokens in any order.
// Softmax runs online (running max and sum, as FlashAttention does), so no gathered copy of the
// sequence is ever built; scratch is one block of one head.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/paged/thought_block_table.hpp"

namespace kvsift {

// Grouped-query attention: query head q reads KV head q / (q_heads / kv_heads). A KV head with no
// live token gives zero outputs for its query heads (our choice; TBE's floor of 4 tokens per
// segment keeps this from happening in practice).
inline void paged_decode_attention(const ThoughtBlockTable& table, std::int32_t seq,
                                   const float* query,  // [q_heads, head_dim]
                                   std::int64_t q_heads, std::int64_t head_dim, float softmax_scale,
                                   float* out) {  // [q_heads, head_dim]
  const ThoughtBlockTableConfig& cfg = table.config();
  KVSIFT_CHECK(table.has_sequence(seq), "paged_decode_attention: unknown sequence ", seq);
  KVSIFT_CHECK(head_dim == cfg.head_dim, "paged_decode_attention: query head_dim (", head_dim,
               ") differs from the table's head_dim (", cfg.head_dim, ")");
  KVSIFT_CHECK(q_heads > 0 && q_heads % cfg.kv_heads == 0, "paged_decode_attention: q_heads (",
               q_heads, ") must be a positive multiple of kv_heads (", cfg.kv_heads, ")");
  KVSIFT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0.0f,
               "paged_decode_attention: softmax_scale (", softmax_scale,
               ") must be finite and > 0");
  KVSIFT_CHECK(query != nullptr && out != nullptr,
               "paged_decode_attention: query and out must not be null");
  const std::int64_t group = q_heads / cfg.kv_heads;
  const std::int64_t S = cfg.block_size, D = head_dim;
  std::vector<float> keys(static_cast<std::size_t>(S * D)), values(keys.size());
  std::vector<float> running_max(static_cast<std::size_t>(group));
  std::vector<float> running_sum(static_cast<std::size_t>(group));
  std::vector<float> acc(static_cast<std::size_t>(group * D));
  std::vector<float> staged_keys, staged_values;
  // One live token (key k, value v: [D]) into the online softmax of KV head h's query heads.
  auto attend = [&](std::int64_t h, const float* k, const float* v) {
    for (std::int64_t g = 0; g < group; ++g) {
      const float* q = query + (h * group + g) * D;
      float dot = 0.0f;
      for (std::int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
      const float logit = dot * softmax_scale;
      float* a = &acc[static_cast<std::size_t>(g * D)];
      if (logit > running_max[g]) {
        // New maximum: rescale what was accumulated under the old one.
        const float rescale = std::exp(running_max[g] - logit);
        running_sum[g] *= rescale;
        for (std::int64_t d = 0; d < D; ++d) a[d] *= rescale;
        running_max[g] = logit;
      }
      const float weight = std::exp(logit - running_max[g]);
      running_sum[g] += weight;
      for (std::int64_t d = 0; d < D; ++d) a[d] += weight * v[d];
    }
  };
  const std::int32_t blocks = table.num_blocks(seq);
  for (std::int32_t h = 0; h < cfg.kv_heads; ++h) {
    std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(running_sum.begin(), running_sum.end(), 0.0f);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int32_t b = 0; b < blocks; ++b) {
      const std::uint64_t* free = table.free_mask(seq, b, h);
      bool any_live = false;
      for (std::int32_t w = 0; w < table.mask_words(); ++w) {
        const std::int64_t bits_in_word = std::min<std::int64_t>(64, S - 64 * w);
        const std::uint64_t all =
            bits_in_word == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits_in_word) - 1;
        any_live = any_live || (free[w] & all) != all;
      }
      if (!any_live) continue;
      table.dequantize_block(seq, b, h, keys.data(), values.data());
      for (std::int64_t slot = 0; slot < S; ++slot) {
        if ((free[slot / 64] >> (slot % 64)) & 1u) continue;  // evicted or never written
        attend(h, &keys[static_cast<std::size_t>(slot * D)],
               &values[static_cast<std::size_t>(slot * D)]);
      }
    }
    table.staged_rows(seq, h, staged_keys, staged_values);
    const std::size_t row = static_cast<std::size_t>(D);
    for (std::size_t i = 0; i < staged_keys.size() / row; ++i)
      attend(h, &staged_keys[i * row], &staged_values[i * row]);
    for (std::int64_t g = 0; g < group; ++g) {
      float* o = out + (h * group + g) * D;
      const float* a = &acc[static_cast<std::size_t>(g * D)];
      const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
      for (std::int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
    }
  }
}

}  // namespace kvsift
