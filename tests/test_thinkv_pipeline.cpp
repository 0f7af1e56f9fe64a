// The ThinKV pipeline (docs/algorithms.md §3): classifier + TBQ block table + TBE evictor driven
// step by step. Multi-step scenarios with hand-set sparsities whose labels, demotions and resident
// counts are worked out by hand in the comments; soft eviction moves no byte; paged attention
// equals a dense two-pass softmax over the table's resident tokens; sparsity from queries and from
// attention rows against hand-computed rows; config and driving errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kvsift/policy/thinkv/thinkv.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// Thresholds of the scenarios: s < 0.3 → E, 0.3 ≤ s < 0.7 → R, s ≥ 0.7 → T.
constexpr float kE = 0.1f, kR = 0.5f, kT = 0.9f;

ThinKVConfig small_config() {
  ThinKVConfig c;
  c.num_layers = 2;
  c.kv_heads = 2;
  c.q_heads = 4;
  c.head_dim = 16;
  c.budget = 1000000;  // no budget pressure unless a test sets one
  c.theta1 = 0.3f;
  c.theta2 = 0.7f;
  c.calibrated_layers = {1};
  c.pool_blocks = 256;
  return c;  // refresh 128, schedule {64, 32, 16, 8, 4}, R4 E4 T2, block 32: the defaults
}

// Plays the engine: random post-RoPE keys and values, the step's sparsity set by hand.
class Host {
 public:
  explicit Host(const ThinKVConfig& c, std::uint32_t seed = 7) : kv(c), rng_(seed) {}

  std::vector<float> random_rows(std::int64_t tokens) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(
        static_cast<std::size_t>(tokens * kv.config().kv_heads * kv.config().head_dim));
    for (float& v : x) v = normal(rng_);
    return x;
  }
  void prompt(std::int64_t n) {
    for (int l = 0; l < kv.config().num_layers; ++l) {
      const std::vector<float> k = random_rows(n), v = random_rows(n);
      kv.prefill(l, k.data(), v.data(), n);
    }
  }
  EvictionStep step(float sparsity) {
    for (int l = 0; l < kv.config().num_layers; ++l) {
      const std::vector<float> k = random_rows(1), v = random_rows(1);
      kv.append(l, k.data(), v.data());
      kv.observe_sparsity(l, sparsity);  // ignored outside L*
    }
    return kv.end_step();
  }

  // Resident tokens of one segment in one (layer, KV head), straight from the table.
  std::int64_t resident(int layer, int head, int segment) const {
    return static_cast<std::int64_t>(
        kv.table(layer).resident_tokens(kv.sequence_id(), head, segment).size());
  }
  // Checks that every (layer, head) holds `expected[s]` tokens of segment s.
  void check_counts(const std::vector<std::int64_t>& expected) const {
    REQUIRE(kv.table(0).num_segments(kv.sequence_id()) == static_cast<int>(expected.size()));
    std::int64_t total = 0;
    for (std::int64_t e : expected) total += e;
    for (int l = 0; l < kv.config().num_layers; ++l) {
      for (int h = 0; h < kv.config().kv_heads; ++h) {
        for (std::size_t s = 0; s < expected.size(); ++s) {
          INFO("layer " << l << " head " << h << " segment " << s);
          CHECK(resident(l, h, static_cast<int>(s)) == expected[s]);
        }
        CHECK(kv.table(l).live_tokens(kv.sequence_id(), h) == total);
      }
    }
    CHECK(kv.resident_tokens() == total);
  }

  ThinKV kv;

 private:
  std::mt19937 rng_;
};

std::vector<ThoughtType> segment_types(const ThinKV& kv) {
  std::vector<ThoughtType> t;
  for (const Segment& s : kv.segments()) t.push_back(s.type);
  return t;
}

// Every live token sits in a block of its segment's type (TBQ: one precision per block, §3.4).
void check_block_types(const ThinKV& kv) {
  for (int l = 0; l < kv.config().num_layers; ++l) {
    const ThoughtBlockTable& t = kv.table(l);
    for (int h = 0; h < kv.config().kv_heads; ++h) {
      for (const ResidentToken& r : t.resident_tokens(kv.sequence_id(), h)) {
        if (r.address.block == kStagedBlock) continue;  // waiting for its group: no block yet
        const BlockInfo b = t.block_info(kv.sequence_id(), r.address.block);
        REQUIRE(b.type == t.segment_type(kv.sequence_id(), r.segment));
        REQUIRE(b.format == kv.config().table_config(l).format_of(b.type));
      }
    }
  }
}

