// The one pass over the keys (cuda/key_pass.cu) and the vectorised column means
// (cuda/key_redundancy.cu) against a double-precision host oracle written from
// docs/algorithms.md §1.2 steps 1, 4 and 6, and against the scalar kernels they replace, with
// explicit tolerances derived from fp32 rounding (below). Cases: f32/f16/bf16 storage, head_dim
// 8, 24, 64, 128, 136 and 256 (every lane-group width), a length that is not a multiple of the
// 128-row chunks inside a larger capacity, two layers of a step (sequence z = layer · batch + b),
// left and scattered pads whose memory holds NaN, and the layouts the pass must refuse (nothing
// written) so that the scalar kernels run instead. The fp16 copy (head_dim <= 128, the
// tensor-core search's scope) is read back through tc_unit16_index: every element of its tile
// images written, zero past head_dim, for pads and from `length` to the end of the images.
//
// Tolerances, u = 2^-24 (fp32 unit roundoff), D = head_dim:
//   denom   ||K|| + 1e-8: a D-term fmaf sum, sqrt and an add: |err| <= (D + 4)·u·ref;
//   unit16  fp16 RNE (2^-11 relative; 2^-25 absolute below 2^-14) of x·(1/den):
//           |err| <= (2^-11 + 2·(D + 8)·u)·|ref| + 2^-25;
//   partial 128-row fp32 sums of values each within (D + 8)·u: |err| <= (128 + D + 8)·u·Σ|k̂|;
//   rbar    the chunks added in fp32, two D-term dot products, two divisions: |err| <=
//           (D + chunks + 16)·u·(Σ_d |x_d|·Σ_c |partial_c,d| / den + x·x/den² + |spared|) / S.
// Pads are exact: denom 0, fp16 rows 0, no contribution.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "../../cuda/rkv_kernels.cuh"  // internal launchers
#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/kv_cache_view.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

constexpr double kU = 5.9604644775390625e-8;  // 2^-24

// A step of `layers` layers of [B, H, capacity, D] keys of storage type T on the device, with
// one padding mask for all layers; `offset` elements of slack before each layer's keys (a
// misaligned base when not a multiple of 8 for 16-bit storage).
template <class T>
struct KeyStep {
  int layers, B, H, capacity, length, D, offset;
  std::vector<std::vector<T>> keys;                      // [layers][B * H * capacity * D]
  std::vector<std::uint8_t> mask;                        // [B * capacity], empty: no pads
  std::vector<std::unique_ptr<DeviceBuffer<T>>> d_keys;  // not movable: owned by pointer
  DeviceBuffer<std::uint8_t> d_mask;
  std::vector<std::int32_t> lengths;
  std::vector<KVCacheView> views;

