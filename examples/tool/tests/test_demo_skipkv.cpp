// SkipKV in the demo (the registry's "skipkv" driven by RegistryPolicy, demo_policy.hpp) on tiny
// runs: its tracker must see the plan's sentences (real delimiter ids, or stand-ins on a synthetic
// stream), its redundancy marks must be exactly those an independent recomputation of PSS over the
// generator's hidden states gives (and only planted near-repeats), its steering strength must count
// the keyword sentences, and on the same decode it must evict a larger share of tokens as whole
// sentences than R-KV.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "demo_generator.hpp"
#include "demo_policy.hpp"
#include "demo_runner.hpp"
#include "demo_sentences.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/policy/skipkv/skipkv.hpp"

using namespace kvsift;
using namespace kvsift::demo;
using Catch::Matchers::Contains;

namespace {

constexpr std::int32_t kWait = 14190;  // "Wait": a check keyword of SentenceTokens::r1_qwen()

GeneratorConfig tiny_generator(std::uint64_t seed) {
  GeneratorConfig g;
  g.batch = 2;
  g.layers = 2;
  g.q_heads = 4;
  g.kv_heads = 2;
  g.head_dim = 32;
  g.seed = seed;
  g.repeat_probability = 0.3f;
  return g;
}

// A token stream with real delimiter ids at the ends of a synthetic plan's sentences (cycling
// through all seven), "Wait" as the first token of every third sentence among the first
// `keyword_sentences`, and plain ids elsewhere.
SentencePlan token_plan(std::int64_t length, std::uint64_t seed, int keyword_sentences) {
  const SentencePlan shape = synthetic_sentence_plan(length, seed);
  const auto& delims = r1qwen_sentence_delimiters();
  std::vector<std::int32_t> ids(static_cast<std::size_t>(length));
  for (std::int64_t s = 0; s < shape.sentences(); ++s) {
    for (std::int32_t t = shape.sentence_start(s); t < shape.sentence_ends[s]; ++t)
      ids[t] = 1000 + t % 997;
    if (s < keyword_sentences && s % 3 == 0) ids[shape.sentence_start(s)] = kWait;
    if (shape.sentence_ends[s] < length)
      ids[shape.sentence_ends[s] - 1] = delims[static_cast<std::size_t>(s) % delims.size()];
  }
  SentencePlan plan = sentence_plan_from_tokens(ids, delims);
  REQUIRE(plan.sentence_ends == shape.sentence_ends);
  return plan;
}

struct Run {
  DemoResult result;
  const RegistryPolicy* skipkv = nullptr;  // owned by `policies`
  const SkipKV* sk = nullptr;              // the policy it drives
  std::vector<std::unique_ptr<DemoPolicy>> policies;
};

DemoConfig tiny_config(std::uint64_t seed) {
  DemoConfig cfg;
  cfg.generator = tiny_generator(seed);
  cfg.dtype = DType::f32;
  cfg.budget = 96;
  cfg.window = 4;
  cfg.buffer = 64;
  return cfg;
}

// rkv then skipkv, both from the registry with the demo's shared knobs, as `kvsift demo` makes
// them.
void run_rkv_and_skipkv(const DemoConfig& cfg, std::vector<SentencePlan> plans, Run& run) {
  const std::string shared = shared_config_json(cfg);
  for (const char* name : {"rkv", "skipkv"})
    run.policies.push_back(
        std::make_unique<RegistryPolicy>(make_policy(name, filter_config(name, shared))));
  run.skipkv = dynamic_cast<const RegistryPolicy*>(run.policies[1].get());
  REQUIRE(run.skipkv != nullptr);
  run.sk = dynamic_cast<const SkipKV*>(&run.skipkv->policy());  // the test inspects its state
  REQUIRE(run.sk != nullptr);
  SyntheticDecode decode(cfg.generator, std::move(plans));
  run.result = run_demo(cfg, decode, run.policies);
}

// Unit sentence means of the generator's hidden states, in double: [sentences][head_dim] per
// sequence. Written independently of SentenceTracker (which sums in double and normalizes with
// +1e-8); the cosines agree to ~1e-6.
std::vector<std::vector<std::vector<double>>> sentence_embeddings(const GeneratorConfig& g,
                                                                  std::vector<SentencePlan> plans) {
  SyntheticDecode decode(g, plans);
  std::vector<std::vector<std::vector<double>>> emb(g.batch);
  for (int b = 0; b < g.batch; ++b)
    emb[b].assign(plans[b].sentences(), std::vector<double>(g.head_dim, 0.0));
  DecodeStep step;
  while (!decode.done()) {
    decode.next(step);
    for (int b = 0; b < g.batch; ++b)
      for (int d = 0; d < g.head_dim; ++d)
        emb[b][step.sentence[b]][d] += step.hidden[static_cast<std::size_t>(b) * g.head_dim + d];
  }
  for (auto& seq : emb) {
    for (auto& v : seq) {
      double n = 0;
      for (double x : v) n += x * x;
      for (double& x : v) x /= std::sqrt(n);
    }
  }
  return emb;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// The first sentence of sentence s's repeat chain (the generator's planted relation).
std::int32_t root_of(const SyntheticDecode& d, int b, std::int32_t s) {
  while (d.repeat_of(b, s) >= 0) s = d.repeat_of(b, s);
  return s;
}

}  // namespace

TEST_CASE("the SkipKV adapter marks exactly the sentences an independent PSS recomputation marks",
          "[demo][skipkv]") {
  const std::int64_t T = 700;
  for (std::uint64_t seed : {3u, 4u, 9u}) {
    INFO("seed " << seed);
    const DemoConfig cfg = tiny_config(seed);
    std::vector<SentencePlan> plans = {token_plan(T, seed, 0), token_plan(T, seed + 50, 0)};
    Run run;
    run_rkv_and_skipkv(cfg, plans, run);
    const SkipKV& skipkv = *run.sk;
    REQUIRE(skipkv.batch() == 2);
    REQUIRE(!run.skipkv->trigger_positions().empty());
    REQUIRE(skipkv.triggers() == static_cast<std::int64_t>(run.skipkv->trigger_positions().size()));
    const std::int64_t last_trigger = run.skipkv->trigger_positions().back();

    const auto emb = sentence_embeddings(cfg.generator, plans);
    const SyntheticDecode decode(cfg.generator, plans);  // for the planted relation only
    const float tau = skipkv.config().sentences.tau;
    std::int64_t marks = 0, planted_pairs = 0;
    for (int b = 0; b < 2; ++b) {
      const SentencePlan& p = plans[b];
      const SentenceTracker& t = skipkv.tracker(b);
      // The tracker's sentences are the plan's (its real delimiter ids), all but the open last.
      REQUIRE(t.num_sentences() == p.sentences() - 1);
      for (std::int64_t s = 0; s < t.num_sentences(); ++s) {
        REQUIRE(t.sentences()[s].start == p.sentence_start(s));
        REQUIRE(t.sentences()[s].end == p.sentence_ends[s] - 1);
      }
      // Every sentence j closed by the last trigger was compared with every earlier i; the last
      // matching j (ascending) sets λ_i.
      for (std::int64_t i = 0; i < t.num_sentences(); ++i) {
        double lambda = -1;
        for (std::int64_t j = i + 1; j < t.num_sentences(); ++j) {
          if (p.sentence_ends[j] > last_trigger) break;
          const double pss = dot(emb[b][i], emb[b][j]);
          REQUIRE(std::fabs(pss - tau) > 1e-4);  // no borderline pair on these seeds
          if (pss > tau) lambda = pss;
          const bool planted = root_of(decode, b, static_cast<std::int32_t>(i)) ==
                               root_of(decode, b, static_cast<std::int32_t>(j));
          planted_pairs += planted;
          // Only planted near-repeats read as redundant: distinct topics are far apart.
          if (pss > tau) REQUIRE(planted);
        }
        const Sentence& s = t.sentences()[i];
        REQUIRE(s.redundant() == (lambda >= 0));
        if (lambda >= 0) REQUIRE(s.lambda == Approx(lambda).margin(1e-5));
        marks += s.redundant();
      }
    }
    REQUIRE(marks > 0);
    REQUIRE(planted_pairs >= marks);
    // The table reports the same count.
    const auto& extra = run.result.policies[1].extra_columns;
    REQUIRE(extra.at(0).first == "redundant sentences");
    REQUIRE_THAT(extra.at(0).second, Contains(std::to_string(marks) + " of "));
  }
}

TEST_CASE("SkipKV evicts a larger share of tokens as whole sentences than R-KV on the same decode",
          "[demo][skipkv]") {
  const std::int64_t T = 700;
  for (std::uint64_t seed = 1; seed <= 9; ++seed) {
    INFO("seed " << seed);
    const DemoConfig cfg = tiny_config(seed);
    Run run;
    run_rkv_and_skipkv(cfg, {token_plan(T, seed, 0), token_plan(T, seed + 50, 0)}, run);
    const PolicyReport& rkv = run.result.policies[0];
    const PolicyReport& skipkv = run.result.policies[1];
    REQUIRE(rkv.name == "rkv");
    REQUIRE(skipkv.name == "skipkv");
    // Same trigger, same budget: the same number of tokens leave, only which ones differs.
    REQUIRE(skipkv.compressions == rkv.compressions);
    REQUIRE(skipkv.evictions.evicted() == rkv.evictions.evicted());
    const auto whole_share = [](const PolicyReport& r) {
      return static_cast<double>(r.evictions.whole_sentence_tokens) /
             static_cast<double>(r.evictions.evicted());
    };
    // Measured on seeds 1-9: R-KV 0-5.6%, SkipKV 8-15%. Its marked sentences score ~λ ≈ 0.98 below
    // the rest and leave together once the buffer (64) is longer than they are.
    CHECK(whole_share(skipkv) > whole_share(rkv));
  }
}

TEST_CASE("the SkipKV adapter reports alpha0 + gamma * N_o from the keyword sentences",
          "[demo][skipkv]") {
  // "Wait" opens every third of the first 9 sentences (0, 3, 6): all close long before the last
  // trigger, so N_o = 3 in each sequence.
  const DemoConfig cfg = tiny_config(7);
  const std::int64_t T = 400;
  std::vector<SentencePlan> plans = {token_plan(T, 7, 9), token_plan(T, 57, 9)};
  for (const auto& p : plans) REQUIRE(p.sentence_ends[8] < 300);
  Run run;
  run_rkv_and_skipkv(cfg, plans, run);
  const SkipKV& skipkv = *run.sk;
  const SteeringConfig& s = skipkv.config().steering;
  for (int b = 0; b < 2; ++b) {
    REQUIRE(skipkv.tracker(b).check_count() == 3);
    REQUIRE(skipkv.steering_strength(b) == Approx(s.alpha0 + 3 * s.gamma));
  }
  const auto& extra = run.result.policies[1].extra_columns;
  REQUIRE(extra.at(1).first == "alpha (N_o) per sequence");
  REQUIRE(extra.at(1).second == "1.31 (3), 1.31 (3)");
}

TEST_CASE("on a synthetic stream the SkipKV adapter stands in delimiter ids at sentence ends",
          "[demo][skipkv]") {
  const DemoConfig cfg = tiny_config(2);
  std::vector<SentencePlan> plans = {synthetic_sentence_plan(300, 2),
                                     synthetic_sentence_plan(300, 8)};
  Run run;
  run_rkv_and_skipkv(cfg, plans, run);
  for (int b = 0; b < 2; ++b) {
    const SentenceTracker& t = run.sk->tracker(b);
    REQUIRE(t.position() == 300);
    // Every planned sentence, the last (cut at the stream's end) included, closes in the tracker.
    REQUIRE(t.num_sentences() == plans[b].sentences());
    for (std::int64_t s = 0; s < t.num_sentences(); ++s)
      REQUIRE(t.sentences()[s].end == plans[b].sentence_ends[s] - 1);
  }
}

TEST_CASE("SkipKV in the demo rejects a hidden width other than the generator's",
          "[demo][skipkv][errors]") {
  RegistryPolicy adapter(make_policy("skipkv", R"({"budget": 64, "window": 4, "buffer": 16,
                                                  "hidden_size": 7})"));
  const GeneratorConfig g = tiny_generator(1);
  SyntheticDecode decode(g, {synthetic_sentence_plan(10, 1), synthetic_sentence_plan(10, 2)});
  DecodeStep step;
  decode.next(step);
  REQUIRE_THROWS_WITH(adapter.observe(step, {}), Contains("hidden_size = 7") && Contains("32"));
  REQUIRE_THROWS_WITH(RegistryPolicy(nullptr), Contains("null policy"));
}
