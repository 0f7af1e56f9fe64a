// PmkvqPolicy: batched engine tensors in, one PM-KVQ stream per (layer, sequence)
// (docs/algorithms.md §5.2).
#include "kvsift/policy/quantizers/pmkvq_policy.hpp"

#include "kvsift/backend/cpu/dense_attention.hpp"
#include "kvsift/quant/pmkvq_codec.hpp"

namespace kvsift {

namespace {
constexpr const char* kWho = "PmkvqPolicy";
}  // namespace

PmkvqPolicy::PmkvqPolicy(const PmkvqPolicyConfig& cfg)
    : cfg_(quantizer_detail::validated(cfg)), ledger_(cfg_.num_layers, kWho) {
  const PmkvqConfig& p = cfg_.pmkvq;
  for (int l = 0; l < cfg_.num_layers; ++l)
    for (std::int64_t b = 0; b < cfg_.batch; ++b) {
      if (real()) {
        real_.push_back(std::make_unique<PmkvqRealStream>(p, l));
      } else {
        fake_.push_back(std::make_unique<PmkvqFakeStream>(p, l));
      }
    }
  const std::size_t streams = static_cast<std::size_t>(cfg_.num_layers * cfg_.batch);
  fed_.assign(streams, 0);
  pending_k_.assign(streams * static_cast<std::size_t>(p.kv_heads * p.head_dim), 0.0f);
  pending_v_ = pending_k_;
  pads_.assign(static_cast<std::size_t>(cfg_.batch), 0);
}

std::size_t PmkvqPolicy::index(int layer, std::int64_t seq, const char* who) const {
  KVSIFT_CHECK(layer >= 0 && layer < cfg_.num_layers, kWho, "::", who, ": layer ", layer,
               " outside [0, num_layers = ", cfg_.num_layers, ")");
  KVSIFT_CHECK(seq >= 0 && seq < cfg_.batch, kWho, "::", who, ": sequence ", seq,
               " outside [0, batch = ", cfg_.batch, ")");
  return static_cast<std::size_t>(layer * cfg_.batch + seq);
}

const PmkvqStreamBase& PmkvqPolicy::stream(int layer, std::int64_t seq) const {
  const std::size_t i = index(layer, seq, "stream");
  if (real()) return *real_[i];
  return *fake_[i];
}

PmkvqUpdateResult PmkvqPolicy::update(std::size_t i, const float* keys, const float* values,
                                      std::int64_t u, std::int64_t src_seq) {
  return real() ? real_[i]->update(keys, values, u, src_seq)
                : fake_[i]->update(keys, values, u, src_seq);
}

void PmkvqPolicy::prefill(int layer, const TensorView& keys, const TensorView& values) {
  const std::size_t first = index(layer, 0, "prefill");
  const std::int64_t H = cfg_.pmkvq.kv_heads, D = cfg_.pmkvq.head_dim;
  KVSIFT_CHECK(keys.rank == 4 && values.rank == 4 && keys.shape == values.shape, kWho,
               "::prefill: keys ", keys.shape_string(), " and values ", values.shape_string(),
               " must be the same [batch, kv_heads, n, head_dim]");
  const std::vector<float> k =
      quantizer_detail::gather(keys, cfg_.batch, H, -1, D, storage(), kWho, "keys");
  const std::vector<float> v =
      quantizer_detail::gather(values, cfg_.batch, H, -1, D, storage(), kWho, "values");
  ledger_.check_prefill(static_cast<std::size_t>(layer));
  const std::int64_t n = keys.shape[2];
  for (std::int64_t b = 0; b < cfg_.batch; ++b) {
    const std::int64_t pad = pads_[static_cast<std::size_t>(b)];
    KVSIFT_CHECK(pad <= n, kWho, "::prefill: pad_counts[", b, "] (", pad, ") exceeds the prompt's ",
                 n, " tokens");
    if (n - pad == 0) continue;  // an empty prompt: the first decode token is update 0
    // Sequence b's real rows start at (b, 0, pad); heads are n rows apart (src_seq = n).
    const std::size_t at = static_cast<std::size_t>((b * H * n + pad) * D);
    const PmkvqUpdateResult r = update(first + b, k.data() + at, v.data() + at, n - pad, n);
    evicted_ += r.evicted;
    fed_[first + b] = n - pad;
  }
  ledger_.mark_prefilled(static_cast<std::size_t>(layer));
}

void PmkvqPolicy::append(int layer, const TensorView& keys, const TensorView& values) {
  const std::int64_t H = cfg_.pmkvq.kv_heads, D = cfg_.pmkvq.head_dim;
  const std::vector<float> k =
      quantizer_detail::gather(keys, cfg_.batch, H, 1, D, storage(), kWho, "keys");
  const std::vector<float> v =
      quantizer_detail::gather(values, cfg_.batch, H, 1, D, storage(), kWho, "values");
  const std::size_t first = index(layer, 0, "append");
  const std::size_t l = static_cast<std::size_t>(layer);
  ledger_.check_append(l);
  const std::size_t row = static_cast<std::size_t>(H * D);
  std::copy(k.begin(), k.begin() + cfg_.batch * row, pending_k_.begin() + first * row);
  std::copy(v.begin(), v.begin() + cfg_.batch * row, pending_v_.begin() + first * row);
  for (std::int64_t b = 0; b < cfg_.batch; ++b) ++fed_[first + b];
  ledger_.mark_appended(l);
}

void PmkvqPolicy::observe(const Observation& obs) {
  quantizer_detail::observe_pads(obs, ledger_.any_prefilled(), pads_, kWho);
}

bool PmkvqPolicy::end_step() {
  last_quantized_ = false;
  if (!ledger_.step_complete()) return false;
  const std::size_t row = static_cast<std::size_t>(cfg_.pmkvq.kv_heads * cfg_.pmkvq.head_dim);
  bool evicted = false;
  for (std::size_t i = 0; i < fed_.size(); ++i) {
    const std::int64_t body = real() ? real_[i]->n_body() : fake_[i]->n_body();
    // The pending token: [kv_heads, 1, head_dim], src_seq 1.
    const PmkvqUpdateResult r =
        update(i, pending_k_.data() + i * row, pending_v_.data() + i * row, 1, 1);
    const std::int64_t body_after = real() ? real_[i]->n_body() : fake_[i]->n_body();
    last_quantized_ = last_quantized_ || r.halvings > 0 || body_after + r.evicted > body;
    evicted = evicted || r.evicted > 0;
    evicted_ += r.evicted;
  }
  ledger_.close_step();
  quantization_steps_ += last_quantized_;
  return evicted;
}

std::vector<float> PmkvqPolicy::rows(std::size_t i, std::int64_t kv_head, int kv) const {
  const std::int64_t H = cfg_.pmkvq.kv_heads, D = cfg_.pmkvq.head_dim;
  const std::int64_t G = cfg_.pmkvq.group_size, groups = D / G;
  const std::size_t layer = i / static_cast<std::size_t>(cfg_.batch);
  const std::int64_t pending = ledger_.appended(layer) ? 1 : 0;
  std::vector<float> out;
  if (real()) {  // [sink | body | window], x̂ = bf16(bf16(bf16(q)·s) − z)
    const PmkvqRealStream& s = *real_[i];
    out.resize(static_cast<std::size_t>((s.tokens() + pending) * D));
    float* o = out.data();
    for (const PmkvqRealStream::Segment* seg : {&s.sink(kv), &s.body(kv), &s.window(kv)})
      for (std::int64_t t = 0; t < seg->tokens; ++t)
        for (std::int64_t g = 0; g < groups; ++g) {
          const std::size_t p = static_cast<std::size_t>((t * H + kv_head) * groups + g);
          const GroupParams gp{seg->scales[p], seg->zeros[p]};
          const std::uint16_t* q = seg->codes.data() + (t * H + kv_head) * D + g * G;
          for (std::int64_t d = 0; d < G; ++d) *o++ = pmkvq::dequantize_bf16(q[d], gp);
        }
    out.resize(static_cast<std::size_t>(s.tokens() * D));
  } else {  // the fake cache already holds the dequantized values, [tokens, H, D]
    const std::vector<float>& c = kv == 0 ? fake_[i]->keys() : fake_[i]->values();
    const std::int64_t n = fake_[i]->tokens();
    for (std::int64_t t = 0; t < n; ++t)
      out.insert(out.end(), c.begin() + (t * H + kv_head) * D,
                 c.begin() + (t * H + kv_head + 1) * D);
  }
  if (pending) {  // the step's own token, full precision
    const std::vector<float>& p = kv == 0 ? pending_k_ : pending_v_;
    const auto at = p.begin() + static_cast<std::ptrdiff_t>((i * H + kv_head) * D);
    out.insert(out.end(), at, at + D);
  }
  return out;
}

void PmkvqPolicy::attention(int layer, const TensorView& queries, const TensorView& out) const {
  const std::int64_t H = cfg_.pmkvq.kv_heads, D = cfg_.pmkvq.head_dim;
  quantizer_detail::check_out(out, cfg_.batch, cfg_.q_heads, D, kWho);
  const std::size_t first = index(layer, 0, "attention");
  const std::vector<float> q = quantizer_detail::gather(queries, cfg_.batch, cfg_.q_heads, 1, D,
                                                        DType::f32, kWho, "queries");
  const std::int64_t group = cfg_.q_heads / H;
  std::vector<float> o(static_cast<std::size_t>(group * D));
  for (std::int64_t b = 0; b < cfg_.batch; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::vector<float> K = rows(first + b, h, 0), V = rows(first + b, h, 1);
      dense_decode_attention(q.data() + (b * cfg_.q_heads + h * group) * D, group, K.data(),
                             V.data(), static_cast<std::int64_t>(K.size()) / D, D, o.data());
      for (std::int64_t g = 0; g < group; ++g)
        for (std::int64_t d = 0; d < D; ++d)
          *out.ptr<float>(b, h * group + g, 0, d) = o[static_cast<std::size_t>(g * D + d)];
    }
}

std::int64_t PmkvqPolicy::resident_bytes(int layer) const {
  const std::size_t first = index(layer, 0, "resident_bytes");
  std::int64_t bytes = 0;
  for (std::int64_t b = 0; b < cfg_.batch; ++b) {
    const std::size_t i = first + b;
    bytes += real() ? real_[i]->storage_bytes() : fake_[i]->storage_bytes();
  }
  if (ledger_.appended(static_cast<std::size_t>(layer)))  // pending K and V at 16 bits
    bytes += cfg_.batch * 2 * cfg_.pmkvq.kv_heads * cfg_.pmkvq.head_dim * 2;
  return bytes;
}

std::int64_t PmkvqPolicy::resident_bytes() const {
  std::int64_t bytes = 0;
  for (int l = 0; l < cfg_.num_layers; ++l) bytes += resident_bytes(l);
  return bytes;
}

std::int64_t PmkvqPolicy::fullkv_fp16_bytes() const {
  std::int64_t tokens = 0;
  for (std::int64_t n : fed_) tokens += n;
  return tokens * 2 * cfg_.pmkvq.kv_heads * cfg_.pmkvq.head_dim * 2;  // K and V, 2 bytes each
}

std::vector<std::int32_t> PmkvqPolicy::resident_positions(int layer, std::int64_t seq,
                                                          std::int64_t kv_head) const {
  const std::size_t i = index(layer, seq, "resident_positions");
  KVSIFT_CHECK(kv_head >= 0 && kv_head < cfg_.pmkvq.kv_heads, kWho,
               "::resident_positions: KV head ", kv_head,
               " outside [0, kv_heads = ", cfg_.pmkvq.kv_heads, ")");
  const PmkvqStreamBase& s = stream(layer, seq);
  const std::int64_t pad = pads_[static_cast<std::size_t>(seq)], fed = fed_[i];
  const std::int64_t pending = ledger_.appended(static_cast<std::size_t>(layer)) ? 1 : 0;
  // Sinks first; evicted body tokens (graceful mode) are always the oldest after the sinks.
  const std::int64_t rest = s.n_body() + s.n_window() + pending;
  std::vector<std::int32_t> p;
  for (std::int64_t t = 0; t < s.n_sink(); ++t) p.push_back(static_cast<std::int32_t>(pad + t));
  for (std::int64_t t = fed - rest; t < fed; ++t) p.push_back(static_cast<std::int32_t>(pad + t));
  return p;
}

std::vector<float> PmkvqPolicy::dequantized_keys(int layer, std::int64_t seq,
                                                 std::int64_t kv_head) const {
  const std::size_t i = index(layer, seq, "dequantized_keys");
  KVSIFT_CHECK(kv_head >= 0 && kv_head < cfg_.pmkvq.kv_heads, kWho, "::dequantized_keys: KV head ",
               kv_head, " outside [0, kv_heads = ", cfg_.pmkvq.kv_heads, ")");
  return rows(i, kv_head, 0);
}

}  // namespace kvsift
