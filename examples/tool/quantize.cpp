// `kvsift quantize` and `kvsift dequantize`: ThinKV's group codecs (docs/algorithms.md §3.2) applied to
// a whole [tokens, channels] tensor in the KIVI layout (include/kvsift/quant/quantized_tensor.hpp).
// quantize writes the decoded tensor plus the packed codes and scales, so other implementations
// can be compared with ours byte for byte; dequantize decodes (and validates) such a file.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "args.hpp"
#include "command.hpp"
#include "kvsift/core/safetensors.hpp"
#include "kvsift/quant/quantized_tensor.hpp"

namespace kvsift::tool {
namespace {

bool wants_help(const std::vector<std::string>& argv) {
  for (const std::string& a : argv) {
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

void print_quantize_help() {
  std::printf(
      "usage: kvsift quantize --format {nvfp4,fp8,ternary} --group-axis {token,channel}\n"
      "                       --case IN --out OUT [--tensor x] [--global-factor G|calibrated]\n\n"
      "Quantizes tensor x [tokens, channels] (F32/F16/BF16; both extents multiples of 16) in\n"
      "groups of 16 and writes OUT (safetensors) with:\n"
      "  dequant        F32 [tokens, channels]   the decoded tensor\n"
      "  codes          U8  [groups, bytes]      packed codes (nvfp4 8, fp8 16, ternary 4 bytes)\n"
      "  scales         U8  [groups]             E4M3 (nvfp4, ternary) or E8M0 (fp8) scale codes\n"
      "  global_factor  F32 [1]                  NVFP4's g (1 for the other formats)\n"
      "and metadata format, group_axis, tokens, channels.\n\n"
      "  --group-axis token    a group is 16 consecutive tokens of one channel (keys, KIVI)\n"
      "  --group-axis channel  a group is 16 consecutive channels of one token (values)\n"
      "  --global-factor       NVFP4 g: a number (default 1) or 'calibrated' = 448*6/amax(x)\n");
}

void print_dequantize_help() {
  std::printf(
      "usage: kvsift dequantize --case IN --out OUT\n\n"
      "Decodes a file written by `kvsift quantize` (codes, scales, global_factor and its\n"
      "metadata) into OUT's tensor dequant [tokens, channels] (F32). Corrupt packed data (wrong\n"
      "byte counts, NaN or negative scale codes, invalid element codes) is an error.\n");
}

std::string metadata_of(const SafetensorsFile& f, const std::string& key, const std::string& path) {
  auto it = f.metadata().find(key);
  KVSIFT_CHECK(it != f.metadata().end(), path, ": missing metadata '", key, "'");
  return it->second;
}

std::int64_t metadata_int(const SafetensorsFile& f, const std::string& key,
                          const std::string& path) {
  const std::string v = metadata_of(f, key, path);
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  KVSIFT_CHECK(end != v.c_str() && *end == '\0', path, ": metadata '", key,
               "' is not an integer ('", v, "')");
  return n;
}

std::vector<std::uint8_t> u8_data(const StTensor& t, const char* name) {
  KVSIFT_CHECK(t.dtype == StDType::u8, "tensor '", name, "' must be U8, got ",
               st_dtype_name(t.dtype));
  return t.bytes;
}

void save(const std::string& path, const QuantizedTensor& q, const std::vector<float>& dequant) {
  SafetensorsFile out;
  const std::int64_t groups = q.grid.num_groups();
  out.put_f32("dequant", {q.grid.tokens, q.grid.channels}, dequant.data());
  out.put_u8("codes", {groups, code_bytes_per_group(q.format)}, q.codes.data());
  out.put_u8("scales", {groups}, q.scales.data());
  out.put_f32("global_factor", {1}, &q.global_factor);
  out.metadata()["format"] = std::string(quant_format_name(q.format));
  out.metadata()["group_axis"] = std::string(group_axis_name(q.grid.axis));
  out.metadata()["tokens"] = std::to_string(q.grid.tokens);
  out.metadata()["channels"] = std::to_string(q.grid.channels);
  out.save(path);
}

int run_quantize(const std::vector<std::string>& argv) {
  if (wants_help(argv)) {
    print_quantize_help();
    return 0;
  }
  const Args args(argv, {"format", "group-axis", "case", "out", "tensor", "global-factor"});
  const QuantFormat format = parse_quant_format(args.required("format"));
  const GroupAxis axis = parse_group_axis(args.required("group-axis"));
  const std::string in_path = args.required("case"), out_path = args.required("out");
  const std::string name = args.str("tensor", "x");

  const SafetensorsFile in = SafetensorsFile::load(in_path);
  const StTensor& t = in.get(name);
  KVSIFT_CHECK(t.shape.size() == 2, in_path, ": tensor '", name,
               "' must be 2-D [tokens, channels], got ", t.shape.size(), " dimensions");
  const std::vector<float> x = t.to_f32();
  const std::int64_t tokens = t.shape[0], channels = t.shape[1];

  float g = 1.0f;
  const std::string gs = args.str("global-factor", "1");
  if (gs == "calibrated") {
    g = nvfp4_calibrated_global_factor(abs_max(x.data(), static_cast<std::int64_t>(x.size())));
  } else {
    g = static_cast<float>(args.real("global-factor", 1.0));
  }
  KVSIFT_CHECK(format == QuantFormat::nvfp4 || g == 1.0f, "--global-factor applies to nvfp4 only (",
               "format ", quant_format_name(format), ", got ", gs, ")");

  const QuantizedTensor q = quantize_tensor(x.data(), tokens, channels, format, axis, g);
  const std::vector<float> back = dequantize_tensor(q);
  save(out_path, q, back);

  double err2 = 0.0, ref2 = 0.0, max_err = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double e = static_cast<double>(x[i]) - back[i];
    err2 += e * e;
    ref2 += static_cast<double>(x[i]) * x[i];
    max_err = std::fmax(max_err, std::fabs(e));
  }
  std::printf("%s, groups along %s: [%lld, %lld] -> %lld groups, %lld bytes (%.2f bits/element)\n",
              std::string(quant_format_name(format)).c_str(),
              std::string(group_axis_name(axis)).c_str(), static_cast<long long>(tokens),
              static_cast<long long>(channels), static_cast<long long>(q.grid.num_groups()),
              static_cast<long long>(q.bytes()), 8.0 * q.bytes() / static_cast<double>(x.size()));
  std::printf("global factor %g, relative RMS error %.4f, max |error| %.4g\nwrote %s\n", g,
              ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0, max_err, out_path.c_str());
  return 0;
}

int run_dequantize(const std::vector<std::string>& argv) {
  if (wants_help(argv)) {
    print_dequantize_help();
    return 0;
  }
  const Args args(argv, {"case", "out"});
  const std::string in_path = args.required("case"), out_path = args.required("out");
  const SafetensorsFile in = SafetensorsFile::load(in_path);
  QuantizedTensor q;
  q.format = parse_quant_format(metadata_of(in, "format", in_path));
  q.grid = KiviGrid{metadata_int(in, "tokens", in_path), metadata_int(in, "channels", in_path),
                    parse_group_axis(metadata_of(in, "group_axis", in_path))};
  q.codes = u8_data(in.get("codes"), "codes");
  q.scales = u8_data(in.get("scales"), "scales");
  const std::vector<float> g = in.get("global_factor", {1}).to_f32();
  q.global_factor = g[0];
  const std::vector<float> back = dequantize_tensor(q);  // validates first
  SafetensorsFile out;
  out.put_f32("dequant", {q.grid.tokens, q.grid.channels}, back.data());
  out.save(out_path);
  std::printf("decoded %s [%lld, %lld] -> %s\n", std::string(quant_format_name(q.format)).c_str(),
              static_cast<long long>(q.grid.tokens), static_cast<long long>(q.grid.channels),
              out_path.c_str());
  return 0;
}

const RegisterCommand register_quantize{
    {"quantize", "quantize a [tokens, channels] tensor (nvfp4, fp8, ternary)", &run_quantize}};
const RegisterCommand register_dequantize{
    {"dequantize", "decode and validate a `kvsift quantize` output", &run_dequantize}};

}  // namespace
}  // namespace kvsift::tool
