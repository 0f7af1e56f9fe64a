"""Golden parity of select() through Python (golden/README.md): R-KV's kept sets on rkv_mha,
rkv_gqa and rkv_batch2, SkipKV's on skipkv_pad (left padding, faithful pads), and bit-identical
compacted K/V for every slot kept by both. Kept sets must equal the reference's except for tokens
whose reference score is within 1e-6 of the score at the cut."""

import json
import os

import numpy as np
import pytest
import torch

import kvsift
import safetensors_lite


def load(golden_dir, name):
    tensors, meta = safetensors_lite.read(os.path.join(golden_dir, name + ".safetensors"))
    return tensors, json.loads(meta["config"])


def check_kept_sets(plan, keep_sorted, score, budget, window, valid=None):
    """Returns the number of near-cut swaps; fails on any other difference."""
    B, H, keep = keep_sorted.shape
    swaps = 0
    for b in range(B):
        for h in range(H):
            row = plan.row(b, h)
            assert len(row) == budget
            n = plan.source_lengths[b] - window
            assert list(row[keep:]) == list(range(n, n + window))  # the window, in order
            ours, ref = set(row[:keep].tolist()), set(keep_sorted[b, h].tolist())
            cut = np.sort(score[b, h, :n])[::-1][keep - 1]
            for j in ours ^ ref:
                assert abs(score[b, h, j] - cut) <= 1e-6, (
                    "(b=%d, h=%d) slot %d: score %r, cut %r" % (b, h, j, score[b, h, j], cut))
                swaps += 1
    return swaps


@pytest.mark.parametrize("case", ["rkv_mha", "rkv_gqa", "rkv_batch2"])
@pytest.mark.parametrize("dtype", [torch.float32])
def test_rkv_golden(golden_dir, case, dtype):
    t, cfg = load(golden_dir, case)
    keys, values = torch.from_numpy(t["keys"]), torch.from_numpy(t["values"])
    B, H, S, D = keys.shape
    budget, window = cfg["budget"], cfg["window"]
    policy = kvsift.make_policy("rkv", budget=budget, window=window, kernel=cfg["kernel"],
                                mix_lambda=cfg["mix_lambda"], threshold=cfg["threshold"],
                                buffer=max(128, window), redundancy="faithful")
    kv = kvsift.CacheView(keys, values, [S] * B)
    assert policy.should_compress(kv) == (S >= budget + max(128, window))
    plan = policy.select(kv, torch.from_numpy(t["queries"]))
    swaps = check_kept_sets(plan, t["keep_sorted"], t["score"], budget, window)
    assert swaps <= B * H * budget // 100
    # Compaction: every slot kept by both holds the reference's rows bit for bit.
    keep = budget - window
    kvsift.compact(kv, plan)
    assert list(kv.lengths) == [budget] * B
    compared = 0
    for b in range(B):
        for h in range(H):
            row = plan.row(b, h).tolist()
            ref_slots = t["keep_topk"][b, h].tolist() + list(range(S - window, S))
            for i, slot in enumerate(ref_slots):
                if slot not in row:
                    continue
                p = row.index(slot)
                assert np.array_equal(keys[b, h, p].numpy(), t["compacted_keys"][b, h, i])
                assert np.array_equal(values[b, h, p].numpy(), t["compacted_values"][b, h, i])
                compared += 1
    assert compared >= B * H * budget - swaps


def test_skipkv_pad_golden(golden_dir):
    t, cfg = load(golden_dir, "skipkv_pad")
    keys, values = torch.from_numpy(t["keys"]), torch.from_numpy(t["values"])
    B, H, S, D = keys.shape
    mask = torch.from_numpy(t["valid_mask"].copy())
    pads = (mask == 0).sum(dim=1).numpy().astype(np.int32)
    assert list(pads) == [0, 17, 40]
    budget, window = cfg["budget"], cfg["window"]
    policy = kvsift.make_policy("skipkv", budget=budget, window=window, kernel=cfg["kernel"],
                                mix_lambda=cfg["mix_lambda"], threshold=cfg["threshold"],
                                redundancy="faithful", pad_mode="faithful", buffer=window,
                                hidden_size=0)
    # Token ids without any delimiter: no sentence closes, so no penalty (as in the reference).
    kv = kvsift.CacheView(keys, values, [S] * B, valid_mask=mask)
    policy.observe(token_ids=np.full((B, S), 5, dtype=np.int32), pad_counts=pads, kv=kv)
    plan = policy.select(kv, torch.from_numpy(t["queries"]))
    check_kept_sets(plan, t["keep_sorted"], t["score"], budget, window)
    for b in range(B):  # faithful mode: every pad kept, in the first slots
        for h in range(H):
            assert list(plan.row(b, h)[:pads[b]]) == list(range(pads[b]))
    kvsift.compact(kv, plan)
    for b in range(B):
        assert int((mask[b, :budget] == 0).sum()) == pads[b]


def test_rkv_golden_in_half_precision_keeps_nearly_the_same_set(golden_dir):
    # f16/bf16 inputs through the same path: not bit-parity (the reference ran in fp32), but the
    # kept sets must overlap the reference's almost entirely.
    t, cfg = load(golden_dir, "rkv_gqa")
    budget, window = cfg["budget"], cfg["window"]
    for dtype in (torch.float16, torch.bfloat16):
        keys = torch.from_numpy(t["keys"]).to(dtype)
        kv = kvsift.CacheView(keys, torch.from_numpy(t["values"]).to(dtype), [keys.shape[2]])
        policy = kvsift.make_policy("rkv", budget=budget, window=window, redundancy="faithful")
        plan = policy.select(kv, torch.from_numpy(t["queries"]).to(dtype))
        keep = budget - window
        overlap = np.mean([len(set(plan.row(0, h)[:keep].tolist())
                               & set(t["keep_sorted"][0, h].tolist())) / keep
                           for h in range(keys.shape[1])])
        assert overlap > 0.9, (dtype, overlap)
