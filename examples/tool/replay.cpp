// `kvsift replay` (replay.hpp): reads the case, picks the method from its config's "method" key in
// the table below, runs it and writes OUT atomically (never over the case itself), so that an
// unseen case can be checked by the golden README's rule alone.
#include "replay.hpp"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "args.hpp"
#include "command.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"

namespace kvsift::tool {
namespace {

struct ReplayMethod {
  const char* method;  // the value of __metadata__.config "method"
  ReplayFn run;
};

// One line per method.
const ReplayMethod kReplayMethods[] = {
    {"kivi", &replay_kivi},
    {"pm-kvq", &replay_pmkvq},
    {"lazyeviction", &replay_lazy},
};

std::string method_names() {
  std::string s;
  for (const ReplayMethod& m : kReplayMethods) s += (s.empty() ? "" : ", ") + std::string(m.method);
  return s;
}

void print_help() {
  std::printf(
      "usage: kvsift replay --case FILE --out OUT\n\n"
      "Runs the stream case FILE (safetensors; the method and every parameter come from its\n"
      "__metadata__.config, the inputs from its tensors) and writes OUT with every output tensor\n"
      "the golden README lists for that method, same names, shapes and dtypes.\n"
      "methods: %s\n",
      method_names().c_str());
}

}  // namespace

int run_replay(const std::vector<std::string>& argv) {
  for (const std::string& a : argv)
    if (a == "--help" || a == "-h") {
      print_help();
      return 0;
    }
  const Args args(argv, {"case", "out"});
  const std::string in_path = args.required("case"), out_path = args.required("out");
  check_output_not_input(out_path, {in_path});
  const SafetensorsFile in = SafetensorsFile::load(in_path);
  const auto it = in.metadata().find("config");
  KVSIFT_CHECK(it != in.metadata().end(), in_path, ": missing __metadata__.config");
  const nlohmann::json cfg = nlohmann::json::parse(it->second, nullptr, false);
  KVSIFT_CHECK(cfg.is_object() && cfg.contains("method") && cfg.at("method").is_string(), in_path,
               ": __metadata__.config has no string \"method\"");
  const std::string method = cfg.at("method").get<std::string>();
  for (const ReplayMethod& m : kReplayMethods) {
    if (method != m.method) continue;
    m.run(in).save(out_path);
    return 0;
  }
  KVSIFT_FAIL(in_path, ": unknown method '", method, "' (replay knows ", method_names(), ")");
}

namespace {
const RegisterCommand reg{
    {"replay", "run a stream case from its config and write its output tensors", &run_replay}};
}  // namespace

}  // namespace kvsift::tool
