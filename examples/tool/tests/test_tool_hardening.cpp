// The kvsift tool under hostile command lines (issue 13, docs/hardening.md): outputs that would
// destroy an input or replace something that is not a regular file are refused before any work;
// a failed write exits non-zero and leaves nothing behind; numbers are parsed strictly in flags
// and config values; calibration's grid is bounded up front; an all-pads plan writes a valid
// output; a directory as --case says so. Every input is made here, in a fresh temporary folder;
// every refusal is one line on the output and exit status 1.

// Checked std::vector indexing: the all-pads plan writer used to take &bytes[0] of an empty vector,
// which only an assertion-enabled libstdc++ turns into a visible failure.
#ifndef _GLIBCXX_ASSERTIONS
#define _GLIBCXX_ASSERTIONS 1
#endif

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "args.hpp"
#include "case_io.hpp"
#include "catch.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/safetensors.hpp"
#include "run_tool.hpp"

using namespace kvsift;
using Catch::Matchers::Contains;
using tool_test::run_tool;
using tool_test::ToolRun;
namespace fs = std::filesystem;

namespace {

// A fresh folder under the system's temporary directory, removed with everything in it.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvsift_tool_hardening.XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_all(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The tool's error convention: exit status 1 and exactly one line, which holds `needle`.
void require_refused(const ToolRun& r, const std::string& needle) {
  INFO("output: " << r.output);
  REQUIRE(r.exit_code == 1);
  REQUIRE(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  REQUIRE_THAT(r.output, Contains("error: ") && Contains(needle));
}

// A small golden-format case (golden/README.md): keys and values [1, 1, 32, 4], queries
// [1, 1, 4, 4] f32, no mask, __metadata__.config = `config`. Values are arbitrary but fixed.
void write_case(const std::string& path, const nlohmann::json& config) {
  const std::int64_t S = 32, D = 4, W = 4;
  std::vector<float> keys(S * D), values(S * D), queries(W * D);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i) + 0.3));
    values[i] = static_cast<float>(std::cos(0.45 * static_cast<double>(i)));
  }
  for (std::size_t i = 0; i < queries.size(); ++i)
    queries[i] = static_cast<float>(std::sin(1.3 * static_cast<double>(i) - 0.2));
  SafetensorsFile f;
  f.put_f32("keys", {1, 1, S, D}, keys.data());
  f.put_f32("values", {1, 1, S, D}, values.data());
  f.put_f32("queries", {1, 1, W, D}, queries.data());
  f.metadata()["config"] = config.dump();
  f.save(path);
}

const nlohmann::json kRkvConfig = {{"budget", 16}, {"window", 4}};

// ThinKV calibration samples `sparsity` [1, 1, 300]: three well-separated clusters (0.15, 0.5,
// 0.85, each spread evenly over ±0.03), which the KDE sees as exactly three stable modes.
void write_trimodal_samples(const std::string& path) {
  const double centers[3] = {0.15, 0.5, 0.85};
  std::vector<float> s(300);
  for (std::size_t i = 0; i < s.size(); ++i)
    s[i] = static_cast<float>(centers[i % 3] + 0.003 * (static_cast<double>((i / 3) % 21) - 10.0));
  SafetensorsFile f;
  f.put_f32("sparsity", {1, 1, static_cast<std::int64_t>(s.size())}, s.data());
  f.save(path);
}

}  // namespace

TEST_CASE("tool: a crafted case scores (the baseline every refusal below departs from)") {
  TempDir dir;
  write_case(dir / "case.safetensors", kRkvConfig);
  const ToolRun r = run_tool({"score", "--policy", "rkv", "--case", dir / "case.safetensors",
                              "--out", dir / "out.safetensors"},
                             dir / "capture");
  INFO("output: " << r.output);
  REQUIRE(r.exit_code == 0);
  const SafetensorsFile out = SafetensorsFile::load(dir / "out.safetensors");
  REQUIRE(out.get("compacted_keys").shape == std::vector<std::int64_t>{1, 1, 16, 4});
}

