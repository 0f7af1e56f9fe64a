// The one table of methods. make_policy(), the kvsift tool, the C API, the Python package and the
// docs all read it; adding a method is its header plus one line in src/policy_registry.cpp
// (CONTRIBUTING.md).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/policy/cache_owning_policy.hpp"
#include "kvsift/policy/policy.hpp"

namespace kvsift {

struct MethodInfo {
  std::string_view name;     // "rkv": what engines put in their config
  std::string_view family;   // "baseline", "skipkv", "thinkv", ...
  std::string_view summary;  // one line for help texts and the docs
  unsigned needs;            // the Needs bits its observe() reads (with the default config)
  // True for methods that own their KV storage (CacheOwningPolicy, e.g. ThinKV): create is
  // nullptr and create_cache_owning builds them. False: a Policy over the engine's cache.
  bool owns_cache;
  // Build the method from a JSON object of its config's fields ("{}": the defaults of
  // docs/algorithms.md §4). Unknown keys, wrong types and invalid values raise kvsift::Error
  // naming the key and the value.
  std::unique_ptr<Policy> (*create)(std::string_view json_config);
  std::unique_ptr<CacheOwningPolicy> (*create_cache_owning)(std::string_view json_config);
  // Every config key with its default value, as a JSON object (the valid keys).
  std::string (*default_config)();
  // A config that creates the method: "{}" unless it has required fields (ThinKV's calibrated
  // thresholds and layers); for docs, help texts and the generic tests.
  std::string_view example_config;
};

// Every registered method, in table order.
const std::vector<MethodInfo>& registered_methods();
// The entry for `name`; throws kvsift::Error naming the unknown name and listing the known ones.
const MethodInfo& method_info(std::string_view name);
// The names in table order (cache-owning methods included).
std::vector<std::string> policy_names();

// The keys of `json_config` that method `name`'s config has, the others dropped: one set of
// shared knobs ({"budget": 256, "window": 8, ...}) for several methods (the tool's flags).
// Only for shared knobs: make_policy() itself rejects unknown keys.
std::string filter_config(std::string_view name, std::string_view json_config);

// make_policy("rkv", R"({"budget": 512})"). Throws for a cache-owning method (use
// make_cache_owning_policy) and for an unknown name.
std::unique_ptr<Policy> make_policy(std::string_view name, std::string_view json_config = "{}");
// make_cache_owning_policy("thinkv", R"({"theta1": 0.2, ...})"). Throws for a Policy method.
std::unique_ptr<CacheOwningPolicy> make_cache_owning_policy(std::string_view name,
                                                            std::string_view json_config = "{}");

}  // namespace kvsift
