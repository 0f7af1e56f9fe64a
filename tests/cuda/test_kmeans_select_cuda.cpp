// kvsift::cuda::kmeans_select against the CPU reference kvsift::kmeans_select (docs/algorithms.md
// §3.3): identical indices, problem by problem, on a hand-made case with an obvious answer and a
// sweep of ~400 random problems in few launches (gaussian keys, keys on a coarse integer grid
// full of exact distance ties, duplicated rows, every dtype, odd head_dims, n and k across their
// ranges, 0, 1 and 10 Lloyd iterations). The sweep prints its match rate and must match 100%.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/kmeans_select.hpp"
#include "kvsift/backend/cpu/kmeans_select.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr std::int32_t kPoison = 0x7fffffff;

enum class Kind { gaussian, grid, duplicates };

struct HostProblem {
  std::vector<float> points;  // [n, dim] as stored (already rounded to the storage dtype)
  std::int32_t n, k;
};

template <class T>
float round_trip(float x) {
  return to_float(from_float<T>(x));
}

template <class T>
HostProblem make_problem(std::mt19937& rng, int n, int k, int dim, Kind kind) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> grid(-2, 2);
  HostProblem p{std::vector<float>(static_cast<std::size_t>(n) * dim), n, k};
  for (int i = 0; i < n; ++i) {
    for (int d = 0; d < dim; ++d) {
      float x = kind == Kind::grid ? static_cast<float>(grid(rng)) : 2.0f * normal(rng);
      p.points[static_cast<std::size_t>(i) * dim + d] = round_trip<T>(x);
    }
    if (kind == Kind::duplicates && i > 0 && i % 3 == 0) {  // every third row repeats one before
      const int src = std::uniform_int_distribution<int>(0, i - 1)(rng);
      std::copy_n(p.points.begin() + static_cast<std::ptrdiff_t>(src) * dim, dim,
                  p.points.begin() + static_cast<std::ptrdiff_t>(i) * dim);
    }
  }
  return p;
}

