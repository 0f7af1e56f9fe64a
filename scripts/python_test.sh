#!/usr/bin/env bash
# The Python package's tests (python/tests) against a built libkvsift_c, with Debian's
# /usr/bin/python3 (python3-torch, python3-numpy, python3-pytest; installs nothing itself).
#   scripts/python_test.sh [extra pytest args]        BUILD_DIR (default build/) holds the library
# Fails when pytest fails, collects no test (exit 5), or passes none: a run where everything was
# skipped is not a green run. Skipped tests (no CUDA, no transformers) are listed by -rs.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-"$ROOT/build"}
PYTHON=${PYTHON:-/usr/bin/python3}

lib="$BUILD_DIR/src/c_api/libkvsift_c.so"
if [ ! -f "$lib" ]; then
  echo "python_test: $lib not found; build the kvsift_c target first" >&2
  exit 1
fi
export KVSIFT_LIBRARY="$lib"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
"$PYTHON" -m pytest "$ROOT/python/tests" -rs -p no:cacheprovider "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -eq 5 ]; then
  echo "python_test: FAILED, pytest collected no tests" >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "python_test: FAILED (pytest exit $rc)" >&2
  exit "$rc"
fi
# The summary line: "N passed, M skipped in ..."; zero passed means nothing was checked.
passed=$(grep -Eo '[0-9]+ passed' "$log" | tail -1 | grep -Eo '[0-9]+' || true)
if [ -z "$passed" ] || [ "$passed" -eq 0 ]; then
  echo "python_test: FAILED, no test passed (all skipped?)" >&2
  exit 1
fi
echo "python_test: $passed passed"
