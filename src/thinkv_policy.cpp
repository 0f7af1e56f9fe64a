// ThinKVPolicy: batched engine tensors in, one ThinKV pipeline per sequence.
#include "kvsift/policy/thinkv/thinkv_policy.hpp"

#include "kvsift/backend/device_backend.hpp"

namespace kvsift {

ThinKVPolicy::ThinKVPolicy(const ThinKVPolicyConfig& cfg) : cfg_(cfg) {
  cfg_.validate();
  for (std::int64_t b = 0; b < cfg_.batch; ++b)
    seqs_.push_back(std::make_unique<ThinKV>(cfg_.pipeline));
}

const float* ThinKVPolicy::gather(const TensorView& t, std::int64_t b, const char* what) const {
  const ThinKVConfig& c = cfg_.pipeline;
  KVSIFT_CHECK(t.data != nullptr && t.rank == 4 && t.dtype == DType::f32 && t.device == Device::cpu,
               "ThinKVPolicy: ", what, " must be a host f32 [batch, heads, n, head_dim] view, got ",
               t.shape_string(), " ", dtype_name(t.dtype), " on ", device_name(t.device),
               t.device == Device::cpu ? "" : " (device tensors need place_on_device() first)");
  KVSIFT_CHECK(t.shape[0] == batch() && t.shape[3] == c.head_dim, "ThinKVPolicy: ", what, " is ",
               t.shape_string(), ", expected [batch = ", batch(),
               ", heads, n, head_dim = ", c.head_dim, "]");
  const std::int64_t heads = t.shape[1], n = t.shape[2], d = t.shape[3];
  scratch_.resize(static_cast<std::size_t>(n * heads * d));
  for (std::int64_t i = 0; i < n; ++i)  // ThinKV's layout: [n, heads, head_dim]
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t k = 0; k < d; ++k)
        scratch_[(i * heads + h) * d + k] = *t.ptr<float>(b, h, i, k);
  return scratch_.data();
}

void ThinKVPolicy::check_host(const char* fn) const {
  KVSIFT_CHECK(!device_, "ThinKVPolicy::", fn,
               ": the policy is placed on the device; this call serves the host pipeline");
}

std::size_t ThinKVPolicy::device_memory_bytes() const {
  return device_backend().thinkv_memory_bytes(cfg_.pipeline, batch());
}

void ThinKVPolicy::place_on_device(const ExecContext& ctx) {
  KVSIFT_CHECK(!device_, "ThinKVPolicy::place_on_device: already on the device");
  for (const auto& s : seqs_) {
    KVSIFT_CHECK(s->length() == 0,
                 "ThinKVPolicy::place_on_device: the host pipeline already holds ", s->length(),
                 " tokens; place the policy before the prompt");
  }
  // Make the device pipeline first: if it refuses (config, memory), the host one stays usable.
  device_ = device_backend().make_thinkv(cfg_.pipeline, batch(), ctx);
  seqs_.clear();
}

std::size_t ThinKVPolicy::attention_workspace_bytes(int layer) const {
  return device_ ? device_->attention_workspace_bytes(layer) : 0;
}

void ThinKVPolicy::attention_with_workspace(int layer, const TensorView& queries,
                                            const TensorView& out, const ExecContext& ctx) const {
  if (!device_) return attention(layer, queries, out);
  device_->attention(layer, queries, out, ctx.workspace, ctx.workspace_bytes);
}

void ThinKVPolicy::prefill(int layer, const TensorView& keys, const TensorView& values) {
  if (device_) return device_->prefill(layer, keys, values);
  KVSIFT_CHECK(keys.rank == 4 && values.rank == 4 && keys.shape == values.shape,
               "ThinKVPolicy::prefill: keys ", keys.shape_string(), " and values ",
               values.shape_string(), " must be the same [batch, kv_heads, n, head_dim]");
  std::vector<float> k;
  for (std::int64_t b = 0; b < batch(); ++b) {
    const float* kp = gather(keys, b, "prefill keys");
    k.assign(kp, kp + scratch_.size());
    seqs_[b]->prefill(layer, k.data(), gather(values, b, "prefill values"), keys.shape[2]);
  }
}

void ThinKVPolicy::append(int layer, const TensorView& keys, const TensorView& values) {
  if (device_) return device_->append(layer, keys, values);
  KVSIFT_CHECK(
      keys.rank == 4 && keys.shape[2] == 1 && values.rank == 4 && keys.shape == values.shape,
      "ThinKVPolicy::append: keys ", keys.shape_string(), " and values ", values.shape_string(),
      " must be the same [batch, kv_heads, 1, head_dim]");
  std::vector<float> k;
  for (std::int64_t b = 0; b < batch(); ++b) {
    const float* kp = gather(keys, b, "append keys");
    k.assign(kp, kp + scratch_.size());
    seqs_[b]->append(layer, k.data(), gather(values, b, "append values"));
  }
}

