"""Zero-copy: the C library reads and compacts the caller's memory itself (same data_ptr, rows
moved in place), in f32/f16/bf16, on strided capacity views (a bigger buffer sliced), and on
NumPy arrays. Oracle: an independent gather of the plan's slots from a copy taken before."""

import numpy as np
import pytest
import torch

import kvsift


def gathered(before, plan, b, h):
    """Rows of `before` [B, H, S, D] at the plan's kept slots of (b, h)."""
    return before[b, h, plan.row(b, h).astype(np.int64)]


def check_compacted(after, before, plan):
    for b in range(plan.batch):
        k = int(plan.kept_lengths[b])
        for h in range(plan.kv_heads):
            expect = gathered(before, plan, b, h)
            got = after[b, h, :k]
            assert torch.equal(got, expect) if torch.is_tensor(got) else np.array_equal(got, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rkv_compacts_the_callers_tensors_in_place(dtype):
    torch.manual_seed(0)
    keys = torch.randn(2, 2, 48, 16).to(dtype)
    values = torch.randn(2, 2, 48, 16).to(dtype)
    queries = torch.randn(2, 4, 4, 16).to(dtype)
    kptr, vptr = keys.data_ptr(), values.data_ptr()
    k0, v0 = keys.clone(), values.clone()
    lengths = np.array([40, 33], dtype=np.int32)
    kv = kvsift.CacheView(keys, values, lengths)
    policy = kvsift.make_policy("rkv", budget=24, window=4, buffer=8)
    plan = policy.select(kv, queries)
    assert torch.equal(keys, k0) and torch.equal(values, v0)  # select never writes
    assert list(plan.kept_lengths) == [24, 24]
    kvsift.compact(kv, plan)
    assert keys.data_ptr() == kptr and values.data_ptr() == vptr
    assert lengths is kv.lengths and list(lengths) == [24, 24]  # the caller's array, rewritten
    check_compacted(keys, k0, plan)
    check_compacted(values, v0, plan)
    # the window (last 4 tokens) is always kept, in order, at the end
    for b, n in ((0, 40), (1, 33)):
        assert torch.equal(keys[b, :, 20:24], k0[b, :, n - 4:n])


def test_strided_capacity_view_of_a_bigger_buffer():
    # One preallocated buffer [B, H, 64, D] of which the cache is the first 40 slots, plus a
    # buffer with heads interleaved ([B, S, H, D] storage, viewed as [B, H, S, D]).
    torch.manual_seed(1)
    big = torch.randn(1, 2, 64, 8)
    keys = big[:, :, :40]
    values_storage = torch.randn(1, 40, 2, 8)
    values = values_storage.transpose(1, 2)  # strides (640, 8, 16, 1)
    assert not keys.is_contiguous() and not values.is_contiguous()
    big0, values0 = big.clone(), values.clone()
    queries = torch.randn(1, 2, 4, 8)
    kv = kvsift.CacheView(keys, values, [40])
    plan = kvsift.make_policy("rkv", budget=20, window=4, buffer=4).select(kv, queries)
    kvsift.compact(kv, plan)
    check_compacted(keys, big0[:, :, :40], plan)
    check_compacted(values, values0, plan)
    assert torch.equal(big[:, :, 40:], big0[:, :, 40:])  # slots past the view untouched


def test_valid_mask_is_rewritten_in_place():
    keys = torch.randn(2, 1, 24, 4)
    mask = torch.ones(2, 24, dtype=torch.uint8)
    mask[1, :5] = 0  # 5 left pads in sequence 1
    kv = kvsift.CacheView(keys, keys.clone(), [24, 24], valid_mask=mask)
    plan = kvsift.make_policy("rkv", budget=12, window=2, buffer=2).select(
        kv, torch.randn(2, 1, 2, 4))
    for h in range(1):
        assert (plan.row(1, h) >= 5).all()  # pads are never kept when a sequence is compressed
    kvsift.compact(kv, plan)
    assert mask[:, :12].all()


def test_numpy_arrays_zero_copy():
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((1, 2, 30, 8)).astype(np.float32)
    values = rng.standard_normal((1, 2, 30, 8)).astype(np.float16)[..., :8]
    values = values.astype(np.float32)
    k0, v0 = keys.copy(), values.copy()
    addr = keys.ctypes.data
    kv = kvsift.CacheView(keys, values, [30])
    plan = kvsift.make_policy("streaming", budget=10, sink=2, buffer=2).select(kv)
    kvsift.compact(kv, plan)
    assert keys.ctypes.data == addr
    assert np.array_equal(keys[0, :, :10], np.concatenate([k0[0, :, :2], k0[0, :, 22:30]], axis=1))
    assert np.array_equal(values[0, :, :10],
                          np.concatenate([v0[0, :, :2], v0[0, :, 22:30]], axis=1))


def test_numpy_f16():
    keys = np.arange(1 * 1 * 12 * 4, dtype=np.float16).reshape(1, 1, 12, 4)
    k0 = keys.copy()
    kv = kvsift.CacheView(keys, keys.copy(), [12])
    kvsift.compact(kv, kvsift.make_policy("streaming", budget=4, sink=1, buffer=1).select(kv))
    assert np.array_equal(keys[0, 0, :4], k0[0, 0, [0, 9, 10, 11]])


def test_a_plan_for_other_lengths_is_refused_and_nothing_moves():
    keys = torch.randn(1, 1, 20, 4)
    k0 = keys.clone()
    kv = kvsift.CacheView(keys, keys.clone(), [20])
    plan = kvsift.make_policy("streaming", budget=8, sink=1, buffer=1).select(kv)
    kv.lengths[0] = 19  # the cache changed after planning
    with pytest.raises(kvsift.Error, match="kvsift_compact"):
        kvsift.compact(kv, plan)
    assert torch.equal(keys, k0) and kv.lengths[0] == 19
