"""ctypes declarations of kvsift's C API (include/kvsift/c/kvsift.h, libkvsift_c): the one place
the package (and bench/torch_rkv.py) declares the C structs and function prototypes, plus a thin
low-level layer over them (Library, Policy, Plan). The public API is in kvsift/__init__.py; this
module imports no torch or numpy.

    lib = _capi.Library(_capi.find_library())
    policy = lib.policy("rkv", {"budget": 1024, "window": 8})
    kv = lib.cache_view(keys, values, lengths)          # torch tensors or _capi.Tensor
    if policy.should_compress(kv):
        plan = policy.select(0, kv, lib.tensor_of(queries), workspace, nbytes, stream)
        lib.compact(kv, plan, workspace, nbytes, stream)

Pointers (device buffers, streams) are plain integers; None is NULL.
"""

import ctypes
import ctypes.util
import glob
import json
import os

# kvsift_status
OK, INVALID_ARGUMENT, UNSUPPORTED, NO_CUDA, OUT_OF_MEMORY, INTERNAL = range(6)
# kvsift_dtype, kvsift_device
DTYPE_F32, DTYPE_F16, DTYPE_BF16 = 0, 1, 2
DEVICE_CPU, DEVICE_CUDA = 0, 1
# KVSIFT_NEEDS_* bits
NEEDS_QUERIES, NEEDS_TOKENS, NEEDS_HIDDEN, NEEDS_APPEND = 1, 2, 4, 8

_TORCH_DTYPES = {"torch.float32": DTYPE_F32, "torch.float16": DTYPE_F16,
                 "torch.bfloat16": DTYPE_BF16}


