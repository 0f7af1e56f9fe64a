// The one table of methods. make_policy(), the kvsift tool, the C API, the Python package and the
// docs all read it; adding a method is its header plus one line in src/policy_registry.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/policy/policy.hpp"

namespace kvsift {

struct MethodInfo {
  std::string_view name;     // "rkv": what engines put in their config
  std::string_view family;   // "baseline", "skipkv", "thinkv", ...
  std::string_view summary;  // one line for help texts and the docs
  unsigned needs;            // the Needs bits its observe() reads
  // Builds the method from a JSON object of its config's fields ("{}": the defaults of
  // docs/algorithms.md §4). Unknown keys, wrong types and invalid values raise kvsift::Error
  // naming the key and the value.
  std::unique_ptr<Policy> (*create)(std::string_view json_config);
};

// Every registered method, in table order.
const std::vector<MethodInfo>& registered_methods();
// The entry for `name`; throws kvsift::Error naming the unknown name and listing the known ones.
const MethodInfo& method_info(std::string_view name);
std::vector<std::string> policy_names();

// make_policy("rkv", R"({"budget": 512})").
std::unique_ptr<Policy> make_policy(std::string_view name, std::string_view json_config = "{}");

// TRANSITIONAL (removed once every caller builds from JSON): the old shared knobs.
struct PolicyOptions {
  int budget = 1024;
  int window = 8;
  int buffer = 128;
  int kernel = 7;
  float mix_lambda = 0.1f;
  float threshold = 0.5f;
  int sink = 4;
  std::int64_t hidden_size = 0;
};
std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyOptions& options);

}  // namespace kvsift
