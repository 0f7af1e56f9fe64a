// kvsift::cuda::compact against the CPU reference kvsift::compact: same rows, bit for bit, for every
// dtype, head_dim and a padding mask; error paths leave the device cache untouched.
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/core/compact.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

// A random plan: per (b, h) a random sorted subset of the prefix plus the window.
KeepPlan random_plan(int B, int H, int C, const std::vector<std::int32_t>& lens,
                     const std::vector<std::int32_t>& kept, int window, std::mt19937& rng,
                     bool same_rows_per_head) {
  KeepPlan plan(B, H, C, lens, kept, window);
  for (int b = 0; b < B; ++b) {
    std::vector<std::int32_t> row;
    for (int h = 0; h < H; ++h) {
      if (!same_rows_per_head || h == 0) {
        const int w = std::min(window, kept[b]);
        std::vector<std::int32_t> prefix(lens[b] - w);
        for (int i = 0; i < lens[b] - w; ++i) prefix[i] = i;
        std::shuffle(prefix.begin(), prefix.end(), rng);
        row.assign(prefix.begin(), prefix.begin() + (kept[b] - w));
        std::sort(row.begin(), row.end());
        for (int i = 0; i < w; ++i) row.push_back(lens[b] - w + i);
      }
      plan.append_row(row);
    }
  }
  return plan;
}

template <class T>
void check_against_cpu(int B, int H, int C, int D, bool with_mask, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const std::size_t n = static_cast<std::size_t>(B) * H * C * D;
  std::vector<T> k(n), v(n);
  for (auto& x : k) x = from_float<T>(nd(rng));
  for (auto& x : v) x = from_float<T>(nd(rng));
  std::vector<std::int32_t> lens(B), kept(B);
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(B) * C, 1);
  for (int b = 0; b < B; ++b) {
    lens[b] = std::uniform_int_distribution<int>(C / 2, C)(rng);
    kept[b] = std::uniform_int_distribution<int>(1, lens[b])(rng);
    if (with_mask) {
      for (int i = 0; i < lens[b] / 4; ++i) mask[b * C + i] = 0;
    }
  }
  const int window = 4;
  for (int b = 0; b < B; ++b) kept[b] = std::max(kept[b], std::min(window, lens[b]));
  // With a mask the heads of one sequence must keep pads alike: give them the same rows.
  const KeepPlan plan = random_plan(B, H, C, lens, kept, window, rng, with_mask);

  DeviceBuffer<T> dk(k), dv(v);
  DeviceBuffer<std::uint8_t> dmask(mask);
  std::vector<std::int32_t> dev_lens = lens, host_lens = lens;
  auto dev_view = make_kv_cache_view(dk.get(), dv.get(), dtype_of<T>::value, Device::cuda, B, H, C,
                                     D, dev_lens.data(), with_mask ? dmask.get() : nullptr);
  auto host_view = make_kv_cache_view(k.data(), v.data(), dtype_of<T>::value, Device::cpu, B, H, C,
                                      D, host_lens.data(), with_mask ? mask.data() : nullptr);
  DeviceBuffer<char> ws(cuda::compact_workspace_bytes(plan));
  cuda::compact(dev_view, plan, ws.get(), ws.size(), nullptr);
  compact(host_view, plan);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

  REQUIRE(dev_lens == host_lens);
  const auto gk = dk.download(), gv = dv.download();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const std::size_t off = (static_cast<std::size_t>(b) * H + h) * C * D;
      // Compare the kept prefix; rows past the new length are unspecified.
      REQUIRE(std::memcmp(&gk[off], &k[off], sizeof(T) * D * host_lens[b]) == 0);
      REQUIRE(std::memcmp(&gv[off], &v[off], sizeof(T) * D * host_lens[b]) == 0);
    }
  if (with_mask) {
    const auto gm = dmask.download();
    for (int b = 0; b < B; ++b)
      REQUIRE(std::equal(gm.begin() + b * C, gm.begin() + b * C + host_lens[b], mask.begin() + b * C));
  }
}

}  // namespace

TEST_CASE("cuda::compact equals the CPU compaction bit for bit", "[cuda][compact]") {
  std::uint32_t seed = 1;
  for (int D : {64, 128, 3}) {  // 16-byte, 4-byte and 2-byte access paths
    for (bool mask : {false, true}) {
      INFO("head_dim " << D << " mask " << mask);
      check_against_cpu<float>(3, 4, 300, D, mask, seed++);
      check_against_cpu<f16_t>(3, 4, 300, D, mask, seed++);
      check_against_cpu<bf16_t>(3, 4, 300, D, mask, seed++);
    }
  }
  // A long row: many tiles, so the in-place read-then-write ordering is exercised across tiles.
  check_against_cpu<bf16_t>(2, 8, 4096, 128, false, 99);
}

