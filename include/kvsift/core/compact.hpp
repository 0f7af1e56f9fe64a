// compact(): applies a KeepPlan to a cache in place. Kept rows move to the front of each
// (sequence, head) in slot order; lengths and the padding mask are rewritten to match.
//   compact(kv, plan)       host memory only;
//   compact(kv, plan, ctx)  by the view's device: host memory here, device memory through the
//                           registered CUDA backend on ctx.stream with ctx.workspace (size it with
//                           compact_workspace_bytes(plan)).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

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

// Applies plans[l] to layers[l] for every layer of one compression step. Layers may share one
// valid_mask (it describes the sequence, not the layer): it is then compacted once, by the first
// layer that uses it, which requires every sharing layer's plan to leave it the same content —
// true whenever pads are never kept (every method's default). Everything, that included (the mask
// staged to the host for device views), is checked before anything moves.
//   layers  [n_layers] caches, one device;  plans  [n_layers], plans[l] made for layers[l]
inline void compact_layers(const KVCacheView* layers, const KeepPlan* plans, int n_layers,
                           const ExecContext& ctx) {
  std::vector<int> mask_owner(static_cast<std::size_t>(n_layers), -1);
  std::vector<std::uint8_t> staged;  // a device mask, read once
  for (int l = 0; l < n_layers; ++l) {
    const KVCacheView& kv = layers[l];
    kv.validate();
    plans[l].validate();
    plans[l].check_matches(kv);
    for (int f = 0; f < l && kv.valid_mask != nullptr; ++f)
      if (layers[f].valid_mask == kv.valid_mask && mask_owner[f] < 0) {
        mask_owner[l] = f;
        break;
      }
    if (mask_owner[l] < 0) continue;
    const int f = mask_owner[l];
    const std::size_t mask_bytes = static_cast<std::size_t>(kv.batch() * kv.capacity());
    const std::uint8_t* mask = kv.valid_mask;
    if (kv.device() != Device::cpu) {
      if (staged.empty()) {
        staged.resize(mask_bytes);
        device_backend().copy_to_host(staged.data(), kv.valid_mask, mask_bytes, ctx);
      }
      mask = staged.data();
    }
    const KeepPlan &mine = plans[l], &first = plans[f];
    for (std::int64_t b = 0; b < kv.batch(); ++b) {
      const std::uint8_t* m = mask + b * kv.capacity();
      KVSIFT_CHECK(mine.kept_length(b) == first.kept_length(b), "compact_layers: layers ", f,
                   " and ", l, " share a valid_mask but keep ", first.kept_length(b), " and ",
                   mine.kept_length(b), " tokens of sequence ", b);
      const std::int32_t* ref = first.row(b, 0);
      for (std::int64_t h = 0; h < mine.kv_heads(); ++h) {
        const std::int32_t* s = mine.row(b, h);
        for (std::int64_t i = 0; i < mine.kept_length(b); ++i)
          KVSIFT_CHECK(m[s[i]] == m[ref[i]], "compact_layers: layers ", f, " and ", l,
                       " share a valid_mask but keep pads at different positions (sequence ", b,
                       ", head ", h, ", kept slot ", i, "); give each layer its own mask");
      }
    }
  }
  for (int l = 0; l < n_layers; ++l) {
    KVCacheView kv = layers[l];
    if (mask_owner[static_cast<std::size_t>(l)] >= 0) kv.valid_mask = nullptr;  // done by its owner
    compact(kv, plans[l], ctx);
  }
}

}  // namespace kvsift
