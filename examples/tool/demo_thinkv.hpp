// ThinKV in the demo (docs/algorithms.md §3, docs/thinkv.md §5). ThinKV owns its cache: the
// library's kvsift::ThinKVPolicy (the cache-owning interface, one ThinKV pipeline per sequence)
// keeps paged, quantized block tables and evicts by setting bits inside its end_step(). So this
// adapter drives it from observe() (append + a sparsity on every layer, then end_step) and reads
// what the runner measures from it: resident positions (for recall), bytes, evictions. Its trigger
// never fires: there is nothing to select() or compact(). What stays here is demo-only: calibrating
// θ1 / θ2 on the run, and the fast sparsity below.
//
// Thresholds θ1 < θ2 (§3.1): the synthetic generator has no real reasoning / execution /
// transition structure, so there is nothing to calibrate them against offline. The adapter
// calibrates them on the run itself: over the first `calibration_steps` decode steps it holds the
// tokens in full precision, measures each step's attention sparsity of every layer against the
// full history (attention_sparsity.hpp, the statistic `kvsift calibrate` uses), and sets θ1 / θ2
// to the 1/3 and 2/3 quantiles of those samples — so the three labels are roughly equally likely
// early on. It then builds the ThinKV objects and replays the buffered steps into them with the
// measured sparsities (observe_sparsity).
// After that, each step's sparsity is the same statistic over ThinKV's resident tokens (the
// adapter's mirror of the tables' positions), but on the keys before quantization (the demo's
// dtype-rounded keys), given through observe_sparsity. ThinKV::observe_query would use the keys as
// stored; it dequantizes every block of the layer each step, which made the default demo ~45 s
// instead of ~2 s. The labels can differ slightly from observe_query's where quantization moves a
// logit across the 1% cut.
// L* = every layer: the synthetic layers are statistically alike, so no layer is more telling.
#pragma once

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "demo_policy.hpp"
#include "kvsift/backend/cpu/attention_sparsity.hpp"
#include "kvsift/backend/cpu/dense_attention.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "kvsift/paged/paged_attention.hpp"
#include "kvsift/policy/thinkv/thinkv_policy.hpp"

namespace kvsift::demo {

struct ThinKVDemoOptions {
  int budget = 256;             // ThinKV's k: tokens per (layer, KV head), as the demo's budget
  std::int64_t length = 2048;   // decode length: sizes each layer's block pool
  int calibration_steps = 128;  // steps measured before θ1 / θ2 are set (one refresh interval)
  int refresh = 128;            // τ (docs/algorithms.md §4)
  // Refill of partly evicted groups (paged/refill_rule.hpp; docs/thinkv.md §6).
  kvsift::RefillRule refill = kvsift::RefillRule::run;
  int regroup_min_free = 8;
  // Slots per block (--thinkv-block): smaller blocks go back to the pool sooner, since a block is
  // held while any slot of any KV head is live (docs/thinkv.md §6).
  int block_size = 32;

  void validate() const {
    KVSIFT_CHECK(budget >= 1, "ThinKVDemoOptions: budget must be >= 1, got ", budget);
    KVSIFT_CHECK(length >= 1, "ThinKVDemoOptions: length must be >= 1, got ", length);
    KVSIFT_CHECK(calibration_steps >= 1, "ThinKVDemoOptions: calibration_steps must be >= 1, got ",
                 calibration_steps);
    KVSIFT_CHECK(refresh >= 1, "ThinKVDemoOptions: refresh must be >= 1, got ", refresh);
    KVSIFT_CHECK(block_size >= 16 && block_size <= 256 && block_size % 16 == 0,
                 "ThinKVDemoOptions: block_size (--thinkv-block) must be a multiple of 16 in "
                 "[16, 256], got ",
                 block_size);
  }
};

// --thinkv-refill: "run", "regroup" or "regroup:F" (F = regroup_min_free, 1..15).
inline void parse_thinkv_refill(const std::string& text, ThinKVDemoOptions& o) {
  const std::size_t colon = text.find(':');
  o.refill = kvsift::parse_refill_rule(text.substr(0, colon));
  if (colon == std::string::npos) return;
  KVSIFT_CHECK(o.refill == kvsift::RefillRule::regroup, "--thinkv-refill '", text,
               "': only regroup takes a minimum of free slots (regroup:F)");
  const std::string f = text.substr(colon + 1);
  KVSIFT_CHECK(!f.empty() && f.size() <= 2 && std::all_of(f.begin(), f.end(), ::isdigit),
               "--thinkv-refill '", text, "': F must be an integer in [1, 15]");
  o.regroup_min_free = std::stoi(f);
  KVSIFT_CHECK(o.regroup_min_free >= 1 && o.regroup_min_free <= 15, "--thinkv-refill '", text,
               "': F must be in [1, 15], got ", o.regroup_min_free);
}

// The q-quantile (0 <= q <= 1) of `samples` by nearest rank on the sorted copy.
inline float quantile_of(std::vector<float> samples, double q) {
  KVSIFT_CHECK(!samples.empty(), "quantile_of: no samples");
  std::sort(samples.begin(), samples.end());
  const auto i = static_cast<std::size_t>(q * static_cast<double>(samples.size() - 1) + 0.5);
  return samples[std::min(i, samples.size() - 1)];
}

class ThinKVDemoPolicy final : public DemoPolicy {
 public:
  explicit ThinKVDemoPolicy(ThinKVDemoOptions options) : options_(options) { options_.validate(); }

