// KIVI's codec on the GPU (backend/cuda/asym_quant.hpp, docs/algorithms.md §5.1) against the
// host codec: packed int32 words bit for bit, scales and minima as numbers, dequantized values bit
// for bit (f32, and f16/bf16 as the one rounding of the f32 value), for keys (per channel over G
// tokens) and values (per token over G channels), 2/4/8 bits, f32/f16/bf16 inputs, shapes with a
// partial last group and a partial last word, constant groups, signed zeros, scales that round to
// zero in fp16 and ranges that overflow it; then against KiviStream's own prefill state; error
// paths.
#include <cstdint>
#include <string>
#include <vector>

#include "asym_quant_oracle.hpp"
#include "catch.hpp"
#include "kvsift/backend/cuda/asym_quant.hpp"
#include "kvsift/policy/quantizers/kivi.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

struct Shape {
  std::int64_t slabs, tokens, channels;
  int group;
};

// Equal-size groups, partial last token group (80 = 2·32 + 16), partial group AND partial word
// (37 tokens with G = 16), one token with a partial channel group (40 = 32 + 8), G = 8.
const Shape kShapes[] = {{3, 64, 128, 32}, {2, 80, 128, 32}, {2, 37, 48, 16},
                         {1, 1, 40, 32},   {4, 130, 64, 32}, {2, 21, 24, 8}};

template <class T>
void check_layout(const cuda::DeviceAsymPacked& q, std::uint32_t seed) {
  const std::vector<float> x = test::make_values<T>(q.slabs, q.tokens, q.channels, seed);
  const test::HostPacked want = test::host_quantize(q, x);
  const test::HostPacked got = test::gpu_quantize<T>(q, x);
  CHECK(test::first_difference("words", got.words, want.words) == "");
  CHECK(test::first_value_difference("scales", got.scales, want.scales) == "");
  CHECK(test::first_value_difference("minima", got.zeros, want.zeros) == "");

  const std::vector<float> dec = test::host_dequantize(q, want, cuda::AsymDequantMode::f32);
  const auto mode = cuda::AsymDequantMode::f32;
  CHECK(test::first_difference("f32 dequant", test::gpu_dequantize<float>(q, want, mode), dec) ==
        "");
  CHECK(test::first_difference("f16 dequant", test::gpu_dequantize<f16_t>(q, want, mode),
                               test::narrowed<f16_t>(dec)) == "");
  CHECK(test::first_difference("bf16 dequant", test::gpu_dequantize<bf16_t>(q, want, mode),
                               test::narrowed<bf16_t>(dec)) == "");
}

template <class T>
void check_all_shapes() {
  std::uint32_t seed = 11;
  for (const Shape& s : kShapes)
    for (int bits : {2, 4, 8}) {
      if (s.group % (32 / bits) != 0) continue;  // a group must own whole int32 words
      for (bool keys : {true, false}) {
        INFO("input " << dtype_name(dtype_of<T>::value) << ", " << (keys ? "keys" : "values")
                      << ", bits " << bits << ", shape [" << s.slabs << ", " << s.tokens << ", "
                      << s.channels << "], G " << s.group);
        const cuda::DeviceAsymPacked q =
            keys ? cuda::kivi_keys_layout(bits, s.group, s.slabs, s.tokens, s.channels)
                 : cuda::kivi_values_layout(bits, s.group, s.slabs, s.tokens, s.channels);
        check_layout<T>(q, ++seed);
      }
    }
}

// Codes of a packed unit-major tensor, unpacked: [slabs, units, extent].
std::vector<std::uint16_t> unpack_all(const cuda::DeviceAsymPacked& q,
                                      const std::vector<std::uint32_t>& words) {
  std::vector<std::uint16_t> out;
  const std::int64_t wpu = q.words_per_unit();
  for (std::int64_t u = 0; u < q.slabs * q.units_per_slab(); ++u) {
    const std::vector<std::uint16_t> c =
        unpack_codes(words.data() + u * wpu, q.unit_extent(), q.spec.bits, 32, q.order);
    out.insert(out.end(), c.begin(), c.end());
  }
  return out;
}

}  // namespace

TEST_CASE("cuda KIVI codec equals the host codec (f32 input)", "[cuda][kivi]") {
  check_all_shapes<float>();
}

