// SkipKV: the whole pipeline of docs/algorithms.md §2 as one object a host drives per step.
//   observe(Observation)          step level (layer -1): token_ids [batch, n], pad_counts, and
//                                 last_hidden [batch, n, hidden] of every step (prompt and decode)
//   observe(seq, tokens, hidden)  the same for one sequence: sentences, check labels,
//                                 embeddings (§2.1), steering gate (§2.5)
//   should_compress(lengths)      the decode trigger: a sequence reaches budget + buffer (§1.3)
//   select(StepInputs)            per layer: eq. 6 scores with the sentence penalty, top-k plan,
//                                 range bookkeeping before and after eviction (§2.2-2.4)
//   steering_strength(seq)        α = α0 + γ·N_o as of the last refresh (§2.5)
// α and the redundant-sentence marks are refreshed every steering.refresh_steps (128) decode
// steps of a sequence, independent of compression (the reference's divide_length cadence), and
// at every compression trigger.
// It composes SentenceTracker (one per sequence), SegmentTable (one per layer), SentenceScorer
// and, when given a vector, SteeringController; it adds only the orchestration.
//
// Plan bookkeeping (design): select() both returns the plan and records it in the layer's range
// map, on the contract that the host applies it (compact(), or its own page remap) before the
// next token is appended. That cannot desync silently: the pipeline knows how long each layer's
// cache must be — the plan's kept length plus the tokens observed since — and the next select()
// of that layer throws kvsift::Error if the cache holds anything else (a plan not applied, applied
// twice, tokens appended but not observed). Before a layer's first plan the cache must hold every
// observed position, pads included.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/backend/device_backend.hpp"
#include "kvsift/config/skipkv_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/limits.hpp"
#include "kvsift/core/segment_table.hpp"
#include "kvsift/core/step_inputs.hpp"
#include "kvsift/policy/budget_trigger.hpp"
#include "kvsift/policy/device_staging.hpp"
#include "kvsift/policy/policy.hpp"
#include "kvsift/policy/skipkv/sentence_scorer.hpp"
#include "kvsift/policy/skipkv/sentence_tracker.hpp"
#include "kvsift/policy/skipkv/steering.hpp"

namespace kvsift {

class SkipKV final : public Policy {
 public:
  // Without a steering vector: steering_strength() is still reported, apply_steering() does
  // nothing.
  explicit SkipKV(const SkipKVConfig& cfg) : cfg_(validated(cfg)), scorer_(cfg_.scorer) {
    trackers_.assign(static_cast<std::size_t>(cfg_.batch), SentenceTracker(cfg_.sentences));
    checks_at_trigger_.assign(static_cast<std::size_t>(cfg_.batch), 0);
  }
  // The controller tracks a fixed batch, so here cfg.batch must be > 0.
  SkipKV(const SkipKVConfig& cfg, SteeringVector vector) : SkipKV(cfg) {
    KVSIFT_CHECK(cfg_.batch > 0, "SkipKV: steering needs a fixed batch, config batch is ",
                 cfg_.batch);
    steer_.emplace(cfg_.steering, std::move(vector), cfg_.batch);
  }

  std::string_view name() const override { return "skipkv"; }
  const SkipKVConfig& config() const { return cfg_; }
  const SentenceScorer& scorer() const { return scorer_; }

  // ---- every step --------------------------------------------------------------------------

  unsigned needs() const override {
    return kNeedsTokens | (cfg_.sentences.hidden_size > 0 ? kNeedsHidden : kNeedsNothing);
  }

