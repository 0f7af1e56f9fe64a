/* kvsift C API: every registered KV-cache compression method, on host or device memory, behind
 * one small C99 interface (link kvsift::c, libkvsift_c). It wraps the C++ kvsift::Policy
 * (kvsift/policy/policy.hpp) one to one; the per-step loop of an engine is
 *
 *   kvsift_policy_create("rkv", "{\"budget\": 1024}", &policy);
 *   every step:  kvsift_policy_observe(policy, &step_obs);          (what kvsift_policy_needs says)
 *                kvsift_policy_observe(policy, &layer_obs[l]);      (per layer, when needed)
 *   kvsift_policy_should_compress(policy, &cache[0], &go);
 *   if (go) for each layer l:
 *     kvsift_policy_compress_step(policy, n_layers, cache, window_queries, ws, ws_bytes, stream);
 *   or, per layer (an engine that applies plans itself, e.g. by remapping pages):
 *     kvsift_policy_select(policy, l, &cache[l], &window_queries[l], ws, ws_bytes, stream, &plan);
 *     kvsift_compact(&cache[l], plan, ws, ws_bytes, stream);
 *     kvsift_plan_destroy(plan);
 * Methods that own their KV storage (ThinKV, KIVI, PM-KVQ) have their own handle:
 * kvsift_owning_policy_*.
 *
 * Conventions
 * - Every function that can fail returns a kvsift_status; KVSIFT_OK is 0. On failure
 *   kvsift_last_error() holds a message naming the argument and the values (per thread). No C++
 *   exception ever leaves the library, and null pointers and bad enum values are reported, not
 *   dereferenced.
 * - kvsift never allocates device memory: device calls carve their scratch from the caller's
 *   workspace (ask the *_workspace_bytes function first) and enqueue on the caller's stream
 *   (a cudaStream_t passed as void*; NULL is the default stream).
 * - Tensors are described, never copied: kvsift_tensor is a non-owning strided view; the
 *   caller keeps the memory alive for the duration of each call.
 * - Handles (kvsift_policy, kvsift_plan, kvsift_owning_policy) are not thread-safe: use each
 *   from one thread at a time. Different handles may be used from different threads.
 */
#ifndef KVSIFT_C_KVSIFT_H_
#define KVSIFT_C_KVSIFT_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32) && defined(KVSIFT_C_BUILDING)
#define KVSIFT_C_EXPORT __declspec(dllexport)
#elif defined(_WIN32)
#define KVSIFT_C_EXPORT __declspec(dllimport)
#elif defined(__GNUC__) || defined(__clang__)
#define KVSIFT_C_EXPORT __attribute__((visibility("default")))
#else
#define KVSIFT_C_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Status codes and errors
 * ------------------------------------------------------------------------------------------- */
typedef enum kvsift_status {
  KVSIFT_OK = 0,
  KVSIFT_ERROR_INVALID_ARGUMENT = 1, /* bad shape, config, JSON, pointer, enum or plan */
  KVSIFT_ERROR_UNSUPPORTED = 2,      /* a valid request this method does not serve (a cache-
                                        owning method through kvsift_policy_create, device
                                        memory to a cache-owning method) */
  KVSIFT_ERROR_NO_CUDA = 3,          /* device memory, but no CUDA backend or no device */
  KVSIFT_ERROR_OUT_OF_MEMORY = 4,    /* a host allocation failed */
  KVSIFT_ERROR_INTERNAL = 5          /* anything else (a bug: please report the message) */
} kvsift_status;

/* The message of the last failing call on this thread; "" after a call that succeeded. Valid
 * until the next kvsift call on this thread. Never NULL. */
KVSIFT_C_EXPORT const char* kvsift_last_error(void);
/* "OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for a value outside the enum. Never NULL. */
KVSIFT_C_EXPORT const char* kvsift_status_name(int32_t status);

/* ---------------------------------------------------------------------------------------------
 * Library
 * ------------------------------------------------------------------------------------------- */
/* The library's version; any pointer may be NULL. */
KVSIFT_C_EXPORT void kvsift_version(int* major, int* minor, int* patch);
/* "0.1.0". Never NULL. */
KVSIFT_C_EXPORT const char* kvsift_version_string(void);
/* 1 when this library was built with the CUDA backend AND a CUDA device is present, else 0. */
KVSIFT_C_EXPORT int kvsift_cuda_available(void);

/* ---------------------------------------------------------------------------------------------
 * Methods (the registry: one entry per method, in table order)
 * ------------------------------------------------------------------------------------------- */
