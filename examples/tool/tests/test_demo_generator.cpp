// Tests of the `kvsift demo` machinery: sentence plans (real and synthetic), the synthetic decode's
// planted structure, the demo's cache bookkeeping, recall and eviction-shape metrics, and a whole
// run with tiny policies defined here, checked against a brute-force oracle.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "demo_metrics.hpp"
#include "demo_policy.hpp"
#include "demo_runner.hpp"
#include "demo_sentences.hpp"
#include "demo_table.hpp"

using namespace kvsift;
using namespace kvsift::demo;
using Catch::Matchers::Contains;

namespace {

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ab += double(a[i]) * b[i];
    aa += double(a[i]) * a[i];
    bb += double(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

// Every step of a decode, kept: keys[t] is [layers, batch, kv_heads, head_dim] etc.
std::vector<DecodeStep> all_steps(SyntheticDecode& decode) {
  std::vector<DecodeStep> steps;
  while (!decode.done()) {
    steps.emplace_back();
    decode.next(steps.back());
  }
  return steps;
}

std::vector<float> key_of(const std::vector<DecodeStep>& steps, int l, int b, int h,
                          std::int64_t t) {
  const DecodeStep& s = steps[t];
  return std::vector<float>(s.key(l, b, h), s.key(l, b, h) + s.head_dim);
}

// Keeps the first budget - window tokens forever plus the last `window`: its resident set after a
// compression at length S is [0, budget - window) ∪ [S - window, S), known in closed form.
class KeepFirstPolicy final : public DemoPolicy {
 public:
  KeepFirstPolicy(int budget, int window, int buffer)
      : budget_(budget), window_(window), buffer_(buffer) {}
  std::string name() const override { return "keep-first"; }
  bool should_compress(const KVCacheView& kv) override { return kv.length(0) >= budget_ + buffer_; }
  KeepPlan select(const StepInputs& in) override {
    const KVCacheView& kv = in.kv;
    std::vector<std::int32_t> src(kv.lengths, kv.lengths + kv.batch());
    std::vector<std::int32_t> kept(src.size(), budget_);
    KeepPlan plan(kv.batch(), kv.kv_heads(), kv.capacity(), src, kept, window_);
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      std::vector<std::int32_t> row;
      for (std::int32_t j = 0; j < budget_ - window_; ++j) row.push_back(j);
      for (std::int32_t j = src[b] - window_; j < src[b]; ++j) row.push_back(j);
      for (std::int64_t h = 0; h < kv.kv_heads(); ++h) plan.append_row(row);
    }
    return plan;
  }

 private:
  int budget_, window_, buffer_;
};

class NeverCompress final : public DemoPolicy {
 public:
  std::string name() const override { return "never"; }
  bool should_compress(const KVCacheView&) override { return false; }
  KeepPlan select(const StepInputs& in) override { return KeepPlan::keep_all(in.kv); }
  std::vector<std::pair<std::string, std::string>> extra_columns() const override {
    return {{"note", "reference"}};
  }
};

GeneratorConfig small_generator(int batch = 2, int layers = 2) {
  GeneratorConfig g;
  g.batch = batch;
  g.layers = layers;
  g.q_heads = 4;
  g.kv_heads = 2;
  g.head_dim = 16;
  g.seed = 7;
  return g;
}

std::vector<SentencePlan> synthetic_plans(int batch, std::int64_t length) {
  std::vector<SentencePlan> plans;
  for (int b = 0; b < batch; ++b) plans.push_back(synthetic_sentence_plan(length, 11 + b));
  return plans;
}

}  // namespace

TEST_CASE("sentence plans end after each delimiter and at the stream's end", "[demo]") {
  const std::vector<std::int32_t> delims = r1qwen_sentence_delimiters();
  SentencePlan p = sentence_plan_from_tokens({5, 198, 7, 8, 271, 9}, delims);
  REQUIRE(p.sentence_ends == std::vector<std::int32_t>{2, 5, 6});
  CHECK(p.sentence_start(1) == 2);
  CHECK(p.sentence_length(1) == 3);
  // A delimiter as the last token closes the last sentence; nothing more is added.
  REQUIRE(sentence_plan_from_tokens({1, 1939}, delims).sentence_ends ==
          std::vector<std::int32_t>{2});
  // No delimiter: one sentence, the whole stream.
  REQUIRE(sentence_plan_from_tokens({1, 2, 3}, delims).sentence_ends ==
          std::vector<std::int32_t>{3});
}