  // The step-level observation (obs.layer == -1; per-layer ones carry nothing SkipKV reads):
  //   obs.token_ids    [batch, n] host, n = obs.num_tokens
  //   obs.pad_counts   [batch] host or nullptr: left pads among the first observation's n tokens
  //                    (ignored on later observations)
  //   obs.last_hidden  [batch, n, hidden_size] (hidden_size > 0), host or device
  //   obs.kv           optional: gives the batch when there are no hidden states and the config's
  //                    batch is 0
  // For every sequence b: add_padding(b, pad_counts[b]) on its first observation, then
  // observe(b, its tokens after the pads, their hidden rows).
  void observe(const Observation& obs) override {
    if (obs.layer >= 0) return;
    KVSIFT_CHECK(obs.num_tokens >= 0 && (obs.num_tokens == 0 || obs.token_ids != nullptr),
                 "SkipKV::observe: token_ids must hold [batch, num_tokens = ", obs.num_tokens,
                 "] ids");
    if (obs.num_tokens == 0) return;
    const bool with_hidden = cfg_.sentences.hidden_size > 0;
    KVSIFT_CHECK(!with_hidden || (obs.last_hidden.data != nullptr && obs.last_hidden.rank == 3 &&
                                  obs.last_hidden.shape[1] == obs.num_tokens &&
                                  obs.last_hidden.shape[2] == cfg_.sentences.hidden_size),
                 "SkipKV::observe: last_hidden must be [batch, num_tokens = ", obs.num_tokens,
                 ", hidden_size = ", cfg_.sentences.hidden_size, "], got ",
                 obs.last_hidden.shape_string(), " (hidden_size > 0 needs hidden states)");
    const std::int64_t rows = with_hidden ? obs.last_hidden.shape[0] : observation_batch(obs);
    KVSIFT_CHECK(obs.batch == 0 || obs.batch == rows, "SkipKV::observe: Observation.batch (",
                 obs.batch, ") != last_hidden rows (", rows, ")");
    HostStaging staging(ExecContext{});
    const TensorView hidden = with_hidden ? staging.tensor(obs.last_hidden) : TensorView{};
    const std::int64_t n = obs.num_tokens;
    for (std::int64_t b = 0; b < rows; ++b) {
      // Pads lead a sequence: pad_counts counts only on its first observation (an engine may
      // pass the same array every step).
      const bool first = b >= batch() || trackers_[b].position() == 0;
      const std::int64_t pads = first && obs.pad_counts != nullptr ? obs.pad_counts[b] : 0;
      KVSIFT_CHECK(pads >= 0 && pads <= n, "SkipKV::observe: pad_counts[", b, "] = ", pads,
                   " outside [0, num_tokens = ", n, "]");
      if (pads > 0) add_padding(b, pads);
      const std::int32_t* tokens = obs.token_ids + b * n + pads;
      if (with_hidden) {
        TensorView row = batch_row(hidden, b);
        row.data = static_cast<char*>(row.data) +
                   static_cast<std::size_t>(pads * row.stride[0]) * dtype_size(row.dtype);
        row.shape[0] = n - pads;
        observe(b, tokens, n - pads, row);
      } else {
        observe(b, tokens, n - pads);
      }
    }
  }

  // Left padding of sequence `seq` (its pad count), before any of its tokens is observed.
  void add_padding(std::int64_t seq, std::int64_t pads) {
    tracker_mut(seq, "add_padding").add_padding(pads);
  }

  // The tokens appended to sequence `seq` this step (prompt or decode), after their K/V are in
  // the cache. `last_hidden`: [n, hidden_size], the final-norm last-layer states of those tokens
  // (f32/f16/bf16 on the CPU, any strides; batch_row() cuts one out of a batched output).
  void observe(std::int64_t seq, const std::int32_t* tokens, std::int64_t n,
               const TensorView& last_hidden) {
    tracker_mut(seq, "observe").observe(tokens, n, last_hidden);
    after_observe(seq, tokens, n);
  }
  // Segmentation only (hidden_size == 0).
  void observe(std::int64_t seq, const std::int32_t* tokens, std::int64_t n) {
    tracker_mut(seq, "observe").observe(tokens, n);
    after_observe(seq, tokens, n);
  }
  void observe(std::int64_t seq, const std::vector<std::int32_t>& tokens) {
    observe(seq, tokens.data(), static_cast<std::int64_t>(tokens.size()));
  }

  // ---- the trigger -------------------------------------------------------------------------

  // `lengths` [n] resident tokens per sequence: true once any reaches budget + buffer.
  bool should_compress(const std::int32_t* lengths, std::int64_t n) const {
    KVSIFT_CHECK(n >= 0 && (n == 0 || lengths != nullptr),
                 "SkipKV::should_compress: bad lengths (n = ", n, ")");
    for (std::int64_t b = 0; b < n; ++b)
      if (lengths[b] >= cfg_.scorer.rkv.budget + cfg_.scorer.rkv.buffer) return true;
    return false;
  }
  bool should_compress(const std::vector<std::int32_t>& lengths) const {
    return should_compress(lengths.data(), static_cast<std::int64_t>(lengths.size()));
  }
  bool should_compress(const KVCacheView& kv) const override {
    return reaches_budget_plus_buffer(kv, cfg_.scorer.rkv.budget, cfg_.scorer.rkv.buffer);
  }

