// PM-KVQ's codec on the GPU (backend/cuda/asym_quant.hpp, docs/algorithms.md §5.2) against the
// host codec (quant/pmkvq_codec.hpp): int16 MSB-first words bit for bit, scales and zero points as
// numbers, both dequantizations bit for bit, at 16/8/4/2 bits in bf16 and fp32 arithmetic, with a
// partial last channel group; the exact right shift (ERS) exhaustively over every code of every
// width pair with its scale update; the whole real-backend flush (Q16 then ERS 16 → n) against
// PmkvqRealStream and the fake backend's Q16 against PmkvqFakeStream; error paths.
#include <cstdint>
#include <string>
#include <vector>

#include "asym_quant_oracle.hpp"
#include "catch.hpp"
#include "kvsift/backend/cuda/asym_quant.hpp"
#include "kvsift/policy/quantizers/pmkvq_stream.hpp"
#include "kvsift/quant/pmkvq_codec.hpp"

using namespace kvsift;
using test::DeviceBuffer;

namespace {

template <class T>
void check_layout(const cuda::DeviceAsymPacked& q, std::uint32_t seed) {
  const std::vector<float> x = test::make_values<T>(q.slabs, q.tokens, q.channels, seed);
  const test::HostPacked want = test::host_quantize(q, x);
  const test::HostPacked got = test::gpu_quantize<T>(q, x);
  CHECK(test::first_difference("words", got.words, want.words) == "");
  CHECK(test::first_value_difference("scales", got.scales, want.scales) == "");
  CHECK(test::first_value_difference("zero points", got.zeros, want.zeros) == "");
  for (auto mode : {cuda::AsymDequantMode::f32, cuda::AsymDequantMode::pmkvq_bf16}) {
    INFO("dequantize mode " << (mode == cuda::AsymDequantMode::f32 ? "f32" : "pmkvq_bf16"));
    const std::vector<float> dec = test::host_dequantize(q, want, mode);
    CHECK(test::first_difference("f32 dequant", test::gpu_dequantize<float>(q, want, mode), dec) ==
          "");
    CHECK(test::first_difference("bf16 dequant", test::gpu_dequantize<bf16_t>(q, want, mode),
                                 test::narrowed<bf16_t>(dec)) == "");
  }
}

// Packed words as uint16 (the host packer returns them widened).
std::vector<std::uint16_t> narrow_words(const std::vector<std::uint32_t>& w) {
  return std::vector<std::uint16_t>(w.begin(), w.end());
}

}  // namespace

TEST_CASE("cuda PM-KVQ codec equals the host codec", "[cuda][pmkvq]") {
  std::uint32_t seed = 7;
  for (int n : {16, 8, 4, 2})
    for (bool bf16 : {true, false}) {
      INFO("n_bits " << n << ", arithmetic " << (bf16 ? "bf16" : "f32"));
      // [slabs, tokens, head_dim]: G = 128 over D = 256 (two groups a token), G = 32 over D = 96,
      // and D = 136 with G = 128 (a partial last group of 8 channels).
      check_layout<bf16_t>(cuda::pmkvq_layout(n, bf16, 128, 3, 17, 256), ++seed);
      check_layout<float>(cuda::pmkvq_layout(n, bf16, 32, 2, 9, 96), ++seed);
      check_layout<bf16_t>(cuda::pmkvq_layout(n, bf16, 128, 1, 5, 136), ++seed);
    }
}

TEST_CASE("cuda PM-KVQ layout is pmkvq::quantize_group + pack_msb_first per group",
          "[cuda][pmkvq]") {
  // Ties the generic oracle to the PM-KVQ functions themselves: token t, group g of a
  // [1, 3, 256] bf16 tensor at 4 bits.
  const cuda::DeviceAsymPacked q = cuda::pmkvq_layout(4, true, 128, 1, 3, 256);
  const std::vector<float> x = test::make_values<bf16_t>(1, 3, 256, 99);
  const test::HostPacked got = test::gpu_quantize<bf16_t>(q, x);
  std::vector<std::uint32_t> words;
  std::vector<float> scales, zeros;
  for (int t = 0; t < 3; ++t)
    for (int g = 0; g < 2; ++g) {
      std::vector<std::uint16_t> codes(128);
      const GroupParams p = pmkvq::quantize_group(x.data() + t * 256 + g * 128, 128, 4,
                                                  pmkvq::Arith::bf16, codes.data());
      scales.push_back(p.scale);
      zeros.push_back(p.zero);
      for (std::uint16_t w : pmkvq::pack_msb_first(codes.data(), 128, 4)) words.push_back(w);
    }
  CHECK(test::first_difference("words", got.words, words) == "");
  CHECK(test::first_value_difference("scales", got.scales, scales) == "");
  CHECK(test::first_value_difference("zero points", got.zeros, zeros) == "");
}

