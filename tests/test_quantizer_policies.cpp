// KIVI and PM-KVQ through the registry and the cache-owning interface (docs/algorithms.md
// §5.1–5.2): the golden streams driven by make_cache_owning_policy() (KIVI: attention outputs and
// lengths under the golden README's rule; PM-KVQ: the body width, window and body after every
// update, and the dequantized cache against the golden codes dequantized here by the README's
// formula), the reference-exact / graceful switch at the fake case's MemoryError, memory against
// hand-computed byte counts, left pads, attention against an fp32 oracle, and error paths.
#include <cmath>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/quantizers/kivi_policy.hpp"
#include "kvsift/policy/quantizers/pmkvq_policy.hpp"
#include "kvsift/policy/registry.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

std::string golden(const std::string& name) {
  return std::string(KVSIFT_GOLDEN_DIR) + "/" + name + ".safetensors";
}

TensorView view(std::vector<float>& x, std::int64_t b, std::int64_t h, std::int64_t n,
                std::int64_t d) {  // [b, h, n, d] contiguous
  return TensorView::contiguous(x.data(), DType::f32, Device::cpu, {b, h, n, d});
}

// Token s of a [B, H, N, D] stream as a strided [B, H, 1, D] view (no copy).
TensorView token(std::vector<float>& x, std::int64_t B, std::int64_t H, std::int64_t N,
                 std::int64_t D, std::int64_t s) {
  TensorView v = TensorView::contiguous(x.data() + s * D, DType::f32, Device::cpu, {B, H, 1, D});
  v.stride = {H * N * D, N * D, D, 1};
  return v;
}

std::unique_ptr<QuantizingCachePolicy> make(const std::string& name, const nlohmann::json& cfg) {
  std::unique_ptr<CacheOwningPolicy> p = make_cache_owning_policy(name, cfg.dump());
  auto* q = dynamic_cast<QuantizingCachePolicy*>(p.get());
  REQUIRE(q != nullptr);
  p.release();
  return std::unique_ptr<QuantizingCachePolicy>(q);
}

float val(std::size_t i) { return std::sin(0.37f * static_cast<float>(i) + 0.11f); }

// KIVI bytes of one (sequence, KV head) from its four lengths (golden/README "Tensors"): int32
// words of b-bit codes, an fp16 scale and minimum per group, fp16 full-precision rows.
std::int64_t kivi_head_bytes(std::int64_t qk, std::int64_t fk, std::int64_t qv, std::int64_t fv,
                             int kb, int vb, int G, int D) {
  const auto words = [](std::int64_t codes, int bits) { return (codes * bits + 31) / 32; };
  return D * words(qk, kb) * 4 + D * (qk / G) * 4 + qv * (words(D, vb) * 4 + (D / G) * 4) +
         2 * D * (fk + fv);
}

}  // namespace