  // ---- per layer ---------------------------------------------------------------------------

  // Plans layer `in.layer` and records the plan in its range map; the host must apply it before
  // appending more tokens (see the header comment). The first select() after new tokens were
  // observed is the trigger: it marks redundant sentences (§2.2) and updates the steering
  // strength (§2.5) once for all layers. Sequences over the budget are compressed whatever the
  // trigger says (prefill compression of a long prompt).
  //   in.kv              [batch, kv_heads, capacity, head_dim]
  //   in.window_queries  [batch, q_heads, window, head_dim]
  using Policy::select;
  KeepPlan select(const StepInputs& in, const ExecContext& ctx) override {
    const KVCacheView& kv = in.kv;
    LayerState& st = prepare_layer(in.layer, kv, ctx);
    const std::int64_t heads = kv.kv_heads();
    SentencePenalties penalties(static_cast<std::size_t>(batch() * heads));
    for (std::int64_t b = 0; b < batch(); ++b)
      for (std::int64_t h = 0; h < heads; ++h)
        penalties[b * heads + h] = st.table.penalty_ranges(0, b, h, trackers_[b].sentences());
    KeepPlan plan =
        kv.device() == Device::cpu || !any_over_budget(kv)
            ? scorer_.select(kv, in.window_queries, penalties)
            : device_backend().skipkv_select(kv, in.window_queries, cfg_.scorer, penalties, ctx);
    // §2.3 after eviction, recorded now on the contract that the host applies the plan.
    st.table.apply_plan(0, plan);
    for (std::int64_t b = 0; b < batch(); ++b) record_plan(st, b, plan.kept_length(b));
    st.planned = true;
    return plan;
  }

  // Device scratch for select() on device views: an upper bound, sized as if every closed
  // sentence of every sequence were a penalty range in every head (the marks are made in select()).
  std::size_t workspace_bytes(const StepInputs& in) const override {
    if (in.kv.device() == Device::cpu) return 0;
    const std::int64_t heads = in.kv.kv_heads();
    SentencePenalties bound(static_cast<std::size_t>(in.kv.batch() * heads));
    for (std::int64_t b = 0; b < in.kv.batch() && b < batch(); ++b)
      for (std::int64_t h = 0; h < heads; ++h)
        bound[b * heads + h].assign(trackers_[b].sentences().size(), PenaltyRange{0, 0, 1.0f});
    return device_backend().skipkv_workspace_bytes(in.kv, in.window_queries, cfg_.scorer, bound);
  }

  // ---- the whole step ----------------------------------------------------------------------