TEST_CASE("cuda KIVI codec equals the host codec (f16 input)", "[cuda][kivi]") {
  check_all_shapes<f16_t>();
}

TEST_CASE("cuda KIVI codec equals the host codec (bf16 input)", "[cuda][kivi]") {
  check_all_shapes<bf16_t>();
}

TEST_CASE("cuda KIVI codec reproduces KiviStream's prefill quantization", "[cuda][kivi]") {
  // R = 64, G = 32, T = 200: the stream quantizes the first 192 keys (T − T mod R) per channel
  // and the first 136 values (T − R) per token.
  for (int bits : {2, 4}) {
    KiviConfig cfg;
    cfg.k_bits = bits;
    cfg.v_bits = bits;
    cfg.group_size = 32;
    cfg.residual_length = 64;
    const int B = 2, H = 3, D = 64;
    const std::int64_t T = 200, kq = 192, vq = 136;
    const std::vector<float> keys = test::make_values<f16_t>(B * H, T, D, 100 + bits);
    const std::vector<float> values = test::make_values<f16_t>(B * H, T, D, 200 + bits);
    KiviStream stream(cfg, B, H, D);
    stream.prefill(keys.data(), values.data(), T);

    auto head_prefix = [&](const std::vector<float>& x, std::int64_t n) {  // [B·H, n, D]
      std::vector<float> out;
      for (int s = 0; s < B * H; ++s)
        out.insert(out.end(), x.begin() + s * T * D, x.begin() + (s * T + n) * D);
      return out;
    };
    const cuda::DeviceAsymPacked qk = cuda::kivi_keys_layout(bits, 32, B * H, kq, D);
    const cuda::DeviceAsymPacked qv = cuda::kivi_values_layout(bits, 32, B * H, vq, D);
    const test::HostPacked gk = test::gpu_quantize<f16_t>(qk, head_prefix(keys, kq));
    const test::HostPacked gv = test::gpu_quantize<f16_t>(qv, head_prefix(values, vq));
    const std::vector<std::uint16_t> kcodes = unpack_all(qk, gk.words);  // [slab, d, t]
    const std::vector<std::uint16_t> vcodes = unpack_all(qv, gv.words);  // [slab, t, d]

    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h) {
        INFO("bits " << bits << ", sequence " << b << ", head " << h);
        const KiviHeadState& st = stream.head(b, h);
        REQUIRE(static_cast<std::int64_t>(st.kq_codes.size()) == kq * D);
        REQUIRE(static_cast<std::int64_t>(st.vq_codes.size()) == vq * D);
        const std::int64_t s = b * H + h;
        std::vector<std::uint16_t> want_k, got_k, want_v, got_v;
        std::vector<float> want_ks, got_ks, want_km, got_km, want_vs, got_vs, want_vm, got_vm;
        for (std::int64_t t = 0; t < kq; ++t)
          for (int d = 0; d < D; ++d) {
            want_k.push_back(st.kq_codes[static_cast<std::size_t>(t * D + d)]);
            got_k.push_back(kcodes[static_cast<std::size_t>((s * D + d) * kq + t)]);
          }
        for (std::int64_t g = 0; g < kq / 32; ++g)
          for (int d = 0; d < D; ++d) {
            const GroupParams p = st.kq_params[static_cast<std::size_t>(g * D + d)];
            want_ks.push_back(p.scale);
            want_km.push_back(p.zero);
            const std::size_t at = static_cast<std::size_t>((s * D + d) * (kq / 32) + g);
            got_ks.push_back(gk.scales[at]);
            got_km.push_back(gk.zeros[at]);
          }
        for (std::int64_t i = 0; i < vq * D; ++i) {
          want_v.push_back(st.vq_codes[static_cast<std::size_t>(i)]);
          got_v.push_back(vcodes[static_cast<std::size_t>(s * vq * D + i)]);
        }
        for (std::int64_t i = 0; i < vq * (D / 32); ++i) {
          want_vs.push_back(st.vq_params[static_cast<std::size_t>(i)].scale);
          want_vm.push_back(st.vq_params[static_cast<std::size_t>(i)].zero);
          got_vs.push_back(gv.scales[static_cast<std::size_t>(s * vq * (D / 32) + i)]);
          got_vm.push_back(gv.zeros[static_cast<std::size_t>(s * vq * (D / 32) + i)]);
        }
        CHECK(test::first_difference("key codes", got_k, want_k) == "");
        CHECK(test::first_value_difference("key scales", got_ks, want_ks) == "");
        CHECK(test::first_value_difference("key minima", got_km, want_km) == "");
        CHECK(test::first_difference("value codes", got_v, want_v) == "");
        CHECK(test::first_value_difference("value scales", got_vs, want_vs) == "");
        CHECK(test::first_value_difference("value minima", got_vm, want_vm) == "");
      }
  }
}

