// The demo's ThinKV adapter (examples/tool/demo_thinkv.hpp) on a tiny run: what it tells the
// runner — resident positions for recall, bytes, evicting layer-steps — must agree with each
// ThinKV object's own accounting (its tables and EvictionCounter), and the calibrated thresholds
// must be the 1/3 and 2/3 quantiles of sparsities recomputed here independently.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "demo_cache.hpp"
#include "demo_generator.hpp"
#include "demo_runner.hpp"
#include "demo_sentences.hpp"
#include "demo_thinkv.hpp"

using namespace kvsift;
using namespace kvsift::demo;
using Catch::Matchers::Contains;

namespace {

GeneratorConfig tiny_generator() {
  GeneratorConfig g;
  g.batch = 2;
  g.layers = 2;
  g.q_heads = 4;
  g.kv_heads = 2;
  g.head_dim = 16;  // ThinKV's quantization groups need a multiple of 16
  g.seed = 5;
  return g;
}

// The tiny decode at f32 (the generated K/V reach ThinKV unrounded) with a budget of 96.
DemoConfig tiny_demo() {
  DemoConfig cfg;
  cfg.generator = tiny_generator();
  cfg.dtype = DType::f32;
  cfg.budget = 96;
  return cfg;
}

// ThinKV at that budget over T tokens, calibrated over and refreshed every 32 steps.
ThinKVDemoOptions tiny_options(std::int64_t T) {
  ThinKVDemoOptions o;
  o.budget = 96;
  o.length = T;
  o.calibration_steps = 32;
  o.refresh = 32;
  return o;
}

std::vector<SentencePlan> plans(int batch, std::int64_t length) {
  std::vector<SentencePlan> out;
  for (int b = 0; b < batch; ++b) out.push_back(synthetic_sentence_plan(length, 3 + b));
  return out;
}

}  // namespace