  // Device views whose layers share one mask (or none) and hold equal lengths, at most 128
  // layers: every layer's penalties planned on the host, then every layer selected and compacted
  // on the device in one call with one host wait (DeviceBackend::skipkv_compress_step); the range
  // maps are updated from the kept rows it downloads. Exactly select() + compact() per layer
  // (select() of every layer first), range maps included. Otherwise layer by layer.
  // A sequence with a NaN score in any layer is left untouched in every layer (its range maps
  // record that it kept everything, so the next step stays consistent), the others are
  // compacted, and kvsift::Error names it.
  std::size_t step_workspace_bytes(const KVCacheView* layers, const TensorView* queries,
                                   int n_layers) const override {
    if (!one_device_step(layers, queries, n_layers))
      return Policy::step_workspace_bytes(layers, queries, n_layers);
    // Penalty ranges the step can plan: per (layer, b, h) the ranges mapped now plus the
    // sentences closed since that layer's last append (every closed sentence for a layer not
    // planned yet), whichever of them the trigger marks.
    std::int64_t ranges = 0;
    const std::int64_t heads = layers[0].kv_heads();
    for (int l = 0; l < n_layers; ++l)
      for (std::int64_t b = 0; b < layers[0].batch() && b < batch(); ++b) {
        const std::int64_t closed = trackers_[b].num_sentences();
        const bool known = static_cast<std::size_t>(l) < layers_.size() && layers_[l] &&
                           layers_[l]->table.kv_heads() == heads;
        if (!known) {
          ranges += closed * heads;
          continue;
        }
        const SegmentTable& t = layers_[l]->table;
        const std::int64_t fresh = std::max<std::int64_t>(closed - t.sentences_appended(0, b), 0);
        for (std::int64_t h = 0; h < heads; ++h)
          ranges += static_cast<std::int64_t>(t.ranges(0, b, h).size()) + fresh;
      }
    return device_backend().skipkv_step_workspace_bytes(layers, queries, n_layers, cfg_.scorer,
                                                        ranges);
  }
  void compress_step(const KVCacheView* layers, const TensorView* queries, int n_layers,
                     const ExecContext& ctx) override {
    if (!one_device_step(layers, queries, n_layers))
      return Policy::compress_step(layers, queries, n_layers, ctx);
    // Every layer checked and its ranges appended (§2.3 before eviction) before anything runs.
    for (int l = 0; l < n_layers; ++l) prepare_layer(l, layers[l], ctx);
    // Taken once every layer exists: a new layer's state may move the others.
    std::vector<LayerState*> states(static_cast<std::size_t>(n_layers));
    for (int l = 0; l < n_layers; ++l) states[l] = &layer_state(l);
    const KVCacheView& kv0 = layers[0];
    const std::int64_t heads = kv0.kv_heads(), rows = batch() * heads;
    std::vector<std::int32_t> source(kv0.lengths, kv0.lengths + batch());
    if (!any_over_budget(kv0)) {  // §1.3: nothing moves; every layer keeps everything
      for (int l = 0; l < n_layers; ++l) {
        states[l]->table.apply_rows(0, nullptr, 0, source.data(), source.data());
        for (std::int64_t b = 0; b < batch(); ++b) record_plan(*states[l], b, source[b]);
        states[l]->planned = true;
      }
      return;
    }
    // The penalties of every layer, one flat CSR (buffers reused from step to step).
    StepPenalties& pen = step_penalties_;
    pen.layers = n_layers;
    pen.batch = batch();
    pen.kv_heads = heads;
    pen.indptr.resize(static_cast<std::size_t>(n_layers * rows + 1));
    pen.ranges.clear();
    pen.indptr[0] = 0;
    for (int l = 0; l < n_layers; ++l)
      for (std::int64_t b = 0; b < batch(); ++b)
        for (std::int64_t h = 0; h < heads; ++h) {
          states[l]->table.append_penalty_ranges(0, b, h, trackers_[b].sentences(), pen.ranges);
          pen.indptr[static_cast<std::size_t>(l * rows + b * heads + h + 1)] =
              static_cast<std::int64_t>(pen.ranges.size());
        }
    DeviceBackend::SkipKVStepRows& out = step_rows_;
    device_backend().skipkv_compress_step(layers, queries, n_layers, cfg_.scorer, pen, out, ctx);
    KVSIFT_CHECK(static_cast<std::int64_t>(out.kept.size()) == batch() && out.row_stride > 0 &&
                     out.slots.size() >= static_cast<std::size_t>(n_layers * rows) *
                                             static_cast<std::size_t>(out.row_stride),
                 "SkipKV::compress_step: the backend returned ", out.kept.size(),
                 " kept counts and ", out.slots.size(), " slots for ", n_layers, " layers of ",
                 rows, " rows");
    // §2.3 after eviction. A NaN sequence was left as it was: it kept everything.
    std::vector<std::int32_t> kept(out.kept);
    std::string nan_rows;
    for (std::int64_t b = 0; b < batch(); ++b) {
      if (kept[b] >= 0) continue;
      kept[b] = source[b];
      nan_rows += (nan_rows.empty() ? "" : ", ") + std::to_string(b);
    }
    const std::size_t layer_slots =
        static_cast<std::size_t>(rows) * static_cast<std::size_t>(out.row_stride);
    for (int l = 0; l < n_layers; ++l) {
      states[l]->table.apply_rows(0, out.slots.data() + l * layer_slots, out.row_stride,
                                  kept.data(), source.data());
      for (std::int64_t b = 0; b < batch(); ++b) record_plan(*states[l], b, kept[b]);
      states[l]->planned = true;
    }
    KVSIFT_CHECK(nan_rows.empty(), "SkipKV::compress_step: NaN scores in sequence(s) ", nan_rows,
                 "; those sequences were left untouched in every layer, the others compacted");
  }

