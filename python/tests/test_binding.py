"""Round trips through the ctypes binding: the registry, versions, configs as keyword options,
plans and their accessors, observe(), and the mapping of C errors to kvsift.Error (status code
and the library's message naming the argument)."""

import numpy as np
import pytest
import torch

import kvsift


def test_version_matches_library():
    assert kvsift.__version__ == kvsift.library_version()


def test_registry_lists_every_method_once():
    names = [m.name for m in kvsift.policies()]
    for expected in ("fullkv", "streaming", "h2o", "snapkv", "rkv", "skipkv", "thinkv"):
        assert expected in names
    assert len(names) == len(set(names))
    info = {m.name: m for m in kvsift.policies()}
    assert info["rkv"].family == "baseline"
    assert info["skipkv"].needs & kvsift.NEEDS_TOKENS
    assert info["h2o"].needs & kvsift.NEEDS_QUERIES
    assert info["streaming"].needs == 0


def test_cuda_available_is_a_bool():
    assert kvsift.cuda_available() in (True, False)


def test_streaming_plan_is_sinks_plus_recent():
    # Hand-computed: 10 tokens, budget 6, 2 sinks -> slots 0, 1 and the last 4.
    keys, values = torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)
    kv = kvsift.CacheView(keys, values, [10, 5])
    policy = kvsift.make_policy("streaming", budget=6, sink=2, buffer=4)
    assert policy.should_compress(kv)  # 10 >= budget + buffer
    plan = policy.select(kv)
    assert isinstance(plan, kvsift.KeepPlan)
    assert (plan.batch, plan.kv_heads, plan.capacity, plan.max_kept) == (2, 3, 12, 6)
    assert list(plan.kept_lengths) == [6, 5]
    assert list(plan.source_lengths) == [10, 5]
    assert not plan.keeps_everything
    slots = plan.slots()
    assert slots.shape == (2, 3, 6) and slots.dtype == np.int32
    for h in range(3):
        assert list(slots[0, h]) == [0, 1, 6, 7, 8, 9]
        assert list(slots[1, h]) == [0, 1, 2, 3, 4, -1]  # under budget: everything, then padding
    assert list(plan.row(1, 2)) == [0, 1, 2, 3, 4]
    t = plan.slots_torch()
    assert t.dtype == torch.int64 and t.shape == (2, 3, 6)


def test_compress_step_compacts_every_layer_in_place():
    # The hand-computed StreamingLLM slots above, in two layers at once, one shared pad mask.
    keys = [torch.randn(2, 3, 12, 8) for _ in range(2)]
    values = [torch.randn(2, 3, 12, 8) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in zip(keys, values)]
    mask = torch.ones(2, 12, dtype=torch.uint8)
    views = [kvsift.CacheView(k, v, [10, 5], valid_mask=mask) for k, v in zip(keys, values)]
    ptrs = [k.data_ptr() for k in keys]
    policy = kvsift.make_policy("streaming", budget=6, sink=2, buffer=4)
    policy.compress_step(views)
    kept = [0, 1, 6, 7, 8, 9]
    for view, k, v, (k0, v0), ptr in zip(views, keys, values, before, ptrs):
        assert list(view.lengths) == [6, 5]
        assert k.data_ptr() == ptr  # in place, on the caller's tensor
        assert torch.equal(k[0, :, :6], k0[0, :, kept]) and torch.equal(v[0, :, :6], v0[0, :, kept])
        assert torch.equal(k[1, :, :5], k0[1, :, :5])
    with pytest.raises(kvsift.Error, match="no layers"):
        policy.compress_step([])
    with pytest.raises(kvsift.Error, match="1 window_queries for 2 layers"):
        policy.compress_step(views, [torch.zeros(2, 3, 4, 8)])


def test_trigger_below_budget_plus_buffer():
    keys = torch.zeros(1, 1, 32, 4)
    policy = kvsift.make_policy("rkv", budget=16, window=4, buffer=8)
    assert not policy.should_compress(kvsift.CacheView(keys, keys, [23]))
    assert policy.should_compress(kvsift.CacheView(keys, keys, [24]))


def test_options_become_the_json_config():
    p = kvsift.make_policy("skipkv", budget=64, window=8, buffer=16, hidden_size=0,
                           delimiters=np.array([198, 271]), keywords=[14190],
                           steering={"boundary": [271], "think_start": [1], "think_end": [2]})
    assert p.needs & kvsift.NEEDS_TOKENS
    assert not p.needs & kvsift.NEEDS_HIDDEN  # hidden_size 0: segmentation only
    q = kvsift.make_policy("skipkv", hidden_size=16)
    assert q.needs & kvsift.NEEDS_HIDDEN