  std::string name() const override { return "thinkv"; }

  void observe(const DecodeStep& step, const std::vector<DemoLayerCache>& caches) override {
    last_ = SelfCompression{};
    if (layers_ == 0) start(step, static_cast<int>(caches.size()));
    if (!kv_) {
      calibrate_step(step, caches);
      return;
    }
    decode_step(step);
  }

  bool should_compress(const KVCacheView&) override { return false; }
  KeepPlan select(const StepInputs&) override {
    KVSIFT_CHECK(false,
                 "ThinKVDemoPolicy::select: ThinKV evicts inside end_step(), never by select()");
    return {};
  }
  SelfCompression self_compression() const override { return last_; }

  // Before ThinKV starts, the calibration tokens are held as the demo's cache holds them.
  std::int64_t resident_bytes(const DemoLayerCache& cache, int layer) const override {
    return kv_ ? kv_->resident_bytes(layer) : cache.resident_bytes();
  }
  const std::int32_t* resident_positions(const DemoLayerCache& cache, int layer, int b, int h,
                                         std::int64_t& n) const override {
    if (!kv_) {
      n = cache.length(b);
      return cache.positions(b, h);
    }
    const auto& p = positions_[index(layer, b, h)];
    n = static_cast<std::int64_t>(p.size());
    return p.data();
  }
  bool layer_step_evictions(std::int64_t& evicting, std::int64_t& total) const override {
    evicting = kv_ ? kv_->evicting_layer_steps() : 0;
    total = kv_ ? kv_->total_layer_steps() : 0;
    return true;
  }
  std::vector<std::pair<std::string, std::string>> extra_columns() const override {
    std::int64_t tokens =
        0;  // resident per (layer, KV head): the same in all, summed over sequences
    for (std::int64_t b = 0; kv_ && b < kv_->batch(); ++b)
      tokens += kv_->sequence(b).resident_tokens();
    const SlotCounts slots = kv_ ? slot_counts() : SlotCounts{};  // one walk of the tables
    return {
        {"tokens/head", !kv_ ? "-" : std::to_string(tokens / kv_->batch())},
        {"slots held/head (in pinned groups)", !kv_ ? "-" : format_slots(slots)},
        {"by type: held/pinned/live per head (segments)", !kv_ ? "-" : format_slots_by_type(slots)},
        {"codes+scales / metadata / staging", !kv_ ? "-" : format_split()},
        {"refill; key rel. err of block-resident tokens",
         !kv_ ? "-" : format_refill() + "; " + format_key_error()},
        {"attn rel. err (last step's queries)", !kv_ ? "-" : format_attention_error()},
        {"theta1 / theta2 (calibrated)",
         !kv_ ? "-" : format_theta(theta1_) + " / " + format_theta(theta2_)}};
  }

  // For tests and the banner: the library policy, nullptr while calibrating.
  const kvsift::ThinKVPolicy* thinkv() const { return kv_.get(); }
  float theta1() const { return theta1_; }
  float theta2() const { return theta2_; }

