"""A tiny safetensors reader (8-byte little-endian header length, JSON header, raw little-endian
data) into NumPy arrays, so that CI needs no safetensors package."""

import json
import struct

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "U8": np.uint8, "I8": np.int8}


def read(path):
    """({name: array}, metadata dict) of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        out[name] = np.frombuffer(data[begin:end], dtype=dtype).reshape(info["shape"]).copy()
    return out, meta
