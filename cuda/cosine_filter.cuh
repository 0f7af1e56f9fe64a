// A cheap fp32 cosine of two key rows with a proven bound on its distance to the exact re-check's
// value, so that the tensor-core search (cuda/key_redundancy_tc.cu) runs the exact re-check only
// for the pairs this cosine cannot decide. The exact re-check is a sequential fmaf chain over the
// D channels of two rows divided by their norms (two quotients and one dependent FMA a channel);
// this one is D FMAs over the raw channels into 8 independent accumulators and two products by
// the rows' reciprocal norms: about a sixth of the instructions and an eighth of the chain.
// Host and device (the host test tests/cuda/host_cosine_filter.cpp checks the bound without a
// GPU).
//
// The bound. Let x, z be a pair's raw channels (fp32 conversions of the stored keys), p, q their
// norms as the search divides by them (p >= ||x||, q >= ||z|| up to the norms' own rounding),
// u = x/p and v = z/q in real arithmetic, c = u·v, A = Σ_d |u_d v_d| <= ||u||·||v|| <= N² =
// 1.002, and ε = 2^-24 (fp32 unit roundoff). n = ceil(D / 8) channels go to each accumulator.
//   The filter f = RN(RN(s̃·RN(1/p))·RN(1/q)), s̃ the 8 accumulators (n FMAs each, from 0) added
//   as a tree of depth 3. Recursive summation (Higham, Accuracy and Stability of Numerical
//   Algorithms, §3.1 and §4.2): |s̃ − x·z| <= γ(n + 3)·Σ|x_d z_d|, γ(k) = kε / (1 − kε); the four
//   roundings of the products and reciprocals add γ(4): |f − c| <= γ(n + 7)·A.
//   The exact re-check c32 (fmaf chain over RN(x_d/p)·RN(z_d/q), d = 0 .. D−1, from 0): each
//   quotient within ε relative, each chain step one rounding: |c32 − c| <= γ(D + 2)·A·(1 + ε)².
// So |f − c32| <= m_f = (D + n + 9)·ε·N²·1.01 (1.01 absorbing the γ denominators and the (1 + ε)
// factors) plus 2^-60 for underflow: every fp32 operation here that underflows loses at most
// 2^-150 absolute, times 1/(p·q) <= 2^80 (the norms are kept in [2^-40, 2^40]; the fp32 chain's
// own underflow is smaller still). D = 128: m_f ≈ 9.2e-6, against the fp16 tensor-core cosine's
// 1.03e-3. Then f > t + m_f proves c32 > t, and f <= t − m_f proves it false; only pairs within
// m_f of t (on structured keys ~1 % of those within 1.03e-3) need the exact chain.
//
// Outside its hypotheses the filter decides nothing and the caller runs the exact chain: a norm
// outside [2^-40, 2^40] (zero rows, overflow of s̃, the underflow term above) or a non-finite f
// (NaN or infinite channels; NaN fails both comparisons by itself).
#pragma once

#include <cmath>

#include "kvsift/core/config.hpp"

namespace kvsift::cuda::detail {

inline constexpr int kFilterLanes = 8;  // independent accumulators: channel d goes to d % 8

// m_f above for head_dim channels.
inline double cosine_filter_margin(int head_dim) {
  const int per_lane = (head_dim + kFilterLanes - 1) / kFilterLanes;
  const double terms = static_cast<double>(head_dim) + per_lane + 9;
  return terms * std::ldexp(1.0, -24) * 1.002 * 1.01 + std::ldexp(1.0, -60);
}

// The values a cosine within `margin` of the exact one must clear: t − margin and t + margin
// rounded outwards to float, so that "c <= below" and "c > above" stay conclusive. The
// tensor-core band (margin m) and the filter's (m_f) both come from here.
struct CosineBand {
  float below, above;
};

inline CosineBand outward_band(float threshold, double margin) {
  return {std::nextafter(static_cast<float>(threshold - margin), -INFINITY),
          std::nextafter(static_cast<float>(threshold + margin), INFINITY)};
}

inline CosineBand cosine_filter_band(float threshold, int head_dim) {
  return outward_band(threshold, cosine_filter_margin(head_dim));
}

// Whether the bound above holds for rows of norms p and q.
KVSIFT_HOST_DEVICE bool cosine_filter_applies(float p, float q) {
  return p >= 0x1p-40f && p <= 0x1p40f && q >= 0x1p-40f && q <= 0x1p40f;
}

// The filter's sum s̃: channels 8c .. 8c + 7 at a time (channel d into accumulator d % 8; a
// last partial group zero-padded, which adds +0), then cosine().
struct FilterDot {
  float acc[kFilterLanes] = {};

  KVSIFT_HOST_DEVICE void add8(const float (&x)[kFilterLanes], const float (&z)[kFilterLanes]) {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int e = 0; e < kFilterLanes; ++e) acc[e] = fmaf(x[e], z[e], acc[e]);
  }
  // f from the reciprocal norms y = RN(1/p), w = RN(1/q).
  KVSIFT_HOST_DEVICE float cosine(float y, float w) const {
    const float s =
        ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
#ifdef __CUDA_ARCH__
    return __fmul_rn(__fmul_rn(s, y), w);  // two roundings, as counted above
#else
    return (s * y) * w;
#endif
  }
};

// +1: c32 > t for certain; −1: certainly not; 0: undecided (run the exact chain).
KVSIFT_HOST_DEVICE int cosine_filter_decides(float f, const CosineBand& band) {
  if (!(f - f == 0.0f)) return 0;  // NaN or infinite
  return f > band.above ? 1 : (f <= band.below ? -1 : 0);
}

}  // namespace kvsift::cuda::detail