TEST_CASE("cuda::compact rejects bad calls before writing anything", "[cuda][compact]") {
  const int B = 1, H = 2, C = 16, D = 8;
  std::vector<float> k(B * H * C * D);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = float(i);
  DeviceBuffer<float> dk(k), dv(k);
  std::vector<std::int32_t> lens = {16};
  auto view = make_kv_cache_view(dk.get(), dv.get(), DType::f32, Device::cuda, B, H, C, D,
                                 lens.data());
  std::mt19937 rng(3);
  const KeepPlan plan = random_plan(B, H, C, {16}, {6}, 2, rng, false);
  SECTION("workspace too small") {
    DeviceBuffer<char> ws(8);
    REQUIRE_THROWS_WITH(cuda::compact(view, plan, ws.get(), ws.size(), nullptr),
                        Catch::Matchers::Contains("workspace of 8 bytes is too small"));
  }
  SECTION("host memory passed as a device cache") {
    auto host_view = view;
    host_view.keys.device = host_view.values.device = Device::cpu;
    DeviceBuffer<char> ws(cuda::compact_workspace_bytes(plan));
    REQUIRE_THROWS_WITH(cuda::compact(host_view, plan, ws.get(), ws.size(), nullptr),
                        Catch::Matchers::Contains("use kvsift::compact"));
  }
  SECTION("a plan for other lengths") {
    std::vector<std::int32_t> other = {15};
    auto stale = view;
    stale.lengths = other.data();
    DeviceBuffer<char> ws(cuda::compact_workspace_bytes(plan));
    REQUIRE_THROWS_WITH(cuda::compact(stale, plan, ws.get(), ws.size(), nullptr),
                        Catch::Matchers::Contains("made for lengths[0] = 16"));
  }
  REQUIRE(lens[0] == 16);
  REQUIRE(dk.download() == k);
  REQUIRE(dv.download() == k);
}

TEST_CASE("cuda::compact_device_rows equals the CPU compaction of the same rows",
          "[cuda][compact]") {
  const int B = 3, H = 4, C = 200, D = 64, stride = 96;
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  std::vector<bf16_t> k(std::size_t(B) * H * C * D), v(k.size());
  for (auto& x : k) x = from_float<bf16_t>(nd(rng));
  for (auto& x : v) x = from_float<bf16_t>(nd(rng));
  std::vector<std::int32_t> lens = {200, 150, 180};
  // Sequence 0 keeps a full row, sequence 1 fewer (kRowEnd-padded), sequence 2 is invalid.
  std::vector<std::int32_t> kept = {96, 70, 96};
  const KeepPlan plan = random_plan(B, H, C, lens, kept, 4, rng, true);
  std::vector<std::int32_t> rows(std::size_t(B) * H * stride, cuda::kRowEnd);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < kept[b]; ++i) rows[(b * H + h) * stride + i] = plan.row(b, h)[i];
  for (int i = 0; i < stride; ++i) rows[(2 * H + 1) * stride + i] = cuda::kRowInvalid;
  std::vector<std::uint8_t> mask(std::size_t(B) * C, 1);

  DeviceBuffer<bf16_t> dk(k), dv(v);
  DeviceBuffer<std::int32_t> drows(rows), dnew(std::vector<std::int32_t>(B, 12345));
  DeviceBuffer<std::uint8_t> dmask(mask);
  std::vector<std::int32_t> dev_lens = lens;
  auto view = make_kv_cache_view(dk.get(), dv.get(), DType::bf16, Device::cuda, B, H, C, D,
                                 dev_lens.data(), dmask.get());
  cuda::compact_device_rows(view, drows.get(), stride, dnew.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  REQUIRE(dnew.download() == std::vector<std::int32_t>{96, 70, -1});
  REQUIRE(dev_lens == lens);  // host lengths are the engine's to update

  const auto gk = dk.download(), gv = dv.download();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const std::size_t off = (std::size_t(b) * H + h) * C * D;
      if (b == 2) {  // invalid sequence: untouched
        REQUIRE(std::memcmp(&gk[off], &k[off], sizeof(bf16_t) * C * D) == 0);
        continue;
      }
      for (int i = 0; i < kept[b]; ++i) {
        const std::size_t src = off + std::size_t(plan.row(b, h)[i]) * D;
        REQUIRE(std::memcmp(&gk[off + std::size_t(i) * D], &k[src], sizeof(bf16_t) * D) == 0);
        REQUIRE(std::memcmp(&gv[off + std::size_t(i) * D], &v[src], sizeof(bf16_t) * D) == 0);
      }
    }
  SECTION("bad stride") {
    REQUIRE_THROWS_WITH(cuda::compact_device_rows(view, drows.get(), C + 1, dnew.get(), nullptr),
                        Catch::Matchers::Contains("row_stride (201)"));
  }
}
