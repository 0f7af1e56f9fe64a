/* The C API (kvsift/c/kvsift.h) exercised from C99 on host memory: the method registry, a
 * round trip (create, observe, select, compact) of every registered method, a hand-computed
 * StreamingLLM plan, an R-KV plan against the C++ API and the golden reference
 * (golden/README.md, rkv_gqa), and the error paths, each checking the status code and that
 * kvsift_last_error() names the problem. Exit 0: all passed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "golden_rkv.h"
#include "kvsift/c/kvsift.h"

/* ------------------------------------------------------------------------------------------- */
/* A small host cache: f32 keys/values [batch, kv_heads, capacity, head_dim], value at
 * (b, h, s, d) = 1000 b + 100 h + s + d / 100, so a row names its slot after compaction. */
enum { B = 2, H = 2, HQ = 4, C = 48, D = 8, W = 4 };

typedef struct host_cache {
  float keys[B * H * C * D];
  float values[B * H * C * D];
  float queries[B * HQ * W * D]; /* [batch, q_heads, window, head_dim] */
  int32_t lengths[B];
  kvsift_cache_view view;
  kvsift_tensor window_queries;
} host_cache;

static float cell(int64_t b, int64_t h, int64_t s, int64_t d) {
  return 1000.0f * (float)b + 100.0f * (float)h + (float)s + (float)d / 100.0f;
}

static void host_cache_init(host_cache* c, int32_t len0, int32_t len1) {
  const int64_t kv_shape[4] = {B, H, C, D};
  const int64_t q_shape[4] = {B, HQ, W, D};
  int64_t b, h, s, d;
  memset(c, 0, sizeof *c);
  for (b = 0; b < B; ++b)
    for (h = 0; h < H; ++h)
      for (s = 0; s < C; ++s)
        for (d = 0; d < D; ++d) {
          const int64_t i = ((b * H + h) * C + s) * D + d;
          c->keys[i] = cell(b, h, s, d);
          c->values[i] = -cell(b, h, s, d);
        }
  /* Queries that are not all alike, so that attention-based scores have an order. */
  for (b = 0; b < B * HQ * W * D; ++b) c->queries[b] = (float)((b * 37) % 11) / 11.0f - 0.5f;
  c->lengths[0] = len0;
  c->lengths[1] = len1;
  CHECK_OK(kvsift_tensor_contiguous(&c->view.keys, c->keys, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4,
                                    kv_shape));
  CHECK_OK(kvsift_tensor_contiguous(&c->view.values, c->values, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU,
                                    4, kv_shape));
  CHECK_OK(kvsift_tensor_contiguous(&c->window_queries, c->queries, KVSIFT_DTYPE_F32,
                                    KVSIFT_DEVICE_CPU, 4, q_shape));
  c->view.lengths = c->lengths;
  c->view.valid_mask = NULL;
}

/* ------------------------------------------------------------------------------------------- */
static void test_library(void) {
  int major = -1, minor = -1, patch = -1;
  char expected[64];
  kvsift_version(&major, &minor, &patch);
  kvsift_version(NULL, NULL, NULL); /* any output may be NULL */
  snprintf(expected, sizeof expected, "%d.%d.%d", major, minor, patch);
  CHECK(major >= 0 && minor >= 0 && patch >= 0);
  CHECK(strcmp(kvsift_version_string(), expected) == 0);
  CHECK(kvsift_cuda_available() == 0 || kvsift_cuda_available() == 1);
  CHECK(strcmp(kvsift_status_name(KVSIFT_ERROR_NO_CUDA), "NO_CUDA") == 0);
  CHECK(strcmp(kvsift_status_name(99), "UNKNOWN") == 0);
}

static int method_index(const char* name) {
  int32_t i;
  for (i = 0; i < kvsift_method_count(); ++i)
    if (strcmp(kvsift_method_name(i), name) == 0) return i;
  return -1;
}

static void test_registry(void) {
  const int32_t n = kvsift_method_count();
  int32_t i;
  uint32_t needs = 99;
  CHECK(n >= 7); /* fullkv, streaming, h2o, snapkv, rkv, skipkv, thinkv at least */
  for (i = 0; i < n; ++i) {
    CHECK(kvsift_method_name(i) != NULL && kvsift_method_name(i)[0] != '\0');
    CHECK(kvsift_method_family(i) != NULL && kvsift_method_family(i)[0] != '\0');
    CHECK(kvsift_method_summary(i) != NULL && kvsift_method_summary(i)[0] != '\0');
    CHECK_OK(kvsift_method_needs(i, &needs));
    CHECK((needs & ~15u) == 0);
    CHECK(kvsift_method_default_config(i) != NULL && kvsift_method_default_config(i)[0] == '{');
    CHECK(kvsift_method_example_config(i) != NULL && kvsift_method_example_config(i)[0] == '{');
  }
  /* The registry's own word on a few methods. */
  i = method_index("rkv");
  CHECK(i >= 0 && strstr(kvsift_method_default_config(i), "\"budget\":1024") != NULL);
  i = method_index("thinkv");
  {
    int owns = -1;
    CHECK(i >= 0 && kvsift_method_owns_cache(i, &owns) == KVSIFT_OK && owns == 1);
    CHECK(kvsift_method_owns_cache(method_index("streaming"), &owns) == KVSIFT_OK && owns == 0);
  }
  CHECK(method_index("streaming") >= 0 && method_index("rkv") >= 0 && method_index("fullkv") >= 0);
  CHECK(kvsift_method_name(n) == NULL);
  CHECK(strstr(kvsift_last_error(), "kvsift_method_name") != NULL &&
        strstr(kvsift_last_error(), "outside") != NULL);
  CHECK(kvsift_method_summary(-1) == NULL);
  CHECK_ERROR(kvsift_method_needs(n, &needs), KVSIFT_ERROR_INVALID_ARGUMENT, "method index");
  CHECK_ERROR(kvsift_method_needs(0, NULL), KVSIFT_ERROR_INVALID_ARGUMENT, "out_needs is NULL");
}

