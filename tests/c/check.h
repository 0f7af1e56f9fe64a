/* The C tests' checks: CHECK(cond), CHECK_OK(call) (succeeds and leaves kvsift_last_error()
 * empty) and CHECK_ERROR(call, code, words...) (fails with `code`, and the message names every
 * word). Failures are counted and printed; main returns test_exit_code(). */
#ifndef KVSIFT_TESTS_C_CHECK_H_
#define KVSIFT_TESTS_C_CHECK_H_

#include <stdio.h>
#include <string.h>

#include "kvsift/c/kvsift.h"

static int g_failures = 0;
static int g_checks = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    ++g_checks;                                                                \
    if (!(cond)) {                                                             \
      ++g_failures;                                                            \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

/* A call must succeed and leave kvsift_last_error() empty. */
#define CHECK_OK(call)                                                          \
  do {                                                                          \
    kvsift_status st_ = (call);                                                 \
    ++g_checks;                                                                 \
    if (st_ != KVSIFT_OK || kvsift_last_error()[0] != '\0') {                   \
      ++g_failures;                                                             \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #call, \
              kvsift_status_name(st_), kvsift_last_error());                    \
    }                                                                           \
  } while (0)

/* A call must fail with `code`, and the message must contain every one of the given words. */
static void check_error(const char* file, int line, const char* what, kvsift_status got,
                        kvsift_status code, const char* const* words) {
  const char* msg = kvsift_last_error();
  ++g_checks;
  if (got != code) {
    ++g_failures;
    fprintf(stderr, "%s:%d: %s returned %s, expected %s (message: '%s')\n", file, line, what,
            kvsift_status_name(got), kvsift_status_name(code), msg);
    return;
  }
  for (; *words != NULL; ++words) {
    if (strstr(msg, *words) == NULL) {
      ++g_failures;
      fprintf(stderr, "%s:%d: %s: message '%s' does not name '%s'\n", file, line, what, msg,
              *words);
    }
  }
}
#define CHECK_ERROR(call, code, ...)                                \
  do {                                                              \
    const char* const words_[] = {__VA_ARGS__, NULL};               \
    check_error(__FILE__, __LINE__, #call, (call), (code), words_); \
  } while (0)

static int test_exit_code(void) {
  printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

#endif /* KVSIFT_TESTS_C_CHECK_H_ */
