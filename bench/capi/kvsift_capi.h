/* kvsift_capi: a tiny C ABI over kvsift::cuda for benchmarks and bindings (Python ctypes).
 *
 * One call runs one R-KV compression step of one layer, or of all layers at once
 * (kvsift_rkv_layers_step) (docs/algorithms.md §1.1–§1.3) on
 * caller-owned device memory: score, select the top (budget − window) tokens plus the window per
 * (sequence, KV head), and compact keys and values in place. No function allocates device memory or
 * throws: each returns KVSIFT_CAPI_OK or an error code, and kvsift_capi_last_error() gives the
 * message (per thread, valid until the next call on that thread).
 *
 * Tensors are contiguous, head_dim innermost; dtype codes follow kvsift::DType.
 */
#ifndef KVSIFT_CAPI_H_
#define KVSIFT_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#if defined(KVSIFT_CAPI_BUILDING) && (defined(__GNUC__) || defined(__clang__))
#define KVSIFT_CAPI_EXPORT __attribute__((visibility("default")))
#else
#define KVSIFT_CAPI_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define KVSIFT_CAPI_OK 0
#define KVSIFT_CAPI_INVALID_ARGUMENT \
  1 /* a kvsift::Error: bad shape, config, workspace or CUDA error */
#define KVSIFT_CAPI_OUT_OF_MEMORY 2 /* host allocation failed (the plan download) */
#define KVSIFT_CAPI_INTERNAL 3      /* any other exception */

#define KVSIFT_CAPI_F32 0
#define KVSIFT_CAPI_F16 1
#define KVSIFT_CAPI_BF16 2

/* The message of the last failing call on this thread ("" after a success). */
KVSIFT_CAPI_EXPORT const char* kvsift_capi_last_error(void);

/* Device workspace bytes kvsift_rkv_step() / kvsift_rkv_select() need for these shapes, at every
 * sequence holding `length` tokens (R-KV scratch + the slot rows + the compaction plan). */
KVSIFT_CAPI_EXPORT int kvsift_rkv_workspace_bytes(int dtype, int batch, int kv_heads, int q_heads,
                                                  int64_t capacity, int head_dim, int32_t length,
                                                  int budget, int window, size_t* bytes);

/* Score + select, asynchronous on `stream` (a cudaStream_t; NULL is the legacy default stream):
 *   keys, values  device [batch, kv_heads, capacity, head_dim]
 *   queries       device [batch, q_heads, window, head_dim], the last `window` decode queries
 *   lengths       host [batch], tokens per sequence (may differ: a ragged batch)
 *   slots_out     device [batch, kv_heads, budget] int32, each row ascending (kvsift::cuda::
 *                 rkv_select); required here
 *   compressed    host, optional: set to 1 when scoring ran, 0 when length <= budget (no-op)
 * mix_lambda is λ of λ·a − (1−λ)·R; threshold the near-duplicate cosine (§1.2). */
KVSIFT_CAPI_EXPORT int kvsift_rkv_select(int dtype, void* keys, void* values, const void* queries,
                                         int batch, int kv_heads, int q_heads, int64_t capacity,
                                         int head_dim, const int32_t* lengths, int budget,
                                         int window, float mix_lambda, float threshold,
                                         int32_t* slots_out, void* workspace,
                                         size_t workspace_bytes, void* stream, int* compressed);

/* The whole step: kvsift_rkv_select(), then the plan download (waits for `stream`) and the
 * in-place compaction of keys and values (enqueued on `stream`). lengths (host) are rewritten to
 * the kept lengths. slots_out may be NULL (the workspace holds the rows then). */
KVSIFT_CAPI_EXPORT int kvsift_rkv_step(int dtype, void* keys, void* values, const void* queries,
                                       int batch, int kv_heads, int q_heads, int64_t capacity,
                                       int head_dim, int32_t* lengths, int budget, int window,
                                       float mix_lambda, float threshold, int32_t* slots_out,
                                       void* workspace, size_t workspace_bytes, void* stream,
                                       int* compressed);

/* All layers of one compression step in one call (kvsift::cuda::rkv_select_step, then
 * compact_device_rows_step; asynchronous on `stream`): keys[l], values[l] and queries[l] are host
 * arrays of n_layers device pointers, each layer shaped as in kvsift_rkv_select(); every layer
 * holds lengths[b] tokens (host [batch], rewritten to the kept lengths); 1 <= n_layers <= 128. */
KVSIFT_CAPI_EXPORT int kvsift_rkv_layers_workspace_bytes(int dtype, int n_layers, int batch,
                                                         int kv_heads, int q_heads,
                                                         int64_t capacity, int head_dim,
                                                         int32_t length, int budget, int window,
                                                         size_t* bytes);
KVSIFT_CAPI_EXPORT int kvsift_rkv_layers_step(
    int dtype, int n_layers, void* const* keys, void* const* values, const void* const* queries,
    int batch, int kv_heads, int q_heads, int64_t capacity, int head_dim, int32_t* lengths,
    int budget, int window, float mix_lambda, float threshold, void* workspace,
    size_t workspace_bytes, void* stream, int* compressed);
#ifdef __cplusplus
}
#endif

#endif /* KVSIFT_CAPI_H_ */
