// A small `--flag value` parser for the tool's subcommands. Unknown flags, missing values and
// malformed numbers are kvsift::Errors naming the flag, so every subcommand fails the same way.
// Numbers go through the library's strict parser (core/parse_number.hpp): an integer flag never
// truncates ("16.7") or wraps ("4294967312" for an int), a real flag is finite and in range.
#pragma once

#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/parse_number.hpp"

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
  // The flag as an Int within [min, max], else `fallback` when absent. Errors name the flag
  // ("flag --budget") and quote the text as given.
  template <class Int>
  Int integer(const std::string& key, Int fallback, Int min = std::numeric_limits<Int>::lowest(),
              Int max = std::numeric_limits<Int>::max()) const {
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    return parse_integer<Int>(it->second, "flag --" + key, min, max);
  }
  // The flag as a finite real within [min, max], else `fallback` when absent.
  double real(const std::string& key, double fallback,
              double min = -std::numeric_limits<double>::max(),
              double max = std::numeric_limits<double>::max()) const {
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    return parse_real(it->second, "flag --" + key, min, max);
  }

 private:
  std::set<std::string> known_, switches_;
  std::map<std::string, std::string> values_;
};

}  // namespace kvsift::tool