int blocks_of_type(const ThoughtBlockTable& t, std::int32_t seq, ThoughtType type) {
  int n = 0;
  for (int b = 0; b < t.num_blocks(seq); ++b) n += t.block_info(seq, b).type == type ? 1 : 0;
  return n;
}

// Blocks of `type` once `groups` more whole 16-token groups of it have arrived in every head, with
// no eviction meanwhile, by the refill rule of docs/algorithms.md §3.4 read off the eviction masks:
// head h refills its whole free 16-slot runs first and puts the rest in new blocks, which all heads
// share (each new block offers every head block_size / 16 runs).
int blocks_after_groups(const ThoughtBlockTable& t, std::int32_t seq, ThoughtType type,
                        int groups) {
  const int S = t.config().block_size, per_block = S / 16;
  int extra = 0;
  for (int h = 0; h < t.config().kv_heads; ++h) {
    int runs = 0;
    for (int b = 0; b < t.num_blocks(seq); ++b) {
      if (t.block_info(seq, b).type != type) continue;
      const std::uint64_t* free = t.free_mask(seq, b, h);
      for (int first = 0; first < S; first += 16) {
        bool all = true;
        for (int i = first; i < first + 16; ++i) all = all && ((free[i / 64] >> (i % 64)) & 1u);
        runs += all ? 1 : 0;
      }
    }
    const int need = std::max(0, groups - runs);
    extra = std::max(extra, (need + per_block - 1) / per_block);
  }
  return blocks_of_type(t, seq, type) + extra;
}

// Dense attention over the resident tokens the table itself reports, two-pass softmax in double:
// an oracle written independently of the paged, online-softmax kernel.
std::vector<float> dense_attention(const ThinKV& kv, int layer, const std::vector<float>& query) {
  const ThinKVConfig& c = kv.config();
  const ThoughtBlockTable& t = kv.table(layer);
  const int group = c.q_heads / c.kv_heads;
  std::vector<float> out(query.size(), 0.0f);
  std::vector<float> k(static_cast<std::size_t>(c.head_dim)), v(k.size());
  for (int h = 0; h < c.kv_heads; ++h) {
    std::vector<std::vector<float>> keys, values;
    for (const ResidentToken& r : t.resident_tokens(kv.sequence_id(), h)) {
      t.read_token(kv.sequence_id(), h, r.address, k.data(), v.data());
      keys.push_back(k);
      values.push_back(v);
    }
    for (int g = 0; g < group; ++g) {
      const float* q = &query[static_cast<std::size_t>((h * group + g) * c.head_dim)];
      std::vector<double> logit(keys.size());
      double max_logit = -1e300;
      for (std::size_t j = 0; j < keys.size(); ++j) {
        double dot = 0.0;
        for (int d = 0; d < c.head_dim; ++d) dot += double(q[d]) * keys[j][d];
        logit[j] = dot / std::sqrt(double(c.head_dim));
        max_logit = std::max(max_logit, logit[j]);
      }
      double sum = 0.0;
      for (double& x : logit) sum += (x = std::exp(x - max_logit));
      for (int d = 0; d < c.head_dim; ++d) {
        double acc = 0.0;
        for (std::size_t j = 0; j < keys.size(); ++j) acc += logit[j] * values[j][d];
        out[static_cast<std::size_t>((h * group + g) * c.head_dim + d)] =
            static_cast<float>(acc / sum);
      }
    }
  }
  return out;
}

// Raw bytes of every block and every survivor's read-back, to compare across an eviction.
struct Snapshot {
  std::vector<std::vector<std::uint8_t>> storage;              // [layer · blocks]
  std::map<std::vector<std::int32_t>, std::vector<float>> kv;  // (layer, head, position) → k|v
};