TEST_CASE("synthetic sentence plans cover the decode with lengths 6..53", "[demo]") {
  const SentencePlan p = synthetic_sentence_plan(1000, 3);
  REQUIRE(p.length() == 1000);
  REQUIRE(p.sentence_ends.back() == 1000);
  for (std::int64_t s = 0; s + 1 < p.sentences(); ++s) {
    CHECK(p.sentence_length(s) >= 6);
    CHECK(p.sentence_length(s) <= 53);
  }
  REQUIRE(synthetic_sentence_plan(1000, 3).sentence_ends == p.sentence_ends);
  REQUIRE(synthetic_sentence_plan(1000, 4).sentence_ends != p.sentence_ends);
  REQUIRE_THROWS_WITH(synthetic_sentence_plan(0, 1), Contains("length must be >= 1, got 0"));
}

TEST_CASE("token streams concatenate problems from a seed-chosen start and wrap", "[demo]") {
  const std::vector<std::vector<std::int32_t>> problems = {{1, 2}, {3}};
  // seed 0, sequence 0 starts at problem 0; sequence 1 at (37 mod 2) = 1.
  REQUIRE(token_stream_for_sequence(problems, 5, 0, 0) == std::vector<std::int32_t>{1, 2, 3, 1, 2});
  REQUIRE(token_stream_for_sequence(problems, 5, 0, 1) == std::vector<std::int32_t>{3, 1, 2, 3, 1});
}

TEST_CASE("token files load as prompt + solution per line; bad ids name the line", "[demo]") {
  const std::string path = "test_demo_tokens.tsv";
  {
    std::ofstream out(path);
    out << "1 2\t3 4\n10\t20 198\n";
  }
  const auto problems = load_token_streams(path);
  REQUIRE(problems.size() == 2);
  REQUIRE(problems[0] == std::vector<std::int32_t>{1, 2, 3, 4});
  REQUIRE(problems[1] == std::vector<std::int32_t>{10, 20, 198});
  {
    std::ofstream out(path);
    out << "1 2\t3\n4 x5\t6\n";
  }
  REQUIRE_THROWS_WITH(load_token_streams(path), Contains("line 2") && Contains("'x5'"));
  std::remove(path.c_str());
  REQUIRE_THROWS_WITH(load_token_streams("no/such/file.tsv"), Contains("no/such/file.tsv"));
}

TEST_CASE("the real MATH-500 streams give real sentence lengths", "[demo]") {
  const auto problems =
      load_token_streams(std::string(KVSIFT_DATA_DIR) + "/math500_r1qwen_tokens.tsv");
  REQUIRE(problems.size() == 500);
  const std::vector<std::int32_t> stream = token_stream_for_sequence(problems, 4096, 1, 0);
  const SentencePlan p = sentence_plan_from_tokens(stream, r1qwen_sentence_delimiters());
  // Independent count: every delimiter id closes one sentence, plus a trailing open one.
  const std::set<std::int32_t> delims = {198, 624, 340, 271, 382, 692, 1939};
  std::int64_t closers = 0;
  for (std::int32_t id : stream) closers += delims.count(id);
  const bool open_tail = delims.count(stream.back()) == 0;
  REQUIRE(p.sentences() == closers + (open_tail ? 1 : 0));
  for (std::int64_t s = 0; s + 1 < p.sentences(); ++s) {
    CHECK(delims.count(stream[p.sentence_ends[s] - 1]) == 1);
  }
}

TEST_CASE("the synthetic decode is a pure function of its seed", "[demo]") {
  GeneratorConfig g = small_generator();
  SyntheticDecode a(g, synthetic_plans(2, 40)), b(g, synthetic_plans(2, 40));
  g.seed = 8;
  SyntheticDecode c(g, synthetic_plans(2, 40));
  const auto sa = all_steps(a), sb = all_steps(b), sc = all_steps(c);
  REQUIRE(sa.size() == 40);
  bool differs = false;
  for (std::size_t t = 0; t < sa.size(); ++t) {
    REQUIRE(sa[t].keys == sb[t].keys);
    REQUIRE(sa[t].queries == sb[t].queries);
    REQUIRE(sa[t].values == sb[t].values);
    differs = differs || sa[t].keys != sc[t].keys;
  }
  REQUIRE(differs);
  DecodeStep extra;
  REQUIRE_THROWS_WITH(a.next(extra), Contains("all 40 tokens"));
}

