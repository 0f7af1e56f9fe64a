// kvsift::cuda R-KV scoring and selection against the CPU reference (policy/baselines/rkv.hpp), a
// naive O(S²) redundancy oracle written straight from docs/algorithms.md §1.2, and the golden cases
// of the published R-KV code. Scores: |x − ref| <= 1e-6 + 1e-4·|ref|; kept sets equal the
// reference's except for tokens within that tolerance of the cut; given the GPU's own scores the
// selection must equal the CPU selection rule exactly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "golden_case.hpp"
#include "kvsift/backend/cpu/select_topk.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/baselines/rkv.hpp"

using namespace kvsift;
using test::check_kept_sets;
using test::DeviceBuffer;
using test::within_score_tolerance;

namespace {

// Counts entries of `ours` [rows, stride] (first n of each row) outside tolerance of `ref`.
std::int64_t count_mismatches(const std::vector<float>& ours, std::int64_t ours_stride,
                              const std::function<float(std::int64_t, std::int64_t)>& ref,
                              std::int64_t rows, std::int64_t n, const char* what) {
  std::int64_t bad = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < n; ++j) {
      const float x = ours[r * ours_stride + j], y = ref(r, j);
      if (!within_score_tolerance(x, y)) {
        if (bad++ < 5)
          UNSCOPED_INFO(what << " row " << r << " slot " << j << ": " << x << " vs " << y);
      }
    }
  return bad;
}

// A host cache of storage type T with its device mirror, plus window queries.
template <class T>
struct TestCase {
  int B, Hkv, Hq, S, D, W;
  std::int64_t capacity;
  std::vector<T> keys, values, queries;
  std::vector<std::uint8_t> mask;  // empty: no pads
  std::vector<std::int32_t> host_lengths, dev_lengths;
  DeviceBuffer<T> d_keys, d_values, d_queries;
  DeviceBuffer<std::uint8_t> d_mask;

  TestCase(int b, int hkv, int hq, int s, int d, int w, std::vector<float> k, std::vector<float> q,
           std::vector<std::uint8_t> m = {}, int extra_capacity = 0)
      : B(b),
        Hkv(hkv),
        Hq(hq),
        S(s),
        D(d),
        W(w),
        capacity(s + extra_capacity),
        keys(convert(k)),
        values(keys),
        queries(convert(q)),
        mask(std::move(m)),
        host_lengths(b, s),
        dev_lengths(b, s),
        d_keys(keys),
        d_values(values),
        d_queries(queries),
        d_mask(mask.empty() ? std::vector<std::uint8_t>(1) : mask) {
    REQUIRE(keys.size() == static_cast<std::size_t>(B * Hkv * capacity * D));
    REQUIRE(queries.size() == static_cast<std::size_t>(B * Hq * W * D));
    REQUIRE((mask.empty() || mask.size() == static_cast<std::size_t>(B * capacity)));
  }

  static std::vector<T> convert(const std::vector<float>& x) {
    std::vector<T> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<T>(x[i]);
    return out;
  }
  KVCacheView host_kv() {
    return make_kv_cache_view(keys.data(), values.data(), dtype_of<T>::value, Device::cpu, B, Hkv,
                              capacity, D, host_lengths.data(),
                              mask.empty() ? nullptr : mask.data());
  }
  KVCacheView dev_kv() {
    return make_kv_cache_view(d_keys.get(), d_values.get(), dtype_of<T>::value, Device::cuda, B,
                              Hkv, capacity, D, dev_lengths.data(),
                              mask.empty() ? nullptr : d_mask.get());
  }
  TensorView host_q() {
    return TensorView::contiguous(queries.data(), dtype_of<T>::value, Device::cpu, {B, Hq, W, D});
  }
  TensorView dev_q() {
    return TensorView::contiguous(d_queries.get(), dtype_of<T>::value, Device::cuda, {B, Hq, W, D});
  }
};

