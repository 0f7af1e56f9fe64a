// `kvsift demo --device cuda`: every planning method selects on device views. At each
// compression the layer's host cache and window queries are uploaded and the policy's select()
// runs on the device copies with a workspace sized by workspace_bytes(): the library dispatches
// by the views' device (R-KV and SkipKV on the CUDA backend, the others staged to the host in this
// version). The plan comes back to the runner, which compacts the demo's host cache with it
// exactly as for a CPU plan (so recall and eviction shapes are measured the same way). The point
// is agreement with the CPU run, not speed: ms/compression includes allocation and both
// transfers. Only for builds with the CUDA backend (KVSIFT_WITH_CUDA).
#pragma once

#include <cstddef>

#include "kvsift/core/error.hpp"
#include "kvsift/core/exec_context.hpp"
#include "kvsift/core/step_inputs.hpp"
#include "kvsift/policy/policy.hpp"
#include "score_cuda.hpp"

namespace kvsift::demo {

//   in.kv              host [batch, kv_heads, capacity, head_dim], contiguous
//   in.window_queries  host [batch, q_heads, W, head_dim], contiguous
inline KeepPlan select_on_device(Policy& policy, const StepInputs& in) {
  KVSIFT_CHECK(in.kv.keys.is_contiguous() && in.kv.values.is_contiguous() &&
                   in.window_queries.is_contiguous(),
               "demo --device cuda: the demo's caches and windows must be contiguous");
  const auto bytes = [](const TensorView& t) {
    return static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype);
  };
  tool::DeviceBytes keys(in.kv.keys.data, bytes(in.kv.keys));
  tool::DeviceBytes values(in.kv.values.data, bytes(in.kv.values));
  tool::DeviceBytes queries(in.window_queries.data, bytes(in.window_queries));
  const std::size_t mask_bytes = static_cast<std::size_t>(in.kv.batch() * in.kv.capacity());
  tool::DeviceBytes mask(in.kv.valid_mask, in.kv.valid_mask != nullptr ? mask_bytes : 0);
  StepInputs dev = in;  // lengths stay on the host (KVCacheView's contract)
  dev.kv.keys.data = keys.get();
  dev.kv.values.data = values.get();
  dev.kv.keys.device = dev.kv.values.device = Device::cuda;
  dev.kv.valid_mask = in.kv.valid_mask != nullptr ? mask.get<std::uint8_t>() : nullptr;
  dev.window_queries.data = queries.get();
  dev.window_queries.device = Device::cuda;
  tool::DeviceBytes workspace(policy.workspace_bytes(dev));
  return policy.select(dev, ExecContext{workspace.get(), workspace.size(), nullptr});
}

}  // namespace kvsift::demo
