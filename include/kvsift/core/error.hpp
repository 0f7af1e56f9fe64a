// kvsift::Error and KVSIFT_CHECK: every rejected input raises one, with a message that names the
// argument and the values that were wrong.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvsift {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}
}  // namespace detail

}  // namespace kvsift

// KVSIFT_CHECK(cond, "budget (", budget, ") must exceed window (", window, ")")
#define KVSIFT_CHECK(cond, ...)                                                 \
  do {                                                                          \
    if (!(cond)) throw ::kvsift::Error(::kvsift::detail::concat(__VA_ARGS__)); \
  } while (0)

#define KVSIFT_FAIL(...) throw ::kvsift::Error(::kvsift::detail::concat(__VA_ARGS__))
