"""The Pythonic layer over the C API: policies, cache views, plans and compaction on torch tensors
(CPU or CUDA) and NumPy arrays, zero-copy. CUDA work runs on torch's current stream of the
tensors' device, with workspaces allocated by torch on that device."""

import collections
import ctypes
import json
import threading

from . import _capi
from ._capi import KvsiftError
from ._tensors import describe, device_of, error, host_int32, is_numpy, is_torch

MethodInfo = collections.namedtuple(
    "MethodInfo", "name family summary needs owns_cache default_config example_config")

_lock = threading.Lock()
_library = None


def library():
    """The loaded libkvsift_c (found by _capi.find_library on first use)."""
    global _library
    with _lock:
        if _library is None:
            _library = _capi.Library(_capi.find_library())
        return _library


def library_version():
    """The version string of the loaded libkvsift_c."""
    return library().version()


def cuda_available():
    """True when libkvsift_c was built with the CUDA backend and a CUDA device is present."""
    return library().cuda_available()


def policies():
    """Every registered method, in registry order, as MethodInfo(name, family, summary, needs,
    owns_cache, default_config, example_config) (the configs as dicts)."""
    return [MethodInfo(**{f: m[f] for f in MethodInfo._fields}) for m in library().methods()]


def _byte_mask(mask, what):
    """The data pointer of a [batch, capacity] uint8/bool mask (1 byte per entry either way)."""
    if is_torch(mask):
        if str(mask.dtype) not in ("torch.uint8", "torch.bool"):
            raise error("%s: dtype %s, expected uint8 or bool" % (what, mask.dtype))
        if mask.dim() != 2 or (mask.shape[1] > 1 and mask.stride(1) != 1) or (
                mask.shape[0] > 1 and mask.stride(0) != mask.shape[1]):
            raise error("%s: must be a contiguous [batch, capacity] tensor, got shape %s strides %s"
                        % (what, tuple(mask.shape), tuple(mask.stride())))
        return mask.data_ptr()
    if is_numpy(mask):
        if (str(mask.dtype) not in ("uint8", "bool") or mask.ndim != 2
                or not mask.flags["C_CONTIGUOUS"]):
            raise error("%s: expected a C-contiguous 2-D uint8/bool array, got %s %s"
                        % (what, mask.dtype, mask.shape))
        return mask.ctypes.data
    raise error("%s: expected a torch.Tensor or numpy.ndarray, got %s"
                % (what, type(mask).__name__))


class CacheView:
    """One layer's KV cache, described in place (nothing is copied):
      keys, values  [batch, kv_heads, capacity, head_dim], same dtype and device (a bigger buffer
                    sliced along capacity is fine: any strides with a dense head_dim)
      lengths       [batch] resident tokens per sequence; host int32. An int32 NumPy array or CPU
                    tensor is used in place, so compact() rewrites the caller's array; anything
                    else is copied once into `self.lengths`.
      valid_mask    [batch, capacity] optional, 1 = real token, 0 = left pad; uint8 or bool, on
                    the keys' device, contiguous; compact() rewrites it."""

    def __init__(self, keys, values, lengths, valid_mask=None):
        dk, dv = device_of(keys), device_of(values)
        if dk != dv:
            raise error("keys are on %s but values on %s" % (_device_str(dk), _device_str(dv)))
        self.keys, self.values, self.valid_mask = keys, values, valid_mask
        self.device = dk
        if valid_mask is not None and device_of(valid_mask) != dk:
            raise error("valid_mask is on %s but keys on %s"
                        % (_device_str(device_of(valid_mask)), _device_str(dk)))
        view = _capi.CacheView()
        view.keys = describe(keys, "keys", ranks=(4,))
        view.values = describe(values, "values", ranks=(4,))
        self.lengths = host_int32(lengths, "lengths")
        if tuple(self.lengths.shape) != (keys.shape[0],):
            raise error("lengths: shape %s, expected [batch = %d]"
                        % (tuple(self.lengths.shape), keys.shape[0]))
        view.lengths = ctypes.cast(self.lengths.ctypes.data, ctypes.POINTER(ctypes.c_int32))
        view.valid_mask = None if valid_mask is None else _byte_mask(valid_mask, "valid_mask")
        self.c_view = view

    @property
    def batch(self):
        return int(self.keys.shape[0])


def _device_str(d):
    return d[0] if d[1] is None else "%s:%d" % d


