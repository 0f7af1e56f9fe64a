// kvsift::cuda::apply_steering against the CPU SteeringController::apply (docs/algorithms.md §2.5):
// bit-exact for f32, f16 and bf16, on random hidden states plus the values where a fused
// multiply-add or a wrong rounding mode would show (−0, rounding ties, overflow to inf, NaN), on
// contiguous and strided tensors, with host and device alpha arrays.
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/steering.hpp"
#include "kvsift/policy/skipkv/steering.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr int kBatch = 6, kSeq = 3, kHidden = 300;  // 300: not a multiple of the block size
constexpr int kRowPad = 5;  // strided case: extra elements between positions

template <class T>
std::uint32_t bits_of(T x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof x);
  return u;
}

SteeringVector make_vector(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  SteeringVector v;
  v.layer = 20;
  v.values.resize(kHidden);
  for (float& x : v.values) x = normal(rng);
  v.values[0] = 0.0f;    // −0 + 0·α stays −0 only if nothing is fused or reordered
  v.values[1] = 1e-30f;  // tiny product
  v.values[2] = 3.0e4f;  // overflows f16 when added to a large value
  v.values[3] = -1.0f;
  return v;
}

// Hidden states with edge values at the first channels of every row.
std::vector<float> make_hidden(std::mt19937& rng, std::int64_t count, std::int64_t row_len) {
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> h(static_cast<std::size_t>(count));
  for (float& x : h) x = normal(rng);
  for (std::int64_t r = 0; r + 4 < count; r += row_len) {
    h[r + 0] = -0.0f;
    h[r + 1] = 1.0f;
    h[r + 2] = 6.0e4f;
    h[r + 3] = std::numeric_limits<float>::quiet_NaN();
  }
  return h;
}

// Gates rows 0, 2, 3 and 5 with different check-sentence counts; rows 1 and 4 stay ungated.
SteeringController make_controller(const SteeringVector& v) {
  SteeringConfig cfg;
  SteeringController c(cfg, v, kBatch);
  for (int b : {0, 2, 3, 5}) {
    c.observe(b, {cfg.think_start[0], 17, cfg.boundary[b % 4]});
    c.update_strength(b, 3 * b + 1);
  }
  c.observe(4, {cfg.think_start[0], 17});  // inside <think> but not at a boundary
  return c;
}

