// The one strict number parser for everything a user types or a file states: command-line flags
// (the kvsift tool) and config values (core/json_number.hpp builds on it). Integers are
// range-checked and must be written as integers ("16.7", "4294967312" for an int, "12abc", " 3"
// and "" are errors, never truncated or wrapped); reals must be finite and inside the caller's
// range ("nan", "inf", "1e20" beyond it are errors). Every error quotes the argument's name and
// the text exactly as given.
#pragma once

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvsift/core/error.hpp"

namespace kvsift {

// Decimal integer, optional leading '+' or '-', nothing else; within [min, max].
template <class Int>
Int parse_integer(std::string_view text, std::string_view name,
                  Int min = std::numeric_limits<Int>::lowest(),
                  Int max = std::numeric_limits<Int>::max()) {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>, "an integer type");
  const std::string shown(text);
  KVSIFT_CHECK(!text.empty(), std::string(name), ": expected an integer, got an empty value");
  std::string_view digits = text;
  if (digits.front() == '+') digits.remove_prefix(1);  // from_chars takes '-' but not '+'
  KVSIFT_CHECK(!digits.empty() &&
                   (digits.front() == '-' || (digits.front() >= '0' && digits.front() <= '9')),
               std::string(name), ": expected an integer, got '", shown, "'");
  long long wide = 0;
  const char* end = digits.data() + digits.size();
  const auto [stop, ec] = std::from_chars(digits.data(), end, wide, 10);
  KVSIFT_CHECK(ec != std::errc::invalid_argument, std::string(name), ": expected an integer, got '",
               shown, "'");
  KVSIFT_CHECK(ec != std::errc::result_out_of_range, std::string(name), ": '", shown,
               "' is out of range [", +min, ", ", +max, "]");
  KVSIFT_CHECK(stop == end, std::string(name), ": expected an integer, got '", shown,
               "' (trailing '", std::string(stop, end), "')");
  bool in_range;
  if constexpr (std::is_signed_v<Int>) {
    in_range = wide >= static_cast<long long>(min) && wide <= static_cast<long long>(max);
  } else {
    in_range = wide >= 0 &&
               static_cast<unsigned long long>(wide) >= static_cast<unsigned long long>(min) &&
               static_cast<unsigned long long>(wide) <= static_cast<unsigned long long>(max);
  }
  KVSIFT_CHECK(in_range, std::string(name), ": '", shown, "' is out of range [", +min, ", ", +max,
               "]");
  return static_cast<Int>(wide);
}

// Decimal or scientific real ("0.5", "-1e-3"); finite and within [min, max]. No leading
// whitespace, no trailing text, no hex floats, no nan/inf.
inline double parse_real(std::string_view text, std::string_view name,
                         double min = -std::numeric_limits<double>::max(),
                         double max = std::numeric_limits<double>::max()) {
  const std::string shown(text);
  KVSIFT_CHECK(!text.empty(), std::string(name), ": expected a number, got an empty value");
  const char c = text.front();
  KVSIFT_CHECK(c == '+' || c == '-' || c == '.' || (c >= '0' && c <= '9'), std::string(name),
               ": expected a number, got '", shown, "'");
  for (char ch : text) {
    // strtod would accept "0x1p3", "infinity" and "nan(...)": letters other than an exponent
    // mark are refused up front.
    const bool ok =
        (ch >= '0' && ch <= '9') || ch == '.' || ch == '+' || ch == '-' || ch == 'e' || ch == 'E';
    KVSIFT_CHECK(ok, std::string(name), ": expected a finite number, got '", shown, "'");
  }
  errno = 0;
  char* stop = nullptr;
  const double v = std::strtod(shown.c_str(), &stop);
  KVSIFT_CHECK(stop != shown.c_str(), std::string(name), ": expected a number, got '", shown, "'");
  KVSIFT_CHECK(*stop == '\0', std::string(name), ": expected a number, got '", shown,
               "' (trailing '", stop, "')");
  KVSIFT_CHECK(std::isfinite(v) && !(errno == ERANGE && std::fabs(v) > 1.0), std::string(name),
               ": '", shown, "' is not a finite number");
  KVSIFT_CHECK(v >= min && v <= max, std::string(name), ": '", shown, "' is out of range [", min,
               ", ", max, "]");
  return v;
}

// parse_real, then within float's finite range (and [min, max]).
inline float parse_float(std::string_view text, std::string_view name,
                         float min = -std::numeric_limits<float>::max(),
                         float max = std::numeric_limits<float>::max()) {
  return static_cast<float>(parse_real(text, name, min, max));
}

}  // namespace kvsift
