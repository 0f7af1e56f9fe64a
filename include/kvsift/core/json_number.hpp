// Strict numbers from JSON config values (a case's __metadata__.config, calibration settings):
// the JSON counterpart of core/parse_number.hpp, with the same rules and messages. An integer
// field must hold an integer — 16.7 is an error, not 16; 16.0 (an integral value) is accepted —
// within the caller's range; a real field must be a finite number within its range. Booleans,
// strings and nulls are errors naming the key and quoting the value as written.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvsift/core/error.hpp"

namespace kvsift {

template <class Int>
Int json_integer(const nlohmann::json& v, std::string_view name,
                 Int min = std::numeric_limits<Int>::lowest(),
                 Int max = std::numeric_limits<Int>::max()) {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>, "an integer type");
  const std::string key(name);
  KVSIFT_CHECK(v.is_number(), key, ": expected an integer, got ", v.dump());
  bool in_range = false;
  long double value = 0;
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    in_range = min <= 0
                   ? u <= static_cast<std::uint64_t>(max)
                   : u >= static_cast<std::uint64_t>(min) && u <= static_cast<std::uint64_t>(max);
    if (in_range) return static_cast<Int>(u);
  } else if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if constexpr (std::is_signed_v<Int>) {
      in_range = i >= static_cast<std::int64_t>(min) && i <= static_cast<std::int64_t>(max);
    } else {
      in_range = i >= 0 && static_cast<std::uint64_t>(i) >= static_cast<std::uint64_t>(min) &&
                 static_cast<std::uint64_t>(i) <= static_cast<std::uint64_t>(max);
    }
    if (in_range) return static_cast<Int>(i);
  } else {
    const double d = v.get<double>();
    KVSIFT_CHECK(std::isfinite(d) && d == std::floor(d), key, ": expected an integer, got ",
                 v.dump());
    value = d;
    in_range = value >= static_cast<long double>(min) && value <= static_cast<long double>(max);
    if (in_range) return static_cast<Int>(d);
  }
  KVSIFT_FAIL(key, ": ", v.dump(), " is out of range [", +min, ", ", +max, "]");
}

inline double json_real(const nlohmann::json& v, std::string_view name,
                        double min = -std::numeric_limits<double>::max(),
                        double max = std::numeric_limits<double>::max()) {
  const std::string key(name);
  KVSIFT_CHECK(v.is_number(), key, ": expected a number, got ", v.dump());
  const double d = v.get<double>();
  KVSIFT_CHECK(std::isfinite(d), key, ": ", v.dump(), " is not a finite number");
  KVSIFT_CHECK(d >= min && d <= max, key, ": ", v.dump(), " is out of range [", min, ", ", max,
               "]");
  return d;
}

inline float json_float(const nlohmann::json& v, std::string_view name,
                        float min = -std::numeric_limits<float>::max(),
                        float max = std::numeric_limits<float>::max()) {
  return static_cast<float>(json_real(v, name, min, max));
}

// The config key `key` of object `cfg` when present, else `fallback`; strict as above.
template <class Int>
Int config_integer(const nlohmann::json& cfg, const char* key, Int fallback,
                   Int min = std::numeric_limits<Int>::lowest(),
                   Int max = std::numeric_limits<Int>::max()) {
  if (!cfg.is_object() || !cfg.contains(key)) return fallback;
  return json_integer<Int>(cfg.at(key), std::string("config key '") + key + "'", min, max);
}

inline double config_real(const nlohmann::json& cfg, const char* key, double fallback,
                          double min = -std::numeric_limits<double>::max(),
                          double max = std::numeric_limits<double>::max()) {
  if (!cfg.is_object() || !cfg.contains(key)) return fallback;
  return json_real(cfg.at(key), std::string("config key '") + key + "'", min, max);
}

}  // namespace kvsift
