// The policy, plan and compaction entry points: thin translations onto kvsift::Policy
// (policy/policy.hpp), the registry (policy/registry.hpp) and compact().
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "convert.hpp"
#include "handles.hpp"
#include "kvsift/c/kvsift.h"
#include "kvsift/core/compact.hpp"
#include "kvsift/core/exec_context.hpp"
#include "kvsift/core/step_inputs.hpp"
#include "kvsift/policy/registry.hpp"
#include "status.hpp"

namespace kvsift::c_api {
namespace {

kvsift::Policy& policy_of(kvsift_policy* p) {
  KVSIFT_CHECK(p != nullptr && p->impl != nullptr, "policy is NULL");
  return *p->impl;
}
const kvsift::Policy& policy_of(const kvsift_policy* p) {
  KVSIFT_CHECK(p != nullptr && p->impl != nullptr, "policy is NULL");
  return *p->impl;
}
const KeepPlan& plan_of(const kvsift_plan* p) {
  KVSIFT_CHECK(p != nullptr, "plan is NULL");
  return p->plan;
}

// The inputs of one layer's select (and its workspace query), checked.
StepInputs step_inputs(int32_t layer, const kvsift_cache_view* kv,
                       const kvsift_tensor* window_queries) {
  StepInputs in;
  KVSIFT_CHECK(layer >= 0, "layer must be >= 0, got ", layer);
  in.layer = layer;
  in.kv = to_cache_view(kv, "kv");
  in.window_queries = to_optional_tensor_view(window_queries, "window_queries");
  if (in.window_queries.rank != 0) {
    KVSIFT_CHECK(in.window_queries.device == in.kv.device(), "window_queries are on ",
                 device_name(in.window_queries.device), " but the cache is on ",
                 device_name(in.kv.device()));
  }
  return in;
}

void copy_lengths(const std::vector<std::int32_t>& from, int32_t* out, int64_t n) {
  KVSIFT_CHECK(out != nullptr, "out is NULL");
  KVSIFT_CHECK(n >= static_cast<int64_t>(from.size()), "n (", n, ") is smaller than batch (",
               from.size(), ")");
  std::copy(from.begin(), from.end(), out);
}

// The step's views: layers[n] and, when given, window_queries[n].
struct StepViews {
  std::vector<KVCacheView> layers;
  std::vector<TensorView> queries;
};
StepViews step_views(int32_t n_layers, const kvsift_cache_view* layers,
                     const kvsift_tensor* window_queries) {
  KVSIFT_CHECK(n_layers >= 1, "n_layers must be >= 1, got ", n_layers);
  KVSIFT_CHECK(layers != nullptr, "layers is NULL (n_layers = ", n_layers, ")");
  StepViews v;
  for (int32_t l = 0; l < n_layers; ++l) {
    const StepInputs in = step_inputs(l, layers + l, window_queries ? window_queries + l : nullptr);
    v.layers.push_back(in.kv);
    v.queries.push_back(in.window_queries);
  }
  return v;
}

}  // namespace
}  // namespace kvsift::c_api

using namespace kvsift::c_api;
using kvsift::ExecContext;
using kvsift::KeepPlan;
using kvsift::StepInputs;