  // ---- steering ----------------------------------------------------------------------------

  // α_b = α0 + γ·N_o with N_o the check sentences of `seq` at the last refresh or trigger (α0
  // before any).
  float steering_strength(std::int64_t seq) const {
    check_seq(seq, "steering_strength");
    if (steer_) return steer_->strength(seq);
    return cfg_.steering.alpha0 + cfg_.steering.gamma * static_cast<float>(checks_at_trigger_[seq]);
  }
  // h[b, last] += α_b·v at the steered layer for gated rows (SteeringController::apply);
  // `hidden` [batch, seq, hidden]. Returns the rows steered; 0 without a steering vector.
  std::int64_t apply_steering(int layer, const TensorView& hidden) const {
    return steer_ ? steer_->apply(layer, hidden) : 0;
  }
  bool has_steering_vector() const { return steer_.has_value(); }

  // ---- inspection --------------------------------------------------------------------------

  // "redundant sentences": marked of closed, over all sequences; "alpha (N_o) per sequence":
  // steering_strength(b) and the check sentences it was computed from.
  std::vector<std::pair<std::string, std::string>> summary() const override {
    std::int64_t marked = 0, closed = 0;
    std::string alphas;
    for (std::int64_t b = 0; b < batch(); ++b) {
      marked += trackers_[b].redundant_count();
      closed += trackers_[b].num_sentences();
      char buf[48];
      std::snprintf(buf, sizeof buf, "%.2f (%lld)", steering_strength(b),
                    static_cast<long long>(checks_at_trigger_[b]));
      alphas += (alphas.empty() ? "" : ", ") + std::string(buf);
    }
    return {{"redundant sentences",
             batch() ? std::to_string(marked) + " of " + std::to_string(closed) : "-"},
            {"alpha (N_o) per sequence", alphas.empty() ? "-" : alphas}};
  }

  const SentenceTracker& tracker(std::int64_t seq) const {
    check_seq(seq, "tracker");
    return trackers_[seq];
  }
  // The range map of `layer` (one layer, batch, kv_heads); throws before its first select().
  const SegmentTable& segments(int layer) const {
    KVSIFT_CHECK(layer >= 0 && layer < static_cast<int>(layers_.size()) && layers_[layer],
                 "SkipKV::segments: layer ", layer, " has not been selected yet");
    return layers_[layer]->table;
  }
  std::int64_t triggers() const { return triggers_; }  // compression triggers so far
  // Cadence refreshes (every steering.refresh_steps decode steps) so far, over all sequences.
  std::int64_t refreshes() const { return refreshes_; }
  std::int64_t batch() const { return static_cast<std::int64_t>(trackers_.size()); }

 private:
  struct LayerState {
    SegmentTable table;                           // (1 layer, batch, kv_heads)
    std::vector<std::int64_t> length_after_plan;  // [batch] kept by this layer's last plan
    std::vector<std::int64_t> position_at_plan;   // [batch] tracker position at that plan
    bool planned = false;
  };

  // What select() checks and does before planning layer `layer`: the cache against the recorded
  // plans and observed tokens, the trigger's marks (once per trigger), and the sentences closed
  // since this layer's last eviction appended to its range map (§2.3 before eviction).
  LayerState& prepare_layer(int layer, const KVCacheView& kv, const ExecContext& ctx) {
    kv.validate();
    KVSIFT_CHECK(observed_tokens_ || !any_over_budget(kv),
                 "SkipKV needs observe() with the step's token ids (Observation layer -1: "
                 "token_ids [batch, n], last_hidden [batch, n, hidden]) every step, prompt "
                 "included; layer ",
                 layer, " is over budget but no token was ever observed");
    KVSIFT_CHECK(kv.batch() == batch(), "SkipKV::select: cache batch (", kv.batch(),
                 ") != ", cfg_.batch > 0 ? "config batch (" : "sequences observed (", batch(), ")");
    frozen_ = true;  // the range maps are sized now
    KVSIFT_CHECK(layer >= 0 && layer < (cfg_.layers == 0 ? kMaxLayers : cfg_.layers),
                 "SkipKV::select: layer ", layer, " outside [0, ",
                 cfg_.layers == 0 ? kMaxLayers : cfg_.layers, ")");
    if (kv_heads_ == 0) kv_heads_ = cfg_.kv_heads;
    KVSIFT_CHECK(kv_heads_ == 0 || kv.kv_heads() == kv_heads_, "SkipKV::select: layer ", layer,
                 " cache has ", kv.kv_heads(), " kv heads, expected ", kv_heads_);
    kv_heads_ = kv.kv_heads();
    LayerState& st = layer_state(layer);
    if (kv.device() == Device::cpu) {
      check_lengths(layer, kv, st);
    } else {
      HostStaging staging(ctx);  // the pad mask, for the first plan's pad check
      check_lengths(layer, st.planned ? kv : staging.lengths_and_mask(kv), st);
    }
    if (pending_trigger_) begin_trigger();
    for (std::int64_t b = 0; b < batch(); ++b) {
      const SentenceTracker& t = trackers_[b];
      st.table.append_closed(0, b, t.sentences(), t.position(), kv.length(b));
    }
    return st;
  }