 private:
  // Slots per (layer, KV head) and sequence, by the thought type of their block. held: every
  // block gives each head block_size slots, live or not (what the memory pays for, next to
  // tokens/head). pinned: slots of the 16-slot groups that hold at least one live token — a group
  // is refilled only as a whole (docs/algorithms.md §3.4), so these stay taken whatever the
  // frames around them do; the rest of the held slots are whole free groups inside frames some
  // other head or group keeps. live: the live tokens in blocks. segments: of the first sequence.
  struct SlotCounts {
    std::int64_t held[3] = {}, pinned[3] = {}, live[3] = {}, segments[3] = {};
  };
  SlotCounts slot_counts() const {
    SlotCounts c;
    for (std::int64_t b = 0; b < kv_->batch(); ++b) {
      const kvsift::ThinKV& seq = kv_->sequence(b);
      const std::int32_t id = seq.sequence_id();
      for (int l = 0; l < layers_; ++l) {
        const kvsift::ThoughtBlockTable& t = seq.table(l);
        for (std::int32_t blk = 0; blk < t.num_blocks(id); ++blk) {
          const int type = static_cast<int>(t.block_info(id, blk).type);
          for (int h = 0; h < kv_heads_; ++h) {
            c.held[type] += t.config().block_size;
            const std::uint64_t* free = t.free_mask(id, blk, h);
            for (int first = 0; first < t.config().block_size; first += 16) {
              const std::uint64_t run = (free[first / 64] >> (first % 64)) & 0xffffu;
              c.pinned[type] += run != 0xffffu ? 16 : 0;
              c.live[type] += 16 - __builtin_popcountll(run);
            }
          }
        }
      }
    }
    const std::int64_t heads = kv_->batch() * layers_ * kv_heads_;
    for (int type = 0; type < 3; ++type) {
      c.held[type] /= heads;
      c.pinned[type] /= heads;
      c.live[type] /= heads;
    }
    const kvsift::ThinKV& first = kv_->sequence(0);
    for (int g = 0; g < first.table(0).num_segments(first.sequence_id()); ++g)
      ++c.segments[static_cast<int>(first.table(0).segment_type(first.sequence_id(), g))];
    return c;
  }
  static std::string format_slots(const SlotCounts& c) {
    return std::to_string(c.held[0] + c.held[1] + c.held[2]) + " (" +
           std::to_string(c.pinned[0] + c.pinned[1] + c.pinned[2]) + ")";
  }
  // Why slots stay held: a pinned run is refilled only by tokens of its own type, so the types
  // that few later segments have keep their survivors' groups (docs/thinkv.md §6).
  static std::string format_slots_by_type(const SlotCounts& c) {
    std::string out;
    for (int type = 0; type < 3; ++type) {
      out += std::string(type ? ", " : "") + "RET"[type] + " " + std::to_string(c.held[type]) +
             "/" + std::to_string(c.pinned[type]) + "/" + std::to_string(c.live[type]) + " (" +
             std::to_string(c.segments[type]) + " seg)";
    }
    return out;
  }
  // ThinKV's resident bytes split as the tables report them (block_bytes.hpp), in KiB.
  std::string format_split() const {
    kvsift::TableBytes sum;
    for (std::int64_t b = 0; b < kv_->batch(); ++b) sum += kv_->sequence(b).resident_bytes();
    char buf[96];
    std::snprintf(buf, sizeof buf, "%.0f / %.0f / %.0f KiB", (sum.codes + sum.scales) / 1024.0,
                  sum.metadata / 1024.0, sum.staging / 1024.0);
    return buf;
  }
  std::string format_refill() const {
    std::string out(kvsift::refill_rule_name(options_.refill));
    if (options_.refill == kvsift::RefillRule::regroup) {
      std::int64_t regroups = 0, survivors = 0;
      for (std::int64_t b = 0; b < kv_->batch(); ++b) {
        const kvsift::ThinKV& seq = kv_->sequence(b);
        for (int l = 0; l < layers_; ++l) {
          regroups += seq.table(l).refill_stats().regroups;
          survivors += seq.table(l).refill_stats().survivors_requantized;
        }
      }
      out += ":" + std::to_string(options_.regroup_min_free) + " (" + std::to_string(regroups) +
             " regroups, " + std::to_string(survivors) + " survivors re-rounded)";
    }
    return out;
  }
  // The accuracy cost of the refill rule: mean over every token held in a block (staged ones, at
  // 16 bits, left out) of |k_dequantized - k| / |k|, k the fp32 key the demo generated.
  std::string format_key_error() const {
    double sum = 0;
    std::int64_t n = 0;
    std::vector<float> keys, values;
    for (std::int64_t b = 0; b < kv_->batch(); ++b) {
      const kvsift::ThinKV& seq = kv_->sequence(b);
      const std::int32_t id = seq.sequence_id();
      for (int l = 0; l < layers_; ++l) {
        const kvsift::ThoughtBlockTable& t = seq.table(l);
        const std::size_t S = static_cast<std::size_t>(t.config().block_size);
        keys.resize(S * head_dim_);
        values.resize(keys.size());
        for (int h = 0; h < kv_heads_; ++h) {
          std::int32_t loaded = -1;
          for (const kvsift::ResidentToken& r : t.resident_tokens(id, h)) {
            if (r.address.block == kvsift::kStagedBlock) continue;
            if (r.address.block != loaded) {
              t.dequantize_block(id, r.address.block, h, keys.data(), values.data());
              loaded = r.address.block;
            }
            const float* k = token_row(keys_, l, static_cast<int>(b), h, r.position);
            const float* d = keys.data() + static_cast<std::size_t>(r.address.slot) * head_dim_;
            sum += relative_error(d, k, static_cast<std::size_t>(head_dim_));
            ++n;
          }
        }
      }
    }
    return format_mean(sum, n);
  }
  // What the stored tokens (quantized by type, refilled by the refill rule) do to attention: the
  // last step's queries over ThinKV's resident tokens as the tables store them
  // (paged_decode_attention) against exact attention over the same tokens' generated K/V
  // (dense_decode_attention); mean over layers, sequences and query heads of |o_table - o| / |o|.
  std::string format_attention_error() const {
    const int group = q_heads_ / kv_heads_;
    const std::size_t D = static_cast<std::size_t>(head_dim_);
    std::vector<float> paged(static_cast<std::size_t>(q_heads_) * D), exact(group * D), k, v;
    double sum = 0;
    std::int64_t n = 0;
    for (int b = 0; b < batch_; ++b) {
      const kvsift::ThinKV& seq = kv_->sequence(b);
      for (int l = 0; l < layers_; ++l) {
        const float* q = last_queries_.data() + (static_cast<std::size_t>(l) * batch_ + b) *
                                                    static_cast<std::size_t>(q_heads_) * D;
        kvsift::paged_decode_attention(seq.table(l), seq.sequence_id(), q, q_heads_, head_dim_,
                                       1.0f / std::sqrt(static_cast<float>(head_dim_)),
                                       paged.data());
        for (int h = 0; h < kv_heads_; ++h) {
          const std::vector<std::int32_t>& p = positions_[index(l, b, h)];
          k.resize(p.size() * D);
          v.resize(k.size());
          for (std::size_t j = 0; j < p.size(); ++j) {
            std::copy_n(token_row(keys_, l, b, h, p[j]), D, k.data() + j * D);
            std::copy_n(token_row(values_, l, b, h, p[j]), D, v.data() + j * D);
          }
          kvsift::dense_decode_attention(q + h * group * D, group, k.data(), v.data(),
                                         static_cast<std::int64_t>(p.size()), head_dim_,
                                         exact.data());
          for (int g = 0; g < group; ++g, ++n)
            sum += relative_error(paged.data() + (h * group + g) * D, exact.data() + g * D, D);
        }
      }
    }
    return format_mean(sum, n);
  }
  // |got - want| / |want| over n values (0 when want is zero).
  static double relative_error(const float* got, const float* want, std::size_t n) {
    double err = 0, norm = 0;
    for (std::size_t c = 0; c < n; ++c) {
      err += (got[c] - want[c]) * static_cast<double>(got[c] - want[c]);
      norm += want[c] * static_cast<double>(want[c]);
    }
    return norm > 0 ? std::sqrt(err / norm) : 0.0;
  }
  static std::string format_mean(double sum, std::int64_t n) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4f", n > 0 ? sum / static_cast<double>(n) : 0.0);
    return buf;
  }
  static std::string format_theta(float v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", v);
    return buf;
  }
  std::size_t index(int layer, int b, int h) const {
    return (static_cast<std::size_t>(layer) * batch_ + b) * kv_heads_ + h;
  }

