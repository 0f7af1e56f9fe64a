"""The binding on CUDA tensors (skipped without a CUDA device and a CUDA build of libkvsift_c):
zero-copy on the device (same data_ptr, compaction in place), torch's current (non-default)
stream, CUDA compaction bit-identical to CPU compaction on the same plan, CUDA select's kept sets
equal to the CPU reference's up to near-cut swaps, and device mismatches refused."""

import numpy as np
import pytest
import torch

import kvsift
from conftest import cuda_device_available

pytestmark = pytest.mark.skipif(not cuda_device_available(),
                                reason="needs a CUDA device and libkvsift_c built with CUDA")


def random_cache(dtype, B=2, H=4, S=300, D=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, S, D, generator=g).to(dtype)
    v = torch.randn(B, H, S, D, generator=g).to(dtype)
    q = torch.randn(B, 4 * H, 8, D, generator=g).to(dtype)
    return k, v, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_compaction_is_bit_identical_to_cpu(dtype):
    k, v, q = random_cache(dtype)
    lengths = [300, 260]
    policy = kvsift.make_policy("rkv", budget=128, window=8, buffer=16)
    cpu = kvsift.CacheView(k.clone(), v.clone(), lengths)
    plan = policy.select(cpu, q)
    kvsift.compact(cpu, plan)
    kd, vd = k.cuda(), v.cuda()
    ptr = kd.data_ptr()
    dev = kvsift.CacheView(kd, vd, lengths)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the copies above ran on the default stream
    with torch.cuda.stream(stream):
        kvsift.compact(dev, plan)  # the CPU-made plan, on the device copy
    stream.synchronize()
    assert kd.data_ptr() == ptr
    assert list(dev.lengths) == list(cpu.lengths)
    for b in range(2):
        n = int(cpu.lengths[b])
        assert torch.equal(kd[b, :, :n].cpu(), cpu.keys[b, :, :n])
        assert torch.equal(vd[b, :, :n].cpu(), cpu.values[b, :, :n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_select_matches_the_cpu_reference(dtype):
    k, v, q = random_cache(dtype, seed=1)
    policy = kvsift.make_policy("rkv", budget=128, window=8, buffer=16)
    ref = policy.select(kvsift.CacheView(k, v, [300, 300]), q)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev = kvsift.CacheView(k.cuda(), v.cuda(), [300, 300])
        plan = policy.select(dev, q.cuda())
        assert policy.workspace_bytes(dev, q.cuda()) > 0
    differ = sum(len(set(ref.row(b, h).tolist()) ^ set(plan.row(b, h).tolist()))
                 for b in range(2) for h in range(4))
    assert differ <= 2 * 4 * 128 // 50, differ  # near-cut swaps only (fp32 sums in another order)


@pytest.mark.parametrize("batch", [1, 3, 100])
def test_cuda_rkv_compress_step_equals_the_cpu_step(batch):
    # Four layers, one shared mask with left pads: the device step (every layer in one launch
    # sequence; chunks of 256 // batch layers) against the CPU step, bit for bit.
    layers, lengths, pads = 4, [300 - 7 * (b % 3) for b in range(batch)], [b % 4 for b in range(batch)]
    mask = torch.ones(batch, 300, dtype=torch.uint8)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    cpu, dev, queries, dqueries = [], [], [], []
    dmask = mask.cuda()
    for layer in range(layers):
        k, v, q = random_cache(torch.bfloat16, B=batch, H=2, S=300, D=64, seed=layer)
        cpu.append(kvsift.CacheView(k.clone(), v.clone(), lengths, valid_mask=mask))
        dev.append(kvsift.CacheView(k.cuda(), v.cuda(), lengths, valid_mask=dmask))
        queries.append(q[:, :8])
        dqueries.append(q[:, :8].cuda())
    policy = kvsift.make_policy("rkv", budget=128, window=8, buffer=16)
    policy.compress_step(cpu, queries)
    kvsift.make_policy("rkv", budget=128, window=8, buffer=16).compress_step(dev, dqueries)
    torch.cuda.synchronize()
    assert torch.equal(dmask.cpu(), mask)
    for c, d in zip(cpu, dev):
        assert list(d.lengths) == list(c.lengths)
        for b, n in enumerate(c.lengths):
            assert torch.equal(d.keys[b, :, :n].cpu(), c.keys[b, :, :n])
            assert torch.equal(d.values[b, :, :n].cpu(), c.values[b, :, :n])


def test_cuda_rkv_compress_step_leaves_a_nan_sequence_untouched_in_every_layer():
    layers, batch = 3, 3
    dmask = torch.ones(batch, 300, dtype=torch.uint8, device="cuda")
    dev, dq, originals = [], [], []
    for layer in range(layers):
        k, v, q = random_cache(torch.bfloat16, B=batch, H=2, S=300, D=64, seed=layer)
        if layer == 2:
            k[1, 0, 17, 5] = float("nan")
        originals.append(k.clone())
        dev.append(kvsift.CacheView(k.cuda(), v.cuda(), [300] * batch, valid_mask=dmask))
        dq.append(q.cuda())
    policy = kvsift.make_policy("rkv", budget=128, window=8, buffer=16)
    with pytest.raises(kvsift.Error, match=r"NaN scores in sequence\(s\) 1;"):
        policy.compress_step(dev, dq)
    for d, k in zip(dev, originals):
        assert list(d.lengths) == [128, 300, 128]
        # the NaN sequence's rows, bit for bit (NaN != NaN, so compare the bf16 bits)
        assert torch.equal(d.keys[1].cpu().view(torch.int16), k[1].view(torch.int16))


def test_device_mismatches_are_refused():
    k, v, q = random_cache(torch.float16, S=64)
    with pytest.raises(kvsift.Error, match="keys are on cuda:0 but values on cpu"):
        kvsift.CacheView(k.cuda(), v, [64, 64])
    kv = kvsift.CacheView(k.cuda(), v.cuda(), [64, 64])
    with pytest.raises(kvsift.Error, match="window_queries are on cpu but the cache on cuda"):
        kvsift.make_policy("rkv", budget=32, window=8, buffer=8).select(kv, q)
