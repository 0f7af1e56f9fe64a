// KIVI (docs/algorithms.md §5.1): golden parity on every kivi_* case under the golden README's
// rule (tests/kivi_golden_check.hpp), the prefill/decode schedule worked out by hand, constant
// groups, ragged left-padded batches against per-sequence runs, and error paths.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kivi_golden_check.hpp"
#include "kvsift/policy/quantizers/kivi.hpp"
#include "kvsift/policy/quantizers/kivi_replay.hpp"

using namespace kvsift;

namespace {
std::string golden(const std::string& name) { return std::string(KVSIFT_GOLDEN_DIR) + "/" + name; }

// A deterministic fp16-representable value (multiples of 1/64 in [-2, 2)).
float val(std::int64_t i) { return static_cast<float>((i * 37 + 11) % 256 - 128) / 64.0f; }
}  // namespace

TEST_CASE("KIVI golden parity") {
  for (const char* name : {"kivi_2bit_r128.safetensors", "kivi_4bit_r32_gqa.safetensors",
                           "kivi_k2v4_const.safetensors"}) {
    INFO(name);
    const SafetensorsFile ref = SafetensorsFile::load(golden(name));
    const SafetensorsFile got = kivi_replay(ref);
    test::check_kivi_outputs(got, ref);
  }
}

TEST_CASE("KIVI golden: the constant-group case really has zero-range groups") {
  const SafetensorsFile ref = SafetensorsFile::load(golden("kivi_k2v4_const.safetensors"));
  int zeros = 0;
  for (const char* n : {"sK", "sV"})
    for (float s : ref.get(n).to_f32()) zeros += s == 0.0f;
  CHECK(zeros == 4);
}