class _Exec:
    """Workspace and stream for one device: torch's current stream there, a uint8 workspace
    grown on demand (one per device and stream, so that reuse stays in stream order)."""

    def __init__(self):
        self._ws = {}

    def context(self, device, nbytes):
        """(device context manager, workspace pointer, workspace bytes, stream pointer)."""
        if device[0] == "cpu":
            return _NullContext(), None, 0, None
        import torch

        dev = torch.device("cuda", device[1])
        stream = torch.cuda.current_stream(dev)
        key = (device[1], stream.cuda_stream)
        ws = self._ws.get(key)
        if nbytes > 0 and (ws is None or ws.numel() < nbytes):
            ws = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            self._ws[key] = ws
        ptr = ws.data_ptr() if (ws is not None and nbytes > 0) else None
        return torch.cuda.device(dev), ptr, nbytes, stream.cuda_stream


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_shared_exec = _Exec()


class KeepPlan:
    """For every (sequence b, KV head h) the sorted cache slots that survive; every head of
    sequence b keeps kept_lengths[b] slots."""

    def __init__(self, plan):
        self._plan = plan
        self.batch, self.kv_heads, self.capacity, self.max_kept = plan.shape()

    @property
    def kept_lengths(self):
        """[batch] int32 NumPy array."""
        return self._lengths("kvsift_plan_kept_lengths")

    @property
    def source_lengths(self):
        """[batch] int32 NumPy array: the lengths the plan was made for."""
        return self._lengths("kvsift_plan_source_lengths")

    @property
    def keeps_everything(self):
        return self._plan.keeps_everything()

    def _lengths(self, function):
        import numpy as np

        out = np.zeros(max(self.batch, 1), dtype=np.int32)
        library().call(function, self._plan.handle,
                       out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), self.batch)
        return out[:self.batch]

    def slots(self):
        """[batch, kv_heads, max_kept] int32 NumPy array; row (b, h) holds kept_lengths[b]
        ascending slots, then -1."""
        import numpy as np

        n = self.batch * self.kv_heads * self.max_kept
        out = np.full(max(n, 1), -1, dtype=np.int32)
        library().call("kvsift_plan_slots", self._plan.handle,
                       out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n)
        return out[:n].reshape(self.batch, self.kv_heads, self.max_kept)

    def slots_torch(self, device=None):
        """slots() as an int64 torch tensor (for gather/index_select), on `device`."""
        import torch

        return torch.from_numpy(self.slots().astype("int64")).to(device or "cpu")

    def row(self, b, h):
        """The kept slots of (b, h) as a NumPy array."""
        return self.slots()[b, h, :self.kept_lengths[b]]

    def __repr__(self):
        return "KeepPlan(batch=%d, kv_heads=%d, capacity=%d, kept=%s)" % (
            self.batch, self.kv_heads, self.capacity, list(self.kept_lengths))


def _to_json(options):
    def default(o):
        if hasattr(o, "tolist"):
            return o.tolist()
        if hasattr(o, "item"):
            return o.item()
        raise TypeError("option value %r is not JSON-serialisable" % (o,))

    try:
        return json.dumps(options, default=default)
    except TypeError as e:
        raise error(str(e))


def observation(token_ids=None, last_hidden=None, pad_counts=None, layer=-1, kv=None,
                queries=None):
    """A kvsift_observation of these signals (kv: a C cache view or None) and the host arrays
    it points into (keep them alive until the call that reads it returns)."""
    obs = _capi.Observation()
    obs.layer, obs.batch = int(layer), 0
    keep = []
    if token_ids is not None:
        ids = host_int32(token_ids, "token_ids")
        if ids.ndim != 2:
            raise error("token_ids: shape %s, expected [batch, n]" % (ids.shape,))
        keep.append(ids)
        obs.token_ids = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        obs.num_tokens = int(ids.shape[1])
        obs.batch = int(ids.shape[0])
    if pad_counts is not None:
        pads = host_int32(pad_counts, "pad_counts")
        keep.append(pads)
        obs.pad_counts = pads.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    if last_hidden is not None:
        obs.last_hidden = describe(last_hidden, "last_hidden", ranks=(3,))
    if kv is not None:
        obs.kv = kv
    if queries is not None:
        obs.queries = describe(queries, "queries", ranks=(4,))
    return obs, keep


