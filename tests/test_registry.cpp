// The registry table: every name creates (from "{}" or its example config), names round-trip,
// and bad configs raise errors that name the problem (unknown method, unknown key with the valid
// ones listed, wrong type, non-integral int, invalid value, not an object).
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "catch.hpp"
#include "kvsift/policy/registry.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

TEST_CASE("every registered method creates from its example config", "[registry]") {
  std::set<std::string> names;
  for (const MethodInfo& m : registered_methods()) {
    INFO(m.name);
    CHECK(names.insert(std::string(m.name)).second);  // unique
    CHECK(!m.family.empty());
    CHECK(!m.summary.empty());
    REQUIRE((m.create != nullptr) != m.owns_cache);
    REQUIRE((m.create_cache_owning != nullptr) == m.owns_cache);
    CHECK(&method_info(m.name) == &m);
    const nlohmann::json defaults = nlohmann::json::parse(m.default_config());
    REQUIRE(defaults.is_object());
    if (m.owns_cache) {
      auto p = make_cache_owning_policy(m.name, m.example_config);
      CHECK(p->name() == m.name);
      CHECK(p->needs() == m.needs);
      REQUIRE_THROWS_WITH(make_policy(m.name, m.example_config),
                          Contains("owns its KV cache") && Contains("make_cache_owning_policy"));
    } else {
      auto p = make_policy(m.name, m.example_config);
      CHECK(p->name() == m.name);
      CHECK(p->needs() == m.needs);
      // The written defaults read back.
      CHECK(make_policy(m.name, m.default_config())->name() == m.name);
      REQUIRE_THROWS_WITH(make_cache_owning_policy(m.name), Contains("make_policy"));
    }
  }
  for (const char* expected : {"fullkv", "streaming", "h2o", "lazy", "raas", "snapkv", "rkv",
                               "skipkv", "thinkv", "kivi", "pmkvq"})
    CHECK(names.count(expected) == 1);
  CHECK(policy_names().size() == registered_methods().size());
}

