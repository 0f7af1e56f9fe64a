// The registry table (policy/registry.hpp): one line per method. A method's line names it, says
// what it observes, and points at its factory: the config read strictly from JSON by its field
// list (config_fields.hpp), validated, then the policy built from it.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "config_fields.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/policy/baselines/full_kv.hpp"
#include "kvsift/policy/baselines/h2o.hpp"
#include "kvsift/policy/baselines/lazy_eviction.hpp"
#include "kvsift/policy/baselines/raas.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/baselines/snapkv.hpp"
#include "kvsift/policy/baselines/streaming_llm.hpp"
#include "kvsift/policy/quantizers/kivi_policy.hpp"
#include "kvsift/policy/quantizers/pmkvq_policy.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "kvsift/policy/thinkv/thinkv_policy.hpp"

namespace kvsift {

namespace {

// Policy P built from Config C read by field list F. The method name (for errors) is a template
// argument so that each line gives a plain function pointer.
template <const char* Name, class P, class C, class F>
std::unique_ptr<Policy> create(std::string_view json) {
  return std::make_unique<P>(detail::read_config<C>(Name, json, F{}));
}
template <const char* Name>
std::unique_ptr<Policy> create_fullkv(std::string_view json) {
  detail::read_config<detail::EmptyConfig>(Name, json, detail::EmptyFields{});
  return std::make_unique<FullKV>();
}
template <const char* Name, class P, class C, class F>
std::unique_ptr<CacheOwningPolicy> create_owning(std::string_view json) {
  return std::make_unique<P>(detail::read_config<C>(Name, json, F{}));
}
template <class C, class F>
std::string defaults() {
  return detail::write_defaults<C>(F{});
}

// SkipKV created by name: the batch is usually unknown until the first observation.
SkipKVConfig skipkv_defaults() {
  SkipKVConfig c;
  c.batch = 0;
  return c;
}
template <const char* Name>
std::unique_ptr<Policy> create_skipkv(std::string_view json) {
  return std::make_unique<SkipKV>(
      detail::read_config<SkipKVConfig>(Name, json, detail::SkipKVFields{}, skipkv_defaults()));
}
std::string skipkv_default_json() {
  return detail::write_defaults<SkipKVConfig>(detail::SkipKVFields{}, skipkv_defaults());
}

constexpr char kFullKV[] = "fullkv", kStreaming[] = "streaming", kH2O[] = "h2o",
               kSnapKV[] = "snapkv", kRKV[] = "rkv", kSkipKV[] = "skipkv", kThinKV[] = "thinkv",
               kLazy[] = "lazy", kRaaS[] = "raas";
constexpr char kKivi[] = "kivi", kPmkvq[] = "pmkvq";
using detail::H2OFields, detail::LazyFields, detail::RaasFields, detail::RKVFields,
    detail::SnapKVFields, detail::StreamingFields, detail::ThinKVFields, detail::EmptyConfig,
    detail::EmptyFields;

// Small geometries the generic tests drive (2 layers, 2 KV heads, 4 query heads, head_dim 16).
// KIVI-2 with groups of 16 (the smallest 2-bit group that fills whole int32 words) and R = 32;
// PM-KVQ with per-layer budgets that halve layer 0 to 4 bits and layer 1 to 8 over ~160 tokens.
constexpr std::string_view kKiviExample =
    R"({"num_layers": 2, "kv_heads": 2, "q_heads": 4, "head_dim": 16, "group_size": 16,)"
    R"( "residual_length": 32})";
constexpr std::string_view kPmkvqExample =
    R"({"num_layers": 2, "kv_heads": 2, "q_heads": 4, "head_dim": 16, "group_size": 16,)"
    R"( "n_window": 16, "kv_budget_mb": [0.01, 0.02]})";

// A ThinKV config that validates: its thresholds and calibrated layers have no defaults.
constexpr std::string_view kThinKVExample =
    R"({"num_layers": 2, "kv_heads": 2, "q_heads": 4, "head_dim": 16, "budget": 64,)"
    R"( "theta1": 0.3, "theta2": 0.6, "calibrated_layers": [0]})";

}  // namespace

const std::vector<MethodInfo>& registered_methods() {
  static const std::vector<MethodInfo> table = {
      // name, family, summary, needs, owns_cache, create, create_cache_owning, defaults, example
      {kFullKV, "baseline", "keeps every token (the memory and recall reference)", kNeedsNothing,
       false, create_fullkv<kFullKV>, nullptr, defaults<EmptyConfig, EmptyFields>, "{}"},
      {kStreaming, "baseline", "StreamingLLM: attention sinks plus the most recent tokens",
       kNeedsNothing, false, create<kStreaming, StreamingLLM, StreamingLLMConfig, StreamingFields>,
       nullptr, defaults<StreamingLLMConfig, StreamingFields>, "{}"},
      {kH2O, "baseline", "H2O: heavy hitters by attention accumulated over the decode steps",
       kNeedsQueries, false, create<kH2O, H2O, H2OConfig, H2OFields>, nullptr,
       defaults<H2OConfig, H2OFields>, "{}"},
      {kLazy, "baseline", "LazyEviction: recurrence-aware eviction every window steps",
       kNeedsQueries, false, create<kLazy, LazyEviction, LazyConfig, LazyFields>, nullptr,
       defaults<LazyConfig, LazyFields>, "{}"},
      {kRaaS, "baseline", "RaaS: oldest-timestamp eviction of tokens or pages, prompt pinned",
       kNeedsQueries, false, create<kRaaS, RaaS, RaasConfig, RaasFields>, nullptr,
       defaults<RaasConfig, RaasFields>, R"({"unit": "page", "budget": 256})"},
      {kSnapKV, "baseline", "SnapKV: observation-window attention, pooled", kNeedsNothing, false,
       create<kSnapKV, SnapKV, SnapKVConfig, SnapKVFields>, nullptr,
       defaults<SnapKVConfig, SnapKVFields>, "{}"},
      {kRKV, "baseline", "R-KV: window importance minus key redundancy", kNeedsNothing, false,
       create<kRKV, RKV, RKVConfig, RKVFields>, nullptr, defaults<RKVConfig, RKVFields>, "{}"},
      // + kNeedsHidden once hidden_size > 0 (sentence embeddings)
      {kSkipKV, "skipkv", "SkipKV: R-KV score minus redundant-sentence penalties, steering",
       kNeedsTokens, false, create_skipkv<kSkipKV>, nullptr, skipkv_default_json, "{}"},
      {kThinKV, "thinkv",
       "ThinKV: thought-typed quantization and segment eviction (owns its cache)",
       kNeedsAppend | kNeedsQueries, true, nullptr,
       create_owning<kThinKV, ThinKVPolicy, ThinKVPolicyConfig, ThinKVFields>,
       defaults<ThinKVPolicyConfig, ThinKVFields>, kThinKVExample},
      {kKivi, "quantizer",
       "KIVI: 2/4-bit keys per channel, values per token, full-precision residual (owns its "
       "cache)",
       kNeedsAppend, true, nullptr,
       create_owning<kKivi, KiviPolicy, KiviPolicyConfig, detail::KiviFields>,
       defaults<KiviPolicyConfig, detail::KiviFields>, kKiviExample},
      {kPmkvq, "quantizer",
       "PM-KVQ: body width halved 16/8/4/2 bits under per-layer byte budgets (owns its cache)",
       kNeedsAppend, true, nullptr,
       create_owning<kPmkvq, PmkvqPolicy, PmkvqPolicyConfig, detail::PmkvqFields>,
       defaults<PmkvqPolicyConfig, detail::PmkvqFields>, kPmkvqExample},
  };
  return table;
}

std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (const MethodInfo& m : registered_methods()) names.emplace_back(m.name);
  return names;
}

