// `kvsift calibrate`: ThinKV's offline calibration (docs/algorithms.md §3.1). Reads per-step attention
// sparsities recorded on calibration prompts, and prints the thought thresholds θ1 < θ2 and the
// calibrated layers L* (optionally writing them as JSON for ThoughtClassifierConfig).
//
// Input format: a safetensors file with one tensor `sparsity`, dtype F32 (F16/BF16 accepted),
// shape [prompts, layers, steps]: sparsity[p, l, s] is the attention sparsity (averaged over
// query heads) of layer l at decode step s of prompt p. Prompts generate different numbers of
// steps: pad the tail with NaN. Values must lie in [0, 1].
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "args.hpp"
#include "command.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/thinkv/sparsity_calibration.hpp"

namespace kvsift::tool {
namespace {

void print_help() {
  const CalibrationConfig d;
  std::printf(
      "usage: kvsift calibrate --samples FILE.safetensors [--out thresholds.json]\n"
      "                        [--top-layers N] [--grid N] [--stability-ratio R]\n\n"
      "Calibrates ThinKV's thought thresholds from per-step attention sparsities: a Gaussian\n"
      "KDE per (prompt, layer), layers whose KDE has exactly 3 stable modes qualify, the\n"
      "thresholds are the valleys between the modes, L* the layers with the deepest valleys.\n\n"
      "  --samples FILE     safetensors with tensor `sparsity` [prompts, layers, steps] f32,\n"
      "                     values in [0, 1], NaN-padded where a prompt generated fewer steps\n"
      "  --out FILE         also write {\"theta1\", \"theta2\", \"layers\", ...} as JSON\n"
      "  --top-layers N     size of L* (default %d)\n"
      "  --grid N           KDE grid points over [0, 1] (default %d)\n"
      "  --stability-ratio R  the 3-mode bandwidth range must span this factor (default %g)\n",
      d.top_layers, d.grid_points, d.stability_ratio);
}

int run_calibrate(const std::vector<std::string>& argv) {
  for (const std::string& a : argv) {
    if (a == "--help" || a == "-h") {
      print_help();
      return 0;
    }
  }
  const Args args(argv, {"samples", "out", "top-layers", "grid", "stability-ratio"});
  const std::string path = args.required("samples");
  CalibrationConfig config;
  config.top_layers = static_cast<int>(args.integer("top-layers", config.top_layers));
  config.grid_points = static_cast<int>(args.integer("grid", config.grid_points));
  config.stability_ratio = args.real("stability-ratio", config.stability_ratio);
  config.validate();

  const SafetensorsFile file = SafetensorsFile::load(path);
  const StTensor& tensor = file.get("sparsity", {-1, -1, -1});
  const std::vector<float> data = tensor.to_f32();
  const std::int64_t prompts = tensor.shape[0], layers = tensor.shape[1], steps = tensor.shape[2];
  std::printf("samples: %s, %lld prompt(s) x %lld layer(s) x %lld step(s)\n", path.c_str(),
              static_cast<long long>(prompts), static_cast<long long>(layers),
              static_cast<long long>(steps));

  const CalibrationResult r = calibrate_thresholds(data.data(), prompts, layers, steps, config);
  std::printf("\nlayer  prompts  trimodal  valley depth  theta1  theta2\n");
  for (const auto& l : r.per_layer) {
    if (l.prompts_trimodal == 0) {
      std::printf("%5d  %7d  %8d             -       -       -\n", l.layer, l.prompts_with_data,
                  l.prompts_trimodal);
      continue;
    }
    std::printf("%5d  %7d  %8d  %12.3f  %6.3f  %6.3f%s\n", l.layer, l.prompts_with_data,
                l.prompts_trimodal, l.valley_depth, l.theta1, l.theta2,
                l.qualifies ? "" : "  (too few prompts)");
  }
  std::printf("\ntheta1 = %.4f\ntheta2 = %.4f\nlayers =", r.theta1, r.theta2);
  for (int l : r.layers) std::printf(" %d", l);
  std::printf("\n");

  if (args.has("out")) {
    nlohmann::json j;
    j["theta1"] = r.theta1;
    j["theta2"] = r.theta2;
    j["layers"] = r.layers;
    j["samples"] = path;
    j["prompts"] = prompts;
    j["grid_points"] = config.grid_points;
    j["stability_ratio"] = config.stability_ratio;
    const std::string out = args.required("out");
    std::ofstream f(out);
    KVSIFT_CHECK(f.good(), "cannot open '", out, "' for writing");
    f << j.dump(2) << "\n";
    KVSIFT_CHECK(f.good(), "failed writing '", out, "'");
    std::printf("wrote %s\n", out.c_str());
  }
  return 0;
}

const RegisterCommand reg{
    {"calibrate", "ThinKV thought thresholds from sparsity samples", &run_calibrate}};

}  // namespace
}  // namespace kvsift::tool
