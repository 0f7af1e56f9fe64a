// kvsift::cuda::attention_sparsity against the CPU reference kvsift::attention_sparsity
// (docs/algorithms.md §3.1) and a hand-computed row. The device sums every logit in the CPU's order
// without FMA, so counts are expected to be identical: the check is |gpu − cpu| <= 1e-6 (less
// than one key of any row here), plus bitwise equality, on random caches with GQA, left pads,
// unequal lengths, rank-3 and rank-4 queries, every key dtype and mixed query dtypes. Random
// normal inputs make exact logit ties with the cut practically impossible.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/attention_sparsity.hpp"
#include "kvsift/backend/cpu/attention_sparsity.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr float kPoison = 123.0f;

template <class T>
std::vector<T> convert(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<T>(x[i]);
  return out;
}

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct Shape {
  int batch, kv_heads, q_heads, capacity, dim, window;  // window 0: rank-3 queries
};

// Runs both implementations on the same cache and queries and compares sequence by sequence.
template <class KT, class QT>
void compare(const Shape& s, std::vector<std::int32_t> lengths, std::vector<std::uint8_t> mask,
             unsigned seed, float key_spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t key_count = static_cast<std::size_t>(s.batch) * s.kv_heads * s.capacity * s.dim;
  const int rows = s.window == 0 ? 1 : s.window;
  const std::size_t q_count = static_cast<std::size_t>(s.batch) * s.q_heads * rows * s.dim;
  std::vector<float> k(key_count), q(q_count);
  for (float& x : k) x = key_spread * normal(rng);
  for (float& x : q) x = normal(rng);
  std::vector<KT> keys = convert<KT>(k);
  std::vector<QT> queries = convert<QT>(q);

  auto query_view = [&](void* data, Device device) {
    return s.window == 0 ? TensorView::contiguous(data, dtype_of<QT>::value, device,
                                                  {s.batch, s.q_heads, s.dim})
                         : TensorView::contiguous(data, dtype_of<QT>::value, device,
                                                  {s.batch, s.q_heads, s.window, s.dim});
  };
  std::vector<std::int32_t> host_lengths = lengths;
  const KVCacheView host_kv = make_kv_cache_view(
      keys.data(), keys.data(), dtype_of<KT>::value, Device::cpu, s.batch, s.kv_heads, s.capacity,
      s.dim, host_lengths.data(), mask.empty() ? nullptr : mask.data());
  const std::vector<float> expected =
      attention_sparsity(host_kv, query_view(queries.data(), Device::cpu));

  DeviceBuffer<KT> d_keys(keys);
  DeviceBuffer<QT> d_queries(queries);
  DeviceBuffer<std::uint8_t> d_mask(mask.empty() ? std::vector<std::uint8_t>(1) : mask);
  const KVCacheView kv = make_kv_cache_view(d_keys.get(), d_keys.get(), dtype_of<KT>::value,
                                            Device::cuda, s.batch, s.kv_heads, s.capacity, s.dim,
                                            lengths.data(), mask.empty() ? nullptr : d_mask.get());
  const TensorView d_q = query_view(d_queries.get(), Device::cuda);
  const std::size_t ws_bytes = cuda::attention_sparsity_workspace_bytes(kv, d_q);
  DeviceBuffer<char> ws(ws_bytes);
  DeviceBuffer<float> d_out(std::vector<float>(s.batch, kPoison));
  cuda::attention_sparsity(kv, d_q, d_out.get(), ws.get(), ws_bytes, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = d_out.download();
  for (int b = 0; b < s.batch; ++b) {
    INFO("sequence " << b << ": gpu " << got[b] << " cpu " << expected[b]);
    CHECK(std::fabs(got[b] - expected[b]) <= 1e-6f);
    CHECK(bits(got[b]) == bits(expected[b]));
  }
}

// Left pads: sequence b has `pads[b]` pad slots before its real tokens.
std::vector<std::uint8_t> left_pad_mask(int batch, int capacity, const std::vector<int>& pads) {
  std::vector<std::uint8_t> m(static_cast<std::size_t>(batch) * capacity, 1);
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < pads[b]; ++j) m[static_cast<std::size_t>(b) * capacity + j] = 0;
  return m;
}

}  // namespace

TEST_CASE("cuda::attention_sparsity equals the CPU reference", "[cuda][sparsity]") {
  // Key spread 3 makes rows genuinely sparse (tens of percent), so the count matters.
  SECTION("f32 keys and queries, GQA 3, rank 3, unequal lengths") {
    compare<float, float>({3, 2, 6, 300, 64, 0}, {300, 129, 1}, {}, 1, 3.0f);
  }
  SECTION("f16 keys, f32 queries, GQA 5 (a partial pass of 4 heads), rank 4, left pads") {
    compare<f16_t, float>({2, 2, 10, 260, 128, 4}, {260, 200}, left_pad_mask(2, 260, {7, 0}), 2,
                          3.0f);
  }
  SECTION("bf16 keys and queries, GQA 4, head_dim 128, long rows") {
    compare<bf16_t, bf16_t>({2, 4, 16, 1500, 128, 8}, {1500, 1433},
                            left_pad_mask(2, 1500, {0, 100}), 3, 2.0f);
  }
  SECTION("bf16 keys, f16 queries, MHA (group 1), odd head_dim") {
    compare<bf16_t, f16_t>({4, 3, 3, 97, 37, 0}, {97, 50, 2, 96}, {}, 4, 4.0f);
  }
}

