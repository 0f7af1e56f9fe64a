// Runs every policy over one synthetic decode, in lockstep: each step is generated once and fed to
// every policy's own caches, so all policies see identical tokens and FullKV's top-k is computed
// once per measured step. Per step and policy: append the token's K/V to every layer, push its
// queries into the observation window, let the policy observe, measure recall if a compression
// happened within the last `recall_steps` steps, then ask the trigger and, if it fires, select()
// and compact() every layer (timed). A policy with its own storage (ThinKV, the quantizers) instead
// evicts or quantizes inside observe() and reports it (DemoPolicy::self_compression), and answers
// for its resident positions and bytes itself; a quantizer also says where attention goes on its
// dequantized keys (DemoPolicy::attended_positions), which recall then compares with FullKV's.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "demo_metrics.hpp"
#include "demo_policy.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/step_inputs.hpp"

namespace kvsift::demo {

struct DemoConfig {
  GeneratorConfig generator;
  DType dtype = DType::f16;  // storage dtype of the caches (memory is counted in it)
  int budget = 256;          // the methods' shared knobs (shared_config_json)
  int window = 8;
  int buffer = 128;
  int recall_k = 10;     // recall of FullKV's top-k attended tokens...
  int recall_steps = 8;  // ...for the queries of the k steps after each compression

  void validate() const {
    generator.validate();
    KVSIFT_CHECK(window >= 1, "window must be >= 1, got ", window);
    KVSIFT_CHECK(budget > window, "budget (", budget, ") must exceed window (", window, ")");
    KVSIFT_CHECK(buffer >= 1, "buffer must be >= 1, got ", buffer);
    KVSIFT_CHECK(recall_k >= 1, "recall_k must be >= 1, got ", recall_k);
    KVSIFT_CHECK(recall_steps >= 1, "recall_steps must be >= 1, got ", recall_steps);
  }
};

// The demo's knobs as one JSON object every method takes its keys from (filter_config): budget,
// window and buffer; kernel 7 (docs/algorithms.md §4, SnapKV included, so every window scorer pools
// alike); SkipKV's hidden_size is the generator's hidden width (its stand-ins are head_dim wide).
inline std::string shared_config_json(const DemoConfig& cfg) {
  return "{\"budget\": " + std::to_string(cfg.budget) +
         ", \"window\": " + std::to_string(cfg.window) +
         ", \"buffer\": " + std::to_string(cfg.buffer) +
         ", \"kernel\": 7, \"hidden_size\": " + std::to_string(cfg.generator.head_dim) + "}";
}

struct PolicyReport {
  std::string name;
  std::int64_t end_bytes = 0;   // resident KV after the last step, all layers
  std::int64_t peak_bytes = 0;  // most resident KV at any point (just before a compression)
  std::int64_t compressions = 0;
  double compress_ms = 0;  // select() + compact() of every layer, summed over compressions
  double recall_sum = 0;   // over (measured step, layer, sequence, query head)
  std::int64_t recall_samples = 0;
  EvictionShape evictions;  // over every compression, layer, sequence and KV head
  // (sequence, layer, step) triples in which a compression evicted something, and all of them.
  std::int64_t evicting_layer_steps = 0;
  std::int64_t layer_steps = 0;
  std::vector<std::pair<std::string, std::string>> extra_columns;

