// `kvsift replay` for PM-KVQ: replays every pmkvq stream case, writes the output file, reads it
// back and compares it with the case's golden tensors by the golden README's rule (every `real.*`
// / `fake.*` tensor present with the same name, dtype and shape; integers, codes, real scales and
// zeros exact; fake keys/values within 1e-6·(|ref| + max |ref| of the 128-value group)).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kvsift/core/safetensors.hpp"
// The replay function is one translation unit of the tool; compiled into this test directly.
#include "replay_pmkvq.cpp"

using namespace kvsift;

namespace {

bool is_output(const std::string& name) {
  return name.rfind("real.", 0) == 0 || name.rfind("fake.", 0) == 0;
}
bool is_fake_values(const std::string& name) {
  const auto ends = [&](const std::string& suf) {
    return name.size() >= suf.size() &&
           name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  return name.rfind("fake.", 0) == 0 && (ends("keys") || ends("values"));
}

void compare_case(const std::string& case_name) {
  const std::string in_path = std::string(KVSIFT_GOLDEN_DIR) + "/" + case_name + ".safetensors";
  const SafetensorsFile golden = SafetensorsFile::load(in_path);
  const std::string out_path =
      (std::filesystem::temp_directory_path() / ("kvsift_replay_" + case_name + ".safetensors"))
          .string();
  tool::replay_pmkvq(golden, in_path).save(out_path);
  const SafetensorsFile out = SafetensorsFile::load(out_path);
  std::filesystem::remove(out_path);

  std::size_t compared = 0;
  for (const std::string& name : golden.names()) {
    if (!is_output(name)) continue;
    INFO(case_name << ": " << name);
    REQUIRE(out.has(name));
    const StTensor& ref = golden.get(name);
    const StTensor& got = out.get(name);
    CHECK(st_dtype_name(got.dtype) == st_dtype_name(ref.dtype));
    REQUIRE(got.shape == ref.shape);
    if (is_fake_values(name)) {
      const std::vector<float> x = got.to_f32(), r = ref.to_f32();
      const std::size_t G = static_cast<std::size_t>(ref.shape.back());
      std::size_t bad = 0;
      for (std::size_t g0 = 0; g0 < r.size(); g0 += G) {
        float gmax = 0;
        for (std::size_t i = 0; i < G; ++i) gmax = std::fmax(gmax, std::fabs(r[g0 + i]));
        for (std::size_t i = 0; i < G; ++i)
          if (!(std::fabs(x[g0 + i] - r[g0 + i]) <= 1e-6 * (std::fabs(r[g0 + i]) + gmax))) ++bad;
      }
      CHECK(bad == 0);
    } else {
      CHECK(got.bytes == ref.bytes);  // exact: integers, codes, bf16-valued scales and zeros
    }
    ++compared;
  }
  CHECK(compared > 10);
  // Nothing written beyond the README's outputs for this case's backend.
  for (const std::string& name : out.names()) {
    INFO(name);
    CHECK(golden.has(name));
  }
}

}  // namespace

TEST_CASE("replay pmkvq_real writes the golden outputs", "[replay][pmkvq]") {
  compare_case("pmkvq_real");
}

TEST_CASE("replay pmkvq_fake writes the golden outputs", "[replay][pmkvq]") {
  compare_case("pmkvq_fake");
}

TEST_CASE("replay pmkvq config errors name the key and value", "[replay][pmkvq][errors]") {
  const std::string in_path = std::string(KVSIFT_GOLDEN_DIR) + "/pmkvq_fake.safetensors";
  SafetensorsFile f = SafetensorsFile::load(in_path);
  nlohmann::json c = nlohmann::json::parse(f.metadata().at("config"));
  c["n_init_kv_bits"] = 6;
  f.metadata()["config"] = c.dump();
  CHECK_THROWS_WITH(tool::replay_pmkvq(f, "case.st"),
                    Catch::Matchers::Contains(
                        "case.st: config key 'n_init_kv_bits' must be 16, 8, 4 or 2, got 6"));
  c["n_init_kv_bits"] = 16;
  c["backend"] = "hybrid";
  f.metadata()["config"] = c.dump();
  CHECK_THROWS_WITH(tool::replay_pmkvq(f, "case.st"),
                    Catch::Matchers::Contains("case.st: config key 'backend' must be \"real\" or "
                                              "\"fake\", got \"hybrid\""));
  c["backend"] = "fake";
  c["kv_budget_mb"] = "big";
  f.metadata()["config"] = c.dump();
  CHECK_THROWS_WITH(tool::replay_pmkvq(f, "case.st"),
                    Catch::Matchers::Contains("config key 'kv_budget_mb': expected a number"));
  c.erase("kv_budget_mb");
  f.metadata()["config"] = c.dump();
  CHECK_THROWS_WITH(tool::replay_pmkvq(f, "case.st"),
                    Catch::Matchers::Contains("missing config key 'kv_budget_mb'"));
}

TEST_CASE("replay refuses the pmkvq_ers tables case by name", "[replay][pmkvq][errors]") {
  const std::string in_path = std::string(KVSIFT_GOLDEN_DIR) + "/pmkvq_ers.safetensors";
  CHECK_THROWS_WITH(tool::replay_pmkvq(SafetensorsFile::load(in_path), "ers.st"),
                    Catch::Matchers::Contains("ers.st: config key 'kind' is \"tables\", not a "
                                              "stream case"));
}
