"""Methods that own their cache from Python's public API (kvsift.make_owning_policy): KIVI and
PM-KVQ (docs/algorithms.md §5.1-5.2) created by name, a tiny stream of prefill / append /
attention / end_step on torch tensors, the resident bytes against the hand count of
tests/c/test_c_api.c (the same stream), and the errors."""

import numpy as np
import pytest
import torch

import kvsift

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


def _stream(policy):
    k = torch.arange(2 * 20 * 16, dtype=torch.float32).reshape(1, 2, 20, 16)
    prompt = (k * 13 % 17) / 17.0 - 0.5
    policy.prefill(0, prompt, prompt)
    query = (torch.arange(4 * 16, dtype=torch.float32).reshape(1, 4, 1, 16) * 5 % 7) / 7.0 - 0.5
    for step in range(4):
        tok = ((torch.arange(2 * 16, dtype=torch.float32) + 3 * step) % 9 / 9.0 - 0.5)
        tok = tok.reshape(1, 2, 1, 16)
        policy.append(0, tok, tok)
        out = policy.attention(0, query)
        assert out.shape == query.shape and out.dtype == torch.float32
        assert bool(((out > -1) & (out < 1)).all())  # a convex combination of inputs in [-.5, .5]
        assert policy.end_step() is False  # nothing evicted


@pytest.mark.parametrize("name,extra,expect", CASES)
def test_quantizer_by_name_counts_its_bytes(name, extra, expect):
    info = {m.name: m for m in kvsift.policies()}
    assert info[name].owns_cache and info[name].family == "quantizer"
    policy = kvsift.make_owning_policy(name, **dict(GEOMETRY, **extra))
    assert isinstance(policy, kvsift.OwningPolicy) and policy.batch == 1
    _stream(policy)
    assert policy.resident_bytes() == expect
    assert policy.resident_bytes(layer=0) == expect
    assert policy.fullkv_fp16_bytes() == 24 * 2 * 16 * 2 * 2  # fp16 K + V of 24 tokens
    assert policy.resident_positions(0, 0, 1) == list(range(24))


def test_attention_writes_a_given_output_in_place_numpy_too():
    policy = kvsift.make_owning_policy("kivi", residual_length=16, **GEOMETRY)
    prompt = np.linspace(-0.5, 0.5, 2 * 20 * 16, dtype=np.float32).reshape(1, 2, 20, 16)
    policy.prefill(0, prompt, prompt)
    tok = np.full((1, 2, 1, 16), 0.25, dtype=np.float32)
    policy.append(0, tok, tok)
    out = np.full((1, 4, 1, 16), np.nan, dtype=np.float32)
    assert policy.attention(0, np.zeros((1, 4, 1, 16), dtype=np.float32), out) is out
    assert np.isfinite(out).all()


def test_owning_policy_errors_carry_the_c_message():
    with pytest.raises(kvsift.Error, match="kv_budget_mb"):
        kvsift.make_owning_policy("pmkvq", num_layers=1)
    with pytest.raises(kvsift.Error, match="k_bits must be 2, 4 or 8, got 3"):
        kvsift.make_owning_policy("kivi", k_bits=3)
    policy = kvsift.make_owning_policy("kivi", residual_length=16, **GEOMETRY)
    with pytest.raises(kvsift.Error, match="not prefilled"):
        policy.append(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    with pytest.raises(kvsift.Error, match="float64"):
        policy.prefill(0, torch.zeros(1, 2, 4, 16, dtype=torch.float64),
                       torch.zeros(1, 2, 4, 16, dtype=torch.float64))
    with pytest.raises(kvsift.Error, match="policy name must be a str"):
        kvsift.make_owning_policy(3)