  void start(const DecodeStep& step, int layers) {
    layers_ = layers;
    batch_ = step.batch;
    kv_heads_ = step.kv_heads;
    q_heads_ = step.q_heads;
    head_dim_ = step.head_dim;
  }

  // One calibration step: buffer the K/V, record every layer's sparsity per sequence against the
  // full history (the demo's cache is never compacted for ThinKV).
  void calibrate_step(const DecodeStep& step, const std::vector<DemoLayerCache>& caches) {
    keep_tokens(step);
    buffered_keys_.insert(buffered_keys_.end(), step.keys.begin(), step.keys.end());
    buffered_values_.insert(buffered_values_.end(), step.values.begin(), step.values.end());
    for (int l = 0; l < layers_; ++l) {
      // [batch, q_heads, head_dim]: this step's queries of layer l.
      const TensorView q =
          TensorView::contiguous(const_cast<float*>(step.query(l, 0, 0)), DType::f32, Device::cpu,
                                 {step.batch, step.q_heads, step.head_dim});
      const std::vector<float> s = attention_sparsity(caches[l].view(), q);  // [batch]
      for (int b = 0; b < batch_; ++b) sparsity_.push_back(s[b]);            // [step, layer, batch]
    }
    if (++calibrated_ < options_.calibration_steps) return;
    theta1_ = quantile_of(sparsity_, 1.0 / 3.0);
    theta2_ = quantile_of(sparsity_, 2.0 / 3.0);
    if (!(theta1_ < theta2_)) theta2_ = std::min(1.0f, theta1_ + 1e-3f);
    if (!(theta1_ < theta2_)) theta1_ = theta2_ - 1e-3f;
    build_and_replay();
  }