// Keys [B, Hkv, capacity, D]: normal noise, plus `dup_fraction` of rows that copy an earlier row
// (with a little noise) so the last-match search finds near-duplicates, plus `shared` times a
// common direction per head (raises every cosine, so most rows match early).
std::vector<float> make_keys(int B, int H, std::int64_t C, int D, float dup_fraction, float shared,
                             std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  std::vector<float> k(static_cast<std::size_t>(B) * H * C * D);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      std::vector<float> common(D);
      for (auto& x : common) x = nd(rng);
      float* base = &k[(static_cast<std::size_t>(b) * H + h) * C * D];
      for (std::int64_t i = 0; i < C; ++i) {
        float* row = base + i * D;
        if (i > 0 && ud(rng) < dup_fraction) {
          const std::int64_t src = std::uniform_int_distribution<std::int64_t>(0, i - 1)(rng);
          for (int d = 0; d < D; ++d) row[d] = base[src * D + d] + 0.05f * nd(rng);
        } else {
          for (int d = 0; d < D; ++d) row[d] = nd(rng) + shared * common[d];
        }
      }
    }
  return k;
}

std::vector<float> make_queries(int B, int Hq, int W, int D, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(B) * Hq * W * D);
  for (auto& x : q) x = nd(rng);
  return q;
}

// docs/algorithms.md §1.2 as written, O(S²·D) in double: the full cosine matrix, the zeroed
// diagonal, the last match per row (faithful: column 0 when none), column means, softmax.
std::vector<double> naive_redundancy(const std::vector<float>& k, const std::uint8_t* valid, int S,
                                     int D, float threshold, bool faithful) {
  std::vector<double> kn(static_cast<std::size_t>(S) * D, 0.0);
  for (int i = 0; i < S; ++i) {
    if (valid != nullptr && !valid[i]) continue;  // pad: zero key
    double norm = 0;
    for (int d = 0; d < D; ++d) norm += double(k[i * D + d]) * k[i * D + d];
    norm = std::sqrt(norm) + 1e-8;
    for (int d = 0; d < D; ++d) kn[i * D + d] = k[i * D + d] / norm;
  }
  std::vector<double> c(static_cast<std::size_t>(S) * S);
  for (int i = 0; i < S; ++i)
    for (int j = 0; j < S; ++j) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += kn[i * D + d] * kn[j * D + d];
      c[i * S + j] = i == j ? 0.0 : dot;
    }
  for (int i = 0; i < S; ++i) {
    int r = -1;
    for (int j = 0; j < S; ++j)
      if (c[i * S + j] > threshold) r = j;
    if (r >= 0)
      c[i * S + r] = 0.0;
    else if (faithful)
      c[i * S + 0] = 0.0;
  }
  std::vector<double> rbar(S, 0.0);
  for (int j = 0; j < S; ++j) {
    for (int i = 0; i < S; ++i) rbar[j] += c[i * S + j];
    rbar[j] /= S;
  }
  const double m = *std::max_element(rbar.begin(), rbar.end());
  double sum = 0;
  for (double& x : rbar) sum += (x = std::exp(x - m));
  for (double& x : rbar) x /= sum;
  return rbar;
}

struct GpuScores {
  std::vector<float> score, importance, redundancy;  // [B*Hkv, n], [B*Hkv, n], [B*Hkv, S]
};