/* ------------------------------------------------------------------------------------------- */
/* The per-step observations a method asks for, built over the cache's buffers. */
/* Methods that read the tokens see every resident token observed once (the cache then holds
 * exactly the observed positions, as SkipKV's range bookkeeping requires). */
enum { OBSERVED = 40, HIDDEN = 16 };
static void observe_what_it_needs(kvsift_policy* p, host_cache* c, uint32_t needs) {
  static int32_t tokens[B * OBSERVED];
  static float hidden[B * OBSERVED * HIDDEN];
  int32_t layer;
  if (needs & (KVSIFT_NEEDS_TOKENS | KVSIFT_NEEDS_HIDDEN)) {
    kvsift_observation step;
    const int64_t hidden_shape[3] = {B, OBSERVED, HIDDEN};
    int i;
    memset(&step, 0, sizeof step);
    step.layer = -1;
    step.kv = c->view; /* gives the batch to methods configured without one */
    /* Sentences of 8 tokens (id 13 ends one), the same words in both sequences. */
    for (i = 0; i < B * OBSERVED; ++i) tokens[i] = i % 8 == 7 ? 13 : 100 + i % OBSERVED;
    if (needs & KVSIFT_NEEDS_TOKENS) {
      step.token_ids = tokens;
      step.num_tokens = OBSERVED;
    }
    if (needs & KVSIFT_NEEDS_HIDDEN) {
      for (i = 0; i < B * OBSERVED * HIDDEN; ++i) hidden[i] = (float)((i * 7) % 5) - 2.0f;
      CHECK_OK(kvsift_tensor_contiguous(&step.last_hidden, hidden, KVSIFT_DTYPE_F32,
                                        KVSIFT_DEVICE_CPU, 3, hidden_shape));
    }
    CHECK_OK(kvsift_policy_observe(p, &step));
  }
  for (layer = 0; layer < 2; ++layer) {
    if (needs & (KVSIFT_NEEDS_QUERIES | KVSIFT_NEEDS_APPEND)) {
      kvsift_observation obs;
      memset(&obs, 0, sizeof obs);
      obs.layer = layer;
      obs.kv = c->view; /* a per-layer observation carries the layer's cache */
      if (needs & KVSIFT_NEEDS_QUERIES) {
        /* the last query of the window: [batch, q_heads, 1, head_dim], strided */
        obs.queries = c->window_queries;
        obs.queries.data = c->queries + (W - 1) * D;
        obs.queries.shape[2] = 1;
      }
      CHECK_OK(kvsift_policy_observe(p, &obs));
    }
  }
}

/* Small configs for the methods whose budget is a plain key, so that their round trip actually
 * compresses; the others (and a method added later) run with the registry's example config. */
static const char* small_config(int32_t i) {
  const char* name = kvsift_method_name(i);
  if (strcmp(name, "streaming") == 0) return "{\"budget\": 16, \"sink\": 2, \"buffer\": 4}";
  if (strcmp(name, "rkv") == 0 || strcmp(name, "snapkv") == 0)
    return "{\"budget\": 16, \"window\": 4, \"buffer\": 4}";
  if (strcmp(name, "h2o") == 0) return "{\"budget\": 16, \"buffer\": 4}";
  return kvsift_method_example_config(i);
}

/* A method that owns its cache (ThinKV), from the registry's example config: prefill, a few
 * decode steps of append / observe / attention / end_step, then its memory and resident
 * positions. The example is one sequence, 2 layers, 2 KV heads, 4 query heads, head_dim 16. */
static void test_owning_round_trip(int32_t i) {
  enum { L = 2, OH = 2, OQ = 4, OD = 16, PROMPT = 24, STEPS = 4 };
  static float prompt[OH * PROMPT * OD], token[OH * OD], query[OQ * OD], out[OQ * OD];
  const int64_t prompt_shape[4] = {1, OH, PROMPT, OD}, token_shape[4] = {1, OH, 1, OD},
                query_shape[4] = {1, OQ, 1, OD};
  const char* name = kvsift_method_name(i);
  kvsift_owning_policy* p = NULL;
  kvsift_policy* wrong = NULL;
  kvsift_tensor pk, tk, q, o;
  int64_t batch = 0, resident = 0, fullkv = 0, count = -1, k;
  int32_t positions[PROMPT + STEPS];
  uint32_t needs = 0;
  int layer, step, evicted = -1;
  fprintf(stderr, "round trip (owns its cache): %s %s\n", name, kvsift_method_example_config(i));
  for (k = 0; k < OH * PROMPT * OD; ++k) prompt[k] = (float)((k * 13) % 17) / 17.0f - 0.5f;
  for (k = 0; k < OQ * OD; ++k) query[k] = (float)((k * 5) % 7) / 7.0f - 0.5f;
  CHECK_OK(
      kvsift_tensor_contiguous(&pk, prompt, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, prompt_shape));
  CHECK_OK(
      kvsift_tensor_contiguous(&tk, token, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, token_shape));
  CHECK_OK(
      kvsift_tensor_contiguous(&q, query, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, query_shape));
  CHECK_OK(kvsift_tensor_contiguous(&o, out, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, query_shape));
  CHECK_ERROR(kvsift_policy_create(name, kvsift_method_example_config(i), &wrong),
              KVSIFT_ERROR_UNSUPPORTED, name, "kvsift_owning_policy_create");
  CHECK_OK(kvsift_owning_policy_create(name, kvsift_method_example_config(i), &p));
  if (p == NULL) return;
  CHECK_OK(kvsift_owning_policy_needs(p, &needs));
  CHECK_OK(kvsift_owning_policy_batch(p, &batch));
  CHECK(batch == 1);
  for (layer = 0; layer < L; ++layer) CHECK_OK(kvsift_owning_policy_prefill(p, layer, &pk, &pk));
  for (step = 0; step < STEPS; ++step) {
    for (layer = 0; layer < L; ++layer) {
      kvsift_observation obs;
      for (k = 0; k < OH * OD; ++k) token[k] = (float)((k + 3 * step) % 9) / 9.0f - 0.5f;
      CHECK_OK(kvsift_owning_policy_append(p, layer, &tk, &tk));
      memset(&obs, 0, sizeof obs);
      obs.layer = layer;
      obs.queries = q;
      CHECK_OK(kvsift_owning_policy_observe(p, &obs));
      for (k = 0; k < OQ * OD; ++k) out[k] = 1e30f;
      CHECK_OK(kvsift_owning_policy_attention(p, layer, &q, &o, NULL, 0));
      /* A convex combination of values in [-0.5, 0.5] (up to quantization error). */
      for (k = 0; k < OQ * OD; ++k) CHECK(out[k] > -1.0f && out[k] < 1.0f);
    }
    CHECK_OK(kvsift_owning_policy_end_step(p, &evicted));
    CHECK(evicted == 0 || evicted == 1);
  }
  CHECK_OK(kvsift_owning_policy_memory(p, -1, &resident, &fullkv));
  /* fp16 K + V of every token: 2 tensors x 2 layers x 2 heads x 28 tokens x 16 x 2 bytes. */
  CHECK(fullkv == 2 * L * OH * (PROMPT + STEPS) * OD * 2);
  CHECK(resident > 0);
  CHECK_OK(kvsift_owning_policy_resident_positions(p, 0, 0, 0, NULL, 0, &count));
  CHECK(count > 0 && count <= PROMPT + STEPS);
  CHECK_OK(kvsift_owning_policy_resident_positions(p, 0, 0, 0, positions, PROMPT + STEPS, &count));
  for (k = 1; k < count; ++k) CHECK(positions[k] > positions[k - 1]);
  CHECK(count >= 1 && positions[count - 1] == PROMPT + STEPS - 1); /* the newest token stays */
  CHECK_ERROR(kvsift_owning_policy_resident_positions(p, 0, 0, 0, NULL, 4, &count),
              KVSIFT_ERROR_INVALID_ARGUMENT, "out is NULL", "capacity is 4");
  tk.device = KVSIFT_DEVICE_CUDA;
  CHECK_ERROR(kvsift_owning_policy_append(p, 0, &tk, &tk), KVSIFT_ERROR_UNSUPPORTED, "keys",
              "keeps its cache on the host", "kvsift_owning_policy_place_on_device");
  CHECK_ERROR(kvsift_owning_policy_create("rkv", "{}", &p), KVSIFT_ERROR_UNSUPPORTED,
              "kvsift_policy_create");
  CHECK(p == NULL);
  kvsift_owning_policy_destroy(p);
  kvsift_owning_policy_destroy(NULL);
}