TEST_CASE("cuda PM-KVQ exact right shift: every code of every width pair", "[cuda][pmkvq]") {
  for (int from : {16, 8, 4})
    for (int to = from / 2; to >= 2; to /= 2) {
      INFO("from " << from << " to " << to << " bits");
      const std::int64_t count = std::int64_t{1} << from;  // every from-bit code once
      std::vector<std::uint16_t> codes(static_cast<std::size_t>(count)), want(codes.size());
      for (std::int64_t i = 0; i < count; ++i) {
        codes[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(i);
        std::uint16_t c = static_cast<std::uint16_t>(i);
        for (int w = from / 2; w >= to; w /= 2) c = pmkvq::ers_code(c, w);
        want[static_cast<std::size_t>(i)] = c;
      }
      // bf16 scales: small, ordinary, the clamp bounds, one that rounds up after the product.
      std::vector<float> scales = {1e-5f, 0.015625f, 3.0f, 0.0999755859375f, 1e5f, 7.5f};
      for (float& s : scales) s = pmkvq::round_bf16(s);
      std::vector<float> want_scales = scales;
      for (float& s : want_scales)
        for (int w = from / 2; w >= to; w /= 2) s = pmkvq::ers_scale(s, w);

      DeviceBuffer<std::uint16_t> in(pmkvq::pack_msb_first(codes.data(), count, from));
      DeviceBuffer<std::uint16_t> out(static_cast<std::size_t>(count / (16 / to)));
      KVSIFT_CUDA_CHECK(cudaMemset(out.get(), 0xab, out.size() * 2));
      DeviceBuffer<float> sc(scales);
      cuda::pmkvq_requantize(in.get(), from, count, out.get(), to, sc.get(),
                             static_cast<std::int64_t>(scales.size()), nullptr);
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      CHECK(test::first_difference("shifted words", out.download(),
                                   pmkvq::pack_msb_first(want.data(), count, to)) == "");
      CHECK(test::first_difference("shifted scales", sc.download(), want_scales) == "");
    }
}

TEST_CASE("cuda PM-KVQ Q16 + ERS reproduces PmkvqRealStream's flush to the body", "[cuda][pmkvq]") {
  for (int body_bits : {8, 4, 2}) {
    INFO("body bits " << body_bits);
    PmkvqConfig cfg;
    cfg.backend = PmkvqBackend::real;
    cfg.kv_heads = 2;
    cfg.head_dim = 256;
    cfg.group_size = 128;
    cfg.n_sink = 1;
    cfg.n_window = 16;
    cfg.n_init_bits = body_bits;
    cfg.kv_budget_mb = {1e6};  // never over budget: the body stays at n_init_bits
    const std::int64_t H = 2, D = 256, u = 40;
    // One update of 40 tokens: 1 sink, 32 flushed to the body (tokens 1..32), 7 in the window.
    const std::vector<float> keys = test::make_values<bf16_t>(H, u, D, 300 + body_bits);
    const std::vector<float> values = test::make_values<bf16_t>(H, u, D, 400 + body_bits);
    PmkvqRealStream stream(cfg, 0);
    stream.update(keys.data(), values.data(), u, u);
    REQUIRE(stream.n_body() == 32);
    for (int kv = 0; kv < 2; ++kv) {
      INFO((kv == 0 ? "keys" : "values"));
      const std::vector<float>& src = kv == 0 ? keys : values;
      std::vector<float> x;  // tokens 1..32, token-major [t][h][d] as the stream stores them
      for (std::int64_t t = 1; t <= 32; ++t)
        for (std::int64_t h = 0; h < H; ++h)
          x.insert(x.end(), src.begin() + (h * u + t) * D, src.begin() + (h * u + t + 1) * D);
      const cuda::DeviceAsymPacked q16 = cuda::pmkvq_layout(16, true, 128, 1, 32 * H, D);
      const test::HostPacked w16 = test::gpu_quantize<bf16_t>(q16, x);
      const std::int64_t count = 32 * H * D, groups = 32 * H * 2;
      DeviceBuffer<std::uint16_t> in(narrow_words(w16.words));
      DeviceBuffer<std::uint16_t> out(static_cast<std::size_t>(count / (16 / body_bits)));
      DeviceBuffer<float> sc(w16.scales);
      cuda::pmkvq_requantize(in.get(), 16, count, out.get(), body_bits, sc.get(), groups, nullptr);
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      const PmkvqRealStream::Segment& body = stream.body(kv);
      CHECK(test::first_difference("body words", out.download(),
                                   pmkvq::pack_msb_first(body.codes.data(), count, body_bits)) ==
            "");
      CHECK(test::first_value_difference("body scales", sc.download(), body.scales) == "");
      CHECK(test::first_value_difference("body zero points", w16.zeros, body.zeros) == "");
    }
  }
}

TEST_CASE("cuda PM-KVQ fake backend: Q16 then bf16(dequantize_f32) equals PmkvqFakeStream",
          "[cuda][pmkvq]") {
  PmkvqConfig cfg;
  cfg.backend = PmkvqBackend::fake;
  cfg.kv_heads = 2;
  cfg.head_dim = 128;
  cfg.group_size = 128;
  cfg.n_sink = 1;
  cfg.n_window = 128;
  cfg.kv_budget_mb = {1e6};
  const std::int64_t H = 2, D = 128, u = 20;  // no flush: every token quantized once at 16 bits
  const std::vector<float> keys = test::make_values<float>(H, u, D, 501);
  const std::vector<float> values = test::make_values<float>(H, u, D, 502);
  PmkvqFakeStream stream(cfg, 0);
  stream.update(keys.data(), values.data(), u, u);
  for (int kv = 0; kv < 2; ++kv) {
    INFO((kv == 0 ? "keys" : "values"));
    const std::vector<float>& src = kv == 0 ? keys : values;
    std::vector<float> x;  // token-major [t][h][d], the fake cache's order
    for (std::int64_t t = 0; t < u; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        x.insert(x.end(), src.begin() + (h * u + t) * D, src.begin() + (h * u + t + 1) * D);
    const cuda::DeviceAsymPacked q = cuda::pmkvq_layout(16, false, 128, 1, u * H, D);
    const test::HostPacked w = test::gpu_quantize<float>(q, x);
    const std::vector<bf16_t> dec = test::gpu_dequantize<bf16_t>(q, w, cuda::AsymDequantMode::f32);
    std::vector<float> got(dec.size());
    for (std::size_t i = 0; i < dec.size(); ++i) got[i] = to_float(dec[i]);
    CHECK(test::first_difference("fake cache", got, kv == 0 ? stream.keys() : stream.values()) ==
          "");
  }
}

TEST_CASE("cuda PM-KVQ codec: error paths name the argument", "[cuda][pmkvq]") {
  using Catch::Matchers::Contains;
  DeviceBuffer<std::uint16_t> a(64), b(64);
  DeviceBuffer<float> s(4);
  REQUIRE_THROWS_WITH(cuda::pmkvq_requantize(a.get(), 4, 64, b.get(), 8, s.get(), 4, nullptr),
                      Contains("to_bits < from_bits"));
  REQUIRE_THROWS_WITH(cuda::pmkvq_requantize(a.get(), 16, 60, b.get(), 2, s.get(), 4, nullptr),
                      Contains("count (60)"));
  REQUIRE_THROWS_WITH(cuda::pmkvq_requantize(a.get(), 16, 64, a.get() + 4, 8, s.get(), 4, nullptr),
                      Contains("overlap"));
  REQUIRE_THROWS_WITH(cuda::pmkvq_requantize(a.get(), 16, 64, b.get(), 8, nullptr, 4, nullptr),
                      Contains("scales must be non-null"));
  REQUIRE_THROWS_WITH(cuda::pmkvq_layout(3, true, 128, 1, 1, 128), Contains("got 3"));
}
