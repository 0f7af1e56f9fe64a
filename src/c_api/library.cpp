// The library-level entry points: errors, version, CUDA availability, the method registry and
// the tensor helper.
#include <string>
#include <vector>

#include "convert.hpp"
#include "kvsift/c/kvsift.h"
#include "kvsift/core/config.hpp"
#include "kvsift/policy/registry.hpp"
#include "kvsift/version.hpp"
#include "status.hpp"

namespace kvsift::c_api {

std::string& last_error() {
  thread_local std::string message;
  return message;
}

namespace {

// The registry's strings copied once into NUL-terminated storage that lives as long as the
// library (string_view does not promise a terminator).
struct MethodStrings {
  std::string name, family, summary, default_config, example_config;
  unsigned needs;
  bool owns_cache;
};

const std::vector<MethodStrings>& method_table() {
  static const std::vector<MethodStrings> table = [] {
    std::vector<MethodStrings> t;
    for (const MethodInfo& m : registered_methods()) {
      t.push_back({std::string(m.name), std::string(m.family), std::string(m.summary),
                   m.default_config != nullptr ? m.default_config() : std::string("{}"),
                   std::string(m.example_config), m.needs, m.owns_cache});
    }
    return t;
  }();
  return table;
}

const MethodStrings& method_at(std::int32_t i) {
  const auto& t = method_table();
  KVSIFT_CHECK(i >= 0 && static_cast<std::size_t>(i) < t.size(), "method index ", i,
               " is outside [0, ", t.size(), ")");
  return t[static_cast<std::size_t>(i)];
}

// The string accessors return NULL on failure, so they wrap guarded() around a pointer result.
template <class Get>
const char* string_or_null(const char* function, Get&& get) noexcept {
  const char* out = nullptr;
  guarded(function, [&] { out = get(); });
  return out;
}

}  // namespace
}  // namespace kvsift::c_api

using namespace kvsift::c_api;

extern "C" {

const char* kvsift_last_error(void) { return last_error().c_str(); }

const char* kvsift_status_name(int32_t status) {
  switch (status) {
    case KVSIFT_OK:
      return "OK";
    case KVSIFT_ERROR_INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case KVSIFT_ERROR_UNSUPPORTED:
      return "UNSUPPORTED";
    case KVSIFT_ERROR_NO_CUDA:
      return "NO_CUDA";
    case KVSIFT_ERROR_OUT_OF_MEMORY:
      return "OUT_OF_MEMORY";
    case KVSIFT_ERROR_INTERNAL:
      return "INTERNAL";
    default:
      return "UNKNOWN";
  }
}

void kvsift_version(int* major, int* minor, int* patch) {
  if (major != nullptr) *major = KVSIFT_VERSION_MAJOR;
  if (minor != nullptr) *minor = KVSIFT_VERSION_MINOR;
  if (patch != nullptr) *patch = KVSIFT_VERSION_PATCH;
}

const char* kvsift_version_string(void) {
#define KVSIFT_C_STR2(x) #x
#define KVSIFT_C_STR(x) KVSIFT_C_STR2(x)
  return KVSIFT_C_STR(KVSIFT_VERSION_MAJOR) "." KVSIFT_C_STR(KVSIFT_VERSION_MINOR) "." KVSIFT_C_STR(
      KVSIFT_VERSION_PATCH);
#undef KVSIFT_C_STR
#undef KVSIFT_C_STR2
}

int kvsift_cuda_available(void) {
  int out = 0;
  guarded("kvsift_cuda_available", [&] { out = cuda_available() ? 1 : 0; });
  return out;
}

int32_t kvsift_method_count(void) {
  int32_t n = 0;
  guarded("kvsift_method_count", [&] { n = static_cast<int32_t>(method_table().size()); });
  return n;
}

const char* kvsift_method_name(int32_t i) {
  return string_or_null("kvsift_method_name", [&] { return method_at(i).name.c_str(); });
}

const char* kvsift_method_family(int32_t i) {
  return string_or_null("kvsift_method_family", [&] { return method_at(i).family.c_str(); });
}

const char* kvsift_method_summary(int32_t i) {
  return string_or_null("kvsift_method_summary", [&] { return method_at(i).summary.c_str(); });
}

kvsift_status kvsift_method_needs(int32_t i, uint32_t* out_needs) {
  return guarded("kvsift_method_needs", [&] {
    KVSIFT_CHECK(out_needs != nullptr, "out_needs is NULL");
    *out_needs = method_at(i).needs;
  });
}

kvsift_status kvsift_method_owns_cache(int32_t i, int* out) {
  return guarded("kvsift_method_owns_cache", [&] {
    KVSIFT_CHECK(out != nullptr, "out is NULL");
    *out = method_at(i).owns_cache ? 1 : 0;
  });
}

const char* kvsift_method_default_config(int32_t i) {
  return string_or_null("kvsift_method_default_config",
                        [&] { return method_at(i).default_config.c_str(); });
}

const char* kvsift_method_example_config(int32_t i) {
  return string_or_null("kvsift_method_example_config",
                        [&] { return method_at(i).example_config.c_str(); });
}

kvsift_status kvsift_tensor_contiguous(kvsift_tensor* t, void* data, int32_t dtype, int32_t device,
                                       int32_t rank, const int64_t* shape) {
  return guarded("kvsift_tensor_contiguous", [&] {
    KVSIFT_CHECK(t != nullptr, "t is NULL");
    KVSIFT_CHECK(rank >= 1 && rank <= 4, "rank must be in [1, 4], got ", rank);
    KVSIFT_CHECK(shape != nullptr, "shape is NULL (rank ", rank, ")");
    kvsift_tensor out{};
    out.data = data;
    out.dtype = dtype;
    out.device = device;
    out.rank = rank;
    int64_t stride = 1;
    for (int k = rank - 1; k >= 0; --k) {
      out.shape[k] = shape[k];
      out.strides[k] = stride;
      stride *= shape[k];
    }
    to_tensor_view(out, "t");  // the same checks every call applies: report them here first
    *t = out;
  });
}

}  // extern "C"