TEST_CASE("kivi through the registry reproduces every golden stream", "[quantizer_policy][kivi]") {
  for (const char* name : {"kivi_2bit_r128", "kivi_4bit_r32_gqa", "kivi_k2v4_const"}) {
    INFO(name);
    const SafetensorsFile f = SafetensorsFile::load(golden(name));
    const nlohmann::json c = nlohmann::json::parse(f.metadata().at("config"));
    const int B = c.at("batch"), H = c.at("kv_heads"), Hq = c.at("q_heads"), D = c.at("head_dim");
    const int T0 = c.at("prefill_len"), N = c.at("decode_steps");
    const int kb = c.at("k_bits"), vb = c.at("v_bits"), G = c.at("group_size");
    auto p = make("kivi", {{"batch", B},
                           {"num_layers", 1},
                           {"kv_heads", H},
                           {"q_heads", Hq},
                           {"head_dim", D},
                           {"k_bits", kb},
                           {"v_bits", vb},
                           {"group_size", G},
                           {"residual_length", c.at("residual_length")}});
    std::vector<float> pk = f.get("prefill_keys").to_f32(), pv = f.get("prefill_values").to_f32();
    std::vector<float> dk = f.get("decode_keys").to_f32(), dv = f.get("decode_values").to_f32();
    std::vector<float> queries = f.get("queries").to_f32();
    const std::vector<float> ref = f.get("attn_out").to_f32();
    const std::vector<std::int64_t> dumps = f.get("dump_steps").to_i64(),
                                    lengths = f.get("lengths").to_i64(),
                                    attn_steps = f.get("attn_steps").to_i64();
    const std::int64_t A = static_cast<std::int64_t>(attn_steps.size());
    p->prefill(0, view(pk, B, H, T0, D), view(pv, B, H, T0, D));
    std::size_t dump = 0, a = 0;
    long attn_bad = 0;
    std::int64_t events = 0;
    for (int s = 0; s <= N; ++s) {
      if (s > 0) {
        p->append(0, token(dk, B, H, N, D, s - 1), token(dv, B, H, N, D, s - 1));
        if (a < attn_steps.size() && attn_steps[a] == s) {
          std::vector<float> out(static_cast<std::size_t>(B * Hq * D));
          p->attention(0, token(queries, B, Hq, A, D, static_cast<std::int64_t>(a)),
                       view(out, B, Hq, 1, D));
          for (int b = 0; b < B; ++b)
            for (int h = 0; h < Hq; ++h)
              for (int d = 0; d < D; ++d) {
                const float r = ref[((static_cast<std::size_t>(b) * Hq + h) * A + a) * D + d];
                const float o = out[(static_cast<std::size_t>(b) * Hq + h) * D + d];
                if (!(std::fabs(double(o) - r) <= 4e-3 + 4e-3 * std::fabs(r))) ++attn_bad;
              }
          ++a;
        }
        CHECK_FALSE(p->end_step());  // KIVI evicts nothing
        events += p->last_step_quantized();
      }
      if (dump < dumps.size() && dumps[dump] == s) {
        INFO("step " << s);
        const std::int64_t* l = &lengths[dump * 4];
        std::int64_t bytes = 0;
        for (int b = 0; b < B; ++b)
          for (int h = 0; h < H; ++h) {
            const KiviLengths got = dynamic_cast<const KiviPolicy&>(*p).stream(0).lengths(b, h);
            CHECK((got.quantized_keys == l[0] && got.full_keys == l[1] &&
                   got.quantized_values == l[2] && got.full_values == l[3]));
            bytes += kivi_head_bytes(l[0], l[1], l[2], l[3], kb, vb, G, D);
          }
        CHECK(p->resident_bytes() == bytes);
        CHECK(p->resident_bytes(0) == bytes);
        CHECK(p->fullkv_fp16_bytes() == std::int64_t{B} * H * (T0 + s) * D * 2 * 2);
        ++dump;
      }
    }
    CHECK(attn_bad == 0);
    CHECK(a == attn_steps.size());
    CHECK(dump == dumps.size());
    // Key flushes: the buffer reaches R every R tokens after the prefill's remainder.
    const int R = c.at("residual_length");
    CHECK(events == (T0 % R + N) / R);
    CHECK(p->quantization_steps() == events);
    for (int b = 0; b < B; ++b) {
      const std::vector<std::int32_t> pos = p->resident_positions(0, b, H - 1);
      REQUIRE(pos.size() == static_cast<std::size_t>(T0 + N));
      CHECK((pos.front() == 0 && pos.back() == T0 + N - 1));
    }
  }
}

