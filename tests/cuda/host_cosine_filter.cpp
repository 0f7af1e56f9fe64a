// The re-check filter of the tensor-core search (cuda/cosine_filter.cuh) against the exact
// re-check it stands in for: the fp32 chain acc = fmaf(x_d / p, z_d / q, acc), d = 0 .. D−1, over
// keys with p = ||x|| + 1e-8 as the normalisation computes it. For key pairs of several kinds
// (random, sharing a head direction, near-parallel, mixed magnitudes, bf16-rounded like stored
// keys) and head_dims 3 .. 256:
//   - |f − c32| <= cosine_filter_margin(D), the bound the filter's decisions rest on;
//   - at thresholds on and around c32 (t = c32, one ulp either side, c32 ± m/2) it decides
//     nothing or decides right, and at c32 ± 3m it decides, and right;
//   - a zero margin would decide wrongly somewhere here (f and c32 do differ), so this test can
//     tell a filter without its margin from one with it.
// Host only: runs in CI.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "cosine_filter.cuh"

using namespace kvsift::cuda::detail;

namespace {

float round_bf16(float x) {  // round to nearest even at 8 significant bits
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

float norm_den(const std::vector<float>& x) {  // ||x|| + 1e-8, fp32 as the key pass sums it
  float s = 0.0f;
  for (float v : x) s = std::fma(v, v, s);
  return std::sqrt(s) + 1e-8f;
}

float exact_chain(const std::vector<float>& x, float p, const std::vector<float>& z, float q) {
  float acc = 0.0f;
  for (std::size_t d = 0; d < x.size(); ++d) acc = std::fma(x[d] / p, z[d] / q, acc);
  return acc;
}

float filter(const std::vector<float>& x, float p, const std::vector<float>& z, float q) {
  FilterDot dot;
  const int D = static_cast<int>(x.size());
  for (int d0 = 0; d0 < D; d0 += kFilterLanes) {
    float a[kFilterLanes], b[kFilterLanes];
    for (int e = 0; e < kFilterLanes; ++e) {
      a[e] = d0 + e < D ? x[d0 + e] : 0.0f;
      b[e] = d0 + e < D ? z[d0 + e] : 0.0f;
    }
    dot.add8(a, b);
  }
  return dot.cosine(1.0f / p, 1.0f / q);
}

enum class Pair { random, shared_direction, near_parallel, mixed_magnitudes };

// Two raw key rows of one kind, bf16-rounded when `bf16`.
void make_pair(Pair kind, int D, bool bf16, std::mt19937& rng, std::vector<float>& x,
               std::vector<float>& z) {
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-12, 12);
  x.assign(D, 0.0f);
  z.assign(D, 0.0f);
  const float scale = std::ldexp(1.0f, ex(rng));  // keys of any overall size
  std::vector<float> dir(D);
  for (auto& v : dir) v = nd(rng);
  for (int d = 0; d < D; ++d) {
    float a = nd(rng), b = nd(rng);
    switch (kind) {
      case Pair::random:
        break;
      case Pair::shared_direction:  // real keys: a common head direction plus noise
        a = 2.0f * dir[d] + a;
        b = 2.0f * dir[d] + b;
        break;
      case Pair::near_parallel:
        a = dir[d] + 0.01f * a;
        b = dir[d] + 0.01f * b;
        break;
      case Pair::mixed_magnitudes:  // a few huge channels over many tiny ones
        a *= d % 17 == 0 ? 300.0f : 0.01f;
        b *= d % 17 == 0 ? 300.0f : 0.01f;
        break;
    }
    x[d] = scale * a;
    z[d] = scale * b;
    if (bf16) {
      x[d] = round_bf16(x[d]);
      z[d] = round_bf16(z[d]);
    }
  }
}

}  // namespace