class Tensor(ctypes.Structure):
    """kvsift_tensor: a non-owning strided view; strides in elements; rank 0 = not given."""
    _fields_ = [("data", ctypes.c_void_p), ("shape", ctypes.c_int64 * 4),
                ("strides", ctypes.c_int64 * 4), ("rank", ctypes.c_int32),
                ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class CacheView(ctypes.Structure):
    """kvsift_cache_view: keys/values [batch, kv_heads, capacity, head_dim], host lengths [batch],
    optional valid_mask [batch, capacity]."""
    _fields_ = [("keys", Tensor), ("values", Tensor), ("lengths", ctypes.POINTER(ctypes.c_int32)),
                ("valid_mask", ctypes.c_void_p)]


class Observation(ctypes.Structure):
    """kvsift_observation (mirrors kvsift::Observation)."""
    _fields_ = [("layer", ctypes.c_int32), ("batch", ctypes.c_int32), ("kv", CacheView),
                ("queries", Tensor), ("token_ids", ctypes.POINTER(ctypes.c_int32)),
                ("num_tokens", ctypes.c_int64), ("pad_counts", ctypes.POINTER(ctypes.c_int32)),
                ("last_hidden", Tensor)]


class KvsiftError(RuntimeError):
    """A failing C call: .code is the kvsift_status, the message kvsift_last_error()."""

    def __init__(self, function, code, message):
        super().__init__("%s failed (code %d): %s" % (function, code, message))
        self.code = code
        self.message = message


def _declare(lib):
    """Sets restype/argtypes of every C API function."""
    c = ctypes
    P = c.POINTER
    status = c.c_int
    policy_p, plan_p, owning_p = c.c_void_p, c.c_void_p, c.c_void_p
    protos = {
        "kvsift_last_error": (c.c_char_p, []),
        "kvsift_status_name": (c.c_char_p, [c.c_int32]),
        "kvsift_version": (None, [P(c.c_int), P(c.c_int), P(c.c_int)]),
        "kvsift_version_string": (c.c_char_p, []),
        "kvsift_cuda_available": (c.c_int, []),
        "kvsift_method_count": (c.c_int32, []),
        "kvsift_method_name": (c.c_char_p, [c.c_int32]),
        "kvsift_method_family": (c.c_char_p, [c.c_int32]),
        "kvsift_method_summary": (c.c_char_p, [c.c_int32]),
        "kvsift_method_needs": (status, [c.c_int32, P(c.c_uint32)]),
        "kvsift_method_owns_cache": (status, [c.c_int32, P(c.c_int)]),
        "kvsift_method_default_config": (c.c_char_p, [c.c_int32]),
        "kvsift_method_example_config": (c.c_char_p, [c.c_int32]),
        "kvsift_tensor_contiguous": (status, [P(Tensor), c.c_void_p, c.c_int32, c.c_int32,
                                              c.c_int32, P(c.c_int64)]),
        "kvsift_policy_create": (status, [c.c_char_p, c.c_char_p, P(policy_p)]),
        "kvsift_policy_destroy": (None, [policy_p]),
        "kvsift_policy_name": (c.c_char_p, [policy_p]),
        "kvsift_policy_needs": (status, [policy_p, P(c.c_uint32)]),
        "kvsift_policy_should_compress": (status, [policy_p, P(CacheView), P(c.c_int)]),
        "kvsift_policy_observe": (status, [policy_p, P(Observation)]),
        "kvsift_policy_workspace_bytes": (status, [policy_p, c.c_int32, P(CacheView), P(Tensor),
                                                   P(c.c_size_t)]),
        "kvsift_policy_select": (status, [policy_p, c.c_int32, P(CacheView), P(Tensor),
                                          c.c_void_p, c.c_size_t, c.c_void_p, P(plan_p)]),
        "kvsift_policy_step_workspace_bytes": (status, [policy_p, c.c_int32, P(CacheView),
                                                        P(Tensor), P(c.c_size_t)]),
        "kvsift_policy_compress_step": (status, [policy_p, c.c_int32, P(CacheView), P(Tensor),
                                                 c.c_void_p, c.c_size_t, c.c_void_p]),
        "kvsift_plan_destroy": (None, [plan_p]),
        "kvsift_plan_shape": (status, [plan_p, P(c.c_int64), P(c.c_int64), P(c.c_int64),
                                       P(c.c_int64)]),
        "kvsift_plan_keeps_everything": (status, [plan_p, P(c.c_int)]),
        "kvsift_plan_kept_lengths": (status, [plan_p, P(c.c_int32), c.c_int64]),
        "kvsift_plan_source_lengths": (status, [plan_p, P(c.c_int32), c.c_int64]),
        "kvsift_plan_slots": (status, [plan_p, P(c.c_int32), c.c_int64]),
        "kvsift_compact_workspace_bytes": (status, [P(CacheView), plan_p, P(c.c_size_t)]),
        "kvsift_compact": (status, [P(CacheView), plan_p, c.c_void_p, c.c_size_t, c.c_void_p]),
        "kvsift_owning_policy_create": (status, [c.c_char_p, c.c_char_p, P(owning_p)]),
        "kvsift_owning_policy_destroy": (None, [owning_p]),
        "kvsift_owning_policy_needs": (status, [owning_p, P(c.c_uint32)]),
        "kvsift_owning_policy_batch": (status, [owning_p, P(c.c_int64)]),
        "kvsift_owning_policy_prefill": (status, [owning_p, c.c_int32, P(Tensor), P(Tensor)]),
        "kvsift_owning_policy_append": (status, [owning_p, c.c_int32, P(Tensor), P(Tensor)]),
        "kvsift_owning_policy_observe": (status, [owning_p, P(Observation)]),
        "kvsift_owning_policy_end_step": (status, [owning_p, P(c.c_int)]),
        "kvsift_owning_policy_attention": (status, [owning_p, c.c_int32, P(Tensor), P(Tensor),
                                                    c.c_void_p, c.c_size_t]),
        "kvsift_owning_policy_attention_workspace_bytes": (status, [owning_p, c.c_int32,
                                                                    P(c.c_size_t)]),
        "kvsift_owning_policy_device_memory_bytes": (status, [owning_p, P(c.c_size_t)]),
        "kvsift_owning_policy_place_on_device": (status, [owning_p, c.c_void_p, c.c_size_t,
                                                          c.c_void_p]),
        "kvsift_owning_policy_on_device": (status, [owning_p, P(c.c_int)]),
        "kvsift_owning_policy_memory": (status, [owning_p, c.c_int32, P(c.c_int64),
                                                 P(c.c_int64)]),
        "kvsift_owning_policy_resident_positions": (status, [owning_p, c.c_int32, c.c_int64,
                                                             c.c_int64, P(c.c_int32), c.c_int64,
                                                             P(c.c_int64)]),
    }
    for name, (restype, argtypes) in protos.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


LIBRARY_ENV = "KVSIFT_LIBRARY"


def find_library():
    """Path of libkvsift_c: $KVSIFT_LIBRARY, else next to this package (a copy, or a CMake install
    where the package sits in <libdir>/python3/dist-packages/kvsift and the library in <libdir>),
    else the system's search path. Raises OSError naming every place tried."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        if not os.path.isfile(env):
            raise OSError("%s=%s is not a file" % (LIBRARY_ENV, env))
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    places = [here, os.path.normpath(os.path.join(here, "..", "..", ".."))]
    for place in places:
        for pattern in ("libkvsift_c.so", "libkvsift_c.so.*", "libkvsift_c.dylib", "kvsift_c.dll"):
            hits = sorted(glob.glob(os.path.join(place, pattern)))
            if hits:
                return hits[0]
    found = ctypes.util.find_library("kvsift_c")
    if found:
        return found
    raise OSError("libkvsift_c not found: set %s to the built library (build/src/c_api/"
                  "libkvsift_c.so) or copy it next to the kvsift package; looked in %s and the "
                  "system library path" % (LIBRARY_ENV, ", ".join(places)))


def _config_text(config):
    return config if isinstance(config, str) else json.dumps(config or {})


def _ref(x):
    """A pointer argument: None stays NULL."""
    return None if x is None else ctypes.byref(x)


class Library:
    """libkvsift_c loaded through ctypes."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        _declare(self.lib)

    def check(self, function, rc):
        if rc != OK:
            raise KvsiftError(function, rc,
                              self.lib.kvsift_last_error().decode(errors="replace"))

    def call(self, function, *args):
        self.check(function, getattr(self.lib, function)(*args))

    # --- library -------------------------------------------------------------------------------
    def version(self):
        return self.lib.kvsift_version_string().decode()

    def cuda_available(self):
        return self.lib.kvsift_cuda_available() == 1

    def methods(self):
        """[dict(name, family, summary, needs, owns_cache, default_config, example_config)] in
        registry order (the configs as dicts)."""
        out = []
        for i in range(self.lib.kvsift_method_count()):
            needs, owns = ctypes.c_uint32(), ctypes.c_int()
            self.call("kvsift_method_needs", i, ctypes.byref(needs))
            self.call("kvsift_method_owns_cache", i, ctypes.byref(owns))
            out.append(dict(
                name=self.lib.kvsift_method_name(i).decode(),
                family=self.lib.kvsift_method_family(i).decode(),
                summary=self.lib.kvsift_method_summary(i).decode(), needs=needs.value,
                owns_cache=owns.value == 1,
                default_config=json.loads(self.lib.kvsift_method_default_config(i)),
                example_config=json.loads(self.lib.kvsift_method_example_config(i))))
        return out

    # --- tensors -------------------------------------------------------------------------------
    def tensor(self, data, dtype, device, shape, strides=None):
        """A Tensor over a raw pointer (int); row-major when strides is None."""
        t = Tensor()
        if strides is None:
            dims = (ctypes.c_int64 * len(shape))(*shape)
            self.call("kvsift_tensor_contiguous", ctypes.byref(t), data, dtype, device,
                      len(shape), dims)
            return t
        t.data, t.rank, t.dtype, t.device = data, len(shape), dtype, device
        for k, (n, s) in enumerate(zip(shape, strides)):
            t.shape[k], t.strides[k] = n, s
        return t

    def tensor_of(self, x):
        """Zero-copy Tensor of a torch tensor (its data pointer and strides)."""
        dtype = _TORCH_DTYPES.get(str(x.dtype))
        if dtype is None:
            raise ValueError("kvsift_c: unsupported dtype %s" % x.dtype)
        device = DEVICE_CUDA if x.device.type == "cuda" else DEVICE_CPU
        return self.tensor(x.data_ptr(), dtype, device, tuple(x.shape), tuple(x.stride()))

    def cache_view(self, keys, values, lengths, valid_mask=None):
        """A CacheView; keys/values are Tensors or torch tensors, lengths a ctypes int32 array
        (host, rewritten by compact), valid_mask a pointer (int) or None."""
        kv = CacheView()
        kv.keys = keys if isinstance(keys, Tensor) else self.tensor_of(keys)
        kv.values = values if isinstance(values, Tensor) else self.tensor_of(values)
        kv.lengths = ctypes.cast(lengths, ctypes.POINTER(ctypes.c_int32))
        kv.valid_mask = valid_mask
        return kv

    # --- policies, plans, compaction -----------------------------------------------------------
    def policy(self, name, config=None):
        """Policy `name` from a dict (or a JSON string) of its config's fields."""
        return Policy(self, name, _config_text(config))

    def owning_policy(self, name, config=None):
        """A method that owns its cache (methods()[i]["owns_cache"]), e.g. ThinKV."""
        return OwningPolicy(self, name, _config_text(config))

    def compact_workspace_bytes(self, kv, plan):
        out = ctypes.c_size_t()
        self.call("kvsift_compact_workspace_bytes", ctypes.byref(kv), plan.handle,
                  ctypes.byref(out))
        return out.value

    def compact(self, kv, plan, workspace=None, workspace_bytes=0, stream=None):
        self.call("kvsift_compact", ctypes.byref(kv), plan.handle, workspace, workspace_bytes,
                  stream)


class Policy:
    def __init__(self, lib, name, json_config):
        self.lib = lib
        self.handle = ctypes.c_void_p()
        lib.call("kvsift_policy_create", name.encode(), json_config.encode(),
                 ctypes.byref(self.handle))

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.lib.kvsift_policy_destroy(self.handle)
            self.handle = None

    def needs(self):
        out = ctypes.c_uint32()
        self.lib.call("kvsift_policy_needs", self.handle, ctypes.byref(out))
        return out.value

    def should_compress(self, kv):
        out = ctypes.c_int()
        self.lib.call("kvsift_policy_should_compress", self.handle, ctypes.byref(kv),
                      ctypes.byref(out))
        return out.value == 1

    def observe(self, observation):
        self.lib.call("kvsift_policy_observe", self.handle, ctypes.byref(observation))

    def workspace_bytes(self, layer, kv, window_queries=None):
        out = ctypes.c_size_t()
        self.lib.call("kvsift_policy_workspace_bytes", self.handle, layer, ctypes.byref(kv),
                      _ref(window_queries), ctypes.byref(out))
        return out.value

    def step_workspace_bytes(self, views, queries):
        out = ctypes.c_size_t()
        self.lib.call("kvsift_policy_step_workspace_bytes", self.handle, len(views), views,
                      queries, ctypes.byref(out))
        return out.value

    def compress_step(self, views, queries, workspace=None, workspace_bytes=0, stream=None):
        self.lib.call("kvsift_policy_compress_step", self.handle, len(views), views, queries,
                      workspace, workspace_bytes, stream)

    def select(self, layer, kv, window_queries=None, workspace=None, workspace_bytes=0,
               stream=None):
        plan = ctypes.c_void_p()
        self.lib.call("kvsift_policy_select", self.handle, layer, ctypes.byref(kv),
                      _ref(window_queries), workspace, workspace_bytes, stream,
                      ctypes.byref(plan))
        return Plan(self.lib, plan)


class Plan:
    """A kvsift_plan: for every (sequence, KV head) the sorted kept slots."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.lib.kvsift_plan_destroy(self.handle)
            self.handle = None

    def shape(self):
        """(batch, kv_heads, capacity, max_kept)."""
        v = [ctypes.c_int64() for _ in range(4)]
        self.lib.call("kvsift_plan_shape", self.handle, *[ctypes.byref(x) for x in v])
        return tuple(x.value for x in v)

    def keeps_everything(self):
        out = ctypes.c_int()
        self.lib.call("kvsift_plan_keeps_everything", self.handle, ctypes.byref(out))
        return out.value == 1

    def _lengths(self, function):
        batch = self.shape()[0]
        out = (ctypes.c_int32 * max(batch, 1))()
        self.lib.call(function, self.handle, out, batch)
        return list(out[:batch])

    def kept_lengths(self):
        return self._lengths("kvsift_plan_kept_lengths")

    def source_lengths(self):
        return self._lengths("kvsift_plan_source_lengths")

    def slots(self):
        """The padded [batch, kv_heads, max_kept] slots as nested lists (-1 = padding)."""
        batch, heads, _, max_kept = self.shape()
        n = batch * heads * max_kept
        out = (ctypes.c_int32 * max(n, 1))()
        self.lib.call("kvsift_plan_slots", self.handle, out, n)
        flat = list(out[:n])
        return [[flat[(b * heads + h) * max_kept:(b * heads + h + 1) * max_kept]
                 for h in range(heads)] for b in range(batch)]


class OwningPolicy:
    """A kvsift_owning_policy: append / observe / attention / end_step; no select or compact.
    Tensors are kvsift_c.Tensor: host f32, or device memory once placed on the device."""

    def __init__(self, lib, name, json_config):
        self.lib = lib
        self.handle = ctypes.c_void_p()
        lib.call("kvsift_owning_policy_create", name.encode(), json_config.encode(),
                 ctypes.byref(self.handle))

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.lib.kvsift_owning_policy_destroy(self.handle)
            self.handle = None

    def needs(self):
        out = ctypes.c_uint32()
        self.lib.call("kvsift_owning_policy_needs", self.handle, ctypes.byref(out))
        return out.value

    def batch(self):
        out = ctypes.c_int64()
        self.lib.call("kvsift_owning_policy_batch", self.handle, ctypes.byref(out))
        return out.value

    def prefill(self, layer, keys, values):
        self.lib.call("kvsift_owning_policy_prefill", self.handle, layer, ctypes.byref(keys),
                      ctypes.byref(values))

    def append(self, layer, keys, values):
        self.lib.call("kvsift_owning_policy_append", self.handle, layer, ctypes.byref(keys),
                      ctypes.byref(values))

    def observe(self, observation):
        self.lib.call("kvsift_owning_policy_observe", self.handle, ctypes.byref(observation))

    def end_step(self):
        evicted = ctypes.c_int()
        self.lib.call("kvsift_owning_policy_end_step", self.handle, ctypes.byref(evicted))
        return evicted.value == 1

    def attention(self, layer, queries, out, workspace=None, workspace_bytes=0):
        self.lib.call("kvsift_owning_policy_attention", self.handle, layer, ctypes.byref(queries),
                      ctypes.byref(out), workspace, workspace_bytes)

    def attention_workspace_bytes(self, layer):
        out = ctypes.c_size_t()
        self.lib.call("kvsift_owning_policy_attention_workspace_bytes", self.handle, layer,
                      ctypes.byref(out))
        return out.value

    def device_memory_bytes(self):
        out = ctypes.c_size_t()
        self.lib.call("kvsift_owning_policy_device_memory_bytes", self.handle, ctypes.byref(out))
        return out.value

    def place_on_device(self, memory, nbytes, stream):
        self.lib.call("kvsift_owning_policy_place_on_device", self.handle, memory, nbytes, stream)

    def on_device(self):
        out = ctypes.c_int()
        self.lib.call("kvsift_owning_policy_on_device", self.handle, ctypes.byref(out))
        return out.value == 1

    def memory(self, layer=-1):
        """(resident bytes of `layer` or of all layers, fp16 full-cache bytes)."""
        resident, full = ctypes.c_int64(), ctypes.c_int64()
        self.lib.call("kvsift_owning_policy_memory", self.handle, layer, ctypes.byref(resident),
                      ctypes.byref(full))
        return resident.value, full.value

    def resident_positions(self, layer, seq, kv_head):
        count = ctypes.c_int64()
        self.lib.call("kvsift_owning_policy_resident_positions", self.handle, layer, seq, kv_head,
                      None, 0, ctypes.byref(count))
        out = (ctypes.c_int32 * max(count.value, 1))()
        self.lib.call("kvsift_owning_policy_resident_positions", self.handle, layer, seq, kv_head,
                      out, count.value, ctypes.byref(count))
        return list(out[:count.value])
