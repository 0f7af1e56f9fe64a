/* The C API on device memory, from C99: every registered Policy method selects and compacts a
 * CUDA cache on a caller stream with a caller workspace, and must make the plan it makes for the
 * same cache in host memory (exactly for the methods staged to the CPU reference; up to a few
 * near-tie swaps for R-KV and SkipKV, which run CUDA kernels); device compaction must move exactly
 * the planned rows; R-KV on the golden rkv_gqa case keeps the reference's set (golden/README.md).
 * Exit 77 (ctest: skipped) without a CUDA device. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "golden_rkv.h"
#include "kvsift/c/kvsift.h"

#define CUDA_OK(call)                                                                        \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

enum { B = 2, H = 2, HQ = 4, C = 48, D = 8, W = 4, OBSERVED = 40, HIDDEN = 16 };
enum { KV_ELEMS = B * H * C * D, Q_ELEMS = B * HQ * W * D };

/* Deterministic values in [-1, 1): random enough that scores have no ties. */
static float lcg(uint32_t* state) {
  *state = *state * 1664525u + 1013904223u;
  return (float)(*state >> 8) / (float)(1u << 23) - 1.0f;
}

typedef struct cache_pair {
  float keys[KV_ELEMS], values[KV_ELEMS], queries[Q_ELEMS]; /* host originals */
  float host_keys[KV_ELEMS], host_values[KV_ELEMS];         /* compacted on the host */
  float *d_keys, *d_values, *d_queries;
  int32_t host_lengths[B], device_lengths[B];
  kvsift_cache_view host, device;
  kvsift_tensor host_q, device_q;
} cache_pair;

