// `kvsift replay` on the LazyEviction golden cases (golden/README.md "LazyEviction"): the written
// file, read back, must equal the golden tensors by the README's rule (names, shapes, dtypes,
// exact positions/TS/MRI, cand_score within tolerance); bad input exits 1 with one line.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "catch.hpp"
#include "golden_lazy.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;

namespace {

// Runs the tool; returns its exit status and its stderr.
int run_tool(const std::string& args, std::string& err) {
  REQUIRE(std::string(KVSIFT_TOOL) != "");
  // One file per process: ctest runs this file's test cases as parallel processes.
  const std::string log =
      std::string(KVSIFT_TEST_TMP) + "/replay_stderr_" + std::to_string(getpid()) + ".txt";
  const int rc = std::system(
      (std::string("\"") + KVSIFT_TOOL + "\" " + args + " 2>\"" + log + "\" >/dev/null").c_str());
  err.clear();
  if (FILE* f = std::fopen(log.c_str(), "rb")) {
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) err.append(buf, n);
    std::fclose(f);
  }
  std::remove(log.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace

TEST_CASE("kvsift replay writes the README's tensors for every lazy case", "[lazy][replay]") {
  if (std::string(KVSIFT_TOOL).empty()) {
    WARN("built without the kvsift tool (KVSIFT_BUILD_EXAMPLES=OFF): replay not tested");
    return;
  }
  for (const char* name : {"lazy_fp32_gqa", "lazy_fp16", "lazy_fp16_long"}) {
    INFO("case " << name);
    const std::string in = test::golden_path(std::string(name) + ".safetensors");
    const std::string out = std::string(KVSIFT_TEST_TMP) + "/replay_" + name + ".safetensors";
    std::string err;
    REQUIRE(run_tool("replay --case \"" + in + "\" --out \"" + out + "\"", err) == 0);
    const SafetensorsFile ref = SafetensorsFile::load(in);
    const SafetensorsFile ours = SafetensorsFile::load(out);
    test::check_lazy_outputs(ref, ours, std::string(name) != "lazy_fp32_gqa");
    std::remove(out.c_str());
  }
}

TEST_CASE("kvsift replay errors: one line, exit 1", "[lazy][replay][errors]") {
  if (std::string(KVSIFT_TOOL).empty()) return;
  const std::string in = test::golden_path("lazy_fp16.safetensors");
  std::string err;
  CHECK(run_tool("replay --case \"" + in + "\" --out \"" + in + "\"", err) == 1);
  CHECK_THAT(err, Contains("kvsift replay: error:"));
  // A case whose config lacks a key the method needs.
  SafetensorsFile f = SafetensorsFile::load(in);
  nlohmann::json cfg = nlohmann::json::parse(f.metadata().at("config"));
  cfg.erase("alpha");
  f.metadata()["config"] = cfg.dump();
  const std::string bad = std::string(KVSIFT_TEST_TMP) + "/replay_bad.safetensors";
  f.save(bad);
  CHECK(run_tool("replay --case \"" + bad + "\" --out \"" + bad + ".out\"", err) == 1);
  CHECK_THAT(err, Contains("config key 'alpha' is missing"));
  CHECK(std::count(err.begin(), err.end(), '\n') == 1);
  cfg["method"] = "quest";
  f.metadata()["config"] = cfg.dump();
  f.save(bad);
  CHECK(run_tool("replay --case \"" + bad + "\" --out \"" + bad + ".out\"", err) == 1);
  CHECK_THAT(err, Contains("unknown method 'quest'") && Contains("lazyeviction"));
  std::remove(bad.c_str());
}
