// Our E2M1, E4M3 and E8M0 conversions against the CUDA toolkit's host conversions (cuda_fp4.h,
// cuda_fp8.h), bit for bit. Compiled by the host compiler; needs the toolkit's headers, no GPU.
// Inputs: every bf16-representable float (65536), every f16 value (65536), all E2M1/E4M3 values,
// midpoints between neighbours and their float neighbours, and 2M random float bit patterns.
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/quant/e2m1.hpp"
#include "kvsift/quant/e4m3.hpp"
#include "kvsift/quant/e8m0.hpp"

using namespace kvsift;

namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The inputs of interest, built once.
const std::vector<float>& inputs() {
  static const std::vector<float> all = [] {
    std::vector<float> v;
    for (std::uint32_t b = 0; b < 0x10000u; ++b) v.push_back(from_bits(b << 16));  // every bf16
    for (std::uint32_t h = 0; h < 0x10000u; ++h) {
      v.push_back(f16_bits_to_float(static_cast<std::uint16_t>(h)));  // every f16
    }
    // Every E2M1 / E4M3 value and each midpoint between neighbours, with its float neighbours.
    std::vector<float> grid;
    for (int c = 0; c < 8; ++c) grid.push_back(e2m1_magnitude(static_cast<std::uint8_t>(c)));
    for (int c = 0; c < 0x7f; ++c) grid.push_back(e4m3_to_float(static_cast<std::uint8_t>(c)));
    grid.push_back(480.0f);  // the would-be next E4M3 value: 464 is the overflow midpoint
    const std::size_t n = grid.size();
    for (std::size_t i = 0; i + 1 < n; ++i) grid.push_back(0.5f * (grid[i] + grid[i + 1]));
    for (float g : grid) {
      for (float s : {1.0f, -1.0f}) {
        v.push_back(s * g);
        v.push_back(std::nextafter(s * g, 0.0f));
        v.push_back(std::nextafter(s * g, s * INFINITY));
      }
    }
    std::mt19937 rng(20260101);
    std::uniform_int_distribution<std::uint32_t> bits;
    for (int i = 0; i < 2000000; ++i) v.push_back(from_bits(bits(rng)));
    // Random floats of the magnitudes that matter most (|x| < 1024).
    std::uniform_real_distribution<float> mag(-1024.0f, 1024.0f);
    for (int i = 0; i < 200000; ++i) v.push_back(mag(rng));
    return v;
  }();
  return all;
}

float half_raw_to_float(__half_raw h) { return f16_bits_to_float(h.x); }

}  // namespace

TEST_CASE("e2m1 float->code matches __nv_cvt_float_to_fp4 bit for bit", "[oracle][e2m1]") {
  std::size_t mismatches = 0;
  for (float x : inputs()) {
    const unsigned cuda = __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
    const unsigned ours = e2m1_from_float(x);
    if (cuda != ours) {
      if (++mismatches <= 5) {
        std::uint32_t u;
        std::memcpy(&u, &x, 4);
        UNSCOPED_INFO("x = " << x << " bits 0x" << std::hex << u << " cuda 0x" << cuda << " ours 0x"
                             << ours);
      }
    }
  }
  REQUIRE(inputs().size() > 2300000);  // the input set really was built
  REQUIRE(mismatches == 0);
}

TEST_CASE("e2m1 code->float matches __nv_cvt_fp4_to_halfraw for all 16 codes", "[oracle][e2m1]") {
  for (unsigned c = 0; c < 16; ++c) {
    const float cuda =
        half_raw_to_float(__nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(c), __NV_E2M1));
    const float ours = e2m1_to_float(static_cast<std::uint8_t>(c));
    INFO("code " << c);
    REQUIRE(std::signbit(cuda) == std::signbit(ours));
    REQUIRE(cuda == ours);
  }
}

TEST_CASE("e2m1 pairs pack like __nv_cvt_float2_to_fp4x2 (element 0 in the low nibble)",
          "[oracle][e2m1]") {
  const float v[] = {0.5f, -6.0f, 1.5f, 3.0f, -0.0f, 2.0f, 4.0f, -1.0f};
  for (float a : v) {
    for (float b : v) {
      const unsigned cuda = __nv_cvt_float2_to_fp4x2(float2{a, b}, __NV_E2M1, cudaRoundNearest);
      REQUIRE(cuda == e2m1_pack2(e2m1_from_float(a), e2m1_from_float(b)));
    }
  }
}

TEST_CASE("e4m3 float->code matches __nv_cvt_float_to_fp8 (SATFINITE) bit for bit",
          "[oracle][e4m3]") {
  std::size_t mismatches = 0;
  for (float x : inputs()) {
    const unsigned cuda = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    const unsigned ours = e4m3_from_float(x);
    if (cuda != ours && ++mismatches <= 5) {
      std::uint32_t u;
      std::memcpy(&u, &x, 4);
      UNSCOPED_INFO("x = " << x << " bits 0x" << std::hex << u << " cuda 0x" << cuda << " ours 0x"
                           << ours);
    }
  }
  REQUIRE(mismatches == 0);
}

TEST_CASE("e4m3 code->float matches __nv_cvt_fp8_to_halfraw for all 256 codes", "[oracle][e4m3]") {
  for (unsigned c = 0; c < 256; ++c) {
    const float cuda =
        half_raw_to_float(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3));
    const float ours = e4m3_to_float(static_cast<std::uint8_t>(c));
    INFO("code 0x" << std::hex << c);
    if (std::isnan(cuda)) {
      REQUIRE(std::isnan(ours));
      REQUIRE(e4m3_is_nan(static_cast<std::uint8_t>(c)));
    } else {
      REQUIRE(std::signbit(cuda) == std::signbit(ours));
      REQUIRE(cuda == ours);
      REQUIRE(!e4m3_is_nan(static_cast<std::uint8_t>(c)));
    }
  }
}

TEST_CASE("e8m0 round-up matches __nv_cvt_float_to_e8m0 (SATFINITE, RoundPosInf)",
          "[oracle][e8m0]") {
  std::size_t mismatches = 0;
  std::vector<float> extra;
  for (int e = -149; e <= 127; ++e) {  // powers of two and their neighbours, subnormals included
    const float p = std::ldexp(1.0f, e);
    extra.insert(extra.end(), {p, std::nextafter(p, 0.0f), std::nextafter(p, INFINITY)});
  }
  extra.insert(extra.end(), {0.0f, -0.0f, INFINITY, -INFINITY, NAN});
  for (const std::vector<float>* set :
       {&inputs(), static_cast<const std::vector<float>*>(&extra)}) {
    for (float x : *set) {
      const unsigned cuda = __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf);
      const unsigned ours = e8m0_ceil_from_float(x);
      if (cuda != ours && ++mismatches <= 5) {
        UNSCOPED_INFO("x = " << x << " cuda " << cuda << " ours " << ours);
      }
    }
  }
  REQUIRE(mismatches == 0);
}

TEST_CASE("e8m0 code->float matches __nv_cvt_e8m0_to_bf16raw", "[oracle][e8m0]") {
  for (unsigned c = 0; c < 256; ++c) {
    const __nv_bfloat16_raw raw = __nv_cvt_e8m0_to_bf16raw(static_cast<__nv_fp8_storage_t>(c));
    const float cuda = bf16_bits_to_float(raw.x);
    const float ours = e8m0_to_float(static_cast<std::uint8_t>(c));
    INFO("code " << c);
    if (std::isnan(cuda)) {
      REQUIRE(std::isnan(ours));
    } else {
      REQUIRE(cuda == ours);
    }
  }
}
