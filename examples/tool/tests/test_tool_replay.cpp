// `kvsift replay` (examples/tool/replay.cpp): runs each golden KIVI case through the command,
// reads the FILE it wrote back and compares it with the golden tensors by the README's rule
// (tests/kivi_golden_check.hpp), so written names, shapes and dtypes are checked; error paths.
#include <cstdio>
#include <string>
#include <vector>

#include "catch.hpp"
#include "kivi_golden_check.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/safetensors.hpp"
#include "replay.hpp"

using namespace kvsift;

namespace {
std::string golden(const std::string& name) { return std::string(KVSIFT_GOLDEN_DIR) + "/" + name; }
std::string temp_out(const std::string& name) {
  return std::string(KVSIFT_TEST_TMP_DIR) + "/replay_" + name;
}
}  // namespace

TEST_CASE("kvsift replay writes the KIVI outputs of every golden case") {
  for (const char* name : {"kivi_2bit_r128.safetensors", "kivi_4bit_r32_gqa.safetensors",
                           "kivi_k2v4_const.safetensors"}) {
    INFO(name);
    const std::string out = temp_out(name);
    REQUIRE(tool::run_replay({"--case", golden(name), "--out", out}) == 0);
    const SafetensorsFile got = SafetensorsFile::load(out);
    std::remove(out.c_str());
    test::check_kivi_outputs(got, SafetensorsFile::load(golden(name)));
  }
}

TEST_CASE("kvsift replay: errors name the problem") {
  const std::string in = golden("kivi_2bit_r128.safetensors");
  CHECK_THROWS_WITH(tool::run_replay({"--case", in, "--out", in}),
                    Catch::Matchers::Contains("output"));
  CHECK_THROWS_WITH(tool::run_replay({"--case", in}),
                    Catch::Matchers::Contains("missing required flag --out"));
  // A case whose config names no known method.
  SafetensorsFile f = SafetensorsFile::load(in);
  f.metadata()["config"] = R"({"method": "nope"})";
  const std::string bad = temp_out("bad_method.safetensors");
  f.save(bad);
  CHECK_THROWS_WITH(tool::run_replay({"--case", bad, "--out", temp_out("x.safetensors")}),
                    Catch::Matchers::Contains("unknown method 'nope' (replay knows kivi"));
  f.metadata()["config"] = R"({"method": "kivi", "k_bits": 2})";
  f.save(bad);
  CHECK_THROWS_WITH(tool::run_replay({"--case", bad, "--out", temp_out("x.safetensors")}),
                    Catch::Matchers::Contains("missing config key 'v_bits'"));
  std::remove(bad.c_str());
}

TEST_CASE("kvsift replay dispatches pm-kvq cases to replay_pmkvq") {
  // The full README comparison of PM-KVQ outputs is test_tool_replay_pmkvq; here: the command's
  // table line, its written file and one exact tensor of each backend.
  for (const char* name : {"pmkvq_real.safetensors", "pmkvq_fake.safetensors"}) {
    INFO(name);
    const std::string out = temp_out(name);
    REQUIRE(tool::run_replay({"--case", golden(name), "--out", out}) == 0);
    const SafetensorsFile got = SafetensorsFile::load(out);
    std::remove(out.c_str());
    const SafetensorsFile ref = SafetensorsFile::load(golden(name));
    const std::string nbits =
        std::string(name).find("real") != std::string::npos ? "real.nbits" : "fake.nbits";
    REQUIRE(got.has(nbits));
    CHECK(got.get(nbits).bytes == ref.get(nbits).bytes);
  }
}