TEST_CASE("cuda KIVI codec: a constant group gets code 0 and decodes to its value",
          "[cuda][kivi]") {
  // Hand-worked: one slab, 32 tokens, 16 channels, keys G = 32 (one group per channel). Channel c
  // holds the constant c − 4.5 (s = 0: codes 0, x̂ = m exactly); all 2-bit words are 0.
  const cuda::DeviceAsymPacked q = cuda::kivi_keys_layout(2, 32, 1, 32, 16);
  std::vector<float> x(32 * 16);
  for (int t = 0; t < 32; ++t)
    for (int c = 0; c < 16; ++c)
      x[static_cast<std::size_t>(t * 16 + c)] = static_cast<float>(c) - 4.5f;
  const test::HostPacked got = test::gpu_quantize<float>(q, x);
  REQUIRE(got.words.size() == 16 * 2);
  for (std::uint32_t w : got.words) CHECK(w == 0u);
  for (int c = 0; c < 16; ++c) {
    CHECK(got.scales[static_cast<std::size_t>(c)] == 0.0f);
    CHECK(got.zeros[static_cast<std::size_t>(c)] == static_cast<float>(c) - 4.5f);
  }
  const std::vector<float> dec = test::gpu_dequantize<float>(q, got, cuda::AsymDequantMode::f32);
  CHECK(test::first_difference("decoded", dec, x) == "");
}

TEST_CASE("cuda KIVI codec: error paths name the argument", "[cuda][kivi]") {
  using Catch::Matchers::Contains;
  DeviceBuffer<float> x(64 * 32), sc(64), ze(64);
  DeviceBuffer<std::uint32_t> w(64);
  cuda::DeviceAsymPacked q = cuda::kivi_keys_layout(2, 32, 1, 64, 32);
  q.words = w.get();
  q.scales = sc.get();
  q.zeros = ze.get();
  std::vector<float> host(64 * 32);
  REQUIRE_THROWS_WITH(
      cuda::asym_quantize(TensorView::contiguous(host.data(), DType::f32, Device::cpu, {1, 64, 32}),
                          q, nullptr),
      Contains("host memory"));
  REQUIRE_THROWS_WITH(
      cuda::asym_quantize(TensorView::contiguous(x.get(), DType::f32, Device::cuda, {1, 32, 64}), q,
                          nullptr),
      Contains("expected [1, 64, 32]"));
  cuda::DeviceAsymPacked bad = q;
  bad.group = 8;  // 2-bit codes: 16 per int32 word
  REQUIRE_THROWS_WITH(
      cuda::asym_quantize(TensorView::contiguous(x.get(), DType::f32, Device::cuda, {1, 64, 32}),
                          bad, nullptr),
      Contains("group (8)"));
  bad = q;
  bad.zeros = nullptr;
  REQUIRE_THROWS_WITH(
      cuda::asym_dequantize(bad, cuda::AsymDequantMode::f32,
                            TensorView::contiguous(x.get(), DType::f32, Device::cuda, {1, 64, 32}),
                            nullptr),
      Contains("non-null"));
  REQUIRE_THROWS_WITH(
      cuda::asym_dequantize(q, cuda::AsymDequantMode::pmkvq_bf16,
                            TensorView::contiguous(x.get(), DType::f32, Device::cuda, {1, 64, 32}),
                            nullptr),
      Contains("subtract_zero"));
  REQUIRE_THROWS_WITH(cuda::kivi_values_layout(3, 32, 1, 1, 32), Contains("got 3"));
}
