// `kvsift replay --case FILE --out OUT`: runs a stream case (golden/README.md) with the method and
// every parameter from its __metadata__.config, and writes every output tensor the README lists
// for that method under the same names, shapes and dtypes, so that an unseen case can be checked
// by the README's rule alone. The method is the config's "method" key.
#include "replay.hpp"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "args.hpp"
#include "command.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/file_io.hpp"
#include "kvsift/core/safetensors.hpp"

namespace kvsift::tool {
namespace {

struct Replayer {
  const char* method;  // the case's config "method"
  SafetensorsFile (*run)(const SafetensorsFile& in);
};

// One line per method.
const Replayer kReplayers[] = {
    {"lazyeviction", &replay_lazy},
};

std::string case_method(const SafetensorsFile& in, const std::string& path) {
  KVSIFT_CHECK(in.metadata().count("config") != 0, path,
               ": no __metadata__.config (a stream case names its method there)");
  const nlohmann::json cfg = nlohmann::json::parse(in.metadata().at("config"), nullptr, false);
  KVSIFT_CHECK(cfg.is_object() && cfg.contains("method") && cfg.at("method").is_string(), path,
               ": __metadata__.config has no string key 'method'");
  return cfg.at("method").get<std::string>();
}

int run_replay(const std::vector<std::string>& argv) {
  const Args args(argv, {"case", "out"});
  const std::string case_path = args.required("case"), out = args.required("out");
  check_output_not_input(out, {case_path});
  const SafetensorsFile in = SafetensorsFile::load(case_path);
  const std::string method = case_method(in, case_path);
  std::string known;
  for (const Replayer& r : kReplayers) {
    if (method == r.method) {
      r.run(in).save(out);
      std::printf("replayed %s case %s -> %s\n", r.method, case_path.c_str(), out.c_str());
      return 0;
    }
    known += (known.empty() ? "" : ", ") + std::string(r.method);
  }
  KVSIFT_FAIL(case_path, ": method '", method, "' has no replay (known: ", known, ")");
}

const RegisterCommand reg{
    {"replay", "run a stream case from its config and write its output tensors", &run_replay}};

}  // namespace
}  // namespace kvsift::tool
