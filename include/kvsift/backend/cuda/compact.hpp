// kvsift::cuda::compact: applies a KeepPlan to a KV cache in device memory, in place, with no
// staging copy of the cache. Same result as kvsift::compact on the host.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"

namespace kvsift::cuda {

// Device workspace compact() needs for `plan` (its row offsets and slots).
std::size_t compact_workspace_bytes(const KeepPlan& plan);

// Validates on the host (plan well-formed, made for this cache at these lengths), then enqueues
// the moves of keys, values and the padding mask (rewritten from head 0's row; the plan must keep
// pads at the same positions in every head, as every kvsift policy does) on `stream`, and
// rewrites kv.lengths (host) to the kept lengths. Nothing is written when validation fails.
void compact(const KVCacheView& kv, const KeepPlan& plan, void* workspace,
             std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvsift::cuda
