"""kvsift.hf.KVSiftCache's logic on CPU without transformers, through mini_decoder (a decoder that
uses its cache the way transformers 5.x does): no trigger -> the same tokens as a DynamicCache;
a left-padded batch whose hidden slots are overwritten with large random values after every
compaction generates the same tokens (the cache's mask hides exactly those slots); resident
lengths stay within [budget, budget + buffer) once compressed; the re-projected window queries
equal the model's own post-RoPE queries; the kept slots equal a direct kvsift select on the
captured K/Q; the up-front errors."""

import numpy as np
import pytest
import torch

import kvsift
import kvsift.hf as hf
import mini_decoder as md


def model(seed=0, **kw):
    torch.manual_seed(seed)
    return md.MiniLM(md.Config(**kw)).eval()


def prompts(batch, length, pads=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 50, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids, mask


def test_no_trigger_is_token_identical_to_a_dynamic_cache():
    m = model()
    ids, mask = prompts(2, 20, pads=(0, 5))
    ref = md.greedy(m, ids, mask, md.DynamicLikeCache(), 30)
    with hf.KVSiftCache(m, "rkv", budget=200, window=4, buffer=8) as cache:
        out = md.greedy(m, ids, mask, cache, 30)
        assert cache.compressions == 0
        assert cache.get_seq_length() == 20 + 29  # prompt, then 29 decode steps
    assert torch.equal(out, ref)


def test_keep_everything_plan_is_token_identical():
    # fullkv never evicts: its slots stay the DynamicCache's
    m = model(3)
    ids, mask = prompts(2, 24, pads=(3, 0))
    ref = md.greedy(m, ids, mask, md.DynamicLikeCache(), 40)
    with hf.KVSiftCache(m, "fullkv") as cache:
        assert torch.equal(md.greedy(m, ids, mask, cache, 40), ref)


@pytest.mark.parametrize("method", ["rkv", "streaming", "snapkv"])
def test_lengths_stay_within_budget_and_buffer(method):
    m = model(1)
    ids, mask = prompts(2, 12)
    budget, buffer = 24, 8
    seen = []
    with hf.KVSiftCache(m, method, budget=budget, buffer=buffer,
                        **({"window": 4} if method != "streaming" else {})) as cache:
        md.greedy(m, ids, mask, cache, 80,
                  after_step=lambda: seen.append(cache.resident_lengths().copy()))
        assert cache.compressions >= 5
    started = False
    for lens in seen:
        started = started or lens.max() >= budget
        if started:
            assert budget <= lens.min() and lens.max() < budget + buffer, lens


def test_padded_batch_is_invariant_to_what_the_mask_hides():
    m = model(2)
    ids, mask = prompts(3, 30, pads=(0, 7, 19), seed=4)
    runs = []
    for noisy in (False, True):
        g = torch.Generator().manual_seed(9)
        cache = hf.KVSiftCache(m, "rkv", budget=20, window=4, buffer=6)
        state = {"n": 0}

        def after(cache=cache, noisy=noisy, g=g, state=state):
            if noisy and cache.compressions > state["n"]:
                cache.fill_masked_slots_(1e4, generator=g)
            state["n"] = cache.compressions

        runs.append(md.greedy(m, ids, mask, cache, 40, after_step=after))
        assert cache.compressions >= 3
        # rows with 11 real tokens keep all of them (pads dropped): lengths differ
        cache.close()
    assert torch.equal(runs[0], runs[1])


def test_an_unpadded_row_equals_its_solo_run():
    m = model(5)
    ids, mask = prompts(2, 16, seed=7)
    with hf.KVSiftCache(m, "rkv", budget=20, window=4, buffer=6) as cache:
        both = md.greedy(m, ids, mask, cache, 40)
    for b in range(2):
        with hf.KVSiftCache(m, "rkv", budget=20, window=4, buffer=6) as cache:
            solo = md.greedy(m, ids[b:b + 1], mask[b:b + 1], cache, 40)
        assert torch.equal(both[b:b + 1], solo)


@pytest.mark.parametrize("q_norm", [False, True])
def test_window_queries_and_kept_slots_match_a_direct_select(q_norm):
    m = model(6, q_norm=q_norm)
    ids, mask = prompts(2, 10, seed=3)
    W, budget, buffer = 4, 16, 6
    cache = hf.KVSiftCache(m, "rkv", budget=budget, window=W, buffer=buffer)
    checked = {"n": 0}
    original = cache._compress

    def compress_and_check():
        # before compaction: snapshot K/V and the model's own last-W queries of every layer
        snaps = []
        for i, L in enumerate(cache.hf_layers):
            n = int(cache.resident_lengths().max())
            own = torch.cat(m.model.layers[i].self_attn.recorded_queries, dim=2)[:, :, -W:]
            assert torch.allclose(cache._window_queries(i), own, atol=1e-5, rtol=1e-5)
            snaps.append((L.k_buf[:, :, :n].clone(), L.v_buf[:, :, :n].clone(), own))
        lengths = cache.resident_lengths()
        original()
        for i, (k, v, q) in enumerate(snaps):
            kv = kvsift.CacheView(k.clone(), v.clone(), lengths.copy())
            plan = kvsift.make_policy("rkv", budget=budget, window=W, buffer=buffer).select(kv, q)
            L = cache.hf_layers[i]
            for b in range(2):
                rows = plan.row(b, 0)
                for h in range(k.shape[1]):
                    slots = torch.from_numpy(plan.row(b, h).astype(np.int64))
                    assert torch.equal(L.k_buf[b, h, :len(slots)], k[b, h, slots])
                    assert torch.equal(L.v_buf[b, h, :len(slots)], v[b, h, slots])
                assert len(rows) == cache.resident_lengths()[b]
        checked["n"] += 1

    cache._compress = compress_and_check
    md.greedy(m, ids, mask, cache, 30)
    assert checked["n"] >= 2
    cache.close()


def test_skipkv_observes_tokens_and_hidden_states():
    m = model(7)
    ids, mask = prompts(2, 14, pads=(0, 4))
    ids[:, 6] = 5  # a delimiter (given below in this 50-token vocabulary)
    with hf.KVSiftCache(m, "skipkv", vocabulary="r1_qwen", budget=16, window=4, buffer=6,
                        delimiters=[5, 6], keywords=[7]) as cache:
        assert cache.needs & kvsift.NEEDS_HIDDEN and cache.needs & kvsift.NEEDS_TOKENS
        md.greedy(m, ids, mask, cache, 40)
        assert cache.compressions >= 3


def test_up_front_errors():
    m = model()
    with pytest.raises(kvsift.Error, match="h2o"):
        hf.KVSiftCache(m, "h2o")
    m.generation_config.num_beams = 4
    with pytest.raises(kvsift.Error, match="beam search"):
        hf.KVSiftCache(m, "rkv")
    m.generation_config.num_beams = 1
    m.generation_config.cache_implementation = "static"
    with pytest.raises(kvsift.Error, match="static"):
        hf.KVSiftCache(m, "rkv")
    m.generation_config.cache_implementation = None
    with hf.KVSiftCache(m, "rkv", budget=16, window=4, buffer=4) as cache:
        with pytest.raises(kvsift.Error, match="beam search"):
            cache.reorder_cache(torch.tensor([0]))
        ids, mask = prompts(1, 30)
        md.greedy(m, ids, mask, cache, 2)  # compresses right after the 30-token prompt
        assert cache.compressions >= 1
        with pytest.raises(kvsift.Error, match="continuing from a compressed cache"):
            m(ids, attention_mask=torch.ones(1, 32 + 30, dtype=torch.long), past_key_values=cache)
    m.config._attn_implementation = "flash_attention_2"
    with hf.KVSiftCache(m, "rkv", budget=16, window=4, buffer=4) as cache:
        ids, mask = prompts(2, 8, pads=(0, 2))
        with pytest.raises(kvsift.Error, match="flash_attention_2 with padded rows"):
            md.greedy(m, ids, mask, cache, 1)
    m.config._attn_implementation = "eager"
    ids, mask = prompts(1, 8)
    mask[0, 3] = 0
    with hf.KVSiftCache(m, "rkv") as cache:
        with pytest.raises(kvsift.Error, match="not left padding"):
            md.greedy(m, ids, mask, cache, 1)


def test_close_detaches_and_uninstall_restores_the_model():
    m = model()
    ids, mask = prompts(1, 10)
    ref = md.greedy(m, ids, mask, md.DynamicLikeCache(), 5)
    first = hf.KVSiftCache(m, "rkv", budget=16, window=4, buffer=4)
    second = hf.KVSiftCache(m, "rkv", budget=16, window=4, buffer=4)  # shares the wrappers
    first.close()  # closing in any order leaves the other cache working
    assert torch.equal(md.greedy(m, ids, mask, second, 5), ref)
    with pytest.raises(kvsift.Error, match="after close"):
        md.greedy(m, ids, mask, first, 1)
    second.close()
    assert "forward" in m.model.__dict__
    hf.uninstall(m)
    assert "forward" not in m.model.__dict__
    assert all("forward" not in layer.self_attn.__dict__ for layer in m.model.layers)
    assert torch.equal(md.greedy(m, ids, mask, md.DynamicLikeCache(), 5), ref)


class KeepEverything:
    """A policy stand-in that compresses every step with fullkv's keep-everything plans: the
    compaction and the cache's own mask run, the slots stay the same."""

    def __init__(self, inner):
        self.inner, self.full = inner, kvsift.make_policy("fullkv")
        self.needs = inner.needs

    def should_compress(self, kv):
        return True

    def select(self, kv, window_queries=None, layer=0):
        plan = self.full.select(kv)
        assert plan.keeps_everything
        return plan

    def compress_step(self, layers, window_queries=None):
        before = [list(kv.lengths) for kv in layers]
        self.full.compress_step(layers)  # keep-everything plans, compacted (a no-op move)
        assert [list(kv.lengths) for kv in layers] == before

    def observe(self, **kw):
        return self.inner.observe(**kw)


def test_keep_everything_plans_through_the_compressed_path_are_token_identical():
    m = model(8)
    ids, mask = prompts(3, 18, pads=(0, 6, 11), seed=5)
    ref = md.greedy(m, ids, mask, md.DynamicLikeCache(), 30)
    with hf.KVSiftCache(m, "rkv", budget=64, window=4, buffer=8) as cache:
        cache.policy = KeepEverything(cache.policy)
        out = md.greedy(m, ids, mask, cache, 30)
        assert cache.compressions == 30 and cache._compressed
    assert torch.equal(out, ref)


@pytest.mark.parametrize("method", ["rkv", "skipkv"])
def test_fill_synthetic_continues_at_the_given_position(method):
    # The benchmark's state: `resident` slots held at logical position 500; decoding goes on
    # with RoPE positions 500, 501, ... and compresses every `buffer` steps.
    m = model(1)
    opts = {"vocabulary": "r1_qwen", "delimiters": [5]} if method == "skipkv" else {}
    with hf.KVSiftCache(m, method, budget=24, buffer=8, window=4, **opts) as cache:
        cache.fill_synthetic(2, 30, 500, torch.float32, "cpu")
        assert cache.get_seq_length() == 500 and list(cache.resident_lengths()) == [30, 30]
        ids = torch.randint(3, 50, (2, 1))
        for _ in range(20):
            pos = torch.full((2, 1), cache.get_seq_length())
            ids = m(ids, position_ids=pos, past_key_values=cache)[:, -1:].argmax(-1)
        assert cache.get_seq_length() == 520
        assert cache.compressions == 3  # at 32 slots (the first step), then every 8 steps
        assert list(cache.resident_lengths()) == [26, 26]


def test_unset_fields_take_the_methods_defaults():
    m = model()
    with hf.KVSiftCache(m, "snapkv") as cache:  # SnapKV's own window is 32, not R-KV's 8
        defaults = {i.name: i.default_config for i in kvsift.policies()}["snapkv"]
        assert cache.window == defaults["window"]
        assert (cache.budget, cache.buffer) == (defaults["budget"], defaults["buffer"])
