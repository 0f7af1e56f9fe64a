// PM-KVQ stream configuration (docs/algorithms.md §5.2). Eigen-free; validate() names the field
// and the value of every fault.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift {

// Which reference ordering the stream follows (docs/algorithms.md §5.2):
// real — integer codes stored, the flushed window shrunk to the body width by repeated ERS;
// fake — an fp32 cache whose values are replaced by their dequantization in place, the body
//        re-quantized directly from current values (the paper's accuracy runs).
enum class PmkvqBackend : std::uint8_t { real, fake };

struct PmkvqConfig {
  PmkvqBackend backend = PmkvqBackend::real;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 128;
  std::int64_t group_size = 128;  // channels per quantization group; must divide head_dim
  std::int64_t n_sink = 1;        // full-precision (16-bit) sink tokens
  std::int64_t n_window = 128;  // 16-bit recent window, flushed to the body in blocks of this size
  int n_init_bits = 16;         // body width before any halving
  // Per-layer byte budgets in MiB (2^20 bytes); one entry applies to every layer.
  std::vector<double> kv_budget_mb;
  // true: the reference's rule (codes-only bytes, one halving per update, an error below 2 bits).
  // false (library default): scales and zeros counted, halving repeated until the layer fits, and
  // below 2 bits the oldest body tokens are evicted instead of failing.
  bool reference_exact = false;

  void validate() const {
    KVSIFT_CHECK(kv_heads > 0, "PmkvqConfig.kv_heads must be > 0, got ", kv_heads);
    KVSIFT_CHECK(head_dim > 0, "PmkvqConfig.head_dim must be > 0, got ", head_dim);
    KVSIFT_CHECK(group_size > 0 && head_dim % group_size == 0,
                 "PmkvqConfig.group_size must be > 0 and divide head_dim (", head_dim, "), got ",
                 group_size);
    KVSIFT_CHECK(n_sink >= 0, "PmkvqConfig.n_sink must be >= 0, got ", n_sink);
    KVSIFT_CHECK(n_window > 0, "PmkvqConfig.n_window must be > 0, got ", n_window);
    KVSIFT_CHECK(n_init_bits == 16 || n_init_bits == 8 || n_init_bits == 4 || n_init_bits == 2,
                 "PmkvqConfig.n_init_bits must be 16, 8, 4 or 2, got ", n_init_bits);
    KVSIFT_CHECK(!kv_budget_mb.empty(), "PmkvqConfig.kv_budget_mb must hold at least one budget");
    for (std::size_t i = 0; i < kv_budget_mb.size(); ++i)
      KVSIFT_CHECK(std::isfinite(kv_budget_mb[i]) && kv_budget_mb[i] > 0,
                   "PmkvqConfig.kv_budget_mb[", i, "] must be finite and > 0, got ",
                   kv_budget_mb[i]);
  }

  // Byte budget of one layer: budget·2^20, as the reference compares it.
  double budget_bytes(std::int64_t layer) const {
    KVSIFT_CHECK(layer >= 0, "PmkvqConfig.budget_bytes: layer must be >= 0, got ", layer);
    if (kv_budget_mb.size() == 1) return kv_budget_mb[0] * 1048576.0;
    KVSIFT_CHECK(static_cast<std::size_t>(layer) < kv_budget_mb.size(),
                 "PmkvqConfig.budget_bytes: layer ", layer, " has no budget (kv_budget_mb holds ",
                 kv_budget_mb.size(), ")");
    return kv_budget_mb[static_cast<std::size_t>(layer)] * 1048576.0;
  }
};

// PM-KVQ behind the cache-owning interface (policy/quantizers/pmkvq_policy.hpp): one stream per
// (layer, sequence), each with its layer's budget (the reference runs one sequence). The stream
// config carries kv_heads and head_dim; this adds the rest of the geometry (defaults:
// DeepSeek-R1-Distill-Qwen-7B). kv_budget_mb has no default: the offline sensitivity allocation
// (out of scope) produces it, one entry for every layer or one per layer.
struct PmkvqPolicyConfig {
  std::int64_t batch = 1;
  int num_layers = 28;
  int q_heads = 28;  // a multiple of pmkvq.kv_heads
  PmkvqConfig pmkvq = [] {
    PmkvqConfig c;
    c.kv_heads = 4;
    return c;
  }();

  void validate() const {
    KVSIFT_CHECK(batch >= 1, "PmkvqPolicyConfig: batch must be >= 1, got ", batch);
    KVSIFT_CHECK(num_layers >= 1, "PmkvqPolicyConfig: num_layers must be >= 1, got ", num_layers);
    pmkvq.validate();
    KVSIFT_CHECK(q_heads >= 1 && q_heads % pmkvq.kv_heads == 0, "PmkvqPolicyConfig: q_heads (",
                 q_heads, ") must be a positive multiple of kv_heads (", pmkvq.kv_heads, ")");
    KVSIFT_CHECK(pmkvq.kv_budget_mb.size() == 1 ||
                     pmkvq.kv_budget_mb.size() == static_cast<std::size_t>(num_layers),
                 "PmkvqPolicyConfig: kv_budget_mb holds ", pmkvq.kv_budget_mb.size(),
                 " budgets; give one for every layer or one per layer (num_layers = ", num_layers,
                 ")");
  }
};

}  // namespace kvsift
