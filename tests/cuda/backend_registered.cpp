// Linking kvsift::cuda registers the DeviceBackend (cuda/device_backend.cu) although this program
// names none of that file's symbols: the target's link option --undefined=
// kvsift_cuda_backend_anchor keeps its object file. Needs no GPU (registration runs at static
// initialisation and makes no CUDA call), so it runs in CI as an ordinary test.
#include <cstdio>

#include "kvsift/backend/device_backend.hpp"

int main() {
  if (!kvsift::has_device_backend()) {
    std::fprintf(stderr, "kvsift::cuda is linked but no DeviceBackend is registered\n");
    return 1;
  }
  std::printf("DeviceBackend registered\n");
  return 0;
}
