#!/usr/bin/env bash
# The CPU tests under AddressSanitizer + UndefinedBehaviorSanitizer (any report fails the run),
# plus short libFuzzer runs of the safetensors reader and the case loader when clang is the
# compiler. A second build folder (build-sanitize/, or $SANITIZE_BUILD_DIR), CUDA, examples,
# benchmarks and the C API off (a sanitized shared library cannot carry the sanitizer runtime,
# and the C library's own tests run in the normal build). Tests labelled "slow" are skipped (SANITIZE_CTEST_ARGS adds ctest arguments).
# Uses ccache when installed. Called by the lead's CI next to scripts/test.sh.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_dependencies

SAN_DIR=${SANITIZE_BUILD_DIR:-"$KVSIFT_ROOT/build-sanitize"}
SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
# -O0 with line tables: the sanitized build is compiled only to run the tests once, and template-
# heavy test files compile ~3.5x faster than at -O2 -g (its tests still take seconds).
if command -v clang++ >/dev/null 2>&1; then SAN_OPT="-O0 -gline-tables-only"; else SAN_OPT="-O0 -g1"; fi
args=(-DCMAKE_BUILD_TYPE=Sanitize "-DCMAKE_CXX_FLAGS_SANITIZE=$SAN_OPT" -DKVSIFT_CUDA=OFF -DKVSIFT_BUILD_TESTS=ON
      -DKVSIFT_BUILD_EXAMPLES=OFF -DKVSIFT_BUILD_BENCH=OFF
      -DKVSIFT_BUILD_C_API=OFF "-DCMAKE_CXX_FLAGS=$SAN_FLAGS" "-DCMAKE_EXE_LINKER_FLAGS=$SAN_FLAGS")
if command -v clang++ >/dev/null 2>&1; then
  args+=(-DCMAKE_CXX_COMPILER=clang++ -DKVSIFT_BUILD_FUZZERS=ON)
fi
if command -v ccache >/dev/null 2>&1; then
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

start=$(date +%s)
echo "== sanitizer build in $SAN_DIR"
cmake -S "$KVSIFT_ROOT" -B "$SAN_DIR" "${args[@]}" >/dev/null
cmake --build "$SAN_DIR" -j "$JOBS"

echo "== CPU tests and fuzz runs under ASan + UBSan"
# detect_leaks: a leak is a failure too. halt_on_error / -fno-sanitize-recover: the first report
# ends the test with a non-zero status, so ctest sees it.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# shellcheck disable=SC2086
ctest --test-dir "$SAN_DIR" --output-on-failure -j "$JOBS" -LE slow ${SANITIZE_CTEST_ARGS:-}
echo "== sanitizers clean ($(($(date +%s) - start)) s)"
