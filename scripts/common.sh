# Shared by demo.sh and test.sh: install the Debian packages kvsift builds with (only those
# missing), find nvcc when the CUDA toolkit is installed, and configure + build one build folder.
set -euo pipefail

KVSIFT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-"$KVSIFT_ROOT/build"}
JOBS=${JOBS:-$(nproc)}

install_dependencies() {
  local pkgs=(cmake make g++ libeigen3-dev catch2 libbenchmark-dev nlohmann-json3-dev ${KVSIFT_EXTRA_PKGS:-})
  local missing=()
  for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "kvsift: installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
}

# The CUDA backend is built whenever a CUDA compiler is found; the toolkit's default location is
# not always on PATH.
find_cuda() {
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
}

configure_and_build() {
  find_cuda
  cmake -S "$KVSIFT_ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$BUILD_DIR" -j "$JOBS"
}