  void build_and_replay() {
    ThinKVPolicyConfig pc;
    pc.batch = batch_;
    ThinKVConfig& cfg = pc.pipeline;
    cfg.num_layers = layers_;
    cfg.kv_heads = kv_heads_;
    cfg.q_heads = q_heads_;
    cfg.head_dim = head_dim_;
    cfg.budget = options_.budget;
    cfg.refresh = options_.refresh;
    cfg.refill = options_.refill;
    cfg.regroup_min_free = options_.regroup_min_free;
    cfg.block_size = options_.block_size;
    cfg.theta1 = theta1_;
    cfg.theta2 = theta2_;
    for (int l = 0; l < layers_; ++l) cfg.calibrated_layers.push_back(l);
    // Every token fits even if no slot were ever refilled, plus one partly filled block per
    // segment (a segment opens a new block) and per type.
    cfg.pool_blocks = static_cast<int>((options_.length + cfg.block_size - 1) / cfg.block_size +
                                       options_.length / cfg.refresh + 8);
    kv_ = std::make_unique<kvsift::ThinKVPolicy>(pc);
    positions_.assign(static_cast<std::size_t>(layers_) * batch_ * kv_heads_, {});

    const std::size_t per_step = static_cast<std::size_t>(layers_) * batch_ * kv_heads_ * head_dim_;
    for (int s = 0; s < calibrated_; ++s) {
      const float* keys = buffered_keys_.data() + s * per_step;  // [layers, batch, kv_heads, D]
      const float* values = buffered_values_.data() + s * per_step;
      for (int l = 0; l < layers_; ++l) {
        const std::size_t at = static_cast<std::size_t>(l) * batch_ * kv_heads_ * head_dim_;
        append(l, keys + at, values + at);
        kv_->observe_sparsity(l, &sparsity_[(static_cast<std::size_t>(s) * layers_ + l) * batch_]);
      }
      finish_step(s);
    }
    buffered_keys_.clear();
    buffered_keys_.shrink_to_fit();
    buffered_values_.clear();
    buffered_values_.shrink_to_fit();
  }

  // Every key and value of the decode in fp32 as the demo rounded them, and the latest queries.
  void keep_tokens(const DecodeStep& step) {
    const std::size_t rows = static_cast<std::size_t>(layers_) * batch_ * kv_heads_;
    if (keys_.empty()) {
      keys_.resize(rows * options_.length * head_dim_);
      values_.resize(keys_.size());
    }
    KVSIFT_CHECK(step.position < options_.length, "ThinKVPolicy: step ", step.position,
                 " beyond the decode length ", options_.length);
    const auto t = static_cast<std::int32_t>(step.position);
    for (int l = 0; l < layers_; ++l)
      for (int b = 0; b < batch_; ++b)
        for (int h = 0; h < kv_heads_; ++h) {
          std::copy_n(step.key(l, b, h), head_dim_, token_row(keys_, l, b, h, t));
          std::copy_n(step.value(l, b, h), head_dim_, token_row(values_, l, b, h, t));
        }
    last_queries_ = step.queries;
  }
  // Row `position` of (l, b, h) in keys_ or values_.
  template <class Rows>
  auto token_row(Rows& rows, int l, int b, int h, std::int32_t position) const
      -> decltype(rows.data()) {
    return rows.data() + (index(l, b, h) * options_.length + position) * head_dim_;
  }

