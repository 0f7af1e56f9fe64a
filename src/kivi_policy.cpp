// KiviPolicy: batched engine tensors in, one KiviStream per layer (docs/algorithms.md §5.1).
#include "kvsift/policy/quantizers/kivi_policy.hpp"

namespace kvsift {

namespace {
constexpr const char* kWho = "KiviPolicy";
}  // namespace

KiviPolicy::KiviPolicy(const KiviPolicyConfig& cfg)
    : cfg_(quantizer_detail::validated(cfg)), ledger_(cfg_.num_layers, kWho) {
  for (int l = 0; l < cfg_.num_layers; ++l)
    layers_.emplace_back(cfg_.kivi, static_cast<int>(cfg_.batch), cfg_.kv_heads, cfg_.head_dim);
  pads_.assign(static_cast<std::size_t>(cfg_.batch), 0);
}

std::size_t KiviPolicy::layer_index(int layer, const char* who) const {
  KVSIFT_CHECK(layer >= 0 && layer < cfg_.num_layers, kWho, "::", who, ": layer ", layer,
               " outside [0, num_layers = ", cfg_.num_layers, ")");
  return static_cast<std::size_t>(layer);
}

const KiviStream& KiviPolicy::stream(int layer) const {
  return layers_[layer_index(layer, "stream")];
}

void KiviPolicy::prefill(int layer, const TensorView& keys, const TensorView& values) {
  const std::size_t l = layer_index(layer, "prefill");
  KVSIFT_CHECK(keys.rank == 4 && values.rank == 4 && keys.shape == values.shape, kWho,
               "::prefill: keys ", keys.shape_string(), " and values ", values.shape_string(),
               " must be the same [batch, kv_heads, n, head_dim]");
  const std::vector<float> k = quantizer_detail::gather(keys, cfg_.batch, cfg_.kv_heads, -1,
                                                        cfg_.head_dim, DType::f16, kWho, "keys");
  const std::vector<float> v = quantizer_detail::gather(values, cfg_.batch, cfg_.kv_heads, -1,
                                                        cfg_.head_dim, DType::f16, kWho, "values");
  ledger_.check_prefill(l);
  const std::int64_t n = keys.shape[2];
  std::vector<std::int64_t> lengths(pads_.size());
  for (std::size_t b = 0; b < pads_.size(); ++b) {
    KVSIFT_CHECK(pads_[b] <= n, kWho, "::prefill: pad_counts[", b, "] (", pads_[b],
                 ") exceeds the prompt's ", n, " tokens");
    lengths[b] = n - pads_[b];
  }
  layers_[l].prefill(k.data(), v.data(), n, lengths);
  ledger_.mark_prefilled(l);
}

void KiviPolicy::append(int layer, const TensorView& keys, const TensorView& values) {
  const std::size_t l = layer_index(layer, "append");
  const std::vector<float> k = quantizer_detail::gather(keys, cfg_.batch, cfg_.kv_heads, 1,
                                                        cfg_.head_dim, DType::f16, kWho, "keys");
  const std::vector<float> v = quantizer_detail::gather(values, cfg_.batch, cfg_.kv_heads, 1,
                                                        cfg_.head_dim, DType::f16, kWho, "values");
  ledger_.check_append(l);
  layers_[l].append(k.data(), v.data());
  ledger_.mark_appended(l);
}

void KiviPolicy::observe(const Observation& obs) {
  quantizer_detail::observe_pads(obs, ledger_.any_prefilled(), pads_, kWho);
}

bool KiviPolicy::end_step() {
  last_quantized_ = false;
  if (!ledger_.step_complete()) return false;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    KiviStream& s = layers_[l];
    std::int64_t before = 0, after = 0;
    for (int b = 0; b < s.batch(); ++b)
      for (int h = 0; h < s.kv_heads(); ++h) before += s.lengths(b, h).quantized_keys;
    s.after_attention();
    for (int b = 0; b < s.batch(); ++b)
      for (int h = 0; h < s.kv_heads(); ++h) after += s.lengths(b, h).quantized_keys;
    last_quantized_ = last_quantized_ || after > before;
  }
  ledger_.close_step();
  quantization_steps_ += last_quantized_;
  return false;
}

void KiviPolicy::attention(int layer, const TensorView& queries, const TensorView& out) const {
  quantizer_detail::check_out(out, cfg_.batch, cfg_.q_heads, cfg_.head_dim, kWho);
  const std::size_t l = layer_index(layer, "attention");
  const std::vector<float> q = quantizer_detail::gather(queries, cfg_.batch, cfg_.q_heads, 1,
                                                        cfg_.head_dim, DType::f32, kWho, "queries");
  std::vector<float> o(q.size());
  layers_[l].attend(q.data(), cfg_.q_heads, o.data());
  std::size_t i = 0;
  for (std::int64_t b = 0; b < cfg_.batch; ++b)
    for (std::int64_t h = 0; h < cfg_.q_heads; ++h)
      for (std::int64_t d = 0; d < cfg_.head_dim; ++d) *out.ptr<float>(b, h, 0, d) = o[i++];
}

std::int64_t KiviPolicy::resident_bytes(int layer) const {
  return layers_[layer_index(layer, "resident_bytes")].bytes();
}

std::int64_t KiviPolicy::resident_bytes() const {
  std::int64_t bytes = 0;
  for (const KiviStream& s : layers_) bytes += s.bytes();
  return bytes;
}

std::int64_t KiviPolicy::tokens(std::size_t layer, std::int64_t seq) const {
  const KiviLengths n = layers_[layer].lengths(static_cast<int>(seq), 0);
  return n.quantized_keys + n.full_keys;
}

std::int64_t KiviPolicy::fullkv_fp16_bytes() const {
  std::int64_t tok = 0;
  for (std::size_t l = 0; l < layers_.size(); ++l)
    for (std::int64_t b = 0; b < cfg_.batch; ++b) tok += tokens(l, b);
  return tok * 2 * cfg_.kv_heads * cfg_.head_dim * 2;  // K and V, 2 bytes each
}

std::vector<std::int32_t> KiviPolicy::resident_positions(int layer, std::int64_t seq,
                                                         std::int64_t kv_head) const {
  const std::size_t l = layer_index(layer, "resident_positions");
  KVSIFT_CHECK(seq >= 0 && seq < cfg_.batch && kv_head >= 0 && kv_head < cfg_.kv_heads, kWho,
               "::resident_positions: (sequence ", seq, ", KV head ", kv_head,
               ") outside [batch = ", cfg_.batch, ", kv_heads = ", cfg_.kv_heads, ")");
  const std::int64_t first = pads_[static_cast<std::size_t>(seq)], n = tokens(l, seq);
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<std::int32_t>(first + i);
  return p;
}

std::vector<float> KiviPolicy::dequantized_keys(int layer, std::int64_t seq,
                                                std::int64_t kv_head) const {
  const KiviStream& s = layers_[layer_index(layer, "dequantized_keys")];
  return s.dequantized_keys(s.head(static_cast<int>(seq), static_cast<int>(kv_head)));
}

}  // namespace kvsift
