"""Zero-copy descriptions of torch tensors and NumPy arrays as kvsift_tensor views (data pointer,
shape, strides in elements, dtype, device). Nothing is copied: the caller keeps the memory alive
for the duration of the C call. torch and numpy are imported lazily, so either alone works."""

import sys

from . import _capi
from ._capi import KvsiftError

_TORCH_DTYPES = {"torch.float32": _capi.DTYPE_F32, "torch.float16": _capi.DTYPE_F16,
                 "torch.bfloat16": _capi.DTYPE_BF16}
_NUMPY_DTYPES = {"float32": _capi.DTYPE_F32, "float16": _capi.DTYPE_F16}


def error(message):
    """A Python-side argument error, raised as the same kvsift.Error the C calls raise."""
    return KvsiftError("kvsift", _capi.INVALID_ARGUMENT, message)


def is_torch(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_numpy(x):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def device_of(x):
    """("cpu", None) or ("cuda", index) of a tensor or array."""
    if is_torch(x) and x.device.type == "cuda":
        return ("cuda", x.device.index if x.device.index is not None else 0)
    if is_torch(x) and x.device.type != "cpu":
        raise error("%s: device %s is not supported (cpu or cuda)" % (_name(x), x.device))
    return ("cpu", None)


def _name(x):
    return "tensor of shape %s" % (tuple(x.shape),)


def describe(x, what, ranks=(1, 2, 3, 4)):
    """The kvsift_tensor of `x` (torch tensor or NumPy array), zero-copy. `what` names the argument
    in errors. Refuses other dtypes, ranks outside `ranks`, and a last dimension that is not
    contiguous (the C API reads rows of head_dim with stride 1)."""
    if is_torch(x):
        dtype = _TORCH_DTYPES.get(str(x.dtype))
        if dtype is None:
            raise error("%s: dtype %s is not supported (float32, float16, bfloat16)"
                        % (what, x.dtype))
        kind, _ = device_of(x)
        device = _capi.DEVICE_CUDA if kind == "cuda" else _capi.DEVICE_CPU
        shape, strides, ptr = tuple(x.shape), tuple(x.stride()), x.data_ptr()
    elif is_numpy(x):
        dtype = _NUMPY_DTYPES.get(str(x.dtype))
        if dtype is None:
            raise error("%s: NumPy dtype %s is not supported (float32, float16; NumPy has no "
                        "bfloat16)" % (what, x.dtype))
        item = x.itemsize
        if any(s % item for s in x.strides):
            raise error("%s: strides %s (bytes) are not multiples of the element size %d"
                        % (what, x.strides, item))
        device = _capi.DEVICE_CPU
        shape, strides = tuple(x.shape), tuple(s // item for s in x.strides)
        ptr = x.ctypes.data
    else:
        raise error("%s: expected a torch.Tensor or numpy.ndarray, got %s"
                    % (what, type(x).__name__))
    if len(shape) not in ranks:
        raise error("%s: rank %d (shape %s), expected rank %s"
                    % (what, len(shape), shape, " or ".join(str(r) for r in ranks)))
    if shape[-1] > 1 and strides[-1] != 1:
        raise error("%s: the last dimension (size %d) has stride %d; it must be dense (stride 1): "
                    "pass .contiguous() or a view whose rows are contiguous"
                    % (what, shape[-1], strides[-1]))
    if any(s < 0 for s in strides):
        raise error("%s: negative strides %s are not supported" % (what, strides))
    t = _capi.Tensor()
    t.data, t.rank, t.dtype, t.device, t.reserved = ptr, len(shape), dtype, device, 0
    for k, (n, s) in enumerate(zip(shape, strides)):
        t.shape[k], t.strides[k] = n, s
    return t


def host_int32(x, what, shape=None):
    """A C-contiguous host int32 NumPy array over `x` (list, NumPy array or CPU torch tensor),
    sharing memory when `x` already is one (so that C writes are seen by the caller)."""
    import numpy as np

    if is_torch(x):
        if x.device.type != "cpu":
            raise error("%s must be in host memory, got a tensor on %s" % (what, x.device))
        if str(x.dtype) == "torch.int32" and x.is_contiguous():
            arr = x.numpy()
        else:
            arr = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.int32)
    elif is_numpy(x) and x.dtype == np.int32 and x.flags["C_CONTIGUOUS"]:
        arr = x
    else:
        arr = np.ascontiguousarray(np.asarray(x), dtype=np.int32)
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise error("%s: shape %s, expected %s" % (what, tuple(arr.shape), tuple(shape)))
    return arr
