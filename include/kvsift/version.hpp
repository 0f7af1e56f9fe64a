// The library's version, for tools and logs.
#pragma once

#include <string>

#include "kvsift/core/config.hpp"

namespace kvsift {
std::string version_string();
}  // namespace kvsift
