// `--device cpu|cuda`, shared by `kvsift score` and `kvsift demo`: the one place that knows whether
// this build has the CUDA backend (KVSIFT_WITH_CUDA, defined by the kvsift::cuda target), so every
// subcommand refuses `--device cuda` in a CPU-only build with the same message.
#pragma once

#include <string>

#include "args.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::tool {

inline constexpr bool kBuiltWithCuda =
#if defined(KVSIFT_WITH_CUDA)
    true;
#else
    false;
#endif

// "cpu" (default) or "cuda"; throws kvsift::Error for anything else, and for "cuda" in a build
// without the CUDA backend.
inline std::string device_setting(const Args& a) {
  const std::string device = a.str("device", "cpu");
  KVSIFT_CHECK(device == "cpu" || device == "cuda", "--device must be 'cpu' or 'cuda', got '",
               device, "'");
  KVSIFT_CHECK(device == "cpu" || kBuiltWithCuda,
               "--device cuda: this kvsift was built without the CUDA backend (reconfigure with "
               "-DKVSIFT_CUDA=ON where the CUDA toolkit is installed)");
  return device;
}

}  // namespace kvsift::tool