Snapshot snapshot(const ThinKV& kv) {
  Snapshot s;
  const int D = kv.config().head_dim;
  std::vector<float> k(static_cast<std::size_t>(D)), v(k.size());
  for (int l = 0; l < kv.config().num_layers; ++l) {
    const ThoughtBlockTable& t = kv.table(l);
    for (int b = 0; b < t.num_blocks(kv.sequence_id()); ++b) {
      s.storage.push_back(t.block_storage(kv.sequence_id(), b));
    }
    for (int h = 0; h < kv.config().kv_heads; ++h) {
      for (const ResidentToken& r : t.resident_tokens(kv.sequence_id(), h)) {
        t.read_token(kv.sequence_id(), h, r.address, k.data(), v.data());
        std::vector<float> kv_row(k);
        kv_row.insert(kv_row.end(), v.begin(), v.end());
        s.kv[{l, h, r.position}] = kv_row;
      }
    }
  }
  return s;
}

}  // namespace

TEST_CASE("ThinKV: labels per interval, Rule 1 demotions, protected prompt, no data moves") {
  Host host(small_config());
  ThinKV& kv = host.kv;
  host.prompt(100);  // segment 0: 100 tokens
  REQUIRE(kv.segments().size() == 1);
  REQUIRE(kv.segments()[0].kept == 100);

  // Interval i covers decode steps [128 i, 128 i + 128). The label of interval i is the one of the
  // mean sparsity of interval i − 1 (R before the first refresh):
  //   interval  0 1 2 3 4 5
  //   fed       E R T E T R
  //   label     R E R T E T      → segments 1..6 (segment 0 is the prompt)
  const std::vector<float> fed{kE, kR, kT, kE, kT, kR};
  const auto R = ThoughtType::reasoning, E = ThoughtType::execution, T = ThoughtType::transition;
  std::vector<EvictionStep> steps;
  Snapshot before_rule1;
  std::vector<float> seg3_keys;  // layer 1, head 1, segment 3 right before its first demotion
  std::vector<std::int32_t> seg3_positions;
  for (int t = 0; t < 6 * 128; ++t) {
    if (t == 3 * 128) {
      before_rule1 = snapshot(kv);
      kv.table(1).segment_keys(kv.sequence_id(), 1, 3, seg3_keys, seg3_positions);
    }
    REQUIRE(kv.label() == std::vector<ThoughtType>{R, E, R, T, E, T}[t / 128]);
    steps.push_back(host.step(fed[static_cast<std::size_t>(t / 128)]));
    if (t == 3 * 128 - 1) host.check_counts({100, 128, 128, 128});
  }
  CHECK(segment_types(kv) == std::vector<ThoughtType>{R, R, E, R, T, E, T});
  for (int l = 0; l < 2; ++l) {
    for (int s = 1; s < 7; ++s) {
      CHECK(kv.table(l).segment_type(kv.sequence_id(), s) == segment_types(kv)[s]);
      CHECK(kv.table(l).segment_start(kv.sequence_id(), s) == 100 + 128 * (s - 1));
    }
  }
  CHECK(kv.classifier().last_interval_sparsity() == Approx(kR));

  // Rule 1 fires exactly when a T segment opens: steps 384 and 640.
  for (const EvictionStep& s : steps) {
    const bool t_opens = s.step == 384 || s.step == 640;
    INFO("step " << s.step);
    CHECK(s.rule1 == t_opens);
    CHECK(s.evicted() == t_opens);
    CHECK(s.rule2_demotions == 0);
  }
  // Step 384: segments 1–3 demoted once (128 → 64), the prompt protected, the new T token alone.
  REQUIRE(steps[384].changes.size() == 3);
  // Step 640: segments 1–3 a second time (→ 32), segments 4 (T) and 5 (E) once (→ 64).
  REQUIRE(steps[640].changes.size() == 5);
  // After 768 steps segment 6 (T) holds 128 tokens (steps 640..767).
  host.check_counts({100, 32, 32, 32, 64, 64, 128});
  check_block_types(kv);

  // 2 eviction steps × 2 layers out of 768 × 2 layer-steps.
  CHECK(kv.eviction_counter().evicting() == 4);
  CHECK(kv.eviction_counter().total() == 768 * 2);
  CHECK(kv.eviction_fraction() == Approx(2.0 / 768.0));

  SECTION("the demotion of step 384 moved no byte and chose the k-means survivors") {
    // Replay up to step 384 with the same seed and compare against the snapshot taken before it.
    Host replay(small_config());
    replay.prompt(100);
    for (int t = 0; t <= 3 * 128; ++t) replay.step(fed[static_cast<std::size_t>(t / 128)]);
    const Snapshot after = snapshot(replay.kv);
    // The T token waits in staging (its group is not complete), so no block was taken and every
    // block's storage must be bit-identical: eviction only set bits.
    REQUIRE(after.storage.size() == before_rule1.storage.size());
    for (std::size_t i = 0; i < after.storage.size(); ++i)
      CHECK(after.storage[i] == before_rule1.storage[i]);
    // Every survivor reads back bit-identically; 3 × 64 tokens per (layer, head) are gone.
    std::size_t survivors = 0;
    for (const auto& entry : before_rule1.kv) {
      const auto found = after.kv.find(entry.first);
      if (found == after.kv.end()) continue;
      ++survivors;
      REQUIRE(std::memcmp(found->second.data(), entry.second.data(),
                          entry.second.size() * sizeof(float)) == 0);
    }
    CHECK(survivors == before_rule1.kv.size() - 2 * 2 * 3 * 64);
    // Layer 1, head 1, segment 3: the survivors are what segment_eviction_marks keeps from the
    // keys as stored before the step.
    const std::vector<std::int32_t> marks =
        segment_eviction_marks(seg3_keys.data(), seg3_positions.data(),
                               static_cast<std::int64_t>(seg3_positions.size()), 16, 64);
    std::vector<std::int32_t> expected_survivors;
    for (std::int32_t p : seg3_positions) {
      if (!std::binary_search(marks.begin(), marks.end(), p)) expected_survivors.push_back(p);
    }
    std::vector<std::int32_t> survivors3;
    for (const ResidentToken& r : replay.kv.table(1).resident_tokens(replay.kv.sequence_id(), 1, 3))
      survivors3.push_back(r.position);
    std::sort(survivors3.begin(), survivors3.end());
    CHECK(survivors3 == expected_survivors);
  }

  SECTION("new groups refill whole free runs of their type before taking blocks") {
    // R: prompt 100 + segments 1 and 3 (256) = 356 tokens = 22 whole groups (4 staged), all
    // written before any R eviction: 11 blocks of 2 groups.
    for (int l = 0; l < 2; ++l) CHECK(blocks_of_type(kv.table(l), kv.sequence_id(), R) == 11);
    // E: segment 2 (8 groups) lost 64 tokens per head at step 384; segment 5's 8 groups (steps
    // 512..639) refill whatever whole runs that left and take new blocks for the rest. T: segment
    // 4's 8 groups are demoted at step 640, after that step's token was staged; segment 6's 8
    // groups complete at steps 655..767.
    Host replay(small_config());
    replay.prompt(100);
    const std::int32_t seq = replay.kv.sequence_id();
    std::vector<int> e_expected(2), t_expected(2);
    for (int t = 0; t < 6 * 128; ++t) {
      if (t == 512)
        for (int l = 0; l < 2; ++l)
          e_expected[l] = blocks_after_groups(replay.kv.table(l), seq, E, 8);
      if (t == 641)
        for (int l = 0; l < 2; ++l)
          t_expected[l] = blocks_after_groups(replay.kv.table(l), seq, T, 8);
      if (t == 640) {
        for (int l = 0; l < 2; ++l) {
          CHECK(blocks_of_type(replay.kv.table(l), seq, E) == e_expected[l]);
          CHECK(e_expected[l] >= 4);
          CHECK(e_expected[l] <= 8);
        }
      }
      replay.step(fed[static_cast<std::size_t>(t / 128)]);
    }
    for (int l = 0; l < 2; ++l) CHECK(blocks_of_type(replay.kv.table(l), seq, T) == t_expected[l]);
  }

  SECTION("paged attention equals dense attention over the resident tokens") {
    std::mt19937 rng(99);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int l = 0; l < 2; ++l) {
      std::vector<float> q(4 * 16), out(q.size());
      for (float& x : q) x = normal(rng);
      kv.attention(l, q.data(), out.data());
      const std::vector<float> oracle = dense_attention(kv, l, q);
      for (std::size_t i = 0; i < q.size(); ++i) {
        CHECK(out[i] == Approx(oracle[i]).epsilon(2e-5).margin(1e-6));
      }
    }
  }

  SECTION("resident bytes: summed over layers, below an fp16 FullKV of the same tokens") {
    const std::int64_t tokens = 100 + 768;
    CHECK(kv.length() == tokens);
    CHECK(kv.fullkv_fp16_bytes() == 2LL * 2 * tokens * 16 * 2 * 2);
    const std::int64_t sum =
        kv.table(0).resident_bytes().total() + kv.table(1).resident_bytes().total();
    CHECK(kv.resident_bytes().total() == sum);
    CHECK(kv.resident_fraction() == Approx(double(sum) / kv.fullkv_fp16_bytes()));
    CHECK(kv.resident_fraction() < 1.0);
  }
}

