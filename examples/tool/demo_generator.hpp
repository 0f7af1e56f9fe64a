// The demo's model-free decode: a synthetic chain of thought with sentence structure. No model
// runs; every key, value, query and hidden state is drawn from a counter-based hash of (seed, what,
// where), so a run is a pure function of its seed and sentence plans, and any token can be
// regenerated.
//
// What the keys carry, per layer and KV head:
//   key(t) = sqrt(D) * (topic_weight * topic(sentence of t) + token_weight * noise(t))
// with unit topic vectors per sentence and ~unit token noise. Some sentences are planted as
// near-repeats of an earlier sentence (topic and token noise of the original plus a little jitter)
// — the redundancy R-KV and SkipKV look for. Queries look back: in a "look-back" sentence every
// query mixes the current sentence's topic with the topic of one earlier sentence chosen when the
// sentence opens, so attention (and FullKV's top tokens) lands on old content a policy may have
// evicted. No RoPE: keys are position-free, which the policies do not need (they score post-RoPE
// keys as given) and which keeps look-back attention independent of distance.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "demo_sentences.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::demo {

struct GeneratorConfig {
  int batch = 2;
  int layers = 4;
  int q_heads = 8;  // GQA: q_heads / kv_heads query heads share each KV head
  int kv_heads = 2;
  int head_dim = 64;
  std::uint64_t seed = 1;
  float repeat_probability = 0.2f;  // share of sentences planted as near-repeats of an earlier one
  float lookback_probability =
      0.75f;  // share of sentences whose queries look back at an earlier one
  // key = sqrt(D) * (topic_weight * topic + token_weight * noise). With 0.65 / 0.76 two tokens of
  // one sentence have key cosine ~0.42, under R-KV's 0.5 redundancy threshold, while a planted
  // near-repeat of a token sits near 0.99: only the planted repeats read as redundant.
  float topic_weight = 0.65f;
  float token_weight = 0.76f;
  float repeat_jitter = 0.15f;  // how far a near-repeat strays from its original
  float recent_weight = 0.5f;   // query weight of the current sentence's topic when looking back
  float query_noise = 0.3f;     // per-query-head noise, relative to a unit topic

  void validate() const {
    KVSIFT_CHECK(batch >= 1, "GeneratorConfig: batch must be >= 1, got ", batch);
    KVSIFT_CHECK(layers >= 1, "GeneratorConfig: layers must be >= 1, got ", layers);
    KVSIFT_CHECK(kv_heads >= 1 && q_heads >= kv_heads && q_heads % kv_heads == 0,
                 "GeneratorConfig: q_heads (", q_heads,
                 ") must be a positive multiple of kv_heads (", kv_heads, ")");
    KVSIFT_CHECK(head_dim >= 1, "GeneratorConfig: head_dim must be >= 1, got ", head_dim);
    KVSIFT_CHECK(repeat_probability >= 0 && repeat_probability <= 1,
                 "GeneratorConfig: repeat_probability must be in [0, 1], got ", repeat_probability);
    KVSIFT_CHECK(lookback_probability >= 0 && lookback_probability <= 1,
                 "GeneratorConfig: lookback_probability must be in [0, 1], got ",
                 lookback_probability);
  }
};

