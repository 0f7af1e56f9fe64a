// `kvsift replay --case FILE --out OUT`: runs a stream case of one of the seeds' baselines
// (docs/algorithms.md §5) and writes every output tensor the golden
// README lists for that method, under the same names, shapes and dtypes. The case's
// __metadata__.config names the method ("method": "kivi"); each method has one replay_<method>.cpp
// with one function and one line in the table of replay.cpp.
#pragma once

#include <string>
#include <vector>

#include "kvsift/core/safetensors.hpp"

namespace kvsift::tool {

// One method's run: the case (inputs + config metadata) in, the outputs out.
using ReplayFn = SafetensorsFile (*)(const SafetensorsFile& in);

SafetensorsFile replay_kivi(const SafetensorsFile& in);  // replay_kivi.cpp
// replay_pmkvq.cpp; `what` names the case in error messages ("case" in the one-argument form).
SafetensorsFile replay_pmkvq(const SafetensorsFile& in, const std::string& what);
SafetensorsFile replay_pmkvq(const SafetensorsFile& in);
SafetensorsFile replay_lazy(const SafetensorsFile& in);  // replay_lazy.cpp

int run_replay(const std::vector<std::string>& argv);

}  // namespace kvsift::tool
