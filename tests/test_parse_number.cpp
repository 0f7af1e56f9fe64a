// The strict number parsers (core/parse_number.hpp, core/json_number.hpp): the cases of issue 13
// (4294967312 for an int, 16.7 for an integer, nan/inf/1e20, trailing junk, empty) and their
// messages, which must quote the argument name and the text as given.
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>

#include "catch.hpp"
#include "kvsift/core/json_number.hpp"
#include "kvsift/core/parse_number.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

TEST_CASE("parse_integer accepts plain decimal integers within range") {
  REQUIRE(parse_integer<int>("16", "--budget") == 16);
  REQUIRE(parse_integer<int>("+16", "--budget") == 16);
  REQUIRE(parse_integer<int>("-7", "--x") == -7);
  REQUIRE(parse_integer<int>("2147483647", "--x") == 2147483647);
  REQUIRE(parse_integer<std::int64_t>("9223372036854775807", "--x") ==
          std::numeric_limits<std::int64_t>::max());
  REQUIRE(parse_integer<int>("5", "--k", 1, 9) == 5);
}

TEST_CASE("parse_integer rejects wrap-arounds, fractions, junk and empties by name") {
  // 4294967312 = 2^32 + 16 used to run as budget 16.
  REQUIRE_THROWS_WITH(parse_integer<int>("4294967312", "--budget"),
                      Contains("--budget: '4294967312' is out of range [-2147483648, 2147483647]"));
  REQUIRE_THROWS_WITH(parse_integer<int>("16.7", "--budget"),
                      Contains("--budget: expected an integer, got '16.7'"));
  REQUIRE_THROWS_WITH(parse_integer<int>("12abc", "--window"), Contains("trailing 'abc'"));
  REQUIRE_THROWS_WITH(parse_integer<int>("", "--window"),
                      Contains("--window: expected an integer, got an empty value"));
  REQUIRE_THROWS_WITH(parse_integer<int>(" 3", "--window"), Contains("got ' 3'"));
  REQUIRE_THROWS_WITH(parse_integer<int>("1e3", "--window"), Contains("trailing 'e3'"));
  REQUIRE_THROWS_WITH(parse_integer<int>("0x10", "--window"), Contains("trailing 'x10'"));
  REQUIRE_THROWS_WITH(parse_integer<int>("-", "--window"),
                      Contains("expected an integer, got '-'"));
  REQUIRE_THROWS_WITH(parse_integer<std::int64_t>("99999999999999999999", "--n"),
                      Contains("out of range"));
  REQUIRE_THROWS_WITH(parse_integer<int>("0", "--grid", 16, 4096),
                      Contains("--grid: '0' is out of range [16, 4096]"));
  REQUIRE_THROWS_WITH(parse_integer<std::uint32_t>("-1", "--u"), Contains("out of range"));
  REQUIRE_THROWS_WITH(parse_integer<std::uint8_t>("256", "--u8"), Contains("[0, 255]"));
}

TEST_CASE("parse_real accepts finite numbers and rejects nan, inf and out-of-range values") {
  REQUIRE(parse_real("0.5", "--tau") == 0.5);
  REQUIRE(parse_real("-1e-3", "--x") == -1e-3);
  REQUIRE(parse_real(".25", "--x") == 0.25);
  REQUIRE(parse_float("1.25", "--alpha0") == 1.25f);
  REQUIRE_THROWS_WITH(parse_real("nan", "--alpha0"),
                      Contains("--alpha0: expected a number, got 'nan'"));
  REQUIRE_THROWS_WITH(parse_real("inf", "--gamma"), Contains("got 'inf'"));
  REQUIRE_THROWS_WITH(parse_real("-inf", "--gamma"), Contains("'-inf'"));
  REQUIRE_THROWS_WITH(parse_real("1e999", "--gamma"), Contains("'1e999' is not a finite number"));
  REQUIRE_THROWS_WITH(parse_float("1e39", "--gamma"), Contains("'1e39' is out of range"));
  REQUIRE_THROWS_WITH(parse_real("1e20", "--tau", 0.0, 1.0),
                      Contains("--tau: '1e20' is out of range [0, 1]"));
  REQUIRE_THROWS_WITH(parse_real("0x1p3", "--x"),
                      Contains("expected a finite number, got '0x1p3'"));
  REQUIRE_THROWS_WITH(parse_real("1.5x", "--x"), Contains("got '1.5x'"));
  REQUIRE_THROWS_WITH(parse_real("", "--x"),
                      Contains("--x: expected a number, got an empty value"));
  REQUIRE_THROWS_WITH(parse_real("1.2.3", "--x"), Contains("trailing '.3'"));
}

TEST_CASE("JSON config integers must be integral and in range") {
  const auto cfg = nlohmann::json::parse(
      R"({"budget": 16.7, "window": 8, "kernel": 7.0, "big": 4294967312, "neg": -3,
          "text": "16", "flag": true, "huge": 1e300})");
  REQUIRE_THROWS_WITH(config_integer<int>(cfg, "budget", 0),
                      Contains("config key 'budget': expected an integer, got 16.7"));
  REQUIRE(config_integer<int>(cfg, "window", 0) == 8);
  REQUIRE(config_integer<int>(cfg, "kernel", 0) == 7);  // 7.0 is an integral value
  REQUIRE(config_integer<int>(cfg, "missing", 42) == 42);
  REQUIRE_THROWS_WITH(config_integer<int>(cfg, "big", 0),
                      Contains("config key 'big': 4294967312 is out of range"));
  REQUIRE_THROWS_WITH(config_integer<int>(cfg, "neg", 0, 0, 100),
                      Contains("-3 is out of range [0, 100]"));
  REQUIRE_THROWS_WITH(config_integer<int>(cfg, "text", 0),
                      Contains("expected an integer, got \"16\""));
  REQUIRE_THROWS_WITH(config_integer<int>(cfg, "flag", 0), Contains("got true"));
  REQUIRE_THROWS_WITH(config_integer<int>(cfg, "huge", 0), Contains("out of range"));
  REQUIRE(config_integer<std::int64_t>(cfg, "big", 0) == 4294967312LL);
}

TEST_CASE("JSON config reals must be finite and in range") {
  const auto cfg =
      nlohmann::json::parse(R"({"tau": 0.95, "lambda": 2, "bad": "0.1", "big": 1e300})");
  REQUIRE(config_real(cfg, "tau", 0.0) == 0.95);
  REQUIRE(config_real(cfg, "lambda", 0.0) == 2.0);
  REQUIRE_THROWS_WITH(config_real(cfg, "tau", 0.0, 0.0, 0.5),
                      Contains("config key 'tau': 0.95 is out of range [0, 0.5]"));
  REQUIRE_THROWS_WITH(config_real(cfg, "bad", 0.0), Contains("expected a number, got \"0.1\""));
  REQUIRE_THROWS_WITH(json_float(cfg["big"], "threshold"),
                      Contains("threshold: 1e+300 is out of range"));
}
