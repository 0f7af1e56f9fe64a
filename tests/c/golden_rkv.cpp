// golden_rkv.h: loads a case with kvsift's safetensors reader and plans it with the C++ API, the
// independent side the C test compares the C API against.
#include "golden_rkv.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvsift/core/safetensors.hpp"
#include "kvsift/policy/baselines/rkv.hpp"

namespace {

template <class T>
T* malloc_copy(const std::vector<T>& v) {
  T* p = static_cast<T*>(std::malloc(std::max<std::size_t>(v.size(), 1) * sizeof(T)));
  if (p == nullptr) throw std::bad_alloc();
  std::copy(v.begin(), v.end(), p);
  return p;
}

}  // namespace

extern "C" int golden_rkv_load(const char* path, golden_rkv_case* out, char* err, size_t err_len) {
  std::memset(out, 0, sizeof *out);
  try {
    using namespace kvsift;
    const SafetensorsFile file = SafetensorsFile::load(path);
    const nlohmann::json config = nlohmann::json::parse(file.metadata().at("config"));
    const StTensor& k = file.get("keys");
    const std::int64_t B = k.shape.at(0), H = k.shape.at(1), S = k.shape.at(2), D = k.shape.at(3);
    const StTensor& q = file.get("queries", {B, -1, -1, D});
    RKVConfig cfg;  // the reference's settings, as tests/test_golden_rkv.cpp reads them
    cfg.budget = config.at("budget").get<int>();
    cfg.window = config.at("window").get<int>();
    cfg.kernel = config.at("kernel").get<int>();
    cfg.mix_lambda = config.at("mix_lambda").get<float>();
    cfg.threshold = config.at("threshold").get<float>();
    cfg.buffer = std::max(128, cfg.window);
    cfg.redundancy = RedundancyMode::faithful;  // the reference's column-0 fallback

    std::vector<float> keys = k.to_f32();
    std::vector<float> values = file.has("values") ? file.get("values", k.shape).to_f32() : keys;
    std::vector<float> queries = q.to_f32();
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(B), static_cast<std::int32_t>(S));
    StepInputs in;
    in.kv = make_kv_cache_view(keys.data(), values.data(), DType::f32, Device::cpu, B, H, S, D,
                               lengths.data());
    in.window_queries = TensorView::contiguous(queries.data(), DType::f32, Device::cpu,
                                               {B, q.shape[1], q.shape[2], D});
    RKV policy(cfg);
    const KeepPlan plan = policy.select(in);
    std::vector<std::int32_t> slots;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        slots.insert(slots.end(), plan.row(b, h), plan.row(b, h) + plan.row_size(b, h));
    if (static_cast<std::int64_t>(slots.size()) != B * H * cfg.budget) {
      throw std::runtime_error("the C++ plan does not keep budget slots in every row");
    }

    out->batch = B, out->kv_heads = H, out->seq = S, out->head_dim = D;
    out->q_heads = q.shape[1], out->window = q.shape[2];
    out->budget = cfg.budget, out->kernel = cfg.kernel;
    out->mix_lambda = cfg.mix_lambda, out->threshold = cfg.threshold;
    out->keys = malloc_copy(keys);
    out->values = malloc_copy(values);
    out->queries = malloc_copy(queries);
    out->ref_keep = malloc_copy(file.get("keep_sorted", {B, H, cfg.budget - cfg.window}).to_i64());
    out->cpp_slots = malloc_copy(slots);
    return 0;
  } catch (const std::exception& e) {
    golden_rkv_free(out);
    std::snprintf(err, err_len, "%s", e.what());
    return -1;
  }
}

extern "C" void golden_rkv_free(golden_rkv_case* c) {
  std::free(c->keys);
  std::free(c->values);
  std::free(c->queries);
  std::free(c->ref_keep);
  std::free(c->cpp_slots);
  std::memset(c, 0, sizeof *c);
}
