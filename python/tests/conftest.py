"""Shared fixtures: the package from this checkout, the built library, the golden cases.

The library: $KVSIFT_LIBRARY (scripts/python_test.sh sets it), else <repo>/build/src/c_api/
libkvsift_c.so. Golden cases: $KVSIFT_SHARED_DIR/golden, default <repo>/../shared/golden."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not os.environ.get("KVSIFT_LIBRARY"):
    _default = os.path.join(REPO, "build", "src", "c_api", "libkvsift_c.so")
    if os.path.isfile(_default):
        os.environ["KVSIFT_LIBRARY"] = _default


def shared_dir():
    return os.environ.get("KVSIFT_SHARED_DIR", os.path.join(REPO, "..", "shared"))


@pytest.fixture(scope="session")
def golden_dir():
    path = os.path.join(shared_dir(), "golden")
    if not os.path.isdir(path):
        pytest.skip("golden cases not found at %s (set KVSIFT_SHARED_DIR)" % path)
    return path


def cuda_device_available():
    try:
        import torch
    except ImportError:
        return False
    import kvsift

    return torch.cuda.is_available() and kvsift.cuda_available()