/* The quantizers by name (docs/algorithms.md §5.1–5.2): 1 layer, 2 KV heads, 4 query heads,
 * head_dim 16, a 20-token prompt and 4 decode steps (24 tokens), resident bytes checked against
 * the hand count in `expect`. */
static void quantizer_by_hand(const char* name, const char* config, int64_t expect) {
  enum { QH = 2, QQ = 4, QD = 16, QP = 20, QS = 4 };
  static float prompt[QH * QP * QD], token[QH * QD], query[QQ * QD], out[QQ * QD];
  const int64_t prompt_shape[4] = {1, QH, QP, QD}, token_shape[4] = {1, QH, 1, QD},
                query_shape[4] = {1, QQ, 1, QD};
  kvsift_owning_policy* p = NULL;
  kvsift_tensor pk, tk, q, o;
  int64_t resident = -1, fullkv = -1, count = -1, k;
  int32_t positions[QP + QS];
  uint32_t needs = 0;
  int step, evicted = -1;
  fprintf(stderr, "quantizer by hand: %s %s\n", name, config);
  for (k = 0; k < QH * QP * QD; ++k) prompt[k] = (float)((k * 13) % 17) / 17.0f - 0.5f;
  for (k = 0; k < QQ * QD; ++k) query[k] = (float)((k * 5) % 7) / 7.0f - 0.5f;
  CHECK_OK(
      kvsift_tensor_contiguous(&pk, prompt, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, prompt_shape));
  CHECK_OK(
      kvsift_tensor_contiguous(&tk, token, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, token_shape));
  CHECK_OK(
      kvsift_tensor_contiguous(&q, query, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, query_shape));
  CHECK_OK(kvsift_tensor_contiguous(&o, out, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, query_shape));
  CHECK_OK(kvsift_owning_policy_create(name, config, &p));
  if (p == NULL) return;
  CHECK_OK(kvsift_owning_policy_needs(p, &needs));
  CHECK(needs == KVSIFT_NEEDS_APPEND);
  CHECK_OK(kvsift_owning_policy_prefill(p, 0, &pk, &pk));
  for (step = 0; step < QS; ++step) {
    for (k = 0; k < QH * QD; ++k) token[k] = (float)((k + 3 * step) % 9) / 9.0f - 0.5f;
    CHECK_OK(kvsift_owning_policy_append(p, 0, &tk, &tk));
    for (k = 0; k < QQ * QD; ++k) out[k] = 1e30f;
    CHECK_OK(kvsift_owning_policy_attention(p, 0, &q, &o, NULL, 0));
    for (k = 0; k < QQ * QD; ++k) CHECK(out[k] > -1.0f && out[k] < 1.0f);
    CHECK_OK(kvsift_owning_policy_end_step(p, &evicted));
    CHECK(evicted == 0); /* quantizers evict nothing here */
  }
  CHECK_OK(kvsift_owning_policy_memory(p, -1, &resident, &fullkv));
  CHECK(resident == expect);
  CHECK(fullkv == 24 * QH * QD * 2 * 2); /* fp16 K + V of 24 tokens */
  CHECK_OK(kvsift_owning_policy_memory(p, 0, &resident, NULL));
  CHECK(resident == expect);
  CHECK_OK(kvsift_owning_policy_resident_positions(p, 0, 0, 1, positions, QP + QS, &count));
  CHECK(count == QP + QS && positions[0] == 0 && positions[QP + QS - 1] == QP + QS - 1);
  CHECK_ERROR(kvsift_owning_policy_attention(p, 1, &q, &o, NULL, 0), KVSIFT_ERROR_INVALID_ARGUMENT,
              "layer 1", "num_layers = 1");
  kvsift_owning_policy_destroy(p);
}

