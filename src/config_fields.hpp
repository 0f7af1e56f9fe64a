// Every method config's fields, listed once for JSON reading and writing (config_json.hpp).
// JSON keys are the C++ field names; an embedded config's fields appear flat (SkipKV's "budget"
// is its scorer.rkv.budget) except steering, a nested object.
#pragma once

#include "config_json.hpp"
#include "kvsift/config/h2o_config.hpp"
#include "kvsift/config/kivi_config.hpp"
#include "kvsift/config/lazy_config.hpp"
#include "kvsift/config/options.hpp"
#include "kvsift/config/pmkvq_config.hpp"
#include "kvsift/config/raas_config.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/config/skipkv_config.hpp"
#include "kvsift/config/snapkv_config.hpp"
#include "kvsift/config/streaming_llm_config.hpp"
#include "kvsift/config/thinkv_config.hpp"

namespace kvsift::detail {

inline const EnumNames<GqaReduce> kGqaNames{{"max", GqaReduce::max}, {"mean", GqaReduce::mean}};
inline const EnumNames<Pooling> kPoolingNames{{"max", Pooling::max}, {"avg", Pooling::avg}};
inline const EnumNames<WindowReduce> kReduceNames{{"mean", WindowReduce::mean},
                                                  {"sum", WindowReduce::sum}};
inline const EnumNames<RedundancyMode> kRedundancyNames{{"sound", RedundancyMode::sound},
                                                        {"faithful", RedundancyMode::faithful}};
inline const EnumNames<PadMode> kPadNames{{"exclude", PadMode::exclude},
                                          {"faithful", PadMode::faithful}};
inline const EnumNames<H2OMode> kH2ONames{{"accumulated", H2OMode::accumulated},
                                          {"last_query_shared", H2OMode::last_query_shared}};
inline const EnumNames<BlockFormat> kBlockNames{{"f32", BlockFormat::f32},
                                                {"nvfp4", BlockFormat::nvfp4},
                                                {"fp8", BlockFormat::fp8},
                                                {"ternary", BlockFormat::ternary}};
inline const EnumNames<DType> kStagingNames{{"bf16", DType::bf16}, {"f16", DType::f16}};
inline const EnumNames<RefillRule> kRefillNames{{"run", RefillRule::run},
                                                {"regroup", RefillRule::regroup}};

struct EmptyConfig {
  void validate() const {}
};
struct EmptyFields {
  template <class V>
  void operator()(V&, EmptyConfig&) const {}
};

struct StreamingFields {
  template <class V>
  void operator()(V& v, StreamingLLMConfig& c) const {
    v("budget", c.budget);
    v("sink", c.sink);
    v("buffer", c.buffer);
  }
};

struct H2OFields {
  template <class V>
  void operator()(V& v, H2OConfig& c) const {
    v("budget", c.budget);
    v("recent", c.recent);
    v("buffer", c.buffer);
    v("mode", c.mode, kH2ONames);
  }
};

inline const EnumNames<LazyCounters> kLazyCounterNames{{"int32", LazyCounters::int32},
                                                       {"fp16", LazyCounters::fp16}};
inline const EnumNames<LazyScope> kLazyScopeNames{{"kv_head", LazyScope::kv_head},
                                                  {"query_head", LazyScope::query_head}};

struct LazyFields {
  template <class V>
  void operator()(V& v, LazyConfig& c) const {
    v("budget", c.budget);
    v("window", c.window);
    v("alpha", c.alpha);
    v("counters", c.counters, kLazyCounterNames);
    v("scope", c.scope, kLazyScopeNames);
  }
};

inline const EnumNames<RaasUnit> kRaasUnitNames{{"token", RaasUnit::token},
                                                {"page", RaasUnit::page}};
inline const EnumNames<RaasRefresh> kRaasRefreshNames{{"top_half", RaasRefresh::top_half},
                                                      {"alpha", RaasRefresh::alpha}};

struct RaasFields {
  template <class V>
  void operator()(V& v, RaasConfig& c) const {
    v("budget", c.budget);
    v("window", c.window);
    v("buffer", c.buffer);
    v("unit", c.unit, kRaasUnitNames);
    v("page_size", c.page_size);
    v("refresh", c.refresh, kRaasRefreshNames);
    v("alpha", c.alpha);
  }
};

struct SnapKVFields {
  template <class V>
  void operator()(V& v, SnapKVConfig& c) const {
    v("budget", c.budget);
    v("window", c.window);
    v("buffer", c.buffer);
    v("kernel", c.kernel);
    v("pooling", c.pooling, kPoolingNames);
    v("reduction", c.reduction, kReduceNames);
    v("gqa", c.gqa, kGqaNames);
    v("sink", c.sink);
  }
};

struct RKVFields {
  template <class V>
  void operator()(V& v, RKVConfig& c) const {
    v("budget", c.budget);
    v("window", c.window);
    v("buffer", c.buffer);
    v("kernel", c.kernel);
    v("mix_lambda", c.mix_lambda);
    v("threshold", c.threshold);
    v("sink", c.sink);
    v("redundancy", c.redundancy, kRedundancyNames);
    v("gqa", c.gqa, kGqaNames);
  }
};

// SkipKV's eviction knobs: R-KV's (flat keys, as an engine writes them) and the pad mode. The
// R-KV sink is not offered: SkipKV keeps none.
struct ScorerFields {
  template <class V>
  void operator()(V& v, SentenceScorerConfig& c) const {
    v("budget", c.rkv.budget);
    v("window", c.rkv.window);
    v("buffer", c.rkv.buffer);
    v("kernel", c.rkv.kernel);
    v("mix_lambda", c.rkv.mix_lambda);
    v("threshold", c.rkv.threshold);
    v("redundancy", c.rkv.redundancy, kRedundancyNames);
    v("gqa", c.rkv.gqa, kGqaNames);
    v("pad_mode", c.pad_mode, kPadNames);
  }
};

inline const EnumNames<SteeringPreset> kSteeringPresetNames{{"skipkv", SteeringPreset::skipkv},
                                                            {"seal", SteeringPreset::seal}};
inline const EnumNames<SteeringModel> kSteeringModelNames{
    {"r1-qwen-7b", SteeringModel::r1_qwen_7b},
    {"r1-llama-8b", SteeringModel::r1_llama_8b},
    {"r1-qwen-14b", SteeringModel::r1_qwen_14b}};

// "preset" and "model" come first: a change of either rebuilds the config from that preset
// (SteeringConfig::from_preset: layer, α0, γ, ids), then the keys after them override single
// fields, e.g. {"preset": "seal", "model": "r1-qwen-14b", "alpha0": 1.25}.
struct SteeringFields {
  template <class V>
  void operator()(V& v, SteeringConfig& c) const {
    const SteeringPreset preset = c.preset;
    const SteeringModel model = c.model;
    v("preset", c.preset, kSteeringPresetNames);
    v("model", c.model, kSteeringModelNames);
    if (c.preset != preset || c.model != model) c = SteeringConfig::from_preset(c.preset, c.model);
    v("layer", c.layer);
    v("alpha0", c.alpha0);
    v("gamma", c.gamma);
    v("think_start", c.think_start);
    v("think_end", c.think_end);
    v("boundary", c.boundary);
  }
};

struct SkipKVFields {
  template <class V>
  void operator()(V& v, SkipKVConfig& c) const {
    v("batch", c.batch);
    v("layers", c.layers);
    v("kv_heads", c.kv_heads);
    ScorerFields{}(v, c.scorer);
    v("delimiters", c.sentences.tokens.delimiters);
    v("keywords", c.sentences.tokens.keywords);
    v("hidden_size", c.sentences.hidden_size);
    v("tau", c.sentences.tau);
    v.object("steering", c.steering, SteeringFields{});
  }
};

struct ThinKVFields {
  template <class V>
  void operator()(V& v, ThinKVPolicyConfig& c) const {
    ThinKVConfig& p = c.pipeline;
    v("batch", c.batch);
    v("num_layers", p.num_layers);
    v("kv_heads", p.kv_heads);
    v("q_heads", p.q_heads);
    v("head_dim", p.head_dim);
    v("budget", p.budget);
    v("refresh", p.refresh);
    v("theta1", p.theta1);
    v("theta2", p.theta2);
    v("calibrated_layers", p.calibrated_layers);
    v("schedule", p.schedule);
    v("evict_prompt", p.evict_prompt);
    v("kmeans_iterations", p.kmeans_iterations);
    v("block_size", p.block_size);
    v("pool_blocks", p.pool_blocks);
    v("reasoning", p.reasoning, kBlockNames);
    v("execution", p.execution, kBlockNames);
    v("transition", p.transition, kBlockNames);
    v("global_factors", p.global_factors);
    v("staging", p.staging, kStagingNames);
    v("refill", p.refill, kRefillNames);
    v("regroup_min_free", p.regroup_min_free);
  }
};

// KIVI (docs/algorithms.md §5.1): the model's geometry and the quantizer's knobs, flat.
struct KiviFields {
  template <class V>
  void operator()(V& v, KiviPolicyConfig& c) const {
    v("batch", c.batch);
    v("num_layers", c.num_layers);
    v("kv_heads", c.kv_heads);
    v("q_heads", c.q_heads);
    v("head_dim", c.head_dim);
    v("k_bits", c.kivi.k_bits);
    v("v_bits", c.kivi.v_bits);
    v("group_size", c.kivi.group_size);
    v("residual_length", c.kivi.residual_length);
  }
};

inline const EnumNames<PmkvqBackend> kPmkvqBackendNames{{"real", PmkvqBackend::real},
                                                        {"fake", PmkvqBackend::fake}};

// PM-KVQ (docs/algorithms.md §5.2): geometry, the stream's knobs flat, the per-layer budgets
// (MiB; one entry for all layers or one per layer) and the reference-exact / graceful switch.
struct PmkvqFields {
  template <class V>
  void operator()(V& v, PmkvqPolicyConfig& c) const {
    PmkvqConfig& p = c.pmkvq;
    v("batch", c.batch);
    v("num_layers", c.num_layers);
    v("kv_heads", p.kv_heads);
    v("q_heads", c.q_heads);
    v("head_dim", p.head_dim);
    v("backend", p.backend, kPmkvqBackendNames);
    v("group_size", p.group_size);
    v("n_sink", p.n_sink);
    v("n_window", p.n_window);
    v("n_init_bits", p.n_init_bits);
    v("kv_budget_mb", p.kv_budget_mb);
    v("reference_exact", p.reference_exact);
  }
};

}  // namespace kvsift::detail
