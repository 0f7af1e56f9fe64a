// The tensor-core last-match search (cuda/key_redundancy_tc.cu, RKVConfig::
// tensor_core_search) against
//   - an exact host oracle of the fp32 search: r_i = max{ j != i : C[i,j] > t } with C computed
//     as a sequential fmaf chain over d from 0.0f (the fp32 kernel's arithmetic), and the spared
//     cosines summed in 32.32 fixed point: r_i and the sums must be equal, not close;
//   - the fp32 GPU path itself: rkv_score's score, importance and redundancy bit for bit,
// on random, clustered, near-threshold (cosines within 3e-3 of 0.5: inside and outside the
// margin of ~1.03e-3, and thresholds equal to an
// actual fp32 cosine), duplicate-key and padded inputs, f32/f16/bf16 storage, head_dim 64, 128,
// 100 (tensor cores, zero-padded to 112) and 30 / 3 (not a multiple of 4: the fp32 search runs);
// the search alone with its re-check rows read both in 16-byte vectors and channel by channel,
// and with phase 1's re-checks deferred in lists of 512, 1 and 0 pairs a block; and that an H200
// runs the wgmma build of the search.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "../../cuda/rkv_kernels.cuh"  // internal launchers: the search alone, r_i out
#include "catch.hpp"
#include "device_buffer.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

// ---- unit-key level: the search alone ------------------------------------------------------

float fp32_cosine(const float* a, const float* b, int D) {
  float acc = 0.0f;
  for (int d = 0; d < D; ++d) acc = std::fma(a[d], b[d], acc);
  return acc;
}

std::uint64_t to_fixed(float x) {  // the kernels' __double2ll_rn(x · 2^32), two's complement
  return static_cast<std::uint64_t>(std::llrint(static_cast<double>(x) * 4294967296.0));
}

struct SearchResult {
  std::vector<int> match;                  // [B, H, S]
  std::vector<unsigned long long> spared;  // [B, H, S]
};

// Unit keys [B, H, S, D] (any fp32 values: the search takes them as given).
SearchResult oracle_search(const std::vector<float>& unit, int BH, int S, int D, float threshold,
                           bool faithful) {
  SearchResult r{std::vector<int>(static_cast<std::size_t>(BH) * S, -1),
                 std::vector<unsigned long long>(static_cast<std::size_t>(BH) * S, 0)};
  for (int bh = 0; bh < BH; ++bh) {
    const float* u = &unit[static_cast<std::size_t>(bh) * S * D];
    for (int i = 0; i < S; ++i) {
      int m = -1;
      for (int j = S - 1; j >= 0 && m < 0; --j)
        if (j != i && fp32_cosine(u + i * D, u + j * D, D) > threshold) m = j;
      r.match[bh * S + i] = m;
      if (m >= 0)
        r.spared[bh * S + m] += to_fixed(fp32_cosine(u + i * D, u + m * D, D));
      else if (faithful && i != 0)
        r.spared[bh * S + 0] += to_fixed(fp32_cosine(u + i * D, u, D));
    }
  }
  return r;
}