template <class T>
GpuScores gpu_scores(TestCase<T>& tc, const RKVConfig& cfg) {
  const std::int64_t rows = std::int64_t(tc.B) * tc.Hkv, n = tc.S - tc.W;
  DeviceBuffer<float> score(rows * n), imp(rows * n), red(rows * tc.S);
  KVCacheView kv = tc.dev_kv();
  DeviceBuffer<char> ws(cuda::rkv_workspace_bytes(kv, tc.dev_q(), cfg));
  cuda::rkv_score(kv, tc.dev_q(), cfg, {score.get(), imp.get(), red.get()}, ws.get(), ws.size(),
                  nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return {score.download(), imp.download(), red.download()};
}

template <class T>
KeepPlan gpu_plan(TestCase<T>& tc, const RKVConfig& cfg, bool* compressed,
                  std::vector<float>* scores = nullptr) {
  const std::int64_t rows = std::int64_t(tc.B) * tc.Hkv;
  DeviceBuffer<std::int32_t> slots(rows * cfg.budget);
  DeviceBuffer<float> sc(rows * std::max(tc.S - tc.W, 1));
  KVCacheView kv = tc.dev_kv();
  DeviceBuffer<char> ws(cuda::rkv_workspace_bytes(kv, tc.dev_q(), cfg));
  *compressed =
      cuda::rkv_select(kv, tc.dev_q(), cfg, slots.get(), sc.get(), ws.get(), ws.size(), nullptr);
  KeepPlan plan = cuda::download_keep_plan(kv, slots.get(), cfg.budget, cfg.window, nullptr);
  if (scores != nullptr) *scores = sc.download();
  return plan;
}

// The CPU reference takes the same config (config/rkv_config.hpp); tensor_core_search is a
// CUDA-only option it ignores.
RKVConfig cpu_config(const RKVConfig& c) { return c; }

// The whole comparison for one case: scores vs the CPU reference and the naive redundancy,
// the kept set vs the CPU plan (near-cut swaps only), the selection rule exactly on the GPU's
// own scores, and bitwise determinism across two runs.
template <class T>
void check_case(TestCase<T>& tc, const RKVConfig& cfg) {
  const std::int64_t rows = std::int64_t(tc.B) * tc.Hkv, n = tc.S - tc.W, H = tc.Hkv;
  const GpuScores g = gpu_scores(tc, cfg);
  const RKVScores ref = cpu::rkv_scores(tc.host_kv(), tc.host_q(), cpu_config(cfg));
  auto cpu_at = [&](const cpu::ScoreTensor& t) {
    return [&t, H](std::int64_t r, std::int64_t j) { return t.at(r / H, r % H, j); };
  };
  CHECK(count_mismatches(g.importance, n, cpu_at(ref.importance), rows, n, "importance") == 0);
  CHECK(count_mismatches(g.redundancy, tc.S, cpu_at(ref.redundancy_full), rows, tc.S,
                         "redundancy") == 0);
  CHECK(count_mismatches(g.score, n, cpu_at(ref.score), rows, n, "score") == 0);

  // Redundancy against the definition itself (double precision, full matrix).
  std::int64_t naive_bad = 0;
  for (int b = 0; b < tc.B; ++b)
    for (int h = 0; h < tc.Hkv; ++h) {
      std::vector<float> k(static_cast<std::size_t>(tc.S) * tc.D);
      for (int i = 0; i < tc.S; ++i)
        for (int d = 0; d < tc.D; ++d)
          k[i * tc.D + d] =
              to_float(tc.keys[((std::int64_t(b) * H + h) * tc.capacity + i) * tc.D + d]);
      const std::uint8_t* valid = tc.mask.empty() ? nullptr : &tc.mask[b * tc.capacity];
      const std::vector<double> r = naive_redundancy(k, valid, tc.S, tc.D, cfg.threshold,
                                                     cfg.redundancy == RedundancyMode::faithful);
      for (int j = 0; j < tc.S; ++j)
        naive_bad += within_score_tolerance(g.redundancy[(b * H + h) * tc.S + j], r[j]) ? 0 : 1;
    }
  CHECK(naive_bad == 0);

  bool compressed = false;
  std::vector<float> gpu_sc;
  const KeepPlan plan = gpu_plan(tc, cfg, &compressed, &gpu_sc);
  REQUIRE(compressed == (tc.S > cfg.budget));
  REQUIRE_NOTHROW(plan.validate());
  const KeepPlan cpu = cpu::plan_from_scores(tc.host_kv(), &ref.score, cpu_config(cfg).selection());
  REQUIRE(plan.kept_lengths() == cpu.kept_lengths());
  std::int64_t swapped = 0;
  for (int b = 0; b < tc.B; ++b)
    for (int h = 0; h < tc.Hkv; ++h) {
      const std::int64_t kept = plan.row_size(b, h);
      std::vector<std::int32_t> ours(plan.row(b, h), plan.row(b, h) + kept);
      std::vector<std::int32_t> theirs(cpu.row(b, h), cpu.row(b, h) + kept);
      if (!compressed) {
        CHECK(ours == theirs);
        continue;
      }
      // Exact selection rule on the GPU's own scores.
      const std::uint8_t* valid = tc.mask.empty() ? nullptr : &tc.mask[b * tc.capacity];
      std::vector<std::int32_t> expect;
      const float* row_sc = &gpu_sc[(b * H + h) * n];
      cpu::top_k_slots(row_sc, static_cast<std::int32_t>(n), valid, 0, cfg.budget - cfg.window,
                       expect);
      for (int j = static_cast<int>(n); j < tc.S; ++j) expect.push_back(j);
      CHECK(ours == expect);
      // Against the CPU's scores: differences only at the cut.
      std::vector<float> cand;
      for (std::int64_t j = 0; j < n; ++j)
        if (valid == nullptr || valid[j]) cand.push_back(ref.score.at(b, h, j));
      std::sort(cand.begin(), cand.end(), std::greater<float>());
      const std::size_t keep = std::min<std::size_t>(cand.size(), cfg.budget - cfg.window);
      const float cut = keep > 0 ? cand[keep - 1] : 0.0f;
      std::vector<std::int32_t> diff;
      std::set_symmetric_difference(ours.begin(), ours.end(), theirs.begin(), theirs.end(),
                                    std::back_inserter(diff));
      for (std::int32_t j : diff) {
        INFO("(b=" << b << ", h=" << h << ") slot " << j << " score " << ref.score.at(b, h, j)
                   << " cut " << cut);
        CHECK(within_score_tolerance(ref.score.at(b, h, j), cut));
      }
      swapped += static_cast<std::int64_t>(diff.size());
    }
  UNSCOPED_INFO(swapped << " near-cut slots differ from the CPU plan");

  // Determinism: a second run is bit-identical.
  const GpuScores again = gpu_scores(tc, cfg);
  CHECK(again.score == g.score);
  CHECK(again.redundancy == g.redundancy);
  bool compressed2 = false;
  const KeepPlan plan2 = gpu_plan(tc, cfg, &compressed2);
  CHECK(plan2.slots() == plan.slots());
}

template <class T>
void run_random(int B, int Hkv, int G, int S, int D, int W, int budget, int kernel, bool faithful,
                float dup, float shared, std::uint32_t seed, int pads_step = 0) {
  std::mt19937 rng(seed);
  const int Hq = Hkv * G;
  std::vector<std::uint8_t> mask;
  if (pads_step > 0) {  // left pads: sequence b has b * pads_step of them
    mask.assign(static_cast<std::size_t>(B) * S, 1);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < b * pads_step && i < S; ++i) mask[b * S + i] = 0;
  }
  TestCase<T> tc(B, Hkv, Hq, S, D, W, make_keys(B, Hkv, S, D, dup, shared, rng),
                 make_queries(B, Hq, W, D, rng), mask);
  RKVConfig cfg;
  cfg.budget = budget;
  cfg.window = W;
  cfg.kernel = kernel;
  cfg.redundancy = faithful ? RedundancyMode::faithful : RedundancyMode::sound;
  INFO("B=" << B << " Hkv=" << Hkv << " G=" << G << " S=" << S << " D=" << D << " W=" << W
            << " budget=" << budget << " faithful=" << faithful << " dtype "
            << dtype_name(dtype_of<T>::value));
  check_case(tc, cfg);
}

}  // namespace

