// The registration point of the CUDA backend (backend/device_backend.hpp).
#include "kvsift/backend/device_backend.hpp"

#include <atomic>

#include "kvsift/core/error.hpp"

namespace kvsift {

namespace {
std::atomic<const DeviceBackend*> g_backend{nullptr};
}  // namespace

void register_device_backend(const DeviceBackend* backend) { g_backend.store(backend); }

bool has_device_backend() { return g_backend.load() != nullptr; }

std::size_t DeviceBackend::thinkv_memory_bytes(const ThinKVConfig&, std::int64_t) const {
  KVSIFT_CHECK(false, "DeviceBackend: this backend has no ThinKV pipeline");
  return 0;
}

std::unique_ptr<DeviceThinKVPipeline> DeviceBackend::make_thinkv(const ThinKVConfig&, std::int64_t,
                                                                 const ExecContext&) const {
  KVSIFT_CHECK(false, "DeviceBackend: this backend has no ThinKV pipeline");
  return nullptr;
}

const DeviceBackend& device_backend() {
  const DeviceBackend* b = g_backend.load();
  KVSIFT_CHECK(b != nullptr,
               "a device (CUDA) view reached kvsift, but this program was built without the CUDA "
               "backend: link kvsift::cuda (or libkvsift_c built with CUDA)");
  return *b;
}

}  // namespace kvsift