TEST_CASE(
    "tool: --out naming the input (same path, ./ spelling, hard link) is refused, input "
    "untouched") {
  TempDir dir;
  const std::string in = dir / "case.safetensors";
  write_case(in, kRkvConfig);
  const std::string before = read_all(in);
  REQUIRE(::link(in.c_str(), (dir / "hard.safetensors").c_str()) == 0);
  const std::string spellings[] = {in, (dir.path / "." / "case.safetensors").string(),
                                   dir / "hard.safetensors"};
  for (const std::string& out : spellings) {
    INFO("--out " << out);
    require_refused(
        run_tool({"score", "--policy", "rkv", "--case", in, "--out", out}, dir / "capture"),
        "is the same file as input");
    require_refused(
        run_tool({"score", "--policy", "skipkv", "--case", in, "--out", out}, dir / "capture"),
        "is the same file as input");
    REQUIRE(read_all(in) == before);
  }
  // quantize / dequantize / calibrate take the same check (their input need not even parse: the
  // output is refused before anything is read).
  require_refused(run_tool({"quantize", "--format", "fp8", "--group-axis", "token", "--case", in,
                            "--out", dir / "hard.safetensors"},
                           dir / "capture"),
                  "is the same file as input");
  require_refused(run_tool({"dequantize", "--case", in, "--out", in}, dir / "capture"),
                  "is the same file as input");
  require_refused(
      run_tool({"calibrate", "--samples", in, "--out", dir / "hard.safetensors"}, dir / "capture"),
      "is the same file as input");
  REQUIRE(read_all(in) == before);
  REQUIRE(names_in(dir.path) == std::vector<std::string>{"case.safetensors", "hard.safetensors"});
}

TEST_CASE(
    "tool: --out a symlink to a file elsewhere is refused, the link and its target "
    "untouched") {
  TempDir dir, elsewhere;
  write_case(dir / "case.safetensors", kRkvConfig);
  write_all(elsewhere / "precious.txt", "do not overwrite\n");
  fs::create_symlink(elsewhere / "precious.txt", dir / "link.safetensors");
  for (const char* cmd : {"score", "calibrate"}) {
    INFO(cmd);
    const ToolRun r = std::string(cmd) == "score"
                          ? run_tool({"score", "--policy", "rkv", "--case",
                                      dir / "case.safetensors", "--out", dir / "link.safetensors"},
                                     dir / "capture")
                          : run_tool({"calibrate", "--samples", dir / "case.safetensors", "--out",
                                      dir / "link.safetensors"},
                                     dir / "capture");
    require_refused(r, "is a symbolic link");
    REQUIRE(fs::is_symlink(dir / "link.safetensors"));
    REQUIRE(read_all(elsewhere / "precious.txt") == "do not overwrite\n");
  }
}

TEST_CASE("tool: --out /dev/null (a device) is refused") {
  TempDir dir;
  write_case(dir / "case.safetensors", kRkvConfig);
  require_refused(run_tool({"score", "--policy", "rkv", "--case", dir / "case.safetensors", "--out",
                            "/dev/null"},
                           dir / "capture"),
                  "is a character device");
  struct stat st {};
  REQUIRE(::stat("/dev/null", &st) == 0);
  REQUIRE(S_ISCHR(st.st_mode));
}