  double ms_per_compression() const {
    return compressions ? compress_ms / static_cast<double>(compressions)
                        : std::numeric_limits<double>::quiet_NaN();
  }
  double evictions_per_layer_step() const {
    return layer_steps
               ? static_cast<double>(evicting_layer_steps) / static_cast<double>(layer_steps)
               : std::numeric_limits<double>::quiet_NaN();
  }
  double recall() const {
    return recall_samples ? recall_sum / static_cast<double>(recall_samples)
                          : std::numeric_limits<double>::quiet_NaN();
  }
};

struct DemoResult {
  std::int64_t tokens = 0;      // decode length
  std::int64_t full_bytes = 0;  // FullKV's resident KV at the end (every token, all layers)
  std::vector<PolicyReport> policies;
};

inline DemoResult run_demo(const DemoConfig& cfg, SyntheticDecode& decode,
                           std::vector<std::unique_ptr<DemoPolicy>>& policies) {
  cfg.validate();
  const GeneratorConfig& g = decode.config();
  const int L = g.layers, B = g.batch, Hq = g.q_heads, Hkv = g.kv_heads, D = g.head_dim;
  const int G = Hq / Hkv;
  const std::int64_t T = decode.length() - decode.position();
  using Clock = std::chrono::steady_clock;

  struct Run {
    std::vector<DemoLayerCache> caches;  // [layers]
    std::vector<QueryWindow> windows;    // [layers]
    std::int64_t last_compression = -1;
    PolicyReport report;
  };
  std::vector<Run> runs(policies.size());
  for (std::size_t p = 0; p < policies.size(); ++p) {
    runs[p].report.name = policies[p]->name();
    for (int l = 0; l < L; ++l) {
      // Room for the budget-based trigger (budget + buffer); caches grow if a policy holds more.
      runs[p].caches.emplace_back(B, Hkv, std::min<std::int64_t>(T, cfg.budget + cfg.buffer), D,
                                  cfg.dtype);
      runs[p].windows.emplace_back(B, Hq, cfg.window, D, cfg.dtype);
    }
  }

  FullKVReference reference(L, B, Hkv, D, T);
  DecodeStep step;
  std::vector<std::int32_t> before;    // scratch: one row's positions before a compression
  std::vector<std::int32_t> attended;  // scratch: a quantizer's top-k on its dequantized keys
  while (!decode.done()) {
    decode.next(step);
    round_to_dtype(step.keys, cfg.dtype);
    round_to_dtype(step.values, cfg.dtype);
    round_to_dtype(step.queries, cfg.dtype);
    reference.append(step);
    const std::int64_t t = step.position;
    std::vector<std::vector<std::int32_t>> top;  // FullKV's top-k, computed when first needed

    for (std::size_t p = 0; p < policies.size(); ++p) {
      Run& run = runs[p];
      DemoPolicy& policy = *policies[p];
      for (int l = 0; l < L; ++l) {
        run.caches[l].append(step, l);
        run.windows[l].push(step, l);
      }
      policy.observe(step, run.caches);
      run.report.layer_steps += static_cast<std::int64_t>(L) * B;
      const SelfCompression self = policy.self_compression();
      if (self.happened) {  // evicted inside observe(): recall is measured from the next step on
        ++run.report.compressions;
        run.report.compress_ms += self.ms;
        run.last_compression = t;
      }

      std::int64_t bytes = 0;
      for (int l = 0; l < L; ++l) bytes += policy.resident_bytes(run.caches[l], l);
      run.report.peak_bytes = std::max(run.report.peak_bytes, bytes);

      if (run.last_compression >= 0 && t > run.last_compression &&
          t - run.last_compression <= cfg.recall_steps) {
        if (top.empty()) top = reference.top_k(step, cfg.recall_k);
        for (int l = 0; l < L; ++l) {
          for (int b = 0; b < B; ++b) {
            for (int q = 0; q < Hq; ++q) {
              const auto& want = top[(static_cast<std::size_t>(l) * B + b) * Hq + q];
              if (policy.attended_positions(l, b, q, step.query(l, b, q), cfg.recall_k,
                                            attended)) {  // quantized keys: where attention goes
                run.report.recall_sum +=
                    recall_of(want, attended.data(), static_cast<std::int64_t>(attended.size()));
              } else {
                std::int64_t n = 0;
                const std::int32_t* resident =
                    policy.resident_positions(run.caches[l], l, b, q / G, n);
                run.report.recall_sum += recall_of(want, resident, n);
              }
              ++run.report.recall_samples;
            }
          }
        }
      }

      if (!policy.should_compress(run.caches[0].view())) continue;
      for (int l = 0; l < L; ++l) {
        DemoLayerCache& cache = run.caches[l];
        StepInputs in;
        in.layer = l;
        in.kv = cache.view();
        in.window_queries = run.windows[l].view();  // [batch, q_heads, window, head_dim]
        const auto t0 = Clock::now();
        const KeepPlan plan = policy.select(in);
        const auto t1 = Clock::now();
        // Keep the positions each row held, to see afterwards how its evicted tokens left.
        before.clear();
        std::vector<std::int64_t> offsets;
        for (int b = 0; b < B; ++b) {
          for (int h = 0; h < Hkv; ++h) {
            offsets.push_back(static_cast<std::int64_t>(before.size()));
            before.insert(before.end(), cache.positions(b, h),
                          cache.positions(b, h) + cache.length(b));
          }
        }
        std::vector<std::int32_t> lengths_before(B);
        for (int b = 0; b < B; ++b) lengths_before[b] = cache.length(b);
        const auto t2 = Clock::now();
        cache.apply(plan);
        const auto t3 = Clock::now();
        run.report.compress_ms +=
            std::chrono::duration<double, std::milli>((t1 - t0) + (t3 - t2)).count();
        for (int b = 0; b < B; ++b)
          run.report.evicting_layer_steps += cache.length(b) < lengths_before[b];
        for (int b = 0; b < B; ++b) {
          for (int h = 0; h < Hkv; ++h) {
            const EvictionShape s = eviction_shape(
                before.data() + offsets[static_cast<std::size_t>(b) * Hkv + h], lengths_before[b],
                cache.positions(b, h), cache.length(b), decode.plan(b), t + 1);
            run.report.evictions.whole_sentence_tokens += s.whole_sentence_tokens;
            run.report.evictions.fragment_tokens += s.fragment_tokens;
          }
        }
      }
      ++run.report.compressions;
      run.last_compression = t;
    }
  }

  DemoResult result;
  result.tokens = T;
  result.full_bytes = T * B * Hkv * D * 2 * static_cast<std::int64_t>(dtype_size(cfg.dtype)) * L;
  for (std::size_t p = 0; p < policies.size(); ++p) {
    PolicyReport& r = runs[p].report;
    for (int l = 0; l < L; ++l) r.end_bytes += policies[p]->resident_bytes(runs[p].caches[l], l);
    policies[p]->layer_step_evictions(r.evicting_layer_steps, r.layer_steps);
    r.extra_columns = policies[p]->extra_columns();
    result.policies.push_back(std::move(r));
  }
  return result;
}

}  // namespace kvsift::demo
