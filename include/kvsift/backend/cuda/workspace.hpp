// Caller-provided device scratch memory (FlashInfer's Plan/Run, CUTLASS's get_workspace_size):
// each operation says how many bytes it needs, the engine hands them over, kvsift carves them up
// and never calls cudaMalloc itself.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvsift/core/error.hpp"

namespace kvsift::cuda {

inline constexpr std::size_t kWorkspaceAlign = 256;

inline constexpr std::size_t align_up(std::size_t n, std::size_t a = kWorkspaceAlign) {
  return (n + a - 1) / a * a;
}

// Hands out aligned pieces of one workspace, checking that they fit.
class WorkspaceCarver {
 public:
  WorkspaceCarver(void* base, std::size_t bytes, const char* op)
      : base_(static_cast<char*>(base)), bytes_(bytes), op_(op) {}

  template <class T>
  T* take(std::size_t count) {
    const std::size_t need = align_up(count * sizeof(T));
    KVSIFT_CHECK(base_ != nullptr || need == 0, op_, ": workspace is null but ", need,
                 " bytes are needed");
    KVSIFT_CHECK(used_ + need <= bytes_, op_, ": workspace of ", bytes_, " bytes is too small (",
                 used_ + need, " needed so far)");
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += need;
    return p;
  }

 private:
  char* base_;
  std::size_t bytes_;
  std::size_t used_ = 0;
  const char* op_;
};

}  // namespace kvsift::cuda
