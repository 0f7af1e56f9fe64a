// `kvsift replay`: the per-method runners of stream cases (golden/README.md). Each method's file
// (replay_<method>.cpp) defines one function; replay.cpp's table maps the case's config "method"
// to it.
#pragma once

#include <string>

#include "kvsift/core/safetensors.hpp"

namespace kvsift::tool {

// Runs the stream case `in` and returns every output tensor the README lists for its method,
// under the README's names, shapes and dtypes.
SafetensorsFile replay_lazy(const SafetensorsFile& in);

}  // namespace kvsift::tool
