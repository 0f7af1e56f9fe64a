// `kvsift replay`: runs a stream case of a cache method (a prefill, then one token per decode step;
// method and every parameter from the case's __metadata__.config) and returns every output tensor
// the golden README lists for that method, under the same names, shapes and dtypes.
// One function per method (replay_<method>.cpp), one line each in the dispatch table (replay.cpp).
#pragma once

#include <string>

#include "kvsift/core/safetensors.hpp"

namespace kvsift::tool {

// `what` names the input in error messages.
SafetensorsFile replay_pmkvq(const SafetensorsFile& in, const std::string& what);

}  // namespace kvsift::tool
