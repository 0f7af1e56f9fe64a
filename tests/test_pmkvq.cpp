// PM-KVQ (docs/algorithms.md §5.2): the ERS/scale/packing tables, golden parity of both reference
// orderings (pmkvq_real, pmkvq_fake, README rule: integers, codes, real scales/zeros exact; fake
// values within 1e-6·(|ref| + group max |ref|)), the library mode beyond the reference, and
// error paths.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/config/pmkvq_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/quantizers/pmkvq_stream.hpp"
#include "kvsift/quant/pmkvq_codec.hpp"

using namespace kvsift;

namespace {

std::string golden(const std::string& name) {
  return std::string(KVSIFT_GOLDEN_DIR) + "/" + name + ".safetensors";
}

std::vector<std::int64_t> ints(const SafetensorsFile& f, const std::string& name) {
  return f.get(name).to_i64();
}
std::vector<float> floats(const SafetensorsFile& f, const std::string& name) {
  return f.get(name).to_f32();
}

// The case's config as a PmkvqConfig with the reference's rule.
PmkvqConfig config_of(const nlohmann::json& c) {
  PmkvqConfig cfg;
  cfg.backend =
      c.at("backend").get<std::string>() == "real" ? PmkvqBackend::real : PmkvqBackend::fake;
  cfg.kv_heads = c.at("kv_heads").get<std::int64_t>();
  cfg.head_dim = c.at("head_dim").get<std::int64_t>();
  cfg.group_size = c.at("group_size").get<std::int64_t>();
  cfg.n_sink = c.at("n_sink_token").get<std::int64_t>();
  cfg.n_window = c.at("n_window_token").get<std::int64_t>();
  cfg.n_init_bits = c.at("n_init_kv_bits").get<int>();
  cfg.kv_budget_mb = {c.at("kv_budget_mb").get<double>()};
  cfg.reference_exact = true;
  return cfg;
}

// [tokens, H, inner] token-major → [H, tokens, inner] head-major (the golden layout, batch 1).
template <class T>
std::vector<std::int64_t> head_major(const std::vector<T>& x, std::int64_t tokens, std::int64_t H,
                                     std::int64_t inner) {
  std::vector<std::int64_t> out(x.size());
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < inner; ++i)
        out[(h * tokens + t) * inner + i] = static_cast<std::int64_t>(x[(t * H + h) * inner + i]);
  return out;
}
std::vector<float> head_major_f(const std::vector<float>& x, std::int64_t tokens, std::int64_t H,
                                std::int64_t inner) {
  std::vector<float> out(x.size());
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < inner; ++i)
        out[(h * tokens + t) * inner + i] = x[(t * H + h) * inner + i];
  return out;
}

void check_segment(const SafetensorsFile& g, const std::string& prefix,
                   const PmkvqRealStream::Segment& s, std::int64_t H, std::int64_t D) {
  const StTensor& codes = g.get(prefix + "_codes");
  REQUIRE(codes.shape == std::vector<std::int64_t>{1, H, s.tokens, D});
  CHECK(head_major(s.codes, s.tokens, H, D) == codes.to_i64());
  const std::vector<float> sc = head_major_f(s.scales, s.tokens, H, 1);
  const std::vector<float> zr = head_major_f(s.zeros, s.tokens, H, 1);
  CHECK(sc == floats(g, prefix + "_scales"));  // exact (bf16 values)
  CHECK(zr == floats(g, prefix + "_zeros"));
}

}  // namespace

TEST_CASE("ERS 2n -> n equals the reference tables for every code", "[pmkvq][golden]") {
  const SafetensorsFile g = SafetensorsFile::load(golden("pmkvq_ers"));
  const struct {
    const char* name;
    int n;
  } tables[] = {{"ers_16to8", 8}, {"ers_8to4", 4}, {"ers_4to2", 2}};
  for (const auto& t : tables) {
    const std::vector<std::int64_t> ref = ints(g, t.name);
    REQUIRE(ref.size() == (std::size_t{1} << (2 * t.n)));
    std::size_t mismatches = 0, floor_mismatches = 0;
    for (std::uint32_t q = 0; q < ref.size(); ++q) {
      if (pmkvq::ers_code(q, t.n) != ref[q]) ++mismatches;
      // The closed form ⌊q/(2^n + 1) + ½⌋ as an independent oracle of the shift formula.
      const std::uint32_t d = (1u << t.n) + 1u;
      if ((2 * q + d) / (2 * d) != static_cast<std::uint32_t>(ref[q])) ++floor_mismatches;
    }
    INFO(t.name);
    CHECK(mismatches == 0);
    CHECK(floor_mismatches == 0);
  }
}