TEST_CASE("KIVI schedule: prefill rules and quantize-after-use (R = 64, G = 32)") {
  KiviConfig cfg;
  cfg.group_size = 32;
  cfg.residual_length = 64;
  const int D = 32;
  auto run_prefill = [&](int T) {
    KiviStream s(cfg, 1, 1, D);
    std::vector<float> k(static_cast<std::size_t>(T) * D), v(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = val(i), v[i] = val(i + 5);
    s.prefill(k.data(), v.data(), T);
    return s;
  };
  // T < R: everything full precision (keys), T <= R (values).
  KiviLengths l = run_prefill(40).lengths(0, 0);
  CHECK((l.quantized_keys == 0 && l.full_keys == 40 && l.quantized_values == 0 &&
         l.full_values == 40));
  l = run_prefill(64).lengths(0, 0);  // r = 0: all keys quantized; values T = R all full
  CHECK((l.quantized_keys == 64 && l.full_keys == 0 && l.quantized_values == 0 &&
         l.full_values == 64));
  KiviStream s = run_prefill(100);  // r = 36: 64 keys quantized; values: first 36 quantized
  l = s.lengths(0, 0);
  CHECK((l.quantized_keys == 64 && l.full_keys == 36 && l.quantized_values == 36 &&
         l.full_values == 64));
  // 28 decode steps: the full keys reach R = 64 at step 28 and are flushed after attention.
  std::vector<float> k(D), v(D);
  for (int step = 1; step <= 28; ++step) {
    for (int d = 0; d < D; ++d) k[d] = val(step * 100 + d), v[d] = val(step * 7 + d);
    s.append(k.data(), v.data());
    if (step == 28) {
      l = s.lengths(0, 0);  // the step's attention sees 64 full keys and R + 1 full values
      CHECK((l.full_keys == 64 && l.full_values == 65));
    }
    s.after_attention();
  }
  l = s.lengths(0, 0);
  CHECK((l.quantized_keys == 128 && l.full_keys == 0 && l.quantized_values == 64 &&
         l.full_values == 64));
  // Bytes: keys 128 tokens · 32 channels at 2 bits = 32 · 8 words · 4 B + 4 · 32 groups · 4 B;
  // values 64 tokens · (2 words · 4 B + 1 group · 4 B); full values 64 · 32 · 2 B.
  CHECK(s.bytes() == (32 * 8 * 4 + 4 * 32 * 4) + 64 * (2 * 4 + 4) + 64 * 32 * 2);
}

TEST_CASE("KIVI: a constant group dequantizes to its value exactly (no NaN)") {
  KiviConfig cfg;
  cfg.group_size = 32;
  cfg.residual_length = 32;
  KiviStream s(cfg, 1, 1, 32);
  std::vector<float> k(32 * 32, 0.75f), v(32 * 32, -1.5f);  // T = R: keys quantized, values full
  s.prefill(k.data(), v.data(), 32);
  const std::vector<float> K = s.dequantized_keys(s.head(0, 0));
  REQUIRE(K.size() == 32 * 32);
  for (float x : K) REQUIRE(x == 0.75f);
  CHECK(s.head(0, 0).kq_params[0].scale == 0.0f);
}

TEST_CASE("KIVI: ragged left-padded batch equals each sequence run alone") {
  KiviConfig cfg;
  cfg.k_bits = 4;
  cfg.v_bits = 2;
  cfg.group_size = 32;
  cfg.residual_length = 32;
  const int D = 32, T = 80, steps = 40;
  const std::vector<std::int64_t> lens = {80, 45};
  // Padded prefill [2, 1, T, D]: sequence 1's 45 real tokens are the last 45 positions; its pads
  // hold garbage that must never reach the state.
  std::vector<float> pk(2 * T * D), pv(pk.size());
  for (std::size_t i = 0; i < pk.size(); ++i) pk[i] = val(i), pv[i] = val(3 * i + 1);
  for (int t = 0; t < T - 45; ++t)
    for (int d = 0; d < D; ++d) pk[(T + t) * D + d] = pv[(T + t) * D + d] = 1000.0f;
  KiviStream batch(cfg, 2, 1, D);
  batch.prefill(pk.data(), pv.data(), T, lens);
  KiviStream a(cfg, 1, 1, D), b(cfg, 1, 1, D);
  a.prefill(pk.data(), pv.data(), T);
  b.prefill(pk.data() + (T + (T - 45)) * D, pv.data() + (T + (T - 45)) * D, 45);
  std::vector<float> q(2 * D), o(2 * D), oa(D), ob(D);
  for (int s = 0; s < steps; ++s) {
    std::vector<float> k(2 * D), v(2 * D);
    for (int i = 0; i < 2 * D; ++i)
      k[i] = val(s * 1000 + i), v[i] = val(s * 999 + i), q[i] = val(s + i);
    batch.append(k.data(), v.data());
    a.append(k.data(), v.data());
    b.append(k.data() + D, v.data() + D);
    batch.attend(q.data(), 1, o.data());  // one query head per KV head
    a.attend(q.data(), 1, oa.data());
    b.attend(q.data() + D, 1, ob.data());
    for (int d = 0; d < D; ++d) REQUIRE((o[d] == oa[d] && o[D + d] == ob[d]));
    batch.after_attention();
    a.after_attention();
    b.after_attention();
  }
  for (int i = 0; i < 2; ++i) {
    const KiviStream& one = i == 0 ? a : b;
    CHECK(batch.head(i, 0).kq_codes == one.head(0, 0).kq_codes);
    CHECK(batch.head(i, 0).vq_codes == one.head(0, 0).vq_codes);
    CHECK(batch.head(i, 0).k_full == one.head(0, 0).k_full);
    CHECK(batch.head(i, 0).v_full == one.head(0, 0).v_full);
  }
  for (float x : batch.dequantized_values(batch.head(1, 0))) REQUIRE(std::fabs(x) < 3.0f);
  const KiviLengths l = batch.lengths(1, 0);  // 45 + 40 = 85 tokens: 64 keys quantized
  CHECK((l.quantized_keys == 64 && l.full_keys == 21 && l.quantized_values == 53 &&
         l.full_values == 32));
}

TEST_CASE("KIVI: bad configs and inputs name the field and value") {
  KiviConfig cfg;
  cfg.k_bits = 3;
  CHECK_THROWS_WITH(cfg.validate(), Catch::Matchers::Contains("k_bits must be 2, 4 or 8, got 3"));
  cfg = KiviConfig{};
  cfg.residual_length = 48;
  CHECK_THROWS_WITH(cfg.validate(),
                    Catch::Matchers::Contains("residual_length (48) must be a positive multiple of "
                                              "group_size (32)"));
  cfg = KiviConfig{};
  CHECK_THROWS_WITH(KiviStream(cfg, 1, 1, 48),
                    Catch::Matchers::Contains("head_dim (48) must be a positive multiple of "
                                              "group_size (32)"));
  KiviStream s(cfg, 2, 1, 32);
  std::vector<float> x(2 * 4 * 32);
  CHECK_THROWS_WITH(s.prefill(x.data(), x.data(), 4, {4, 5}),
                    Catch::Matchers::Contains("lengths[1] (5) must be in [0, 4]"));
  CHECK_THROWS_WITH(s.append(x.data(), x.data()),
                    Catch::Matchers::Contains("append before prefill"));
  KiviStream two_heads(cfg, 1, 2, 32);
  two_heads.prefill(x.data(), x.data(), 4);
  std::vector<float> q(3 * 32), o(q.size());
  CHECK_THROWS_WITH(two_heads.attend(q.data(), 3, o.data()),
                    Catch::Matchers::Contains("q_heads (3) must be a multiple of kv_heads (2)"));
  s.prefill(x.data(), x.data(), 4);
  CHECK_THROWS_WITH(s.prefill(x.data(), x.data(), 4),
                    Catch::Matchers::Contains("prefill called twice"));
}