class Policy:
    """A kvsift method (see policies()). Per decode step an engine calls observe() with what
    needs says, then should_compress(kv) and, when true, select() + compact() for every layer."""

    def __init__(self, name, options=None):
        if not isinstance(name, str):
            raise error("policy name must be a str, got %s" % type(name).__name__)
        self.options = dict(options or {})
        self.name = name
        self._policy = library().policy(name, _to_json(self.options))
        self._exec = _Exec()

    @property
    def needs(self):
        """The NEEDS_* bits observe() must be given."""
        return self._policy.needs()

    def should_compress(self, kv):
        """True when the cache at kv.lengths must be compressed now (budget + buffer reached)."""
        return self._policy.should_compress(_view(kv))

    def observe(self, token_ids=None, last_hidden=None, pad_counts=None, layer=-1, kv=None,
                queries=None):
        """One observation. Step level (layer -1): token_ids [batch, n] (host ints), pad_counts
        [batch] left pads among them (first observation), last_hidden [batch, n, hidden]
        (final-norm last-layer states, torch/NumPy, any device). Per layer: kv (the cache after
        the append) and queries [batch, q_heads, n, head_dim]."""
        obs, keep = observation(token_ids, last_hidden, pad_counts, layer,
                                _view(kv) if kv is not None else None, queries)
        device = device_of(last_hidden) if last_hidden is not None else ("cpu", None)
        ctx, _, _, _ = self._exec.context(device, 0)
        with ctx:
            self._policy.observe(obs)

    def workspace_bytes(self, kv, window_queries=None, layer=0):
        """Device scratch select() needs (0 for host views); select() allocates it itself."""
        q = self._queries(kv, window_queries)
        return self._policy.workspace_bytes(int(layer), _view(kv), q)

    def select(self, kv, window_queries=None, layer=0):
        """Plans layer `layer`: a KeepPlan. Reads the cache, never writes it. window_queries:
        [batch, q_heads, window, head_dim] post-RoPE, same device as the cache (None for methods
        that read none). CUDA views run on torch's current stream with a torch workspace."""
        q = self._queries(kv, window_queries)
        view = _view(kv)
        nbytes = self._policy.workspace_bytes(int(layer), view, q)
        ctx, ws, nbytes, stream = self._exec.context(kv.device, nbytes)
        with ctx:
            plan = self._policy.select(int(layer), view, q, ws, nbytes, stream)
        return KeepPlan(plan)

    def compress_step(self, layers, window_queries=None):
        """One compression step of every layer, applied in place (kvsift_policy_compress_step):
        layers a list of CacheView (one per layer, one device; their lengths and valid_mask are
        rewritten), window_queries None or one [batch, q_heads, window, head_dim] tensor per
        layer. Every layer is planned before any moves. On CUDA, R-KV runs every layer in one
        launch sequence and waits for torch's current stream once; layers that share one
        valid_mask tensor let it (the mask is per sequence, not per layer)."""
        layers = list(layers)
        if not layers:
            raise error("compress_step: no layers given")
        if window_queries is not None and len(window_queries) != len(layers):
            raise error("compress_step: %d window_queries for %d layers"
                        % (len(window_queries), len(layers)))
        n = len(layers)
        views = (_capi.CacheView * n)(*[_view(kv) for kv in layers])
        queries = None
        if window_queries is not None:
            described = [self._queries(kv, q) for kv, q in zip(layers, window_queries)]
            queries = (_capi.Tensor * n)(*[d for d in described])
        nbytes = self._policy.step_workspace_bytes(views, queries)
        ctx, ws, nbytes, stream = self._exec.context(layers[0].device, nbytes)
        with ctx:
            self._policy.compress_step(views, queries, ws, nbytes, stream)

    @staticmethod
    def _queries(kv, window_queries):
        if window_queries is None:
            return None
        if device_of(window_queries) != kv.device:
            raise error("window_queries are on %s but the cache on %s"
                        % (_device_str(device_of(window_queries)), _device_str(kv.device)))
        return describe(window_queries, "window_queries", ranks=(4,))

    def __repr__(self):
        return "kvsift.Policy(%r, %s)" % (self.name, self.options)


def _view(kv):
    if not isinstance(kv, CacheView):
        raise error("expected a kvsift.CacheView, got %s" % type(kv).__name__)
    return kv.c_view


def make_policy(name, **options):
    """Policy `name` (policies() lists them) with its config fields as keyword options, e.g.
    make_policy("rkv", budget=1024, window=8). Unknown options and invalid values raise
    kvsift.Error with the library's message."""
    return Policy(name, options)


def compact(kv, plan):
    """Applies `plan` to the cache in place: kept rows move to the front of each (sequence, head),
    kv.lengths and kv.valid_mask are rewritten. Validated before anything moves. CUDA views run
    on torch's current stream (kv.lengths is up to date when this returns)."""
    if not isinstance(plan, KeepPlan):
        raise error("expected a kvsift.KeepPlan, got %s" % type(plan).__name__)
    lib = library()
    view = _view(kv)
    nbytes = lib.compact_workspace_bytes(view, plan._plan)
    ctx, ws, nbytes, stream = _shared_exec.context(kv.device, nbytes)
    with ctx:
        lib.compact(view, plan._plan, ws, nbytes, stream)


Error = KvsiftError
