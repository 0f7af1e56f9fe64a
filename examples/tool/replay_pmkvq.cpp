// `kvsift replay` for PM-KVQ cases (docs/algorithms.md §5.2; golden README "PM-KVQ"): runs the
// prefill and every decode step through PmkvqRealStream or PmkvqFakeStream and writes the README's
// `real.*` or `fake.*` tensors. Config keys as the README lists them; `reference_exact` (default
// true: the cases record the reference) and `kv_budget_mb` as one number or one per layer
// (a case is one layer: the first budget applies).
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "kvsift/config/pmkvq_config.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/json_number.hpp"
#include "kvsift/policy/quantizers/pmkvq_stream.hpp"
#include "replay.hpp"

namespace kvsift::tool {
namespace {

void put_i32(SafetensorsFile& f, const std::string& name, std::vector<std::int64_t> shape,
             const std::vector<std::int32_t>& v) {
  StTensor t;
  t.dtype = StDType::i32;
  t.shape = std::move(shape);
  t.bytes.resize(v.size() * sizeof(std::int32_t));
  std::memcpy(t.bytes.data(), v.data(), t.bytes.size());  // little-endian host (as the writer)
  f.put(name, std::move(t));
}

std::string at_prefix(const std::string& backend, std::int64_t update) {
  std::string n = std::to_string(update);
  while (n.size() < 3) n = "0" + n;
  return backend + ".at" + n + ".";
}

PmkvqConfig parse_config(const nlohmann::json& c, const std::string& what) {
  auto key = [&](const char* k) -> const nlohmann::json& {
    KVSIFT_CHECK(c.contains(k), what, ": missing config key '", k, "'");
    return c.at(k);
  };
  auto name = [&](const char* k) { return what + ": config key '" + k + "'"; };
  PmkvqConfig cfg;
  KVSIFT_CHECK(key("backend").is_string(), name("backend"), " must be \"real\" or \"fake\"");
  const std::string backend = key("backend").get<std::string>();
  KVSIFT_CHECK(backend == "real" || backend == "fake", name("backend"),
               " must be \"real\" or \"fake\", got \"", backend, "\"");
  cfg.backend = backend == "real" ? PmkvqBackend::real : PmkvqBackend::fake;
  cfg.kv_heads = json_integer<std::int64_t>(key("kv_heads"), name("kv_heads"), 1, 1 << 16);
  cfg.head_dim = json_integer<std::int64_t>(key("head_dim"), name("head_dim"), 1, 1 << 16);
  cfg.group_size = json_integer<std::int64_t>(key("group_size"), name("group_size"), 1, 1 << 16);
  cfg.n_sink = json_integer<std::int64_t>(key("n_sink_token"), name("n_sink_token"), 0, 1 << 20);
  cfg.n_window =
      json_integer<std::int64_t>(key("n_window_token"), name("n_window_token"), 1, 1 << 20);
  cfg.n_init_bits = json_integer<int>(key("n_init_kv_bits"), name("n_init_kv_bits"), 2, 16);
  KVSIFT_CHECK(pmkvq::is_valid_bits(cfg.n_init_bits), name("n_init_kv_bits"),
               " must be 16, 8, 4 or 2, got ", cfg.n_init_bits);
  for (const char* k : {"n_sink_token_bits", "n_window_token_bits"})
    if (c.contains(k))
      KVSIFT_CHECK(json_integer<int>(c.at(k), name(k)) == 16, name(k),
                   " must be 16 (sinks and window are kept at 16 bits), got ", c.at(k).dump());
  const nlohmann::json& b = key("kv_budget_mb");
  if (b.is_array()) {
    for (std::size_t i = 0; i < b.size(); ++i)
      cfg.kv_budget_mb.push_back(
          json_real(b[i], name("kv_budget_mb") + "[" + std::to_string(i) + "]", 0));
  } else {
    cfg.kv_budget_mb = {json_real(b, name("kv_budget_mb"), 0)};
  }
  cfg.reference_exact = true;
  if (c.contains("reference_exact")) {
    KVSIFT_CHECK(c.at("reference_exact").is_boolean(), name("reference_exact"),
                 " must be true or false, got ", c.at("reference_exact").dump());
    cfg.reference_exact = c.at("reference_exact").get<bool>();
  }
  cfg.validate();
  return cfg;
}

// [tokens, H, inner] token-major → [H, tokens, inner].
template <class Out, class In>
std::vector<Out> head_major(const std::vector<In>& x, std::int64_t tokens, std::int64_t H,
                            std::int64_t inner) {
  std::vector<Out> out(x.size());
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < inner; ++i)
        out[static_cast<std::size_t>((h * tokens + t) * inner + i)] =
            static_cast<Out>(x[static_cast<std::size_t>((t * H + h) * inner + i)]);
  return out;
}

// codes U8 when the width is ≤ 8 bits, else I32 (0…65535); scales and zeros F32.
void put_segment(SafetensorsFile& f, const std::string& prefix, const PmkvqRealStream::Segment& s,
                 int bits, const PmkvqConfig& cfg) {
  const std::int64_t H = cfg.kv_heads, D = cfg.head_dim, G = cfg.head_dim / cfg.group_size;
  const std::vector<std::int64_t> shape{1, H, s.tokens, D}, pshape{1, H, s.tokens, G};
  if (bits <= 8) {
    const auto c = head_major<std::uint8_t>(s.codes, s.tokens, H, D);
    f.put_u8(prefix + "_codes", shape, c.data());
  } else {
    put_i32(f, prefix + "_codes", shape, head_major<std::int32_t>(s.codes, s.tokens, H, D));
  }
  f.put_f32(prefix + "_scales", pshape, head_major<float>(s.scales, s.tokens, H, G).data());
  f.put_f32(prefix + "_zeros", pshape, head_major<float>(s.zeros, s.tokens, H, G).data());
}

std::vector<std::int64_t> dumps_of(const nlohmann::json& c, const std::string& backend,
                                   const std::string& what) {
  std::vector<std::int64_t> d;
  if (c.contains(backend) && c.at(backend).is_object() && c.at(backend).contains("dumps")) {
    const nlohmann::json& a = c.at(backend).at("dumps");
    KVSIFT_CHECK(a.is_array(), what, ": config key '", backend, ".dumps' must be an array");
    for (const auto& v : a) d.push_back(json_integer<std::int64_t>(v, backend + ".dumps", 0));
  }
  return d;
}

template <class Stream>
SafetensorsFile run(const SafetensorsFile& in, const nlohmann::json& c, const PmkvqConfig& cfg,
                    const std::string& what) {
  const bool real = cfg.backend == PmkvqBackend::real;
  const std::string be = real ? "real" : "fake";
  const std::int64_t H = cfg.kv_heads, D = cfg.head_dim;
  const StTensor& pkt = in.get("prefill_keys", {1, H, -1, D});
  const StTensor& dkt = in.get("decode_keys", {1, H, -1, D});
  const std::int64_t P = pkt.shape[2], N = dkt.shape[2];
  KVSIFT_CHECK(P > 0, what, ": prefill_keys holds no tokens");
  const std::vector<float> pk = pkt.to_f32(), pv = in.get("prefill_values", pkt.shape).to_f32();
  const std::vector<float> dk = dkt.to_f32(), dv = in.get("decode_values", dkt.shape).to_f32();
  const std::vector<std::int64_t> dumps = dumps_of(c, be, what);

  Stream s(cfg, 0);
  SafetensorsFile out;
  out.metadata()["config"] = c.dump();
  std::vector<std::int32_t> nbits, nwin, nbody;
  std::vector<std::int64_t> mem;
  std::int32_t error_step = -1;
  for (std::int64_t i = 0; i <= N; ++i) {
    PmkvqUpdateResult r;
    try {
      r = i == 0 ? s.update(pk.data(), pv.data(), P, P)
                 : s.update(dk.data() + (i - 1) * D, dv.data() + (i - 1) * D, 1, N);
    } catch (const PmkvqBudgetError&) {
      error_step = static_cast<std::int32_t>(i);
      break;
    }
    // Library mode degrades instead of raising; the README still wants the overrun reported
    // where the reference would have raised (over budget at 2 bits or with an empty body).
    if (r.reference_would_raise && error_step < 0) error_step = static_cast<std::int32_t>(i);
    nbits.push_back(r.n_bits);
    mem.push_back(r.mem_bytes);
    nwin.push_back(static_cast<std::int32_t>(s.n_window()));
    nbody.push_back(static_cast<std::int32_t>(s.n_body()));
    bool dump = false;
    for (std::int64_t d : dumps) dump = dump || d == i;
    if (!dump) continue;
    const std::string at = at_prefix(be, i);
    if constexpr (std::is_same_v<Stream, PmkvqRealStream>) {
      put_segment(out, at + "body_k", s.body(0), s.n_bits(), cfg);
      put_segment(out, at + "body_v", s.body(1), s.n_bits(), cfg);
    } else {
      const std::int64_t T = s.tokens();
      out.put_f32(at + "keys", {1, H, T, D}, head_major<float>(s.keys(), T, H, D).data());
      out.put_f32(at + "values", {1, H, T, D}, head_major<float>(s.values(), T, H, D).data());
      put_i32(out, at + "nbits_pos", {T},
              std::vector<std::int32_t>(s.nbits_pos().begin(), s.nbits_pos().end()));
    }
  }
  const std::int64_t U = static_cast<std::int64_t>(nbits.size());
  put_i32(out, be + ".nbits", {U}, nbits);
  out.put_i64(be + ".mem_bytes", {U}, mem.data());
  put_i32(out, be + ".error_step", {1}, {error_step});
  if constexpr (std::is_same_v<Stream, PmkvqRealStream>) {
    put_i32(out, be + ".n_window", {U}, nwin);
    put_i32(out, be + ".n_body", {U}, nbody);
    put_segment(out, be + ".sink_k", s.sink(0), 16, cfg);
    put_segment(out, be + ".sink_v", s.sink(1), 16, cfg);
    put_segment(out, be + ".body_k", s.body(0), s.n_bits(), cfg);
    put_segment(out, be + ".body_v", s.body(1), s.n_bits(), cfg);
    put_segment(out, be + ".window_k", s.window(0), 16, cfg);
    put_segment(out, be + ".window_v", s.window(1), 16, cfg);
  } else {
    const std::int64_t T = s.tokens();
    out.put_f32(be + ".keys", {1, H, T, D}, head_major<float>(s.keys(), T, H, D).data());
    out.put_f32(be + ".values", {1, H, T, D}, head_major<float>(s.values(), T, H, D).data());
    put_i32(out, be + ".nbits_pos", {T},
            std::vector<std::int32_t>(s.nbits_pos().begin(), s.nbits_pos().end()));
  }
  return out;
}

}  // namespace

SafetensorsFile replay_pmkvq(const SafetensorsFile& in, const std::string& what) {
  const auto it = in.metadata().find("config");
  KVSIFT_CHECK(it != in.metadata().end(), what, ": missing metadata 'config'");
  const nlohmann::json c = nlohmann::json::parse(it->second);
  KVSIFT_CHECK(!c.contains("kind") || c.at("kind") == "stream", what, ": config key 'kind' is ",
               c.contains("kind") ? c.at("kind").dump() : "",
               ", not a stream case (replay runs "
               "streams: a prefill, then decode steps)");
  const PmkvqConfig cfg = parse_config(c, what);
  return cfg.backend == PmkvqBackend::real ? run<PmkvqRealStream>(in, c, cfg, what)
                                           : run<PmkvqFakeStream>(in, c, cfg, what);
}

SafetensorsFile replay_pmkvq(const SafetensorsFile& in) { return replay_pmkvq(in, "case"); }

}  // namespace kvsift::tool
