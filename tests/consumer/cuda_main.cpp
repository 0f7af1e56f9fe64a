// Built when the installed kvsift has kvsift::cuda: linking it must register the DeviceBackend
// through the exported link option alone (this file names no symbol of kvsift::cuda). No GPU
// needed.
#include <cstdio>

#include "kvsift/backend/device_backend.hpp"

int main() {
  if (!kvsift::has_device_backend()) {
    std::fprintf(stderr, "consumer: kvsift::cuda linked but no DeviceBackend registered\n");
    return 1;
  }
  std::printf("consumer: kvsift::cuda's DeviceBackend registered\n");
  return 0;
}