TEST_CASE("tool: a failed write exits 1 and leaves no partial file") {
  TempDir dir;
  write_case(dir / "case.safetensors", kRkvConfig);
  write_trimodal_samples(dir / "samples.safetensors");
  fs::create_directory(dir / "target_dir");

  // A directory as --out: refused, the directory untouched and nothing written beside it.
  require_refused(run_tool({"score", "--policy", "rkv", "--case", dir / "case.safetensors", "--out",
                            dir / "target_dir"},
                           dir / "capture"),
                  "is a directory");
  require_refused(
      run_tool({"calibrate", "--samples", dir / "samples.safetensors", "--out", dir / "target_dir"},
               dir / "capture"),
      "is a directory");
  REQUIRE(fs::is_directory(dir / "target_dir"));
  REQUIRE(fs::is_empty(dir / "target_dir"));

  // calibrate used to print "wrote" and exit 0 when the write failed. It calibrates first (the
  // samples are good: the same run with a writable --out succeeds), then the write into a
  // missing folder fails: exit 1, no "wrote", no file.
  const ToolRun ok =
      run_tool({"calibrate", "--samples", dir / "samples.safetensors", "--out", dir / "t.json"},
               dir / "capture");
  INFO("output: " << ok.output);
  REQUIRE(ok.exit_code == 0);
  const nlohmann::json t = nlohmann::json::parse(read_all(dir / "t.json"));
  REQUIRE(t.at("theta1").get<double>() < t.at("theta2").get<double>());

  const ToolRun bad = run_tool(
      {"calibrate", "--samples", dir / "samples.safetensors", "--out", dir / "missing/t.json"},
      dir / "capture");
  INFO("output: " << bad.output);
  REQUIRE(bad.exit_code == 1);
  REQUIRE_THAT(bad.output, Contains("error: ") && Contains("missing/t.json"));
  REQUIRE_THAT(bad.output, !Contains("wrote"));
  // /dev/full: the old std::ofstream path opened it, lost the write in the buffer and printed
  // "wrote". Refused now (a device), before the calibration runs.
  if (fs::exists("/dev/full")) {
    const ToolRun full =
        run_tool({"calibrate", "--samples", dir / "samples.safetensors", "--out", "/dev/full"},
                 dir / "capture");
    require_refused(full, "is a character device");
    REQUIRE_THAT(full.output, !Contains("wrote"));
  }
  REQUIRE(names_in(dir.path) == std::vector<std::string>{"case.safetensors", "samples.safetensors",
                                                         "t.json", "target_dir"});
}

TEST_CASE("tool: integer flags are strict (no wrap, no truncation), naming the flag and text") {
  TempDir dir;
  write_case(dir / "case.safetensors", kRkvConfig);
  const std::string in = dir / "case.safetensors";
  for (const char* policy : {"rkv", "skipkv"}) {
    INFO(policy);
    // 4294967312 = 2^32 + 16 used to run as budget 16.
    require_refused(run_tool({"score", "--policy", policy, "--case", in, "--out",
                              dir / "o.safetensors", "--budget", "4294967312"},
                             dir / "capture"),
                    "flag --budget: '4294967312' is out of range");
    require_refused(run_tool({"score", "--policy", policy, "--case", in, "--out",
                              dir / "o.safetensors", "--budget", "16.7"},
                             dir / "capture"),
                    "flag --budget: expected an integer, got '16.7'");
    require_refused(run_tool({"score", "--policy", policy, "--case", in, "--out",
                              dir / "o.safetensors", "--budget", "nan"},
                             dir / "capture"),
                    "flag --budget: expected an integer, got 'nan'");
  }
  require_refused(run_tool({"group", "--lengths", in, "--batch-size", "-3"}, dir / "capture"),
                  "flag --batch-size: '-3' is out of range");
  REQUIRE_FALSE(fs::exists(dir / "o.safetensors"));
}

TEST_CASE("tool: real flags must be finite and in range (nan, inf, 1e20)") {
  TempDir dir;
  const std::string in = dir / "case.safetensors";
  write_case(in, kRkvConfig);
  for (const char* policy : {"rkv", "skipkv"}) {
    for (const char* text : {"nan", "inf", "-inf", "1e20"}) {
      for (const char* flag : {"--threshold", "--lambda"}) {
        INFO(policy << " " << flag << " " << text);
        require_refused(run_tool({"score", "--policy", policy, "--case", in, "--out",
                                  dir / "o.safetensors", flag, text},
                                 dir / "capture"),
                        std::string("flag ") + flag + ": ");
        const ToolRun r = run_tool(
            {"score", "--policy", policy, "--case", in, "--out", dir / "o.safetensors", flag, text},
            dir / "capture");
        REQUIRE_THAT(r.output, Contains(std::string("'") + text + "'"));
        REQUIRE_THAT(r.output, !Contains("-2147483648"));  // the old NaN-cast-to-int message
      }
    }
  }
  REQUIRE_FALSE(fs::exists(dir / "o.safetensors"));
}

