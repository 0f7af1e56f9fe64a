// ThinKV pipeline (docs/algorithms.md §3): config validation and the per-step driver. See
// include/kvsift/policy/thinkv/thinkv.hpp and docs/thinkv.md, "The ThinKV pipeline".
#include "kvsift/policy/thinkv/thinkv.hpp"

#include <cmath>
#include <utility>

#include "kvsift/backend/cpu/attention_sparsity.hpp"
#include "kvsift/core/limits.hpp"
#include "kvsift/paged/paged_attention.hpp"

namespace kvsift {

// --- config ----------------------------------------------------------------------------------

void ThinKVConfig::validate() const {
  KVSIFT_CHECK(num_layers > 0 && num_layers <= kMaxLayers,
               "ThinKVConfig: num_layers must be in [1, ", kMaxLayers, "], got ", num_layers);
  KVSIFT_CHECK(kv_heads > 0, "ThinKVConfig: kv_heads must be > 0, got ", kv_heads);
  KVSIFT_CHECK(q_heads > 0 && q_heads % kv_heads == 0, "ThinKVConfig: q_heads (", q_heads,
               ") must be a positive multiple of kv_heads (", kv_heads, ")");
  KVSIFT_CHECK(head_dim > 0 && head_dim % kQuantGroupSize == 0, "ThinKVConfig: head_dim (",
               head_dim, ") must be a positive multiple of ", kQuantGroupSize);
  KVSIFT_CHECK(budget > 0, "ThinKVConfig: budget must be > 0 tokens per (layer, KV head), got ",
               budget);
  KVSIFT_CHECK(refresh > 0, "ThinKVConfig: refresh (tau) must be > 0 steps, got ", refresh);
  KVSIFT_CHECK(!std::isnan(theta1) && !std::isnan(theta2),
               "ThinKVConfig: thresholds are not set (theta1 = ", theta1, ", theta2 = ", theta2,
               "); they are model-specific: run `kvsift calibrate` and copy theta1, theta2 and "
               "layers into the config");
  KVSIFT_CHECK(theta1 >= 0.0f && theta2 <= 1.0f && theta1 < theta2,
               "ThinKVConfig: thresholds must satisfy 0 <= theta1 < theta2 <= 1, got theta1 = ",
               theta1, ", theta2 = ", theta2);
  KVSIFT_CHECK(!calibrated_layers.empty(),
               "ThinKVConfig: calibrated_layers (L*) is empty; run `kvsift calibrate` and copy "
               "its layers into the config");
  for (std::size_t i = 0; i < calibrated_layers.size(); ++i) {
    KVSIFT_CHECK(calibrated_layers[i] >= 0 && calibrated_layers[i] < num_layers,
                 "ThinKVConfig: calibrated_layers[", i, "] = ", calibrated_layers[i],
                 " outside [0, num_layers = ", num_layers, ")");
  }
  KVSIFT_CHECK(kmeans_iterations > 0, "ThinKVConfig: kmeans_iterations must be > 0, got ",
               kmeans_iterations);
  KVSIFT_CHECK(pool_blocks > 0, "ThinKVConfig: pool_blocks must be > 0, got ", pool_blocks);
  KVSIFT_CHECK(pool_blocks <= kMaxPoolBlocks, "ThinKVConfig: pool_blocks (", pool_blocks,
               ") exceeds kMaxPoolBlocks = ", kMaxPoolBlocks);
  KVSIFT_CHECK(static_cast<std::int64_t>(num_layers) * pool_blocks <= kMaxTotalPoolBlocks,
               "ThinKVConfig: num_layers * pool_blocks (", num_layers, " * ", pool_blocks, " = ",
               static_cast<std::int64_t>(num_layers) * pool_blocks,
               ") exceeds kMaxTotalPoolBlocks = ", kMaxTotalPoolBlocks);
  KVSIFT_CHECK(global_factors.empty() || static_cast<std::int64_t>(global_factors.size()) ==
                                             static_cast<std::int64_t>(num_layers) * kv_heads,
               "ThinKVConfig: global_factors has ", global_factors.size(),
               " entries, expected 0 or num_layers * kv_heads = ",
               static_cast<std::int64_t>(num_layers) * kv_heads);
  // The pieces check the rest (schedule, duplicate layers, block size, formats, factors) with
  // their own messages.
  classifier_config().validate();
  evictor_config().validate();
  for (int l = 0; l < num_layers; ++l) table_config(l).validate();
  KMeansSelectConfig{kmeans_iterations}.validate();
}

ThoughtClassifierConfig ThinKVConfig::classifier_config() const {
  ThoughtClassifierConfig c;
  c.theta1 = theta1;
  c.theta2 = theta2;
  c.refresh = refresh;
  c.layers = calibrated_layers;
  return c;
}

SegmentEvictorConfig ThinKVConfig::evictor_config() const {
  SegmentEvictorConfig c;
  c.schedule = schedule;
  c.budget = budget;
  c.segment_length = refresh;  // a segment is one refresh interval (§3.3)
  c.evict_prompt = evict_prompt;
  return c;
}

ThoughtBlockTableConfig ThinKVConfig::table_config(int layer) const {
  ThoughtBlockTableConfig c;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.block_size = block_size;
  c.num_blocks = pool_blocks;
  c.reasoning = reasoning;
  c.execution = execution;
  c.transition = transition;
  c.staging = staging;
  c.refill = refill;
  c.regroup_min_free = regroup_min_free;
  if (!global_factors.empty()) {
    const auto begin = global_factors.begin() + static_cast<std::ptrdiff_t>(layer) * kv_heads;
    c.global_factors.assign(begin, begin + kv_heads);
  }
  return c;
}

// --- pipeline --------------------------------------------------------------------------------

namespace {
const ThinKVConfig& validated(const ThinKVConfig& config) {
  config.validate();
  return config;
}
}  // namespace

ThinKV::ThinKV(ThinKVConfig config) : config_(std::move(config)), schedule_(validated(config_)) {
  kmeans_.max_iterations = config_.kmeans_iterations;
  tables_.reserve(static_cast<std::size_t>(config_.num_layers));
  for (int l = 0; l < config_.num_layers; ++l) {
    tables_.emplace_back(config_.table_config(l));
    seq_ = tables_.back().create_sequence();  // 0 in every fresh table
    // The prompt is segment 0. It is stored at R precision and ranks as R (segment_evictor.hpp).
    tables_.back().open_segment(seq_, ThoughtType::reasoning);
  }
}

void ThinKV::check_layer(int layer, const char* fn) const {
  KVSIFT_CHECK(layer >= 0 && layer < config_.num_layers, "ThinKV::", fn, ": layer ", layer,
               " outside [0, num_layers = ", config_.num_layers, ")");
}

const ThoughtBlockTable& ThinKV::table(int layer) const {
  check_layer(layer, "table");
  return tables_[static_cast<std::size_t>(layer)];
}

void ThinKV::prefill(int layer, const float* keys, const float* values, std::int64_t n) {
  check_layer(layer, "prefill");
  KVSIFT_CHECK(!schedule_.started(), "ThinKV::prefill: layer ", layer, ": decoding has started (",
               schedule_.steps(), " steps); the prompt must come first");
  KVSIFT_CHECK(n >= 0, "ThinKV::prefill: n must be >= 0, got ", n);
  KVSIFT_CHECK(n == 0 || (keys != nullptr && values != nullptr),
               "ThinKV::prefill: keys and values must not be null");
  ThoughtBlockTable& t = tables_[static_cast<std::size_t>(layer)];
  const std::int64_t row = static_cast<std::int64_t>(config_.kv_heads) * config_.head_dim;
  for (std::int64_t i = 0; i < n; ++i) {
    t.append(seq_, keys + i * row, values + i * row, config_.kv_heads, config_.head_dim);
  }
}

// The prompt is complete once decoding starts: TBE's bookkeeping begins with it as segment 0.
void ThinKV::start_decode() {
  const std::int32_t prompt = tables_[0].length(seq_);
  for (int l = 1; l < config_.num_layers; ++l) {
    KVSIFT_CHECK(tables_[static_cast<std::size_t>(l)].length(seq_) == prompt,
                 "ThinKV::append: layer ", l, " has a prompt of ",
                 tables_[static_cast<std::size_t>(l)].length(seq_), " tokens but layer 0 has ",
                 prompt, "; prefill every layer with the same prompt");
  }
  schedule_.start(prompt);
}

void ThinKV::append(int layer, const float* key, const float* value) {
  check_layer(layer, "append");
  const bool opens = schedule_.opens_segment(layer);
  KVSIFT_CHECK(key != nullptr && value != nullptr,
               "ThinKV::append: key and value must not be null");
  if (!schedule_.started()) start_decode();
  ThoughtBlockTable& t = tables_[static_cast<std::size_t>(layer)];
  // The SegmentEvictor opens a segment every `refresh` decode tokens (segment_length = τ); the
  // table must open the same segment, with the same label, before the token is written.
  // If the append below throws (pool exhausted) nothing is written, and a retry in the same step
  // must not open the segment a second time.
  if (opens) {
    t.open_segment(seq_, schedule_.label());
    schedule_.segment_opened(layer);
  }
  t.append(seq_, key, value, config_.kv_heads, config_.head_dim);
  schedule_.appended(layer);
}

bool ThinKV::needs_sparsity(int layer) const {
  check_layer(layer, "needs_sparsity");
  return schedule_.classifier().uses_layer(layer);
}

bool ThinKV::observe_sparsity(int layer, float sparsity) {
  check_layer(layer, "observe_sparsity");
  return schedule_.classifier().observe_layer(layer, sparsity);
}

bool ThinKV::observe_attention(int layer, const float* probs, std::int64_t n) {
  check_layer(layer, "observe_attention");
  if (!schedule_.classifier().uses_layer(layer)) return false;
  KVSIFT_CHECK(probs != nullptr && n > 0, "ThinKV::observe_attention: layer ", layer,
               ": probs must hold [q_heads, n] with n > 0, got n = ", n);
  double total = 0.0;
  for (int q = 0; q < config_.q_heads; ++q) total += sparsity_from_probabilities(probs + q * n, n);
  return schedule_.classifier().observe_layer(layer, static_cast<float>(total / config_.q_heads));
}

bool ThinKV::observe_query(int layer, const float* query) {
  check_layer(layer, "observe_query");
  if (!schedule_.classifier().uses_layer(layer)) return false;
  KVSIFT_CHECK(query != nullptr, "ThinKV::observe_query: query must not be null");
  const ThoughtBlockTable& t = tables_[static_cast<std::size_t>(layer)];
  const std::int64_t D = config_.head_dim, group = config_.q_heads / config_.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> key(static_cast<std::size_t>(D)), value(key.size());
  double total = 0.0;
  for (int h = 0; h < config_.kv_heads; ++h) {
    const std::vector<ResidentToken> tokens = t.resident_tokens(seq_, h);
    KVSIFT_CHECK(!tokens.empty(), "ThinKV::observe_query: layer ", layer, " KV head ", h,
                 " holds no token");
    // logits[g, j] for the query heads of this KV head: [group, tokens]
    std::vector<float> logits(static_cast<std::size_t>(group) * tokens.size());
    for (std::size_t j = 0; j < tokens.size(); ++j) {
      t.read_token(seq_, h, tokens[j].address, key.data(), value.data());
      for (std::int64_t g = 0; g < group; ++g) {
        const float* q = query + (h * group + g) * D;
        float dot = 0.0f;
        for (std::int64_t d = 0; d < D; ++d) dot += q[d] * key[static_cast<std::size_t>(d)];
        logits[static_cast<std::size_t>(g) * tokens.size() + j] = dot * scale;
      }
    }
    for (std::int64_t g = 0; g < group; ++g) {
      total += sparsity_from_logits(&logits[static_cast<std::size_t>(g) * tokens.size()],
                                    static_cast<std::int64_t>(tokens.size()));
    }
  }
  return schedule_.classifier().observe_layer(layer, static_cast<float>(total / config_.q_heads));
}

EvictionStep ThinKV::end_step() {
  EvictionStep step = schedule_.end_step();
  // The tables opened their segment in append(); both sides must agree on the segment count.
  const std::size_t segments = schedule_.evictor().segments().size();
  KVSIFT_CHECK(static_cast<std::int32_t>(segments) == tables_[0].num_segments(seq_),
               "ThinKV::end_step: internal error: TBE has ", segments,
               " segments but the block table has ", tables_[0].num_segments(seq_));
  for (const SegmentChange& c : step.changes) apply_change(c);
  return step;
}

// One demotion, in every (layer, KV head): the survivors are chosen by k-means on that head's
// resident keys of the segment (as stored, i.e. dequantized), the rest get their eviction bits.
void ThinKV::apply_change(const SegmentChange& c) {
  std::vector<float> keys;
  std::vector<std::int32_t> positions;
  for (int l = 0; l < config_.num_layers; ++l) {
    ThoughtBlockTable& t = tables_[static_cast<std::size_t>(l)];
    for (int h = 0; h < config_.kv_heads; ++h) {
      t.segment_keys(seq_, h, c.segment, keys, positions);
      KVSIFT_CHECK(static_cast<std::int32_t>(positions.size()) == c.kept_before,
                   "ThinKV::end_step: internal error: segment ", c.segment, " holds ",
                   positions.size(), " tokens in layer ", l, " head ", h, ", TBE expected ",
                   c.kept_before);
      t.evict_positions(seq_, h,
                        segment_eviction_marks(keys.data(), positions.data(),
                                               static_cast<std::int64_t>(positions.size()),
                                               config_.head_dim, c.kept_after, kmeans_));
    }
  }
}

void ThinKV::attention(int layer, const float* query, float* out) const {
  check_layer(layer, "attention");
  paged_decode_attention(tables_[static_cast<std::size_t>(layer)], seq_, query, config_.q_heads,
                         config_.head_dim, 1.0f / std::sqrt(static_cast<float>(config_.head_dim)),
                         out);
}

// --- state -----------------------------------------------------------------------------------

std::int32_t ThinKV::length() const { return tables_[0].length(seq_); }

std::vector<Segment> ThinKV::segments() const {
  if (schedule_.started()) return schedule_.evictor().segments();
  Segment prompt;
  prompt.is_prompt = true;
  prompt.length = prompt.kept = length();
  return {prompt};
}

std::int32_t ThinKV::resident_tokens() const {
  return schedule_.started() ? schedule_.evictor().cache_length() : length();
}

TableBytes ThinKV::resident_bytes() const {
  TableBytes sum;
  for (const ThoughtBlockTable& t : tables_) sum += t.resident_bytes();
  return sum;
}

std::int64_t ThinKV::fullkv_fp16_bytes() const {
  // K and V, 2 bytes per element, every token ever appended in every (layer, KV head).
  return static_cast<std::int64_t>(config_.num_layers) * config_.kv_heads * length() *
         config_.head_dim * 2 * 2;
}

double ThinKV::resident_fraction() const {
  const std::int64_t full = fullkv_fp16_bytes();
  return full == 0 ? 0.0 : static_cast<double>(resident_bytes().total()) / full;
}

}  // namespace kvsift
