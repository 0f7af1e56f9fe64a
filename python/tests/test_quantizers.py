"""KIVI and PM-KVQ (docs/algorithms.md §5.1-5.2) from Python: created by name through the
C API's owning-policy handle (kvsift._api.library().owning_policy; the package's public API has
no owning-policy wrapper yet), a tiny stream of prefill / append / attention / end_step, and the
resident bytes against the hand count of tests/c/test_c_api.c (the same stream)."""

import pytest
import torch

from kvsift import _api

# 1 layer, 2 KV heads, 4 query heads, head_dim 16, a 20-token prompt and 4 decode steps.
GEOMETRY = {"num_layers": 1, "kv_heads": 2, "q_heads": 4, "head_dim": 16, "group_size": 16}
CASES = [
    # KIVI-2, R = 16: key codes 64 B + key scale/minimum 64 B + 8 value rows 64 B + fp16 rows
    # 2 B x 16 x (8 keys + 16 values) 768 B = 960 B per head, 2 heads.
    ("kivi", {"residual_length": 16}, 1920),
    # PM-KVQ real, graceful, window 8, budget 0.002 MiB: halved to 8 bits by the prompt and to 4
    # bits at the second step; 1 sink + 7 window tokens at 16 bits (8 x 144 B) + 16 body tokens
    # at 4 bits (16 x 48 B).
    ("pmkvq", {"n_window": 8, "kv_budget_mb": [0.002]}, 1920),
]


def _stream(policy, lib):
    k = torch.arange(2 * 20 * 16, dtype=torch.float32).reshape(1, 2, 20, 16)
    prompt = (k * 13 % 17) / 17.0 - 0.5
    policy.prefill(0, lib.tensor_of(prompt), lib.tensor_of(prompt))
    query = (torch.arange(4 * 16, dtype=torch.float32).reshape(1, 4, 1, 16) * 5 % 7) / 7.0 - 0.5
    for step in range(4):
        tok = ((torch.arange(2 * 16, dtype=torch.float32) + 3 * step) % 9 / 9.0 - 0.5)
        tok = tok.reshape(1, 2, 1, 16)
        policy.append(0, lib.tensor_of(tok), lib.tensor_of(tok))
        out = torch.full((1, 4, 1, 16), 1e30)
        policy.attention(0, lib.tensor_of(query), lib.tensor_of(out))
        assert bool(((out > -1) & (out < 1)).all())  # a convex combination of inputs in [-.5, .5]
        assert policy.end_step() is False  # nothing evicted


@pytest.mark.parametrize("name,extra,expect", CASES)
def test_quantizer_by_name_counts_its_bytes(name, extra, expect):
    lib = _api.library()
    info = {m["name"]: m for m in lib.methods()}
    assert info[name]["owns_cache"] and info[name]["family"] == "quantizer"
    policy = lib.owning_policy(name, dict(GEOMETRY, **extra))
    assert policy.batch() == 1
    _stream(policy, lib)
    resident, full = policy.memory()
    assert resident == expect
    assert full == 24 * 2 * 16 * 2 * 2  # fp16 K + V of 24 tokens
    assert policy.resident_positions(0, 0, 1) == list(range(24))


def test_quantizer_config_errors_name_the_field():
    lib = _api.library()
    with pytest.raises(_api.Error) as e:
        lib.owning_policy("pmkvq", {"num_layers": 1})
    assert "kv_budget_mb" in str(e.value)
    with pytest.raises(_api.Error) as e:
        lib.owning_policy("kivi", {"k_bits": 3})
    assert "k_bits must be 2, 4 or 8, got 3" in str(e.value)