TEST_CASE("the filter margin at head_dim 128, by hand") {
  // (128 + 16 + 9) · 2^-24 · 1.002 · 1.01 + 2^-60
  REQUIRE(cosine_filter_margin(128) ==
          Approx(153.0 * 5.9604644775390625e-8 * 1.01202).epsilon(1e-9));
  REQUIRE(cosine_filter_margin(3) == Approx(13.0 * 5.9604644775390625e-8 * 1.01202).epsilon(1e-6));
  const CosineBand band = cosine_filter_band(0.5f, 128);
  REQUIRE(band.below < 0.5f - 9.2e-6f);
  REQUIRE(band.above > 0.5f + 9.2e-6f);
  REQUIRE(band.above - band.below < 2 * 9.3e-6f);
}

TEST_CASE("the filter stays within its margin of the exact re-check and decides only right") {
  std::mt19937 rng(2026);
  long long pairs = 0, differ = 0, zero_margin_wrong = 0, decided_far = 0;
  double worst = 0.0;  // max |f − c32| / m over all pairs
  std::vector<float> x, z;
  for (int D : {3, 8, 30, 64, 100, 128, 256}) {
    const double m = cosine_filter_margin(D);
    for (Pair kind :
         {Pair::random, Pair::shared_direction, Pair::near_parallel, Pair::mixed_magnitudes})
      for (bool bf16 : {false, true})
        for (int n = 0; n < 400; ++n) {
          make_pair(kind, D, bf16, rng, x, z);
          const float p = norm_den(x), q = norm_den(z);
          REQUIRE(cosine_filter_applies(p, q));
          const float c32 = exact_chain(x, p, z, q);
          const float f = filter(x, p, z, q);
          ++pairs;
          INFO("D " << D << " kind " << static_cast<int>(kind) << " c32 " << c32 << " f " << f);
          REQUIRE(std::fabs(static_cast<double>(f) - c32) <= m);
          worst = std::max(worst, std::fabs(static_cast<double>(f) - c32) / m);
          if (f != c32) ++differ;
          if (f > c32) ++zero_margin_wrong;  // t = c32, no margin: "f > t" would claim a match
          const float half = static_cast<float>(m / 2), three = static_cast<float>(3 * m);
          for (float t : {c32, std::nextafter(c32, -2.0f), std::nextafter(c32, 2.0f), c32 - half,
                          c32 + half, c32 - three, c32 + three}) {
            const int decided = cosine_filter_decides(f, cosine_filter_band(t, D));
            const int truth = c32 > t ? 1 : -1;
            REQUIRE((decided == 0 || decided == truth));
            if (t == c32 - three || t == c32 + three) {
              REQUIRE(decided == truth);  // the margin is narrow enough to be of use
              ++decided_far;
            }
          }
        }
  }
  INFO(pairs << " pairs, " << differ << " with f != c32, worst |f − c32| / m = " << worst);
  REQUIRE(differ > pairs / 10);
  REQUIRE(zero_margin_wrong > 0);
  REQUIRE(decided_far == 2 * pairs);
}

TEST_CASE("the filter decides nothing outside its hypotheses") {
  const CosineBand band = cosine_filter_band(0.5f, 128);
  REQUIRE_FALSE(cosine_filter_applies(0.0f, 1.0f));  // pad rows
  REQUIRE_FALSE(cosine_filter_applies(1.0f, 0x1p-41f));
  REQUIRE_FALSE(cosine_filter_applies(0x1p41f, 1.0f));
  REQUIRE_FALSE(cosine_filter_applies(1.0f, INFINITY));
  REQUIRE_FALSE(cosine_filter_applies(1.0f, NAN));
  REQUIRE(cosine_filter_decides(NAN, band) == 0);
  REQUIRE(cosine_filter_decides(INFINITY, band) == 0);
  REQUIRE(cosine_filter_decides(-INFINITY, band) == 0);
  REQUIRE(cosine_filter_decides(0.9f, band) == 1);
  REQUIRE(cosine_filter_decides(0.1f, band) == -1);
  REQUIRE(cosine_filter_decides(0.5f, band) == 0);
}