TEST_CASE("cuda R-KV equals the CPU reference on random caches", "[cuda][rkv]") {
  SECTION("f32, multi-head, no duplicates") {
    run_random<float>(2, 2, 1, 300, 64, 8, 128, 7, false, 0.0f, 0.0f, 1);
  }
  SECTION("bf16, GQA group 4, batch 3, head_dim 128, near-duplicates") {
    run_random<bf16_t>(3, 4, 4, 260, 128, 8, 100, 7, false, 0.3f, 0.0f, 2);
  }
  SECTION("f16, tiny head_dim 3, group 3, window 5, kernel 5, faithful") {
    run_random<f16_t>(2, 2, 3, 150, 3, 5, 60, 5, true, 0.1f, 0.0f, 3);
  }
  SECTION("f32, group 12 (two register chunks), window 20 (three rounds), shared direction") {
    run_random<float>(1, 2, 12, 333, 40, 20, 150, 3, true, 0.0f, 1.5f, 4);
  }
  SECTION("bf16, left padding, faithful") {
    run_random<bf16_t>(3, 2, 2, 200, 32, 8, 120, 7, true, 0.2f, 0.0f, 5, 37);
  }
  SECTION("f32, heavy padding leaves fewer candidates than the budget") {
    run_random<float>(2, 1, 2, 140, 16, 4, 120, 7, false, 0.2f, 0.0f, 6, 60);
  }
  SECTION("f32, every row matches almost at once (early exit)") {
    run_random<float>(2, 2, 2, 700, 64, 8, 300, 7, false, 0.0f, 4.0f, 7);
  }
  SECTION("bf16, head_dim 320: normalisation and key sums in separate kernels, left padding") {
    run_random<bf16_t>(2, 2, 2, 200, 320, 8, 100, 7, true, 0.2f, 0.0f, 8, 30);
  }
}