TEST_CASE("ERS scale update s' = bf16(s*(2^n+1)) equals the reference tables", "[pmkvq][golden]") {
  const SafetensorsFile g = SafetensorsFile::load(golden("pmkvq_ers"));
  const std::vector<float> in = floats(g, "scale_in");
  const struct {
    const char* name;
    int n;
  } tables[] = {{"scale_x257", 8}, {"scale_x17", 4}, {"scale_x5", 2}};
  for (const auto& t : tables) {
    const std::vector<float> ref = floats(g, t.name);
    REQUIRE(ref.size() == in.size());
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < in.size(); ++i)
      if (pmkvq::ers_scale(in[i], t.n) != ref[i]) ++mismatches;
    INFO(t.name);
    CHECK(mismatches == 0);
  }
}

TEST_CASE("int16 MSB-first packing equals the reference words", "[pmkvq][golden]") {
  const SafetensorsFile g = SafetensorsFile::load(golden("pmkvq_ers"));
  for (int n : {16, 8, 4, 2}) {
    const std::vector<std::int64_t> c = ints(g, "pack" + std::to_string(n) + "_codes");
    const std::vector<std::int64_t> w = ints(g, "pack" + std::to_string(n) + "_words");
    std::vector<std::uint16_t> codes(c.begin(), c.end());
    const std::vector<std::uint16_t> words =
        pmkvq::pack_msb_first(codes.data(), static_cast<std::int64_t>(codes.size()), n);
    INFO("n = " << n);
    CHECK(std::vector<std::int64_t>(words.begin(), words.end()) == w);
    CHECK(pmkvq::unpack_msb_first(words.data(), static_cast<std::int64_t>(codes.size()), n) ==
          codes);
  }
}

TEST_CASE("packing and ERS by hand", "[pmkvq]") {
  const std::uint16_t codes[] = {1, 2, 3, 0, 3, 3, 3, 3};
  // 01 10 11 00 11 11 11 11 = 0x6CFF: the first code in the two most significant bits.
  CHECK(pmkvq::pack_msb_first(codes, 8, 2) == std::vector<std::uint16_t>{0x6CFF});
  CHECK(pmkvq::ers_code(8, 2) == 2);   // 8/5 + 1/2 = 2.1 -> 2
  CHECK(pmkvq::ers_code(12, 2) == 2);  // 12/5 + 1/2 = 2.9 -> 2
  CHECK(pmkvq::ers_code(13, 2) == 3);  // 13/5 + 1/2 = 3.1 -> 3
  CHECK(pmkvq::ers_code(65535, 8) == 255);
  CHECK(pmkvq::ers_code(128, 8) == 0);  // 128/257 + 1/2 < 1
  CHECK(pmkvq::ers_code(129, 8) == 1);
}

