#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build everything, run all tests (GPU tests for real), run the GPU
# tests under compute-sanitizer (memcheck, racecheck), then the GPU benchmarks. Logs go to $OUT
# (default ./gpu-out). Extra CMake arguments pass through (e.g. -DCMAKE_PREFIX_PATH=...).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
BUILD=${BUILD:-$ROOT/build-gpu}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/machine.txt"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVSIFT_CUDA=ON "$@" >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -40; exit 1; }
echo "== ctest"
ctest --test-dir "$BUILD" --output-on-failure -j 8 2>&1 | tee "$OUT/ctest.log" | tail -15
echo "== compute-sanitizer"
for t in "$BUILD"/tests/cuda/gpu_*; do
  [ -x "$t" ] || continue
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$t" >"$OUT/sanitizer_$(basename "$t")_$tool.log" 2>&1
    echo "$(basename "$t") $tool exit=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$(basename "$t")_$tool.log" | tail -1)"
  done
done | tee "$OUT/sanitizer.txt"
echo "== GPU benchmarks"
for b in "$BUILD"/bench/gpu_bench_*; do
  [ -x "$b" ] || continue
  "$b" 2>&1 | tee "$OUT/$(basename "$b").txt"
done
