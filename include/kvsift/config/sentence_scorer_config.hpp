// SkipKV's eviction-score config (docs/algorithms.md §2.4), shared by the CPU reference and the
// CUDA backend.
#pragma once

#include "kvsift/config/options.hpp"
#include "kvsift/config/rkv_config.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

struct SentenceScorerConfig {
  // The R-KV part of eq. 6 (§1.3): budget, window, kernel, λ, threshold, redundancy mode, GQA
  // reduction and the CUDA search option, computed by the R-KV scorer itself. Its `buffer` is
  // the SkipKV trigger's (§1.3); SkipKV keeps no sinks, so `sink` must stay 0.
  RKVConfig rkv;
  PadMode pad_mode = PadMode::exclude;  // faithful: pads +100, force-kept (the reference)

  void validate() const {
    rkv.validate();
    KVSIFT_CHECK(rkv.sink == 0,
                 "SentenceScorerConfig: SkipKV keeps no sinks, got rkv.sink = ", rkv.sink);
  }
  TopKSelection selection() const { return {rkv.budget, rkv.window, 0}; }
};

}  // namespace kvsift