TEST_CASE("planted near-repeats copy their original; sentences share a topic", "[demo]") {
  GeneratorConfig g = small_generator(1, 1);
  g.head_dim = 64;
  g.repeat_probability = 0.5f;
  SyntheticDecode decode(g, synthetic_plans(1, 1500));
  const auto steps = all_steps(decode);
  const SentencePlan& plan = decode.plan(0);
  int repeats_checked = 0;
  double same_sentence = 0, unrelated = 0;
  int n_same = 0, n_unrelated = 0;
  for (std::int64_t s = 1; s < plan.sentences(); ++s) {
    const std::int32_t o = decode.repeat_of(0, s);
    const std::int32_t start = plan.sentence_start(s);
    if (o >= 0) {
      REQUIRE(o < s);
      // Token j of the repeat near-copies token j (cyclically) of the original.
      for (std::int32_t j = 0; j < plan.sentence_length(s); ++j) {
        const std::int64_t orig = plan.sentence_start(o) + j % plan.sentence_length(o);
        CHECK(cosine(key_of(steps, 0, 0, 0, start + j), key_of(steps, 0, 0, 0, orig)) > 0.9);
      }
      ++repeats_checked;
    } else if (decode.repeat_of(0, s - 1) < 0) {
      same_sentence += cosine(key_of(steps, 0, 0, 0, start), key_of(steps, 0, 0, 0, start + 1));
      ++n_same;
      unrelated += cosine(key_of(steps, 0, 0, 0, start), key_of(steps, 0, 0, 0, start - 1));
      ++n_unrelated;
    }
  }
  REQUIRE(repeats_checked >= 5);
  // topic_weight² / (topic_weight² + token_weight²) = 0.4225 / 1.0001 for two tokens of a sentence.
  CHECK(std::fabs(same_sentence / n_same - 0.42) < 0.08);
  CHECK(std::fabs(unrelated / n_unrelated) < 0.1);
}

TEST_CASE("look-back queries put FullKV's top-10 on the target and current sentences", "[demo]") {
  GeneratorConfig g = small_generator(1, 1);
  g.head_dim = 64;
  SyntheticDecode decode(g, synthetic_plans(1, 600));
  const auto steps = all_steps(decode);
  std::int64_t on_target = 0, total = 0;
  for (std::int64_t t = 300; t < 600; t += 7) {
    const std::int32_t s = decode.sentence_at(0, t);
    const std::int32_t look = decode.lookback_target(0, s);
    if (look < 0) continue;
    // Brute-force top-10 over keys 0..t of KV head 0 for query head 0.
    std::vector<std::pair<float, std::int64_t>> scored;
    for (std::int64_t j = 0; j <= t; ++j) {
      float dot = 0;
      for (int d = 0; d < g.head_dim; ++d)
        dot += steps[t].query(0, 0, 0)[d] * steps[j].key(0, 0, 0)[d];
      scored.push_back({-dot, j});
    }
    std::sort(scored.begin(), scored.end());
    for (int i = 0; i < 10; ++i) {
      const std::int32_t where = decode.sentence_at(0, scored[i].second);
      const std::int32_t root = [&](std::int32_t x) {  // a near-repeat of the target counts too
        while (decode.repeat_of(0, x) >= 0) x = decode.repeat_of(0, x);
        return x;
      }(where);
      const std::int32_t look_root = [&](std::int32_t x) {
        while (decode.repeat_of(0, x) >= 0) x = decode.repeat_of(0, x);
        return x;
      }(look);
      on_target += (where == look || root == look_root || where == s);
      ++total;
    }
  }
  REQUIRE(total >= 100);
  CHECK(static_cast<double>(on_target) / total > 0.9);
}

TEST_CASE("generator config errors name the values", "[demo]") {
  GeneratorConfig g;
  g.q_heads = 6;
  g.kv_heads = 4;
  REQUIRE_THROWS_WITH(g.validate(), Contains("q_heads (6)") && Contains("kv_heads (4)"));
  g = GeneratorConfig{};
  g.repeat_probability = 1.5f;
  REQUIRE_THROWS_WITH(g.validate(), Contains("repeat_probability") && Contains("1.5"));
  DemoConfig d;
  d.budget = 8;
  d.window = 8;
  REQUIRE_THROWS_WITH(d.validate(), Contains("budget (8) must exceed window (8)"));
}