// Counter-based randomness (splitmix64 finalizer): one hash per number, no state to carry.
namespace rng {
inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
enum Stream : std::uint64_t {
  kTopic = 1,
  kTopicJitter,
  kToken,
  kTokenJitter,
  kValue,
  kQuery,
  kChoice
};
inline std::uint64_t key(std::uint64_t seed, Stream s, std::uint64_t a, std::uint64_t b = 0,
                         std::uint64_t c = 0, std::uint64_t d = 0) {
  std::uint64_t k = mix64(seed ^ (static_cast<std::uint64_t>(s) << 56));
  k = mix64(k ^ a);
  k = mix64(k ^ (b + 0x51ull));
  k = mix64(k ^ (c + 0xa3ull));
  return mix64(k ^ (d + 0xf5ull));
}
// Uniform in [0, 1) from the top 53 bits.
inline double uniform(std::uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }
// Approximately standard normal: Irwin–Hall sum of four 16-bit uniforms, rescaled to variance 1.
// Plenty for synthetic data, and one hash per number keeps the generator cheap.
inline float normal(std::uint64_t bits) {
  float sum = 0;
  for (int i = 0; i < 4; ++i) sum += (static_cast<float>((bits >> (16 * i)) & 0xffffu) + 0.5f);
  return (sum * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
}
// out[i] += scale * N(0, 1), i < n, drawn from the stream `key`.
inline void add_normals(std::uint64_t key, float scale, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] += scale * normal(mix64(key + static_cast<std::uint64_t>(i)));
}
}  // namespace rng

// One decode step of every sequence and layer.
struct DecodeStep {
  std::int64_t position = 0;                  // generation position of this token (all sequences)
  std::vector<std::int32_t> token_ids;        // [batch] real id, or -1 on a synthetic stream
  std::vector<std::int32_t> sentence;         // [batch] index of the sentence this token belongs to
  std::vector<std::uint8_t> closes_sentence;  // [batch] 1 when this token ends its sentence
  std::vector<float> keys;                    // [layers, batch, kv_heads, head_dim]
  std::vector<float> values;                  // [layers, batch, kv_heads, head_dim]
  std::vector<float> queries;                 // [layers, batch, q_heads, head_dim]
  // [batch, head_dim] a stand-in for the last layer's hidden state: the sentence's topic plus token
  // noise, so a near-repeat sentence has a near-identical mean (for sentence-embedding policies).
  std::vector<float> hidden;
  int batch = 0, kv_heads = 0, q_heads = 0, head_dim = 0;

  const float* key(int layer, int b, int h) const {
    return keys.data() + ((static_cast<std::size_t>(layer) * batch + b) * kv_heads + h) * head_dim;
  }
  const float* value(int layer, int b, int h) const {
    return values.data() +
           ((static_cast<std::size_t>(layer) * batch + b) * kv_heads + h) * head_dim;
  }
  const float* query(int layer, int b, int qh) const {
    return queries.data() +
           ((static_cast<std::size_t>(layer) * batch + b) * q_heads + qh) * head_dim;
  }
};

class SyntheticDecode {
 public:
  // One sentence plan per sequence, all of the same length (the decode length).
  SyntheticDecode(const GeneratorConfig& config, std::vector<SentencePlan> plans)
      : cfg_(config), plans_(std::move(plans)) {
    cfg_.validate();
    KVSIFT_CHECK(static_cast<int>(plans_.size()) == cfg_.batch, "SyntheticDecode: ", plans_.size(),
                 " sentence plans for batch ", cfg_.batch);
    length_ = plans_[0].length();
    KVSIFT_CHECK(length_ >= 1, "SyntheticDecode: decode length must be >= 1, got ", length_);
    for (std::size_t b = 0; b < plans_.size(); ++b) {
      const SentencePlan& p = plans_[b];
      KVSIFT_CHECK(p.length() == length_, "SyntheticDecode: sequence ", b, " has length ",
                   p.length(), ", sequence 0 has ", length_);
      KVSIFT_CHECK(!p.sentence_ends.empty() && p.sentence_ends.back() == length_,
                   "SyntheticDecode: sentence plan of sequence ", b, " does not end at ", length_);
    }
    plan_sentences();
  }

  const GeneratorConfig& config() const { return cfg_; }
  std::int64_t length() const { return length_; }
  std::int64_t position() const { return next_; }
  bool done() const { return next_ >= length_; }
  const SentencePlan& plan(int b) const { return plans_[b]; }
  // The sentence `s` of sequence `b` near-repeats, or -1.
  std::int32_t repeat_of(int b, std::int64_t s) const { return seq_[b].repeat_of[s]; }
  // The earlier sentence that the queries of sentence `s` look back at, or -1.
  std::int32_t lookback_target(int b, std::int64_t s) const { return seq_[b].lookback[s]; }
  // Sentence index of generation position `t` of sequence `b`.
  std::int32_t sentence_at(int b, std::int64_t t) const { return seq_[b].sentence_of[t]; }

