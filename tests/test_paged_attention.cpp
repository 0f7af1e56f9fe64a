// Paged decode attention over a ThoughtBlockTable equals dense attention over the retained tokens
// (docs/algorithms.md §3.4). The oracle keeps its own model of which token is live in which head
// and where the allocation rule (lowest free slot of the token's type, per head) must put it,
// gathers the retained tokens into a contiguous buffer and runs a plain two-pass softmax in double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "catch.hpp"
#include "kvsift/paged/paged_attention.hpp"
#include "kvsift/paged/thought_block_table.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// Dense GQA attention of one query over gathered rows, in double.
// query: [q_heads, D]; keys/values[h]: [n_h, D]; out: [q_heads, D]
std::vector<float> dense_attention(const std::vector<float>& query, std::int64_t q_heads,
                                   std::int64_t D, const std::vector<std::vector<float>>& keys,
                                   const std::vector<std::vector<float>>& values, float scale) {
  const std::int64_t kv_heads = static_cast<std::int64_t>(keys.size());
  const std::int64_t group = q_heads / kv_heads;
  std::vector<float> out(static_cast<std::size_t>(q_heads * D), 0.0f);
  for (std::int64_t q = 0; q < q_heads; ++q) {
    const std::vector<float>& K = keys[q / group];
    const std::vector<float>& V = values[q / group];
    const std::int64_t n = static_cast<std::int64_t>(K.size()) / D;
    if (n == 0) continue;
    std::vector<double> logit(n);
    double mx = -1e300;
    for (std::int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (std::int64_t d = 0; d < D; ++d) dot += double(query[q * D + d]) * K[j * D + d];
      logit[j] = dot * scale;
      mx = std::max(mx, logit[j]);
    }
    double sum = 0;
    for (double& l : logit) sum += (l = std::exp(l - mx));
    for (std::int64_t d = 0; d < D; ++d) {
      double acc = 0;
      for (std::int64_t j = 0; j < n; ++j) acc += logit[j] * V[j * D + d];
      out[q * D + d] = static_cast<float>(acc / sum);
    }
  }
  return out;
}

void require_close(const std::vector<float>& got, const std::vector<float>& want, float tol) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": paged " << got[i] << ", dense " << want[i]);
    REQUIRE(std::fabs(got[i] - want[i]) <= tol * (1.0f + std::fabs(want[i])));
  }
}

struct Token {
  std::vector<float> key, value;  // [D] of one head
};

// The current address of `position` in head h (addresses move when a block is returned).
SlotAddress address_of(const ThoughtBlockTable& table, std::int32_t seq, std::int32_t h,
                       std::int32_t position) {
  for (const ResidentToken& r : table.resident_tokens(seq, h))
    if (r.position == position) return r.address;
  FAIL("position " << position << " is not resident in head " << h);
  return {};
}

