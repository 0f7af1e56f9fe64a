// libFuzzer harness for loading a golden-format case (golden/README.md) the way the library's
// pieces do it: the safetensors image, __metadata__.config read with the strict number parsers
// (core/json_number.hpp), keys/values [B, Hkv, S, D] and the optional valid_mask [B, S] turned
// into a validated KVCacheView, and a keep-everything plan compacted through it. Any input must be
// accepted or rejected with kvsift::Error; ASan/UBSan catch the rest.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "kvsift/core/compact.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/json_number.hpp"
#include "kvsift/core/safetensors.hpp"

namespace {

void load_case(const std::vector<std::uint8_t>& image) {
  using namespace kvsift;
  const SafetensorsFile f = SafetensorsFile::parse(image, "fuzz case");
  nlohmann::json cfg = nlohmann::json::object();
  const auto meta = f.metadata().find("config");
  if (meta != f.metadata().end()) {
    cfg = nlohmann::json::parse(meta->second, nullptr, /*allow_exceptions=*/false);
    KVSIFT_CHECK(cfg.is_object(), "config is not a JSON object");
  }
  (void)config_integer<int>(cfg, "budget", 1024, 1);
  (void)config_integer<int>(cfg, "window", 8, 0);
  (void)config_integer<int>(cfg, "kernel", 7, 1);
  (void)config_real(cfg, "mix_lambda", 0.1, 0.0, 1.0);
  (void)config_real(cfg, "threshold", 0.5, -1.0, 1.0);

  const StTensor& k = f.get("keys", {-1, -1, -1, -1});
  const StTensor& v = f.get("values", k.shape);
  const auto dtype = storage_dtype_of(k.dtype);
  KVSIFT_CHECK(dtype.has_value() && v.dtype == k.dtype, "keys/values dtype");
  const std::int64_t batch = k.shape[0], heads = k.shape[1], seq = k.shape[2], dim = k.shape[3];
  KVSIFT_CHECK(batch > 0 && heads > 0 && seq > 0 && dim > 0, "empty keys");
  KVSIFT_CHECK(seq <= INT32_MAX, "seq beyond int32");
  std::vector<std::uint8_t> keys = k.bytes, values = v.bytes;
  std::vector<std::uint8_t> mask;
  if (f.has("valid_mask")) {
    for (std::int64_t x : f.get("valid_mask", {batch, seq}).to_i64()) {
      KVSIFT_CHECK(x == 0 || x == 1, "valid_mask value");
      mask.push_back(static_cast<std::uint8_t>(x));
    }
  }
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(batch),
                                    static_cast<std::int32_t>(seq));
  const KVCacheView kv =
      make_kv_cache_view(keys.data(), values.data(), *dtype, Device::cpu, batch, heads, seq, dim,
                         lengths.data(), mask.empty() ? nullptr : mask.data());
  if (f.has("queries")) (void)f.get("queries", {batch, -1, -1, dim}).to_f32();
  compact(kv, KeepPlan::keep_all(kv));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    load_case(std::vector<std::uint8_t>(data, data + size));
  } catch (const kvsift::Error&) {
  }
  return 0;
}