TEST_CASE(
    "tool: quantize --global-factor must be a positive finite float, checked before reading") {
  TempDir dir;
  const std::string absent = dir / "absent.safetensors";  // never read: the flag fails first
  for (const char* text : {"nan", "inf", "1e39", "0", "-2"}) {
    INFO(text);
    require_refused(run_tool({"quantize", "--format", "nvfp4", "--group-axis", "token", "--case",
                              absent, "--out", dir / "q.safetensors", "--global-factor", text},
                             dir / "capture"),
                    std::string("flag --global-factor: "));
  }
  REQUIRE_FALSE(fs::exists(dir / "q.safetensors"));
}

TEST_CASE("tool: config values are strict: a case's budget 16.7 is an error, not 16") {
  TempDir dir;
  write_case(dir / "frac.safetensors", {{"budget", 16.7}, {"window", 4}});
  write_case(dir / "nan.safetensors", {{"budget", 16}, {"window", 4}, {"threshold", "nan"}});
  for (const char* policy : {"rkv", "skipkv"}) {
    INFO(policy);
    require_refused(run_tool({"score", "--policy", policy, "--case", dir / "frac.safetensors",
                              "--out", dir / "o.safetensors"},
                             dir / "capture"),
                    "config key 'budget': expected an integer, got 16.7");
    require_refused(run_tool({"score", "--policy", policy, "--case", dir / "nan.safetensors",
                              "--out", dir / "o.safetensors"},
                             dir / "capture"),
                    "config key 'threshold': expected a number, got \"nan\"");
  }
  // An integral value written as a real is the integer it names (json_number.hpp's rule).
  write_case(dir / "whole.safetensors", {{"budget", 16.0}, {"window", 4}});
  const ToolRun r = run_tool({"score", "--policy", "rkv", "--case", dir / "whole.safetensors",
                              "--out", dir / "o.safetensors"},
                             dir / "capture");
  INFO("output: " << r.output);
  REQUIRE(r.exit_code == 0);
  REQUIRE_THAT(r.output, Contains("\"budget\":16,"));
}

TEST_CASE("tool: Args and setting() parse through the strict parser") {
  const tool::Args a(
      {"--budget", "4294967312", "--window=16.7", "--kernel", "7", "--lambda", "1e20"},
      {"budget", "window", "kernel", "lambda"});
  REQUIRE_THROWS_WITH(a.integer<int>("budget", 0),
                      Contains("flag --budget") && Contains("'4294967312'"));
  REQUIRE(a.integer<std::int64_t>("budget", 0) == 4294967312LL);
  REQUIRE_THROWS_WITH(a.integer<int>("window", 0), Contains("flag --window") && Contains("'16.7'"));
  REQUIRE(a.integer<int>("kernel", 0) == 7);
  REQUIRE(a.integer<int>("absent", 5) == 5);
  REQUIRE_THROWS_WITH(
      tool::setting<float>(a, "lambda", nlohmann::json::object(), "mix_lambda", 0.1f, 0.0f, 1.0f),
      Contains("flag --lambda") && Contains("'1e20'"));
  const nlohmann::json cfg = {{"budget", 16.7}, {"mix_lambda", 0.25}};
  const tool::Args none({}, {"budget", "lambda"});
  REQUIRE_THROWS_WITH(tool::setting<int>(none, "budget", cfg, "budget", 1),
                      Contains("config key 'budget'") && Contains("16.7"));
  REQUIRE(tool::setting<float>(none, "lambda", cfg, "mix_lambda", 0.1f) == 0.25f);
  REQUIRE(tool::setting<int>(none, "kernel", cfg, "kernel", 7) == 7);
}

TEST_CASE("tool: calibrate --grid beyond kMaxCalibrationGridPoints is refused up front") {
  TempDir dir;
  // Samples are never read: the bound is checked first (a missing file would say so otherwise).
  const std::string samples = dir / "absent.safetensors";
  require_refused(
      run_tool({"calibrate", "--samples", samples, "--grid", "100000000"}, dir / "capture"),
      "flag --grid: '100000000' is out of range [16, 4096]");
  require_refused(run_tool({"calibrate", "--samples", samples, "--grid", "1e8"}, dir / "capture"),
                  "flag --grid: expected an integer, got '1e8'");
  require_refused(
      run_tool({"calibrate", "--samples", samples, "--top-layers", "2147483648"}, dir / "capture"),
      "flag --top-layers: '2147483648' is out of range [1, 1024]");
}

