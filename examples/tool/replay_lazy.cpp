// `kvsift replay` for LazyEviction stream cases (golden/README.md "LazyEviction";
// docs/algorithms.md §5.3): the reference stream, per query head, counters in the case's dtype.
#include "kvsift/policy/baselines/lazy_case.hpp"
#include "replay.hpp"

namespace kvsift::tool {

SafetensorsFile replay_lazy(const SafetensorsFile& in) {
  const lazy::Case c = lazy::load_case(in);
  const lazy::StreamResult r =
      lazy::run_stream(c.shape, c.cfg, c.fp16, c.prefill_keys, c.decode_keys, c.decode_queries);
  return lazy::write_outputs(r, c);
}

}  // namespace kvsift::tool