TEST_CASE("ThinKV: the prompt is demoted only with evict_prompt") {
  ThinKVConfig c = small_config();
  c.evict_prompt = true;
  Host host(c);
  host.prompt(100);
  // Fed R then T: segment 1 R (initial), 2 R, 3 T (opens at step 256).
  for (int t = 0; t < 257; ++t) host.step(t < 128 ? kR : kT);
  // Rule 1 at step 256 demotes the prompt (100 → 64) and segments 1, 2 (128 → 64).
  host.check_counts({64, 64, 64, 1});
}

TEST_CASE("ThinKV: budget pressure demotes E segments first, down to the floor, then R") {
  ThinKVConfig c = small_config();
  c.budget = 400;
  Host host(c);
  host.prompt(20);
  const auto fed = [](int t) { return t < 128 ? kE : t < 256 ? kR : t < 384 ? kE : kR; };
  // Fed E R E R: segments 1 R (steps 0–127), 2 E (128–255), 3 R (256–383), 4 E (384–).
  // The cache holds 20 + t + 1 tokens after step t until the first demotion.
  std::vector<EvictionStep> steps;
  for (int t = 0; t < 506; ++t) {
    steps.push_back(host.step(fed(t)));
    if (t == 379) host.check_counts({20, 128, 128, 124});  // 400 tokens: at the budget
  }
  const auto only = [](const EvictionStep& s, int segment, int before, int after) {
    INFO("step " << s.step);
    REQUIRE(s.changes.size() == 1);
    CHECK(s.changes[0].segment == segment);
    CHECK(s.changes[0].kept_before == before);
    CHECK(s.changes[0].kept_after == after);
    CHECK(s.rule2_demotions == 1);
    CHECK_FALSE(s.rule1);
  };
  // Step 380: 401 tokens. Closed segments 1 (R) and 2 (E): E goes first, 128 → 64 (337 left).
  only(steps[380], 2, 128, 64);
  // Then each time the cache reaches 401 again, segment 2 shrinks along the schedule:
  //   step 444: 64 → 32 (369); 476: 32 → 16 (385); 492: 16 → 8 (393); 500: 8 → 4 (397).
  only(steps[444], 2, 64, 32);
  only(steps[476], 2, 32, 16);
  only(steps[492], 2, 16, 8);
  only(steps[500], 2, 8, 4);
  // Step 504: segment 2 sits at the floor of 4, so the oldest R segment (1) goes: 128 → 64.
  only(steps[504], 1, 128, 64);
  int evicting = 0;
  for (const EvictionStep& s : steps) evicting += s.evicted() ? 1 : 0;
  CHECK(evicting == 6);
  // Segment 4 holds steps 384..505 = 122 tokens; 20 + 64 + 4 + 128 + 122 = 338.
  host.check_counts({20, 64, 4, 128, 122});
  check_block_types(host.kv);

  // Same tokens without a budget: more blocks in use, more bytes.
  ThinKVConfig unlimited = small_config();
  Host full(unlimited);
  full.prompt(20);
  for (int t = 0; t < 506; ++t) full.step(fed(t));
  CHECK(full.kv.length() == host.kv.length());
  // E tokens: 128 of segment 2 and 122 of segment 4, i.e. 15 whole groups (10 staged). Without
  // a budget they take 8 blocks; with it, segment 2 shrinks to 4 tokens per head, and segment 4's
  // groups refill the whole runs it frees: fewer blocks.
  for (int l = 0; l < 2; ++l) {
    CHECK(blocks_of_type(host.kv.table(l), 0, ThoughtType::execution) < 8);
    CHECK(blocks_of_type(full.kv.table(l), 0, ThoughtType::execution) == 8);
  }
  CHECK(host.kv.resident_bytes().total() < full.kv.resident_bytes().total());
  CHECK(host.kv.resident_fraction() < full.kv.resident_fraction());
}

