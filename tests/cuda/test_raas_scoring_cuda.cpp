// RaaS scoring on the GPU (backend/cuda/raas_scoring.hpp, docs/algorithms.md §5.4) against the
// CPU functions the RaaS policy calls (backend/cpu/raas_scores.hpp): the top-half and alpha
// timestamp refreshes bit for bit on ragged rows with many tied scores, signed zeros, a single
// unit and an empty row; page mode's key min/max and Quest bounds bit for bit for f32 and bf16
// keys, GQA, partial last pages and an offset prompt; untouched slots outside the rows; a
// hand-worked refresh; error paths.
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cpu/raas_scores.hpp"
#include "kvsift/backend/cuda/check.hpp"
#include "kvsift/backend/cuda/raas_scoring.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/tensor_view.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr std::int32_t kOld = -3;
constexpr float kPoison = 777.0f;

template <class T>
std::uint32_t bits_of(T v) {
  std::uint32_t u = 0;
  std::memcpy(&u, &v, sizeof v);
  return u;
}

// "" when equal bit for bit, else the first difference with both values.
template <class T>
std::string first_difference(const char* what, const std::vector<T>& got,
                             const std::vector<T>& want) {
  std::ostringstream os;
  if (got.size() != want.size()) {
    os << what << ": " << got.size() << " entries, expected " << want.size();
    return os.str();
  }
  for (std::size_t i = 0; i < got.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i])) {
      os << what << ": first difference at " << i << ": got " << got[i] << ", expected " << want[i];
      return os.str();
    }
  return "";
}

// Scores drawn from a few values (many ties), signed zeros among them.
std::vector<float> tied_scores(std::size_t n, std::mt19937& rng) {
  const float pool[] = {0.5f, 0.25f, 0.0f, -0.0f, 1e-4f, 0.5f, -2.0f, 0.125f, 1e-4f, 3.0f};
  std::uniform_int_distribution<int> pick(0, 9);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> s(n);
  for (float& v : s) v = unit(rng) < 0.5f ? pool[pick(rng)] : unit(rng);
  return s;
}

void check_refresh(cuda::RaasRefreshRule rule, std::uint32_t seed) {
  const std::int64_t batch = 4, H = 2, pitch = 300;
  const std::vector<std::int32_t> units = {257, 1, 0, 300};
  std::mt19937 rng(seed);
  const std::size_t cells = static_cast<std::size_t>(batch * H * pitch);
  std::vector<float> scores = tied_scores(cells, rng);
  // Row (3, 1): every score equal (the lower half of the units wins every tie).
  for (std::int64_t j = 0; j < pitch; ++j)
    scores[static_cast<std::size_t>((3 * H + 1) * pitch + j)] = 0.25f;
  std::vector<std::int32_t> ts(cells);
  for (std::size_t i = 0; i < cells; ++i) ts[i] = kOld - static_cast<std::int32_t>(i % 5);
  const float alpha = 1e-4f;
  const std::int32_t t = 41;

  std::vector<std::int32_t> want = ts;
  for (std::int64_t r = 0; r < batch * H; ++r) {
    const std::int64_t n = units[static_cast<std::size_t>(r / H)];
    const float* s = scores.data() + r * pitch;
    std::int32_t* w = want.data() + r * pitch;
    if (rule == cuda::RaasRefreshRule::top_half)
      cpu::raas::refresh_top_half(s, n, t, w);
    else
      cpu::raas::refresh_above(s, n, alpha, t, w);
  }
  DeviceBuffer<float> ds(scores);
  DeviceBuffer<std::int32_t> du(units), dts(ts);
  cuda::raas_refresh(ds.get(), du.get(), batch, H, pitch, rule, alpha, t, dts.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(first_difference("timestamps", dts.download(), want) == "");
}

template <class T>
void check_pages(std::uint32_t seed) {
  const std::int64_t batch = 2, H = 2, q_heads = 6, capacity = 100, dim = 64;
  const int page = 16;
  const std::int64_t max_pages = 7;
  const std::vector<std::int32_t> first = {10, 0}, count = {53, 90};  // 4 and 6 pages, partial
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<T> keys(static_cast<std::size_t>(batch * H * capacity * dim));
  for (T& k : keys) k = from_float<T>(normal(rng));
  // A page with equal keys in one channel and signed zeros in another (min == max).
  for (int j = 0; j < page; ++j) {
    keys[static_cast<std::size_t>(((0 * H + 0) * capacity + 10 + j) * dim + 3)] =
        from_float<T>(0.5f);
    keys[static_cast<std::size_t>(((0 * H + 0) * capacity + 10 + j) * dim + 4)] =
        from_float<T>(j % 2 ? -0.0f : 0.0f);
  }
  std::vector<float> q(static_cast<std::size_t>(batch * q_heads * dim));
  for (float& v : q) v = normal(rng);
  q[0] = 0.0f;

  const std::size_t bcells = static_cast<std::size_t>(batch * H * max_pages * dim);
  std::vector<float> want_min(bcells, kPoison), want_max(bcells, kPoison);
  std::vector<float> want_out(static_cast<std::size_t>(batch * H * max_pages), kPoison);
  const std::int64_t group = q_heads / H;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t r = b * H + h, n = count[static_cast<std::size_t>(b)];
      const std::int64_t pages = (n + page - 1) / page;
      std::vector<float> k(static_cast<std::size_t>(n * dim));
      for (std::int64_t j = 0; j < n * dim; ++j)
        k[static_cast<std::size_t>(j)] = to_float(keys[static_cast<std::size_t>(
            (r * capacity + first[static_cast<std::size_t>(b)]) * dim + j)]);
      cpu::raas::page_key_bounds(k.data(), n, static_cast<int>(dim), page,
                                 want_min.data() + r * max_pages * dim,
                                 want_max.data() + r * max_pages * dim);
      cpu::raas::page_bounds(q.data() + (b * q_heads + h * group) * dim, static_cast<int>(group),
                             want_min.data() + r * max_pages * dim,
                             want_max.data() + r * max_pages * dim, pages, static_cast<int>(dim),
                             want_out.data() + r * max_pages);
    }

  DeviceBuffer<T> dk(keys);
  DeviceBuffer<std::int32_t> df(first), dc(count);
  DeviceBuffer<float> dmin(std::vector<float>(bcells, kPoison)),
      dmax(std::vector<float>(bcells, kPoison));
  DeviceBuffer<float> dq(q), dout(std::vector<float>(want_out.size(), kPoison));
  cuda::raas_page_key_bounds(
      TensorView::contiguous(dk.get(), dtype_of<T>::value, Device::cuda, {batch, H, capacity, dim}),
      df.get(), dc.get(), page, max_pages, dmin.get(), dmax.get(), nullptr);
  cuda::raas_page_bounds(dq.get(), batch, q_heads, H, dim, dmin.get(), dmax.get(), dc.get(), page,
                         max_pages, dout.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(first_difference("page key minima", dmin.download(), want_min) == "");
  CHECK(first_difference("page key maxima", dmax.download(), want_max) == "");
  CHECK(first_difference("Quest bounds", dout.download(), want_out) == "");
}

}  // namespace

