#include "kvsift/version.hpp"

namespace kvsift {

std::string version_string() {
  return std::to_string(KVSIFT_VERSION_MAJOR) + "." + std::to_string(KVSIFT_VERSION_MINOR) + "." +
         std::to_string(KVSIFT_VERSION_PATCH);
}

}  // namespace kvsift
