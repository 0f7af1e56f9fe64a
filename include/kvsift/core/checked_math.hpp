// Overflow-checked size arithmetic: the one place where element counts, byte counts and offsets
// computed from untrusted extents (a file header, an engine's view, a config) are multiplied and
// added. Each function names the field in its kvsift::Error, so a hostile or careless size is
// reported instead of wrapping into a small buffer that then passes a later check.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "kvsift/core/error.hpp"

namespace kvsift {

// Non-throwing forms for callers that report the fault in their own words (the safetensors
// reader names the tensor and file): false when a or b is negative or the result overflows.
inline bool try_mul(std::int64_t a, std::int64_t b, std::int64_t* out) {
  if (a < 0 || b < 0 || (a != 0 && b > std::numeric_limits<std::int64_t>::max() / a)) return false;
  *out = a * b;
  return true;
}

// a * b for non-negative a, b; throws naming `what` when either is negative or the product
// exceeds int64.
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what) {
  KVSIFT_CHECK(a >= 0 && b >= 0, what, ": negative operand in ", a, " * ", b);
  KVSIFT_CHECK(a == 0 || b <= std::numeric_limits<std::int64_t>::max() / a, what, ": ", a, " * ", b,
               " overflows int64");
  return a * b;
}

// a + b for non-negative a, b; throws naming `what` on a negative operand or int64 overflow.
inline std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* what) {
  KVSIFT_CHECK(a >= 0 && b >= 0, what, ": negative operand in ", a, " + ", b);
  KVSIFT_CHECK(b <= std::numeric_limits<std::int64_t>::max() - a, what, ": ", a, " + ", b,
               " overflows int64");
  return a + b;
}

inline std::size_t checked_mul(std::size_t a, std::size_t b, const char* what) {
  KVSIFT_CHECK(a == 0 || b <= std::numeric_limits<std::size_t>::max() / a, what, ": ", a, " * ", b,
               " overflows size_t");
  return a * b;
}

inline std::size_t checked_add(std::size_t a, std::size_t b, const char* what) {
  KVSIFT_CHECK(b <= std::numeric_limits<std::size_t>::max() - a, what, ": ", a, " + ", b,
               " overflows size_t");
  return a + b;
}

// Product of `n` extents, each checked >= 0; `what` names the shape in errors.
inline std::int64_t checked_product(const std::int64_t* extents, std::size_t n, const char* what) {
  std::int64_t p = 1;
  for (std::size_t k = 0; k < n; ++k) {
    KVSIFT_CHECK(extents[k] >= 0, what, ": extent ", k, " is negative (", extents[k], ")");
    p = checked_mul(p, extents[k], what);
  }
  return p;
}

// An int64 count as a size_t that fits the address space, for allocation.
inline std::size_t checked_size(std::int64_t n, const char* what) {
  KVSIFT_CHECK(n >= 0, what, " is negative (", n, ")");
  KVSIFT_CHECK(static_cast<std::uint64_t>(n) <= std::numeric_limits<std::size_t>::max(), what, " (",
               n, ") does not fit size_t");
  return static_cast<std::size_t>(n);
}

// `count` elements of `elem_size` bytes must fit in `available` bytes: the check that bounds a
// count read from a file by what the file can hold, before anything is allocated.
inline void check_fits(std::int64_t count, std::int64_t elem_size, std::int64_t available,
                       const char* what) {
  const std::int64_t need = checked_mul(count, elem_size, what);
  KVSIFT_CHECK(need <= available, what, ": ", count, " elements of ", elem_size, " bytes need ",
               need, " bytes, only ", available, " available");
}

}  // namespace kvsift
