// Where a call runs and with what scratch memory: the caller's stream and workspace. Host calls
// ignore both; device calls only enqueue on `stream` and carve their scratch from `workspace`
// (FlashInfer's Plan/Run: ask workspace_bytes() first), so kvsift never allocates device memory
// behind the engine's back.
#pragma once

#include <cstddef>

namespace kvsift {

// A cudaStream_t, kept opaque so that host code needs no CUDA header. nullptr: the default stream.
using StreamHandle = void*;

struct ExecContext {
  void* workspace = nullptr;      // device scratch, at least workspace_bytes() bytes
  std::size_t workspace_bytes = 0;
  StreamHandle stream = nullptr;  // cudaStream_t of the caller
};

}  // namespace kvsift
