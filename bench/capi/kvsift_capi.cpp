// kvsift_capi: the C ABI of kvsift_capi.h over kvsift::cuda (rkv_scoring.hpp, compact.hpp).
// Exceptions never cross the ABI: each entry point catches, stores the message per thread and
// returns a code, so a Python ctypes caller sees an error string instead of an abort.
#include "kvsift_capi.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "kvsift/backend/cuda/compact.hpp"
#include "kvsift/backend/cuda/rkv_scoring.hpp"
#include "kvsift/backend/cuda/workspace.hpp"

namespace {

using namespace kvsift;

thread_local std::string g_last_error;

// Runs `body`, translating exceptions into the C error codes.
template <class Body>
int guarded(Body&& body) {
  g_last_error.clear();
  try {
    body();
    return KVSIFT_CAPI_OK;
  } catch (const Error& e) {
    g_last_error = e.what();
    return KVSIFT_CAPI_INVALID_ARGUMENT;
  } catch (const std::bad_alloc& e) {
    g_last_error = std::string("out of host memory: ") + e.what();
    return KVSIFT_CAPI_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return KVSIFT_CAPI_INTERNAL;
  } catch (...) {
    g_last_error = "unknown exception";
    return KVSIFT_CAPI_INTERNAL;
  }
}

DType to_dtype(int code) {
  KVSIFT_CHECK(code == KVSIFT_CAPI_F32 || code == KVSIFT_CAPI_F16 || code == KVSIFT_CAPI_BF16,
               "kvsift_capi: dtype code must be 0 (f32), 1 (f16) or 2 (bf16), got ", code);
  return code == KVSIFT_CAPI_F32 ? DType::f32 : code == KVSIFT_CAPI_F16 ? DType::f16 : DType::bf16;
}

struct Shapes {
  DType dtype;
  int batch, kv_heads, q_heads, head_dim, budget, window;
  std::int64_t capacity;
};

Shapes check_shapes(int dtype, int batch, int kv_heads, int q_heads, std::int64_t capacity,
                    int head_dim, int budget, int window) {
  KVSIFT_CHECK(batch >= 0 && kv_heads >= 1 && q_heads >= 1 && capacity >= 0 && head_dim >= 1,
               "kvsift_capi: bad shape batch=", batch, " kv_heads=", kv_heads, " q_heads=", q_heads,
               " capacity=", capacity, " head_dim=", head_dim);
  KVSIFT_CHECK(budget >= 1, "kvsift_capi: budget must be >= 1, got ", budget);
  return Shapes{to_dtype(dtype), batch, kv_heads, q_heads, head_dim, budget, window, capacity};
}

struct Views {
  KVCacheView kv;
  TensorView queries;
};

// Views over the caller's device buffers; KVCacheView::validate() checks lengths (host).
Views make_views(const Shapes& s, void* keys, void* values, const void* queries,
                 std::int32_t* lengths) {
  Views v;
  v.kv = make_kv_cache_view(keys, values, s.dtype, Device::cuda, s.batch, s.kv_heads, s.capacity,
                            s.head_dim, lengths);
  v.queries = TensorView::contiguous(const_cast<void*>(queries), s.dtype, Device::cuda,
                                     {s.batch, s.q_heads, s.window, s.head_dim});
  return v;
}

RKVConfig make_config(const Shapes& s, float mix_lambda, float threshold) {
  RKVConfig cfg;  // kernel, redundancy mode: docs/algorithms.md §4 defaults
  cfg.budget = s.budget;
  cfg.window = s.window;
  cfg.mix_lambda = mix_lambda;
  cfg.threshold = threshold;
  // The tensor-core search gives the fp32 search's exact answers (same r_i, bit-identical scores),
  // so the benchmark times the fast path.
  cfg.tensor_core_search = true;
  cfg.buffer = std::max(cfg.buffer, cfg.window);  // the trigger is the caller's business
  cfg.validate();
  return cfg;
}

std::size_t slot_count(const Shapes& s) {
  return static_cast<std::size_t>(s.batch) * s.kv_heads * s.budget;
}

// Upper bound of cuda::compact_workspace_bytes() for any plan of these shapes: every row keeps at
// most `budget` slots.
std::size_t compact_bound(const Shapes& s) {
  const std::size_t rows = static_cast<std::size_t>(s.batch) * s.kv_heads;
  return cuda::align_up((rows + 1) * sizeof(std::int64_t)) +
         cuda::align_up(std::max<std::size_t>(slot_count(s), 1) * sizeof(std::int32_t));
}

// The workspace is laid out as [R-KV scratch | slot rows | compaction plan].
struct Layout {
  std::size_t rkv, slots, compact;
  std::size_t total() const { return rkv + slots + compact; }
};

Layout layout_for(const Shapes& s, const Views& v, const RKVConfig& cfg) {
  Layout l;
  l.rkv = cuda::align_up(cuda::rkv_workspace_bytes(v.kv, v.queries, cfg));
  l.slots = cuda::align_up(std::max<std::size_t>(slot_count(s), 1) * sizeof(std::int32_t));
  l.compact = compact_bound(s);
  return l;
}

// Score + select; returns whether scoring ran. `slots_out` may be null (the workspace slice).
bool select_into(const Shapes& s, const Views& v, const RKVConfig& cfg, std::int32_t*& slots,
                 void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const Layout l = layout_for(s, v, cfg);
  KVSIFT_CHECK(workspace != nullptr || l.total() == 0, "kvsift_capi: workspace is null but ",
               l.total(), " bytes are needed");
  KVSIFT_CHECK(workspace_bytes >= l.total(), "kvsift_capi: workspace of ", workspace_bytes,
               " bytes is too small (", l.total(), " needed)");
  char* base = static_cast<char*>(workspace);
  if (slots == nullptr) slots = reinterpret_cast<std::int32_t*>(base + l.rkv);
  return cuda::rkv_select(v.kv, v.queries, cfg, slots, nullptr, base, l.rkv, stream);
}

// Views of every layer of a step over the caller's per-layer device buffers (one lengths array:
// all layers hold the same tokens).
struct LayerViews {
  std::vector<KVCacheView> kv;
  std::vector<TensorView> queries;
};

LayerViews make_layer_views(const Shapes& s, int n_layers, void* const* keys, void* const* values,
                            const void* const* queries, std::int32_t* lengths) {
  KVSIFT_CHECK(n_layers >= 1, "kvsift_capi: n_layers must be >= 1, got ", n_layers);
  KVSIFT_CHECK(keys != nullptr && values != nullptr && queries != nullptr,
               "kvsift_capi: keys, values and queries must be arrays of n_layers pointers");
  LayerViews lv;
  for (int l = 0; l < n_layers; ++l) {
    const Views v = make_views(s, keys[l], values[l], queries[l], lengths);
    lv.kv.push_back(v.kv);
    lv.queries.push_back(v.queries);
  }
  return lv;
}

// The step workspace: [R-KV scratch of all layers | slot rows [n_layers, batch, kv_heads, budget]].
Layout layers_layout(const Shapes& s, const LayerViews& lv, const RKVConfig& cfg) {
  const int n = static_cast<int>(lv.kv.size());
  Layout l;
  l.rkv = cuda::align_up(cuda::rkv_step_workspace_bytes(lv.kv.data(), lv.queries.data(), n, cfg));
  l.slots = cuda::align_up(std::max<std::size_t>(n * slot_count(s), 1) * sizeof(std::int32_t));
  l.compact = 0;
  return l;
}

}  // namespace

