// ThinKV: the whole pipeline of docs/algorithms.md §3 for one sequence, driven step by step by a
// host (the engine). It wires together
//  - the thought classifier (§3.1): per-step attention sparsity of the calibrated layers L*, one
//    R/E/T label per τ = 128-step refresh interval (policy/thinkv/thought_classifier.hpp);
//  - Think Before you Quantize (§3.2): each layer's ThoughtBlockTable stores a token at the
//    precision of its thought type (R4 E4 T2 by default; paged/block_codec.hpp);
//  - Think Before you Evict (§3.3): the SegmentEvictor's Rule 1 / Rule 2 demotions, each applied
//    per (layer, KV head) by k-means on the segment's resident keys
//    (policy/thinkv/segment_evictor.hpp);
//  - Continuous Thinking (§3.4): eviction only sets bits in the table; nothing is gathered.
//
// One ThinKV object serves one sequence and owns one ThoughtBlockTable per layer (each with its
// own pool of `pool_blocks` blocks). A batch is a vector of ThinKV objects, one per sequence: TBE's
// decisions are per sequence anyway, and no state is shared between sequences (our choice: the
// simplest object an engine can drive; docs/thinkv.md, "The ThinKV pipeline").
//
// Driving it (every tensor is host fp32, post-RoPE keys as engines store them):
//   ThinKV kv(config);                              // validates the config
//   for each layer: kv.prefill(layer, K, V, n);     // the prompt: segment 0, protected
//   each decode step:
//     for each layer: kv.append(layer, k, v);       // the step's new token, typed by label()
//                     kv.attention(layer, q, out);  // optional: paged decode attention
//                     kv.observe_query(layer, q);   // on L* layers (or observe_attention /
//                                                   //   observe_sparsity)
//     kv.end_step();                                // classify, Rule 1 / 2, soft evictions
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "kvsift/backend/cpu/kmeans_select.hpp"
#include "kvsift/config/thinkv_config.hpp"
#include "kvsift/config/thought_type.hpp"
#include "kvsift/paged/block_codec.hpp"
#include "kvsift/paged/thought_block_table.hpp"
#include "kvsift/policy/thinkv/segment_evictor.hpp"
#include "kvsift/policy/thinkv/thinkv_schedule.hpp"
#include "kvsift/policy/thinkv/thought_classifier.hpp"

namespace kvsift {

class ThinKV {
 public:
  explicit ThinKV(ThinKVConfig config);

  const ThinKVConfig& config() const { return config_; }

  // --- prompt ----------------------------------------------------------------------------------
  // Appends `n` prompt tokens of one layer to segment 0 (may be called in chunks). Only before the
  // first decode append; every layer must end up with the same prompt length.
  void prefill(int layer,
               const float* keys,    // [n, kv_heads, head_dim] post-RoPE
               const float* values,  // [n, kv_heads, head_dim]
               std::int64_t n);

  // --- one decode step -------------------------------------------------------------------------
  // The step's new token of one layer, written into that layer's table with the current label
  // (a new segment opens at every refresh boundary). Each layer exactly once per step.
  void append(int layer,
              const float* key,     // [kv_heads, head_dim] post-RoPE
              const float* value);  // [kv_heads, head_dim]

  // Whether `layer` is in L*: only those layers' sparsities are needed.
  bool needs_sparsity(int layer) const;
  // The step's attention sparsity of one layer (§3.1), three ways; each returns false (and does
  // nothing) for a layer outside L*. Every L* layer must be reported once per step.
  //  - the host already knows it (a number in [0, 1]);
  bool observe_sparsity(int layer, float sparsity);
  //  - from the step's attention rows: probs [q_heads, n] (any non-negative weights; n = the
  //    keys the host attended to), averaged over query heads;
  bool observe_attention(int layer, const float* probs, std::int64_t n);
  //  - from the step's post-RoPE query against this layer's resident keys as stored (dequantized),
  //    logits q·k/sqrt(D). Call it after append() so the new token is among the keys.
  bool observe_query(int layer, const float* query);  // query: [q_heads, head_dim]

  // Closes the step (every layer appended, every L* layer observed): advances the classifier,
  // runs TBE (Rule 1 at a new T segment, Rule 2 over budget) and applies each demotion to every
  // (layer, KV head) as eviction bits: k-means survivors of the segment's resident keys
  // (segment_keys → segment_eviction_marks → evict_positions). No data moves. Returns what TBE did.
  EvictionStep end_step();

  // --- attention -------------------------------------------------------------------------------
  // Paged decode attention over the layer's resident tokens (softmax scale 1/sqrt(head_dim)).
  void attention(int layer,
                 const float* query,  // [q_heads, head_dim] post-RoPE
                 float* out) const;   // [q_heads, head_dim]

  // --- state -----------------------------------------------------------------------------------
  ThoughtType label() const { return schedule_.label(); }   // type of the next decode token
  std::int64_t steps() const { return schedule_.steps(); }  // decode steps ended
  std::int32_t length() const;  // tokens appended so far (prompt + decode), as FullKV holds them
  // Segments as TBE sees them (segment i = table segment i of every layer); the prompt only
  // before the first decode step.
  std::vector<Segment> segments() const;
  std::int32_t resident_tokens() const;  // per (layer, KV head): the same in all of them
  const ThoughtClassifier& classifier() const { return schedule_.classifier(); }
  const ThoughtBlockTable& table(int layer) const;
  std::int32_t sequence_id() const { return seq_; }  // the sequence id inside every table

  // Memory: the tables' bytes summed over layers (codes, scales, metadata, staging), an fp16
  // FullKV of the same tokens (K and V, 2 bytes per element), and the ratio of the two.
  TableBytes resident_bytes() const;
  std::int64_t fullkv_fp16_bytes() const;
  double resident_fraction() const;

  // (layer, step) pairs with some eviction (ThinKV reports ≈5%).
  const EvictionCounter& eviction_counter() const { return schedule_.eviction_counter(); }
  double eviction_fraction() const { return eviction_counter().fraction(); }

 private:
  void check_layer(int layer, const char* fn) const;
  void start_decode();
  void apply_change(const SegmentChange& change);

  ThinKVConfig config_;
  ThinKVSchedule schedule_;                // classifier, TBE, per-step bookkeeping
  std::vector<ThoughtBlockTable> tables_;  // [num_layers]
  std::int32_t seq_ = 0;
  KMeansSelectConfig kmeans_;
};

}  // namespace kvsift
