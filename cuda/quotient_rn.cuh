// x / den rounded to nearest, bit for bit what the division gives, from y = 1 / den (itself
// rounded to nearest) with two FMAs instead of a division. Used where many quotients share one
// denominator: the exact fp32 re-checks of the tensor-core redundancy search divide every
// channel of two key rows by their norms (cuda/key_redundancy_tc.cu). Host and device (the host
// test tests/cuda/host_quotient_rn.cpp checks it against the division without a GPU).
//
// Why it is exact (Markstein's theorem: P. Markstein, IBM J. Res. Dev. 34(1), 1990; J.-M. Muller
// et al., Handbook of Floating-Point Arithmetic, division with an FMA): if y = RN(1/den) and q is
// within one ulp of x/den, the remainder r = x − q·den is a float (the FMA computes it exactly) and
// RN(q + r·y) = RN(x/den). q = RN(x·y) is within one ulp. The theorem assumes that nothing
// underflows or overflows, so zero, tiny and huge values, NaN and infinities take the division.
#pragma once

#include <cmath>

#include "kvsift/core/config.hpp"

namespace kvsift::cuda::detail {

KVSIFT_HOST_DEVICE float quotient_rn(float x, float den, float y) {
#ifdef __CUDA_ARCH__
  const float q = __fmul_rn(x, y);  // never contracted into the FMA below
#else
  const float q = x * y;
#endif
  const float ax = fabsf(x), aq = fabsf(q);
  if (!(ax >= 0x1p-80f && aq >= 0x1p-80f && aq <= 0x1p80f)) return x / den;
  const float r = fmaf(-q, den, x);
  return fmaf(r, y, q);
}

}  // namespace kvsift::cuda::detail