void ThinKVPolicy::observe(const Observation& obs) {
  if (device_) {  // outside L* the pipeline ignores the layer; inside it checks the queries
    if (obs.layer >= 0) device_->observe_query(obs.layer, obs.queries);
    return;
  }
  if (obs.layer < 0 || seqs_.empty() || !seqs_[0]->needs_sparsity(obs.layer)) return;
  KVSIFT_CHECK(obs.queries.data != nullptr && obs.queries.rank == 4 && obs.queries.shape[2] == 1,
               "ThinKVPolicy::observe: layer ", obs.layer,
               " is calibrated (L*) and needs the step's queries [batch, q_heads, 1, head_dim], "
               "got ",
               obs.queries.shape_string());
  for (std::int64_t b = 0; b < batch(); ++b)
    seqs_[b]->observe_query(obs.layer, gather(obs.queries, b, "queries"));
}

void ThinKVPolicy::observe_sparsity(int layer, const float* sparsity) {
  check_host("observe_sparsity");
  KVSIFT_CHECK(sparsity != nullptr, "ThinKVPolicy::observe_sparsity: sparsity is null");
  for (std::int64_t b = 0; b < batch(); ++b) seqs_[b]->observe_sparsity(layer, sparsity[b]);
}

bool ThinKVPolicy::end_step() {
  bool evicted = false;
  if (device_) {
    for (const EvictionStep& s : device_->end_step()) evicted = s.evicted() || evicted;
    return evicted;
  }
  for (auto& s : seqs_) evicted = s->end_step().evicted() || evicted;
  return evicted;
}

void ThinKVPolicy::attention(int layer, const TensorView& queries, const TensorView& out) const {
  KVSIFT_CHECK(!device_,
               "ThinKVPolicy::attention: on the device, attention takes its scratch: "
               "call attention_with_workspace() with attention_workspace_bytes(layer) "
               "bytes");
  const ThinKVConfig& c = cfg_.pipeline;
  KVSIFT_CHECK(out.data != nullptr && out.rank == 4 && out.dtype == DType::f32 &&
                   out.device == Device::cpu && out.shape[0] == batch() &&
                   out.shape[1] == c.q_heads && out.shape[2] == 1 && out.shape[3] == c.head_dim,
               "ThinKVPolicy::attention: out must be host f32 [batch = ", batch(),
               ", q_heads = ", c.q_heads, ", 1, head_dim = ", c.head_dim, "], got ",
               out.shape_string());
  std::vector<float> o(static_cast<std::size_t>(c.q_heads * c.head_dim));
  for (std::int64_t b = 0; b < batch(); ++b) {
    seqs_[b]->attention(layer, gather(queries, b, "queries"), o.data());
    for (std::int64_t h = 0; h < c.q_heads; ++h)
      for (std::int64_t k = 0; k < c.head_dim; ++k)
        *out.ptr<float>(b, h, 0, k) = o[static_cast<std::size_t>(h * c.head_dim + k)];
  }
}

std::int64_t ThinKVPolicy::resident_bytes(int layer) const {
  if (device_) return device_->resident_bytes(layer);
  std::int64_t bytes = 0;
  for (const auto& s : seqs_) bytes += s->table(layer).resident_bytes().total();
  return bytes;
}

std::int64_t ThinKVPolicy::resident_bytes() const {
  if (device_) return device_->resident_bytes();
  std::int64_t bytes = 0;
  for (const auto& s : seqs_) bytes += s->resident_bytes().total();
  return bytes;
}

std::int64_t ThinKVPolicy::fullkv_fp16_bytes() const {
  if (device_) return device_->fullkv_fp16_bytes();
  std::int64_t bytes = 0;
  for (const auto& s : seqs_) bytes += s->fullkv_fp16_bytes();
  return bytes;
}

std::vector<std::int32_t> ThinKVPolicy::resident_positions(int layer, std::int64_t seq,
                                                           std::int64_t kv_head) const {
  if (device_) return device_->resident_positions(layer, seq, kv_head);
  const ThinKV& s = sequence(seq);
  return s.table(layer).resident_positions(s.sequence_id(), static_cast<std::int32_t>(kv_head));
}

std::int64_t ThinKVPolicy::evicting_layer_steps() const {
  if (device_) return device_->evicting_layer_steps();
  std::int64_t n = 0;
  for (const auto& s : seqs_) n += s->eviction_counter().evicting();
  return n;
}

std::int64_t ThinKVPolicy::total_layer_steps() const {
  if (device_) return device_->total_layer_steps();
  std::int64_t n = 0;
  for (const auto& s : seqs_) n += s->eviction_counter().total();
  return n;
}

const ThinKV& ThinKVPolicy::sequence(std::int64_t seq) const {
  check_host("sequence");
  KVSIFT_CHECK(seq >= 0 && seq < batch(), "ThinKVPolicy: sequence ", seq,
               " outside [0, batch = ", batch(), ")");
  return *seqs_[seq];
}

}  // namespace kvsift