TEST_CASE("the ThinKV adapter's positions, bytes and evictions match ThinKV's own accounting",
          "[demo][thinkv]") {
  DemoConfig cfg = tiny_demo();
  cfg.window = 4;
  cfg.buffer = 16;
  const std::int64_t T = 520;
  ThinKVDemoOptions o = tiny_options(T);
  o.block_size = GENERATE(16, 32);  // --thinkv-block: the held-slot columns follow the table's
  INFO("block_size " << o.block_size);
  std::vector<std::unique_ptr<DemoPolicy>> policies;
  policies.push_back(std::make_unique<ThinKVDemoPolicy>(o));
  const auto& adapter = static_cast<const ThinKVDemoPolicy&>(*policies[0]);
  SyntheticDecode decode(cfg.generator, plans(2, T));
  const DemoResult r = run_demo(cfg, decode, policies);
  const PolicyReport& rep = r.policies[0];
  const GeneratorConfig& g = cfg.generator;

  REQUIRE(adapter.thinkv() != nullptr);
  REQUIRE(adapter.thinkv()->batch() == 2);
  std::int64_t table_bytes = 0, evicting = 0, total = 0;
  // The adapter never sees its demo caches' contents after calibration, so any cache will do for
  // the calls that take one; a fresh empty one proves they are not read.
  DemoLayerCache unused(g.batch, g.kv_heads, 1, g.head_dim, cfg.dtype);
  for (int b = 0; b < 2; ++b) {
    const ThinKV& kv = adapter.thinkv()->sequence(b);
    REQUIRE(kv.length() == T);
    REQUIRE(kv.table(0).config().block_size == o.block_size);
    REQUIRE(kv.resident_tokens() < T);  // something was evicted
    table_bytes += kv.resident_bytes().total();
    evicting += kv.eviction_counter().evicting();
    total += kv.eviction_counter().total();
    for (int l = 0; l < g.layers; ++l) {
      for (int h = 0; h < g.kv_heads; ++h) {
        std::vector<std::int32_t> expect;
        for (const auto& t : kv.table(l).resident_tokens(kv.sequence_id(), h))
          expect.push_back(t.position);
        std::sort(expect.begin(), expect.end());
        REQUIRE(static_cast<std::int32_t>(expect.size()) == kv.resident_tokens());
        std::int64_t n = -1;
        const std::int32_t* got = adapter.resident_positions(unused, l, b, h, n);
        REQUIRE(std::vector<std::int32_t>(got, got + n) == expect);
      }
    }
  }
  std::int64_t adapter_bytes = 0;
  for (int l = 0; l < g.layers; ++l) adapter_bytes += adapter.resident_bytes(unused, l);
  REQUIRE(adapter_bytes == table_bytes);
  REQUIRE(rep.end_bytes == table_bytes);
  REQUIRE(rep.peak_bytes >= rep.end_bytes);
  // One record per (sequence, layer, step), the replayed calibration steps included.
  REQUIRE(total == 2 * g.layers * T);
  REQUIRE(rep.layer_steps == total);
  REQUIRE(rep.evicting_layer_steps == evicting);
  REQUIRE(evicting > 0);
  REQUIRE(rep.compressions > 0);
  REQUIRE(rep.recall_samples > 0);
  REQUIRE(rep.recall() >= 0.0);
  REQUIRE(rep.recall() <= 1.0);

  // The slot columns, recounted here from the tables: held slots and block-resident live tokens
  // by the thought type of their block, per (layer, KV head) and sequence; segments of sequence 0.
  std::int64_t held[3] = {}, live[3] = {}, segments[3] = {};
  for (int b = 0; b < 2; ++b) {
    const ThinKV& kv = adapter.thinkv()->sequence(b);
    for (int l = 0; l < g.layers; ++l) {
      const ThoughtBlockTable& t = kv.table(l);
      for (std::int32_t blk = 0; blk < t.num_blocks(kv.sequence_id()); ++blk)
        held[static_cast<int>(t.block_info(kv.sequence_id(), blk).type)] +=
            t.config().block_size * g.kv_heads;
      for (int h = 0; h < g.kv_heads; ++h) {
        for (const auto& tok : t.resident_tokens(kv.sequence_id(), h)) {
          if (tok.address.block == kStagedBlock) continue;
          ++live[static_cast<int>(t.block_info(kv.sequence_id(), tok.address.block).type)];
        }
      }
      if (b == 0 && l == 0) {
        for (std::int32_t s = 0; s < t.num_segments(kv.sequence_id()); ++s)
          ++segments[static_cast<int>(t.segment_type(kv.sequence_id(), s))];
      }
    }
  }
  const std::int64_t heads = 2 * g.layers * g.kv_heads;
  std::string by_type, held_total;
  for (const auto& column : rep.extra_columns) {
    if (column.first == "by type: held/pinned/live per head (segments)") by_type = column.second;
    if (column.first == "slots held/head (in pinned groups)") held_total = column.second;
  }
  REQUIRE(held_total.rfind(std::to_string((held[0] + held[1] + held[2]) / heads) + " (", 0) == 0);
  for (int type = 0; type < 3; ++type) {
    INFO(by_type);
    const std::string prefix =
        std::string(1, "RET"[type]) + " " + std::to_string(held[type] / heads) + "/";
    const std::size_t at = by_type.find(prefix);
    REQUIRE(at != std::string::npos);
    const std::string rest = by_type.substr(at + prefix.size());  // "pinned/live (n seg)..."
    const std::string tail = rest.substr(rest.find('/') + 1);
    REQUIRE(tail.rfind(std::to_string(live[type] / heads) + " (" + std::to_string(segments[type]) +
                           " seg)",
                       0) == 0);
  }
}