template <class T>
void check_dtype(bool strided) {
  std::mt19937 rng(strided ? 7 : 3);
  const SteeringVector vec = make_vector(rng);
  const SteeringController controller = make_controller(vec);
  const std::int64_t pos_stride = kHidden + (strided ? kRowPad : 0);
  const std::int64_t total = kBatch * kSeq * pos_stride;
  const std::vector<float> values = make_hidden(rng, total, pos_stride);
  std::vector<T> host(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) host[i] = from_float<T>(values[i]);

  auto view_of = [&](void* data, Device device) {
    TensorView t =
        TensorView::contiguous(data, dtype_of<T>::value, device, {kBatch, kSeq, kHidden});
    t.stride = {kSeq * pos_stride, pos_stride, 1, 0};
    return t;
  };
  std::vector<T> expected = host;
  REQUIRE(controller.apply(20, view_of(expected.data(), Device::cpu)) == 4);

  DeviceBuffer<float> d_vec(vec.values);
  std::vector<float> alpha(kBatch, 0.0f);
  for (int b = 0; b < kBatch; ++b) alpha[b] = controller.gated(b) ? controller.strength(b) : 0.0f;
  DeviceBuffer<float> d_alpha(alpha);

  auto compare = [&](const std::vector<T>& got, const char* path) {
    std::int64_t bad = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (bits_of(got[i]) != bits_of(expected[i]) && bad++ < 5) {
        UNSCOPED_INFO(path << ": element " << i << " got bits " << bits_of(got[i]) << " expected "
                           << bits_of(expected[i]));
      }
    }
    CHECK(bad == 0);
  };

  std::vector<std::uint8_t> gated(kBatch, 0);
  std::vector<float> strength(kBatch, 0.0f);
  for (int b = 0; b < kBatch; ++b) {
    gated[b] = controller.gated(b) ? 1 : 0;
    strength[b] = controller.strength(b);
  }
  const std::int64_t vsize = vec.hidden_size();
  SECTION("gated rows and strengths from the controller") {
    DeviceBuffer<T> d_h(host);
    REQUIRE(cuda::apply_steering(controller.config(), 20, view_of(d_h.get(), Device::cuda),
                                 gated.data(), strength.data(), d_vec.get(), vsize, nullptr) == 4);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    compare(d_h.download(), "controller");
    // Another layer is left alone.
    DeviceBuffer<T> d_other(host);
    REQUIRE(cuda::apply_steering(controller.config(), 3, view_of(d_other.get(), Device::cuda),
                                 gated.data(), strength.data(), d_vec.get(), vsize, nullptr) == 0);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<T> untouched = d_other.download();
    for (std::size_t i = 0; i < host.size(); ++i)
      REQUIRE(bits_of(untouched[i]) == bits_of(host[i]));
  }
  SECTION("host alpha array") {
    DeviceBuffer<T> d_h(host);
    cuda::apply_steering(view_of(d_h.get(), Device::cuda), alpha.data(), cuda::AlphaLocation::host,
                         d_vec.get(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    compare(d_h.download(), "host alpha");
  }
  SECTION("device alpha array") {
    DeviceBuffer<T> d_h(host);
    cuda::apply_steering(view_of(d_h.get(), Device::cuda), d_alpha.get(),
                         cuda::AlphaLocation::device, d_vec.get(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    compare(d_h.download(), "device alpha");
  }
}

}  // namespace

TEST_CASE("cuda::apply_steering is bit-exact with SteeringController::apply", "[cuda][steering]") {
  SECTION("f32") { check_dtype<float>(false); }
  SECTION("f16") { check_dtype<f16_t>(false); }
  SECTION("bf16") { check_dtype<bf16_t>(false); }
  SECTION("f16 strided") { check_dtype<f16_t>(true); }
  SECTION("bf16 strided") { check_dtype<bf16_t>(true); }
}

TEST_CASE("cuda::apply_steering rounds the sum to nearest even", "[cuda][steering]") {
  // bf16 has 8 significant bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and rounds to the
  // even 1.0; 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6 and rounds up to 1 + 2^-6.
  std::vector<bf16_t> host = {from_float<bf16_t>(1.0f), from_float<bf16_t>(1.0f)};
  const std::vector<float> v = {1.0f / 256.0f, 3.0f / 256.0f};
  DeviceBuffer<bf16_t> d_h(host);
  DeviceBuffer<float> d_v(v);
  const float alpha = 1.0f;
  TensorView t = TensorView::contiguous(d_h.get(), DType::bf16, Device::cuda, {1, 1, 2});
  cuda::apply_steering(t, &alpha, cuda::AlphaLocation::host, d_v.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16_t> got = d_h.download();
  CHECK(to_float(got[0]) == 1.0f);
  CHECK(to_float(got[1]) == 1.0f + 1.0f / 64.0f);
}

TEST_CASE("cuda::apply_steering steers more rows than one launch holds", "[cuda][steering]") {
  // 600 rows with host alphas: three launches of at most kSteeringRowsPerLaunch rows.
  const int batch = 600, hidden = 8;
  std::vector<float> h(static_cast<std::size_t>(batch) * hidden, 1.0f), alpha(batch);
  for (int b = 0; b < batch; ++b) alpha[b] = b % 7 == 0 ? 0.0f : static_cast<float>(b);
  const std::vector<float> v(hidden, 0.5f);
  DeviceBuffer<float> d_h(h), d_v(v);
  TensorView t = TensorView::contiguous(d_h.get(), DType::f32, Device::cuda, {batch, 1, hidden});
  cuda::apply_steering(t, alpha.data(), cuda::AlphaLocation::host, d_v.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = d_h.download();
  for (int b = 0; b < batch; ++b)
    for (int k = 0; k < hidden; ++k) REQUIRE(got[b * hidden + k] == 1.0f + 0.5f * alpha[b]);
}

TEST_CASE("cuda::apply_steering rejects bad arguments", "[cuda][steering]") {
  DeviceBuffer<float> d_h(12), d_v(4);
  const float alpha[3] = {1.0f, 0.0f, 1.0f};
  TensorView rank2 = TensorView::contiguous(d_h.get(), DType::f32, Device::cuda, {3, 4});
  REQUIRE_THROWS_WITH(
      cuda::apply_steering(rank2, alpha, cuda::AlphaLocation::host, d_v.get(), nullptr),
      Catch::Matchers::Contains("got [3, 4]"));
  std::vector<float> host(12);
  TensorView on_host = TensorView::contiguous(host.data(), DType::f32, Device::cpu, {3, 1, 4});
  REQUIRE_THROWS_WITH(
      cuda::apply_steering(on_host, alpha, cuda::AlphaLocation::host, d_v.get(), nullptr),
      Catch::Matchers::Contains("device memory"));
  TensorView ok = TensorView::contiguous(d_h.get(), DType::f32, Device::cuda, {3, 1, 4});
  REQUIRE_THROWS_WITH(
      cuda::apply_steering(ok, nullptr, cuda::AlphaLocation::host, d_v.get(), nullptr),
      Catch::Matchers::Contains("alpha is null for batch 3"));
  TensorView no_pos = TensorView::contiguous(d_h.get(), DType::f32, Device::cuda, {3, 0, 4});
  REQUIRE_THROWS_WITH(
      cuda::apply_steering(no_pos, alpha, cuda::AlphaLocation::host, d_v.get(), nullptr),
      Catch::Matchers::Contains("seq = 0"));
  std::mt19937 rng(1);
  SteeringVector vec = make_vector(rng);  // kHidden values, hidden size here is 4
  const std::uint8_t gates[3] = {1, 0, 1};
  REQUIRE_THROWS_WITH(cuda::apply_steering(SteeringConfig{}, 20, ok, gates, alpha, d_v.get(),
                                           vec.hidden_size(), nullptr),
                      Catch::Matchers::Contains("300 values, hidden size is 4"));
  REQUIRE_THROWS_WITH(
      cuda::apply_steering(SteeringConfig{}, 20, ok, nullptr, alpha, d_v.get(), 4, nullptr),
      Catch::Matchers::Contains("gated and alpha (host, [batch]) must be given for batch 3"));
}