/* Device storage of a cache-owning method, without touching a device: ThinKV reports its device
 * bytes and refuses NULL or too small memory before any CUDA call (so the policy stays on the
 * host, usable); KIVI has no device path; without the CUDA backend every such call says so. */
static void test_owning_device_placement(void) {
  const char* thinkv =
      "{\"batch\": 2, \"num_layers\": 2, \"kv_heads\": 2, \"q_heads\": 4, \"head_dim\": 16, "
      "\"theta1\": 0.2, \"theta2\": 0.6, \"calibrated_layers\": [1], \"refresh\": 32, "
      "\"schedule\": [16, 8, 4], \"pool_blocks\": 16}";
  kvsift_owning_policy *t = NULL, *k = NULL;
  size_t bytes = 7, ws = 9;
  int on = -1;
  static unsigned char fake[256];
  CHECK_OK(kvsift_owning_policy_create("thinkv", thinkv, &t));
  CHECK_OK(kvsift_owning_policy_create("kivi", "{\"num_layers\": 1, \"kv_heads\": 1, "
                                       "\"q_heads\": 1, \"head_dim\": 16, \"group_size\": 16, "
                                       "\"residual_length\": 32}", &k));
  if (t == NULL || k == NULL) return;
  CHECK_OK(kvsift_owning_policy_attention_workspace_bytes(t, 0, &ws));
  CHECK(ws == 0); /* on the host attention needs no scratch */
#if KVSIFT_C_TEST_CUDA_BACKEND
  CHECK_OK(kvsift_owning_policy_device_memory_bytes(t, &bytes));
  CHECK(bytes > sizeof fake);
  CHECK_OK(kvsift_owning_policy_device_memory_bytes(k, &bytes));
  CHECK(bytes == 0);
  CHECK_ERROR(kvsift_owning_policy_place_on_device(k, fake, sizeof fake, NULL),
              KVSIFT_ERROR_UNSUPPORTED, "kivi", "host only");
  CHECK_ERROR(kvsift_owning_policy_place_on_device(t, NULL, 1u << 30, NULL),
              KVSIFT_ERROR_INVALID_ARGUMENT, "memory is NULL");
  CHECK_ERROR(kvsift_owning_policy_place_on_device(t, fake, sizeof fake, NULL),
              KVSIFT_ERROR_INVALID_ARGUMENT, "DeviceThinKV", "is too small", "memory_bytes()");
#else
  CHECK_ERROR(kvsift_owning_policy_device_memory_bytes(t, &bytes), KVSIFT_ERROR_NO_CUDA,
              "without the CUDA backend");
  CHECK(bytes == 0);
  CHECK_ERROR(kvsift_owning_policy_place_on_device(t, fake, sizeof fake, NULL),
              KVSIFT_ERROR_NO_CUDA, "without the CUDA backend");
#endif
  CHECK_OK(kvsift_owning_policy_on_device(t, &on));
  CHECK(on == 0);
  CHECK_ERROR(kvsift_owning_policy_on_device(t, NULL), KVSIFT_ERROR_INVALID_ARGUMENT,
              "out is NULL");
  kvsift_owning_policy_destroy(t);
  kvsift_owning_policy_destroy(k);
}

static void test_quantizers_by_hand(void) {
  kvsift_owning_policy* p = NULL;
  /* KIVI-2, G = 16, R = 16. Keys: the prompt's first 16 quantized, then 4 + 4 full (no flush
   * before 32). Values: 4 quantized after the prompt, one more each step: 8, 16 full. Per head:
   * key codes 16 channels x one int32 word = 64 B, key scale + minimum 16 x 4 B = 64 B, value
   * rows 8 x (one word + one group's 4 B) = 64 B, full rows 2 B x 16 x (8 + 16) = 768 B; 960 B,
   * 2 heads: 1920 B. */
  quantizer_by_hand("kivi",
                    "{\"num_layers\": 1, \"kv_heads\": 2, \"q_heads\": 4, \"head_dim\": 16, "
                    "\"group_size\": 16, \"residual_length\": 16}",
                    1920);
  /* PM-KVQ (real, graceful), G = 16, sink 1, window 8, budget 0.002 MiB = 2097.152 B. A token
   * of K+V, 2 heads, at 16 bits: 4 x (16 words x 2 B + bf16 scale and zero 4 B) = 144 B; body at
   * 8 bits 4 x (8 words x 2 B + 4 B) = 80 B, at 4 bits 4 x (4 x 2 B + 4 B) = 48 B. Prompt: sink 1,
   * body 16, window 3; 2880 B > budget, halved to 8 bits: 1280 + 576 = 1856 B. Steps add window
   * tokens of 144 B; the second reaches 2144 B and halves to 4 bits. End: 1 sink + 7 window at 16
   * bits (1152 B) + 16 body at 4 bits (768 B) = 1920 B. */
  quantizer_by_hand("pmkvq",
                    "{\"num_layers\": 1, \"kv_heads\": 2, \"q_heads\": 4, \"head_dim\": 16, "
                    "\"group_size\": 16, \"n_window\": 8, \"kv_budget_mb\": [0.002]}",
                    1920);
  CHECK_ERROR(kvsift_owning_policy_create("pmkvq", "{\"num_layers\": 1}", &p),
              KVSIFT_ERROR_INVALID_ARGUMENT, "kv_budget_mb");
  CHECK(p == NULL);
  CHECK_ERROR(kvsift_owning_policy_create("kivi", "{\"v_bits\": 3}", &p),
              KVSIFT_ERROR_INVALID_ARGUMENT, "v_bits", "got 3");
}

/* Every registered method: create, observe what it needs, trigger, select, compact, on host
 * memory; the plan must be a valid plan of the cache and compaction must move exactly it. */