  KeyStep(int n_layers, int b, int h, int cap, int len, int d, bool pads, std::uint32_t seed,
          int offset_elems = 0)
      : layers(n_layers),
        B(b),
        H(h),
        capacity(cap),
        length(len),
        D(d),
        offset(offset_elems),
        d_mask(static_cast<std::size_t>(b) * cap),
        lengths(static_cast<std::size_t>(b), len) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> scale(0.05f, 20.0f);
    if (pads) {
      mask.assign(static_cast<std::size_t>(B) * capacity, 1);
      for (int bb = 0; bb < B; ++bb)
        for (int i = 0; i < capacity; ++i)
          if ((bb == 1 && i < 37) || i % 29 == 5) mask[bb * capacity + i] = 0;
      d_mask.upload(mask);
    }
    const std::size_t n = static_cast<std::size_t>(B) * H * capacity * D;
    for (int l = 0; l < layers; ++l) {
      std::vector<T> k(n + offset, from_float<T>(0.0f));
      for (int bb = 0; bb < B; ++bb)
        for (int hh = 0; hh < H; ++hh)
          for (int i = 0; i < capacity; ++i) {
            const float s = scale(rng);
            const bool pad = !mask.empty() && mask[bb * capacity + i] == 0;
            const bool zero = i == 11;  // a real all-zero key: den = 1e-8, unit key 0
            for (int dd = 0; dd < D; ++dd) {
              const float x = pad ? std::numeric_limits<float>::quiet_NaN()  // never read as such
                              : zero ? 0.0f
                                     : s * nd(rng);
              k[offset + ((static_cast<std::size_t>(bb) * H + hh) * capacity + i) * D + dd] =
                  from_float<T>(x);
            }
          }
      keys.push_back(k);
      d_keys.push_back(std::make_unique<DeviceBuffer<T>>(k));
    }
    for (int l = 0; l < layers; ++l) {
      views.push_back(make_kv_cache_view(d_keys[l]->get() + offset, d_keys[l]->get() + offset,
                                         dtype_of<T>::value, Device::cuda, B, H, capacity, D,
                                         lengths.data(), pads ? d_mask.get() : nullptr));
    }
  }
  cuda::detail::StepView step() const { return {views.data(), nullptr, layers}; }
  int sequences() const { return layers * B; }
  std::size_t rows() const { return static_cast<std::size_t>(sequences()) * H * length; }
  int chunks() const { return cuda::detail::key_sum_chunks(length); }
  // The fp16 copy exists for the tensor-core search's head_dims only.
  bool has_unit16() const { return cuda::detail::tc_search_supported(D); }
  std::size_t unit16_count() const {
    return static_cast<std::size_t>(
        cuda::detail::tc_unit16_count(static_cast<std::int64_t>(sequences()) * H, length, D));
  }
  // Channels of an image row (64 or 128) and rows of the images (whole 256-row tiles).
  int image_channels() const { return D > 64 ? 128 : 64; }
  int image_rows() const { return (length + 255) / 256 * 256; }
  std::size_t u16(std::size_t bh, int i, int d) const {
    return static_cast<std::size_t>(
        cuda::detail::tc_unit16_index(static_cast<std::int64_t>(bh), i, d, length, D));
  }
  bool pad(int z, int i) const { return !mask.empty() && mask[(z % B) * capacity + i] == 0; }
  // Key channel d of row i of (sequence z, head h) as float.
  double x(int z, int h, int i, int d) const {
    const int l = z / B, b = z % B;
    return to_float(
        keys[l][offset + ((static_cast<std::size_t>(b) * H + h) * capacity + i) * D + d]);
  }
};

struct PassOut {
  std::vector<float> denom, partial;
  std::vector<std::uint16_t> unit16;
};

// Runs the one pass (or, scalar = true, the scalar kernels) into exactly sized buffers.
template <class T>
PassOut run_pass(const KeyStep<T>& ks, bool scalar, bool* accepted = nullptr,
                 bool fp16_copy = true) {
  DeviceBuffer<float> denom(ks.rows());
  const bool copy = fp16_copy && ks.has_unit16();
  DeviceBuffer<std::uint16_t> unit16(copy ? ks.unit16_count() : 1);
  std::uint16_t* const u16 = copy ? unit16.get() : nullptr;
  DeviceBuffer<float> partial(static_cast<std::size_t>(ks.sequences()) * ks.H * ks.chunks() * ks.D);
  // Poison: every output element must be written.
  KVSIFT_CUDA_CHECK(cudaMemset(denom.get(), 0xff, denom.size() * sizeof(float)));
  KVSIFT_CUDA_CHECK(cudaMemset(unit16.get(), 0xff, unit16.size() * sizeof(std::uint16_t)));
  KVSIFT_CUDA_CHECK(cudaMemset(partial.get(), 0xff, partial.size() * sizeof(float)));
  if (scalar) {
    cuda::detail::launch_key_rows_scalar(ks.step(), ks.length, denom.get(), u16, partial.get(),
                                         nullptr);
  } else {
    const bool ok = cuda::detail::launch_key_pass(ks.step(), ks.length, denom.get(), u16,
                                                  partial.get(), nullptr);
    if (accepted != nullptr) *accepted = ok;
  }
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return {denom.download(), partial.download(), unit16.download()};
}

// The oracle in double: denominators, unit keys and chunk sums (§1.2 steps 1 and 6).
struct Oracle {
  std::vector<double> den, unit, partial, abs_partial;  // unit [rows, D]
};

