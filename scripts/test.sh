#!/usr/bin/env bash
# One command for the tests: install dependencies, build everything, run every test (GPU tests
# skip without a device), the Python package's tests, check that an installed kvsift works through
# find_package (C++ and C), run each benchmark once as a smoke test, and run the CPU tests again
# under ASan + UBSan with short fuzz runs (scripts/sanitize.sh; SKIP_SANITIZE=1 leaves it out).
# Python (Debian's torch, numpy, pytest) and clang (sanitizers, libFuzzer) are installed too.
export KVSIFT_EXTRA_PKGS="python3-torch python3-numpy python3-pytest python3-setuptools clang"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_dependencies
configure_and_build -DKVSIFT_BUILD_TESTS=ON -DKVSIFT_BUILD_BENCH=ON -DKVSIFT_BUILD_EXAMPLES=ON

echo "== unit, parity and GPU tests"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"

echo "== Python package (python/tests, /usr/bin/python3)"
BUILD_DIR="$BUILD_DIR" "$KVSIFT_ROOT/scripts/python_test.sh" -q

echo "== consumer project against the installed package"
rm -rf "$BUILD_DIR/install" "$BUILD_DIR/consumer"
cmake --install "$BUILD_DIR" --prefix "$BUILD_DIR/install" >/dev/null
cmake -S "$KVSIFT_ROOT/tests/consumer" -B "$BUILD_DIR/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$BUILD_DIR/install" >/dev/null
cmake --build "$BUILD_DIR/consumer" -j "$JOBS" >/dev/null
"$BUILD_DIR/consumer/kvsift_consumer"
if [ -x "$BUILD_DIR/consumer/kvsift_consumer_cuda" ]; then
  "$BUILD_DIR/consumer/kvsift_consumer_cuda"
fi
"$BUILD_DIR/consumer/kvsift_consumer_c"

echo "== benchmark smoke run"
for b in "$BUILD_DIR"/bench/bench_*; do
  [ -x "$b" ] || continue
  # The first (smallest) case of each benchmark: a smoke test that every one runs, not a
  # measurement (the whole grid takes minutes on a 2-core machine).
  first=$("$b" --benchmark_list_tests | awk -F/ '!seen[$1]++' | sed 's/[][().*+?^$|{}\\]/\\&/g' |
    paste -sd'|')
  "$b" --benchmark_min_time=0.001 --benchmark_filter="^(${first})\$" >/dev/null
  echo "ok  $(basename "$b")"
done
if [ -z "${SKIP_SANITIZE:-}" ]; then
  "$KVSIFT_ROOT/scripts/sanitize.sh"
fi
echo "== all checks passed"
