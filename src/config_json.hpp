// Strict JSON <-> config structs for the registry (private to src/). Each config lists its fields
// once, in a `fields(Visitor&, Config&)` function; the same list reads a config (unknown key,
// wrong type or non-integral value for an int: kvsift::Error naming the key and the value) and
// writes its defaults (the valid keys, for help texts and the docs).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift::detail {

// An enum's JSON spelling: {{"max", GqaReduce::max}, ...}.
template <class E>
using EnumNames = std::vector<std::pair<const char*, E>>;

// Reads the fields present in `j` into a config; remembers every key it was asked about.
class JsonReader {
 public:
  JsonReader(std::string_view method, const nlohmann::json& j) : method_(method), j_(j) {}

  template <class T>
  void operator()(const char* key, T& value) {
    keys_.push_back(key);
    auto it = j_.find(key);
    if (it != j_.end()) read(key, *it, value);
  }
  template <class E>
  void operator()(const char* key, E& value, const EnumNames<E>& names) {
    keys_.push_back(key);
    auto it = j_.find(key);
    if (it == j_.end()) return;
    std::string known;
    for (const auto& [n, e] : names) {
      known += (known.empty() ? "" : ", ") + std::string(n);
      if (it->is_string() && it->template get<std::string>() == n) {
        value = e;
        return;
      }
    }
    fail(key, *it, "one of " + known);
  }
  // A nested object read by its own field list.
  template <class C, class Fields>
  void object(const char* key, C& value, Fields fields) {
    keys_.push_back(key);
    auto it = j_.find(key);
    if (it == j_.end()) return;
    if (!it->is_object()) fail(key, *it, "an object");
    JsonReader inner(method_ + "." + key, *it);
    fields(inner, value);
    inner.finish();
  }

  // Throws for the first key no field claimed, listing the valid ones.
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      bool known = false;
      for (const std::string& k : keys_) known = known || k == it.key();
      if (known) continue;
      std::string valid;
      for (const std::string& k : keys_) valid += (valid.empty() ? "" : ", ") + k;
      KVSIFT_FAIL(method_, " config: unknown key '", it.key(), "' (valid keys: ", valid, ")");
    }
  }

 private:
  [[noreturn]] void fail(const char* key, const nlohmann::json& v, const std::string& want) const {
    KVSIFT_FAIL(method_, " config: '", key, "' must be ", want, ", got ", v.dump());
  }
  template <class I>
  void read_int(const char* key, const nlohmann::json& v, I& out, const char* want = "an integer") {
    if (!v.is_number()) fail(key, v, want);
    const double d = v.get<double>();
    if (!(std::isfinite(d) && d == std::floor(d) &&
          d >= static_cast<double>(std::numeric_limits<I>::lowest()) &&
          d <= static_cast<double>(std::numeric_limits<I>::max())))
      fail(key, v, want);
    out = v.is_number_integer() ? v.get<I>() : static_cast<I>(d);
  }
  void read(const char* key, const nlohmann::json& v, int& out) { read_int(key, v, out); }
  void read(const char* key, const nlohmann::json& v, std::int64_t& out) { read_int(key, v, out); }
  void read(const char* key, const nlohmann::json& v, float& out) {
    if (!v.is_number()) fail(key, v, "a number");
    out = v.get<float>();
  }
  void read(const char* key, const nlohmann::json& v, bool& out) {
    if (!v.is_boolean()) fail(key, v, "true or false");
    out = v.get<bool>();
  }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  void read(const char* key, const nlohmann::json& v, std::vector<I>& out) {
    if (!v.is_array()) fail(key, v, "an array of integers");
    std::vector<I> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) read_int(key, v[i], r[i], "an array of integers");
    out = std::move(r);
  }
  template <class F, std::enable_if_t<std::is_floating_point_v<F>, int> = 0>
  void read(const char* key, const nlohmann::json& v, std::vector<F>& out) {
    if (!v.is_array()) fail(key, v, "an array of numbers");
    std::vector<F> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number()) fail(key, v, "an array of numbers");
      r[i] = v[i].get<F>();
    }
    out = std::move(r);
  }

  std::string method_;
  const nlohmann::json& j_;
  std::vector<std::string> keys_;
};

// Writes every field (the defaults, when given a default-constructed config).
class JsonWriter {
 public:
  template <class T>
  void operator()(const char* key, T& value) {
    if constexpr (std::is_floating_point_v<T>) {
      j[key] = std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
    } else {
      j[key] = value;
    }
  }
  template <class E>
  void operator()(const char* key, E& value, const EnumNames<E>& names) {
    for (const auto& [n, e] : names)
      if (e == value) j[key] = n;
  }
  template <class C, class Fields>
  void object(const char* key, C& value, Fields fields) {
    JsonWriter inner;
    fields(inner, value);
    j[key] = inner.j;
  }
  nlohmann::json j = nlohmann::json::object();
};

// Parses `text` as a JSON object (empty: {}); errors name the method.
inline nlohmann::json parse_config_object(std::string_view method, std::string_view text) {
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos) return nlohmann::json::object();
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  KVSIFT_CHECK(!j.is_discarded(), std::string(method),
               " config: not valid JSON: ", std::string(text));
  KVSIFT_CHECK(j.is_object(), std::string(method), " config: expected a JSON object, got ",
               j.dump());
  return j;
}

// Reads a config of type C from `text` with its field list, then validates it.
template <class C, class Fields>
C read_config(std::string_view method, std::string_view text, Fields fields, C config = C{}) {
  const nlohmann::json j = parse_config_object(method, text);
  JsonReader reader(method, j);
  fields(reader, config);
  reader.finish();
  config.validate();
  return config;
}

template <class C, class Fields>
std::string write_defaults(Fields fields, C config = C{}) {
  JsonWriter w;
  fields(w, config);
  return w.j.dump();
}

}  // namespace kvsift::detail