TEST_CASE("registry errors name the problem", "[registry][errors]") {
  REQUIRE_THROWS_WITH(make_policy("quest"),
                      Contains("unknown policy 'quest'") && Contains("rkv") && Contains("thinkv"));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"budgte": 512})"),
                      Contains("rkv config") && Contains("unknown key 'budgte'") &&
                          Contains("valid keys: budget, window"));
  REQUIRE_THROWS_WITH(make_policy("h2o", R"({"window": 8})"),
                      Contains("unknown key 'window'") && Contains("recent"));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"budget": "512"})"),
                      Contains("'budget' must be an integer") && Contains("\"512\""));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"budget": 512.5})"),
                      Contains("'budget' must be an integer") && Contains("512.5"));
  REQUIRE_THROWS_WITH(make_policy("snapkv", R"({"budget": 1e12})"),
                      Contains("'budget' must be an integer"));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"mix_lambda": true})"),
                      Contains("'mix_lambda' must be a number") && Contains("true"));
  REQUIRE_THROWS_WITH(make_policy("snapkv", R"({"pooling": "median"})"),
                      Contains("'pooling' must be one of max, avg") && Contains("median"));
  REQUIRE_THROWS_WITH(make_policy("rkv", R"({"budget": 4})"),
                      Contains("budget (4)") && Contains("window"));
  REQUIRE_THROWS_WITH(make_policy("lazy", R"({"counters": "fp8"})"),
                      Contains("'counters' must be one of int32, fp16") && Contains("fp8"));
  REQUIRE_THROWS_WITH(make_policy("lazy", R"({"budget": 16, "window": 16})"),
                      Contains("budget (16) must exceed window (16)"));
  REQUIRE_THROWS_WITH(make_policy("rkv", "[1, 2]"), Contains("expected a JSON object"));
  REQUIRE_THROWS_WITH(make_policy("rkv", "{budget: 3"), Contains("not valid JSON"));
  REQUIRE_THROWS_WITH(
      make_policy("skipkv", R"({"steering": {"alpha": 1}})"),
      Contains("skipkv.steering config") && Contains("unknown key 'alpha'") && Contains("alpha0"));
  REQUIRE_THROWS_WITH(make_policy("skipkv", R"({"delimiters": [198, 1.5]})"),
                      Contains("'delimiters' must be an array of integers"));
  REQUIRE_THROWS_WITH(make_cache_owning_policy("thinkv"), Contains("theta1"));
  // ThinKV's 16-bit staging dtype is a named field: bf16 or f16, nothing else.
  const std::string thinkv =
      R"({"num_layers": 1, "kv_heads": 1, "q_heads": 1, "head_dim": 16, "theta1": 0.3,
          "theta2": 0.6, "calibrated_layers": [0], "staging": )";
  CHECK(make_cache_owning_policy("thinkv", thinkv + R"("f16"})") != nullptr);
  REQUIRE_THROWS_WITH(make_cache_owning_policy("thinkv", thinkv + R"("f32"})"),
                      Contains("staging") && Contains("f32"));
  // ThinKV's refill rule (docs/thinkv.md §6): run (default) or the regroup experiment, by name.
  const std::string geometry =
      R"({"num_layers": 1, "kv_heads": 1, "q_heads": 1, "head_dim": 16, "theta1": 0.3,
          "theta2": 0.6, "calibrated_layers": [0], )";
  CHECK(make_cache_owning_policy("thinkv", geometry + R"("refill": "regroup"})") != nullptr);
  CHECK(make_cache_owning_policy("thinkv", geometry + R"("refill": "run",
                                                          "regroup_min_free": 4})") != nullptr);
  REQUIRE_THROWS_WITH(make_cache_owning_policy("thinkv", geometry + R"("refill": "gather"})"),
                      Contains("refill") && Contains("gather"));
  REQUIRE_THROWS_WITH(make_cache_owning_policy("thinkv", geometry + R"("refill": 1})"),
                      Contains("refill"));
  REQUIRE_THROWS_WITH(make_cache_owning_policy(
                          "thinkv", geometry + R"("refill": "regroup", "regroup_min_free": 0})"),
                      Contains("regroup_min_free must be in [1, 15], got 0"));
  // The quantizers: KIVI's bit widths, PM-KVQ's required budgets, their count and the backend.
  REQUIRE_THROWS_WITH(make_cache_owning_policy("kivi", R"({"k_bits": 3})"),
                      Contains("k_bits must be 2, 4 or 8, got 3"));
  REQUIRE_THROWS_WITH(make_cache_owning_policy("kivi", R"({"head_dim": 48})"),
                      Contains("head_dim (48)") && Contains("group_size (32)"));
  REQUIRE_THROWS_WITH(make_cache_owning_policy("pmkvq"),
                      Contains("kv_budget_mb must hold at least one budget"));
  REQUIRE_THROWS_WITH(
      make_cache_owning_policy("pmkvq", R"({"num_layers": 3, "kv_budget_mb": [1, 2]})"),
      Contains("kv_budget_mb holds 2 budgets") && Contains("num_layers = 3"));
  REQUIRE_THROWS_WITH(make_cache_owning_policy("pmkvq", R"({"kv_budget_mb": [1, "2"]})"),
                      Contains("'kv_budget_mb' must be an array of numbers"));
  REQUIRE_THROWS_WITH(
      make_cache_owning_policy("pmkvq", R"({"backend": "fast", "kv_budget_mb": [1]})"),
      Contains("'backend' must be one of real, fake") && Contains("fast"));
  REQUIRE_THROWS_WITH(
      make_cache_owning_policy("pmkvq", R"({"reference_exact": 1, "kv_budget_mb": [1]})"),
      Contains("'reference_exact' must be true or false"));
  // An integral float is an integer.
  CHECK(make_policy("rkv", R"({"budget": 512.0})") != nullptr);
}

TEST_CASE("filter_config keeps the keys a method has", "[registry]") {
  const std::string shared = R"({"budget": 64, "window": 4, "sink": 2, "hidden_size": 8})";
  CHECK(nlohmann::json::parse(filter_config("h2o", shared)) == nlohmann::json{{"budget", 64}});
  CHECK(nlohmann::json::parse(filter_config("streaming", shared)) ==
        nlohmann::json{{"budget", 64}, {"sink", 2}});
  CHECK(nlohmann::json::parse(filter_config("skipkv", shared)) ==
        nlohmann::json{{"budget", 64}, {"window", 4}, {"hidden_size", 8}});
  REQUIRE_THROWS_WITH(filter_config("quest", shared), Contains("'quest'"));
}