static void cache_pair_init(cache_pair* c, int32_t len1, uint32_t seed) {
  const int64_t kv_shape[4] = {B, H, C, D}, q_shape[4] = {B, HQ, W, D};
  int i;
  for (i = 0; i < KV_ELEMS; ++i) c->keys[i] = lcg(&seed), c->values[i] = lcg(&seed);
  for (i = 0; i < Q_ELEMS; ++i) c->queries[i] = lcg(&seed);
  memcpy(c->host_keys, c->keys, sizeof c->keys);
  memcpy(c->host_values, c->values, sizeof c->values);
  CUDA_OK(cudaMalloc((void**)&c->d_keys, sizeof c->keys));
  CUDA_OK(cudaMalloc((void**)&c->d_values, sizeof c->values));
  CUDA_OK(cudaMalloc((void**)&c->d_queries, sizeof c->queries));
  CUDA_OK(cudaMemcpy(c->d_keys, c->keys, sizeof c->keys, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(c->d_values, c->values, sizeof c->values, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(c->d_queries, c->queries, sizeof c->queries, cudaMemcpyHostToDevice));
  c->host_lengths[0] = c->device_lengths[0] = OBSERVED;
  c->host_lengths[1] = c->device_lengths[1] = len1;
  memset(&c->host, 0, sizeof c->host);
  memset(&c->device, 0, sizeof c->device);
  CHECK_OK(kvsift_tensor_contiguous(&c->host.keys, c->host_keys, KVSIFT_DTYPE_F32,
                                    KVSIFT_DEVICE_CPU, 4, kv_shape));
  CHECK_OK(kvsift_tensor_contiguous(&c->host.values, c->host_values, KVSIFT_DTYPE_F32,
                                    KVSIFT_DEVICE_CPU, 4, kv_shape));
  CHECK_OK(kvsift_tensor_contiguous(&c->host_q, c->queries, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4,
                                    q_shape));
  CHECK_OK(kvsift_tensor_contiguous(&c->device.keys, c->d_keys, KVSIFT_DTYPE_F32,
                                    KVSIFT_DEVICE_CUDA, 4, kv_shape));
  CHECK_OK(kvsift_tensor_contiguous(&c->device.values, c->d_values, KVSIFT_DTYPE_F32,
                                    KVSIFT_DEVICE_CUDA, 4, kv_shape));
  CHECK_OK(kvsift_tensor_contiguous(&c->device_q, c->d_queries, KVSIFT_DTYPE_F32,
                                    KVSIFT_DEVICE_CUDA, 4, q_shape));
  c->host.lengths = c->host_lengths;
  c->device.lengths = c->device_lengths;
}

static void cache_pair_free(cache_pair* c) {
  cudaFree(c->d_keys);
  cudaFree(c->d_values);
  cudaFree(c->d_queries);
}

/* The step's tokens and hidden states (host memory: both sides read them there) and each
 * layer's cache and last query, as kvsift_policy_needs asks. */
static void observe(kvsift_policy* p, const kvsift_cache_view* kv, const kvsift_tensor* q,
                    uint32_t needs) {
  static int32_t tokens[B * OBSERVED];
  static float hidden[B * OBSERVED * HIDDEN];
  if (needs & (KVSIFT_NEEDS_TOKENS | KVSIFT_NEEDS_HIDDEN)) {
    const int64_t hidden_shape[3] = {B, OBSERVED, HIDDEN};
    kvsift_observation step;
    int i;
    for (i = 0; i < B * OBSERVED; ++i) tokens[i] = i % 8 == 7 ? 13 : 100 + i % OBSERVED;
    for (i = 0; i < B * OBSERVED * HIDDEN; ++i) hidden[i] = (float)((i * 7) % 5) - 2.0f;
    memset(&step, 0, sizeof step);
    step.layer = -1;
    step.kv = *kv;
    step.token_ids = tokens;
    step.num_tokens = OBSERVED;
    if (needs & KVSIFT_NEEDS_HIDDEN) {
      CHECK_OK(kvsift_tensor_contiguous(&step.last_hidden, hidden, KVSIFT_DTYPE_F32,
                                        KVSIFT_DEVICE_CPU, 3, hidden_shape));
    }
    CHECK_OK(kvsift_policy_observe(p, &step));
  }
  if (needs & (KVSIFT_NEEDS_QUERIES | KVSIFT_NEEDS_APPEND)) {
    kvsift_observation obs;
    memset(&obs, 0, sizeof obs);
    obs.layer = 0;
    obs.kv = *kv;
    obs.queries = *q; /* the window's last query: [batch, q_heads, 1, head_dim], strided */
    obs.queries.data = (float*)q->data + (W - 1) * D;
    obs.queries.shape[2] = 1;
    CHECK_OK(kvsift_policy_observe(p, &obs));
  }
}

static const char* small_config(int32_t i) {
  const char* name = kvsift_method_name(i);
  if (strcmp(name, "streaming") == 0) return "{\"budget\": 16, \"sink\": 2, \"buffer\": 4}";
  if (strcmp(name, "rkv") == 0 || strcmp(name, "snapkv") == 0 || strcmp(name, "skipkv") == 0)
    return "{\"budget\": 16, \"window\": 4, \"buffer\": 4}";
  if (strcmp(name, "h2o") == 0) return "{\"budget\": 16, \"buffer\": 4}";
  return kvsift_method_example_config(i);
}

/* Selects with `p` on `kv` (host or device) and compacts; returns the plan's padded slots
 * (malloc'ed [B, H, max_kept]) and max_kept. */
static int32_t* select_and_compact(kvsift_policy* p, const kvsift_cache_view* kv,
                                   const kvsift_tensor* q, cudaStream_t stream, void** ws,
                                   size_t* ws_bytes, int64_t* max_kept) {
  kvsift_plan* plan = NULL;
  size_t need = 0, compact_need = 0;
  int32_t* slots;
  CHECK_OK(kvsift_policy_workspace_bytes(p, 0, kv, q, &need));
  if (need > *ws_bytes) {
    cudaFree(*ws);
    CUDA_OK(cudaMalloc(ws, need));
    *ws_bytes = need;
  }
  CHECK_OK(kvsift_policy_select(p, 0, kv, q, *ws, *ws_bytes, stream, &plan));
  if (plan == NULL) return NULL;
  CHECK_OK(kvsift_plan_shape(plan, NULL, NULL, NULL, max_kept));
  slots = (int32_t*)malloc((size_t)(B * H * (*max_kept > 0 ? *max_kept : 1)) * sizeof *slots);
  CHECK_OK(kvsift_plan_slots(plan, slots, B * H * *max_kept));
  CHECK_OK(kvsift_compact_workspace_bytes(kv, plan, &compact_need));
  if (compact_need > *ws_bytes) {
    cudaFree(*ws);
    CUDA_OK(cudaMalloc(ws, compact_need));
    *ws_bytes = compact_need;
  }
  CHECK_OK(kvsift_compact(kv, plan, *ws, *ws_bytes, stream));
  kvsift_plan_destroy(plan);
  return slots;
}

/* Row k of every (b, h) of `compacted` holds what slot slots[k] held in `original`. */
static void check_compacted(const float* compacted, const float* original, const int32_t* slots,
                            const int32_t* lengths, int64_t max_kept) {
  int64_t b, h, k;
  for (b = 0; b < B; ++b)
    for (h = 0; h < H; ++h)
      for (k = 0; k < lengths[b]; ++k) {
        const int32_t s = slots[(b * H + h) * max_kept + k];
        CHECK(memcmp(compacted + ((b * H + h) * C + k) * D, original + ((b * H + h) * C + s) * D,
                     D * sizeof(float)) == 0);
      }
}

static void test_every_method_on_device(cudaStream_t stream) {
  int32_t i;
  void* ws = NULL;
  size_t ws_bytes = 0;
  for (i = 0; i < kvsift_method_count(); ++i) {
    const char* name = kvsift_method_name(i);
    cache_pair* c = (cache_pair*)malloc(sizeof *c);
    kvsift_policy *ph = NULL, *pd = NULL;
    int32_t *host_slots, *device_slots;
    int64_t host_max = 0, device_max = 0, k, differing = 0;
    uint32_t needs = 0;
    int owns = 0;
    float device_keys[KV_ELEMS];
    const int kernels = strcmp(name, "rkv") == 0 || strcmp(name, "skipkv") == 0;
    CHECK_OK(kvsift_method_owns_cache(i, &owns));
    if (owns) {
      free(c);
      continue;
    }
    fprintf(stderr, "device: %s %s\n", name, small_config(i));
    CHECK_OK(kvsift_method_needs(i, &needs));
    cache_pair_init(c, (needs & KVSIFT_NEEDS_TOKENS) ? OBSERVED : 24, 12345u + (uint32_t)i);
    CHECK_OK(kvsift_policy_create(name, small_config(i), &ph));
    CHECK_OK(kvsift_policy_create(name, small_config(i), &pd));
    observe(ph, &c->host, &c->host_q, needs);
    observe(pd, &c->device, &c->device_q, needs);
    host_slots = select_and_compact(ph, &c->host, &c->host_q, NULL, &ws, &ws_bytes, &host_max);
    device_slots =
        select_and_compact(pd, &c->device, &c->device_q, stream, &ws, &ws_bytes, &device_max);
    CUDA_OK(cudaStreamSynchronize(stream));
    if (host_slots != NULL && device_slots != NULL) {
      CHECK(c->device_lengths[0] == c->host_lengths[0] &&
            c->device_lengths[1] == c->host_lengths[1] && device_max == host_max);
      for (k = 0; k < B * H * host_max && device_max == host_max; ++k)
        differing += device_slots[k] != host_slots[k];
      /* Staged methods run the CPU reference on the same bytes: the same plan. The CUDA
       * kernels may swap a near tie at the cut. */
      CHECK(kernels ? differing * 50 <= B * H * host_max : differing == 0);
      if (differing) fprintf(stderr, "  %lld slots differ\n", (long long)differing);
      CUDA_OK(cudaMemcpy(device_keys, c->d_keys, sizeof device_keys, cudaMemcpyDeviceToHost));
      check_compacted(device_keys, c->keys, device_slots, c->device_lengths, device_max);
      check_compacted(c->host_keys, c->keys, host_slots, c->host_lengths, host_max);
    }
    free(host_slots);
    free(device_slots);
    kvsift_policy_destroy(ph);
    kvsift_policy_destroy(pd);
    cache_pair_free(c);
    free(c);
  }
  cudaFree(ws);
}

/* A workspace smaller than asked for is refused before anything runs. */
static void test_small_workspace(cudaStream_t stream) {
  cache_pair* c = (cache_pair*)malloc(sizeof *c);
  kvsift_policy* p = NULL;
  kvsift_plan* plan = NULL;
  size_t need = 0;
  void* ws = NULL;
  cache_pair_init(c, 24, 7u);
  CHECK_OK(kvsift_policy_create("rkv", "{\"budget\": 16, \"window\": 4, \"buffer\": 4}", &p));
  CHECK_OK(kvsift_policy_workspace_bytes(p, 0, &c->device, &c->device_q, &need));
  CHECK(need > 0);
  CUDA_OK(cudaMalloc(&ws, need));
  CHECK_ERROR(kvsift_policy_select(p, 0, &c->device, &c->device_q, ws, need - 1, stream, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "workspace");
  CHECK(plan == NULL && c->device_lengths[0] == OBSERVED);
  cudaFree(ws);
  kvsift_policy_destroy(p);
  cache_pair_free(c);
  free(c);
}

/* R-KV on the golden GQA case in device memory: the reference's kept set up to near-cut swaps
 * (at most 1%), the window kept, and compaction moving exactly the planned rows. */
static void test_rkv_golden_on_device(const char* golden_dir, cudaStream_t stream) {
  char path[1024], err[512], config[256];
  golden_rkv_case g;
  kvsift_cache_view kv;
  kvsift_tensor q;
  kvsift_policy* p = NULL;
  kvsift_plan* plan = NULL;
  float *d_keys, *d_values, *d_queries, *compacted;
  int32_t *lengths, *slots;
  void* ws = NULL;
  size_t need = 0, compact_need = 0, kv_bytes;
  int64_t rows, r, k, j, missing = 0;
  snprintf(path, sizeof path, "%s/rkv_gqa.safetensors", golden_dir);
  if (golden_rkv_load(path, &g, err, sizeof err) != 0) {
    CHECK(!"golden case loads");
    fprintf(stderr, "cannot load %s: %s\n", path, err);
    return;
  }
  rows = g.batch * g.kv_heads;
  kv_bytes = (size_t)(rows * g.seq * g.head_dim) * sizeof(float);
  CUDA_OK(cudaMalloc((void**)&d_keys, kv_bytes));
  CUDA_OK(cudaMalloc((void**)&d_values, kv_bytes));
  CUDA_OK(cudaMalloc((void**)&d_queries,
                     (size_t)(g.batch * g.q_heads * g.window * g.head_dim) * sizeof(float)));
  CUDA_OK(cudaMemcpy(d_keys, g.keys, kv_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_values, g.values, kv_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_queries, g.queries,
                     (size_t)(g.batch * g.q_heads * g.window * g.head_dim) * sizeof(float),
                     cudaMemcpyHostToDevice));
  {
    const int64_t kv_shape[4] = {g.batch, g.kv_heads, g.seq, g.head_dim};
    const int64_t q_shape[4] = {g.batch, g.q_heads, g.window, g.head_dim};
    memset(&kv, 0, sizeof kv);
    CHECK_OK(kvsift_tensor_contiguous(&kv.keys, d_keys, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CUDA, 4,
                                      kv_shape));
    CHECK_OK(kvsift_tensor_contiguous(&kv.values, d_values, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CUDA, 4,
                                      kv_shape));
    CHECK_OK(
        kvsift_tensor_contiguous(&q, d_queries, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CUDA, 4, q_shape));
  }
  lengths = (int32_t*)malloc((size_t)g.batch * sizeof *lengths);
  for (r = 0; r < g.batch; ++r) lengths[r] = (int32_t)g.seq;
  kv.lengths = lengths;
  snprintf(config, sizeof config,
           "{\"budget\": %d, \"window\": %d, \"kernel\": %d, \"mix_lambda\": %.9g, "
           "\"threshold\": %.9g, \"buffer\": 128, \"redundancy\": \"faithful\"}",
           (int)g.budget, (int)g.window, (int)g.kernel, (double)g.mix_lambda, (double)g.threshold);
  CHECK_OK(kvsift_policy_create("rkv", config, &p));
  CHECK_OK(kvsift_policy_workspace_bytes(p, 0, &kv, &q, &need));
  CUDA_OK(cudaMalloc(&ws, need > 0 ? need : 1));
  CHECK_OK(kvsift_policy_select(p, 0, &kv, &q, ws, need, stream, &plan));
  if (plan != NULL) {
    slots = (int32_t*)malloc((size_t)(rows * g.budget) * sizeof *slots);
    CHECK_OK(kvsift_plan_slots(plan, slots, rows * g.budget));
    for (r = 0; r < rows; ++r) {
      for (k = 0; k < g.budget - g.window; ++k) {
        int found = 0;
        for (j = 0; j < g.budget && !found; ++j)
          found = slots[r * g.budget + j] == g.ref_keep[r * (g.budget - g.window) + k];
        missing += !found;
      }
      for (k = 0; k < g.window; ++k)
        CHECK(slots[r * g.budget + g.budget - g.window + k] == g.seq - g.window + k);
    }
    CHECK(missing * 100 <= rows * (g.budget - g.window));
    fprintf(stderr, "rkv_gqa on the device: %lld reference tokens swapped at the cut\n",
            (long long)missing);
    CHECK_OK(kvsift_compact_workspace_bytes(&kv, plan, &compact_need));
    if (compact_need > need) {
      cudaFree(ws);
      CUDA_OK(cudaMalloc(&ws, compact_need));
    }
    CHECK_OK(kvsift_compact(&kv, plan, ws, compact_need > need ? compact_need : need, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CHECK(lengths[0] == g.budget);
    compacted = (float*)malloc(kv_bytes);
    CUDA_OK(cudaMemcpy(compacted, d_keys, kv_bytes, cudaMemcpyDeviceToHost));
    for (r = 0; r < rows; ++r)
      for (k = 0; k < g.budget; ++k)
        CHECK(memcmp(compacted + (r * g.seq + k) * g.head_dim,
                     g.keys + (r * g.seq + slots[r * g.budget + k]) * g.head_dim,
                     (size_t)g.head_dim * sizeof(float)) == 0);
    free(compacted);
    free(slots);
    kvsift_plan_destroy(plan);
  }
  cudaFree(ws);
  cudaFree(d_keys);
  cudaFree(d_values);
  cudaFree(d_queries);
  free(lengths);
  kvsift_policy_destroy(p);
  golden_rkv_free(&g);
}

int main(int argc, char** argv) {
  cudaStream_t stream;
  if (argc != 2) {
    fprintf(stderr, "usage: %s GOLDEN_DIR\n", argv[0]);
    return 2;
  }
  if (!kvsift_cuda_available()) {
    printf("no CUDA device (or no CUDA backend in libkvsift_c): skipped\n");
    return 77;
  }
  CUDA_OK(cudaStreamCreate(&stream)); /* not the default stream: kvsift must use the one given */
  test_every_method_on_device(stream);
  test_small_workspace(stream);
  test_rkv_golden_on_device(argv[1], stream);
  CUDA_OK(cudaStreamDestroy(stream));
  return test_exit_code();
}