TEST_CASE("PM-KVQ real backend matches pmkvq_real (reference_exact)", "[pmkvq][golden]") {
  const SafetensorsFile g = SafetensorsFile::load(golden("pmkvq_real"));
  const nlohmann::json c = nlohmann::json::parse(g.metadata().at("config"));
  PmkvqRealStream s(config_of(c), 0);
  const std::int64_t H = s.config().kv_heads, D = s.config().head_dim;
  const std::vector<float> pk = floats(g, "prefill_keys"), pv = floats(g, "prefill_values");
  const std::vector<float> dk = floats(g, "decode_keys"), dv = floats(g, "decode_values");
  const std::int64_t P = g.get("prefill_keys").shape[2], N = g.get("decode_keys").shape[2];
  const std::vector<std::int64_t> nbits = ints(g, "real.nbits"), mem = ints(g, "real.mem_bytes");
  const std::vector<std::int64_t> nwin = ints(g, "real.n_window"), nbody = ints(g, "real.n_body");
  REQUIRE(ints(g, "real.error_step")[0] == -1);
  REQUIRE(static_cast<std::int64_t>(nbits.size()) == N + 1);

  std::size_t bad = 0;
  for (std::int64_t i = 0; i <= N; ++i) {
    const PmkvqUpdateResult r =
        i == 0 ? s.update(pk.data(), pv.data(), P, P)
               : s.update(dk.data() + (i - 1) * D, dv.data() + (i - 1) * D, 1, N);
    if (r.n_bits != nbits[i] || r.mem_bytes != mem[i] || s.n_window() != nwin[i] ||
        s.n_body() != nbody[i]) {
      if (bad++ < 5)
        UNSCOPED_INFO("update " << i << ": bits " << r.n_bits << "/" << nbits[i] << " mem "
                                << r.mem_bytes << "/" << mem[i] << " window " << s.n_window() << "/"
                                << nwin[i] << " body " << s.n_body() << "/" << nbody[i]);
    }
    const std::string at = "real.at" +
                           std::string(i < 10    ? "00"
                                       : i < 100 ? "0"
                                                 : "") +
                           std::to_string(i) + ".body_";
    if (g.has(at + "k_codes")) {
      INFO("dump " << at);
      check_segment(g, at + "k", s.body(0), H, D);
      check_segment(g, at + "v", s.body(1), H, D);
    }
  }
  CHECK(bad == 0);
  check_segment(g, "real.sink_k", s.sink(0), H, D);
  check_segment(g, "real.sink_v", s.sink(1), H, D);
  check_segment(g, "real.body_k", s.body(0), H, D);
  check_segment(g, "real.body_v", s.body(1), H, D);
  check_segment(g, "real.window_k", s.window(0), H, D);
  check_segment(g, "real.window_v", s.window(1), H, D);
}

namespace {
// README rule for fake.keys/values: |x − ref| ≤ 1e-6·(|ref| + max |ref| over its group).
std::size_t fake_mismatches(const std::vector<float>& x, const std::vector<float>& ref,
                            std::int64_t G) {
  REQUIRE(x.size() == ref.size());
  std::size_t bad = 0;
  for (std::size_t g0 = 0; g0 < ref.size(); g0 += static_cast<std::size_t>(G)) {
    float gmax = 0;
    for (std::int64_t i = 0; i < G; ++i) gmax = std::fmax(gmax, std::fabs(ref[g0 + i]));
    for (std::int64_t i = 0; i < G; ++i)
      if (!(std::fabs(x[g0 + i] - ref[g0 + i]) <= 1e-6 * (std::fabs(ref[g0 + i]) + gmax))) ++bad;
  }
  return bad;
}
}  // namespace

TEST_CASE("PM-KVQ fake backend matches pmkvq_fake (reference_exact)", "[pmkvq][golden]") {
  const SafetensorsFile g = SafetensorsFile::load(golden("pmkvq_fake"));
  const nlohmann::json c = nlohmann::json::parse(g.metadata().at("config"));
  PmkvqFakeStream s(config_of(c), 0);
  const std::int64_t H = s.config().kv_heads, D = s.config().head_dim;
  const std::vector<float> pk = floats(g, "prefill_keys"), pv = floats(g, "prefill_values");
  const std::vector<float> dk = floats(g, "decode_keys"), dv = floats(g, "decode_values");
  const std::int64_t P = g.get("prefill_keys").shape[2], N = g.get("decode_keys").shape[2];
  const std::vector<std::int64_t> nbits = ints(g, "fake.nbits"), mem = ints(g, "fake.mem_bytes");
  const std::int64_t error_step = ints(g, "fake.error_step")[0];
  REQUIRE(error_step == static_cast<std::int64_t>(nbits.size()));

  auto compare_cache = [&](const std::string& prefix) {
    INFO(prefix);
    const std::int64_t T = s.tokens();
    REQUIRE(g.get(prefix + "keys").shape == std::vector<std::int64_t>{1, H, T, D});
    CHECK(fake_mismatches(head_major_f(s.keys(), T, H, D), floats(g, prefix + "keys"), D) == 0);
    CHECK(fake_mismatches(head_major_f(s.values(), T, H, D), floats(g, prefix + "values"), D) == 0);
    const std::vector<std::int64_t> nb(s.nbits_pos().begin(), s.nbits_pos().end());
    CHECK(nb == ints(g, prefix + "nbits_pos"));
  };

  std::size_t bad = 0;
  bool raised = false;
  for (std::int64_t i = 0; i <= N; ++i) {
    try {
      const PmkvqUpdateResult r =
          i == 0 ? s.update(pk.data(), pv.data(), P, P)
                 : s.update(dk.data() + (i - 1) * D, dv.data() + (i - 1) * D, 1, N);
      REQUIRE(i < error_step);
      if (r.n_bits != nbits[i] || r.mem_bytes != mem[i]) {
        if (bad++ < 5)
          UNSCOPED_INFO("update " << i << ": bits " << r.n_bits << "/" << nbits[i] << " mem "
                                  << r.mem_bytes << "/" << mem[i]);
      }
    } catch (const PmkvqBudgetError& e) {
      CHECK(i == error_step);
      CHECK(std::string(e.what()).find("exceed the budget") != std::string::npos);
      raised = true;
      break;
    }
    const std::string at = "fake.at" +
                           std::string(i < 10    ? "00"
                                       : i < 100 ? "0"
                                                 : "") +
                           std::to_string(i) + ".";
    if (g.has(at + "keys")) compare_cache(at);
  }
  CHECK(bad == 0);
  CHECK(raised);
  compare_cache("fake.");  // the stream stayed at the last successful update
}