TEST_CASE("cuda R-KV at or below the budget keeps everything", "[cuda][rkv]") {
  for (int S : {90, 100}) {  // S < budget and S == budget
    INFO("S = " << S);
    std::mt19937 rng(11);
    TestCase<bf16_t> tc(3, 2, 8, S, 16, 8, make_keys(3, 2, S + 10, 16, 0.1f, 0.0f, rng),
                        make_queries(3, 8, 8, 16, rng), {}, 10);
    RKVConfig cfg;
    cfg.budget = 100;
    bool compressed = true;
    const KeepPlan plan = gpu_plan(tc, cfg, &compressed);
    CHECK_FALSE(compressed);
    CHECK(plan.keeps_everything());
    for (int b = 0; b < 3; ++b)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < S; ++i) CHECK(plan.row(b, h)[i] == i);
  }
}

TEST_CASE("cuda R-KV matches the published reference (golden cases)", "[cuda][rkv][golden]") {
  for (const char* name :
       {"rkv_mha.safetensors", "rkv_gqa.safetensors", "rkv_batch2.safetensors"}) {
    INFO(name);
    const SafetensorsFile f = SafetensorsFile::load(test::golden_path(name));
    const nlohmann::json c = nlohmann::json::parse(f.metadata().at("config"));
    const StTensor& k = f.get("keys");
    const int B = int(k.shape[0]), H = int(k.shape[1]), S = int(k.shape[2]), D = int(k.shape[3]);
    const StTensor& q = f.get("queries");
    const int Hq = int(q.shape[1]), W = int(q.shape[2]);
    TestCase<float> tc(B, H, Hq, S, D, W, k.to_f32(), q.to_f32());
    RKVConfig cfg;
    cfg.budget = c.at("budget").get<int>();
    cfg.window = c.at("window").get<int>();
    cfg.kernel = c.at("kernel").get<int>();
    cfg.mix_lambda = c.at("mix_lambda").get<float>();
    cfg.threshold = c.at("threshold").get<float>();
    cfg.redundancy = RedundancyMode::faithful;  // the reference's column-0 fallback
    const std::int64_t rows = std::int64_t(B) * H, n = S - W;
    const GpuScores g = gpu_scores(tc, cfg);
    const std::vector<float> ref_a = f.get("importance").to_f32();
    const std::vector<float> ref_r = f.get("redundancy_full").to_f32();
    const std::vector<float> ref_s = f.get("score").to_f32();
    auto from = [](const std::vector<float>& v, std::int64_t stride) {
      return [&v, stride](std::int64_t r, std::int64_t j) { return v[r * stride + j]; };
    };
    CHECK(count_mismatches(g.importance, n, from(ref_a, n), rows, n, "importance") == 0);
    CHECK(count_mismatches(g.redundancy, S, from(ref_r, S), rows, S, "redundancy") == 0);
    CHECK(count_mismatches(g.score, n, from(ref_s, n), rows, n, "score") == 0);

    bool compressed = false;
    const KeepPlan plan = gpu_plan(tc, cfg, &compressed);
    REQUIRE(compressed);
    check_kept_sets(plan, f.get("keep_sorted").to_i64(), ref_s, H, S, cfg.budget, W);
  }
}

TEST_CASE("cuda R-KV redundancy: sparing the last near-duplicate, column-0 fallback",
          "[cuda][rkv][golden]") {
  const SafetensorsFile f = SafetensorsFile::load(test::golden_path("rkv_retain6.safetensors"));
  const nlohmann::json c = nlohmann::json::parse(f.metadata().at("config"));
  const StTensor& k = f.get("keys", {1, 1, 6, -1});
  const int D = int(k.shape[3]);
  // The case has no queries: any window-1 query drives the importance, only R is compared.
  TestCase<float> tc(1, 1, 1, 6, D, 1, k.to_f32(), std::vector<float>(D, 0.5f));
  RKVConfig cfg;
  cfg.budget = 4;
  cfg.window = 1;
  cfg.kernel = 1;
  cfg.threshold = c.at("threshold").get<float>();
  cfg.redundancy = RedundancyMode::faithful;
  const std::vector<float> ref = f.get("redundancy_full", {1, 1, 6}).to_f32();
  const GpuScores g = gpu_scores(tc, cfg);
  for (int j = 0; j < 6; ++j) {
    INFO("column " << j << ": " << g.redundancy[j] << " vs " << ref[j]);
    CHECK(within_score_tolerance(g.redundancy[j], ref[j]));
  }
  cfg.redundancy = RedundancyMode::sound;  // the sound mode moves column 0 only
  const GpuScores sound = gpu_scores(tc, cfg);
  CHECK(std::fabs(std::log(sound.redundancy[0] / sound.redundancy[1]) - std::log(ref[0] / ref[1])) >
        1e-3);
  for (int j = 2; j < 6; ++j)
    CHECK(std::fabs(std::log(sound.redundancy[j] / sound.redundancy[1]) -
                    std::log(ref[j] / ref[1])) < 1e-5);
}