// Uploads the problems (storage dtype T, rows padded to `row_stride`) and runs one launch;
// returns the number of problems whose output row differs from the CPU reference.
template <class T>
int run_and_compare(const std::vector<HostProblem>& problems, int dim, int row_stride,
                    const KMeansSelectConfig& cfg) {
  std::vector<T> storage;
  std::vector<std::size_t> offsets;
  for (const HostProblem& p : problems) {
    offsets.push_back(storage.size());
    for (int i = 0; i < p.n; ++i) {
      for (int d = 0; d < row_stride; ++d) {
        const float x = d < dim ? p.points[static_cast<std::size_t>(i) * dim + d] : 1e30f;
        storage.push_back(from_float<T>(x));  // the padding must never be read
      }
    }
  }
  DeviceBuffer<T> d_points(storage);
  std::vector<cuda::KMeansProblem> descs;
  std::int64_t out_stride = 1;
  for (std::size_t p = 0; p < problems.size(); ++p) {
    descs.push_back({d_points.get() + offsets[p], row_stride, problems[p].n, problems[p].k});
    out_stride = std::max<std::int64_t>(out_stride, std::min(problems[p].n, problems[p].k) + 1);
  }
  DeviceBuffer<std::int32_t> d_out(
      std::vector<std::int32_t>(problems.size() * out_stride, kPoison));
  const std::size_t ws_bytes = cuda::kmeans_select_workspace_bytes(descs.size());
  DeviceBuffer<char> ws(ws_bytes);
  cuda::kmeans_select(descs, dim, dtype_of<T>::value, cfg, d_out.get(), out_stride, ws.get(),
                      ws_bytes, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<std::int32_t> got = d_out.download();
  int mismatches = 0;
  for (std::size_t p = 0; p < problems.size(); ++p) {
    const HostProblem& hp = problems[p];
    std::vector<std::int32_t> expected = kmeans_select(hp.points.data(), hp.n, dim, hp.k, cfg);
    expected.resize(out_stride, cuda::kKMeansUnusedSlot);
    const std::vector<std::int32_t> row(got.begin() + p * out_stride,
                                        got.begin() + (p + 1) * out_stride);
    if (row != expected && mismatches++ < 3) {
      UNSCOPED_INFO("problem " << p << " (n=" << hp.n << " k=" << hp.k << " dim=" << dim
                               << ") differs; first slots gpu " << row[0] << "," << row[1]
                               << " cpu " << expected[0] << "," << expected[1]);
    }
  }
  return mismatches;
}

template <class T>
void sweep(unsigned seed, int dim, int row_stride, int count, const KMeansSelectConfig& cfg,
           int* total, int* matched) {
  std::mt19937 rng(seed);
  std::vector<HostProblem> problems;
  for (int p = 0; p < count; ++p) {
    const int n = p == 0 ? 128 : std::uniform_int_distribution<int>(1, 128)(rng);
    const int k = p == 0 ? 64 : std::uniform_int_distribution<int>(1, 64)(rng);
    const Kind kind = static_cast<Kind>(p % 3);
    problems.push_back(make_problem<T>(rng, n, k, dim, kind));
  }
  const int bad = run_and_compare<T>(problems, dim, row_stride, cfg);
  *total += count;
  *matched += count - bad;
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("cuda::kmeans_select picks the obvious representatives", "[cuda][kmeans]") {
  // Three tight clusters of three collinear points; each centroid is its middle point.
  const std::vector<float> pts = {0, 0, 1, 0, 2, 0, 100, 0, 101, 0, 102, 0, 0, 100, 0, 101, 0, 102};
  DeviceBuffer<float> d_pts(pts);
  DeviceBuffer<std::int32_t> d_out(std::vector<std::int32_t>(4, kPoison));
  const std::vector<cuda::KMeansProblem> descs = {{d_pts.get(), 2, 9, 3}};
  const std::size_t ws_bytes = cuda::kmeans_select_workspace_bytes(1);
  DeviceBuffer<char> ws(ws_bytes);
  cuda::kmeans_select(descs, 2, DType::f32, {}, d_out.get(), 4, ws.get(), ws_bytes, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(d_out.download() == std::vector<std::int32_t>{1, 4, 7, cuda::kKMeansUnusedSlot});
  CHECK(kmeans_select(pts.data(), 9, 2, 3) == std::vector<std::int32_t>{1, 4, 7});
}

TEST_CASE("cuda::kmeans_select matches the CPU reference on a random sweep", "[cuda][kmeans]") {
  int total = 0, matched = 0;
  const KMeansSelectConfig ten{};
  SECTION("f32, head_dim 128") { sweep<float>(11, 128, 128, 80, ten, &total, &matched); }
  SECTION("bf16, head_dim 128, padded rows") {
    sweep<bf16_t>(12, 128, 136, 80, ten, &total, &matched);
  }
  SECTION("f16, head_dim 64") { sweep<f16_t>(13, 64, 64, 80, ten, &total, &matched); }
  SECTION("f32, odd head_dim 37") { sweep<float>(14, 37, 37, 60, ten, &total, &matched); }
  SECTION("bf16, head_dim 256 (the largest shared-memory footprint)") {
    sweep<bf16_t>(15, 256, 256, 24, ten, &total, &matched);
  }
  SECTION("f32, head_dim 256") { sweep<float>(16, 256, 256, 12, ten, &total, &matched); }
  SECTION("one Lloyd iteration and none") {
    KMeansSelectConfig one, none;
    one.max_iterations = 1;
    none.max_iterations = 0;
    sweep<f16_t>(17, 16, 16, 40, one, &total, &matched);
    sweep<f16_t>(18, 16, 16, 40, none, &total, &matched);
  }
  std::printf("kmeans sweep: %d of %d problems match the CPU reference exactly\n", matched, total);
}

TEST_CASE("cuda::kmeans_select edge cases", "[cuda][kmeans]") {
  // Problem 0: k >= n keeps every row; 1: n = 0; 2: a NaN key; 3: every row identical (all
  // distances tie: the survivors are the lowest rows); 4: an infinite key.
  std::vector<float> pts(5 * 10 * 3, 1.0f);
  pts[2 * 30 + 7] = std::nanf("");
  pts[4 * 30 + 4] = -INFINITY;
  DeviceBuffer<float> d_pts(pts);
  auto at = [&](int p) { return d_pts.get() + p * 30; };
  const std::vector<cuda::KMeansProblem> descs = {{at(0), 3, 5, 8},
                                                  {nullptr, 3, 0, 2},
                                                  {at(2), 3, 10, 4},
                                                  {at(3), 3, 10, 4},
                                                  {at(4), 3, 10, 2}};
  const std::int64_t stride = 6;
  DeviceBuffer<std::int32_t> d_out(std::vector<std::int32_t>(descs.size() * stride, kPoison));
  const std::size_t ws_bytes = cuda::kmeans_select_workspace_bytes(descs.size());
  DeviceBuffer<char> ws(ws_bytes);
  cuda::kmeans_select(descs, 3, DType::f32, {}, d_out.get(), stride, ws.get(), ws_bytes, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<std::int32_t> got = d_out.download();
  auto row = [&](int p) {
    return std::vector<std::int32_t>(got.begin() + p * stride, got.begin() + (p + 1) * stride);
  };
  const std::int32_t u = cuda::kKMeansUnusedSlot, nf = cuda::kNonFiniteKeySlot;
  CHECK(row(0) == std::vector<std::int32_t>{0, 1, 2, 3, 4, u});
  CHECK(row(1) == std::vector<std::int32_t>(stride, u));
  CHECK(row(2) == std::vector<std::int32_t>(stride, nf));
  CHECK(row(3) == std::vector<std::int32_t>{0, 1, 2, 3, u, u});
  CHECK(row(3) == [&] {
    auto e = kmeans_select(pts.data() + 90, 10, 3, 4);
    e.resize(stride, u);
    return e;
  }());
  CHECK(row(4) == std::vector<std::int32_t>(stride, nf));
}

TEST_CASE("cuda::kmeans_select on segments of a device cache", "[cuda][kmeans]") {
  // [batch 2, kv_heads 3, capacity 200, head_dim 32] bf16; segment [40, 168) of every (b, h).
  const int B = 2, H = 3, cap = 200, D = 32, start = 40, n = 128, k = 16;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16_t> keys(static_cast<std::size_t>(B) * H * cap * D);
  for (bf16_t& x : keys) x = from_float<bf16_t>(normal(rng));
  DeviceBuffer<bf16_t> d_keys(keys);
  std::vector<std::int32_t> lengths(B, cap);
  const KVCacheView kv = make_kv_cache_view(d_keys.get(), d_keys.get(), DType::bf16, Device::cuda,
                                            B, H, cap, D, lengths.data());
  std::vector<cuda::KMeansProblem> descs;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      descs.push_back(cuda::kmeans_problem_from_cache(kv, b, h, start, n, k));
  DeviceBuffer<std::int32_t> d_out(std::vector<std::int32_t>(descs.size() * k, kPoison));
  const std::size_t ws_bytes = cuda::kmeans_select_workspace_bytes(descs.size());
  DeviceBuffer<char> ws(ws_bytes);
  cuda::kmeans_select(descs, D, DType::bf16, {}, d_out.get(), k, ws.get(), ws_bytes, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<std::int32_t> got = d_out.download();
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      std::vector<float> seg(static_cast<std::size_t>(n) * D);
      for (int i = 0; i < n; ++i)
        for (int d = 0; d < D; ++d)
          seg[i * D + d] =
              to_float(keys[((static_cast<std::size_t>(b) * H + h) * cap + start + i) * D + d]);
      const int p = b * H + h;
      CHECK(std::vector<std::int32_t>(got.begin() + p * k, got.begin() + (p + 1) * k) ==
            kmeans_select(seg.data(), n, D, k));
    }
  }
  REQUIRE_THROWS_WITH(cuda::kmeans_problem_from_cache(kv, 0, 0, 100, 128, 4),
                      Catch::Matchers::Contains("tokens [100, 228)"));
}

TEST_CASE("cuda::kmeans_select rejects bad arguments", "[cuda][kmeans]") {
  DeviceBuffer<float> d_pts(256 * 200);
  DeviceBuffer<std::int32_t> d_out(64);
  DeviceBuffer<char> ws(4096);
  auto run = [&](cuda::KMeansProblem p, std::int64_t dim, std::int64_t stride = 64) {
    const std::vector<cuda::KMeansProblem> descs = {p};
    cuda::kmeans_select(descs, dim, DType::f32, {}, d_out.get(), stride, ws.get(), 4096, nullptr);
  };
  REQUIRE_THROWS_WITH(run({d_pts.get(), 300, 10, 2}, 300), Catch::Matchers::Contains("dim=300"));
  REQUIRE_THROWS_WITH(run({d_pts.get(), 16, 129, 2}, 16), Catch::Matchers::Contains("n=129"));
  REQUIRE_THROWS_WITH(run({d_pts.get(), 16, 100, 65}, 16), Catch::Matchers::Contains("k=65"));
  REQUIRE_THROWS_WITH(run({d_pts.get(), 16, 100, 0}, 16), Catch::Matchers::Contains("k=0"));
  REQUIRE_THROWS_WITH(run({d_pts.get(), 8, 100, 2}, 16), Catch::Matchers::Contains("row_stride=8"));
  REQUIRE_THROWS_WITH(run({nullptr, 16, 100, 2}, 16), Catch::Matchers::Contains("need non-null"));
  REQUIRE_THROWS_WITH(run({d_pts.get(), 16, 100, 20}, 16, 10),
                      Catch::Matchers::Contains("keeps 20 rows but out_stride=10"));
  KMeansSelectConfig bad;
  bad.max_iterations = -1;
  const std::vector<cuda::KMeansProblem> one = {{d_pts.get(), 16, 100, 2}};
  REQUIRE_THROWS_WITH(
      cuda::kmeans_select(one, 16, DType::f32, bad, d_out.get(), 64, ws.get(), 4096, nullptr),
      Catch::Matchers::Contains("max_iterations must be >= 0, got -1"));
  REQUIRE_THROWS_WITH(
      cuda::kmeans_select(one, 16, DType::f32, {}, d_out.get(), 64, ws.get(), 10, nullptr),
      Catch::Matchers::Contains("workspace of 10 bytes is too small"));
}
