// Entry point of every GPU test binary: run Catch2 when a CUDA device is present, otherwise
// exit 77, which ctest reports as "skipped" (SKIP_RETURN_CODE).
#include <cstdio>

#if __has_include(<catch2/catch_session.hpp>)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <cuda_runtime_api.h>

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device present: GPU tests skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
