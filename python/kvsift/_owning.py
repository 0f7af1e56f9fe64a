"""Methods that own their KV storage (policies() marks them owns_cache: ThinKV, KIVI, PM-KVQ),
over the C API's kvsift_owning_policy_* calls. The engine hands them every K/V it produces and
asks them for attention; there is no select/compact. Per decode step:

    for layer in range(num_layers):
        policy.append(layer, k, v)                 # [batch, kv_heads, 1, head_dim]
        policy.observe(layer=layer, queries=q)     # when policy.needs asks for queries
        out = policy.attention(layer, q)           # [batch, q_heads, 1, head_dim]
    policy.end_step()                              # the method's own eviction / quantization

The prompt goes in first with prefill(layer, keys, values) for every layer (left pads, if any,
as observe(pad_counts=...) before it). Tensors are host float32 torch tensors or NumPy arrays
(any strides, head_dim contiguous); bad input raises kvsift.Error with the library's message.

ThinKV can keep its whole cache on a CUDA device (docs/thinkv.md §9): policy.to("cuda") before
the prompt allocates its storage with torch and places it there; from then on every tensor is a
contiguous CUDA tensor (K/V float32 or bfloat16, queries float32), work runs on torch's current
stream at placement, and K/V never leave the device."""

from ._api import _to_json, library, observation
from ._tensors import describe, error, is_torch


class OwningPolicy:
    """A cache-owning kvsift method; build it with make_owning_policy(name, **options)."""

    def __init__(self, name, options=None):
        if not isinstance(name, str):
            raise error("policy name must be a str, got %s" % type(name).__name__)
        self.name = name
        self.options = dict(options or {})
        self._policy = library().owning_policy(name, _to_json(self.options))
        self._storage = None  # the device memory of a policy placed on the device (kept alive)
        self._device = None
        self._stream = None

    def to(self, device):
        """Places the policy's storage on a CUDA device (before the prompt); returns self.
        Raises kvsift.Error for a method without a device path or a config outside the device
        pipeline's limits (the policy then stays on the host, usable)."""
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            raise error("OwningPolicy.to: %s is not a CUDA device" % dev)
        if self._storage is not None:
            raise error("OwningPolicy.to: %s is already on %s" % (self.name, self._device))
        nbytes = self._policy.device_memory_bytes()
        if nbytes == 0:
            raise error("OwningPolicy.to: %s keeps its cache on the host only" % self.name)
        storage = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        stream = torch.cuda.current_stream(storage.device)
        with torch.cuda.device(storage.device):
            self._policy.place_on_device(storage.data_ptr(), nbytes, stream.cuda_stream)
        self._storage, self._device, self._stream = storage, storage.device, stream
        return self

    @property
    def device(self):
        """Where the storage lives: "cpu", or the torch.device it was placed on."""
        return self._device if self._device is not None else "cpu"

    def device_memory_bytes(self):
        """Device bytes the storage takes when placed on a device (0: no device path)."""
        return self._policy.device_memory_bytes()

    @property
    def needs(self):
        """The NEEDS_* bits observe() must be given (appends are implied)."""
        return self._policy.needs()

    @property
    def batch(self):
        return self._policy.batch()

    def prefill(self, layer, keys, values):
        """The prompt of one layer: keys, values [batch, kv_heads, n, head_dim], post-RoPE."""
        self._policy.prefill(int(layer), describe(keys, "keys", ranks=(4,)),
                             describe(values, "values", ranks=(4,)))

    def append(self, layer, keys, values):
        """The step's token of one layer: keys, values [batch, kv_heads, 1, head_dim]."""
        self._policy.append(int(layer), describe(keys, "keys", ranks=(4,)),
                            describe(values, "values", ranks=(4,)))

    def observe(self, layer=-1, queries=None, token_ids=None, pad_counts=None):
        """Step level (layer -1): pad_counts [batch] (the prompt's left pads, before prefill),
        token_ids [batch, n]. Per layer: queries [batch, q_heads, 1, head_dim]."""
        obs, keep = observation(token_ids=token_ids, pad_counts=pad_counts, layer=layer,
                                queries=queries)
        self._policy.observe(obs)
        del keep

    def attention(self, layer, queries, out=None):
        """Decode attention of one layer over its resident tokens: queries [batch, q_heads, 1,
        head_dim]; writes (and returns) out, a new tensor (or array) like queries when not
        given."""
        if out is None:
            if is_torch(queries):
                out = queries.new_empty(queries.shape)
            else:  # NumPy is imported only when NumPy arrays are used (torch alone is enough)
                import numpy as np

                out = np.empty_like(queries)
        q, o = describe(queries, "queries", ranks=(4,)), describe(out, "out", ranks=(4,))
        if self._storage is None:
            self._policy.attention(int(layer), q, o)
            return out
        import torch

        nbytes = self._policy.attention_workspace_bytes(int(layer))
        # torch's caching allocator, ordered on the placement stream (all the policy's work runs
        # there), hands the same blocks back step after step.
        with torch.cuda.stream(self._stream):
            ws = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self._device)
            self._policy.attention(int(layer), q, o, ws.data_ptr(), nbytes)
        return out

    def end_step(self):
        """Closes the step for every sequence; True when the method evicted something."""
        return self._policy.end_step()

    def resident_bytes(self, layer=None):
        """Bytes the method's storage holds (codes, scales, metadata): one layer or all."""
        return self._policy.memory(-1 if layer is None else int(layer))[0]

    def fullkv_fp16_bytes(self):
        """Bytes an fp16 K+V cache of the same tokens would take."""
        return self._policy.memory(-1)[1]

    def resident_positions(self, layer, seq, kv_head):
        """Sorted generation positions resident in (layer, sequence, KV head)."""
        return self._policy.resident_positions(int(layer), int(seq), int(kv_head))

    def __repr__(self):
        return "kvsift.OwningPolicy(%r, %s)" % (self.name, self.options)


def make_owning_policy(name, **options):
    """OwningPolicy `name` (a method with owns_cache in policies(): "thinkv", "kivi", "pmkvq")
    with its config fields as keyword options, e.g. make_owning_policy("kivi", num_layers=32,
    kv_heads=8, q_heads=32, head_dim=128). Unknown options and invalid values raise kvsift.Error."""
    return OwningPolicy(name, options)
