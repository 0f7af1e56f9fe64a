"""ThinKV with its whole cache on a CUDA device, from Python (OwningPolicy.to("cuda"), docs/thinkv.md
§9): in lockstep with the same policy on the host, fed the same bf16 K/V and float32 queries, the
device policy gives the same eviction answers, resident positions and bytes, and attention within
1e-4; wrong calls raise kvsift.Error. The placement errors that need no device run everywhere."""

import pytest
import torch

import kvsift
from conftest import cuda_device_available

CONFIG = dict(batch=2, num_layers=2, kv_heads=2, q_heads=8, head_dim=128, budget=100,
              refresh=32, theta1=0.3, theta2=0.7, calibrated_layers=[1], schedule=[16, 8, 4],
              pool_blocks=48)
needs_cuda = pytest.mark.skipif(not cuda_device_available(),
                                reason="needs a CUDA device and libkvsift_c built with CUDA")


def test_methods_without_a_device_path_refuse_placement():
    kivi = kvsift.make_owning_policy("kivi", num_layers=1, kv_heads=1, q_heads=1, head_dim=16,
                                     group_size=16, residual_length=32)
    with pytest.raises(kvsift.Error, match="not a CUDA device"):
        kivi.to("cpu")
    # KIVI has no device path; a library without the CUDA backend has none at all. Either way
    # nothing is allocated and the policy stays on the host.
    with pytest.raises(kvsift.Error, match="host only|without the CUDA backend"):
        kivi.to("cuda")
    assert kivi.device == "cpu"


@needs_cuda
def test_thinkv_on_the_device_follows_the_host():
    g = torch.Generator().manual_seed(5)
    host = kvsift.make_owning_policy("thinkv", **CONFIG)
    dev = kvsift.make_owning_policy("thinkv", **CONFIG).to("cuda")
    assert dev.device.type == "cuda" and host.device == "cpu"
    assert dev.device_memory_bytes() > 0
    B, H, Q, D, L = 2, 2, 8, 128, 2
    for layer in range(L):
        k = torch.randn(B, H, 24, D, generator=g).bfloat16()
        v = torch.randn(B, H, 24, D, generator=g).bfloat16()
        host.prefill(layer, k.float(), v.float())
        dev.prefill(layer, k.cuda(), v.cuda())
    scales = [0.05, 1.8, 4.0, 4.0, 1.8]
    evicted = 0
    for step in range(140):
        for layer in range(L):
            k = torch.randn(B, H, 1, D, generator=g).bfloat16()
            v = torch.randn(B, H, 1, D, generator=g).bfloat16()
            host.append(layer, k.float(), v.float())
            dev.append(layer, k.cuda(), v.cuda())
            q = torch.cat([torch.randn(1, Q, 1, D, generator=g) * scales[(step // 32 + b) % 5]
                           for b in range(B)])
            host.observe(layer=layer, queries=q)
            dev.observe(layer=layer, queries=q.cuda())
            if step % 10 == 9:
                want = host.attention(layer, q)
                got = dev.attention(layer, q.cuda())
                assert got.is_cuda
                torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        e = host.end_step()
        assert dev.end_step() == e
        evicted += e
    assert evicted >= 2
    for layer in range(L):
        for b in range(B):
            for h in range(H):
                assert dev.resident_positions(layer, b, h) == host.resident_positions(layer, b, h)
    # The host keeps one table per (sequence, layer), each with its own copy of the layer's NVFP4
    # global factors (4 bytes per KV head); the device one table per layer for the whole batch.
    assert dev.resident_bytes() == host.resident_bytes() - (B - 1) * L * 4 * H
    assert dev.fullkv_fp16_bytes() == host.fullkv_fp16_bytes()


@needs_cuda
def test_thinkv_on_the_device_refuses_host_tensors_and_late_placement():
    dev = kvsift.make_owning_policy("thinkv", **CONFIG).to("cuda")
    k = torch.zeros(2, 2, 1, 128)
    with pytest.raises(kvsift.Error, match="contiguous device f32/bf16"):
        dev.append(0, k, k)
    with pytest.raises(kvsift.Error, match="already on"):
        dev.to("cuda")
    host = kvsift.make_owning_policy("thinkv", **CONFIG)
    with pytest.raises(kvsift.Error, match="keeps its cache on the host"):
        host.append(0, k.cuda(), k.cuda())
    host.append(0, k, k)
    with pytest.raises(kvsift.Error, match="before the prompt"):
        host.to("cuda")
    assert host.device == "cpu"