/* What a method's observe reads (a bit set; mirrors kvsift::Needs). */
#define KVSIFT_NEEDS_NOTHING 0u
#define KVSIFT_NEEDS_QUERIES 1u /* per layer: the step's queries */
#define KVSIFT_NEEDS_TOKENS 2u  /* once per step: the appended token ids */
#define KVSIFT_NEEDS_HIDDEN 4u  /* once per step: final-norm last-layer hidden states */
#define KVSIFT_NEEDS_APPEND 8u  /* per layer: the appended K/V (the cache after the append) */

KVSIFT_C_EXPORT int32_t kvsift_method_count(void);
/* Name ("rkv"), family ("baseline", "skipkv", ...) and one-line summary of method i, as static
 * NUL-terminated strings; NULL (and kvsift_last_error() set) when i is outside [0, count). */
KVSIFT_C_EXPORT const char* kvsift_method_name(int32_t i);
KVSIFT_C_EXPORT const char* kvsift_method_family(int32_t i);
KVSIFT_C_EXPORT const char* kvsift_method_summary(int32_t i);
/* The KVSIFT_NEEDS_* bits of method i (with its default config). */
KVSIFT_C_EXPORT kvsift_status kvsift_method_needs(int32_t i, uint32_t* out_needs);
/* *out = 1 when method i owns its KV storage (ThinKV, KIVI, PM-KVQ): build it with
 * kvsift_owning_policy_create; it has no select/compact. 0: a policy over the engine's cache
 * (kvsift_policy_create). */
KVSIFT_C_EXPORT kvsift_status kvsift_method_owns_cache(int32_t i, int* out);
/* Every config key of method i with its default value, as a JSON object: the valid keys of
 * json_config. Static string; NULL when i is out of range. */
KVSIFT_C_EXPORT const char* kvsift_method_default_config(int32_t i);
/* A config that creates method i: "{}" unless it has required fields (ThinKV's calibrated
 * thresholds). Static string; NULL when i is out of range. */
KVSIFT_C_EXPORT const char* kvsift_method_example_config(int32_t i);

/* ---------------------------------------------------------------------------------------------
 * Tensors and cache views (non-owning descriptions of the caller's memory)
 * ------------------------------------------------------------------------------------------- */
typedef enum kvsift_dtype {
  KVSIFT_DTYPE_F32 = 0,
  KVSIFT_DTYPE_F16 = 1,
  KVSIFT_DTYPE_BF16 = 2
} kvsift_dtype;
typedef enum kvsift_device { KVSIFT_DEVICE_CPU = 0, KVSIFT_DEVICE_CUDA = 1 } kvsift_device;

/* A strided view of up to 4 dimensions. rank 0 (with data NULL) means "not given" for the
 * optional tensors. Enum fields are int32_t so that the layout is fixed across compilers. */
typedef struct kvsift_tensor {
  void* data;         /* first element; host or device memory per `device` */
  int64_t shape[4];   /* the first `rank` entries are meaningful */
  int64_t strides[4]; /* in ELEMENTS, not bytes; the innermost dimension must have stride 1 */
  int32_t rank;       /* 0..4 */
  int32_t dtype;      /* kvsift_dtype */
  int32_t device;     /* kvsift_device */
  int32_t reserved;   /* set to 0 */
} kvsift_tensor;

/* One layer's KV cache as the engine stores it. */
typedef struct kvsift_cache_view {
  kvsift_tensor keys;   /* [batch, kv_heads, capacity, head_dim], post-RoPE */
  kvsift_tensor values; /* [batch, kv_heads, capacity, head_dim], same dtype/device as keys */
  int32_t* lengths;     /* [batch] resident tokens per sequence, HOST memory; kvsift_compact
                           rewrites it */
  uint8_t* valid_mask;  /* [batch, capacity] optional (NULL: no pads), 1 = real token, 0 = left
                           pad; same device as keys; kvsift_compact rewrites it */
} kvsift_cache_view;

/* Fills `t` as a row-major contiguous view of `rank` dims (shape[rank]) over `data`. */
KVSIFT_C_EXPORT kvsift_status kvsift_tensor_contiguous(kvsift_tensor* t, void* data, int32_t dtype,
                                                       int32_t device, int32_t rank,
                                                       const int64_t* shape);

/* What a policy may read every step besides the cache (mirrors kvsift::Observation). Zero the
 * struct and fill what kvsift_policy_needs asks for; a method that needs a field it never got
 * refuses to select. */