TEST_CASE("cuda::attention_sparsity on a hand-computed row", "[cuda][sparsity]") {
  // head_dim 4, scale 1/2; q = (2, 0, 0, 0), k_j = (x_j, 0, 0, 0): logit_j = x_j.
  // Logits {10, 9, 5.5, 5.3, 0}: cut = 10 + ln 0.01 = 5.3948; 5.3 and 0 are below: 2/5.
  // A left pad at slot 0 holding a logit of 100 must be ignored.
  const std::vector<float> keys = {100, 0, 0, 0, 10,  0, 0, 0, 9, 0, 0, 0,
                                   5.5, 0, 0, 0, 5.3, 0, 0, 0, 0, 0, 0, 0};
  const std::vector<float> q = {2, 0, 0, 0};
  const std::vector<std::uint8_t> mask = {0, 1, 1, 1, 1, 1};
  DeviceBuffer<float> d_keys(keys), d_q(q), d_out(std::vector<float>{kPoison});
  DeviceBuffer<std::uint8_t> d_mask(mask);
  std::int32_t length = 6;
  const KVCacheView kv = make_kv_cache_view(d_keys.get(), d_keys.get(), DType::f32, Device::cuda, 1,
                                            1, 6, 4, &length, d_mask.get());
  const TensorView qv = TensorView::contiguous(d_q.get(), DType::f32, Device::cuda, {1, 1, 4});
  const std::size_t ws_bytes = cuda::attention_sparsity_workspace_bytes(kv, qv);
  DeviceBuffer<char> ws(ws_bytes);
  cuda::attention_sparsity(kv, qv, d_out.get(), ws.get(), ws_bytes, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(d_out.download()[0] == 0.4f);
}

TEST_CASE("cuda::attention_sparsity returns NaN where the CPU reference throws",
          "[cuda][sparsity]") {
  // Sequence 0: every key a pad. Sequence 1: a NaN query gives NaN logits. Sequence 2: fine,
  // all keys equal so nothing is sparse (0).
  const int batch = 3, cap = 4, dim = 2;
  std::vector<float> keys(batch * cap * dim, 1.0f), q(batch * dim, 1.0f);
  q[1 * dim] = std::nanf("");
  std::vector<std::uint8_t> mask(batch * cap, 1);
  for (int j = 0; j < cap; ++j) mask[j] = 0;
  DeviceBuffer<float> d_keys(keys), d_q(q), d_out(std::vector<float>(batch, kPoison));
  DeviceBuffer<std::uint8_t> d_mask(mask);
  std::vector<std::int32_t> lengths(batch, cap);
  const KVCacheView kv = make_kv_cache_view(d_keys.get(), d_keys.get(), DType::f32, Device::cuda,
                                            batch, 1, cap, dim, lengths.data(), d_mask.get());
  const TensorView qv =
      TensorView::contiguous(d_q.get(), DType::f32, Device::cuda, {batch, 1, dim});
  const std::size_t ws_bytes = cuda::attention_sparsity_workspace_bytes(kv, qv);
  DeviceBuffer<char> ws(ws_bytes);
  cuda::attention_sparsity(kv, qv, d_out.get(), ws.get(), ws_bytes, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = d_out.download();
  CHECK(std::isnan(got[0]));
  CHECK(std::isnan(got[1]));
  CHECK(got[2] == 0.0f);
}

TEST_CASE("cuda::attention_sparsity rejects bad arguments", "[cuda][sparsity]") {
  DeviceBuffer<float> d_keys(2 * 2 * 8 * 4), d_q(2 * 6 * 4), d_out(2);
  std::vector<std::int32_t> lengths = {8, 0};
  const KVCacheView kv = make_kv_cache_view(d_keys.get(), d_keys.get(), DType::f32, Device::cuda, 2,
                                            2, 8, 4, lengths.data());
  const TensorView qv = TensorView::contiguous(d_q.get(), DType::f32, Device::cuda, {2, 6, 4});
  DeviceBuffer<char> ws(1 << 16);
  REQUIRE_THROWS_WITH(cuda::attention_sparsity(kv, qv, d_out.get(), ws.get(), 1 << 16, nullptr),
                      Catch::Matchers::Contains("lengths[1] = 0"));
  lengths[1] = 8;
  const TensorView q5 = TensorView::contiguous(d_q.get(), DType::f32, Device::cuda, {2, 5, 4});
  REQUIRE_THROWS_WITH(cuda::attention_sparsity(kv, q5, d_out.get(), ws.get(), 1 << 16, nullptr),
                      Catch::Matchers::Contains("q_heads (5)"));
  const TensorView q_dim = TensorView::contiguous(d_q.get(), DType::f32, Device::cuda, {2, 6, 3});
  REQUIRE_THROWS_WITH(cuda::attention_sparsity(kv, q_dim, d_out.get(), ws.get(), 1 << 16, nullptr),
                      Catch::Matchers::Contains("[2, 6, 3] do not match the cache [2, 2, 8, 4]"));
  std::vector<float> host_q(2 * 6 * 4);
  const TensorView q_host =
      TensorView::contiguous(host_q.data(), DType::f32, Device::cpu, {2, 6, 4});
  REQUIRE_THROWS_WITH(cuda::attention_sparsity(kv, q_host, d_out.get(), ws.get(), 1 << 16, nullptr),
                      Catch::Matchers::Contains("device memory"));
  REQUIRE_THROWS_WITH(cuda::attention_sparsity(kv, qv, d_out.get(), ws.get(), 100, nullptr),
                      Catch::Matchers::Contains("workspace of 100 bytes is too small"));
}