static void test_round_trip_every_method(void) {
  int32_t i;
  for (i = 0; i < kvsift_method_count(); ++i) {
    const char* name = kvsift_method_name(i);
    kvsift_policy* p = NULL;
    kvsift_plan* plan = NULL;
    host_cache* c;
    uint32_t needs = 0;
    int go = -1, layer, owns = -1;
    size_t ws = 1;
    CHECK_OK(kvsift_method_owns_cache(i, &owns));
    if (owns) {
      test_owning_round_trip(i);
      continue;
    }
    fprintf(stderr, "round trip: %s %s\n", name, small_config(i));
    CHECK_OK(kvsift_method_needs(i, &needs));
    c = (host_cache*)malloc(sizeof *c);
    host_cache_init(c, OBSERVED, (needs & KVSIFT_NEEDS_TOKENS) ? OBSERVED : 24);
    CHECK_OK(kvsift_policy_create(name, small_config(i), &p));
    if (p == NULL) {
      free(c);
      continue;
    }
    CHECK(strcmp(kvsift_policy_name(p), name) == 0);
    CHECK_OK(kvsift_policy_needs(p, &needs));
    observe_what_it_needs(p, c, needs);
    CHECK_OK(kvsift_policy_should_compress(p, &c->view, &go));
    CHECK(go == 0 || go == 1);
    for (layer = 0; layer < 1; ++layer) {
      int64_t pb = 0, ph = 0, pc = 0, max_kept = 0, b, h, k;
      int32_t kept[B], source[B];
      int32_t* slots;
      float before[B * H * C * D];
      CHECK_OK(kvsift_policy_workspace_bytes(p, layer, &c->view, &c->window_queries, &ws));
      CHECK(ws == 0); /* host views need no device scratch */
      CHECK_OK(kvsift_policy_select(p, layer, &c->view, &c->window_queries, NULL, 0, NULL, &plan));
      if (plan == NULL) break;
      CHECK_OK(kvsift_plan_shape(plan, &pb, &ph, &pc, &max_kept));
      CHECK(pb == B && ph == H && pc == C && max_kept <= OBSERVED);
      CHECK_OK(kvsift_plan_source_lengths(plan, source, B));
      CHECK_OK(kvsift_plan_kept_lengths(plan, kept, B));
      CHECK(source[0] == c->lengths[0] && source[1] == c->lengths[1]);
      CHECK(kept[0] <= source[0] && kept[1] <= source[1]);
      if (small_config(i) != kvsift_method_example_config(i)) { /* budget 16: both compress */
        CHECK(kept[0] == 16 && kept[1] == 16);
      }
      slots = (int32_t*)malloc((size_t)(B * H * (max_kept > 0 ? max_kept : 1)) * sizeof *slots);
      CHECK_OK(kvsift_plan_slots(plan, slots, B * H * max_kept));
      memcpy(before, c->keys, sizeof before);
      CHECK_OK(kvsift_compact_workspace_bytes(&c->view, plan, &ws));
      CHECK(ws == 0);
      CHECK_OK(kvsift_compact(&c->view, plan, NULL, 0, NULL));
      CHECK(c->lengths[0] == kept[0] && c->lengths[1] == kept[1]);
      /* Row k of (b, h) now holds what slot slots[k] held; rows are ascending and padded. */
      for (b = 0; b < B; ++b)
        for (h = 0; h < H; ++h)
          for (k = 0; k < max_kept; ++k) {
            const int32_t s = slots[(b * H + h) * max_kept + k];
            if (k >= kept[b]) {
              CHECK(s == -1);
              continue;
            }
            CHECK(s >= 0 && s < source[b] && (k == 0 || s > slots[(b * H + h) * max_kept + k - 1]));
            CHECK(c->keys[((b * H + h) * C + k) * D + 1] == before[((b * H + h) * C + s) * D + 1]);
          }
      free(slots);
      kvsift_plan_destroy(plan);
      plan = NULL;
    }
    kvsift_policy_destroy(p);
    free(c);
  }
}

/* ------------------------------------------------------------------------------------------- */
/* StreamingLLM by hand (docs/algorithms.md §1.4): budget 6, sink 2, buffer 1, bf16 storage.
 * Sequence 0 holds 10 tokens -> keeps the sinks 0, 1 and the recent 6..9; sequence 1 holds 5
 * (under budget) -> keeps 0..4. */
static void test_streaming_by_hand(void) {
  enum { SB = 2, SH = 2, SC = 12, SD = 4 };
  static uint16_t keys[SB * SH * SC * SD], values[SB * SH * SC * SD];
  const int64_t shape[4] = {SB, SH, SC, SD};
  const int32_t expect_slots[SB * SH * 6] = {0, 1, 6, 7, 8, 9,  0, 1, 6, 7, 8, 9,
                                             0, 1, 2, 3, 4, -1, 0, 1, 2, 3, 4, -1};
  int32_t lengths[SB] = {10, 5}, kept[SB], slots[SB * SH * 6];
  kvsift_cache_view kv;
  kvsift_policy* p = NULL;
  kvsift_plan* plan = NULL;
  int64_t max_kept = 0, i, b, h, k;
  int go = -1, all = -1;
  for (i = 0; i < SB * SH * SC * SD; ++i) keys[i] = (uint16_t)i, values[i] = (uint16_t)(60000 - i);
  memset(&kv, 0, sizeof kv);
  CHECK_OK(
      kvsift_tensor_contiguous(&kv.keys, keys, KVSIFT_DTYPE_BF16, KVSIFT_DEVICE_CPU, 4, shape));
  CHECK_OK(
      kvsift_tensor_contiguous(&kv.values, values, KVSIFT_DTYPE_BF16, KVSIFT_DEVICE_CPU, 4, shape));
  kv.lengths = lengths;
  CHECK_OK(kvsift_policy_create("streaming", "{\"budget\": 6, \"sink\": 2, \"buffer\": 1}", &p));
  CHECK_OK(kvsift_policy_should_compress(p, &kv, &go));
  CHECK(go == 1); /* 10 >= budget + buffer = 7 */
  CHECK_OK(kvsift_policy_select(p, 0, &kv, NULL, NULL, 0, NULL, &plan));
  CHECK_OK(kvsift_plan_shape(plan, NULL, NULL, NULL, &max_kept));
  CHECK(max_kept == 6);
  CHECK_OK(kvsift_plan_keeps_everything(plan, &all));
  CHECK(all == 0);
  CHECK_OK(kvsift_plan_kept_lengths(plan, kept, SB));
  CHECK(kept[0] == 6 && kept[1] == 5);
  CHECK_ERROR(kvsift_plan_slots(plan, slots, SB * SH * 6 - 1), KVSIFT_ERROR_INVALID_ARGUMENT,
              "capacity (23)", "= 24");
  CHECK_OK(kvsift_plan_slots(plan, slots, SB * SH * 6));
  CHECK(memcmp(slots, expect_slots, sizeof slots) == 0);
  CHECK_OK(kvsift_compact(&kv, plan, NULL, 0, NULL));
  CHECK(lengths[0] == 6 && lengths[1] == 5);
  for (b = 0; b < SB; ++b)
    for (h = 0; h < SH; ++h)
      for (k = 0; k < kept[b]; ++k) {
        const int64_t s = expect_slots[(b * SH + h) * 6 + k];
        const int64_t at = ((b * SH + h) * SC + k) * SD + 3;
        CHECK(keys[at] == (uint16_t)(((b * SH + h) * SC + s) * SD + 3));
        CHECK(values[at] == (uint16_t)(60000 - (((b * SH + h) * SC + s) * SD + 3)));
      }
  /* The same plan again: the cache no longer holds the lengths it was made for. */
  CHECK_ERROR(kvsift_compact(&kv, plan, NULL, 0, NULL), KVSIFT_ERROR_INVALID_ARGUMENT,
              "kvsift_compact", "lengths[0] = 10", "holds 6");
  kvsift_plan_destroy(plan);
  kvsift_policy_destroy(p);
}