const MethodInfo& method_info(std::string_view name) {
  for (const MethodInfo& m : registered_methods())
    if (m.name == name) return m;
  std::string known;
  for (const std::string& n : policy_names()) known += (known.empty() ? "" : ", ") + n;
  KVSIFT_FAIL("unknown policy '", std::string(name), "' (known: ", known, ")");
}

std::string filter_config(std::string_view name, std::string_view json_config) {
  const MethodInfo& m = method_info(name);
  const nlohmann::json given = detail::parse_config_object(name, json_config);
  const nlohmann::json valid = nlohmann::json::parse(m.default_config());
  nlohmann::json kept = nlohmann::json::object();
  for (auto it = given.begin(); it != given.end(); ++it)
    if (valid.contains(it.key())) kept[it.key()] = it.value();
  return kept.dump();
}

std::unique_ptr<Policy> make_policy(std::string_view name, std::string_view json_config) {
  const MethodInfo& m = method_info(name);
  KVSIFT_CHECK(!m.owns_cache, "make_policy: '", std::string(name),
               "' owns its KV cache; build it with make_cache_owning_policy()");
  return m.create(json_config);
}

std::unique_ptr<CacheOwningPolicy> make_cache_owning_policy(std::string_view name,
                                                            std::string_view json_config) {
  const MethodInfo& m = method_info(name);
  KVSIFT_CHECK(m.owns_cache, "make_cache_owning_policy: '", std::string(name),
               "' plans over the engine's cache; build it with make_policy()");
  return m.create_cache_owning(json_config);
}

}  // namespace kvsift