TEST_CASE("pmkvq through the registry follows the golden real stream",
          "[quantizer_policy][pmkvq]") {
  const SafetensorsFile f = SafetensorsFile::load(golden("pmkvq_real"));
  const nlohmann::json c = nlohmann::json::parse(f.metadata().at("config"));
  const int H = c.at("kv_heads"), D = c.at("head_dim"), P = c.at("prefill_len"),
            N = c.at("decode_steps"), W = c.at("n_window_token");
  auto p = make("pmkvq", {{"num_layers", 1},
                          {"kv_heads", H},
                          {"q_heads", H},
                          {"head_dim", D},
                          {"backend", "real"},
                          {"group_size", c.at("group_size")},
                          {"n_sink", c.at("n_sink_token")},
                          {"n_window", W},
                          {"n_init_bits", c.at("n_init_kv_bits")},
                          {"kv_budget_mb", {c.at("kv_budget_mb")}},
                          {"reference_exact", true}});
  auto* pm = dynamic_cast<PmkvqPolicy*>(p.get());
  REQUIRE(pm != nullptr);
  std::vector<float> pk = f.get("prefill_keys").to_f32(), pv = f.get("prefill_values").to_f32();
  std::vector<float> dk = f.get("decode_keys").to_f32(), dv = f.get("decode_values").to_f32();
  const auto nbits = f.get("real.nbits").to_i64(), n_window = f.get("real.n_window").to_i64(),
             n_body = f.get("real.n_body").to_i64();
  p->prefill(0, view(pk, 1, H, P, D), view(pv, 1, H, P, D));
  long bad = 0;
  std::int64_t events = 0, flushes = 0, halvings = 0;
  for (int u = 0; u <= N; ++u) {
    if (u > 0) {
      p->append(0, token(dk, 1, H, N, D, u - 1), token(dv, 1, H, N, D, u - 1));
      CHECK_FALSE(p->end_step());
      events += p->last_step_quantized();
      flushes += n_body[u] > n_body[u - 1];
      halvings += nbits[u] < nbits[u - 1];
    }
    const PmkvqStreamBase& s = pm->stream(0, 0);
    bad += s.n_bits() != nbits[u] || s.n_window() != n_window[u] || s.n_body() != n_body[u];
  }
  CHECK(bad == 0);
  // A quantization event: a window flush or a halving (the README's 57, 249, 537 each flush too
  // or not — counted once per step either way).
  CHECK(events >= flushes);
  CHECK(events <= flushes + halvings);
  CHECK(halvings == 3);
  // The keys attention reads: the golden codes dequantized by the README's formula,
  // x̂ = bf16(bf16(bf16(q)·s) − z), in [sink | body | window] order.
  const auto bf16 = [](float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); };
  for (int h = 0; h < H; ++h) {
    std::vector<float> expect;
    for (const char* seg : {"sink", "body", "window"}) {
      const std::string base = std::string("real.") + seg + "_k_";
      const auto& ct = f.get(base + "codes");
      const auto codes = ct.to_i64();
      const auto sc = f.get(base + "scales").to_f32(), ze = f.get(base + "zeros").to_f32();
      const std::int64_t n = ct.shape[2];
      for (std::int64_t t = 0; t < n; ++t)
        for (int d = 0; d < D; ++d) {
          const std::size_t g = static_cast<std::size_t>(h * n + t);
          expect.push_back(bf16(bf16(bf16(static_cast<float>(codes[g * D + d])) * sc[g]) - ze[g]));
        }
    }
    CHECK(p->dequantized_keys(0, 0, h) == expect);
  }
  // Memory: packed int16 words of codes plus one bf16 scale and zero per (token, head) group,
  // keys and values: sink 1 and window 31 at 16 bits (128 words), body 768 at 2 bits (16 words).
  const std::int64_t sink = 1, window = n_window[N], body = n_body[N];
  REQUIRE((window == 31 && body == 768 && nbits[N] == 2));
  CHECK(p->resident_bytes() ==
        2 * H * ((sink + window) * 128 * 2 + body * 16 * 2 + (sink + window + body) * 2 * 2));
  CHECK(p->fullkv_fp16_bytes() == std::int64_t{H} * (P + N) * D * 2 * 2);
  const std::vector<std::int32_t> pos = p->resident_positions(0, 0, 1);
  CHECK((pos.size() == static_cast<std::size_t>(P + N) && pos.back() == P + N - 1));
}

