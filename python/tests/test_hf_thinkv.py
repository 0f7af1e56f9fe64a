"""kvsift.hf_thinkv.ThinKVCache inside transformers (skipped without transformers >= 5.5 and a
CUDA device with a CUDA build of libkvsift_c): tiny seeded Llama / Qwen3 models from their
configs, fp32 (TF32 off), greedy, EOS ignored.
- Nothing quantized or evicted (f32 blocks, every step labelled R, a budget above the length):
  ThinKV's attention over its table is the model's own attention, so generate's tokens equal
  DynamicCache's and every step's logits agree within 1e-3.
- R4 E4 T2 with evictions, the cache on the device against the same cache on the host pipeline,
  both fed the same tokens: every step's logits agree within 2e-3 and TBE evicts in the same
  steps (the device pipeline's decisions are the host's).
- The errors: a padded batch, a batch of the wrong size, a second prompt."""

import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from packaging import version  # noqa: E402

if version.parse(transformers.__version__) < version.parse("5.5"):
    pytest.skip("needs transformers >= 5.5, found %s" % transformers.__version__,
                allow_module_level=True)

import kvsift  # noqa: E402
from conftest import cuda_device_available  # noqa: E402
from kvsift.hf_thinkv import ThinKVCache  # noqa: E402
import test_hf_transformers as hf_tests  # noqa: E402
from test_hf_transformers import exact_matmul  # noqa: E402,F401 - autouse: fp32 without TF32

pytestmark = pytest.mark.skipif(not cuda_device_available(),
                                reason="needs a CUDA device and libkvsift_c built with CUDA")


def tiny_model(arch, seed=0):
    return hf_tests.tiny_model(arch, seed=seed, head_dim=64, device="cuda")


def prompt(batch, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, length), generator=g).to("cuda")


# Every step labelled R (a sparsity is < 1), f32 blocks, budget above the length: nothing
# quantized, nothing evicted.
EXACT = dict(theta1=0.0, theta2=1.0, calibrated_layers=[1], budget=4096, refresh=32,
             reasoning="f32", execution="f32", transition="f32", pool_blocks=64)
# R4 E4 T2, a small budget, thresholds that give the tiny model's steps E, R and T labels.
EVICTING = dict(theta1=0.05, theta2=0.2, calibrated_layers=[0, 1], budget=48, refresh=16,
                schedule=[8, 4], pool_blocks=64)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_nothing_evicted_matches_dynamic_cache(arch):
    model = tiny_model(arch)
    ids = prompt(2, 24)
    kw = dict(input_ids=ids, max_new_tokens=40, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    ref = model.generate(past_key_values=transformers.DynamicCache(), **kw)
    with ThinKVCache(model, batch=2, **EXACT) as cache:
        out = cache.generate(model, **kw)
        assert cache.steps == 39 and cache.evicting_steps == 0
        assert cache.policy.device.type == "cuda"
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    # close() gave the model its attention back: a plain generate works again.
    again = model.generate(past_key_values=transformers.DynamicCache(), **kw)
    assert torch.equal(again.sequences, ref.sequences)


@torch.no_grad()
def test_device_cache_follows_the_host_pipeline_in_the_model():
    model = tiny_model("llama", seed=3)
    ids = prompt(2, 20, seed=4)
    dev = ThinKVCache(model, batch=2, **EVICTING)
    host = ThinKVCache(model, batch=2, device="cpu", **EVICTING)
    assert host.policy.device == "cpu" and dev.policy.device.type == "cuda"

    def forward(cache, tokens):
        # Two caches share one model here: point its attention modules at the one in use.
        for attn in cache._attentions:
            attn._kvsift_thinkv = weakref.ref(cache)
        return model(input_ids=tokens, past_key_values=cache, use_cache=True)

    out_d, out_h = forward(dev, ids), forward(host, ids)
    for step in range(120):
        torch.testing.assert_close(out_d.logits[:, -1], out_h.logits[:, -1], rtol=0, atol=2e-3)
        tok = out_d.logits[:, -1].argmax(-1, keepdim=True)
        out_d, out_h = forward(dev, tok), forward(host, tok)
    assert dev.steps == host.steps == 120
    assert dev.evicting_steps == host.evicting_steps
    assert dev.evicting_steps > 0
    for layer in range(2):
        for b in range(2):
            for h in range(2):
                assert (dev.policy.resident_positions(layer, b, h)
                        == host.policy.resident_positions(layer, b, h))
    host.close()
    dev.close()
    assert model.config._attn_implementation == "sdpa"


def test_refusals():
    model = tiny_model("llama")
    with ThinKVCache(model, batch=2, **EXACT) as cache:
        mask = torch.ones(2, 8, dtype=torch.long, device="cuda")
        mask[1, :3] = 0
        with pytest.raises(kvsift.Error, match="padding"):
            cache.generate(model, input_ids=prompt(2, 8), attention_mask=mask, max_new_tokens=2)
        with pytest.raises(kvsift.Error, match="batch = 2"):
            cache.generate(model, input_ids=prompt(3, 8), max_new_tokens=2)
        cache.generate(model, input_ids=prompt(2, 8), max_new_tokens=2)
        with pytest.raises(kvsift.Error, match="prefills once"):
            model(input_ids=prompt(2, 4), past_key_values=cache, use_cache=True)
    with pytest.raises(kvsift.Error, match="kv_heads = 4, but the model has 2"):
        ThinKVCache(model, batch=1, kv_heads=4, **EXACT)
