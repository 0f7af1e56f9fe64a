// make_policy / policy_names: the baselines and SkipKV by name, mapped from the shared
// PolicyOptions.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/policy/baselines/full_kv.hpp"
#include "kvsift/policy/baselines/h2o.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/baselines/rkv.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"
#include "kvsift/policy/baselines/snapkv.hpp"
#include "kvsift/policy/baselines/streaming_llm.hpp"

namespace kvsift {

std::vector<std::string> policy_names() {
  return {"fullkv", "streaming", "h2o", "snapkv", "rkv", "skipkv"};
}

std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyOptions& o) {
  if (name == "fullkv") return std::make_unique<FullKV>();
  if (name == "streaming") {
    StreamingLLMConfig c;
    c.budget = o.budget;
    c.sink = o.sink;
    c.buffer = o.buffer;
    return std::make_unique<StreamingLLM>(c);
  }
  if (name == "h2o") {
    H2OConfig c;  // recent = budget / 2, H2O's default
    c.budget = o.budget;
    c.buffer = o.buffer;
    return std::make_unique<H2O>(c);
  }
  if (name == "snapkv") {
    SnapKVConfig c;  // pooling, reduction and GQA stay SnapKV's (avg, sum, mean)
    c.budget = o.budget;
    c.window = o.window;
    c.kernel = o.kernel;
    c.buffer = o.buffer;
    return std::make_unique<SnapKV>(c);
  }
  if (name == "rkv") {
    RKVConfig c;  // options.sink is StreamingLLM's; R-KV keeps no sinks by default
    c.budget = o.budget;
    c.window = o.window;
    c.buffer = o.buffer;
    c.kernel = o.kernel;
    c.mix_lambda = o.mix_lambda;
    c.threshold = o.threshold;
    return std::make_unique<RKV>(c);
  }
  if (name == "skipkv") {
    SkipKVConfig c;  // R1-Distill-Qwen ids, τ 0.95, steering defaults (docs/algorithms.md §4)
    c.batch = 0;     // a host creating it by name may not know the batch yet: sized by observe()
    c.budget = o.budget;
    c.window = o.window;
    c.buffer = o.buffer;
    c.kernel = o.kernel;
    c.mix_lambda = o.mix_lambda;
    c.threshold = o.threshold;
    c.hidden_size = o.hidden_size;
    return std::make_unique<SkipKV>(c);
  }
  std::string known;
  for (const std::string& n : policy_names()) known += (known.empty() ? "" : ", ") + n;
  KVSIFT_FAIL("unknown policy '", std::string(name), "' (known: ", known, ")");
}

}  // namespace kvsift
