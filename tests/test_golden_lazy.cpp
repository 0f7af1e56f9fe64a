// LazyEviction golden parity (docs/algorithms.md §5.3; golden/README.md "LazyEviction"): the
// reference stream against every lazy_* case, by the README's rule (positions, TS, MRI, hits and
// eviction steps exact; candidate scores within 1e-6 + 1e-5|ref| (fp32) or 8 fp16 ulps).
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "catch.hpp"
#include "golden_lazy.hpp"
#include "kvsift/policy/baselines/lazy_stream.hpp"

using namespace kvsift;

TEST_CASE("LazyEviction reference stream matches every golden case", "[lazy][golden]") {
  for (const char* name : {"lazy_fp32_gqa", "lazy_fp16", "lazy_fp16_long"}) {
    INFO("case " << name);
    const SafetensorsFile f =
        SafetensorsFile::load(test::golden_path(std::string(name) + ".safetensors"));
    const lazy::Case in = lazy::load_case(f);
    const lazy::StreamResult r = lazy::run_stream(in.shape, in.cfg, in.fp16, in.prefill_keys,
                                                  in.decode_keys, in.decode_queries);
    test::check_lazy_outputs(f, lazy::write_outputs(r, in), in.fp16);
  }
}

TEST_CASE("LazyEviction score: hand-worked values", "[lazy]") {
  // MRI = 0: the first term is 2/(1 + exp(1 + a/1e-5)) = 0 for any a >= 1, and the second is 0.
  CHECK(lazy::score(3, 0, 10, LazyCounters::int32) == 0.0f);
  CHECK(lazy::score(3, 0, 10, LazyCounters::fp16) == 0.0f);
  // TS = t (hit this step), MRI = 1: 2/(1+e^1) + 2/(1+e^0) = 0.537883 + 1.
  CHECK(lazy::score(10, 1, 10, LazyCounters::int32) ==
        Approx(2.0 / (1.0 + std::exp(1.0)) + 1.0).epsilon(1e-6));
  // a = 4, MRI = 2: 2/(1+exp(1 + 4/(2 + 1e-5))) + 2/(1+exp(1)).
  CHECK(lazy::score(6, 2, 10, LazyCounters::int32) ==
        Approx(2.0 / (1.0 + std::exp(1.0 + 4.0 / 2.00001)) + 2.0 / (1.0 + std::exp(1.0)))
            .epsilon(1e-6));
}

TEST_CASE("LazyEviction counters: fp16 rounds odd steps past 2048 to even", "[lazy]") {
  CHECK(lazy::counter_of_step(LazyCounters::fp16, 2049) == 2048);
  CHECK(lazy::counter_of_step(LazyCounters::fp16, 2051) == 2052);
  CHECK(lazy::counter_of_step(LazyCounters::int32, 2049) == 2049);
  CHECK_THROWS_WITH(lazy::counter_of_step(LazyCounters::fp16, 70000),
                    Catch::Matchers::Contains("step 70000") && Catch::Matchers::Contains("fp16"));
}

TEST_CASE("LazyEviction kept slots: top scores, ties to the lower slot, window kept", "[lazy]") {
  // 6 tokens, budget 4, window 2: candidates 0..3 with scores 0.5, 0.9, 0.5, 0.1 keep 1 and 0
  // (tie 0 vs 2 goes to the lower slot), plus the window 4, 5.
  const std::vector<float> sc = {0.5f, 0.9f, 0.5f, 0.1f, 0.0f, 0.0f};
  CHECK(lazy::kept_slots(sc, 0, 6, 4, 2) == std::vector<std::int32_t>{0, 1, 4, 5});
  // One padding slot first: candidates 1..3 keep 1 and 2.
  CHECK(lazy::kept_slots(sc, 1, 6, 4, 2) == std::vector<std::int32_t>{1, 2, 4, 5});
}

TEST_CASE("LazyConfig validation names the field and value", "[lazy]") {
  LazyConfig c;
  c.budget = 8, c.window = 8;
  CHECK_THROWS_WITH(c.validate(), Catch::Matchers::Contains("budget (8) must exceed window (8)"));
  c.budget = 16, c.alpha = 0.0;
  CHECK_THROWS_WITH(c.validate(), Catch::Matchers::Contains("alpha must be in (0, 1], got 0"));
}