// Both ways of reading the re-checks' rows (16-byte vectors when D % 8 == 0, channel by channel
// always) must give the same answer, and so must phase 1 with its re-checks deferred as the
// library runs it (room for 512 pairs a block), with room for one (a resolution after every tile
// that has a pair, the rest re-checked at once) and with none (every pair re-checked where it is
// found); the first run (vector rows where D % 8 == 0, the library's deferral) is returned.
SearchResult gpu_search(const std::vector<float>& unit, int B, int H, int S, int D, float threshold,
                        bool faithful) {
  const std::size_t n = static_cast<std::size_t>(B) * H * S;
  DeviceBuffer<float> d_unit(unit);
  DeviceBuffer<int> d_match(n);
  DeviceBuffer<int> d_reached(static_cast<std::size_t>(B) * H * cuda::detail::tc_row_tiles(S));
  DeviceBuffer<unsigned long long> d_spared(n);
  // The unit keys as a cache of f32 "keys" with divisor 1 (x / 1 = x exactly), and the fp16 copy
  // the normalisation writes: RNE of every unit value, rows zero-padded.
  DeviceBuffer<float> d_denom(std::vector<float>(n, 1.0f));
  cuda::detail::UnitKeys u{};
  u.keys.base[0] = reinterpret_cast<char*>(d_unit.get());
  u.keys.batch = B;
  u.keys.stride_b = static_cast<std::int64_t>(H) * S * D * sizeof(float);
  u.stride_h = static_cast<std::int64_t>(S) * D;
  u.stride_s = D;
  u.denom = d_denom.get();
  u.kv_heads = H;
  u.length = S;
  // In the search's tile images (zero elsewhere), placed by the index function of the layout.
  std::vector<f16_t> unit16(static_cast<std::size_t>(cuda::detail::tc_unit16_count(
                                static_cast<std::int64_t>(B) * H, S, D)),
                            from_float<f16_t>(0.0f));
  for (std::size_t r = 0; r < n; ++r)
    for (int d = 0; d < D; ++d)
      unit16[static_cast<std::size_t>(cuda::detail::tc_unit16_index(
          static_cast<std::int64_t>(r / S), static_cast<int>(r % S), d, S, D))] =
          from_float<f16_t>(unit[r * D + d]);
  DeviceBuffer<f16_t> d_unit16(unit16);
  const auto run = [&](bool vectorized, int pair_slots) {
    KVSIFT_CUDA_CHECK(
        cudaMemset(d_match.get(), 0x7f, n * sizeof(int)));  // garbage: reset by the launcher
    KVSIFT_CUDA_CHECK(cudaMemset(d_reached.get(), 0x7f, d_reached.size() * sizeof(int)));
    KVSIFT_CUDA_CHECK(cudaMemset(d_spared.get(), 0, n * sizeof(unsigned long long)));
    cuda::detail::launch_last_match_tc(u, DType::f32, d_unit16.get(), B, H, S, D, threshold,
                                       faithful, vectorized, d_spared.get(), d_match.get(),
                                       d_reached.get(), nullptr, pair_slots);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    return SearchResult{d_match.download(), d_spared.download()};
  };
  const SearchResult deferred = run(D % 8 == 0, -1);
  const std::pair<bool, int> variants[] = {{false, -1}, {D % 8 == 0, 1}, {false, 0}};
  for (const auto& [vectorized, slots] : variants) {
    INFO("vectorized " << vectorized << ", pair slots " << slots);
    const SearchResult other = run(vectorized, slots);
    REQUIRE(other.match == deferred.match);
    REQUIRE(other.spared == deferred.spared);
  }
  return deferred;
}

void normalize_rows(std::vector<float>& x, int D) {
  for (std::size_t r = 0; r * D < x.size(); ++r) {
    double s = 0;
    for (int d = 0; d < D; ++d) s += double(x[r * D + d]) * x[r * D + d];
    if (s == 0) continue;  // pad rows stay zero
    for (int d = 0; d < D; ++d) x[r * D + d] = static_cast<float>(x[r * D + d] / std::sqrt(s));
  }
}

// staged: row tiles of 256 built so that some phase-1 blocks stop early and others sweep to
// their diagonal, so phase 2 mixes recomputed column tiles with ones covered by transposed
// results, and many rows' last match lies in a recomputed tile above a covered one.
enum class Keys { random, clustered, near_threshold, duplicates, staged };