// Runs random appends (random thought types), per-head evictions (so slots get reused and blocks
// freed) and queries; checks the retained set against a model and attention against the dense
// oracle. With `quantized`, the oracle reads each retained token back as stored (dequantized, or
// at 16 bits while staged: the same values the table attends to); in full precision it uses the
// original floats. Allocation itself is tested in test_thought_block_table.cpp.
void run_property_case(std::uint32_t seed, bool quantized) {
  std::mt19937 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint32_t>(n)); };
  ThoughtBlockTableConfig c;
  c.kv_heads = 1 + pick(3);
  c.head_dim = 16 * (1 + pick(2));
  c.block_size = 16 * (1 + pick(2));
  c.num_blocks = 64;
  if (!quantized) c.reasoning = c.execution = c.transition = BlockFormat::f32;
  const std::int64_t H = c.kv_heads, D = c.head_dim, S = c.block_size;
  const std::int64_t q_heads = H * (1 + pick(3));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  INFO("seed " << seed << " kv_heads " << H << " q_heads " << q_heads << " head_dim " << D
               << " block_size " << S << (quantized ? " R4E4T2" : " f32"));
  ThoughtBlockTable table(c);
  const std::int32_t seq = table.create_sequence();
  std::normal_distribution<float> normal(0.0f, 1.0f);

  std::vector<std::map<std::int32_t, Token>> live(H);  // per head: position -> token
  ThoughtType type = ThoughtType::reasoning;
  table.open_segment(seq, type);
  int queries = 0;
  for (int step = 0; step < 400; ++step) {
    const int op = pick(10);
    if (op == 0) {
      type = static_cast<ThoughtType>(pick(3));
      table.open_segment(seq, type);
    } else if (op <= 5) {
      std::vector<float> k(H * D), v(H * D);
      for (float& x : k) x = normal(rng) * 2.0f;
      for (float& x : v) x = normal(rng);
      const std::int32_t pos = table.append(seq, k.data(), v.data(), H, D);
      for (std::int64_t h = 0; h < H; ++h) {
        live[h][pos] = Token{std::vector<float>(k.begin() + h * D, k.begin() + (h + 1) * D),
                             std::vector<float>(v.begin() + h * D, v.begin() + (h + 1) * D)};
      }
    } else if (op <= 7) {
      // Evict a random subset of one head, by position or by address.
      const std::int64_t h = pick(static_cast<int>(H));
      std::vector<std::int32_t> victims;
      for (const auto& [pos, tok] : live[h])
        if (pick(4) == 0) victims.push_back(pos);
      if (pick(2)) {
        table.evict_positions(seq, static_cast<std::int32_t>(h), victims);
      } else {
        for (std::int32_t p : victims) {
          const std::int32_t hh = static_cast<std::int32_t>(h);
          table.evict(seq, hh, address_of(table, seq, hh, p));
        }
      }
      for (std::int32_t p : victims) live[h].erase(p);
    } else {
      // Query: gather the model's retained tokens and compare.
      std::vector<std::vector<float>> keys(H), values(H);
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int32_t hh = static_cast<std::int32_t>(h);
        REQUIRE(table.live_tokens(seq, hh) == static_cast<std::int64_t>(live[h].size()));
        std::vector<float> kq(D), vq(D);
        for (const auto& [pos, tok] : live[h]) {
          if (quantized) {
            table.read_token(seq, hh, address_of(table, seq, hh, pos), kq.data(), vq.data());
          } else {
            kq = tok.key;
            vq = tok.value;
          }
          keys[h].insert(keys[h].end(), kq.begin(), kq.end());
          values[h].insert(values[h].end(), vq.begin(), vq.end());
        }
      }
      std::vector<float> query(q_heads * D);
      for (float& x : query) x = normal(rng);
      std::vector<float> out(q_heads * D, -1.0f);
      paged_decode_attention(table, seq, query.data(), q_heads, D, scale, out.data());
      require_close(out, dense_attention(query, q_heads, D, keys, values, scale), 2e-5f);
      ++queries;
    }
  }
  REQUIRE(queries > 0);
  REQUIRE(table.used_blocks() == table.num_blocks(seq));
}

}  // namespace