extern "C" {

const char* kvsift_capi_last_error(void) { return g_last_error.c_str(); }

int kvsift_rkv_workspace_bytes(int dtype, int batch, int kv_heads, int q_heads, int64_t capacity,
                               int head_dim, int32_t length, int budget, int window,
                               size_t* bytes) {
  return guarded([&] {
    KVSIFT_CHECK(bytes != nullptr, "kvsift_rkv_workspace_bytes: bytes must not be null");
    const Shapes s =
        check_shapes(dtype, batch, kv_heads, q_heads, capacity, head_dim, budget, window);
    // Sizing reads shapes only; the views need non-null data, so a never-dereferenced
    // placeholder stands in for the device buffers.
    static char placeholder;
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(batch), length);
    const Views v = make_views(s, &placeholder, &placeholder, &placeholder, lengths.data());
    *bytes = layout_for(s, v, make_config(s, 0.1f, 0.5f)).total();
  });
}

int kvsift_rkv_select(int dtype, void* keys, void* values, const void* queries, int batch,
                      int kv_heads, int q_heads, int64_t capacity, int head_dim,
                      const int32_t* lengths, int budget, int window, float mix_lambda,
                      float threshold, int32_t* slots_out, void* workspace, size_t workspace_bytes,
                      void* stream, int* compressed) {
  return guarded([&] {
    KVSIFT_CHECK(slots_out != nullptr, "kvsift_rkv_select: slots_out must be a device pointer");
    const Shapes s =
        check_shapes(dtype, batch, kv_heads, q_heads, capacity, head_dim, budget, window);
    // rkv_select only reads the lengths; the view type is shared with compact(), which writes.
    const Views v = make_views(s, keys, values, queries, const_cast<std::int32_t*>(lengths));
    std::int32_t* slots = slots_out;
    const bool ran = select_into(s, v, make_config(s, mix_lambda, threshold), slots, workspace,
                                 workspace_bytes, static_cast<cudaStream_t>(stream));
    if (compressed != nullptr) *compressed = ran ? 1 : 0;
  });
}