// Keys [BH, S, D] of one kind, normalised; `pad_every` > 0 zeroes every pad_every-th row.
std::vector<float> make_unit_keys(Keys kind, int BH, int S, int D, std::uint32_t seed,
                                  int pad_every = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<double> ud(-3e-3, 3e-3);
  std::vector<float> k(static_cast<std::size_t>(BH) * S * D);
  for (int bh = 0; bh < BH; ++bh) {
    float* base = &k[static_cast<std::size_t>(bh) * S * D];
    std::vector<double> anchor(D), common(D);
    double an = 0;
    for (int d = 0; d < D; ++d) an += (anchor[d] = nd(rng)) * anchor[d];
    for (auto& a : anchor) a /= std::sqrt(an);
    for (auto& c : common) c = 1.5 * nd(rng);
    for (int i = 0; i < S; ++i) {
      float* row = base + i * D;
      switch (kind) {
        case Keys::random:
          for (int d = 0; d < D; ++d) row[d] = nd(rng);
          break;
        case Keys::clustered:
          for (int d = 0; d < D; ++d) row[d] = static_cast<float>(nd(rng) + common[d]);
          break;
        case Keys::near_threshold: {
          // Every 7th row is the anchor (tiny noise: those match each other for sure); the others
          // have cosine 0.5 ± 3e-3 with the anchor: c·anchor + sqrt(1 − c²)·(unit ⟂ anchor).
          std::vector<double> v(D);
          double dot = 0, vn = 0;
          for (int d = 0; d < D; ++d) dot += (v[d] = nd(rng)) * anchor[d];
          for (int d = 0; d < D; ++d) vn += (v[d] -= dot * anchor[d]) * v[d];
          const double c = i % 7 == 0 ? 1.0 - 1e-7 : 0.5 + ud(rng);
          const double s = std::sqrt(1.0 - c * c) / std::sqrt(vn);
          for (int d = 0; d < D; ++d) row[d] = static_cast<float>(c * anchor[d] + s * v[d]);
          break;
        }
        case Keys::staged: {
          // [0, 256): random R_i; [256, 400): B + noise; [400, 512): C + noise; [512, 768):
          // random; [768, S) but [850, 860): B + 1.25·R_{r0} (cosine ~0.6 with B rows, ~0.78
          // with R_{r0}); [850, 860): C + noise (S >= 900). Block 1 stops at column tile 13,
          // inside row tile 3 (which must recompute it), block 0 sweeps down to its own rows.
          const int r0 = (i * 37) % 256;
          for (int d = 0; d < D; ++d) {
            const float n = 0.3f * nd(rng);
            const float B = static_cast<float>(anchor[d]) * std::sqrt(float(D));
            const float C = static_cast<float>(common[d]) / 1.5f;
            if (i < 256 || (i >= 512 && i < 768))
              row[d] = nd(rng);
            else if (i < 400)
              row[d] = B + n;
            else if (i < 512 || (i >= 850 && i < 860))
              row[d] = C + n;
            else
              row[d] = B + 1.25f * base[r0 * D + d] + 0.1f * nd(rng);
          }
          break;
        }
        case Keys::duplicates:  // exact copies of an earlier row (cosine 1 up to rounding)
          if (i > 0 && i % 3 != 0) {
            const int src = std::uniform_int_distribution<int>(0, i - 1)(rng);
            for (int d = 0; d < D; ++d) row[d] = base[src * D + d];
          } else {
            for (int d = 0; d < D; ++d) row[d] = nd(rng);
          }
          break;
      }
      if (pad_every > 0 && i % pad_every == pad_every - 1)
        for (int d = 0; d < D; ++d) row[d] = 0.0f;
    }
  }
  normalize_rows(k, D);
  return k;
}

void check_search(const std::vector<float>& unit, int B, int H, int S, int D, float threshold,
                  bool faithful) {
  INFO("B=" << B << " H=" << H << " S=" << S << " D=" << D << " threshold=" << threshold
            << " faithful=" << faithful);
  const SearchResult ref = oracle_search(unit, B * H, S, D, threshold, faithful);
  const SearchResult got = gpu_search(unit, B, H, S, D, threshold, faithful);
  std::int64_t bad_match = 0, bad_spared = 0, matched = 0;
  for (std::size_t e = 0; e < ref.match.size(); ++e) {
    matched += ref.match[e] >= 0;
    if (got.match[e] != ref.match[e] && bad_match++ < 5)
      UNSCOPED_INFO("row " << e << ": r_i " << got.match[e] << " vs " << ref.match[e]);
    if (got.spared[e] != ref.spared[e] && bad_spared++ < 5)
      UNSCOPED_INFO("column " << e << ": spared " << got.spared[e] << " vs " << ref.spared[e]);
  }
  INFO(matched << " of " << ref.match.size() << " rows matched");
  CHECK(bad_match == 0);
  CHECK(bad_spared == 0);
}