  // Attention sparsity (docs/algorithms.md §3.1) of sequence b's queries of layer l over the
  // resident tokens plus the new one at `position`, averaged over query heads. query: [q_heads, D]
  float resident_sparsity(int l, int b, const float* query, std::int32_t position) {
    const int group = q_heads_ / kv_heads_;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    double sum = 0;
    for (int q = 0; q < q_heads_; ++q) {
      const int h = q / group;
      const std::vector<std::int32_t>& p = positions_[index(l, b, h)];
      logits_.resize(p.size() + 1);
      const float* qv = query + static_cast<std::size_t>(q) * head_dim_;
      for (std::size_t j = 0; j <= p.size(); ++j) {
        const float* k = token_row(keys_, l, b, h, j < p.size() ? p[j] : position);
        float dot = 0;
        for (int d = 0; d < head_dim_; ++d) dot += qv[d] * k[d];
        logits_[j] = dot * scale;
      }
      sum += sparsity_from_logits(logits_.data(), static_cast<std::int64_t>(logits_.size()));
    }
    return static_cast<float>(sum / q_heads_);
  }

  // One layer's token of every sequence: keys, values [batch, kv_heads, D] contiguous.
  void append(int l, const float* keys, const float* values) {
    const auto view = [&](const float* p) {  // [batch, kv_heads, 1, D]
      return TensorView::contiguous(const_cast<float*>(p), DType::f32, Device::cpu,
                                    {batch_, kv_heads_, 1, head_dim_});
    };
    kv_->append(l, view(keys), view(values));
  }

  void decode_step(const DecodeStep& step) {
    using Clock = std::chrono::steady_clock;
    keep_tokens(step);
    const auto position = static_cast<std::int32_t>(step.position);
    std::vector<float> sparsity(static_cast<std::size_t>(batch_));
    for (int l = 0; l < layers_; ++l) {
      append(l, step.key(l, 0, 0), step.value(l, 0, 0));
      for (int b = 0; b < batch_; ++b)
        sparsity[b] = resident_sparsity(l, b, step.query(l, b, 0), position);
      kv_->observe_sparsity(l, sparsity.data());
    }
    const auto t0 = Clock::now();
    const bool evicted = finish_step(position);
    const auto t1 = Clock::now();
    if (evicted) {
      last_.happened = true;
      last_.ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    }
  }

  // end_step() of every sequence for the token at `position`; keeps the demo's mirror of the
  // sorted resident positions of every (layer, sequence, KV head) in step with the tables.
  // Returns whether TBE evicted in some sequence.
  bool finish_step(std::int32_t position) {
    const bool evicted = kv_->end_step();
    for (int l = 0; l < layers_; ++l)
      for (int b = 0; b < batch_; ++b)
        for (int h = 0; h < kv_heads_; ++h) {
          std::vector<std::int32_t>& p = positions_[index(l, b, h)];
          if (evicted) {
            p = kv_->resident_positions(l, b, h);
          } else {
            p.push_back(position);
          }
        }
    return evicted;
  }

  ThinKVDemoOptions options_;
  int layers_ = 0, batch_ = 0, kv_heads_ = 0, q_heads_ = 0, head_dim_ = 0;
  // Calibration: [step, layers, batch, kv_heads, D] tokens and [step, layers, batch] sparsities.
  std::vector<float> buffered_keys_, buffered_values_, sparsity_;
  // [layers, batch, kv_heads, length, D] every key (for sparsity and errors) and value (errors)
  std::vector<float> keys_, values_;
  std::vector<float> last_queries_;  // [layers, batch, q_heads, D] the latest step's
  std::vector<float> logits_;        // scratch: one query head's row
  int calibrated_ = 0;
  float theta1_ = 0, theta2_ = 0;
  std::unique_ptr<kvsift::ThinKVPolicy> kv_;          // nullptr while calibrating
  std::vector<std::vector<std::int32_t>> positions_;  // [layers, batch, kv_heads] sorted
  SelfCompression last_;
};

}  // namespace kvsift::demo
