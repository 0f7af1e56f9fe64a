/* A C program against the installed C API (kvsift::c): one policy by name, one plan on host
 * memory, as a C, Rust or Go engine would link libkvsift_c. */
#include <stdint.h>
#include <stdio.h>

#include "kvsift/c/kvsift.h"

int main(void) {
  enum { B = 1, H = 2, C = 16, D = 4 };
  static float keys[B * H * C * D], values[B * H * C * D];
  const int64_t shape[4] = {B, H, C, D};
  int32_t lengths[B] = {C}, kept[B] = {0};
  kvsift_cache_view kv = {0};
  kvsift_policy* policy = NULL;
  kvsift_plan* plan = NULL;
  kv.lengths = lengths;
  if (kvsift_tensor_contiguous(&kv.keys, keys, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, shape) ||
      kvsift_tensor_contiguous(&kv.values, values, KVSIFT_DTYPE_F32, KVSIFT_DEVICE_CPU, 4, shape) ||
      kvsift_policy_create("streaming", "{\"budget\": 8, \"sink\": 2, \"buffer\": 1}", &policy) ||
      kvsift_policy_select(policy, 0, &kv, NULL, NULL, 0, NULL, &plan) ||
      kvsift_compact(&kv, plan, NULL, 0, NULL) || kvsift_plan_kept_lengths(plan, kept, B)) {
    fprintf(stderr, "consumer_c: %s\n", kvsift_last_error());
    return 1;
  }
  kvsift_plan_destroy(plan);
  kvsift_policy_destroy(policy);
  if (lengths[0] != 8 || kept[0] != 8) {
    fprintf(stderr, "consumer_c: expected 8 resident tokens, got %d\n", (int)lengths[0]);
    return 1;
  }
  printf("consumer_c: libkvsift_c %s found and linked; %d methods; streaming kept %d of %d\n",
         kvsift_version_string(), (int)kvsift_method_count(), (int)lengths[0], C);
  return 0;
}