TEST_CASE("PM-KVQ library mode degrades instead of raising, and reports the overrun", "[pmkvq]") {
  const SafetensorsFile g = SafetensorsFile::load(golden("pmkvq_fake"));
  const nlohmann::json c = nlohmann::json::parse(g.metadata().at("config"));
  PmkvqConfig cfg = config_of(c);
  cfg.reference_exact = false;
  PmkvqFakeStream s(cfg, 0);
  const std::int64_t D = cfg.head_dim;
  const std::vector<float> pk = floats(g, "prefill_keys"), pv = floats(g, "prefill_values");
  const std::vector<float> dk = floats(g, "decode_keys"), dv = floats(g, "decode_values");
  const std::int64_t P = g.get("prefill_keys").shape[2], N = g.get("decode_keys").shape[2];
  std::int64_t evicted = 0;
  bool flagged = false;
  for (std::int64_t i = 0; i <= N; ++i) {
    const PmkvqUpdateResult r =
        i == 0 ? s.update(pk.data(), pv.data(), P, P)
               : s.update(dk.data() + (i - 1) * D, dv.data() + (i - 1) * D, 1, N);
    CHECK(r.fits);                                   // every update ends within the budget
    CHECK(s.memory_bytes() <= cfg.budget_bytes(0));  // scales and zeros included
    evicted += r.evicted;
    flagged = flagged || r.reference_would_raise;
  }
  CHECK(flagged);  // the overrun where the reference raises is still reported
  CHECK(s.n_bits() == 2);
  CHECK(evicted > 0);
  // Tokens: sink + body + window, the evicted ones gone.
  CHECK(s.tokens() == P + N - evicted);
  // Hand count: with H=1, D=G=128, one token costs 2·(2·128/8·n/… ) — check the formula at 2 bits:
  // codes 2 (K,V)·128·n/8 bytes plus 2·4 bytes of fp32 scale and zero per group, K and V.
  pmkvq_detail::Counts one;
  one.body = 1;
  CHECK(s.memory_bytes(one, 2) == 2 * 128 * 2 / 8 + 2 * 2 * 4);
}

TEST_CASE("PM-KVQ memory count by hand (reference rule)", "[pmkvq]") {
  PmkvqConfig cfg;
  cfg.backend = PmkvqBackend::real;
  cfg.kv_heads = 2;
  cfg.kv_budget_mb = {1.0};
  cfg.reference_exact = true;
  PmkvqRealStream s(cfg, 0);
  pmkvq_detail::Counts c;
  c.sink = 1, c.window = 3, c.body = 10;
  // H·D·2·(16·(1+3) + 4·10)/8 = 2·128·2·104/8
  CHECK(s.memory_bytes(c, 4) == 2 * 128 * 2 * 104 / 8);
}