  // Fills `out` with the token at position() and advances.
  void next(DecodeStep& out) {
    KVSIFT_CHECK(!done(), "SyntheticDecode::next: all ", length_, " tokens already generated");
    const int B = cfg_.batch, L = cfg_.layers, Hkv = cfg_.kv_heads, Hq = cfg_.q_heads;
    const int D = cfg_.head_dim, G = Hq / Hkv;
    const float root_d = std::sqrt(static_cast<float>(D));
    const float inv_root_d = 1.0f / root_d;
    const std::int64_t t = next_;
    out.position = t;
    out.batch = B, out.kv_heads = Hkv, out.q_heads = Hq, out.head_dim = D;
    out.token_ids.assign(B, -1);
    out.sentence.assign(B, 0);
    out.closes_sentence.assign(B, 0);
    out.keys.assign(static_cast<std::size_t>(L) * B * Hkv * D, 0.0f);
    out.values.assign(out.keys.size(), 0.0f);
    out.queries.assign(static_cast<std::size_t>(L) * B * Hq * D, 0.0f);
    out.hidden.assign(static_cast<std::size_t>(B) * D, 0.0f);
    std::vector<float> topic(D), target(D);
    for (int b = 0; b < B; ++b) {
      const Sequence& sq = seq_[b];
      const std::int32_t s = sq.sentence_of[t];
      out.token_ids[b] = plans_[b].token_ids[t];
      out.sentence[b] = s;
      out.closes_sentence[b] = plans_[b].sentence_ends[s] == t + 1;
      const std::int32_t look = sq.lookback[s];
      for (int l = 0; l < L; ++l) {
        for (int h = 0; h < Hkv; ++h) {
          sentence_topic(l, b, h, s, topic.data());
          if (look >= 0) sentence_topic(l, b, h, look, target.data());
          float* k = out.keys.data() + ((static_cast<std::size_t>(l) * B + b) * Hkv + h) * D;
          float* v = out.values.data() + ((static_cast<std::size_t>(l) * B + b) * Hkv + h) * D;
          // Token noise of the root token (the original this token near-repeats) plus jitter.
          rng::add_normals(rng::key(cfg_.seed, rng::kToken, l, b, h, sq.root_position[t]),
                           cfg_.token_weight * inv_root_d, k, D);
          if (sq.root_position[t] != t) {
            rng::add_normals(rng::key(cfg_.seed, rng::kTokenJitter, l, b, h, t),
                             cfg_.token_weight * cfg_.repeat_jitter * inv_root_d, k, D);
          }
          for (int d = 0; d < D; ++d) k[d] = root_d * (k[d] + cfg_.topic_weight * topic[d]);
          rng::add_normals(rng::key(cfg_.seed, rng::kValue, l, b, h, t), 1.0f, v, D);
          for (int g = 0; g < G; ++g) {
            const int qh = h * G + g;
            float* q = out.queries.data() + ((static_cast<std::size_t>(l) * B + b) * Hq + qh) * D;
            rng::add_normals(rng::key(cfg_.seed, rng::kQuery, l, b, qh, t),
                             cfg_.query_noise * inv_root_d, q, D);
            const float w_recent = look >= 0 ? cfg_.recent_weight : 1.0f;
            for (int d = 0; d < D; ++d) {
              q[d] = root_d * (q[d] + w_recent * topic[d] + (look >= 0 ? target[d] : 0.0f));
            }
          }
        }
      }
      // Hidden state: the topic of an extra "layer" L (not a KV layer) plus token noise.
      float* hid = out.hidden.data() + static_cast<std::size_t>(b) * D;
      sentence_topic(L, b, 0, s, hid);
      rng::add_normals(rng::key(cfg_.seed, rng::kToken, L, b, 0, t), 0.3f * inv_root_d, hid, D);
    }
    ++next_;
  }

