// LazyEviction's counters and score on the GPU (backend/cuda/lazy_scoring.hpp, docs/algorithms.md
// §5.3) against the CPU reference (policy/baselines/lazy_counters.hpp): a ragged, left-padded
// batch with GQA observed for a prompt and many decode steps, TS/MRI compared exactly after every
// step and the scores within one fp32 (fp16) rounding, for int32 counters (including steps past
// 2^24, where the counters' fp32 rounding shows) and fp16 counters (steps past 2048 and up to
// 65504); weights exactly at alpha; pads with large weights that must not count; slots outside
// the rows untouched; a hand-worked row; error paths.
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/lazy_scoring.hpp"
#include "kvsift/policy/baselines/lazy_counters.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr std::int32_t kPoison = -7;
constexpr float kScorePoison = 12345.0f;

struct Batch {
  std::int64_t batch = 3, kv_heads = 2, q_heads = 6, capacity = 160;
  int window = 8;
  float alpha = 1e-3f;
  std::vector<std::int32_t> lengths = {100, 64, 120};
  std::vector<std::uint8_t> valid;  // [batch, capacity]: sequence 1 has 10 left pads
};

// One step's weights [batch, q_heads, capacity]: about 40% of the real slots above alpha, some
// exactly alpha, pads at 0.5 (the mask must drop them), slots past the length 0.
std::vector<float> step_probs(const Batch& bt, std::mt19937& rng) {
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> p(static_cast<std::size_t>(bt.batch * bt.q_heads * bt.capacity), 0.0f);
  for (std::int64_t b = 0; b < bt.batch; ++b)
    for (std::int64_t hq = 0; hq < bt.q_heads; ++hq)
      for (std::int64_t j = 0; j < bt.lengths[static_cast<std::size_t>(b)]; ++j) {
        float w = std::pow(unit(rng), 4.0f) * 0.01f;
        if (unit(rng) < 0.03f) w = bt.alpha;  // a tie with the threshold is a hit
        if (!bt.valid[static_cast<std::size_t>(b * bt.capacity + j)]) w = 0.5f;
        p[static_cast<std::size_t>((b * bt.q_heads + hq) * bt.capacity + j)] = w;
      }
  return p;
}

// "" when the counters of every row equal the CPU rows, slots past the length untouched.
std::string compare_counters(const Batch& bt, const std::vector<lazy::Row>& rows,
                             const std::vector<std::int32_t>& ts,
                             const std::vector<std::int32_t>& mri) {
  std::ostringstream os;
  for (std::int64_t r = 0; r < bt.batch * bt.kv_heads; ++r) {
    const std::int64_t len = bt.lengths[static_cast<std::size_t>(r / bt.kv_heads)];
    const lazy::Row& row = rows[static_cast<std::size_t>(r)];
    for (std::int64_t j = 0; j < bt.capacity; ++j) {
      const std::size_t at = static_cast<std::size_t>(r * bt.capacity + j);
      const std::int32_t want_ts = j < len ? row.ts[static_cast<std::size_t>(j)] : kPoison;
      const std::int32_t want_mri = j < len ? row.mri[static_cast<std::size_t>(j)] : kPoison;
      if (ts[at] != want_ts || mri[at] != want_mri) {
        os << "row " << r << " slot " << j << " (length " << len << "): GPU TS " << ts[at]
           << " MRI " << mri[at] << ", CPU TS " << want_ts << " MRI " << want_mri;
        return os.str();
      }
    }
  }
  return "";
}

