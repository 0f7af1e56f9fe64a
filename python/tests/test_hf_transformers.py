"""kvsift.hf.KVSiftCache inside transformers' generate (skipped without transformers >= 5.5): tiny
seeded Llama / Qwen2 / Qwen3 models from their configs, greedy decoding with EOS ignored, on CUDA
when available (fp32, TF32 off) else CPU:
- no trigger -> tokens identical to DynamicCache;
- keep-everything plans through the compressed path -> identical tokens;
- a left-padded batch is invariant to large random values written into the slots the mask hides
  after every compaction (eager and sdpa);
- an unpadded row of a batch equals its solo run;
- resident lengths stay within [budget, budget + buffer) once compressed;
- the re-projected window queries equal the model's own (q_proj output, q_norm, HF's rotary) and
  the kept slots equal a direct kvsift select on the captured K/Q."""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from packaging import version  # noqa: E402

if version.parse(transformers.__version__) < version.parse("5.5"):
    pytest.skip("needs transformers >= 5.5, found %s" % transformers.__version__,
                allow_module_level=True)

import kvsift  # noqa: E402
import kvsift.hf as hf  # noqa: E402
from test_hf_logic import KeepEverything  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARCHS = ["llama", "qwen2", "qwen3"]


def tiny_model(arch, attn="sdpa", seed=0, head_dim=16, device=DEVICE):
    """A seeded 2-layer model, 4 query / 2 KV heads of head_dim, hidden 4 * head_dim, fp32."""
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    cfg = cls[0](vocab_size=256, hidden_size=4 * head_dim, intermediate_size=8 * head_dim,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=head_dim, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model = model.to(device, torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(autouse=True)
def exact_matmul():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def prompts(batch, length, pads=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def generate(model, ids, mask, cache, n):
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                         max_new_tokens=n, do_sample=False)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_trigger_matches_dynamic_cache(arch, attn):
    model = tiny_model(arch, attn)
    ids, mask = prompts(2, 24, pads=(0, 5))
    ref = generate(model, ids, mask, transformers.DynamicCache(), 40)
    with hf.KVSiftCache(model, "rkv", budget=1024, buffer=128) as cache:
        out = generate(model, ids, mask, cache, 40)
        assert cache.compressions == 0
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_everything_plans_match_dynamic_cache(arch):
    model = tiny_model(arch, "sdpa", seed=3)
    ids, mask = prompts(3, 20, pads=(0, 6, 11), seed=2)
    ref = generate(model, ids, mask, transformers.DynamicCache(), 30)
    with hf.KVSiftCache(model, "rkv", budget=1024, buffer=128) as cache:
        cache.policy = KeepEverything(cache.policy)
        out = generate(model, ids, mask, cache, 30)
        assert cache.compressions >= 29
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", ["rkv", "skipkv"])
def test_padded_batch_is_invariant_to_hidden_slots(arch, attn, method):
    model = tiny_model(arch, attn, seed=4)
    ids, mask = prompts(3, 40, pads=(0, 9, 23), seed=5)
    runs = []
    for noisy in (False, True):
        cache = hf.KVSiftCache(model, method, budget=32, window=8, buffer=16,
                               **({"vocabulary": "r1_qwen"} if method == "skipkv" else {}))
        g = torch.Generator().manual_seed(7)
        state = {"n": 0}
        original = cache._compress

        def compress(cache=cache, noisy=noisy, g=g, original=original):
            original()
            if noisy:
                cache.fill_masked_slots_(1e4, generator=g)

        cache._compress = compress
        runs.append(generate(model, ids, mask, cache, 60))
        assert cache.compressions >= 3
        cache.close()
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_unpadded_row_equals_its_solo_run(arch):
    model = tiny_model(arch, "sdpa", seed=6)
    ids, mask = prompts(2, 30, seed=8)
    with hf.KVSiftCache(model, "rkv", budget=32, window=8, buffer=16) as cache:
        both = generate(model, ids, mask, cache, 60)
    for b in range(2):
        with hf.KVSiftCache(model, "rkv", budget=32, window=8, buffer=16) as cache:
            solo = generate(model, ids[b:b + 1], mask[b:b + 1], cache, 60)
        assert torch.equal(both[b:b + 1], solo)


@pytest.mark.parametrize("method", ["rkv", "skipkv", "streaming"])
def test_lengths_stay_within_budget_and_buffer(method):
    model = tiny_model("llama", "sdpa", seed=9)
    ids, mask = prompts(2, 20, seed=10)
    budget, buffer = 48, 16
    opts = {"vocabulary": "r1_llama"} if method == "skipkv" else {}
    if method != "streaming":
        opts["window"] = 8
    cache = hf.KVSiftCache(model, method, budget=budget, buffer=buffer, **opts)
    seen = []
    original = cache._after_step

    def after(output, original=original):
        original(output)
        seen.append(cache.resident_lengths().copy())

    cache._after_step = after
    generate(model, ids, mask, cache, 150)
    assert cache.compressions >= 5
    assert cache.get_seq_length() == 20 + 149
    started = False
    for lens in seen:
        started = started or lens.max() >= budget
        if started:
            assert budget <= lens.min() and lens.max() < budget + buffer, lens
    cache.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_window_queries_and_kept_slots_match_a_direct_select(arch):
    model = tiny_model(arch, "sdpa", seed=11)
    ids, mask = prompts(2, 12, seed=12)
    W, budget, buffer = 8, 32, 16
    decoder = model.get_decoder()
    q_out = {i: [] for i in range(len(decoder.layers))}
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, inp, out, i=i: q_out[i].append(out.detach().clone()))
        for i, layer in enumerate(decoder.layers)]
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    cache = hf.KVSiftCache(model, "rkv", budget=budget, window=W, buffer=buffer)
    checked = {"n": 0}
    original = cache._compress

    def compress():
        n_seen = cache.get_seq_length()
        pos = torch.arange(n_seen - W, n_seen, device=DEVICE)[None]
        snaps = []
        for i, L in enumerate(cache.hf_layers):
            attn = decoder.layers[i].self_attn
            raw = torch.cat(q_out[i], dim=1)[:, -W:]  # [B, W, q_heads * head_dim]
            q = raw.reshape(2, W, -1, attn.head_dim)
            if getattr(attn, "q_norm", None) is not None:
                q = attn.q_norm(q)
            q = q.transpose(1, 2)
            cos, sin = decoder.rotary_emb(q, pos)
            q, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
            ours = cache._window_queries(i)
            assert torch.allclose(ours, q, atol=1e-5, rtol=1e-4)
            n = int(cache.resident_lengths().max())
            # The selection is checked on the queries the cache captured (a GEMM over W rows may
            # round differently from the model's over the whole step, which could swap near-cut
            # tokens); their closeness to the model's own is checked just above.
            snaps.append((L.k_buf[:, :, :n].clone(), L.v_buf[:, :, :n].clone(), ours))
        lengths = cache.resident_lengths()
        original()
        for i, (k, v, q) in enumerate(snaps):
            kv = kvsift.CacheView(k.clone(), v.clone(), lengths.copy())
            plan = kvsift.make_policy("rkv", budget=budget, window=W, buffer=buffer).select(kv, q)
            L = cache.hf_layers[i]
            for b in range(2):
                for h in range(k.shape[1]):
                    slots = torch.from_numpy(plan.row(b, h).astype(np.int64)).to(k.device)
                    assert torch.equal(L.k_buf[b, h, :len(slots)], k[b, h, slots])
                    assert torch.equal(L.v_buf[b, h, :len(slots)], v[b, h, slots])
        checked["n"] += 1

    cache._compress = compress
    generate(model, ids, mask, cache, 80)
    for h in hooks:
        h.remove()
    cache.close()
    assert checked["n"] >= 3


def test_up_front_errors_in_generate():
    model = tiny_model("llama", "sdpa")
    ids, mask = prompts(1, 16)
    with hf.KVSiftCache(model, "rkv", budget=32, window=8, buffer=8) as cache:
        with pytest.raises(kvsift.Error, match="beam search"):
            cache.generate(model, input_ids=ids, attention_mask=mask, num_beams=2,
                           max_new_tokens=4)
        with pytest.raises(kvsift.Error, match="beam search"):
            cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(kvsift.Error, match="h2o"):
        hf.KVSiftCache(model, "h2o")
    with hf.KVSiftCache(model, "rkv", budget=16, window=8, buffer=8) as cache:
        ids, mask = prompts(1, 40)
        generate(model, ids, mask, cache, 4)
        assert cache.compressions >= 1
        full = torch.cat([ids, ids[:, :4]], dim=1)
        with pytest.raises(kvsift.Error, match="continuing from a compressed cache"):
            model(input_ids=full[:, -10:], past_key_values=cache)
