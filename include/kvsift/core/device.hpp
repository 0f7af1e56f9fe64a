// Where a view's memory lives; the backend is picked from it.
#pragma once

#include <string_view>

namespace kvsift {

enum class Device { cpu, cuda };

inline constexpr std::string_view device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

}  // namespace kvsift