TEST_CASE("pmkvq: reference_exact raises where the reference does, graceful mode evicts",
          "[quantizer_policy][pmkvq]") {
  const SafetensorsFile f = SafetensorsFile::load(golden("pmkvq_fake"));
  const nlohmann::json c = nlohmann::json::parse(f.metadata().at("config"));
  const int H = c.at("kv_heads"), D = c.at("head_dim"), P = c.at("prefill_len"),
            N = c.at("decode_steps");
  const int error_step = static_cast<int>(f.get("fake.error_step").to_i64()[0]);
  REQUIRE(error_step == 596);
  const auto nbits = f.get("fake.nbits").to_i64();
  std::vector<float> pk = f.get("prefill_keys").to_f32(), pv = f.get("prefill_values").to_f32();
  std::vector<float> dk = f.get("decode_keys").to_f32(), dv = f.get("decode_values").to_f32();
  for (const bool exact : {true, false}) {
    INFO("reference_exact " << exact);
    auto p = make("pmkvq", {{"num_layers", 1},
                            {"kv_heads", H},
                            {"q_heads", H},
                            {"head_dim", D},
                            {"backend", "fake"},
                            {"group_size", c.at("group_size")},
                            {"n_sink", c.at("n_sink_token")},
                            {"n_window", c.at("n_window_token")},
                            {"n_init_bits", c.at("n_init_kv_bits")},
                            {"kv_budget_mb", {c.at("kv_budget_mb")}},
                            {"reference_exact", exact}});
    const auto& pm = dynamic_cast<const PmkvqPolicy&>(*p);
    p->prefill(0, view(pk, 1, H, P, D), view(pv, 1, H, P, D));
    bool evicted = false;
    for (int u = 1; u <= N; ++u) {
      p->append(0, token(dk, 1, H, N, D, u - 1), token(dv, 1, H, N, D, u - 1));
      if (exact && u == error_step) {
        REQUIRE_THROWS_WITH(p->end_step(), Contains("PM-KVQ layer 0") &&
                                               Contains("exceed the budget") &&
                                               Contains("at 2 bits"));
        break;
      }
      evicted = p->end_step() || evicted;
      if (exact) REQUIRE(pm.n_bits(0, 0) == nbits[u]);
    }
    if (exact) continue;
    // Graceful: every update succeeds, the layer fits its budget at 2 bits by evicting the oldest
    // body tokens; the sink and the newest tokens stay.
    CHECK(evicted);
    CHECK(pm.n_bits(0, 0) == 2);
    CHECK(pm.evicted_tokens() > 0);
    CHECK(static_cast<double>(p->resident_bytes()) <= 0.0625 * 1048576.0);
    const std::vector<std::int32_t> pos = p->resident_positions(0, 0, 0);
    CHECK(static_cast<std::int64_t>(pos.size()) == P + N - pm.evicted_tokens());
    CHECK((pos[0] == 0 && pos[1] == pm.evicted_tokens() + 1 && pos.back() == P + N - 1));
    CHECK(p->dequantized_keys(0, 0, 0).size() == pos.size() * D);
  }
}