int kvsift_rkv_step(int dtype, void* keys, void* values, const void* queries, int batch,
                    int kv_heads, int q_heads, int64_t capacity, int head_dim, int32_t* lengths,
                    int budget, int window, float mix_lambda, float threshold, int32_t* slots_out,
                    void* workspace, size_t workspace_bytes, void* stream, int* compressed) {
  return guarded([&] {
    const Shapes s =
        check_shapes(dtype, batch, kv_heads, q_heads, capacity, head_dim, budget, window);
    const Views v = make_views(s, keys, values, queries, lengths);
    const RKVConfig cfg = make_config(s, mix_lambda, threshold);
    const auto st = static_cast<cudaStream_t>(stream);
    std::int32_t* slots = slots_out;
    const bool ran = select_into(s, v, cfg, slots, workspace, workspace_bytes, st);
    if (compressed != nullptr) *compressed = ran ? 1 : 0;
    if (!ran) return;  // at or below the budget: nothing moves (§1.3), no need to wait
    // The slot rows stay on the device: no host plan, no stream synchronisation. Without a pad
    // mask a compressed sequence keeps exactly `budget` slots and the others all of theirs, so
    // the host lengths are known.
    cuda::compact_device_rows(v.kv, slots, s.budget, nullptr, st);
    for (int b = 0; b < s.batch; ++b) lengths[b] = std::min(lengths[b], s.budget);
  });
}

int kvsift_rkv_layers_workspace_bytes(int dtype, int n_layers, int batch, int kv_heads, int q_heads,
                                      int64_t capacity, int head_dim, int32_t length, int budget,
                                      int window, size_t* bytes) {
  return guarded([&] {
    KVSIFT_CHECK(bytes != nullptr, "kvsift_rkv_layers_workspace_bytes: bytes must not be null");
    const Shapes s =
        check_shapes(dtype, batch, kv_heads, q_heads, capacity, head_dim, budget, window);
    static char placeholder;  // never dereferenced: sizing reads shapes only
    std::vector<void*> ptrs(static_cast<std::size_t>(std::max(n_layers, 0)), &placeholder);
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(batch), length);
    const LayerViews lv =
        make_layer_views(s, n_layers, ptrs.data(), ptrs.data(), ptrs.data(), lengths.data());
    *bytes = layers_layout(s, lv, make_config(s, 0.1f, 0.5f)).total();
  });
}

int kvsift_rkv_layers_step(int dtype, int n_layers, void* const* keys, void* const* values,
                           const void* const* queries, int batch, int kv_heads, int q_heads,
                           int64_t capacity, int head_dim, int32_t* lengths, int budget, int window,
                           float mix_lambda, float threshold, void* workspace,
                           size_t workspace_bytes, void* stream, int* compressed) {
  return guarded([&] {
    const Shapes s =
        check_shapes(dtype, batch, kv_heads, q_heads, capacity, head_dim, budget, window);
    const LayerViews lv = make_layer_views(s, n_layers, keys, values, queries, lengths);
    const RKVConfig cfg = make_config(s, mix_lambda, threshold);
    const Layout l = layers_layout(s, lv, cfg);
    KVSIFT_CHECK(workspace_bytes >= l.total(), "kvsift_capi: workspace of ", workspace_bytes,
                 " bytes is too small (", l.total(), " needed)");
    char* base = static_cast<char*>(workspace);
    auto* slots = reinterpret_cast<std::int32_t*>(base + l.rkv);
    const auto st = static_cast<cudaStream_t>(stream);
    const bool ran = cuda::rkv_select_step(lv.kv.data(), lv.queries.data(), n_layers, cfg, slots,
                                           nullptr, base, l.rkv, st);
    if (compressed != nullptr) *compressed = ran ? 1 : 0;
    if (!ran) return;
    cuda::compact_device_rows_step(lv.kv.data(), n_layers, slots, s.budget, nullptr, st);
    for (int b = 0; b < s.batch; ++b)  // no pad mask: full budget, or everything when below it
      lengths[b] = std::min(lengths[b], s.budget);
  });
}

}  // extern "C"