TEST_CASE("cuda R-KV selection: ties go to the lower index, NaN is rejected", "[cuda][rkv]") {
  const int B = 1, H = 2, S = 20, W = 2, budget = 8;
  // Row 0: all scores equal -> the lowest 6 indices. Row 1: -0 and +0 tie, larger values win.
  std::vector<float> scores(static_cast<std::size_t>(B) * H * (S - W), 0.25f);
  float* r1 = &scores[S - W];
  for (int j = 0; j < S - W; ++j) r1[j] = (j % 2) ? -0.0f : 0.0f;
  r1[17] = 1.0f;
  r1[3] = std::numeric_limits<float>::infinity();
  DeviceBuffer<float> d_scores(scores);
  DeviceBuffer<std::int32_t> slots(B * H * budget);
  const std::vector<std::int32_t> row_lengths(B, S);
  cuda::select_topk_slots(d_scores.get(), row_lengths.data(), nullptr, B, H, S, budget, W,
                          slots.get(), nullptr);
  const std::vector<std::int32_t> got = slots.download();
  CHECK(std::vector<std::int32_t>(got.begin(), got.begin() + budget) ==
        std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 18, 19});
  CHECK(std::vector<std::int32_t>(got.begin() + budget, got.end()) ==
        std::vector<std::int32_t>{0, 1, 2, 3, 4, 17, 18, 19});

  r1[5] = std::nanf("");
  d_scores.upload(scores);
  cuda::select_topk_slots(d_scores.get(), row_lengths.data(), nullptr, B, H, S, budget, W,
                          slots.get(), nullptr);
  std::vector<std::int32_t> lengths = {S};
  DeviceBuffer<float> kv(static_cast<std::size_t>(B) * H * S * 4);
  const KVCacheView view =
      make_kv_cache_view(kv.get(), kv.get(), DType::f32, Device::cuda, B, H, S, 4, lengths.data());
  REQUIRE_THROWS_WITH(cuda::download_keep_plan(view, slots.get(), budget, W, nullptr),
                      Catch::Matchers::Contains("row (b=0, h=1) has a NaN score"));
}

TEST_CASE("cuda R-KV selection: the radix cut with heavy ties equals a sort", "[cuda][rkv]") {
  // Scores drawn from a few values (ties across every radix digit), with ±0 and ±inf, over rows
  // long enough to take several block-sized chunks; the oracle sorts by (score desc, index asc),
  // keeps the first budget − window, and lists them ascending, then the window.
  const int B = 3, H = 4, W = 8;
  const std::vector<float> values = {
      -std::numeric_limits<float>::infinity(), -2.5f, -0.0f, 0.0f, 1e-30f, 0.125f, 0.1250001f, 3.0f,
      std::numeric_limits<float>::infinity()};
  std::mt19937 rng(11);
  for (int S : {40, 300, 1152}) {
    for (int budget : {W + 1, S / 2, S - 1}) {
      INFO("S " << S << " budget " << budget);
      const int n = S - W;
      std::vector<float> scores(static_cast<std::size_t>(B) * H * n);
      for (std::size_t r = 0; r < scores.size() / n; ++r) {
        // Each row draws from a different number of distinct values: 1 (all tied) to all 9.
        const std::size_t distinct = 1 + r % values.size();
        for (int j = 0; j < n; ++j) scores[r * n + j] = values[rng() % distinct];
      }
      DeviceBuffer<float> d_scores(scores);
      DeviceBuffer<std::int32_t> slots(static_cast<std::size_t>(B) * H * budget);
      const std::vector<std::int32_t> lengths(B, S);
      cuda::select_topk_slots(d_scores.get(), lengths.data(), nullptr, B, H, S, budget, W,
                              slots.get(), nullptr);
      const std::vector<std::int32_t> got = slots.download();
      for (int r = 0; r < B * H; ++r) {
        INFO("row " << r);
        std::vector<int> order(n);
        for (int j = 0; j < n; ++j) order[j] = j;
        const float* row = &scores[static_cast<std::size_t>(r) * n];
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
        std::vector<std::int32_t> want(order.begin(), order.begin() + (budget - W));
        std::sort(want.begin(), want.end());
        for (int i = 0; i < W; ++i) want.push_back(n + i);
        CHECK(std::vector<std::int32_t>(
                  got.begin() + static_cast<std::ptrdiff_t>(r) * budget,
                  got.begin() + static_cast<std::ptrdiff_t>(r + 1) * budget) == want);
      }
    }
  }
}