TEST_CASE("PM-KVQ config and input errors name the field and value", "[pmkvq][errors]") {
  PmkvqConfig cfg;
  cfg.kv_heads = 1;
  cfg.kv_budget_mb = {1.0};
  auto msg = [](const PmkvqConfig& c) {
    try {
      c.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  PmkvqConfig bad = cfg;
  bad.group_size = 96;
  CHECK(msg(bad).find("group_size") != std::string::npos);
  CHECK(msg(bad).find("96") != std::string::npos);
  bad = cfg;
  bad.n_init_bits = 3;
  CHECK(msg(bad).find("n_init_bits must be 16, 8, 4 or 2, got 3") != std::string::npos);
  bad = cfg;
  bad.kv_budget_mb = {0.5, -1.0};
  CHECK(msg(bad).find("kv_budget_mb[1]") != std::string::npos);
  bad = cfg;
  bad.kv_budget_mb = {0.5, 1.0};
  CHECK_THROWS_WITH(bad.budget_bytes(2), Catch::Matchers::Contains("layer 2 has no budget"));
  CHECK(bad.budget_bytes(1) == 1048576.0);
  CHECK_THROWS_WITH(PmkvqFakeStream(cfg, 0), Catch::Matchers::Contains("backend = fake"));
  PmkvqRealStream s(cfg, 0);
  std::vector<float> x(128, 0.f);
  CHECK_THROWS_WITH(s.update(x.data(), x.data(), 2, 1),
                    Catch::Matchers::Contains("src_seq (1) must be >= u (2)"));
  CHECK_THROWS_WITH(pmkvq::ers_code(256, 4), Catch::Matchers::Contains("does not fit in 8 bits"));
}

TEST_CASE("PM-KVQ reference_exact raises on an empty body over budget", "[pmkvq][errors]") {
  PmkvqConfig cfg;
  cfg.kv_heads = 1;
  cfg.n_window = 4;
  cfg.kv_budget_mb = {1e-4};  // 104 bytes: below one 16-bit token of K and V (512 bytes)
  cfg.reference_exact = true;
  PmkvqRealStream s(cfg, 0);
  std::vector<float> x(128);
  for (int i = 0; i < 128; ++i) x[i] = static_cast<float>(i) / 8;
  CHECK_THROWS_WITH(s.update(x.data(), x.data(), 1, 1),
                    Catch::Matchers::Contains("with an empty body"));
  CHECK(s.tokens() == 0);  // unchanged
}

TEST_CASE("PM-KVQ 16-bit quantizer by hand: bf16 scale, fp32 quotient, scale floor", "[pmkvq]") {
  // Group {0, 64, 1, 0.5, 0...}: s = bf16(bf16(64)/65535) = bf16(2^-10·1.0000153) = 2^-10;
  // codes (x + 0)/2^-10 in fp32: 65536 → clamped 65535, 1024, 512.
  std::vector<float> x(128, 0.f);
  x[1] = 64.f, x[2] = 1.f, x[3] = 0.5f;
  std::vector<std::uint16_t> q(128);
  const GroupParams p = pmkvq::quantize_group(x.data(), 128, 16, pmkvq::Arith::bf16, q.data());
  CHECK(p.scale == std::ldexp(1.0f, -10));
  CHECK(p.zero == 0.f);
  CHECK(q[0] == 0);
  CHECK(q[1] == 65535);
  CHECK(q[2] == 1024);
  CHECK(q[3] == 512);
  // A constant group: the scale floor 1e-5 stored as bf16 (1.00135803e-05), every code 0.
  std::vector<float> c(128, 0.5f);
  const GroupParams pc = pmkvq::quantize_group(c.data(), 128, 16, pmkvq::Arith::bf16, q.data());
  CHECK(pc.scale == 1.0013580322265625e-05f);
  CHECK(pc.zero == -0.5f);
  CHECK(q[0] == 0);
}

TEST_CASE("PM-KVQ library mode: sinks and window alone over budget keep everything, reported",
          "[pmkvq]") {
  PmkvqConfig cfg;
  cfg.kv_heads = 1;
  cfg.n_window = 4;
  cfg.kv_budget_mb = {1e-4};  // 104 bytes; one 16-bit token of K and V costs 512 + 8 bytes
  PmkvqRealStream s(cfg, 0);
  std::vector<float> x(128);
  for (int i = 0; i < 128; ++i) x[i] = static_cast<float>(i) / 8;
  const PmkvqUpdateResult r = s.update(x.data(), x.data(), 1, 1);
  CHECK(r.mem_bytes == 2 * 128 * 2 + 2 * 2 * 2);  // codes + bf16 scale and zero, K and V
  CHECK(r.over_budget);
  CHECK(r.reference_would_raise);
  CHECK_FALSE(r.fits);
  CHECK(r.evicted == 0);
  CHECK(s.tokens() == 1);
}

TEST_CASE("PM-KVQ real flush shrinks 16-bit codes to the body width by repeated rounding",
          "[pmkvq]") {
  // Body starts at 4 bits: a flushed token's codes go 16 → 8 → 4 through ⌊q/(2^n + 1) + ½⌋ twice
  // (the closed form, an oracle independent of the shift formula), its scale ·257 then ·17 with a
  // bf16 rounding each; the zero point is kept.
  PmkvqConfig cfg;
  cfg.kv_heads = 1;
  cfg.n_sink = 1;
  cfg.n_window = 2;
  cfg.n_init_bits = 4;
  cfg.kv_budget_mb = {1.0};
  cfg.reference_exact = true;
  PmkvqRealStream s(cfg, 0);
  std::vector<float> x(4 * 128);  // [1 head, 4 tokens, 128]
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 128; ++i)
      x[t * 128 + i] = pmkvq::round_bf16(std::sin(0.37f * i + t) * (1 + t));
  const PmkvqUpdateResult r = s.update(x.data(), x.data(), 3, 4);  // sink + 2 → flush 2
  CHECK(r.n_bits == 4);
  REQUIRE(s.n_body() == 2);
  CHECK(s.n_window() == 0);
  for (int t = 1; t <= 2; ++t) {
    std::vector<std::uint16_t> q16(128);
    const GroupParams p =
        pmkvq::quantize_group(&x[t * 128], 128, 16, pmkvq::Arith::bf16, q16.data());
    for (int i = 0; i < 128; ++i) {
      const std::uint32_t q8 = (2u * q16[i] + 257u) / (2u * 257u);
      const std::uint32_t q4 = (2u * q8 + 17u) / (2u * 17u);
      CHECK(s.body(0).codes[(t - 1) * 128 + i] == q4);
    }
    CHECK(s.body(0).scales[t - 1] == pmkvq::round_bf16(pmkvq::round_bf16(p.scale * 257) * 17));
    CHECK(s.body(0).zeros[t - 1] == p.zero);
  }
  // The fourth token enters the window; 2·H·D·(16·(1 + 1) + 4·2)/8 bytes of codes, H = 1.
  const PmkvqUpdateResult r2 = s.update(x.data() + 3 * 128, x.data() + 3 * 128, 1, 4);
  CHECK(r2.mem_bytes == 2 * 128 * (16 * 2 + 4 * 2) / 8);
}

TEST_CASE("PM-KVQ library mode on the real stream stays within budget", "[pmkvq]") {
  const SafetensorsFile g = SafetensorsFile::load(golden("pmkvq_real"));
  PmkvqConfig cfg = config_of(nlohmann::json::parse(g.metadata().at("config")));
  cfg.reference_exact = false;
  cfg.kv_budget_mb = {0.16};  // sinks + window take up to 133120 bytes: the body must evict
  PmkvqRealStream s(cfg, 0);
  const std::int64_t D = cfg.head_dim;
  const std::vector<float> pk = floats(g, "prefill_keys"), pv = floats(g, "prefill_values");
  const std::vector<float> dk = floats(g, "decode_keys"), dv = floats(g, "decode_values");
  const std::int64_t P = g.get("prefill_keys").shape[2], N = g.get("decode_keys").shape[2];
  std::int64_t evicted = 0;
  for (std::int64_t i = 0; i <= N; ++i) {
    const PmkvqUpdateResult r =
        i == 0 ? s.update(pk.data(), pv.data(), P, P)
               : s.update(dk.data() + (i - 1) * D, dv.data() + (i - 1) * D, 1, N);
    CHECK(r.fits);
    evicted += r.evicted;
  }
  CHECK(s.n_bits() == 2);
  CHECK(evicted > 0);
  CHECK(s.tokens() == P + N - evicted);
  CHECK(s.body(0).tokens == s.n_body());
  CHECK(static_cast<double>(s.memory_bytes()) <= cfg.budget_bytes(0));
}