// ---- rkv_score level: tensor-core search vs fp32 search --------------------------------------

template <class T>
std::vector<T> to_storage(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<T>(x[i]);
  return out;
}

struct ScoreOutputs {
  std::vector<float> score, importance, redundancy;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Keys [B, H, S, D] as given (raw: rkv_score normalises them), pads by `mask` [B, S] (empty: none).
template <class T>
void check_paths_agree(const std::vector<float>& keys, std::vector<std::uint8_t> mask, int B, int H,
                       int S, int D, float threshold, bool faithful) {
  INFO("dtype " << dtype_name(dtype_of<T>::value) << " B=" << B << " H=" << H << " S=" << S
                << " D=" << D << " threshold=" << threshold << " faithful=" << faithful
                << " tensor cores used: " << cuda::detail::tc_search_supported(D));
  const int G = 2, W = 8, Hq = H * G;
  std::mt19937 rng(99);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<std::size_t>(B) * Hq * W * D);
  for (auto& x : q) x = nd(rng);
  DeviceBuffer<T> d_keys(to_storage<T>(keys)), d_values(to_storage<T>(keys)), d_q(to_storage<T>(q));
  DeviceBuffer<std::uint8_t> d_mask(mask.empty() ? std::vector<std::uint8_t>(1) : mask);
  std::vector<std::int32_t> lengths(B, S);
  const KVCacheView kv =
      make_kv_cache_view(d_keys.get(), d_values.get(), dtype_of<T>::value, Device::cuda, B, H, S, D,
                         lengths.data(), mask.empty() ? nullptr : d_mask.get());
  const TensorView qv =
      TensorView::contiguous(d_q.get(), dtype_of<T>::value, Device::cuda, {B, Hq, W, D});
  auto run = [&](bool tensor_core) {
    RKVConfig cfg;
    cfg.budget = S / 2;
    cfg.window = W;
    cfg.threshold = threshold;
    cfg.redundancy = faithful ? RedundancyMode::faithful : RedundancyMode::sound;
    cfg.tensor_core_search = tensor_core;
    const std::size_t rows = static_cast<std::size_t>(B) * H, n = S - W;
    DeviceBuffer<float> score(rows * n), imp(rows * n), red(rows * S);
    for (auto* buf : {&score, &imp, &red})  // poison: NaN bytes, unwritten entries differ
      KVSIFT_CUDA_CHECK(cudaMemset(buf->get(), 0xff, buf->size() * sizeof(float)));
    DeviceBuffer<char> ws(cuda::rkv_workspace_bytes(kv, qv, cfg));
    cuda::rkv_score(kv, qv, cfg, {score.get(), imp.get(), red.get()}, ws.get(), ws.size(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    return ScoreOutputs{score.download(), imp.download(), red.download()};
  };
  const ScoreOutputs fp32 = run(false), tc = run(true);
  std::int64_t not_finite = 0;  // the NaN poison must have been overwritten
  for (float x : fp32.redundancy) not_finite += !std::isfinite(x);
  for (float x : tc.redundancy) not_finite += !std::isfinite(x);
  REQUIRE(not_finite == 0);
  CHECK(same_bits(tc.redundancy, fp32.redundancy));
  CHECK(same_bits(tc.score, fp32.score));
  CHECK(same_bits(tc.importance, fp32.importance));
}

std::vector<float> raw_keys(Keys kind, int BH, int S, int D, std::uint32_t seed) {
  std::vector<float> k = make_unit_keys(kind, BH, S, D, seed);
  for (std::size_t e = 0; e < k.size(); ++e)  // row norms 3 .. 7: the kernels normalise
    k[e] *= 3.0f + static_cast<float>((e / D) % 5);
  return k;
}

}  // namespace

TEST_CASE("tensor-core cosine margin and support", "[cuda][rkv][tc]") {
  // D = 128: 1.002·(2^-10 + 2^-20 + 2^-21 + 128·2^-22·(1 + 2^-11)²·1.01 + 128·2^-24·1.01)
  //          + 128·2^-23 = 0.0010338 (rounded; the 2^-21 covers the fp16 copy being rounded from
  //          x·(1/den), not x/den; 128·2^-23 the channels below fp16's normal range)
  CHECK(cuda::detail::tc_cosine_margin(128) == Approx(0.0010338).epsilon(1e-4));
  CHECK(cuda::detail::tc_cosine_margin(64) < cuda::detail::tc_cosine_margin(128));
  CHECK(cuda::detail::tc_cosine_margin(64) > 0.0009765625);  // never below fp16's 2^-10 term
  CHECK(cuda::detail::tc_search_supported(128));
  CHECK(cuda::detail::tc_search_supported(64));
  CHECK(cuda::detail::tc_search_supported(100));
  CHECK_FALSE(cuda::detail::tc_search_supported(30));
  CHECK_FALSE(cuda::detail::tc_search_supported(3));
  CHECK_FALSE(cuda::detail::tc_search_supported(256));
}

TEST_CASE("on a compute capability 9.0 device the search runs its wgmma code", "[cuda][rkv][tc]") {
  // The library builds key_redundancy_tc.cu for sm_90 (mma.sync) and sm_90a (wgmma); the cases
  // below test whichever the driver loads, so this one pins down that it is the wgmma code.
  cudaDeviceProp prop{};
  KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  INFO("compute capability " << prop.major << "." << prop.minor);
  if (prop.major == 9 && prop.minor == 0) {
    REQUIRE(cuda::detail::tc_search_uses_wgmma());
  } else {
    REQUIRE_FALSE(cuda::detail::tc_search_uses_wgmma());
  }
}

TEST_CASE("tensor-core last match equals the exact fp32 search", "[cuda][rkv][tc]") {
  SECTION("random keys: no row matches, every tile scanned") {
    check_search(make_unit_keys(Keys::random, 4, 600, 128, 1), 2, 2, 600, 128, 0.5f, true);
  }
  SECTION("random keys, low threshold: matches everywhere, some near it") {
    check_search(make_unit_keys(Keys::random, 2, 517, 128, 2), 1, 2, 517, 128, 0.2f, false);
  }
  SECTION("clustered keys: early exit") {
    check_search(make_unit_keys(Keys::clustered, 3, 1000, 128, 3), 3, 1, 1000, 128, 0.5f, true);
  }
  SECTION("near-threshold cosines (0.5 ± 3e-3), head_dim 128 and 64") {
    check_search(make_unit_keys(Keys::near_threshold, 2, 700, 128, 4), 2, 1, 700, 128, 0.5f, true);
    check_search(make_unit_keys(Keys::near_threshold, 2, 333, 64, 5), 1, 2, 333, 64, 0.5f, false);
  }
  SECTION("duplicate keys and zero pads, negative threshold (pads match everything)") {
    check_search(make_unit_keys(Keys::duplicates, 2, 400, 64, 6, 5), 2, 1, 400, 64, 0.5f, true);
    check_search(make_unit_keys(Keys::random, 2, 300, 64, 7, 4), 1, 2, 300, 64, -0.05f, true);
  }
  SECTION("staged keys: early-stopping and full-sweeping row tiles mixed (phase 2 coverage)") {
    // Verified with a host model of the kernel: an off-by-one in the coverage test or answering
    // a row from a covered tile below an uncovered one both change r_i here.
    check_search(make_unit_keys(Keys::staged, 2, 1000, 128, 22), 2, 1, 1000, 128, 0.5f, false);
    check_search(make_unit_keys(Keys::staged, 2, 1100, 128, 21), 1, 2, 1100, 128, 0.5f, true);
  }
  SECTION("threshold equal to an actual fp32 cosine C[i, r_i], and one ulp below it") {
    // At t = C[i, r_i] the pair no longer matches (strictly greater is required), so r_i moves;
    // one ulp below, it matches again. Both searches must see exactly that.
    const int S = 260, D = 128;
    const std::vector<float> u = make_unit_keys(Keys::near_threshold, 1, S, D, 8);
    const SearchResult at_half = oracle_search(u, 1, S, D, 0.5f, false);
    const int i = 12, r = at_half.match[i];
    REQUIRE(r >= 0);
    const float c = fp32_cosine(&u[i * D], &u[r * D], D);
    CHECK(oracle_search(u, 1, S, D, c, false).match[i] != r);
    CHECK(oracle_search(u, 1, S, D, std::nextafter(c, -1.0f), false).match[i] == r);
    check_search(u, 1, 1, S, D, c, false);
    check_search(u, 1, 1, S, D, std::nextafter(c, -1.0f), true);
  }
  SECTION("head_dim 100 (zero channels to 128 in the images) and short sequences") {
    check_search(make_unit_keys(Keys::near_threshold, 2, 300, 100, 9), 2, 1, 300, 100, 0.5f, true);
    check_search(make_unit_keys(Keys::duplicates, 1, 1, 64, 10), 1, 1, 1, 64, 0.5f, true);
    check_search(make_unit_keys(Keys::clustered, 1, 70, 64, 11), 1, 1, 70, 64, 0.5f, false);
  }
}

TEST_CASE("rkv_score with tensor_core_search equals the fp32 search bit for bit",
          "[cuda][rkv][tc]") {
  SECTION("bf16 storage, head_dim 128: random, clustered, near-threshold, duplicates") {
    for (Keys kind : {Keys::random, Keys::clustered, Keys::near_threshold, Keys::duplicates})
      check_paths_agree<bf16_t>(raw_keys(kind, 2 * 2, 300, 128, 20 + int(kind)), {}, 2, 2, 300, 128,
                                0.5f, true);
  }
  SECTION("bf16 storage, staged keys (mixed phase-1 coverage), S = 1000") {
    check_paths_agree<bf16_t>(raw_keys(Keys::staged, 2, 1000, 128, 22), {}, 1, 2, 1000, 128, 0.5f,
                              true);
  }
  SECTION("f16 and f32 storage, head_dim 64, sound and faithful") {
    check_paths_agree<f16_t>(raw_keys(Keys::near_threshold, 2, 290, 64, 30), {}, 1, 2, 290, 64,
                             0.5f, false);
    check_paths_agree<float>(raw_keys(Keys::near_threshold, 2, 290, 64, 31), {}, 2, 1, 290, 64,
                             0.5f, true);
    check_paths_agree<float>(raw_keys(Keys::clustered, 4, 600, 128, 32), {}, 2, 2, 600, 128, 0.5f,
                             false);
  }
  SECTION("left padding (valid mask), bf16, head_dim 128, positive and negative thresholds") {
    const int B = 3, H = 2, S = 270;
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(B) * S, 1);
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < 41 * b; ++i) mask[b * S + i] = 0;
    const std::vector<float> k = raw_keys(Keys::duplicates, B * H, S, 128, 40);
    check_paths_agree<bf16_t>(k, mask, B, H, S, 128, 0.5f, true);
    check_paths_agree<bf16_t>(k, mask, B, H, S, 128, -0.1f, false);
  }
  SECTION("head_dim 100 uses tensor cores; 30 and 3 fall back to the fp32 search") {
    check_paths_agree<bf16_t>(raw_keys(Keys::near_threshold, 2, 200, 100, 50), {}, 1, 2, 200, 100,
                              0.5f, true);
    check_paths_agree<f16_t>(raw_keys(Keys::near_threshold, 2, 200, 30, 51), {}, 2, 1, 200, 30,
                             0.5f, true);
    check_paths_agree<float>(raw_keys(Keys::random, 2, 150, 3, 52), {}, 1, 2, 150, 3, 0.5f, false);
  }
}