TEST_CASE("quantizer attention is softmax attention over the stored tokens (fp32 oracle)",
          "[quantizer_policy]") {
  // 16-bit PM-KVQ with a budget nothing reaches and KIVI before its first flush (R = 64 > tokens,
  // every key full precision; values past R quantized: none) both store every token within
  // bf16 / fp16 rounding, so their attention equals the exact fp32 one within 1e-2.
  const int B = 2, H = 2, Hq = 4, D = 32, T = 20, steps = 6;
  for (const char* name : {"kivi", "pmkvq"}) {
    INFO(name);
    nlohmann::json cfg = {{"batch", B},    {"num_layers", 2}, {"kv_heads", H},
                          {"q_heads", Hq}, {"head_dim", D},   {"group_size", 16}};
    if (std::string(name) == "kivi") {
      cfg["residual_length"] = 64;
    } else {
      cfg["kv_budget_mb"] = {64.0};
      cfg["n_window"] = 8;
    }
    auto p = make(name, cfg);
    std::vector<float> keys(static_cast<std::size_t>(B * H * (T + steps) * D)), values(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = val(i), values[i] = val(7 * i + 3);
    std::vector<float> pk(static_cast<std::size_t>(B * H * T * D)), pv(pk.size());
    for (int bh = 0; bh < B * H; ++bh)
      for (int i = 0; i < T * D; ++i) {
        pk[bh * T * D + i] = keys[bh * (T + steps) * D + i];
        pv[bh * T * D + i] = values[bh * (T + steps) * D + i];
      }
    for (int l = 0; l < 2; ++l) p->prefill(l, view(pk, B, H, T, D), view(pv, B, H, T, D));
    for (int s = 0; s < steps; ++s) {
      std::vector<float> q(static_cast<std::size_t>(B * Hq * D)), out(q.size());
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = val(31 * i + s);
      for (int l = 0; l < 2; ++l) {
        p->append(l, token(keys, B, H, T + steps, D, T + s),
                  token(values, B, H, T + steps, D, T + s));
        p->attention(l, view(q, B, Hq, 1, D), view(out, B, Hq, 1, D));
      }
      const int n = T + s + 1;
      for (int b = 0; b < B; ++b)
        for (int hq = 0; hq < Hq; ++hq) {
          const float* kk = &keys[(b * H + hq / 2) * (T + steps) * D];
          const float* vv = &values[(b * H + hq / 2) * (T + steps) * D];
          const float* qq = &q[(b * Hq + hq) * D];
          std::vector<double> w(n);
          double mx = -1e300, z = 0;
          for (int t = 0; t < n; ++t) {
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += double(qq[d]) * kk[t * D + d];
            w[t] = dot / std::sqrt(double(D));
            mx = std::max(mx, w[t]);
          }
          for (double& x : w) z += (x = std::exp(x - mx));
          for (int d = 0; d < D; ++d) {
            double o = 0;
            for (int t = 0; t < n; ++t) o += w[t] * vv[t * D + d];
            REQUIRE(std::fabs(out[(b * Hq + hq) * D + d] - o / z) < 1e-2);
          }
        }
      p->end_step();
    }
  }
}

TEST_CASE("quantizers skip left pads observed before prefill", "[quantizer_policy]") {
  // Sequence 1 has 3 pads (garbage 1000s): it must equal a batch-1 policy fed only its real rows.
  const int H = 1, D = 32, T = 40, steps = 70;
  for (const char* name : {"kivi", "pmkvq"}) {
    INFO(name);
    nlohmann::json cfg = {
        {"num_layers", 1}, {"kv_heads", H}, {"q_heads", H}, {"head_dim", D}, {"group_size", 16}};
    if (std::string(name) == "kivi") {
      cfg["residual_length"] = 32;
    } else {
      cfg["kv_budget_mb"] = {0.004};
      cfg["n_window"] = 16;
    }
    auto one = make(name, cfg);
    cfg["batch"] = 2;
    auto two = make(name, cfg);
    std::vector<float> pk(static_cast<std::size_t>(2 * T * D)), pv(pk.size());
    for (std::size_t i = 0; i < pk.size(); ++i) pk[i] = val(i), pv[i] = val(5 * i + 2);
    for (int i = 0; i < 3 * D; ++i) pk[T * D + i] = pv[T * D + i] = 1000.0f;
    const std::int32_t pads[2] = {0, 3};
    Observation obs;
    obs.pad_counts = pads;
    two->observe(obs);
    two->prefill(0, view(pk, 2, H, T, D), view(pv, 2, H, T, D));
    std::vector<float> rk(pk.begin() + (T + 3) * D, pk.end()),
        rv(pv.begin() + (T + 3) * D, pv.end());
    one->prefill(0, view(rk, 1, H, T - 3, D), view(rv, 1, H, T - 3, D));
    for (int s = 0; s < steps; ++s) {
      std::vector<float> k(2 * D), v(2 * D), q(2 * D), o2(2 * D), o1(D);
      for (int i = 0; i < 2 * D; ++i)
        k[i] = val(s * 100 + i), v[i] = val(s * 77 + i), q[i] = val(s + 3 * i);
      two->append(0, view(k, 2, H, 1, D), view(v, 2, H, 1, D));
      one->append(0, TensorView::contiguous(k.data() + D, DType::f32, Device::cpu, {1, H, 1, D}),
                  TensorView::contiguous(v.data() + D, DType::f32, Device::cpu, {1, H, 1, D}));
      two->attention(0, view(q, 2, H, 1, D), view(o2, 2, H, 1, D));
      one->attention(0, TensorView::contiguous(q.data() + D, DType::f32, Device::cpu, {1, H, 1, D}),
                     view(o1, 1, H, 1, D));
      for (int d = 0; d < D; ++d) REQUIRE(o2[D + d] == o1[d]);
      two->end_step();
      one->end_step();
    }
    CHECK(two->dequantized_keys(0, 1, 0) == one->dequantized_keys(0, 0, 0));
    const std::vector<std::int32_t> p1 = two->resident_positions(0, 1, 0);
    const std::vector<std::int32_t> p0 = one->resident_positions(0, 0, 0);
    REQUIRE(p1.size() == p0.size());
    for (std::size_t i = 0; i < p0.size(); ++i) CHECK(p1[i] == p0[i] + 3);  // padded numbering
    CHECK(two->fullkv_fp16_bytes() == (2 * (T + steps) - 3) * H * D * 2 * 2);
    // A late pad is refused.
    obs.pad_counts = pads;
    REQUIRE_THROWS_WITH(two->observe(obs), Contains("pad_counts[1] = 3 after prefill()"));
  }
}

TEST_CASE("quantizer policies: hand-computed memory of a small stream", "[quantizer_policy]") {
  // KIVI-2, G = 16, R = 32, D = 32, 2 KV heads, batch 1, one layer: prompt 40, 30 steps → 70.
  // Keys: 64 quantized (flushes at the prefill's 32 and at 64), 6 full. Values: 38 quantized,
  // 32 full. Per head: keys 32 ch x 64 tok x 2 bit = 512 B codes + 32 ch x 4 groups x 4 B = 512
  // B params; values 38 x (32 x 2 bit = 8 B + 2 groups x 4 B) = 608 B; full 2 x 32 x (6 + 32) x 2
  // B ... = 64 x 38 = 2432 B. Total per head 4064 B; 2 heads 8128 B.
  auto kivi = make("kivi", {{"num_layers", 1},
                            {"kv_heads", 2},
                            {"q_heads", 2},
                            {"head_dim", 32},
                            {"group_size", 16},
                            {"residual_length", 32}});
  // PM-KVQ real, 16-bit, sink 1, window 16, budget large: 70 tokens = 1 sink + 64 body + 5 window
  // at 16 bits, G = 32: per token and head 32 codes = 32 words = 64 B + bf16 scale + zero 4 B,
  // keys and values: 70 x 2 heads x 2 x 68 = 19040 B.
  auto pmkvq = make("pmkvq", {{"num_layers", 1},
                              {"kv_heads", 2},
                              {"q_heads", 2},
                              {"head_dim", 32},
                              {"group_size", 32},
                              {"n_window", 16},
                              {"kv_budget_mb", {1.0}}});
  for (QuantizingCachePolicy* p : {kivi.get(), pmkvq.get()}) {
    std::vector<float> pk(2 * 40 * 32), pv(pk.size());
    for (std::size_t i = 0; i < pk.size(); ++i) pk[i] = val(i), pv[i] = val(3 * i);
    p->prefill(0, view(pk, 1, 2, 40, 32), view(pv, 1, 2, 40, 32));
    for (int s = 0; s < 30; ++s) {
      std::vector<float> k(64), v(64);
      for (int i = 0; i < 64; ++i) k[i] = val(s * 64 + i + 9), v[i] = val(s * 64 + i + 5);
      p->append(0, view(k, 1, 2, 1, 32), view(v, 1, 2, 1, 32));
      p->end_step();
    }
    CHECK(p->fullkv_fp16_bytes() == 70 * 2 * 2 * 32 * 2);
  }
  CHECK(kivi->resident_bytes() == 8128);
  CHECK(pmkvq->resident_bytes() == 19040);
  CHECK(kivi->quantization_steps() == 1);   // the flush at 64 (the one at 32 was the prefill's)
  CHECK(pmkvq->quantization_steps() == 2);  // window flushes at tokens 33 and 49 (+1 sink)
}

TEST_CASE("quantizer policies: misuse names the problem", "[quantizer_policy][errors]") {
  for (const char* name : {"kivi", "pmkvq"}) {
    INFO(name);
    nlohmann::json cfg = {
        {"num_layers", 2}, {"kv_heads", 1}, {"q_heads", 2}, {"head_dim", 16}, {"group_size", 16}};
    if (std::string(name) == "kivi") {
      cfg["residual_length"] = 16;
    } else {
      cfg["kv_budget_mb"] = {1.0};
    }
    auto p = make(name, cfg);
    std::vector<float> k(16, 0.5f), q(32, 0.1f), out(32);
    REQUIRE_THROWS_WITH(p->append(0, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16)),
                        Contains("layer 0 was not prefilled"));
    REQUIRE_THROWS_WITH(p->prefill(2, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16)),
                        Contains("layer 2 outside [0, num_layers = 2)"));
    for (int l = 0; l < 2; ++l) p->prefill(l, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16));
    REQUIRE_THROWS_WITH(p->prefill(0, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16)),
                        Contains("layer 0 was already prefilled"));
    p->append(0, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16));
    REQUIRE_THROWS_WITH(p->append(0, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16)),
                        Contains("layer 0 already appended this step"));
    REQUIRE_THROWS_WITH(p->end_step(), Contains("some layers were not appended"));
    REQUIRE_THROWS_WITH(p->attention(0, view(q, 1, 1, 1, 32), view(out, 1, 2, 1, 16)),
                        Contains("queries is [1, 1, 1, 32]") && Contains("head_dim = 16"));
    REQUIRE_THROWS_WITH(p->resident_positions(0, 1, 0), Contains("sequence 1"));
    // Non-finite inputs (KIVI: also beyond fp16's range) are refused, naming the element.
    p->append(1, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16));
    p->end_step();
    k[5] = std::string(name) == "kivi" ? 1e6f : INFINITY;
    REQUIRE_THROWS_WITH(p->append(0, view(k, 1, 1, 1, 16), view(k, 1, 1, 1, 16)),
                        Contains("keys[0, 0, 0, 5]") && Contains("is not finite"));
  }
}
