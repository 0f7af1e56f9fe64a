// compact(): applies a KeepPlan to a cache in place. Kept rows move to the front of each
// (sequence, head) in slot order; lengths and the padding mask are rewritten to match.
//   compact(kv, plan)       host memory only;
//   compact(kv, plan, ctx)  by the view's device: host memory here, device memory through the
//                           registered CUDA backend on ctx.stream with ctx.workspace (size it with
//                           compact_workspace_bytes(plan)).
#pragma once

#include <cstring>

#include "kvsift/backend/device_backend.hpp"
#include "kvsift/core/exec_context.hpp"
#include "kvsift/core/keep_plan.hpp"
#include "kvsift/core/kv_cache_view.hpp"

namespace kvsift {

namespace detail {
// Every head of a sequence must keep pads at the same positions, or one mask row cannot describe
// the compacted sequence. Checked before anything is written.
inline void check_plan_pads_agree(const KVCacheView& kv, const KeepPlan& plan) {
  if (kv.valid_mask == nullptr) return;
  for (std::int64_t b = 0; b < plan.batch(); ++b) {
    const std::int32_t* first = plan.row(b, 0);
    for (std::int64_t h = 1; h < plan.kv_heads(); ++h) {
      const std::int32_t* s = plan.row(b, h);
      for (std::int64_t i = 0; i < plan.kept_length(b); ++i) {
        KVSIFT_CHECK(kv.is_valid(b, s[i]) == kv.is_valid(b, first[i]),
                     "compact: plan keeps pads at different positions in heads 0 and ", h,
                     " of sequence ", b, " (slot ", i, ")");
      }
    }
  }
}

// Moves rows forward within one (b, h). Safe in place: slots are sorted and unique, so
// slots[i] >= i, and a row is read before any later write can reach it.
inline void compact_rows(const TensorView& t, std::int64_t b, std::int64_t h,
                         const std::int32_t* slots, std::int64_t n) {
  const std::size_t row_bytes = static_cast<std::size_t>(t.shape[3]) * dtype_size(t.dtype);
  char* base = static_cast<char*>(t.data);
  const std::size_t esz = dtype_size(t.dtype);
  for (std::int64_t i = 0; i < n; ++i) {
    if (slots[i] == i) continue;
    std::memmove(base + t.offset(b, h, i) * esz, base + t.offset(b, h, slots[i]) * esz, row_bytes);
  }
}
}  // namespace detail

// Validates everything first, then moves: the cache is never left half-compacted.
inline void compact(const KVCacheView& kv, const KeepPlan& plan) {
  kv.validate();
  KVSIFT_CHECK(kv.device() == Device::cpu,
               "compact: the cache is in device memory; call compact(kv, plan, ctx)");
  kv.check_separate_buffers("compact");
  plan.validate();
  plan.check_matches(kv);
  detail::check_plan_pads_agree(kv, plan);
  for (std::int64_t b = 0; b < plan.batch(); ++b) {
    if (plan.kept_length(b) == plan.source_length(b)) continue;  // a full row keeps 0..len-1
    for (std::int64_t h = 0; h < plan.kv_heads(); ++h) {
      detail::compact_rows(kv.keys, b, h, plan.row(b, h), plan.kept_length(b));
      detail::compact_rows(kv.values, b, h, plan.row(b, h), plan.kept_length(b));
    }
    if (kv.valid_mask != nullptr) {
      std::uint8_t* m = kv.valid_mask + b * kv.capacity();
      const std::int32_t* s = plan.row(b, 0);
      for (std::int64_t i = 0; i < plan.kept_length(b); ++i) m[i] = m[s[i]];
    }
    kv.lengths[b] = plan.kept_length(b);
  }
}

// Dispatches by kv.device(): host views as compact(kv, plan), device views to the CUDA backend
// (which validates on the host before it enqueues anything).
inline void compact(const KVCacheView& kv, const KeepPlan& plan, const ExecContext& ctx) {
  if (kv.device() == Device::cpu) return compact(kv, plan);
  device_backend().compact(kv, plan, ctx);
}

// Device scratch compact(kv, plan, ctx) needs: 0 for host views.
inline std::size_t compact_workspace_bytes(const KVCacheView& kv, const KeepPlan& plan) {
  return kv.device() == Device::cpu ? 0 : device_backend().compact_workspace_bytes(plan);
}

}  // namespace kvsift