TEST_CASE("cuda RaaS top-half refresh equals cpu::raas::refresh_top_half", "[cuda][raas]") {
  for (std::uint32_t seed : {1u, 2u, 3u}) check_refresh(cuda::RaasRefreshRule::top_half, seed);
}

TEST_CASE("cuda RaaS alpha refresh equals cpu::raas::refresh_above", "[cuda][raas]") {
  check_refresh(cuda::RaasRefreshRule::alpha, 4);
}

TEST_CASE("cuda RaaS page key bounds and Quest bounds equal the CPU", "[cuda][raas]") {
  check_pages<float>(5);
  check_pages<bf16_t>(6);
  check_pages<f16_t>(7);
}

TEST_CASE("cuda RaaS refresh: a hand-worked row", "[cuda][raas]") {
  // 5 units, scores {0.1, 0.3, 0.3, −0, +0}: the top ceil(5/2) = 3 are units 1, 2 (0.3) and 0
  // (0.1); −0 and +0 are equal, so neither wins. Alpha 0.2 stamps units 1 and 2 only.
  DeviceBuffer<float> s(std::vector<float>{0.1f, 0.3f, 0.3f, -0.0f, 0.0f, kPoison});
  DeviceBuffer<std::int32_t> units(std::vector<std::int32_t>{5});
  DeviceBuffer<std::int32_t> ts(std::vector<std::int32_t>{1, 1, 1, 1, 1, 1});
  cuda::raas_refresh(s.get(), units.get(), 1, 1, 6, cuda::RaasRefreshRule::top_half, 0.0f, 9,
                     ts.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(ts.download() == std::vector<std::int32_t>{9, 9, 9, 1, 1, 1});
  DeviceBuffer<std::int32_t> ts2(std::vector<std::int32_t>{1, 1, 1, 1, 1, 1});
  cuda::raas_refresh(s.get(), units.get(), 1, 1, 6, cuda::RaasRefreshRule::alpha, 0.2f, 9,
                     ts2.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(ts2.download() == std::vector<std::int32_t>{1, 9, 9, 1, 1, 1});
}

TEST_CASE("cuda RaaS scoring: error paths name the argument", "[cuda][raas]") {
  using Catch::Matchers::Contains;
  DeviceBuffer<float> f(256);
  DeviceBuffer<std::int32_t> i(16);
  REQUIRE_THROWS_WITH(cuda::raas_refresh(f.get(), i.get(), 0, 2, 8, cuda::RaasRefreshRule::top_half,
                                         0.0f, 1, i.get(), nullptr),
                      Contains("batch (0)"));
  REQUIRE_THROWS_WITH(cuda::raas_refresh(nullptr, i.get(), 1, 2, 8, cuda::RaasRefreshRule::top_half,
                                         0.0f, 1, i.get(), nullptr),
                      Contains("non-null"));
  REQUIRE_THROWS_WITH(cuda::raas_page_bounds(f.get(), 1, 3, 2, 4, f.get(), f.get(), i.get(), 16, 1,
                                             f.get(), nullptr),
                      Contains("q_heads (3)"));
  std::vector<float> host(64);
  REQUIRE_THROWS_WITH(
      cuda::raas_page_key_bounds(
          TensorView::contiguous(host.data(), DType::f32, Device::cpu, {1, 1, 16, 4}), i.get(),
          i.get(), 16, 1, f.get(), f.get(), nullptr),
      Contains("device memory"));
  REQUIRE_THROWS_WITH(cuda::raas_page_key_bounds(
                          TensorView::contiguous(f.get(), DType::f32, Device::cuda, {1, 1, 16, 4}),
                          i.get(), i.get(), 0, 1, f.get(), f.get(), nullptr),
                      Contains("page_size (0)"));
}
