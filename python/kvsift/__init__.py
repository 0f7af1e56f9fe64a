"""kvsift: KV-cache compression policies (SkipKV, ThinKV, R-KV, SnapKV, H2O, StreamingLLM) for
PyTorch, over kvsift's C API (libkvsift_c) through ctypes: no compiler at install time.

    import kvsift
    policy = kvsift.make_policy("rkv", budget=1024, window=8)
    kv = kvsift.CacheView(keys, values, lengths)        # [batch, kv_heads, capacity, head_dim]
    if policy.should_compress(kv):
        plan = policy.select(kv, window_queries)        # [batch, q_heads, window, head_dim]
        kvsift.compact(kv, plan)                        # in place, on torch's current stream

The library is found through $KVSIFT_LIBRARY or next to this package (docs/python.md).
Methods that own their cache (ThinKV, KIVI, PM-KVQ): kvsift.make_owning_policy.
HuggingFace generate: kvsift.hf.KVSiftCache.
"""

from ._api import (CacheView, Error, KeepPlan, MethodInfo, Policy, compact, cuda_available,
                   library_version, make_policy, policies)
from ._owning import OwningPolicy, make_owning_policy
from ._capi import (DEVICE_CPU, DEVICE_CUDA, NEEDS_APPEND, NEEDS_HIDDEN, NEEDS_QUERIES,
                    NEEDS_TOKENS, find_library)

__version__ = "0.1.0"

__all__ = ["CacheView", "Error", "KeepPlan", "MethodInfo", "Policy", "compact", "cuda_available",
           "library_version", "make_policy", "policies", "OwningPolicy", "make_owning_policy", "find_library", "NEEDS_QUERIES",
           "NEEDS_TOKENS", "NEEDS_HIDDEN", "NEEDS_APPEND", "DEVICE_CPU", "DEVICE_CUDA",
           "__version__"]
