// `kvsift replay` for KIVI cases (docs/algorithms.md §5.1): the library's golden-format runner.
#include "kvsift/policy/quantizers/kivi_replay.hpp"
#include "replay.hpp"

namespace kvsift::tool {

SafetensorsFile replay_kivi(const SafetensorsFile& in) { return kivi_replay(in); }

}  // namespace kvsift::tool