TEST_CASE("ThinKV: sparsity from the query and from attention rows") {
  ThinKVConfig c = small_config();
  c.num_layers = 2;
  c.kv_heads = 1;
  c.q_heads = 2;
  c.refresh = 2;
  c.reasoning = c.execution = c.transition = BlockFormat::f32;
  ThinKV kv(c);
  // Keys along channel 0 with values 0, -4, -40, -40 (scaled by sqrt(16) = 4 in the logits).
  std::vector<float> keys(4 * 16, 0.0f), values(4 * 16, 1.0f);
  const float k0[4] = {0.0f, -4.0f, -40.0f, -40.0f};
  for (int j = 0; j < 4; ++j) keys[j * 16] = k0[j];
  kv.prefill(0, keys.data(), values.data(), 3);
  kv.prefill(1, keys.data(), values.data(), 3);
  const std::vector<float> step_key(keys.begin() + 48, keys.end()), step_value(16, 1.0f);
  kv.append(0, step_key.data(), step_value.data());
  kv.append(1, step_key.data(), step_value.data());

  // Query head 0 = e0: logits 0, -1, -10, -10; cut = 0 + ln 0.01 = -4.6 → 2 of 4 sparse (0.5).
  // Query head 1 = 0.1 e0: logits 0, -0.1, -1, -1 → none sparse (0). Mean over heads: 0.25.
  std::vector<float> query(2 * 16, 0.0f);
  query[0] = 1.0f;
  query[16] = 0.1f;
  CHECK_FALSE(kv.observe_query(0, query.data()));  // layer 0 is not in L*
  CHECK(kv.needs_sparsity(1));
  CHECK_FALSE(kv.needs_sparsity(0));
  CHECK(kv.observe_query(1, query.data()));
  kv.end_step();
  CHECK(kv.classifier().last_step_sparsity() == Approx(0.25));

  // Attention rows [q_heads = 2, n = 4]: row 0 has 2 of 4 below 1% of its max (0.005 and 0),
  // row 1 none: sparsity 0.25 again; the interval's mean 0.25 < θ1 labels the next interval E.
  const float probs[8] = {1.0f, 0.005f, 0.5f, 0.0f, 0.3f, 0.2f, 0.25f, 0.25f};
  kv.append(0, step_key.data(), step_value.data());
  kv.append(1, step_key.data(), step_value.data());
  CHECK_FALSE(kv.observe_attention(0, probs, 4));
  CHECK(kv.observe_attention(1, probs, 4));
  kv.end_step();
  CHECK(kv.classifier().last_step_sparsity() == Approx(0.25));
  CHECK(kv.label() == ThoughtType::execution);
}