TEST_CASE("paged attention: hand-worked two-token example", "[paged_attention]") {
  ThoughtBlockTableConfig c;
  c.kv_heads = 1;
  c.head_dim = 16;
  c.block_size = 16;
  c.num_blocks = 1;
  c.reasoning = BlockFormat::f32;
  ThoughtBlockTable t(c);
  const std::int32_t seq = t.create_sequence();
  t.open_segment(seq, ThoughtType::reasoning);
  // q = e0, k1 = 0, k2 = ln(3)·e0 with scale 1: logits 0 and ln 3, weights 1/4 and 3/4.
  std::vector<float> q(16, 0.0f), k1(16, 0.0f), k2(16, 0.0f), v1(16, 0.0f), v2(16, 0.0f);
  q[0] = 1.0f;
  k2[0] = std::log(3.0f);
  v1[1] = 4.0f;
  v2[1] = 8.0f;
  v2[2] = 2.0f;
  t.append(seq, k1.data(), v1.data(), 1, 16);
  t.append(seq, k2.data(), v2.data(), 1, 16);
  std::vector<float> out(16);
  paged_decode_attention(t, seq, q.data(), 1, 16, 1.0f, out.data());
  REQUIRE(std::fabs(out[1] - (0.25f * 4 + 0.75f * 8)) < 1e-5f);
  REQUIRE(std::fabs(out[2] - 0.75f * 2) < 1e-5f);
  REQUIRE(out[0] == 0.0f);
  // Evicting the second token masks it out although its bytes are still in the block.
  t.evict(seq, 0, SlotAddress{0, 1});
  paged_decode_attention(t, seq, q.data(), 1, 16, 1.0f, out.data());
  REQUIRE(std::fabs(out[1] - 4.0f) < 1e-6f);
  REQUIRE(out[2] == 0.0f);
  // Nothing live: zeros (our choice).
  t.evict(seq, 0, SlotAddress{0, 0});
  out.assign(16, 7.0f);
  paged_decode_attention(t, seq, q.data(), 1, 16, 1.0f, out.data());
  REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("paged attention equals dense attention over retained tokens (full precision)",
          "[paged_attention]") {
  for (std::uint32_t seed = 1; seed <= 12; ++seed) run_property_case(seed, false);
}

TEST_CASE("paged attention equals dense attention over retained tokens (R4 E4 T2)",
          "[paged_attention]") {
  for (std::uint32_t seed = 101; seed <= 112; ++seed) run_property_case(seed, true);
}

TEST_CASE("paged attention of quantized blocks stays near full precision", "[paged_attention]") {
  // The same tokens in an R4 E4 T2 table and an f32 table: outputs differ by quantization error
  // only (a loose bound: this guards against dequantizing a block with the wrong format).
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  ThoughtBlockTableConfig qc;
  qc.kv_heads = 2;
  qc.head_dim = 32;
  qc.block_size = 32;
  qc.num_blocks = 16;
  qc.transition = BlockFormat::nvfp4;  // R4 E4 T4: ternary's error would swamp the check
  ThoughtBlockTableConfig fc = qc;
  fc.reasoning = fc.execution = fc.transition = BlockFormat::f32;
  ThoughtBlockTable tq(qc), tf(fc);
  const std::int32_t sq = tq.create_sequence(), sf = tf.create_sequence();
  for (int i = 0; i < 128; ++i) {
    if (i % 32 == 0) {
      const ThoughtType type = static_cast<ThoughtType>((i / 32) % 3);
      tq.open_segment(sq, type);
      tf.open_segment(sf, type);
    }
    std::vector<float> k(64), v(64);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    tq.append(sq, k.data(), v.data(), 2, 32);
    tf.append(sf, k.data(), v.data(), 2, 32);
  }
  std::vector<float> query(4 * 32), oq(4 * 32), of(4 * 32);
  for (float& x : query) x = normal(rng);
  paged_decode_attention(tq, sq, query.data(), 4, 32, 0.25f, oq.data());
  paged_decode_attention(tf, sf, query.data(), 4, 32, 0.25f, of.data());
  double err = 0, ref = 0;
  for (std::size_t i = 0; i < of.size(); ++i) {
    err += (oq[i] - of[i]) * double(oq[i] - of[i]);
    ref += of[i] * double(of[i]);
  }
  REQUIRE(std::sqrt(err / ref) < 0.25);
  REQUIRE(std::sqrt(err / ref) > 0.0);  // it did run on quantized data
}

TEST_CASE("paged attention rejects bad arguments with the values named", "[paged_attention]") {
  ThoughtBlockTableConfig c;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.block_size = 16;
  c.num_blocks = 2;
  ThoughtBlockTable t(c);
  const std::int32_t seq = t.create_sequence();
  std::vector<float> q(6 * 32), out(6 * 32);
  REQUIRE_THROWS_WITH(paged_decode_attention(t, seq, q.data(), 3, 16, 1.0f, out.data()),
                      Contains("q_heads (3) must be a positive multiple of kv_heads (2)"));
  REQUIRE_THROWS_WITH(paged_decode_attention(t, seq, q.data(), 4, 32, 1.0f, out.data()),
                      Contains("query head_dim (32) differs from the table's head_dim (16)"));
  REQUIRE_THROWS_WITH(paged_decode_attention(t, 3, q.data(), 4, 16, 1.0f, out.data()),
                      Contains("unknown sequence 3"));
  REQUIRE_THROWS_WITH(paged_decode_attention(t, seq, q.data(), 4, 16, -1.0f, out.data()),
                      Contains("softmax_scale (-1)"));
}