TEST_CASE("the ThinKV adapter's attention error equals a recomputation from the tables' rows",
          "[demo][thinkv]") {
  const DemoConfig cfg = tiny_demo();  // f32: the generated K/V are the oracle's exact rows
  const std::int64_t T = 300;
  ThinKVDemoOptions o = tiny_options(T);
  o.refill = GENERATE(RefillRule::run, RefillRule::regroup);
  INFO("refill " << refill_rule_name(o.refill));
  std::vector<std::unique_ptr<DemoPolicy>> policies;
  policies.push_back(std::make_unique<ThinKVDemoPolicy>(o));
  const auto& adapter = static_cast<const ThinKVDemoPolicy&>(*policies[0]);
  SyntheticDecode decode(cfg.generator, plans(2, T));
  const DemoResult r = run_demo(cfg, decode, policies);
  std::string column;
  for (const auto& c : r.policies[0].extra_columns)
    if (c.first == "attn rel. err (last step's queries)") column = c.second;
  REQUIRE(!column.empty());

  // The same decode again: every generated K/V row by position, and the last step's queries.
  const GeneratorConfig& g = cfg.generator;
  const int D = g.head_dim, group = g.q_heads / g.kv_heads;
  SyntheticDecode replay(g, plans(2, T));
  DecodeStep step;
  std::vector<float> keys, values;  // [T, layers, batch, kv_heads, D]
  while (!replay.done()) {
    replay.next(step);
    keys.insert(keys.end(), step.keys.begin(), step.keys.end());
    values.insert(values.end(), step.values.begin(), step.values.end());
  }
  const auto row = [&](const std::vector<float>& rows, std::int32_t t, int l, int b, int h) {
    return rows.data() +
           (((static_cast<std::size_t>(t) * g.layers + l) * g.batch + b) * g.kv_heads + h) * D;
  };
  // Stored rows: each resident token decoded on its own (read_token) or from the staging
  // buffer; exact rows: the generated ones at the same positions. Both through dense attention.
  double sum = 0;
  int n = 0;
  for (int b = 0; b < g.batch; ++b) {
    const ThinKV& kv = adapter.thinkv()->sequence(b);
    for (int l = 0; l < g.layers; ++l) {
      const ThoughtBlockTable& t = kv.table(l);
      for (int h = 0; h < g.kv_heads; ++h) {
        std::vector<float> sk, sv, ek, ev, staged_k, staged_v;
        t.staged_rows(kv.sequence_id(), h, staged_k, staged_v);
        std::size_t staged = 0;
        for (const ResidentToken& tok : t.resident_tokens(kv.sequence_id(), h)) {
          std::vector<float> k(D), v(D);
          if (tok.address.block == kStagedBlock) {
            k.assign(staged_k.begin() + staged * D, staged_k.begin() + (staged + 1) * D);
            v.assign(staged_v.begin() + staged * D, staged_v.begin() + (staged + 1) * D);
            ++staged;
          } else {
            t.read_token(kv.sequence_id(), h, tok.address, k.data(), v.data());
          }
          sk.insert(sk.end(), k.begin(), k.end());
          sv.insert(sv.end(), v.begin(), v.end());
          ek.insert(ek.end(), row(keys, tok.position, l, b, h),
                    row(keys, tok.position, l, b, h) + D);
          ev.insert(ev.end(), row(values, tok.position, l, b, h),
                    row(values, tok.position, l, b, h) + D);
        }
        const std::int64_t tokens = static_cast<std::int64_t>(sk.size()) / D;
        std::vector<float> stored_out(group * D), exact_out(group * D);
        const float* q = step.query(l, b, h * group);
        dense_decode_attention(q, group, sk.data(), sv.data(), tokens, D, stored_out.data());
        dense_decode_attention(q, group, ek.data(), ev.data(), tokens, D, exact_out.data());
        for (int qh = 0; qh < group; ++qh) {
          double err = 0, norm = 0;
          for (int c = 0; c < D; ++c) {
            const double d = stored_out[qh * D + c] - static_cast<double>(exact_out[qh * D + c]);
            err += d * d;
            norm += static_cast<double>(exact_out[qh * D + c]) * exact_out[qh * D + c];
          }
          sum += std::sqrt(err / norm);
          ++n;
        }
      }
    }
  }
  const double expected = sum / n;
  INFO("column " << column << ", recomputed " << expected);
  REQUIRE(expected > 0.01);  // the blocks are quantized: the check below has something to see
  REQUIRE(std::fabs(std::stod(column) - expected) < 2e-4);
}