TEST_CASE("the demo cache appends, grows and compacts positions with the rows", "[demo]") {
  const GeneratorConfig g = small_generator(2, 1);
  SyntheticDecode decode(g, synthetic_plans(2, 30));
  const auto steps = all_steps(decode);
  DemoLayerCache cache(2, g.kv_heads, 4, g.head_dim, DType::f32);  // grows 4 -> 8 -> 16 -> 32
  for (const auto& s : steps) cache.append(s, 0);
  REQUIRE(cache.length(0) == 30);
  REQUIRE(cache.view().capacity() == 32);
  REQUIRE(cache.resident_bytes() == 2 * 30 * g.kv_heads * g.head_dim * 2 * 4);
  // Keep {1, 5, 28, 29} in sequence 0 and everything in sequence 1.
  KeepPlan plan(2, g.kv_heads, 32, {30, 30}, {4, 30}, 2);
  for (int h = 0; h < g.kv_heads; ++h) plan.append_row({1, 5, 28, 29});
  std::vector<std::int32_t> all(30);
  for (int i = 0; i < 30; ++i) all[i] = i;
  for (int h = 0; h < g.kv_heads; ++h) plan.append_row(all);
  cache.apply(plan);
  REQUIRE(cache.length(0) == 4);
  const std::vector<std::int32_t> expect = {1, 5, 28, 29};
  for (int h = 0; h < g.kv_heads; ++h) {
    REQUIRE(std::vector<std::int32_t>(cache.positions(0, h), cache.positions(0, h) + 4) == expect);
    for (int i = 0; i < 4; ++i) {  // the rows moved with their positions
      const float* row = cache.view().keys.ptr<float>(0, h, i);
      REQUIRE(std::equal(row, row + g.head_dim, steps[expect[i]].key(0, 0, h)));
    }
  }
  REQUIRE(cache.positions(1, 1)[29] == 29);
}

TEST_CASE("the query window hands out the last W queries oldest first", "[demo]") {
  const GeneratorConfig g = small_generator(2, 2);
  SyntheticDecode decode(g, synthetic_plans(2, 10));
  const auto steps = all_steps(decode);
  QueryWindow w(2, g.q_heads, 3, g.head_dim, DType::f32);
  for (const auto& s : steps) w.push(s, 1);
  const TensorView v = w.view();
  REQUIRE(v.shape_string() == "[2, 4, 3, 16]");
  for (int b = 0; b < 2; ++b) {
    for (int q = 0; q < g.q_heads; ++q) {
      for (int i = 0; i < 3; ++i) {
        const float* got = v.ptr<float>(b, q, i);
        REQUIRE(std::equal(got, got + g.head_dim, steps[7 + i].query(1, b, q)));
      }
    }
  }
}

TEST_CASE("top-k, recall and eviction shapes on hand-made cases", "[demo]") {
  // keys [4, 2]; query (1, 0): logits 3, -1, 3, 2 -> top-2 {0, 2} (tie: lower first), top-3 + 3.
  const float keys[] = {3, 0, -1, 5, 3, 1, 2, 9};
  const float query[] = {1, 0};
  REQUIRE(top_k_attended(query, keys, 4, 2, 2) == std::vector<std::int32_t>{0, 2});
  REQUIRE(top_k_attended(query, keys, 4, 2, 3) == std::vector<std::int32_t>{0, 2, 3});
  REQUIRE(top_k_attended(query, keys, 2, 2, 10) == std::vector<std::int32_t>{0, 1});
  const std::int32_t resident[] = {0, 3, 7};
  REQUIRE(recall_of({0, 2, 3, 5}, resident, 3) == 0.5);  // 2 of 4, exact in binary

  SentencePlan plan;
  plan.token_ids.assign(10, -1);
  plan.sentence_ends = {3, 6, 10};
  const std::vector<std::int32_t> before = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, after = {3, 4, 9};
  // Sentence 0 leaves whole (3 tokens); 5 and 6, 7, 8 leave as fragments.
  EvictionShape s = eviction_shape(before.data(), 10, after.data(), 3, plan, 10);
  REQUIRE(s.whole_sentence_tokens == 3);
  REQUIRE(s.fragment_tokens == 4);
  // Sentence 2 still open (now = 8): even fully evicted it is a fragment.
  const std::vector<std::int32_t> b2 = {0, 1, 2, 6, 7}, a2 = {};
  s = eviction_shape(b2.data(), 5, a2.data(), 0, plan, 8);
  REQUIRE(s.whole_sentence_tokens == 3);
  REQUIRE(s.fragment_tokens == 2);
  // A sentence that had already lost tokens is a fragment when its rest leaves.
  const std::vector<std::int32_t> b3 = {3, 5}, a3 = {};
  s = eviction_shape(b3.data(), 2, a3.data(), 0, plan, 10);
  REQUIRE(s.whole_sentence_tokens == 0);
  REQUIRE(s.fragment_tokens == 2);
}