def test_observe_feeds_skipkv_and_select_checks_lengths():
    p = kvsift.make_policy("skipkv", budget=16, window=4, buffer=4, hidden_size=0)
    ids = np.full((1, 30), 5, dtype=np.int64)  # no delimiter: one open sentence
    p.observe(token_ids=ids)
    keys = torch.randn(1, 2, 40, 8)
    kv = kvsift.CacheView(keys, keys.clone(), [29])  # one token fewer than observed
    with pytest.raises(kvsift.Error) as e:
        p.select(kv, torch.randn(1, 4, 4, 8))
    assert "holds 29 tokens, expected 30" in str(e.value)
    kv = kvsift.CacheView(keys, keys.clone(), [30])
    plan = p.select(kv, torch.randn(1, 4, 4, 8))
    assert list(plan.kept_lengths) == [16]


@pytest.mark.parametrize("bad, message", [
    (lambda: kvsift.make_policy("no_such_method"), "unknown policy 'no_such_method'"),
    (lambda: kvsift.make_policy("rkv", budget=8, window=8), "budget (8) must exceed window"),
    (lambda: kvsift.make_policy("rkv", bogus=1), "unknown key 'bogus'"),
    (lambda: kvsift.make_policy("rkv", mix_lambda=1.5), "mix_lambda must be in [0, 1]"),
    (lambda: kvsift.make_policy("rkv", budget="many"), "budget"),
])
def test_config_errors_carry_the_c_message(bad, message):
    with pytest.raises(kvsift.Error) as e:
        bad()
    assert e.value.code == 1  # KVSIFT_ERROR_INVALID_ARGUMENT
    assert message in str(e.value)
    assert "kvsift_policy_create" in str(e.value)


def test_mismatched_tensors_are_refused():
    k = torch.randn(1, 2, 10, 4)
    policy = kvsift.make_policy("streaming", budget=6, sink=2, buffer=1)
    with pytest.raises(kvsift.Error, match="values dtype f16 != keys dtype f32"):
        policy.select(kvsift.CacheView(k, k.half(), [10]))
    with pytest.raises(kvsift.Error, match=r"values shape \[1, 1, 10, 4\] != keys shape"):
        policy.select(kvsift.CacheView(k, k[:, :1], [10]))
    with pytest.raises(kvsift.Error, match="keys: rank 3"):
        kvsift.CacheView(k[0], k[0], [10])
    with pytest.raises(kvsift.Error, match="lengths: shape"):
        kvsift.CacheView(k, k, [10, 3])
    with pytest.raises(kvsift.Error, match="lengths.* outside"):
        policy.should_compress(kvsift.CacheView(k, k, [11]))
    with pytest.raises(kvsift.Error, match="dtype torch.float64 is not supported"):
        kvsift.CacheView(k.double(), k.double(), [10])
    with pytest.raises(kvsift.Error, match="expected a torch.Tensor or numpy.ndarray"):
        kvsift.CacheView([[1.0]], k, [10])


def test_non_dense_head_dim_is_refused():
    k = torch.randn(1, 2, 4, 10).transpose(2, 3)  # [1, 2, 10, 4] with head_dim stride 10
    with pytest.raises(kvsift.Error, match="last dimension .* stride 10; it must be dense"):
        kvsift.CacheView(k, k, [10])


def test_numpy_bf16_is_not_a_thing_and_float64_is_refused():
    k = np.zeros((1, 1, 4, 4), dtype=np.float64)
    with pytest.raises(kvsift.Error, match="NumPy dtype float64 is not supported"):
        kvsift.CacheView(k, k, [4])


def test_window_queries_on_another_device_kind_fail_in_c():
    # A fake device pointer: the C library refuses device memory when built without CUDA (or
    # validates the shapes first); either way the error names the argument.
    keys = torch.randn(1, 2, 16, 8)
    policy = kvsift.make_policy("rkv", budget=8, window=2, buffer=2)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(kvsift.Error, match="head_dim|window"):
        policy.select(kvsift.CacheView(keys, keys, [16]), q[..., :4])


def test_rkv_without_queries_names_them():
    keys = torch.randn(1, 2, 16, 8)
    policy = kvsift.make_policy("rkv", budget=8, window=2, buffer=2)
    with pytest.raises(kvsift.Error) as e:
        policy.select(kvsift.CacheView(keys, keys, [16]))
    assert "window_queries" in str(e.value) or "queries" in str(e.value)


def test_per_layer_observe_feeds_h2o():
    # H2O accumulates attention from every step's queries (per-layer observations); without
    # them it refuses to select, with them it plans `budget` tokens.
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 40, 8)
    kv = kvsift.CacheView(keys, keys.clone(), [40])
    policy = kvsift.make_policy("h2o", budget=16, recent=4, buffer=4)
    assert policy.needs & kvsift.NEEDS_QUERIES
    with pytest.raises(kvsift.Error):
        policy.select(kv)
    policy.observe(layer=0, kv=kv, queries=torch.randn(1, 4, 40, 8))
    plan = policy.select(kv)
    assert list(plan.kept_lengths) == [16]
    assert list(plan.row(0, 0)[-4:]) == [36, 37, 38, 39]  # the recent tokens