template <class T>
Oracle oracle(const KeyStep<T>& ks) {
  Oracle o;
  const int D = ks.D;
  o.den.assign(ks.rows(), 0.0);
  o.unit.assign(ks.rows() * D, 0.0);
  o.partial.assign(static_cast<std::size_t>(ks.sequences()) * ks.H * ks.chunks() * D, 0.0);
  o.abs_partial = o.partial;
  for (int z = 0; z < ks.sequences(); ++z)
    for (int h = 0; h < ks.H; ++h)
      for (int i = 0; i < ks.length; ++i) {
        const std::size_t r = (static_cast<std::size_t>(z) * ks.H + h) * ks.length + i;
        if (ks.pad(z, i)) continue;
        double sq = 0;
        for (int d = 0; d < D; ++d) sq += ks.x(z, h, i, d) * ks.x(z, h, i, d);
        o.den[r] = std::sqrt(sq) + 1e-8;
        const std::size_t p = ((static_cast<std::size_t>(z) * ks.H + h) * ks.chunks() +
                               i / kvsift::cuda::detail::kKeySumRows) *
                              D;
        for (int d = 0; d < D; ++d) {
          const double u = ks.x(z, h, i, d) / o.den[r];
          o.unit[r * D + d] = u;
          o.partial[p + d] += u;
          o.abs_partial[p + d] += std::fabs(u);
        }
      }
  return o;
}

float f16_value(std::uint16_t b) { return f16_bits_to_float(b); }

// Every output of `out` within the header's tolerances of the oracle; counts failures.
template <class T>
void check_against_oracle(const KeyStep<T>& ks, const PassOut& out, const Oracle& o) {
  const int D = ks.D;
  std::int64_t bad_den = 0, bad_unit = 0, bad_pad16 = 0, bad_sum = 0;
  for (std::size_t r = 0; r < ks.rows(); ++r) {
    const bool pad = o.den[r] == 0.0;
    const double den = out.denom[r];
    if (pad ? den != 0.0 : !(std::fabs(den - o.den[r]) <= (D + 4) * kU * o.den[r])) {
      if (bad_den++ < 5) UNSCOPED_INFO("denom row " << r << ": " << den << " vs " << o.den[r]);
    }
    for (int d = 0; ks.has_unit16() && d < ks.image_channels(); ++d) {
      const std::uint16_t bits =
          out.unit16[ks.u16(r / ks.length, static_cast<int>(r % ks.length), d)];
      const double v = f16_value(bits);
      if (d >= D || pad) {
        if (bits != 0) ++bad_pad16;  // +0.0 exactly
        continue;
      }
      const double ref = o.unit[r * D + d];
      if (!(std::fabs(v - ref) <=
            (1.0 / 2048 + 2 * (D + 8) * kU) * std::fabs(ref) + std::ldexp(1.0, -25))) {
        if (bad_unit++ < 5)
          UNSCOPED_INFO("unit16 row " << r << " ch " << d << ": " << v << " vs " << ref);
      }
    }
  }
  // The images' rows from `length` on: zero.
  for (std::size_t bh = 0; ks.has_unit16() && bh * ks.length < ks.rows(); ++bh)
    for (int i = ks.length; i < ks.image_rows(); ++i)
      for (int d = 0; d < ks.image_channels(); ++d)
        if (out.unit16[ks.u16(bh, i, d)] != 0) ++bad_pad16;
  for (std::size_t e = 0; e < o.partial.size(); ++e) {
    const double tol = (128 + D + 8) * kU * o.abs_partial[e];
    if (!(std::fabs(out.partial[e] - o.partial[e]) <= tol)) {
      if (bad_sum++ < 5)
        UNSCOPED_INFO("partial " << e << ": " << out.partial[e] << " vs " << o.partial[e]);
    }
  }
  CHECK(bad_den == 0);
  CHECK(bad_unit == 0);
  CHECK(bad_pad16 == 0);
  CHECK(bad_sum == 0);
}