/* ------------------------------------------------------------------------------------------- */
/* kvsift_policy_compress_step over two layers: the same hand-computed StreamingLLM slots as above
 * in both layers (each layer its own values), lengths rewritten, and its argument errors. */
static void test_compress_step_by_hand(void) {
  enum { SL = 2, SB = 2, SH = 2, SC = 12, SD = 4 };
  static uint16_t keys[SL][SB * SH * SC * SD], values[SL][SB * SH * SC * SD];
  const int64_t shape[4] = {SB, SH, SC, SD};
  const int32_t expect_slots[SB * SH * 6] = {0, 1, 6, 7, 8, 9,  0, 1, 6, 7, 8, 9,
                                             0, 1, 2, 3, 4, -1, 0, 1, 2, 3, 4, -1};
  int32_t lengths[SL][SB] = {{10, 5}, {10, 5}};
  kvsift_cache_view kv[SL];
  kvsift_policy* p = NULL;
  size_t ws = 99;
  int64_t i, l, b, h, k;
  memset(kv, 0, sizeof kv);
  for (l = 0; l < SL; ++l) {
    for (i = 0; i < SB * SH * SC * SD; ++i) keys[l][i] = (uint16_t)(i + 7 * l);
    for (i = 0; i < SB * SH * SC * SD; ++i) values[l][i] = (uint16_t)(60000 - i - 7 * l);
    CHECK_OK(kvsift_tensor_contiguous(&kv[l].keys, keys[l], KVSIFT_DTYPE_BF16, KVSIFT_DEVICE_CPU, 4,
                                      shape));
    CHECK_OK(kvsift_tensor_contiguous(&kv[l].values, values[l], KVSIFT_DTYPE_BF16,
                                      KVSIFT_DEVICE_CPU, 4, shape));
    kv[l].lengths = lengths[l];
  }
  CHECK_OK(kvsift_policy_create("streaming", "{\"budget\": 6, \"sink\": 2, \"buffer\": 1}", &p));
  CHECK_OK(kvsift_policy_step_workspace_bytes(p, SL, kv, NULL, &ws));
  CHECK(ws == 0); /* host views */
  CHECK_ERROR(kvsift_policy_compress_step(p, 0, kv, NULL, NULL, 0, NULL),
              KVSIFT_ERROR_INVALID_ARGUMENT, "n_layers must be >= 1, got 0");
  CHECK_ERROR(kvsift_policy_compress_step(p, SL, NULL, NULL, NULL, 0, NULL),
              KVSIFT_ERROR_INVALID_ARGUMENT, "layers is NULL");
  CHECK(lengths[0][0] == 10 && lengths[1][0] == 10); /* the failures moved nothing */
  CHECK_OK(kvsift_policy_compress_step(p, SL, kv, NULL, NULL, 0, NULL));
  for (l = 0; l < SL; ++l) {
    CHECK(lengths[l][0] == 6 && lengths[l][1] == 5);
    for (b = 0; b < SB; ++b)
      for (h = 0; h < SH; ++h)
        for (k = 0; k < lengths[l][b]; ++k) {
          const int64_t s = expect_slots[(b * SH + h) * 6 + k];
          const int64_t at = ((b * SH + h) * SC + k) * SD + 1;
          CHECK(keys[l][at] == (uint16_t)(((b * SH + h) * SC + s) * SD + 1 + 7 * l));
          CHECK(values[l][at] == (uint16_t)(60000 - (((b * SH + h) * SC + s) * SD + 1) - 7 * l));
        }
  }
  kvsift_policy_destroy(p);
}

/* ------------------------------------------------------------------------------------------- */
/* R-KV on the golden GQA case: the C API plan equals the C++ API's slot for slot, matches the
 * reference's kept set up to near-cut swaps, and compaction moves exactly the planned rows. */