TEST_CASE("a demo run matches a brute-force oracle for a policy of known residency", "[demo]") {
  DemoConfig cfg;
  cfg.generator = small_generator(2, 2);
  cfg.dtype = DType::f32;
  cfg.budget = 24;
  cfg.window = 4;
  cfg.buffer = 16;
  cfg.recall_k = 5;
  cfg.recall_steps = 3;
  const std::int64_t T = 100;
  std::vector<std::unique_ptr<DemoPolicy>> policies;
  policies.push_back(std::make_unique<NeverCompress>());
  policies.push_back(std::make_unique<KeepFirstPolicy>(cfg.budget, cfg.window, cfg.buffer));
  SyntheticDecode decode(cfg.generator, synthetic_plans(2, T));
  const DemoResult r = run_demo(cfg, decode, policies);

  // Oracle: the same decode, brute force. Compressions at lengths 40: t = 39, 55, 71, 87.
  SyntheticDecode again(cfg.generator, synthetic_plans(2, T));
  const auto steps = all_steps(again);
  const std::vector<std::int64_t> triggers = {39, 55, 71, 87};
  const GeneratorConfig& g = cfg.generator;
  const int G = g.q_heads / g.kv_heads;
  double recall_sum = 0;
  std::int64_t samples = 0;
  for (std::int64_t c : triggers) {
    for (std::int64_t t = c + 1; t <= c + cfg.recall_steps && t < T; ++t) {
      for (int l = 0; l < g.layers; ++l) {
        for (int b = 0; b < g.batch; ++b) {
          for (int q = 0; q < g.q_heads; ++q) {
            std::vector<std::pair<float, std::int64_t>> scored;
            for (std::int64_t j = 0; j <= t; ++j) {
              float dot = 0;
              for (int d = 0; d < g.head_dim; ++d)
                dot += steps[t].query(l, b, q)[d] * steps[j].key(l, b, q / G)[d];
              scored.push_back({-dot, j});
            }
            std::sort(scored.begin(), scored.end());
            int hit = 0;
            for (int i = 0; i < cfg.recall_k; ++i) {
              const std::int64_t p = scored[i].second;
              // Resident after the compression at c: the first budget - window, then c-3..t.
              hit += p < cfg.budget - cfg.window || p > c - cfg.window;
            }
            recall_sum += double(hit) / cfg.recall_k;
            ++samples;
          }
        }
      }
    }
  }
  REQUIRE(r.tokens == T);
  const std::int64_t row_bytes = g.kv_heads * g.head_dim * 2 * 4;  // K+V, f32, per token per layer
  REQUIRE(r.full_bytes == T * g.batch * row_bytes * g.layers);
  const PolicyReport& never = r.policies[0];
  const PolicyReport& first = r.policies[1];
  REQUIRE(never.compressions == 0);
  REQUIRE(never.end_bytes == r.full_bytes);
  REQUIRE(std::isnan(never.recall()));
  REQUIRE(first.compressions == 4);
  // Ends at 24 + (99 - 87) = 36 tokens; peaks at budget + buffer = 40.
  REQUIRE(first.end_bytes == 36 * g.batch * row_bytes * g.layers);
  REQUIRE(first.peak_bytes == 40 * g.batch * row_bytes * g.layers);
  REQUIRE(first.recall_samples == samples);
  REQUIRE(std::fabs(first.recall() - recall_sum / samples) < 1e-12);
  REQUIRE(first.recall() < 1.0);
  REQUIRE(first.compress_ms >= 0.0);
  // Every compression evicts 16 tokens per (layer, sequence, head).
  REQUIRE(first.evictions.evicted() == 4 * 16 * g.layers * g.batch * g.kv_heads);
  // Each of the 4 compressions evicts in every (sequence, layer); no other step does.
  REQUIRE(first.layer_steps == T * g.layers * g.batch);
  REQUIRE(first.evicting_layer_steps == 4 * g.layers * g.batch);
  REQUIRE(never.evicting_layer_steps == 0);

  std::ostringstream os;
  demo_table(r, cfg.recall_k).print(os);
  const std::string text = os.str();
  REQUIRE_THAT(text, Contains("recall@5") && Contains("keep-first") && Contains("reference"));
  // Aligned: every line of the table has the same width.
  std::istringstream lines(text);
  std::string line;
  std::set<std::size_t> widths;
  while (std::getline(lines, line)) widths.insert(line.size());
  REQUIRE(widths.size() == 1);
}