TEST_CASE("the ThinKV adapter calibrates theta1/theta2 as sparsity quantiles", "[demo][thinkv]") {
  // Independent oracle: every layer's sparsity (share of keys whose softmax weight is below 1% of
  // the row's largest, averaged over query heads) of the first C steps over the full history,
  // written as a direct double-precision softmax.
  const GeneratorConfig g = tiny_generator();
  const int C = 20;
  DemoConfig cfg;
  cfg.generator = g;
  cfg.dtype = DType::f32;
  cfg.budget = 64;
  cfg.window = 4;
  ThinKVDemoOptions o;
  o.budget = cfg.budget;
  o.length = 40;
  o.calibration_steps = C;
  o.refresh = 16;
  std::vector<std::unique_ptr<DemoPolicy>> policies;
  policies.push_back(std::make_unique<ThinKVDemoPolicy>(o));
  SyntheticDecode decode(g, plans(2, 40));
  run_demo(cfg, decode, policies);
  const auto& adapter = static_cast<const ThinKVDemoPolicy&>(*policies[0]);

  SyntheticDecode again(g, plans(2, 40));
  std::vector<DecodeStep> steps;
  DecodeStep s;
  while (!again.done()) {
    again.next(s);
    steps.push_back(s);
  }
  std::vector<double> samples;
  const int G = g.q_heads / g.kv_heads;
  for (int t = 0; t < C; ++t) {
    for (int l = 0; l < g.layers; ++l) {
      for (int b = 0; b < g.batch; ++b) {
        double mean = 0;
        for (int q = 0; q < g.q_heads; ++q) {
          std::vector<double> w(t + 1);
          for (int j = 0; j <= t; ++j) {
            double dot = 0;
            for (int d = 0; d < g.head_dim; ++d)
              dot += double(steps[t].query(l, b, q)[d]) * steps[j].key(l, b, q / G)[d];
            w[j] = dot / std::sqrt(double(g.head_dim));
          }
          const double m = *std::max_element(w.begin(), w.end());
          int sparse = 0;
          for (double x : w) sparse += std::exp(x - m) < 0.01;
          mean += double(sparse) / (t + 1);
        }
        samples.push_back(mean / g.q_heads);
      }
    }
  }
  std::sort(samples.begin(), samples.end());
  const auto at = [&](double q) { return samples[std::size_t(q * (samples.size() - 1) + 0.5)]; };
  REQUIRE(std::fabs(adapter.theta1() - at(1.0 / 3.0)) < 1e-5);
  // Tied quantiles (few, coarse samples) are split by 1e-3 so that theta1 < theta2 holds.
  const double theta2 = at(2.0 / 3.0) > at(1.0 / 3.0) ? at(2.0 / 3.0) : at(1.0 / 3.0) + 1e-3;
  REQUIRE(std::fabs(adapter.theta2() - theta2) < 1e-5);
  REQUIRE(adapter.theta1() < adapter.theta2());
}

TEST_CASE("the ThinKV adapter rejects bad options and select()", "[demo][thinkv]") {
  ThinKVDemoOptions o;
  o.budget = 0;
  REQUIRE_THROWS_WITH(o.validate(), Contains("budget must be >= 1, got 0"));
  o = ThinKVDemoOptions{};
  o.calibration_steps = -3;
  REQUIRE_THROWS_WITH(ThinKVDemoPolicy(o), Contains("calibration_steps must be >= 1, got -3"));
  for (int bad : {0, 24, 272}) {
    o = ThinKVDemoOptions{};
    o.block_size = bad;
    REQUIRE_THROWS_WITH(ThinKVDemoPolicy(o),
                        Contains("block_size (--thinkv-block) must be a multiple of 16 in [16, "
                                 "256], got " +
                                 std::to_string(bad)));
  }
  ThinKVDemoPolicy ok{ThinKVDemoOptions{}};
  REQUIRE_THROWS_WITH(ok.select(StepInputs{}), Contains("never by select()"));
}