// "" when every candidate score is within tolerance of lazy::score and the rest untouched.
std::string compare_scores(const Batch& bt, const std::vector<lazy::Row>& rows, std::int64_t t,
                           LazyCounters c, const std::vector<float>& got) {
  std::ostringstream os;
  // One rounding of the result apart at most (exp() may differ by one ulp in double).
  const double rel = c == LazyCounters::fp16 ? 2e-3 : 1e-6,
               abs = c == LazyCounters::fp16 ? 1e-7 : 1e-30;
  for (std::int64_t r = 0; r < bt.batch * bt.kv_heads; ++r) {
    const std::int64_t n = bt.lengths[static_cast<std::size_t>(r / bt.kv_heads)] - bt.window;
    const lazy::Row& row = rows[static_cast<std::size_t>(r)];
    for (std::int64_t j = 0; j < bt.capacity; ++j) {
      const float g = got[static_cast<std::size_t>(r * bt.capacity + j)];
      if (j >= n) {
        if (g != kScorePoison) {
          os << "row " << r << " slot " << j << " (not a candidate) was written: " << g;
          return os.str();
        }
        continue;
      }
      const float want = lazy::score(row.ts[static_cast<std::size_t>(j)],
                                     row.mri[static_cast<std::size_t>(j)], t, c);
      if (!(std::fabs(double(g) - double(want)) <= rel * std::fabs(double(want)) + abs)) {
        os << "row " << r << " slot " << j << " (TS " << row.ts[static_cast<std::size_t>(j)]
           << ", MRI " << row.mri[static_cast<std::size_t>(j)] << ", t " << t << "): GPU score "
           << g << ", CPU " << want;
        return os.str();
      }
    }
  }
  return "";
}