template <class T>
void check_pass(int layers, int B, int H, int capacity, int length, int D, bool pads,
                std::uint32_t seed) {
  INFO("dtype " << dtype_name(dtype_of<T>::value) << " D " << D << " length " << length
                << " layers " << layers << " pads " << pads);
  const KeyStep<T> ks(layers, B, H, capacity, length, D, pads, seed);
  bool accepted = false;
  const PassOut ours = run_pass(ks, false, &accepted);
  REQUIRE(accepted);
  const Oracle o = oracle(ks);
  check_against_oracle(ks, ours, o);
  // The scalar kernels meet the same oracle (the tolerances are not tailored to the new pass).
  const PassOut scalar = run_pass(ks, true);
  check_against_oracle(ks, scalar, o);
  // Run to run: bit-identical.
  const PassOut again = run_pass(ks, false);
  CHECK(again.denom == ours.denom);
  CHECK(again.unit16 == ours.unit16);
  CHECK(again.partial == ours.partial);
  // Without the fp16 copy (the fp32 search's call): the same divisors and sums, bit for bit, in
  // both kernels, as the two searches' shared column means need.
  const PassOut bare = run_pass(ks, false, nullptr, false);
  CHECK(bare.denom == ours.denom);
  CHECK(bare.partial == ours.partial);
  const PassOut bare_scalar = run_pass(ks, true, nullptr, false);
  CHECK(bare_scalar.denom == scalar.denom);
  CHECK(bare_scalar.partial == scalar.partial);
}

// rbar of the vectorised or scalar column means, for given denominators, chunk sums and spared
// sums, against the double formula of §1.2 step 4 with the same inputs. `B` sequences a layer,
// `H` heads, two layers.
template <class T>
void check_column_means(int D, bool pads, std::uint32_t seed, int B = 2, int H = 2,
                        int length = 300) {
  INFO("column means, dtype " << dtype_name(dtype_of<T>::value) << " D " << D << " pads " << pads
                              << " B " << B << " H " << H << " length " << length);
  const KeyStep<T> ks(2, B, H, length + 20, length, D, pads, seed);
  const cuda::detail::StepView step = ks.step();
  REQUIRE(cuda::detail::key_rows_vectorizable(step));
  const std::size_t rows = ks.rows();
  DeviceBuffer<float> denom(rows),
      partial(static_cast<std::size_t>(ks.sequences()) * ks.H * ks.chunks() * D);
  REQUIRE(
      cuda::detail::launch_key_pass(step, ks.length, denom.get(), nullptr, partial.get(), nullptr));
  std::mt19937 rng(seed + 1);
  std::uniform_real_distribution<double> cosine(-1.0, 1.0);
  std::vector<unsigned long long> spared(rows);
  for (auto& s : spared)  // a few spared cosines per column, 32.32 fixed point
    s = static_cast<unsigned long long>(std::llrint((cosine(rng) + cosine(rng)) * 4294967296.0));
  DeviceBuffer<unsigned long long> d_spared(spared);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> den = denom.download(), part = partial.download();
  for (bool vectorized : {true, false}) {
    INFO("vectorized " << vectorized);
    DeviceBuffer<float> rbar(rows);
    KVSIFT_CUDA_CHECK(cudaMemset(rbar.get(), 0xff, rows * sizeof(float)));
    cuda::detail::launch_column_means(step, ks.length, denom.get(), d_spared.get(), partial.get(),
                                      rbar.get(), vectorized, nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = rbar.download();
    std::int64_t bad = 0;
    for (int z = 0; z < ks.sequences(); ++z)
      for (int h = 0; h < ks.H; ++h) {
        const std::size_t bh = static_cast<std::size_t>(z) * ks.H + h;
        std::vector<double> total(D, 0.0), abs_total(D, 0.0);
        for (int c = 0; c < ks.chunks(); ++c)
          for (int d = 0; d < D; ++d) {
            total[d] += part[(bh * ks.chunks() + c) * D + d];
            abs_total[d] += std::fabs(part[(bh * ks.chunks() + c) * D + d]);
          }
        for (int j = 0; j < ks.length; ++j) {
          const std::size_t r = bh * ks.length + j;
          const double sp = static_cast<double>(static_cast<long long>(spared[r])) / 4294967296.0;
          double own = 0, scale = std::fabs(sp);
          if (den[r] != 0.0f) {  // pads: own = 0 (their memory holds NaN)
            double dot = 0, adot = 0, sq = 0;
            for (int d = 0; d < D; ++d) {
              const double x = ks.x(z, h, j, d);
              dot += x * total[d];
              adot += std::fabs(x) * abs_total[d];
              sq += x * x;
            }
            const double dd = den[r];
            own = dot / dd - sq / (dd * dd);
            scale += adot / dd + sq / (dd * dd);
          }
          const double ref = (own - sp) / ks.length;
          const double tol = (D + ks.chunks() + 16) * kU * scale / ks.length + 1e-30;
          if (!(std::fabs(got[r] - ref) <= tol)) {
            if (bad++ < 5) UNSCOPED_INFO("rbar row " << r << ": " << got[r] << " vs " << ref);
          }
        }
      }
    CHECK(bad == 0);
  }
}

}  // namespace

