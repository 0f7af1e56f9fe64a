/* A golden R-KV case (golden/README.md) for the C test: the inputs as plain buffers, the
 * reference's kept set, and the plan the C++ API (kvsift::RKV) makes on them. C++ behind a C
 * interface, so that test_c_api.c stays C while reading safetensors through kvsift's loader. */
#ifndef KVSIFT_TESTS_C_GOLDEN_RKV_H_
#define KVSIFT_TESTS_C_GOLDEN_RKV_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct golden_rkv_case {
  int64_t batch, kv_heads, seq, head_dim, q_heads, window;
  int32_t budget, kernel;
  float mix_lambda, threshold;
  float* keys;        /* [batch, kv_heads, seq, head_dim] */
  float* values;      /* [batch, kv_heads, seq, head_dim] */
  float* queries;     /* [batch, q_heads, window, head_dim] */
  int64_t* ref_keep;  /* [batch, kv_heads, budget - window] the reference's keep_sorted */
  int32_t* cpp_slots; /* [batch, kv_heads, budget] kvsift::RKV(config).select() on the case */
} golden_rkv_case;

/* Loads `path`; 0 on success, else -1 with a message in err[0..err_len). */
int golden_rkv_load(const char* path, golden_rkv_case* out, char* err, size_t err_len);
void golden_rkv_free(golden_rkv_case* c);

#ifdef __cplusplus
}
#endif

#endif /* KVSIFT_TESTS_C_GOLDEN_RKV_H_ */
