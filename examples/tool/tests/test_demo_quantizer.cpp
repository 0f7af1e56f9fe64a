// The demo's quantizer rows (examples/tool/demo_quantizer.hpp): KIVI and PM-KVQ from the registry
// on a short run, their table rows present, their memory against byte counts worked out by hand
// for the demo's settings, their compressions (quantization events) and their recall samples.
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "demo_generator.hpp"
#include "demo_quantizer.hpp"
#include "demo_runner.hpp"
#include "demo_sentences.hpp"
#include "demo_table.hpp"

using namespace kvsift;
using namespace kvsift::demo;

TEST_CASE("the demo's kivi and pmkvq rows: memory as counted by hand", "[demo][quantizer]") {
  DemoConfig cfg;
  cfg.generator.batch = 1;
  cfg.generator.layers = 1;
  cfg.generator.q_heads = 4;
  cfg.generator.kv_heads = 2;
  cfg.generator.head_dim = 64;
  cfg.generator.seed = 9;
  cfg.dtype = DType::f16;
  const std::int64_t T = 300;
  std::vector<std::unique_ptr<DemoPolicy>> policies;
  for (const char* name : {"kivi", "pmkvq"})
    policies.push_back(std::make_unique<QuantizerDemoPolicy>(name, T));
  SyntheticDecode decode(cfg.generator, {synthetic_sentence_plan(T, 4)});
  const DemoResult r = run_demo(cfg, decode, policies);
  REQUIRE(r.policies.size() == 2);
  // FullKV: 300 tokens x 2 KV heads x 64 x (K + V) x 2 bytes.
  REQUIRE(r.full_bytes == 153600);

  // KIVI-2, G = 32, R = 128, no prompt. Keys: flushed at 128 and 256 → 256 quantized, 44 full.
  // Values: 172 quantized, the last 128 full. Per KV head: key codes 64 channels x 16 int32
  // words = 4096 B; key scale + minimum 64 x 8 groups x 4 B = 2048 B; value rows 172 x (4 words
  // = 16 B + 2 groups x 4 B) = 4128 B; fp16 rows 2 B x 64 x (44 + 128) = 22016 B. 32288 B a head.
  const PolicyReport& kivi = r.policies[0];
  CHECK(kivi.name == "kivi");
  CHECK(kivi.end_bytes == 2 * 32288);
  CHECK(kivi.compressions == 2);
  CHECK(kivi.recall_samples == 2 * 8 * 4);  // 8 steps after each event, 4 query heads
  CHECK((kivi.recall() > 0.0 && kivi.recall() <= 1.0));

  // PM-KVQ, G = 64, sink 1, window 128, budget max(quarter of FullKV = 38400 B, 4 x (129 x 132 +
  // 300 x 20) = 92112 B) = 92112 B. A token of K+V, 2 heads: 528 B at 16 bits, 272 at 8, 144 at
  // 4. Token 129 flushes 128 window tokens (68112 B, fits); token 175 (92400 B) halves to 8 bits;
  // token 237 (92368 B) to 4; token 257 flushes the next 128 at 4 bits. End: sink 1 + window 43
  // at 16 bits, body 256 at 4 bits: 44 x 528 + 256 x 144 = 60096 B.
  CHECK(pmkvq_demo_budget_bytes(2, 64, T) == 92112);
  const PolicyReport& pm = r.policies[1];
  CHECK(pm.name == "pmkvq");
  CHECK(pm.end_bytes == 60096);
  CHECK(pm.compressions == 4);
  CHECK(pm.recall_samples == 4 * 8 * 4);
  CHECK((pm.recall() > 0.0 && pm.recall() <= 1.0));
  CHECK(pm.peak_bytes == 174 * 528);  // token 174, all at 16 bits, just before the halving

  // The table has both rows, with the shares above: 42.0% and 39.1%.
  std::ostringstream os;
  demo_table(r, cfg.recall_k).print(os);
  const std::string t = os.str();
  CHECK(t.find("kivi   |") != std::string::npos);
  CHECK(t.find("pmkvq  |") != std::string::npos);
  CHECK(t.find("42.0%") != std::string::npos);
  CHECK(t.find("39.1%") != std::string::npos);
  CHECK(t.find("quantized as") != std::string::npos);
  CHECK(t.find("K2 V2, R 128") != std::string::npos);
  CHECK(t.find("body 4 bit") != std::string::npos);  // PM-KVQ's width at the end
}