TEST_CASE("one key pass: norms, fp16 unit keys and key sums match a double oracle",
          "[cuda][rkv][keypass]") {
  SECTION("bf16, head_dim 128, two layers, pads, ragged chunk") {
    check_pass<bf16_t>(2, 2, 3, 320, 300, 128, true, 1);
  }
  SECTION("bf16, head_dim 64 and 8, no pads") {
    check_pass<bf16_t>(1, 1, 2, 256, 256, 64, false, 2);
    check_pass<bf16_t>(1, 2, 1, 130, 129, 8, false, 3);
  }
  SECTION("f16, head_dim 24 (a zero-padding lane) and 136 (32 lanes)") {
    check_pass<f16_t>(2, 2, 2, 200, 150, 24, true, 4);
    check_pass<f16_t>(1, 2, 2, 140, 140, 136, true, 5);
  }
  SECTION("f32, head_dim 128 and 256, a single short sequence") {
    check_pass<float>(2, 2, 2, 320, 300, 128, true, 6);
    check_pass<float>(1, 1, 1, 40, 7, 256, false, 7);
  }
}

TEST_CASE("one key pass: layouts without 16-byte accesses are refused, untouched",
          "[cuda][rkv][keypass]") {
  auto refused = [](const auto& ks, bool misalign_unit16) {
    DeviceBuffer<float> denom(ks.rows() + 1);
    DeviceBuffer<std::uint16_t> unit16(ks.unit16_count() + 8);
    DeviceBuffer<float> partial(static_cast<std::size_t>(ks.sequences()) * ks.H * ks.chunks() *
                                ks.D);
    KVSIFT_CUDA_CHECK(cudaMemset(denom.get(), 0x7f, denom.size() * sizeof(float)));
    const bool ok = cuda::detail::launch_key_pass(ks.step(), ks.length, denom.get(),
                                                  unit16.get() + (misalign_unit16 ? 1 : 0),
                                                  partial.get(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> after = denom.download();
    std::vector<float> poison(after.size());
    std::memset(poison.data(), 0x7f, poison.size() * sizeof(float));
    CHECK(std::memcmp(after.data(), poison.data(), after.size() * sizeof(float)) == 0);
    return !ok;
  };
  // head_dim 100: not a multiple of 8 (bf16), and 264: above 256.
  CHECK(refused(KeyStep<bf16_t>(1, 1, 1, 40, 40, 100, false, 8), false));
  CHECK(refused(KeyStep<bf16_t>(1, 1, 1, 40, 40, 264, false, 9), false));
  // f32 head_dim 4: 16 bytes per row, but not whole 8-channel vectors.
  CHECK(refused(KeyStep<float>(1, 1, 1, 40, 40, 4, false, 10), false));
  // A base 2 bytes past a 16-byte boundary, and a misaligned fp16 copy.
  CHECK(refused(KeyStep<bf16_t>(1, 1, 1, 40, 40, 128, false, 11, 1), false));
  CHECK(refused(KeyStep<bf16_t>(1, 1, 1, 40, 40, 128, false, 12), true));
  CHECK_FALSE(cuda::detail::key_rows_vectorizable(
      KeyStep<bf16_t>(1, 1, 1, 40, 40, 128, false, 13, 1).step()));
}

TEST_CASE("key pass: an fp16 copy outside the tensor-core search's head_dims is refused",
          "[cuda][rkv][keypass]") {
  const KeyStep<f16_t> ks(1, 1, 1, 40, 40, 136, false, 14);  // vectorizable, but above 128
  DeviceBuffer<float> denom(ks.rows()), partial(static_cast<std::size_t>(ks.chunks()) * ks.D);
  DeviceBuffer<std::uint16_t> unit16(ks.unit16_count());
  CHECK_THROWS_WITH(cuda::detail::launch_key_pass(ks.step(), ks.length, denom.get(), unit16.get(),
                                                  partial.get(), nullptr),
                    Catch::Matchers::Contains("head_dim = 136"));
  CHECK_THROWS_AS(cuda::detail::launch_key_rows_scalar(ks.step(), ks.length, denom.get(),
                                                       unit16.get(), partial.get(), nullptr),
                  kvsift::Error);
}

TEST_CASE("vectorised column means match the double formula of §1.2 step 4",
          "[cuda][rkv][keypass]") {
  check_column_means<bf16_t>(128, true, 21);
  check_column_means<f16_t>(24, false, 22);
  check_column_means<float>(256, true, 23);
}

TEST_CASE("vectorised column means: many tiles a block, heads changing inside a block",
          "[cuda][rkv][keypass]") {
  // 2 layers x 16 sequences x 8 heads x 18 tiles of 64 rows (the last one partial): more tiles
  // than the GPU holds blocks, so each block runs several tiles, double-buffered, across heads.
  check_column_means<bf16_t>(128, true, 24, 16, 8, 1100);
  check_column_means<f16_t>(64, false, 25, 16, 8, 1031);
}

// The compaction's software pipeline (cuda/compact.cu: the reads of tile k + 1 overlap the writes
// of tile k) on rows that move far: each row keeps a stretch of the second half of a long
// sequence and a few scattered early slots, so most reads hit rows that later tiles write. The
// oracle is the definition: new row i = old row slots[i].
TEST_CASE("compact_device_rows moves rows from far ahead across many tiles",
          "[cuda][compact][keypass]") {
  const int B = 2, H = 3, C = 3000, D = 128, keep = 1400;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const std::size_t n = static_cast<std::size_t>(B) * H * C * D;
  std::vector<bf16_t> k(n), v(n);
  for (auto& x : k) x = from_float<bf16_t>(nd(rng));
  for (auto& x : v) x = from_float<bf16_t>(nd(rng));
  std::vector<std::int32_t> slots(static_cast<std::size_t>(B) * H * keep);
  for (int r = 0; r < B * H; ++r) {
    std::int32_t* row = &slots[static_cast<std::size_t>(r) * keep];
    const int early = 5 + r;  // slots 0, 7, 14, ... then the stretch C − (keep − early) .. C − 1
    for (int i = 0; i < early; ++i) row[i] = 7 * i;
    for (int i = early; i < keep; ++i) row[i] = C - keep + i;
  }
  DeviceBuffer<bf16_t> dk(k), dv(v);
  DeviceBuffer<std::int32_t> dslots(slots), new_lengths(B);
  std::vector<std::int32_t> lengths(B, C);
  const KVCacheView kv =
      make_kv_cache_view(dk.get(), dv.get(), DType::bf16, Device::cuda, B, H, C, D, lengths.data());
  cuda::compact_device_rows(kv, dslots.get(), keep, new_lengths.get(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(new_lengths.download() == std::vector<std::int32_t>(B, keep));
  const std::vector<bf16_t> gk = dk.download(), gv = dv.download();
  std::int64_t bad = 0;
  for (int r = 0; r < B * H; ++r)
    for (int i = 0; i < keep; ++i) {
      const std::size_t dst = (static_cast<std::size_t>(r) * C + i) * D;
      const std::size_t src =
          (static_cast<std::size_t>(r) * C + slots[static_cast<std::size_t>(r) * keep + i]) * D;
      bad += std::memcmp(&gk[dst], &k[src], D * sizeof(bf16_t)) != 0;
      bad += std::memcmp(&gv[dst], &v[src], D * sizeof(bf16_t)) != 0;
    }
  CHECK(bad == 0);
}

namespace {

// Window queries [B, H·group, W, D] per layer of a KeyStep, on the device, and the step with them.
template <class T>
struct QuerySet {
  int group, W;
  std::vector<std::vector<T>> q;  // [layers][B * H * group * W * D]
  std::vector<std::unique_ptr<DeviceBuffer<T>>> d_q;
  std::vector<TensorView> views;
  QuerySet(const KeyStep<T>& ks, int g, int w, std::uint32_t seed) : group(g), W(w) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    const std::size_t n = static_cast<std::size_t>(ks.B) * ks.H * g * w * ks.D;
    for (int l = 0; l < ks.layers; ++l) {
      std::vector<T> v(n);
      for (auto& x : v) x = from_float<T>(2.0f * nd(rng));
      q.push_back(v);
      d_q.push_back(std::make_unique<DeviceBuffer<T>>(v));
      views.push_back(TensorView::contiguous(d_q.back()->get(), dtype_of<T>::value, Device::cuda,
                                             {ks.B, ks.H * g, w, ks.D}));
    }
  }
  double at(const KeyStep<T>& ks, int z, int qh, int w, int d) const {
    const int l = z / ks.B, b = z % ks.B;
    return to_float(q[l][((static_cast<std::size_t>(b) * ks.H * group + qh) * W + w) * ks.D + d]);
  }
};

template <class T>
void check_pass_with_logits(int D, int group, int W, bool pads, std::uint32_t seed) {
  INFO("logits: dtype " << dtype_name(dtype_of<T>::value) << " D " << D << " group " << group
                        << " window " << W << " pads " << pads);
  const KeyStep<T> ks(2, 2, 2, 320, 300, D, pads, seed);
  const QuerySet<T> qs(ks, group, W, seed + 100);
  const cuda::detail::StepView step{ks.views.data(), qs.views.data(), ks.layers};
  const int n = ks.length - W;
  const std::size_t logit_count = static_cast<std::size_t>(ks.sequences()) * ks.H * W * n;
  DeviceBuffer<float> denom(ks.rows()),
      partial(static_cast<std::size_t>(ks.sequences()) * ks.H * ks.chunks() * D);
  DeviceBuffer<std::uint16_t> unit16(ks.unit16_count());
  DeviceBuffer<float> fused(logit_count), separate(logit_count);
  DeviceBuffer<float> pre_pool(static_cast<std::size_t>(ks.sequences()) * ks.H * n),
      importance(static_cast<std::size_t>(ks.sequences()) * ks.H * n);
  KVSIFT_CUDA_CHECK(cudaMemset(fused.get(), 0xff, logit_count * sizeof(float)));  // NaN poison
  bool written = false;
  REQUIRE(cuda::detail::launch_key_pass(step, ks.length, denom.get(), unit16.get(), partial.get(),
                                        nullptr, fused.get(), &written));
  REQUIRE(written);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> f_denom = denom.download(), f_partial = partial.download();
  const std::vector<std::uint16_t> f_unit16 = unit16.download();
  // The separate tensor-core logits kernel (and its softmax/pool, not compared here).
  cuda::detail::launch_window_importance(step, ks.length, 7, separate.get(), pre_pool.get(),
                                         importance.get(), nullptr, false);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = fused.download(), want = separate.download();
  CHECK(std::memcmp(got.data(), want.data(), logit_count * sizeof(float)) == 0);
  // The other outputs are those of the pass without logits, bit for bit.
  const PassOut plain = run_pass(ks, false);
  CHECK(f_denom == plain.denom);
  CHECK(f_partial == plain.partial);
  CHECK(f_unit16 == plain.unit16);
  // And the logits against the definition (§1.1 steps 1 and 5) in double: products of two 16-bit
  // values are exact in fp32, so only the D-term tensor-core accumulation (at most two roundings of
  // 2^-23 per term, key_redundancy_tc.cu's bound: 4·D·u) and the scaling round.
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::int64_t bad = 0;
  for (int z = 0; z < ks.sequences(); ++z)
    for (int h = 0; h < ks.H; ++h)
      for (int w = 0; w < W; ++w)
        for (int j = 0; j < n; ++j) {
          const float x = got[((static_cast<std::size_t>(z) * ks.H + h) * W + w) * n + j];
          if (ks.pad(z, j)) {
            bad += x != -1e9f;
            continue;
          }
          double best = -INFINITY, mag = 0;
          for (int g = 0; g < group; ++g) {
            double dot = 0, abs_dot = 0;
            for (int d = 0; d < D; ++d) {
              const double p = qs.at(ks, z, h * group + g, w, d) * ks.x(z, h, j, d);
              dot += p;
              abs_dot += std::fabs(p);
            }
            best = std::max(best, dot);
            mag = std::max(mag, abs_dot);
          }
          const double ref = best * scale;
          if (!(std::fabs(x - ref) <= (4 * D + 8) * kU * mag * scale + 1e-30)) {
            if (bad++ < 5)
              UNSCOPED_INFO("logit z " << z << " h " << h << " w " << w << " j " << j << ": " << x
                                       << " vs " << ref);
          }
        }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("one key pass with window logits: bit for bit the separate tensor-core kernel",
          "[cuda][rkv][keypass]") {
  SECTION("bf16, head_dim 128, group 4 × window 8, pads") {
    check_pass_with_logits<bf16_t>(128, 4, 8, true, 31);
  }
  SECTION("f16, head_dim 64, group 8 × window 8 (64 rows), no pads") {
    check_pass_with_logits<f16_t>(64, 8, 8, false, 32);
  }
  SECTION("bf16, head_dim 24, group 3 × window 5 (15 rows, one m tile), pads") {
    check_pass_with_logits<bf16_t>(24, 3, 5, true, 33);
  }
  SECTION("bf16, window 50: a chunk entirely inside the window, one partly (idle warps)") {
    check_pass_with_logits<bf16_t>(128, 1, 50, true, 34);
  }
  SECTION("f32 storage or group · window > 64: the pass runs, the logits are left to the kernel") {
    const KeyStep<float> ks(1, 1, 1, 40, 40, 128, false, 35);
    const QuerySet<float> qs(ks, 4, 8, 36);
    const cuda::detail::StepView step{ks.views.data(), qs.views.data(), 1};
    DeviceBuffer<float> denom(ks.rows()), partial(ks.chunks() * 128), logits(4 * 8 * 32);
    KVSIFT_CUDA_CHECK(cudaMemset(logits.get(), 0x7f, logits.size() * sizeof(float)));
    bool written = true;
    CHECK(cuda::detail::launch_key_pass(step, ks.length, denom.get(), nullptr, partial.get(),
                                        nullptr, logits.get(), &written));
    CHECK_FALSE(written);
    const KeyStep<bf16_t> kb(1, 1, 1, 80, 80, 64, false, 37);
    const QuerySet<bf16_t> qb(kb, 9, 8, 38);  // 72 rows
    const cuda::detail::StepView step_b{kb.views.data(), qb.views.data(), 1};
    DeviceBuffer<float> denom_b(kb.rows()), partial_b(kb.chunks() * 64);
    written = true;
    CHECK(cuda::detail::launch_key_pass(step_b, kb.length, denom_b.get(), nullptr, partial_b.get(),
                                        nullptr, logits.get(), &written));
    CHECK_FALSE(written);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> after = logits.download();
    std::vector<float> poison(after.size());
    std::memset(poison.data(), 0x7f, poison.size() * sizeof(float));
    CHECK(std::memcmp(after.data(), poison.data(), after.size() * sizeof(float)) == 0);
  }
}