typedef struct kvsift_observation {
  int32_t layer;             /* the layer of the per-layer fields, or -1 for the step-level part */
  int32_t batch;             /* rows of token_ids; 0: from kv or last_hidden */
  kvsift_cache_view kv;      /* per layer: the cache after this step's append (keys.rank 0: none) */
  kvsift_tensor queries;     /* [batch, q_heads, n, head_dim] this step's n queries (post-RoPE) */
  const int32_t* token_ids;  /* [batch, n] host; the tokens appended this step; NULL: none */
  int64_t num_tokens;        /* n */
  const int32_t* pad_counts; /* [batch] host, left pads among those n tokens; NULL: none */
  kvsift_tensor last_hidden; /* [batch, n, hidden] final-norm last-layer hidden states */
} kvsift_observation;

/* ---------------------------------------------------------------------------------------------
 * Policies
 * ------------------------------------------------------------------------------------------- */
typedef struct kvsift_policy kvsift_policy;
typedef struct kvsift_plan kvsift_plan;

/* Creates method `name` (kvsift_method_name) from a JSON object of its config's fields; NULL or
 * "{}" gives the defaults of docs/algorithms.md §4. Unknown names, malformed JSON, unknown keys,
 * wrong types and invalid values fail with KVSIFT_ERROR_INVALID_ARGUMENT; a method that owns its
 * cache (kvsift_method_owns_cache) with KVSIFT_ERROR_UNSUPPORTED. *out is NULL on failure. */
KVSIFT_C_EXPORT kvsift_status kvsift_policy_create(const char* name, const char* json_config,
                                                   kvsift_policy** out);
/* NULL is a no-op. */
KVSIFT_C_EXPORT void kvsift_policy_destroy(kvsift_policy* policy);
/* The method's registry name; NULL for a NULL policy. */
KVSIFT_C_EXPORT const char* kvsift_policy_name(const kvsift_policy* policy);
/* The KVSIFT_NEEDS_* bits kvsift_policy_observe must be given. */
KVSIFT_C_EXPORT kvsift_status kvsift_policy_needs(const kvsift_policy* policy, uint32_t* out_needs);
/* The decode trigger: *out = 1 when the cache at its current lengths must be compressed now. */
KVSIFT_C_EXPORT kvsift_status kvsift_policy_should_compress(const kvsift_policy* policy,
                                                            const kvsift_cache_view* kv, int* out);
/* Feeds one observation (see kvsift_observation). Methods that need nothing accept and ignore
 * every observation. */
KVSIFT_C_EXPORT kvsift_status kvsift_policy_observe(kvsift_policy* policy,
                                                    const kvsift_observation* obs);

/* Device scratch bytes kvsift_policy_select needs for these inputs (0 for host views).
 *   kv              the layer's cache
 *   window_queries  [batch, q_heads, window, head_dim] the last `window` queries; NULL for
 *                   methods that read none (StreamingLLM, FullKV, ...) */
KVSIFT_C_EXPORT kvsift_status kvsift_policy_workspace_bytes(const kvsift_policy* policy,
                                                            int32_t layer,
                                                            const kvsift_cache_view* kv,
                                                            const kvsift_tensor* window_queries,
                                                            size_t* out_bytes);
/* Plans one layer of one compression step; reads the cache, never writes it. Host views run on
 * the CPU reference; device views on the CUDA backend, on `stream` with `workspace` (at least
 * kvsift_policy_workspace_bytes bytes, device memory); the call waits for the stream once to
 * download the plan. Apply the plan with kvsift_compact (or remap pages) before the next
 * observe or select of that layer. *out is a new plan (kvsift_plan_destroy it), NULL on failure.
 * q_heads of window_queries must be a multiple of kv_heads (GQA). */
KVSIFT_C_EXPORT kvsift_status kvsift_policy_select(kvsift_policy* policy, int32_t layer,
                                                   const kvsift_cache_view* kv,
                                                   const kvsift_tensor* window_queries,
                                                   void* workspace, size_t workspace_bytes,
                                                   void* stream, kvsift_plan** out);

/* One compression step of every layer, applied in place: the engine's one call per step when
 * kvsift_policy_should_compress says so. layers[l] is layer l's cache (its lengths, HOST, and
 * valid_mask are rewritten), window_queries[l] its last `window` queries [batch, q_heads, window,
 * head_dim] (window_queries NULL for methods that read none). Every layer is selected before any
 * is compacted: a failing call leaves every layer as it was (except the one case documented in
 * docs/c_api.md: NaN scores on the device leave only the affected sequences untouched).
 * Device views: `workspace` of at least kvsift_policy_step_workspace_bytes bytes, enqueued on
 * `stream`; R-KV runs every layer in one launch sequence and waits for the stream once (the kept
 * lengths), other methods plan layer by layer. The layers share one device, shape, strides,
 * lengths and (when set) one valid_mask pointer; 1 <= n_layers <= 128 on the device. */