 private:
  struct Sequence {
    std::vector<std::int32_t> sentence_of;    // [length] sentence index of each position
    std::vector<std::int32_t> repeat_of;      // [sentences] original of a near-repeat, or -1
    std::vector<std::int32_t> root_sentence;  // [sentences] the first original of a repeat chain
    std::vector<std::int32_t> lookback;       // [sentences] look-back target, or -1
    std::vector<std::int64_t> root_position;  // [length] the token whose noise this token repeats
  };

  // Sentence-level choices are fixed up front from the seed: which sentences are near-repeats (and
  // of what), and which earlier sentence each look-back sentence attends to.
  void plan_sentences() {
    seq_.resize(plans_.size());
    for (int b = 0; b < cfg_.batch; ++b) {
      const SentencePlan& p = plans_[b];
      Sequence& sq = seq_[b];
      const auto n = static_cast<std::int32_t>(p.sentences());
      sq.sentence_of.resize(static_cast<std::size_t>(length_));
      sq.root_position.resize(static_cast<std::size_t>(length_));
      sq.repeat_of.assign(n, -1);
      sq.root_sentence.resize(n);
      sq.lookback.assign(n, -1);
      for (std::int32_t s = 0; s < n; ++s) {
        const auto choice = [&](std::uint64_t what) {
          return rng::mix64(rng::key(cfg_.seed, rng::kChoice, b, s, what));
        };
        if (s >= 1 && rng::uniform(choice(0)) < cfg_.repeat_probability) {
          sq.repeat_of[s] = static_cast<std::int32_t>(choice(1) % static_cast<std::uint64_t>(s));
        }
        // Look back past the previous sentence (that one is recent context anyway).
        if (s >= 2 && rng::uniform(choice(2)) < cfg_.lookback_probability) {
          sq.lookback[s] = static_cast<std::int32_t>(choice(3) % static_cast<std::uint64_t>(s - 1));
        }
        sq.root_sentence[s] = sq.repeat_of[s] < 0 ? s : sq.root_sentence[sq.repeat_of[s]];
        const std::int32_t start = p.sentence_start(s), end = p.sentence_ends[s];
        for (std::int32_t t = start; t < end; ++t) {
          sq.sentence_of[t] = s;
          if (sq.repeat_of[s] < 0) {
            sq.root_position[t] = t;
          } else {  // token j of the repeat copies token j (cyclically) of the original
            const std::int32_t o = sq.repeat_of[s];
            const std::int32_t j = (t - start) % p.sentence_length(o);
            sq.root_position[t] = sq.root_position[p.sentence_start(o) + j];
          }
        }
      }
    }
  }

  // Unit topic of sentence `s` in (layer, b, h): the root original's direction, plus jitter for a
  // near-repeat. Recomputed on demand: D hashes, cheaper than storing every sentence's topics.
  void sentence_topic(int layer, int b, int h, std::int32_t s, float* out) const {
    const int D = cfg_.head_dim;
    for (int d = 0; d < D; ++d) out[d] = 0.0f;
    const std::int32_t root = seq_[b].root_sentence[s];
    rng::add_normals(rng::key(cfg_.seed, rng::kTopic, layer, b, h, root), 1.0f, out, D);
    if (root != s) {
      rng::add_normals(rng::key(cfg_.seed, rng::kTopicJitter, layer, b, h, s), cfg_.repeat_jitter,
                       out, D);
    }
    float norm = 0;
    for (int d = 0; d < D; ++d) norm += out[d] * out[d];
    const float inv = 1.0f / (std::sqrt(norm) + 1e-8f);
    for (int d = 0; d < D; ++d) out[d] *= inv;
  }

  GeneratorConfig cfg_;
  std::vector<SentencePlan> plans_;
  std::vector<Sequence> seq_;
  std::int64_t length_ = 0;
  std::int64_t next_ = 0;
};

}  // namespace kvsift::demo
