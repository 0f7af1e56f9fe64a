// LazyEviction golden helpers: loading a lazy_* case's inputs and config, turning a stream
// result into the README's tensors, and the README's comparison rule (golden/README.md
// "LazyEviction"). Shared by the parity test and the replay test.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/baselines/lazy_case.hpp"
#include "kvsift/policy/baselines/lazy_stream.hpp"

namespace kvsift::test {

inline std::string golden_path(const std::string& name) {
  return std::string(KVSIFT_GOLDEN_DIR) + "/" + name;
}

// fp16 ulp of x (the spacing of the fp16 grid at |x|).
inline double f16_ulp(double x) {
  const double a = std::fabs(x);
  if (a < 6.103515625e-05) return 5.960464477539063e-08;
  return std::ldexp(1.0, int(std::floor(std::log2(a))) - 10);
}

// The README's rule: every tensor exact except cand_score (tolerance); names, shapes, dtypes
// equal.
inline void check_lazy_outputs(const SafetensorsFile& ref, const SafetensorsFile& ours, bool fp16) {
  for (const char* n : {"evict_steps", "hit_count", "cand_pos", "cand_score", "cand_ts", "cand_mri",
                        "kept_pos", "kept_ts", "kept_mri", "final_pos", "final_ts", "final_mri"}) {
    INFO("tensor " << n);
    const StTensor& r = ref.get(n);
    REQUIRE(ours.has(n));
    const StTensor& o = ours.get(n);
    REQUIRE(o.dtype == r.dtype);
    REQUIRE(o.shape == r.shape);
    if (r.dtype == StDType::i32) {
      CHECK(o.to_i64() == r.to_i64());
      continue;
    }
    const std::vector<float> rv = r.to_f32(), ov = o.to_f32();
    std::int64_t bad = 0;
    const bool tol = std::string(n) == "cand_score";
    for (std::size_t i = 0; i < rv.size(); ++i) {
      const double lim = !tol ? 0.0 : fp16 ? 8 * f16_ulp(rv[i]) : 1e-6 + 1e-5 * std::fabs(rv[i]);
      if (!(std::fabs(double(ov[i]) - double(rv[i])) <= lim) && bad++ < 5)
        UNSCOPED_INFO(n << "[" << i << "]: " << ov[i] << " vs golden " << rv[i]);
    }
    CHECK(bad == 0);
  }
}

}  // namespace kvsift::test