KVSIFT_C_EXPORT kvsift_status kvsift_policy_step_workspace_bytes(
    const kvsift_policy* policy, int32_t n_layers, const kvsift_cache_view* layers,
    const kvsift_tensor* window_queries, size_t* out_bytes);
KVSIFT_C_EXPORT kvsift_status kvsift_policy_compress_step(kvsift_policy* policy, int32_t n_layers,
                                                          const kvsift_cache_view* layers,
                                                          const kvsift_tensor* window_queries,
                                                          void* workspace, size_t workspace_bytes,
                                                          void* stream);

/* ---------------------------------------------------------------------------------------------
 * Plans: for every (sequence b, KV head h) the sorted cache slots that survive. Every head of
 * sequence b keeps kept_lengths[b] slots.
 * ------------------------------------------------------------------------------------------- */
/* NULL is a no-op. */
KVSIFT_C_EXPORT void kvsift_plan_destroy(kvsift_plan* plan);
/* The cache shape the plan was made for, and max over b of kept_lengths[b]; any output may be
 * NULL. */
KVSIFT_C_EXPORT kvsift_status kvsift_plan_shape(const kvsift_plan* plan, int64_t* batch,
                                                int64_t* kv_heads, int64_t* capacity,
                                                int64_t* max_kept);
/* *out = 1 when nothing moves (every sequence keeps all its tokens). */
KVSIFT_C_EXPORT kvsift_status kvsift_plan_keeps_everything(const kvsift_plan* plan, int* out);
/* Copies [batch] kept lengths (resp. the lengths the plan was made for) into out[0..n);
 * n must be >= batch. */
KVSIFT_C_EXPORT kvsift_status kvsift_plan_kept_lengths(const kvsift_plan* plan, int32_t* out,
                                                       int64_t n);
KVSIFT_C_EXPORT kvsift_status kvsift_plan_source_lengths(const kvsift_plan* plan, int32_t* out,
                                                         int64_t n);
/* Copies the kept slots as a PADDED row-major [batch, kv_heads, max_kept] int32 array: row
 * (b, h) starts at out[(b * kv_heads + h) * max_kept], holds kept_lengths[b] ascending slot
 * indices, and is filled up to max_kept with -1. capacity (in elements) must be >=
 * batch * kv_heads * max_kept (kvsift_plan_shape). */
KVSIFT_C_EXPORT kvsift_status kvsift_plan_slots(const kvsift_plan* plan, int32_t* out,
                                                int64_t capacity);

/* ---------------------------------------------------------------------------------------------
 * Compaction: applies a plan to the cache in place (kept rows move to the front of each
 * (sequence, head) in slot order; lengths and valid_mask rewritten). Everything is validated
 * before anything moves: a failing call leaves the cache as it was.
 * ------------------------------------------------------------------------------------------- */
/* Device scratch kvsift_compact needs (0 for host views). */
KVSIFT_C_EXPORT kvsift_status kvsift_compact_workspace_bytes(const kvsift_cache_view* kv,
                                                             const kvsift_plan* plan,
                                                             size_t* out_bytes);
/* The plan must have been made for this cache at its current lengths. Device views: enqueued
 * on `stream` with `workspace`; lengths (host) are rewritten when the call returns. */
KVSIFT_C_EXPORT kvsift_status kvsift_compact(const kvsift_cache_view* kv, const kvsift_plan* plan,
                                             void* workspace, size_t workspace_bytes, void* stream);

/* ---------------------------------------------------------------------------------------------
 * Methods that own their KV storage (kvsift_method_owns_cache; ThinKV keeps paged, quantized,
 * thought-typed blocks, docs/algorithms.md §3.4). The engine hands them every K/V it produces and
 * asks them for attention; there is no select/compact. Per decode step:
 *   for each layer l: kvsift_owning_policy_append(p, l, &k, &v);    k, v [batch, kv_heads, 1, D]
 *                     kvsift_owning_policy_observe(p, &obs);        (queries, as needs says)
 *                     kvsift_owning_policy_attention(p, l, &q, &out);
 *   kvsift_owning_policy_end_step(p, &evicted);                     the method's own eviction
 * The prompt goes in first with kvsift_owning_policy_prefill (every layer). Tensors are host f32,
 * unless the policy was placed on the device (ThinKV): then every tensor is device memory
 * (contiguous; K/V f32 or bf16, queries and outputs f32) and K/V never leave the device:
 *   kvsift_owning_policy_device_memory_bytes(p, &bytes);      0: the method has no device path
 *   kvsift_owning_policy_place_on_device(p, memory, bytes, stream);   before the prompt
 * Device tensors to a policy kept on the host: KVSIFT_ERROR_UNSUPPORTED.
 * ------------------------------------------------------------------------------------------- */