  void record_plan(LayerState& st, std::int64_t b, std::int64_t kept) const {
    st.length_after_plan[b] = kept;
    st.position_at_plan[b] = trackers_[b].position();
  }

  // compress_step's one-call device path applies (see there); the layers' views are checked
  // by the backend.
  bool one_device_step(const KVCacheView* layers, const TensorView* queries, int n_layers) const {
    check_step_args(layers, queries, n_layers);
    if (layers[0].device() == Device::cpu || n_layers > 128) return false;
    if (layers[0].lengths == nullptr || layers[0].batch() != batch()) return false;
    for (int l = 1; l < n_layers; ++l) {
      if (layers[l].valid_mask != layers[0].valid_mask || layers[l].lengths == nullptr ||
          layers[l].batch() != layers[0].batch())
        return false;
      for (std::int64_t b = 0; b < layers[0].batch(); ++b)
        if (layers[l].length(b) != layers[0].length(b)) return false;
    }
    return true;
  }

  static SkipKVConfig validated(const SkipKVConfig& c) {
    c.validate();
    return c;
  }

  void check_seq(std::int64_t seq, const char* fn) const {
    KVSIFT_CHECK(seq >= 0 && seq < batch(), "SkipKV::", fn, ": sequence ", seq,
                 " outside [0, batch = ", batch(), ")");
  }
  SentenceTracker& tracker_mut(std::int64_t seq, const char* fn) {
    if (cfg_.batch == 0 && !frozen_ && seq >= batch() && seq < kMaxAutoBatch) {
      trackers_.resize(static_cast<std::size_t>(seq + 1), SentenceTracker(cfg_.sentences));
      checks_at_trigger_.resize(static_cast<std::size_t>(seq + 1), 0);
    }
    check_seq(seq, fn);
    return trackers_[seq];
  }

  void after_observe(std::int64_t seq, const std::int32_t* tokens, std::int64_t n) {
    if (steer_) steer_->observe(seq, tokens, n);
    if (n > 0) pending_trigger_ = observed_tokens_ = true;
    refresh_on_cadence(seq, n);
  }

  bool any_over_budget(const KVCacheView& kv) const {
    for (std::int64_t b = 0; b < kv.batch(); ++b)
      if (kv.length(b) > cfg_.scorer.rkv.budget) return true;
    return false;
  }

  // Rows of a step observation without hidden states: its batch, its cache view's batch, else
  // the batch already known. Never guessed: token_ids alone does not say how many rows it has.
  std::int64_t observation_batch(const Observation& obs) const {
    if (obs.batch > 0) return obs.batch;
    if (obs.kv.keys.data != nullptr) return obs.kv.batch();
    if (cfg_.batch > 0) return cfg_.batch;
    KVSIFT_CHECK(
        batch() > 0,
        "SkipKV::observe: the step observation does not say its batch: set Observation.batch, "
        "kv (any layer's cache) or last_hidden, or give the config a batch");
    return batch();
  }

