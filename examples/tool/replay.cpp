// `kvsift replay --case FILE --out OUT`: the dispatch over stream-case methods (replay.hpp).
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
  const char* method;  // the case's config key "method"
  SafetensorsFile (*run)(const SafetensorsFile& in, const std::string& what);
};

// One line per method.
const ReplayMethod kReplayMethods[] = {
    {"pm-kvq", &replay_pmkvq},
};

int run_replay(const std::vector<std::string>& argv) {
  for (const std::string& a : argv)
    if (a == "--help" || a == "-h") {
      std::printf(
          "usage: kvsift replay --case FILE --out OUT\n\n"
          "Runs a stream case (method and parameters from its __metadata__.config, inputs by the\n"
          "golden README's names) and writes every output tensor the README lists for that\n"
          "method, under the same names, shapes and dtypes.\n");
      return 0;
    }
  const Args args(argv, {"case", "out"});
  const std::string in_path = args.required("case"), out_path = args.required("out");
  check_output_not_input(out_path, {in_path});
  const SafetensorsFile in = SafetensorsFile::load(in_path);
  const auto it = in.metadata().find("config");
  KVSIFT_CHECK(it != in.metadata().end(), in_path, ": missing metadata 'config'");
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception& e) {
    KVSIFT_FAIL(in_path, ": metadata 'config' is not JSON (", e.what(), ")");
  }
  KVSIFT_CHECK(cfg.is_object() && cfg.contains("method") && cfg.at("method").is_string(), in_path,
               ": config key 'method' must name the case's method");
  const std::string method = cfg.at("method").get<std::string>();
  std::string known;
  for (const ReplayMethod& m : kReplayMethods) {
    if (method == m.method) {
      const SafetensorsFile out = m.run(in, in_path);
      out.save(out_path);
      std::printf("replayed %s case %s -> %s\n", m.method, in_path.c_str(), out_path.c_str());
      return 0;
    }
    known += known.empty() ? m.method : std::string(", ") + m.method;
  }
  KVSIFT_FAIL(in_path, ": config key 'method' is '", method, "', replay knows ", known);
}

const RegisterCommand register_replay{
    {"replay", "run a stream case (KV quantizer/evictor) and write its outputs", &run_replay}};

}  // namespace
}  // namespace kvsift::tool