void run_stream(LazyCounters c, const std::vector<std::int64_t>& steps, std::uint32_t seed) {
  Batch bt;
  bt.valid.assign(static_cast<std::size_t>(bt.batch * bt.capacity), 1);
  for (int j = 0; j < 10; ++j) bt.valid[static_cast<std::size_t>(1 * bt.capacity + j)] = 0;
  std::mt19937 rng(seed);
  const std::size_t cells = static_cast<std::size_t>(bt.batch * bt.kv_heads * bt.capacity);
  DeviceBuffer<std::int32_t> ts(std::vector<std::int32_t>(cells, kPoison));
  DeviceBuffer<std::int32_t> mri(std::vector<std::int32_t>(cells, kPoison));
  DeviceBuffer<std::uint8_t> valid(bt.valid);
  const cuda::LazyDeviceCounters counters{ts.get(), mri.get(), bt.batch, bt.kv_heads, bt.capacity};
  std::vector<lazy::Row> rows(static_cast<std::size_t>(bt.batch * bt.kv_heads));
  std::vector<std::int32_t> prev(static_cast<std::size_t>(bt.batch), 0);

  // The prompt: counters start at TS = 0, no hits.
  {
    DeviceBuffer<std::int32_t> len(bt.lengths), prv(prev);
    cuda::lazy_observe(counters, nullptr, bt.q_heads, len.get(), prv.get(), valid.get(),
                       cuda::lazy_counter_of_step(c, 0), 0, bt.alpha, c, nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    for (std::int64_t r = 0; r < bt.batch * bt.kv_heads; ++r)
      lazy::append_tokens(rows[static_cast<std::size_t>(r)],
                          bt.lengths[static_cast<std::size_t>(r / bt.kv_heads)], 0);
    REQUIRE(compare_counters(bt, rows, ts.download(), mri.download()) == "");
  }
  std::int64_t last = 0;
  for (std::int64_t t : steps) {
    INFO("counters " << (c == LazyCounters::fp16 ? "fp16" : "int32") << ", step " << t);
    prev = bt.lengths;
    for (std::int32_t& l : bt.lengths) ++l;  // one new token per sequence
    const std::vector<float> p = step_probs(bt, rng);
    const std::int32_t start = lazy::counter_of_step(c, last);
    REQUIRE(cuda::lazy_counter_of_step(c, t) == lazy::counter_of_step(c, t));
    DeviceBuffer<std::int32_t> len(bt.lengths), prv(prev);
    DeviceBuffer<float> probs(p);
    cuda::lazy_observe(counters, probs.get(), bt.q_heads, len.get(), prv.get(), valid.get(), start,
                       t, bt.alpha, c, nullptr);
    const std::int64_t group = bt.q_heads / bt.kv_heads;
    for (std::int64_t b = 0; b < bt.batch; ++b)
      for (std::int64_t h = 0; h < bt.kv_heads; ++h) {
        lazy::Row& row = rows[static_cast<std::size_t>(b * bt.kv_heads + h)];
        const std::int64_t s = bt.lengths[static_cast<std::size_t>(b)];
        lazy::append_tokens(row, s, start);
        std::vector<std::uint8_t> hit(static_cast<std::size_t>(s), 0);
        for (std::int64_t j = 0; j < s; ++j) {
          float w = 0.0f;
          for (std::int64_t g = 0; g < group; ++g)
            w = std::fmax(
                w,
                p[static_cast<std::size_t>(((b * bt.q_heads) + h * group + g) * bt.capacity + j)]);
          hit[static_cast<std::size_t>(j)] =
              bt.valid[static_cast<std::size_t>(b * bt.capacity + j)] && w >= bt.alpha;
        }
        lazy::record_hits(row, hit.data(), t, c);
      }
    DeviceBuffer<float> scores(std::vector<float>(cells, kScorePoison));
    cuda::lazy_scores(counters, len.get(), bt.window, t, c, scores.get(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    REQUIRE(compare_counters(bt, rows, ts.download(), mri.download()) == "");
    REQUIRE(compare_scores(bt, rows, t, c, scores.download()) == "");
    last = t;
  }
}

}  // namespace

TEST_CASE("cuda LazyEviction counters and scores equal the CPU (int32 counters)", "[cuda][lazy]") {
  std::vector<std::int64_t> steps;
  for (std::int64_t t = 1; t <= 24; ++t) steps.push_back(t);
  // Past 2^24 the counters' fp32 rounding shows (16777217 → 16777216).
  for (std::int64_t t : {16777215, 16777217, 16777219, 16777230, 100000001}) steps.push_back(t);
  run_stream(LazyCounters::int32, steps, 5);
}

TEST_CASE("cuda LazyEviction counters and scores equal the CPU (fp16 counters)", "[cuda][lazy]") {
  std::vector<std::int64_t> steps;
  for (std::int64_t t = 1; t <= 12; ++t) steps.push_back(t);
  // Past 2048 odd steps round to even ones; 65504 is the last finite fp16 step.
  for (std::int64_t t : {2047, 2048, 2049, 2051, 4097, 4101, 30001, 65504}) steps.push_back(t);
  run_stream(LazyCounters::fp16, steps, 6);
}

TEST_CASE("cuda LazyEviction: a hand-worked row", "[cuda][lazy]") {
  // One sequence, one KV head, two query heads (GQA max), 3 prompt tokens, then steps 1 and 3
  // (step 2 not hitting anything). Step 1 hits slot 0 (head 1: 0.5) → TS 1, MRI 1 − 0 = 1.
  // Step 3 hits slot 0 again (head 0: alpha exactly) → TS 3, MRI max(1, 3 − 1) = 2, and slot 3
  // (step 1's token, started at TS 0) → TS 3, MRI 3; slot 4 (step 3's token) starts at TS 2.
  DeviceBuffer<std::int32_t> ts(std::vector<std::int32_t>(8, kPoison));
  DeviceBuffer<std::int32_t> mri(std::vector<std::int32_t>(8, kPoison));
  const cuda::LazyDeviceCounters c{ts.get(), mri.get(), 1, 1, 8};
  const float alpha = 0.25f;
  DeviceBuffer<std::int32_t> len3(std::vector<std::int32_t>{3}), len0(std::vector<std::int32_t>{0});
  cuda::lazy_observe(c, nullptr, 2, len3.get(), len0.get(), nullptr, 0, 0, alpha,
                     LazyCounters::int32, nullptr);
  // Step 1: 4 tokens; weights [2 heads, 8 slots].
  DeviceBuffer<std::int32_t> len4(std::vector<std::int32_t>{4});
  DeviceBuffer<float> p1(std::vector<float>{0.1f, 0.2f, 0.2f, 0.1f, 0, 0, 0, 0,  //
                                            0.5f, 0.1f, 0.1f, 0.2f, 0, 0, 0, 0});
  cuda::lazy_observe(c, p1.get(), 2, len4.get(), len3.get(), nullptr, 0, 1, alpha,
                     LazyCounters::int32, nullptr);
  // Step 3 (counter start = counter of step 2 = 2 for the new slot 4).
  DeviceBuffer<std::int32_t> len5(std::vector<std::int32_t>{5});
  DeviceBuffer<float> p3(std::vector<float>{0.25f, 0.1f, 0.1f, 0.3f, 0.1f, 0, 0, 0,  //
                                            0.0f, 0.1f, 0.2f, 0.1f, 0.2f, 0, 0, 0});
  cuda::lazy_observe(c, p3.get(), 2, len5.get(), len4.get(), nullptr, 2, 3, alpha,
                     LazyCounters::int32, nullptr);
  DeviceBuffer<std::int32_t> len_all(std::vector<std::int32_t>{5});
  DeviceBuffer<float> sc(std::vector<float>(8, kScorePoison));
  cuda::lazy_scores(c, len_all.get(), 2, 3, LazyCounters::int32, sc.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(ts.download() == std::vector<std::int32_t>{3, 0, 0, 3, 2, kPoison, kPoison, kPoison});
  CHECK(mri.download() == std::vector<std::int32_t>{2, 0, 0, 3, 0, kPoison, kPoison, kPoison});
  // Candidates are slots 0..2 (5 − window 2). The formula of docs/algorithms.md §5.3:
  // 2σ(−1 − (t − TS)/(MRI + 1e-5)) + (MRI = 0 ? 0 : 2σ(1 − MRI)), σ(x) = 1/(1 + e^−x).
  auto sigma2 = [](double x) { return 2.0 / (1.0 + std::exp(-x)); };
  const std::vector<float> got = sc.download();
  CHECK(got[0] == Approx(sigma2(-1.0 - 0.0 / (2 + 1e-5)) + sigma2(1.0 - 2.0)).epsilon(1e-6));
  CHECK(got[1] == Approx(sigma2(-1.0 - 3.0 / 1e-5)).margin(1e-30));
  CHECK(got[2] == Approx(sigma2(-1.0 - 3.0 / 1e-5)).margin(1e-30));
  for (int j = 3; j < 8; ++j) CHECK(got[static_cast<std::size_t>(j)] == kScorePoison);
}

TEST_CASE("cuda LazyEviction: error paths name the argument", "[cuda][lazy]") {
  using Catch::Matchers::Contains;
  DeviceBuffer<std::int32_t> ts(16), mri(16), len(2);
  DeviceBuffer<float> p(64), sc(16);
  const cuda::LazyDeviceCounters c{ts.get(), mri.get(), 2, 2, 4};
  REQUIRE_THROWS_WITH(cuda::lazy_observe(c, p.get(), 3, len.get(), len.get(), nullptr, 0, 1, 1e-3f,
                                         LazyCounters::int32, nullptr),
                      Contains("q_heads (3)"));
  REQUIRE_THROWS_WITH(cuda::lazy_observe(c, p.get(), 4, nullptr, len.get(), nullptr, 0, 1, 1e-3f,
                                         LazyCounters::int32, nullptr),
                      Contains("lengths"));
  REQUIRE_THROWS_WITH(cuda::lazy_observe(c, p.get(), 4, len.get(), len.get(), nullptr, 0, 1, 0.0f,
                                         LazyCounters::int32, nullptr),
                      Contains("alpha"));
  REQUIRE_THROWS_WITH(cuda::lazy_observe(c, p.get(), 4, len.get(), len.get(), nullptr, 0, 70000,
                                         1e-3f, LazyCounters::fp16, nullptr),
                      Contains("step 70000"));
  const cuda::LazyDeviceCounters empty{ts.get(), mri.get(), 0, 2, 4};
  REQUIRE_THROWS_WITH(
      cuda::lazy_scores(empty, len.get(), 1, 1, LazyCounters::int32, sc.get(), nullptr),
      Contains("counters shape [0, 2, 4]"));
  REQUIRE_THROWS_WITH(
      cuda::lazy_scores(c, len.get(), -1, 1, LazyCounters::int32, sc.get(), nullptr),
      Contains("window"));
}
