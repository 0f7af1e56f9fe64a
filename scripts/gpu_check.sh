#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build everything, run all tests (GPU tests for real), run the GPU
# tests under compute-sanitizer (memcheck, racecheck), then the GPU benchmarks and the PyTorch
# side-by-side R-KV benchmark. Logs go to $OUT (default ./gpu-out). Extra arguments pass to CMake
# (e.g. -DCMAKE_PREFIX_PATH=... -DKVSIFT_SHARED_DIR=...). SKIP_BENCH=1 stops after the sanitizers.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
BUILD=${BUILD:-$ROOT/build-gpu}
mkdir -p "$OUT"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/gpu_benchmarks.txt"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVSIFT_CUDA=ON "$@" >"$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)" -- -k >>"$OUT/build.log" 2>&1 ||
  { echo "BUILD ERRORS:"; grep -E "error" "$OUT/build.log" | head -20; }
echo "== ctest"
ctest --test-dir "$BUILD" --output-on-failure -j 8 >"$OUT/ctest.log" 2>&1
grep -E "tests passed|tests failed|\(Failed\)|Not Run|\*\*\*Failed|Exception" "$OUT/ctest.log" | head -20
echo "== GPU tests (assertion counts)"
for t in "$BUILD"/tests/cuda/gpu_*; do
  [ -x "$t" ] || continue
  echo "$(basename "$t"): $("$t" 2>&1 | tail -2 | head -1)"
done | tee "$OUT/gpu_tests.txt"
echo "== the tool on the GPU against the CPU"
GOLDEN=$(sed -n 's/^KVSIFT_SHARED_DIR:PATH=//p' "$BUILD/CMakeCache.txt")/golden
{
  for c in rkv_mha rkv_gqa rkv_batch2; do
    echo "-- score --policy rkv --case $c --device cuda --compare-cpu"
    "$BUILD/examples/kvsift" score --policy rkv --case "$GOLDEN/$c.safetensors" \
      --out /tmp/kvsift_score.safetensors --device cuda --compare-cpu 2>&1 | tail -12
  done
  for c in skipkv_pad skipkv_sentences; do
    echo "-- score --policy skipkv --pad-mode faithful --case $c --device cuda --compare-cpu"
    "$BUILD/examples/kvsift" score --policy skipkv --pad-mode faithful --case "$GOLDEN/$c.safetensors" \
      --out /tmp/kvsift_score.safetensors --device cuda --compare-cpu 2>&1 | tail -12
  done
  echo "-- demo --device cuda --policies fullkv,rkv"
  "$BUILD/examples/kvsift" demo --device cuda --policies fullkv,rkv 2>&1 | sed -n '/^policy/,/^$/p'
  echo "-- demo --device cpu --policies fullkv,rkv"
  "$BUILD/examples/kvsift" demo --policies fullkv,rkv 2>&1 | sed -n '/^policy/,/^$/p'
} >>"$OUT/gpu_tests.txt" 2>&1
grep -E "PASS|FAIL" "$OUT/gpu_tests.txt" | head -10
echo "== compute-sanitizer"
for t in "$BUILD"/tests/cuda/gpu_*; do
  [ -x "$t" ] || continue
  for tool in memcheck racecheck; do
    log=$(mktemp)
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 "$t" >"$log" 2>&1
    echo "$(basename "$t") $tool exit=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    grep -E -A3 "^========= (Error|Warning|Race)" "$log" | head -40 >>"$OUT/sanitizer_details.txt"
    rm -f "$log"
  done
done | tee "$OUT/sanitizer.txt"
[ -n "${SKIP_BENCH:-}" ] && exit 0  # correctness only
echo "== GPU benchmarks"
for b in "$BUILD"/bench/gpu_bench_*; do
  [ -x "$b" ] || continue
  echo "### $(basename "$b")" >>"$OUT/gpu_benchmarks.txt"
  timeout 150 "$b" >>"$OUT/gpu_benchmarks.txt" 2>&1
  echo "$(basename "$b") exit=$?"
done
if python3 -c "import torch" 2>/dev/null && [ -f "$BUILD/src/c_api/libkvsift_c.so" ]; then
  echo "== PyTorch side by side"
  timeout 240 python3 "$ROOT/bench/torch_rkv.py" --lib "$BUILD/src/c_api/libkvsift_c.so" \
    --out "$OUT/rkv_vs_torch.md" >"$OUT/rkv_vs_torch.log" 2>&1
  echo "torch_rkv exit=$?"
  tail -25 "$OUT/rkv_vs_torch.log"
fi
