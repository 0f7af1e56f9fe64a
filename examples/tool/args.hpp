// A small `--flag value` parser for the tool's subcommands. Unknown flags, missing values and
// malformed numbers are kvsift::Errors naming the flag, so every subcommand fails the same way.
#pragma once

#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift::tool {

class Args {
 public:
  // `known` lists the flags this subcommand accepts (without "--"); `switches` those that take no
  // value.
  Args(const std::vector<std::string>& argv, std::set<std::string> known,
       std::set<std::string> switches = {})
      : known_(std::move(known)), switches_(std::move(switches)) {
    for (std::size_t i = 0; i < argv.size(); ++i) {
      const std::string& a = argv[i];
      KVSIFT_CHECK(a.rfind("--", 0) == 0, "unexpected argument '", a, "' (flags start with --)");
      std::string key = a.substr(2), value;
      const auto eq = key.find('=');
      if (eq != std::string::npos) {
        value = key.substr(eq + 1);
        key = key.substr(0, eq);
      } else if (switches_.count(key) == 0) {
        KVSIFT_CHECK(i + 1 < argv.size(), "flag --", key, " needs a value");
        value = argv[++i];
      }
      KVSIFT_CHECK(known_.count(key) || switches_.count(key), "unknown flag --", key);
      values_[key] = value;
    }
  }

  bool has(const std::string& key) const { return values_.count(key) != 0; }

  std::string str(const std::string& key, const std::string& fallback) const {
    auto it = values_.find(key);
    return it == values_.end() ? fallback : it->second;
  }
  std::string required(const std::string& key) const {
    auto it = values_.find(key);
    KVSIFT_CHECK(it != values_.end() && !it->second.empty(), "missing required flag --", key);
    return it->second;
  }
  long integer(const std::string& key, long fallback) const {
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    char* end = nullptr;
    const long v = std::strtol(it->second.c_str(), &end, 10);
    KVSIFT_CHECK(end != it->second.c_str() && *end == '\0', "flag --", key,
                 " expects an integer, got '", it->second, "'");
    return v;
  }
  double real(const std::string& key, double fallback) const {
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    char* end = nullptr;
    const double v = std::strtod(it->second.c_str(), &end);
    KVSIFT_CHECK(end != it->second.c_str() && *end == '\0', "flag --", key,
                 " expects a number, got '", it->second, "'");
    return v;
  }

 private:
  std::set<std::string> known_, switches_;
  std::map<std::string, std::string> values_;
};

}  // namespace kvsift::tool