typedef struct kvsift_owning_policy kvsift_owning_policy;

/* As kvsift_policy_create, for the methods that own their cache (a Policy method here fails
 * with KVSIFT_ERROR_UNSUPPORTED). */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_create(const char* name, const char* json_config,
                                                          kvsift_owning_policy** out);
/* NULL is a no-op. */
KVSIFT_C_EXPORT void kvsift_owning_policy_destroy(kvsift_owning_policy* policy);
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_needs(const kvsift_owning_policy* policy,
                                                         uint32_t* out_needs);
/* The number of sequences it was configured for. */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_batch(const kvsift_owning_policy* policy,
                                                         int64_t* out_batch);
/* The prompt of one layer, before any decode append:
 *   keys, values  [batch, kv_heads, n, head_dim] host f32, post-RoPE, any strides */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_prefill(kvsift_owning_policy* policy,
                                                           int32_t layer, const kvsift_tensor* keys,
                                                           const kvsift_tensor* values);
/* The step's token of one layer, each layer exactly once per step:
 *   keys, values  [batch, kv_heads, 1, head_dim] host f32, post-RoPE */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_append(kvsift_owning_policy* policy,
                                                          int32_t layer, const kvsift_tensor* keys,
                                                          const kvsift_tensor* values);
/* Per-layer observation after append: obs->queries [batch, q_heads, 1, head_dim] host f32. */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_observe(kvsift_owning_policy* policy,
                                                           const kvsift_observation* obs);
/* Closes the step (the method's own eviction); *evicted = 1 when some tokens were evicted.
 * evicted may be NULL. */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_end_step(kvsift_owning_policy* policy,
                                                            int* evicted);
/* Decode attention of one layer over its resident tokens:
 *   queries  [batch, q_heads, 1, head_dim] f32;  out  [batch, q_heads, 1, head_dim] f32
 * On the device, workspace is device scratch of kvsift_owning_policy_attention_workspace_bytes
 * (asked at this step: it grows with the cache) and the work is enqueued on the placement's
 * stream; on the host workspace may be NULL (0 bytes). */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_attention(const kvsift_owning_policy* policy,
                                                             int32_t layer,
                                                             const kvsift_tensor* queries,
                                                             const kvsift_tensor* out,
                                                             void* workspace,
                                                             size_t workspace_bytes);
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_attention_workspace_bytes(
    const kvsift_owning_policy* policy, int32_t layer, size_t* out_bytes);
/* Device storage. *out_bytes: device bytes the method's storage needs for its batch (0: it has no
 * device path; KVSIFT_ERROR_NO_CUDA in a library built without the CUDA backend). */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_device_memory_bytes(
    const kvsift_owning_policy* policy, size_t* out_bytes);
/* Moves the storage into `memory` (device, memory_bytes >= device_memory_bytes, 256-byte aligned,
 * kept alive by the caller until kvsift_owning_policy_destroy); all later work is enqueued on
 * `stream` (a cudaStream_t, NULL = default). Only before the prompt. A refusal (config outside
 * the device pipeline's limits, memory too small) leaves the policy on the host, usable. */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_place_on_device(kvsift_owning_policy* policy,
                                                                   void* memory,
                                                                   size_t memory_bytes,
                                                                   void* stream);
/* *out = 1 once the policy is placed on the device. */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_on_device(const kvsift_owning_policy* policy,
                                                             int* out);
/* Bytes its storage holds for `layer` (-1: all layers), and what an fp16 K+V cache of the same
 * tokens would hold (all layers); either output may be NULL. */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_memory(const kvsift_owning_policy* policy,
                                                          int32_t layer, int64_t* resident_bytes,
                                                          int64_t* fullkv_fp16_bytes);
/* The sorted generation positions resident in (layer, sequence, KV head): *count = how many;
 * the first min(count, capacity) are copied to out (out may be NULL when capacity is 0). */
KVSIFT_C_EXPORT kvsift_status kvsift_owning_policy_resident_positions(
    const kvsift_owning_policy* policy, int32_t layer, int64_t seq, int64_t kv_head, int32_t* out,
    int64_t capacity, int64_t* count);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVSIFT_C_KVSIFT_H_ */