TEST_CASE("ThinKV: config errors name the field and its value") {
  ThinKVConfig c = small_config();
  SECTION("thresholds are required and point to kvsift calibrate") {
    ThinKVConfig d;  // default: NaN thresholds
    d.calibrated_layers = {1};
    REQUIRE_THROWS_WITH(d.validate(), Contains("theta1 = nan") && Contains("kvsift calibrate"));
    REQUIRE_THROWS_AS(ThinKV(d), Error);
  }
  SECTION("calibrated layers are required and in range") {
    c.calibrated_layers = {};
    REQUIRE_THROWS_WITH(c.validate(),
                        Contains("calibrated_layers") && Contains("kvsift calibrate"));
    c.calibrated_layers = {0, 5};
    REQUIRE_THROWS_WITH(c.validate(),
                        Contains("calibrated_layers[1] = 5") && Contains("num_layers = 2"));
    c.calibrated_layers = {1, 1};
    REQUIRE_THROWS_WITH(c.validate(), Contains("layer 1 is listed twice"));
  }
  SECTION("threshold order") {
    c.theta1 = 0.8f;
    REQUIRE_THROWS_WITH(c.validate(), Contains("theta1 = 0.8") && Contains("theta2 = 0.7"));
  }
  SECTION("geometry") {
    c.q_heads = 3;
    REQUIRE_THROWS_WITH(c.validate(), Contains("q_heads (3)") && Contains("kv_heads (2)"));
    c = small_config();
    c.head_dim = 20;
    REQUIRE_THROWS_WITH(c.validate(), Contains("head_dim (20)"));
    c = small_config();
    c.num_layers = 0;
    REQUIRE_THROWS_WITH(c.validate(), Contains("num_layers must be in [1, 1024], got 0"));
  }
  SECTION("budget, refresh, schedule, table, k-means") {
    c.budget = 0;
    REQUIRE_THROWS_WITH(c.validate(), Contains("budget must be > 0") && Contains("got 0"));
    c = small_config();
    c.refresh = -1;
    REQUIRE_THROWS_WITH(c.validate(), Contains("refresh (tau) must be > 0 steps, got -1"));
    c = small_config();
    c.schedule = {64, 2};
    REQUIRE_THROWS_WITH(c.validate(), Contains("schedule[1] = 2"));
    c = small_config();
    c.block_size = 24;
    REQUIRE_THROWS_WITH(c.validate(), Contains("block_size (24)"));
    c = small_config();
    c.staging = DType::f32;  // §3.4: the staging buffer is 16-bit
    REQUIRE_THROWS_WITH(c.validate(), Contains("staging must be f16 or bf16") && Contains("f32"));
    c.staging = DType::f16;
    REQUIRE(ThinKV(c).table(1).config().staging == DType::f16);
    c = small_config();
    REQUIRE(ThinKV(c).table(0).config().refill == RefillRule::run);  // default: §3.4's rule
    c.refill = RefillRule::regroup;
    c.regroup_min_free = 12;
    REQUIRE(ThinKV(c).table(1).config().refill == RefillRule::regroup);
    REQUIRE(ThinKV(c).table(1).config().regroup_min_free == 12);
    c.regroup_min_free = 16;
    REQUIRE_THROWS_WITH(c.validate(), Contains("regroup_min_free must be in [1, 15], got 16"));
    c = small_config();
    c.pool_blocks = 0;
    REQUIRE_THROWS_WITH(c.validate(), Contains("pool_blocks must be > 0, got 0"));
    c.pool_blocks = 2147483647;  // used to attempt allocations of hundreds of GB
    REQUIRE_THROWS_WITH(c.validate(), Contains("pool_blocks (2147483647) exceeds kMaxPoolBlocks"));
    c = small_config();
    c.num_layers = 1000;
    c.pool_blocks = 1 << 20;
    REQUIRE_THROWS_WITH(c.validate(), Contains("num_layers * pool_blocks (1000 * 1048576"));
    c = small_config();
    c.global_factors = {1.0f, 2.0f, 3.0f};
    REQUIRE_THROWS_WITH(c.validate(),
                        Contains("global_factors has 3") && Contains("num_layers * kv_heads = 4"));
    c = small_config();
    c.kmeans_iterations = 0;
    REQUIRE_THROWS_WITH(c.validate(), Contains("kmeans_iterations must be > 0, got 0"));
  }
}