TEST_CASE("tool: --case a directory says it is not a regular file") {
  TempDir dir;
  fs::create_directory(dir / "a_dir");
  require_refused(run_tool({"score", "--policy", "rkv", "--case", dir / "a_dir", "--out",
                            dir / "o.safetensors"},
                           dir / "capture"),
                  "is a directory, not a regular file");
  require_refused(run_tool({"dequantize", "--case", dir / "a_dir", "--out", dir / "o.safetensors"},
                           dir / "capture"),
                  "not a regular file");
  REQUIRE_FALSE(fs::exists(dir / "o.safetensors"));
}

TEST_CASE("tool: put_plan writes a valid output when every sequence keeps nothing (all pads)") {
  // [B=2, Hkv=1, S=3, D=2] f32; both sequences are all pads, so the plan keeps 0 rows each.
  tool::ScoreCase c;
  c.batch = 2, c.kv_heads = 1, c.seq = 3, c.dim = 2, c.q_heads = 1, c.window = 0;
  c.dtype = DType::f32;
  c.keys.assign(2 * 3 * 2 * sizeof(float), 0x11);
  c.values.assign(2 * 3 * 2 * sizeof(float), 0x22);
  c.mask.assign(2 * 3, 0);
  c.lengths.assign(2, 3);
  KeepPlan plan(2, 1, 3, {3, 3}, {0, 0}, 0);
  plan.append_row(nullptr, 0);
  plan.append_row(nullptr, 0);
  plan.validate();

  SafetensorsFile out;
  tool::put_plan(out, c, plan, 0, c.keys, c.values);
  TempDir dir;
  out.save(dir / "plan.safetensors");
  const SafetensorsFile back = SafetensorsFile::load(dir / "plan.safetensors");
  REQUIRE(back.get("keep_sorted").shape == std::vector<std::int64_t>{2, 1, 0});
  REQUIRE(back.get("compacted_keys").shape == std::vector<std::int64_t>{2, 1, 0, 2});
  REQUIRE(back.get("compacted_values").shape == std::vector<std::int64_t>{2, 1, 0, 2});
  REQUIRE(back.get("compacted_keys").bytes.empty());
}

TEST_CASE("tool: put_plan with one all-pads sequence beside a kept one copies only the kept rows") {
  // [B=2, Hkv=1, S=3, D=1] f32 keys 0..5 (sequence 0: 0 1 2, sequence 1: 3 4 5); sequence 0 keeps
  // slots 0 and 2 (already compacted to the front: 0 2 _), sequence 1 keeps nothing.
  tool::ScoreCase c;
  c.batch = 2, c.kv_heads = 1, c.seq = 3, c.dim = 1, c.q_heads = 1, c.window = 0;
  c.dtype = DType::f32;
  const std::vector<float> compacted = {0.f, 2.f, 2.f, 3.f, 4.f, 5.f};
  c.keys.resize(compacted.size() * sizeof(float));
  std::memcpy(c.keys.data(), compacted.data(), c.keys.size());
  c.values = c.keys;
  c.lengths.assign(2, 3);
  KeepPlan plan(2, 1, 3, {3, 3}, {2, 0}, 0);
  const std::int32_t kept[] = {0, 2};
  plan.append_row(kept, 2);
  plan.append_row(nullptr, 0);
  plan.validate();

  SafetensorsFile out;
  tool::put_plan(out, c, plan, 0, c.keys, c.values);
  REQUIRE(out.get("keep_sorted").to_i64() == std::vector<std::int64_t>{0, 2, -1, -1});
  // Sequence 1's rows stay zero: nothing of it is kept.
  REQUIRE(out.get("compacted_keys").to_f32() == std::vector<float>{0.f, 2.f, 0.f, 0.f});
}
