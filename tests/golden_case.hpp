// Shared helpers of the golden parity tests (golden/README.md): loading a case into owned fp32
// buffers and views, the score tolerance, and the kept-set rule that allows swaps only at the cut.
// Used by the CPU tests (test_golden_rkv, test_sentence_scorer) and the GPU test
// tests/cuda/test_rkv_scoring_cuda.cpp (which finds this header through tests/ on its include
// path).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/backend/cpu/score_tensor.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"
#include "kvsift/core/safetensors.hpp"

namespace kvsift::test {

inline std::string golden_path(const std::string& name) {
  return std::string(KVSIFT_GOLDEN_DIR) + "/" + name;
}

// One golden case as owned fp32 buffers plus the views over them. `values` falls back to the keys,
// `queries` and `mask` stay empty when the case has no such tensor (callers that need them check).
struct GoldenCase {
  SafetensorsFile file;
  nlohmann::json config;            // the case's "config" metadata (budget, window, kernel, ...)
  std::vector<float> keys, values;  // [batch, kv_heads, seq, dim]
  std::vector<float> queries;       // [batch, q_heads, window, dim]
  std::vector<std::uint8_t> mask;   // [batch, seq], 1 = real token
  std::vector<std::int32_t> lengths;
  std::int64_t batch = 0, kv_heads = 0, seq = 0, dim = 0, q_heads = 0, window = 0;

  explicit GoldenCase(const std::string& name) : file(SafetensorsFile::load(golden_path(name))) {
    config = nlohmann::json::parse(file.metadata().at("config"));
    const StTensor& k = file.get("keys");
    REQUIRE(k.shape.size() == 4);
    batch = k.shape[0], kv_heads = k.shape[1], seq = k.shape[2], dim = k.shape[3];
    keys = k.to_f32();
    if (file.has("values"))
      values = file.get("values", k.shape).to_f32();
    else
      values = keys;
    if (file.has("queries")) {
      const StTensor& q = file.get("queries", {batch, -1, -1, dim});
      q_heads = q.shape[1], window = q.shape[2];
      queries = q.to_f32();
    }
    if (file.has("valid_mask")) {
      const std::vector<std::int64_t> m = file.get("valid_mask", {batch, seq}).to_i64();
      mask.assign(m.begin(), m.end());
    }
    lengths.assign(static_cast<std::size_t>(batch), static_cast<std::int32_t>(seq));
  }
  KVCacheView kv() {
    return make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, batch, kv_heads,
                              seq, dim, lengths.data(), mask.empty() ? nullptr : mask.data());
  }
  TensorView q() {
    return TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                  {batch, q_heads, window, dim});
  }
  // Left pads of sequence b: the leading zeros of its mask row (0 without a mask).
  std::int64_t pads(std::int64_t b) const {
    if (mask.empty()) return 0;
    std::int64_t p = 0;
    while (p < seq && mask[b * seq + p] == 0) ++p;
    return p;
  }
};

// The score tolerance of the golden cases, |x − ref| <= 1e-6 + 1e-4·|ref| (golden/README.md);
// the GPU tests hold their scores to the CPU reference with the same bound.
inline bool within_score_tolerance(double x, double ref) {
  return std::fabs(x - ref) <= 1e-6 + 1e-4 * std::fabs(ref);
}

// Compares the first `n` entries of every (b, h) row of `ours` with a reference [B, H, n] tensor.
inline void check_scores(const cpu::ScoreTensor& ours, const std::vector<float>& ref,
                         std::int64_t n, const char* what) {
  std::int64_t bad = 0;
  for (std::int64_t b = 0; b < ours.batch(); ++b) {
    REQUIRE(ours.count(b) == n);
    for (std::int64_t h = 0; h < ours.kv_heads(); ++h)
      for (std::int64_t j = 0; j < n; ++j) {
        const float r = ref[(b * ours.kv_heads() + h) * n + j];
        if (!within_score_tolerance(ours.at(b, h, j), r) && bad++ < 5)
          UNSCOPED_INFO(what << " [" << b << ", " << h << ", " << j << "]: " << ours.at(b, h, j)
                             << " vs reference " << r);
      }
  }
  INFO(what << ": " << bad << " entries outside |x-ref| <= 1e-6 + 1e-4|ref|");
  CHECK(bad == 0);
}

// Kept sets: every (b, h) row of `plan` keeps `budget` slots, its first budget − W equal the
// reference's keep_sorted [B, H, budget − W] except for tokens whose reference score
// ([B, H, S − W]) lies within 1e-6 of the cut (the (budget − W)-th largest), and the window's W
// slots follow. golden/README.md. Returns how many slots were kept by one side only.
inline std::int64_t check_kept_sets(const KeepPlan& plan,
                                    const std::vector<std::int64_t>& ref_sorted,
                                    const std::vector<float>& ref_score, std::int64_t kv_heads,
                                    std::int64_t seq, std::int64_t budget, std::int64_t window) {
  const std::int64_t H = kv_heads, keep = budget - window, n = seq - window;
  std::int64_t swapped = 0;
  for (std::int64_t b = 0; b < plan.batch(); ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      REQUIRE(plan.row_size(b, h) == budget);
      const std::int32_t* row = plan.row(b, h);
      const float* rs = &ref_score[(b * H + h) * n];
      std::vector<float> sorted(rs, rs + n);
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const float cut = sorted[keep - 1];
      std::vector<std::int64_t> ours(row, row + keep);
      std::vector<std::int64_t> ref(&ref_sorted[(b * H + h) * keep],
                                    &ref_sorted[(b * H + h) * keep] + keep);
      REQUIRE(std::is_sorted(ref.begin(), ref.end()));
      std::vector<std::int64_t> diff;
      std::set_symmetric_difference(ours.begin(), ours.end(), ref.begin(), ref.end(),
                                    std::back_inserter(diff));
      for (std::int64_t j : diff) {
        INFO("(b=" << b << ", h=" << h << ") slot " << j << " kept by one side only; score "
                   << rs[j] << ", cut " << cut);
        CHECK(std::fabs(rs[j] - cut) <= 1e-6f);
      }
      swapped += static_cast<std::int64_t>(diff.size());
      for (std::int64_t k = 0; k < window; ++k) CHECK(row[keep + k] == seq - window + k);
    }
  return swapped;
}

}  // namespace kvsift::test
