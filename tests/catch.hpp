// Catch2 v2 (Debian's catch2 2.13) and v3 both work: pick whichever header is installed, and keep
// the tests to spellings the two share.
#pragma once

#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
// v2's spelling of the substring matcher, so one test source serves both versions.
namespace Catch::Matchers {
inline StringContainsMatcher Contains(const std::string& str,
                                      CaseSensitive cs = CaseSensitive::Yes) {
  return ContainsSubstring(str, cs);
}
}  // namespace Catch::Matchers
using Catch::Approx;
#else
#include <catch2/catch.hpp>
using Catch::Detail::Approx;
#endif