  // §2.5: every refresh_steps decode steps of `seq`, refresh its marks (§2.2) and α, whether or
  // not the cache is over budget. A sequence's first observe() is its prompt; every token of a
  // later call is a decode step (a call that crosses a multiple refreshes once, after it).
  void refresh_on_cadence(std::int64_t seq, std::int64_t n) {
    const std::int64_t every = cfg_.steering.refresh_steps;
    if (every <= 0 || n <= 0) return;
    if (decode_steps_.size() < trackers_.size()) decode_steps_.resize(trackers_.size(), -1);
    std::int64_t& steps = decode_steps_[static_cast<std::size_t>(seq)];
    if (steps < 0) {
      steps = 0;  // the prompt
      return;
    }
    const std::int64_t before = steps / every;
    steps += n;
    if (steps / every == before) return;
    trackers_[seq].mark_redundant();
    checks_at_trigger_[seq] = trackers_[seq].check_count();
    if (steer_) steer_->update_strength(seq, checks_at_trigger_[seq]);
    ++refreshes_;
  }

  // Once per trigger, for every sequence: §2.2 marks, then N_o for §2.5.
  void begin_trigger() {
    for (std::int64_t b = 0; b < batch(); ++b) {
      trackers_[b].mark_redundant();
      checks_at_trigger_[b] = trackers_[b].check_count();
      if (steer_) steer_->update_strength(b, checks_at_trigger_[b]);
    }
    pending_trigger_ = false;
    ++triggers_;
  }

  LayerState& layer_state(int layer) {
    if (static_cast<std::size_t>(layer) >= layers_.size()) layers_.resize(layer + 1);
    std::optional<LayerState>& slot = layers_[layer];
    if (!slot) {
      LayerState st{SegmentTable(1, batch(), kv_heads_),
                    std::vector<std::int64_t>(static_cast<std::size_t>(batch()), 0),
                    std::vector<std::int64_t>(static_cast<std::size_t>(batch()), 0), false};
      for (std::int64_t b = 0; b < batch(); ++b)
        st.table.set_first_position(b, trackers_[b].padding());
      slot.emplace(std::move(st));
    }
    return *slot;
  }

  // The cache must hold exactly what the recorded plans and observed tokens say; before the
  // layer's first plan, every observed position with the tracker's pad count as its left pads.
  void check_lengths(int layer, const KVCacheView& kv, const LayerState& st) const {
    for (std::int64_t b = 0; b < batch(); ++b) {
      const SentenceTracker& t = trackers_[b];
      const std::int64_t expected = st.length_after_plan[b] + t.position() - st.position_at_plan[b];
      KVSIFT_CHECK(kv.length(b) == expected, "SkipKV::select: layer ", layer, " sequence ", b,
                   " holds ", kv.length(b), " tokens, expected ", expected,
                   st.planned ? " (its last plan kept " : " (observed positions: ",
                   st.planned ? st.length_after_plan[b] : t.position(),
                   st.planned ? ", plus tokens observed since); was the plan applied and every "
                                "token observed?"
                              : "); observe() every token appended to the cache");
      if (!st.planned && kv.valid_mask != nullptr) {
        std::int64_t pads = 0;
        for (std::int64_t j = 0; j < kv.length(b); ++j) pads += kv.is_valid(b, j) ? 0 : 1;
        KVSIFT_CHECK(pads == t.padding(), "SkipKV::select: sequence ", b, " has ", pads,
                     " pads in valid_mask but add_padding() gave ", t.padding());
      }
    }
  }

  SkipKVConfig cfg_;
  SentenceScorer scorer_;
  std::vector<SentenceTracker> trackers_;        // [batch]
  std::vector<std::int64_t> checks_at_trigger_;  // [batch] N_o at the last trigger
  std::optional<SteeringController> steer_;
  std::vector<std::optional<LayerState>> layers_;  // [layers seen]
  std::int64_t kv_heads_ = 0;
  bool pending_trigger_ = false;
  bool observed_tokens_ = false;  // some observe() gave tokens: select() may run over budget
  bool frozen_ = false;           // batch fixed: a select() has run
  // Auto-sizing (batch = 0) stops here, so a stray sequence index cannot allocate without bound.
  static constexpr std::int64_t kMaxAutoBatch = 1 << 16;
  std::int64_t triggers_ = 0;
  // [batch] decode steps observed per sequence (-1: prompt not yet observed); grown lazily.
  std::vector<std::int64_t> decode_steps_;
  std::int64_t refreshes_ = 0;
  // compress_step's host buffers, kept from step to step (no per-step allocation).
  StepPenalties step_penalties_;
  DeviceBackend::SkipKVStepRows step_rows_;
};

}  // namespace kvsift