TEST_CASE("ThinKV: driving errors") {
  Host host(small_config());
  ThinKV& kv = host.kv;
  const std::vector<float> k = host.random_rows(1), v = host.random_rows(1);
  SECTION("layers must have the same prompt") {
    kv.prefill(0, k.data(), v.data(), 1);
    REQUIRE_THROWS_WITH(kv.append(0, k.data(), v.data()),
                        Contains("layer 1 has a prompt of 0 tokens but layer 0 has 1"));
  }
  SECTION("each layer once per step, all layers and all L* before end_step") {
    kv.append(0, k.data(), v.data());
    REQUIRE_THROWS_WITH(kv.append(0, k.data(), v.data()),
                        Contains("layer 0 already has its token for step 0"));
    REQUIRE_THROWS_WITH(kv.end_step(), Contains("layer 1 has no token for step 0"));
    kv.append(1, k.data(), v.data());
    REQUIRE_THROWS_WITH(kv.end_step(), Contains("no layer observed"));
    kv.observe_sparsity(1, 0.5f);
    kv.end_step();
    REQUIRE_THROWS_WITH(kv.prefill(0, k.data(), v.data(), 1),
                        Contains("decoding has started (1 steps)"));
  }
  SECTION("layer out of range and bad sparsity") {
    REQUIRE_THROWS_WITH(kv.append(2, k.data(), v.data()),
                        Contains("layer 2 outside [0, num_layers = 2)"));
    REQUIRE_THROWS_WITH(kv.observe_sparsity(1, 1.5f), Contains("1.5"));
    REQUIRE_THROWS_WITH(kv.prefill(0, k.data(), v.data(), -1), Contains("n must be >= 0, got -1"));
  }
}
