#!/usr/bin/env bash
# One command for a newcomer: install dependencies, build, run `kvsift demo` (extra args pass on).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_dependencies
configure_and_build -DKVSIFT_BUILD_TESTS=OFF -DKVSIFT_BUILD_BENCH=OFF -DKVSIFT_BUILD_EXAMPLES=ON
"$BUILD_DIR/examples/kvsift" demo "$@"