extern "C" {

kvsift_status kvsift_policy_create(const char* name, const char* json_config, kvsift_policy** out) {
  return guarded("kvsift_policy_create", [&] {
    KVSIFT_CHECK(out != nullptr, "out is NULL");
    *out = nullptr;
    KVSIFT_CHECK(name != nullptr, "name is NULL");
    if (kvsift::method_info(name).owns_cache) {
      throw StatusError(KVSIFT_ERROR_UNSUPPORTED,
                        std::string("'") + name +
                            "' owns its KV cache (it has no select/compact): create it with "
                            "kvsift_owning_policy_create");
    }
    auto handle = std::make_unique<kvsift_policy>();
    handle->impl = kvsift::make_policy(name, json_config != nullptr ? json_config : "{}");
    handle->name = name;
    *out = handle.release();
  });
}

void kvsift_policy_destroy(kvsift_policy* policy) { delete policy; }

const char* kvsift_policy_name(const kvsift_policy* policy) {
  return policy == nullptr ? nullptr : policy->name.c_str();
}

kvsift_status kvsift_policy_needs(const kvsift_policy* policy, uint32_t* out_needs) {
  return guarded("kvsift_policy_needs", [&] {
    const kvsift::Policy& p = policy_of(policy);
    KVSIFT_CHECK(out_needs != nullptr, "out_needs is NULL");
    *out_needs = p.needs();
  });
}

kvsift_status kvsift_policy_should_compress(const kvsift_policy* policy,
                                            const kvsift_cache_view* kv, int* out) {
  return guarded("kvsift_policy_should_compress", [&] {
    const kvsift::Policy& p = policy_of(policy);
    KVSIFT_CHECK(out != nullptr, "out is NULL");
    *out = p.should_compress(to_cache_view(kv, "kv")) ? 1 : 0;
  });
}

kvsift_status kvsift_policy_observe(kvsift_policy* policy, const kvsift_observation* obs) {
  return guarded("kvsift_policy_observe", [&] {
    kvsift::Policy& p = policy_of(policy);
    p.observe(to_observation(obs, "obs"));
  });
}

kvsift_status kvsift_policy_workspace_bytes(const kvsift_policy* policy, int32_t layer,
                                            const kvsift_cache_view* kv,
                                            const kvsift_tensor* window_queries,
                                            size_t* out_bytes) {
  return guarded("kvsift_policy_workspace_bytes", [&] {
    const kvsift::Policy& p = policy_of(policy);
    KVSIFT_CHECK(out_bytes != nullptr, "out_bytes is NULL");
    *out_bytes = p.workspace_bytes(step_inputs(layer, kv, window_queries));
  });
}

kvsift_status kvsift_policy_select(kvsift_policy* policy, int32_t layer,
                                   const kvsift_cache_view* kv, const kvsift_tensor* window_queries,
                                   void* workspace, size_t workspace_bytes, void* stream,
                                   kvsift_plan** out) {
  return guarded("kvsift_policy_select", [&] {
    KVSIFT_CHECK(out != nullptr, "out is NULL");
    *out = nullptr;
    kvsift::Policy& p = policy_of(policy);
    const StepInputs in = step_inputs(layer, kv, window_queries);
    auto handle = std::make_unique<kvsift_plan>();
    handle->plan = p.select(in, ExecContext{workspace, workspace_bytes, stream});
    *out = handle.release();
  });
}

kvsift_status kvsift_policy_step_workspace_bytes(const kvsift_policy* policy, int32_t n_layers,
                                                 const kvsift_cache_view* layers,
                                                 const kvsift_tensor* window_queries,
                                                 size_t* out_bytes) {
  return guarded("kvsift_policy_step_workspace_bytes", [&] {
    const kvsift::Policy& p = policy_of(policy);
    KVSIFT_CHECK(out_bytes != nullptr, "out_bytes is NULL");
    const StepViews v = step_views(n_layers, layers, window_queries);
    *out_bytes = p.step_workspace_bytes(v.layers.data(), v.queries.data(), n_layers);
  });
}

kvsift_status kvsift_policy_compress_step(kvsift_policy* policy, int32_t n_layers,
                                          const kvsift_cache_view* layers,
                                          const kvsift_tensor* window_queries, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  return guarded("kvsift_policy_compress_step", [&] {
    kvsift::Policy& p = policy_of(policy);
    const StepViews v = step_views(n_layers, layers, window_queries);
    p.compress_step(v.layers.data(), v.queries.data(), n_layers,
                    ExecContext{workspace, workspace_bytes, stream});
  });
}

void kvsift_plan_destroy(kvsift_plan* plan) { delete plan; }

kvsift_status kvsift_plan_shape(const kvsift_plan* plan, int64_t* batch, int64_t* kv_heads,
                                int64_t* capacity, int64_t* max_kept) {
  return guarded("kvsift_plan_shape", [&] {
    const KeepPlan& p = plan_of(plan);
    if (batch != nullptr) *batch = p.batch();
    if (kv_heads != nullptr) *kv_heads = p.kv_heads();
    if (capacity != nullptr) *capacity = p.capacity();
    if (max_kept != nullptr) {
      const auto& k = p.kept_lengths();
      *max_kept = k.empty() ? 0 : *std::max_element(k.begin(), k.end());
    }
  });
}

kvsift_status kvsift_plan_keeps_everything(const kvsift_plan* plan, int* out) {
  return guarded("kvsift_plan_keeps_everything", [&] {
    const KeepPlan& p = plan_of(plan);
    KVSIFT_CHECK(out != nullptr, "out is NULL");
    *out = p.keeps_everything() ? 1 : 0;
  });
}

kvsift_status kvsift_plan_kept_lengths(const kvsift_plan* plan, int32_t* out, int64_t n) {
  return guarded("kvsift_plan_kept_lengths",
                 [&] { copy_lengths(plan_of(plan).kept_lengths(), out, n); });
}

kvsift_status kvsift_plan_source_lengths(const kvsift_plan* plan, int32_t* out, int64_t n) {
  return guarded("kvsift_plan_source_lengths",
                 [&] { copy_lengths(plan_of(plan).source_lengths(), out, n); });
}

kvsift_status kvsift_plan_slots(const kvsift_plan* plan, int32_t* out, int64_t capacity) {
  return guarded("kvsift_plan_slots", [&] {
    const KeepPlan& p = plan_of(plan);
    KVSIFT_CHECK(p.complete(), "the plan has only ", p.rows_appended(), " of ",
                 p.batch() * p.kv_heads(), " rows");
    int64_t max_kept = 0;
    for (std::int32_t k : p.kept_lengths()) max_kept = std::max<int64_t>(max_kept, k);
    const int64_t needed = p.batch() * p.kv_heads() * max_kept;
    KVSIFT_CHECK(out != nullptr || needed == 0, "out is NULL (", needed, " slots to copy)");
    KVSIFT_CHECK(capacity >= needed, "capacity (", capacity,
                 ") is smaller than batch * kv_heads * max_kept = ", p.batch(), " * ", p.kv_heads(),
                 " * ", max_kept, " = ", needed);
    for (int64_t b = 0; b < p.batch(); ++b) {
      for (int64_t h = 0; h < p.kv_heads(); ++h) {
        int32_t* row = out + (b * p.kv_heads() + h) * max_kept;
        const int64_t n = p.row_size(b, h);
        std::copy(p.row(b, h), p.row(b, h) + n, row);
        std::fill(row + n, row + max_kept, -1);
      }
    }
  });
}

kvsift_status kvsift_compact_workspace_bytes(const kvsift_cache_view* kv, const kvsift_plan* plan,
                                             size_t* out_bytes) {
  return guarded("kvsift_compact_workspace_bytes", [&] {
    const KeepPlan& p = plan_of(plan);
    KVSIFT_CHECK(out_bytes != nullptr, "out_bytes is NULL");
    *out_bytes = kvsift::compact_workspace_bytes(to_cache_view(kv, "kv"), p);
  });
}

kvsift_status kvsift_compact(const kvsift_cache_view* kv, const kvsift_plan* plan, void* workspace,
                             size_t workspace_bytes, void* stream) {
  return guarded("kvsift_compact", [&] {
    const KeepPlan& p = plan_of(plan);
    kvsift::compact(to_cache_view(kv, "kv"), p, ExecContext{workspace, workspace_bytes, stream});
  });
}

}  // extern "C"