TEST_CASE("cuda R-KV rejects bad calls with messages naming the values", "[cuda][rkv]") {
  std::mt19937 rng(21);
  TestCase<float> tc(2, 2, 4, 64, 8, 8, make_keys(2, 2, 64, 8, 0.0f, 0.0f, rng),
                     make_queries(2, 4, 8, 8, rng));
  RKVConfig cfg;
  cfg.budget = 32;
  DeviceBuffer<float> score(2 * 2 * 56);
  DeviceBuffer<std::int32_t> slots(2 * 2 * 32);
  const std::size_t bytes = cuda::rkv_workspace_bytes(tc.dev_kv(), tc.dev_q(), cfg);
  DeviceBuffer<char> ws(bytes);
  SECTION("config fields the kernels do not implement") {
    cfg.gqa = GqaReduce::mean;
    REQUIRE_THROWS_WITH(
        cuda::rkv_score(tc.dev_kv(), tc.dev_q(), cfg, {score.get()}, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains("RKVConfig.gqa = mean is not supported by the CUDA backend"));
    cfg.gqa = GqaReduce::max;
    cfg.sink = 2;
    REQUIRE_THROWS_WITH(
        cuda::rkv_select(tc.dev_kv(), tc.dev_q(), cfg, slots.get(), nullptr, ws.get(), ws.size(),
                         nullptr),
        Catch::Matchers::Contains("RKVConfig.sink = 2 is not supported by the CUDA backend"));
  }
  SECTION("a sequence no longer than the window cannot be scored") {
    tc.dev_lengths[1] = 8;
    REQUIRE_THROWS_WITH(
        cuda::rkv_score(tc.dev_kv(), tc.dev_q(), cfg, {score.get()}, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains("lengths[1] (8) must exceed the window (8)"));
  }
  SECTION("workspace too small") {
    REQUIRE_THROWS_WITH(cuda::rkv_select(tc.dev_kv(), tc.dev_q(), cfg, slots.get(), nullptr,
                                         ws.get(), 1000, nullptr),
                        Catch::Matchers::Contains("workspace of 1000 bytes is too small"));
  }
  SECTION("host cache") {
    REQUIRE_THROWS_WITH(cuda::rkv_workspace_bytes(tc.host_kv(), tc.dev_q(), cfg),
                        Catch::Matchers::Contains("the cache is in host memory"));
  }
  SECTION("queries dtype differs from the keys'") {
    TensorView q = tc.dev_q();
    q.dtype = DType::bf16;
    REQUIRE_THROWS_WITH(cuda::rkv_workspace_bytes(tc.dev_kv(), q, cfg),
                        Catch::Matchers::Contains("queries dtype bf16 != keys dtype f32"));
  }
  SECTION("window rows disagree with the config") {
    cfg.window = 4;
    REQUIRE_THROWS_WITH(
        cuda::rkv_workspace_bytes(tc.dev_kv(), tc.dev_q(), cfg),
        Catch::Matchers::Contains("queries hold 8 window rows, config window is 4"));
  }
  SECTION("even kernel and budget at the window") {
    cfg.kernel = 4;
    REQUIRE_THROWS_WITH(cfg.validate(),
                        Catch::Matchers::Contains("kernel must be odd and >= 1, got 4"));
    cfg.kernel = 7;
    cfg.budget = 8;
    REQUIRE_THROWS_WITH(cfg.validate(),
                        Catch::Matchers::Contains("budget (8) must exceed window + sink (8 + 0)"));
  }
  SECTION("null score output") {
    REQUIRE_THROWS_WITH(
        cuda::rkv_score(tc.dev_kv(), tc.dev_q(), cfg, {}, ws.get(), ws.size(), nullptr),
        Catch::Matchers::Contains("out.score must be a device pointer"));
  }
}
