// SkipKV in the demo (docs/algorithms.md §2, docs/skipkv.md). SkipKV is a kvsift::Policy, so the demo's
// caches, trigger and compact() serve it as they serve R-KV; what it needs beyond them is its
// per-sequence sentence tracking, fed here every step with
//   - the step's token id: the real R1-Distill-Qwen id of the MATH-500 stream, so its sentences
//     end at the real delimiters and its check sentences (N_o, §2.5) are the real keyword ones;
//     on a synthetic stream (ids -1) a delimiter id stands in where the plan closes a sentence,
//     so the tracker's sentences are the plan's either way;
//   - a hidden state: the generator's synthetic stand-in (DecodeStep::hidden [batch, head_dim]:
//     the sentence's topic plus token noise), so a planted near-repeat has a near-identical
//     sentence mean and SkipKV's PSS > τ test (§2.2) fires on it. Nothing else is redundant:
//     unrelated topics in head_dim = 64 have cosine ~N(0, 1/8), far below τ = 0.95.
// select() records the plan in SkipKV's range maps on the contract that the host applies it
// before the next token; the runner compacts every layer right after select(), as required.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "demo_policy.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/tensor_view.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"

namespace kvsift::demo {

class SkipKVPolicy final : public DemoPolicy {
 public:
  explicit SkipKVPolicy(std::unique_ptr<SkipKV> skipkv) : skipkv_(std::move(skipkv)) {
    KVSIFT_CHECK(skipkv_ != nullptr, "SkipKVPolicy: null policy");
    const auto& delimiters = skipkv_->config().sentences.tokens.delimiters;
    KVSIFT_CHECK(!delimiters.empty(), "SkipKVPolicy: SkipKV has no delimiter ids");
    synthetic_delimiter_ = delimiters.front();
  }

  std::string name() const override { return std::string(skipkv_->name()); }

  void observe(const DecodeStep& step, const std::vector<DemoLayerCache>& caches) override {
    (void)caches;
    const std::int64_t width = skipkv_->config().sentences.hidden_size;
    KVSIFT_CHECK(width == 0 || width == step.head_dim, "SkipKVPolicy: SkipKV hidden_size (", width,
                 ") must be 0 or the generator's hidden width head_dim (", step.head_dim, ")");
    for (int b = 0; b < step.batch; ++b) {
      std::int32_t id = step.token_ids[b];
      if (id < 0 && step.closes_sentence[b]) id = synthetic_delimiter_;
      if (width == 0) {
        skipkv_->observe(b, &id, 1);
        continue;
      }
      // [1, hidden]: this token's synthetic last-layer state.
      float* row = const_cast<float*>(step.hidden.data()) + static_cast<std::size_t>(b) * width;
      skipkv_->observe(b, &id, 1, TensorView::contiguous(row, DType::f32, Device::cpu, {1, width}));
    }
  }

  bool should_compress(const KVCacheView& kv) override { return skipkv_->should_compress(kv); }

  KeepPlan select(const StepInputs& in) override {
    const std::int64_t before = skipkv_->triggers();
    KeepPlan plan = skipkv_->select(in);
    if (skipkv_->triggers() > before) {  // this select() was the trigger: marks and N_o updated
      trigger_positions_.push_back(skipkv_->tracker(0).position());
      checks_at_trigger_.resize(static_cast<std::size_t>(skipkv_->batch()));
      for (std::int64_t b = 0; b < skipkv_->batch(); ++b)
        checks_at_trigger_[b] = skipkv_->tracker(b).check_count();
    }
    return plan;
  }

  std::vector<std::pair<std::string, std::string>> extra_columns() const override {
    std::int64_t marked = 0, closed = 0;
    std::string alphas;
    for (std::int64_t b = 0; b < skipkv_->batch(); ++b) {
      const SentenceTracker& t = skipkv_->tracker(b);
      marked += t.redundant_count();
      closed += t.num_sentences();
      char buf[48];
      std::snprintf(buf, sizeof buf, "%.2f (%lld)", skipkv_->steering_strength(b),
                    static_cast<long long>(checks_at_last_trigger(b)));
      alphas += (alphas.empty() ? "" : ", ") + std::string(buf);
    }
    return {{"redundant sentences",
             skipkv_->batch() ? std::to_string(marked) + " of " + std::to_string(closed) : "-"},
            {"alpha (N_o) per sequence", alphas.empty() ? "-" : alphas}};
  }

  // For tests: the pipeline, and the generation position (tokens observed) at each trigger.
  const SkipKV& skipkv() const { return *skipkv_; }
  const std::vector<std::int64_t>& trigger_positions() const { return trigger_positions_; }

 private:
  // N_o of sequence b at the last trigger (what α was computed from), 0 before any.
  std::int64_t checks_at_last_trigger(std::int64_t b) const {
    return b < static_cast<std::int64_t>(checks_at_trigger_.size()) ? checks_at_trigger_[b] : 0;
  }

  std::unique_ptr<SkipKV> skipkv_;
  std::int32_t synthetic_delimiter_ = 0;
  std::vector<std::int64_t> trigger_positions_;  // [triggers]
  std::vector<std::int64_t> checks_at_trigger_;  // [batch] N_o at the last trigger
};

}  // namespace kvsift::demo