static void test_rkv_golden(const char* golden_dir) {
  char path[1024], err[512], config[256];
  golden_rkv_case g;
  kvsift_cache_view kv;
  kvsift_tensor q;
  kvsift_policy* p = NULL;
  kvsift_plan* plan = NULL;
  int32_t* lengths;
  int32_t* slots;
  float* original;
  int64_t max_kept = 0, rows, r, k, missing = 0;
  const int64_t* ref;
  snprintf(path, sizeof path, "%s/rkv_gqa.safetensors", golden_dir);
  if (golden_rkv_load(path, &g, err, sizeof err) != 0) {
    ++g_failures;
    fprintf(stderr, "cannot load %s: %s\n", path, err);
    return;
  }
  {
    const int64_t kv_shape[4] = {g.batch, g.kv_heads, g.seq, g.head_dim};
    const int64_t q_shape[4] = {g.batch, g.q_heads, g.window, g.head_dim};
    memset(&kv, 0, sizeof kv);
    CHECK_OK(kvsift_tensor_contiguous(&kv.keys, g.keys, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4,
                                      kv_shape));
    CHECK_OK(kvsift_tensor_contiguous(&kv.values, g.values, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4,
                                      kv_shape));
    CHECK_OK(
        kvsift_tensor_contiguous(&q, g.queries, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, q_shape));
  }
  lengths = (int32_t*)malloc((size_t)g.batch * sizeof *lengths);
  for (r = 0; r < g.batch; ++r) lengths[r] = (int32_t)g.seq;
  kv.lengths = lengths;
  snprintf(config, sizeof config,
           "{\"budget\": %d, \"window\": %d, \"kernel\": %d, \"mix_lambda\": %.9g, "
           "\"threshold\": %.9g, \"buffer\": 128, \"redundancy\": \"faithful\"}",
           (int)g.budget, (int)g.window, (int)g.kernel, (double)g.mix_lambda, (double)g.threshold);
  CHECK_OK(kvsift_policy_create("rkv", config, &p));
  CHECK_OK(kvsift_policy_select(p, 0, &kv, &q, NULL, 0, NULL, &plan));
  if (plan == NULL) goto done;
  CHECK_OK(kvsift_plan_shape(plan, NULL, NULL, NULL, &max_kept));
  CHECK(max_kept == g.budget);
  rows = g.batch * g.kv_heads;
  slots = (int32_t*)malloc((size_t)(rows * g.budget) * sizeof *slots);
  CHECK_OK(kvsift_plan_slots(plan, slots, rows * g.budget));
  CHECK(memcmp(slots, g.cpp_slots, (size_t)(rows * g.budget) * sizeof *slots) == 0);
  /* The reference's kept tokens (window excluded): only near-cut swaps may differ
   * (golden/README.md tolerances); allow at most 1% of them. */
  for (r = 0; r < rows; ++r) {
    ref = g.ref_keep + r * (g.budget - g.window);
    for (k = 0; k < g.budget - g.window; ++k) {
      int64_t j, found = 0;
      for (j = 0; j < g.budget && !found; ++j) found = slots[r * g.budget + j] == ref[k];
      missing += !found;
    }
    for (k = 0; k < g.window; ++k)
      CHECK(slots[r * g.budget + g.budget - g.window + k] == g.seq - g.window + k);
  }
  CHECK(missing * 100 <= rows * (g.budget - g.window));
  fprintf(stderr, "rkv_gqa: %lld of %lld reference tokens swapped at the cut\n", (long long)missing,
          (long long)(rows * (g.budget - g.window)));
  original = (float*)malloc((size_t)(rows * g.seq * g.head_dim) * sizeof *original);
  memcpy(original, g.keys, (size_t)(rows * g.seq * g.head_dim) * sizeof *original);
  CHECK_OK(kvsift_compact(&kv, plan, NULL, 0, NULL));
  CHECK(lengths[0] == g.budget);
  for (r = 0; r < rows; ++r)
    for (k = 0; k < g.budget; ++k)
      CHECK(memcmp(g.keys + (r * g.seq + k) * g.head_dim,
                   original + (r * g.seq + slots[r * g.budget + k]) * g.head_dim,
                   (size_t)g.head_dim * sizeof(float)) == 0);
  free(original);
  free(slots);
done:
  kvsift_plan_destroy(plan);
  kvsift_policy_destroy(p);
  free(lengths);
  golden_rkv_free(&g);
}

/* ------------------------------------------------------------------------------------------- */
static void test_create_errors(void) {
  kvsift_policy* p = (kvsift_policy*)&p; /* garbage: must be reset to NULL on failure */
  CHECK_ERROR(kvsift_policy_create("no_such_method", "{}", &p), KVSIFT_ERROR_INVALID_ARGUMENT,
              "kvsift_policy_create", "no_such_method");
  CHECK(p == NULL);
  CHECK_ERROR(kvsift_policy_create("rkv", "{\"budget\": ", &p), KVSIFT_ERROR_INVALID_ARGUMENT,
              "kvsift_policy_create", "JSON");
  CHECK_ERROR(kvsift_policy_create("rkv", "{\"budgett\": 512}", &p), KVSIFT_ERROR_INVALID_ARGUMENT,
              "budgett");
  CHECK_ERROR(kvsift_policy_create("rkv", "{\"budget\": 4, \"window\": 8}", &p),
              KVSIFT_ERROR_INVALID_ARGUMENT, "budget (4)", "window");
  CHECK_ERROR(kvsift_policy_create(NULL, "{}", &p), KVSIFT_ERROR_INVALID_ARGUMENT, "name is NULL");
  CHECK_ERROR(kvsift_policy_create("rkv", "{}", NULL), KVSIFT_ERROR_INVALID_ARGUMENT,
              "out is NULL");
  CHECK_OK(kvsift_policy_create("rkv", NULL, &p)); /* NULL config: the defaults */
  CHECK(p != NULL);
  kvsift_policy_destroy(p);
  kvsift_policy_destroy(NULL);
  kvsift_plan_destroy(NULL);
  CHECK(kvsift_policy_name(NULL) == NULL);
}

static void test_argument_errors(void) {
  host_cache* c = (host_cache*)malloc(sizeof *c);
  kvsift_policy* p = NULL;
  kvsift_plan* plan = NULL;
  kvsift_cache_view bad;
  kvsift_tensor bad_q;
  kvsift_observation obs;
  uint32_t needs;
  int go;
  size_t ws;
  int32_t out[4];
  const int64_t one[1] = {1};
  host_cache_init(c, 40, 24);
  CHECK_OK(kvsift_policy_create("rkv", "{\"budget\": 16, \"window\": 4, \"buffer\": 4}", &p));

  /* Null pointers are reported, not dereferenced. */
  CHECK_ERROR(kvsift_policy_select(NULL, 0, &c->view, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "kvsift_policy_select", "policy is NULL");
  CHECK(plan == NULL);
  CHECK_ERROR(kvsift_policy_select(p, 0, NULL, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "kv is NULL");
  CHECK_ERROR(kvsift_policy_select(p, 0, &c->view, &c->window_queries, NULL, 0, NULL, NULL),
              KVSIFT_ERROR_INVALID_ARGUMENT, "out is NULL");
  CHECK_ERROR(kvsift_policy_needs(p, NULL), KVSIFT_ERROR_INVALID_ARGUMENT, "out_needs is NULL");
  CHECK_ERROR(kvsift_policy_needs(NULL, &needs), KVSIFT_ERROR_INVALID_ARGUMENT, "policy is NULL");
  CHECK_ERROR(kvsift_policy_should_compress(p, &c->view, NULL), KVSIFT_ERROR_INVALID_ARGUMENT,
              "out is NULL");
  CHECK_ERROR(kvsift_policy_observe(p, NULL), KVSIFT_ERROR_INVALID_ARGUMENT, "obs is NULL");
  CHECK_ERROR(kvsift_policy_workspace_bytes(p, 0, &c->view, NULL, NULL),
              KVSIFT_ERROR_INVALID_ARGUMENT, "out_bytes is NULL");
  CHECK_ERROR(kvsift_plan_kept_lengths(NULL, out, 4), KVSIFT_ERROR_INVALID_ARGUMENT,
              "plan is NULL");
  CHECK_ERROR(kvsift_compact(&c->view, NULL, NULL, 0, NULL), KVSIFT_ERROR_INVALID_ARGUMENT,
              "plan is NULL");
  CHECK_ERROR(kvsift_tensor_contiguous(NULL, c->keys, 0, 0, 1, one), KVSIFT_ERROR_INVALID_ARGUMENT,
              "t is NULL");
  CHECK_ERROR(kvsift_tensor_contiguous(&bad_q, c->keys, 0, 0, 1, NULL),
              KVSIFT_ERROR_INVALID_ARGUMENT, "shape is NULL");
  bad = c->view;
  bad.lengths = NULL;
  CHECK_ERROR(kvsift_policy_should_compress(p, &bad, &go), KVSIFT_ERROR_INVALID_ARGUMENT,
              "kv->lengths is NULL");
  bad = c->view;
  bad.keys.data = NULL;
  CHECK_ERROR(kvsift_policy_select(p, 0, &bad, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "kv->keys.data is NULL", "[2, 2, 48, 8]");
  memset(&obs, 0, sizeof obs);
  obs.num_tokens = 3;
  CHECK_ERROR(kvsift_policy_observe(p, &obs), KVSIFT_ERROR_INVALID_ARGUMENT,
              "obs->token_ids is NULL", "3");

  /* Bad enums. */
  bad = c->view;
  bad.keys.dtype = 7;
  CHECK_ERROR(kvsift_policy_select(p, 0, &bad, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "kv->keys.dtype", "got 7");
  bad = c->view;
  bad.values.device = 5;
  CHECK_ERROR(kvsift_policy_select(p, 0, &bad, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "kv->values.device", "got 5");
  bad = c->view;
  bad.keys.rank = 9;
  CHECK_ERROR(kvsift_policy_select(p, 0, &bad, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "kv->keys.rank", "got 9");

  /* Mismatched shapes. */
  bad = c->view;
  bad.values.shape[2] = 40;
  CHECK_ERROR(kvsift_policy_select(p, 0, &bad, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "values shape [2, 2, 40, 8]", "[2, 2, 48, 8]");
  bad_q = c->window_queries;
  bad_q.shape[3] = 4;
  CHECK_ERROR(kvsift_policy_select(p, 0, &c->view, &bad_q, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "head_dim (4)", "head_dim (8)");
  bad_q = c->window_queries;
  bad_q.shape[1] = 3;
  CHECK_ERROR(kvsift_policy_select(p, 0, &c->view, &bad_q, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "q_heads (3)", "kv_heads (2)");
  bad_q = c->window_queries;
  bad_q.strides[3] = 2;
  CHECK_ERROR(kvsift_policy_select(p, 0, &c->view, &bad_q, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "window_queries", "contiguous", "= 2");
  c->lengths[1] = 60;
  CHECK_ERROR(kvsift_policy_should_compress(p, &c->view, &go), KVSIFT_ERROR_INVALID_ARGUMENT,
              "lengths[1] = 60", "capacity = 48");
  c->lengths[1] = 24;
  CHECK_ERROR(kvsift_policy_select(p, -2, &c->view, &c->window_queries, NULL, 0, NULL, &plan),
              KVSIFT_ERROR_INVALID_ARGUMENT, "layer must be >= 0, got -2");
  CHECK(plan == NULL);

  /* Device memory in a library without a usable CUDA device. */
  if (!kvsift_cuda_available()) {
    bad = c->view;
    bad.keys.device = KVSIFT_DEVICE_CUDA;
    bad.values.device = KVSIFT_DEVICE_CUDA;
    CHECK_ERROR(kvsift_policy_workspace_bytes(p, 0, &bad, NULL, &ws), KVSIFT_ERROR_NO_CUDA,
                "kv->keys", "CUDA");
  }

  /* A success after failures clears the message. */
  CHECK_OK(kvsift_policy_needs(p, &needs));
  CHECK(kvsift_last_error()[0] == '\0');
  kvsift_policy_destroy(p);
  free(c);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s GOLDEN_DIR\n", argv[0]);
    return 2;
  }
  test_library();
  test_registry();
  test_round_trip_every_method();
  test_quantizers_by_hand();
  test_owning_device_placement();
  test_streaming_by_hand();
  test_compress_step_by_hand();
  test_rkv_golden(argv[1]);
  test_create_errors();
  test_argument_errors();
  return test_exit_code();
}
