"""ThinKV in HuggingFace `generate` (transformers >= 5.5; Llama, Qwen2, Qwen3):

    from kvsift.hf_thinkv import ThinKVCache
    cache = ThinKVCache(model, batch=8, theta1=0.21, theta2=0.47, calibrated_layers=[3, 9, 14, 20])
    out = cache.generate(model, **inputs, max_new_tokens=4096)

ThinKV owns its cache (typed, paged, quantized blocks; docs/thinkv.md), so unlike KVSiftCache the
model's attention does not read K/V from this cache at all during decoding (docs/python.md):
- update() hands each layer's new K/V to the ThinKV policy (kvsift.make_owning_policy("thinkv"),
  placed on the model's CUDA device, so K/V never leave it; on a CPU model the host pipeline);
  the prompt is prefilled as segment 0 and returned unchanged, so the prompt's own attention is
  the model's usual sdpa.
- An attention function registered with transformers' AttentionInterface ("kvsift_thinkv") runs
  every decode step's attention over ThinKV's paged table, gather-free (the split kernel on the
  device), after giving the L* layers' post-RoPE queries to the classifier; the last layer closes
  the step (TBE: Rule 1 / Rule 2 demotions). Prompt steps fall through to sdpa.
- get_seq_length() counts the tokens seen, so positions (RoPE) stay the full sequence's.
What it refuses up front (kvsift.Error): a batch other than the configured one, padded batches
(attention_mask with zeros), beam search, static or compiled caches, sliding-window models, a
second prompt on a filled cache, and a model whose attention scaling is not 1/sqrt(head_dim)
(ThinKV's softmax scale).
"""

import math
import weakref

import torch

from ._owning import make_owning_policy
from ._tensors import error
from .hf import KVSiftCache, _HFCache, _SeenPositions

ATTENTION_NAME = "kvsift_thinkv"
_registered = False


def _register():
    """Registers the attention function (and sdpa's mask for it) with transformers, once."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    except ImportError:  # pragma: no cover - versions whose masks do not key on the name
        pass

    def thinkv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         **kwargs):
        ref = getattr(module, "_kvsift_thinkv", None)
        cache = ref() if ref is not None else None
        if cache is None or cache._closed or query.shape[2] != 1:
            # The prompt (or a model used without its ThinKV cache): the model's usual sdpa.
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        return cache._decode_attention(module, query, scaling)

    AttentionInterface.register(ATTENTION_NAME, thinkv_attention)
    _registered = True


class ThinKVCache(_SeenPositions, _HFCache):
    """A transformers Cache backed by kvsift's ThinKV policy. `batch` sequences (fixed); the
    ThinKV config fields as keyword options (make_owning_policy("thinkv"); the thresholds theta1,
    theta2 and calibrated_layers have no defaults: kvsift calibrate); the model's geometry
    (num_layers, kv_heads, q_heads, head_dim) is filled in. `device`: where the policy keeps its
    cache (default: the model's device; "cpu" runs the host pipeline)."""

    is_compileable = False
    _who = "ThinKVCache"

    def __init__(self, model, batch, device=None, **options):
        KVSiftCache._check_model(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        self.num_layers = int(config.num_hidden_layers)
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        geometry = {"num_layers": self.num_layers,
                    "kv_heads": int(getattr(config, "num_key_value_heads", None)
                                    or config.num_attention_heads),
                    "q_heads": int(config.num_attention_heads), "head_dim": self.head_dim}
        for k, v in geometry.items():
            if k in options and int(options[k]) != v:
                raise error("ThinKVCache: %s = %s, but the model has %s" % (k, options[k], v))
        self.batch = int(batch)
        self.options = dict(options, batch=self.batch, **geometry)
        self.policy = make_owning_policy("thinkv", **self.options)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "cuda":
            self.policy.to(self.device)
        self._init_layers()
        _, self._attentions = KVSiftCache._find_modules(model)
        for attn in self._attentions:
            attn._kvsift_thinkv = weakref.ref(self)
        _register()
        self._model = weakref.ref(model)
        previous = str(getattr(config, "_attn_implementation", "") or "sdpa")
        if previous == ATTENTION_NAME:  # another ThinKVCache is attached: keep the model's own
            previous = getattr(model, "_kvsift_previous_attention", "sdpa")
        model._kvsift_previous_attention = self._previous_attention = previous
        self._set_attention(model, ATTENTION_NAME)
        self._seen = 0          # tokens appended per sequence (prompt + decode)
        self._closed = False
        self.steps = 0          # decode steps closed (end_step)
        self.evicting_steps = 0  # steps in which TBE evicted something

    @staticmethod
    def _set_attention(model, name):
        if hasattr(model, "set_attn_implementation"):
            try:
                model.set_attn_implementation(name)
                return
            except Exception:  # noqa: BLE001 - an older API: set the config field directly
                pass
        model.config._attn_implementation = name

    def close(self):
        """Detaches the cache and gives the model back its previous attention implementation."""
        if self._closed:
            return
        self._closed = True
        model = self._model()
        if model is not None:
            self._set_attention(model, self._previous_attention)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def generate(self, model, **kwargs):
        """model.generate(**kwargs, past_key_values=self) after checking kwargs up front (beam
        search, static caches, another cache, the batch, padding)."""
        kwargs = self._generate_kwargs(kwargs)
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if ids is not None and int(ids.shape[0]) != self.batch:
            raise error("ThinKVCache: input_ids has %d rows, the cache was made for batch = %d"
                        % (int(ids.shape[0]), self.batch))
        if mask is not None and not bool((mask != 0).all()):
            raise error("ThinKVCache: the attention_mask has padding; ThinKV's pipeline keeps "
                        "every sequence's positions aligned, so pass an unpadded batch")
        return model.generate(**kwargs)

    # ---- the cache interface -----------------------------------------------------------------

    def _kv(self, t):
        """K/V as the policy takes them: contiguous CUDA f32/bf16, or host f32."""
        if self.device.type == "cuda":
            t = t if t.dtype in (torch.float32, torch.bfloat16) else t.float()
            return t.contiguous()
        return t.detach().float().cpu().contiguous()

    @torch.no_grad()
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Hands the step's K/V ([batch, kv_heads, n, head_dim], post-RoPE) to ThinKV. A prompt
        (n > 1) is prefilled and returned for the prompt's own attention; a decode token (n = 1)
        is appended and the attention function reads ThinKV's table instead."""
        if self._closed:
            raise error("ThinKVCache: the cache was closed")
        B, _, n, _ = key_states.shape
        if B != self.batch:
            raise error("ThinKVCache: a step of batch %d, the cache was made for batch = %d"
                        % (B, self.batch))
        last = layer_idx == self.num_layers - 1
        if n > 1:
            if self._seen > 0:
                raise error("ThinKVCache: a %d-token step on a cache that already holds %d "
                            "tokens (a new prompt or full input_ids); ThinKV prefills once"
                            % (n, self._seen))
            self.policy.prefill(layer_idx, self._kv(key_states), self._kv(value_states))
            if last:
                self._seen = n
            return key_states, value_states
        self.policy.append(layer_idx, self._kv(key_states), self._kv(value_states))
        if last:
            self._seen += 1
        return key_states, value_states

    def _decode_attention(self, module, query, scaling):
        """Attention of one decode step of one layer over ThinKV's table. query [batch, q_heads,
        1, head_dim] post-RoPE; returns ([batch, 1, q_heads, head_dim], None), as transformers'
        attention functions do."""
        if scaling is not None and abs(scaling * math.sqrt(self.head_dim) - 1.0) > 1e-6:
            raise error("ThinKVCache: the model's attention scaling %s is not 1/sqrt(head_dim) "
                        "= %s, ThinKV's softmax scale" % (scaling, 1.0 / math.sqrt(self.head_dim)))
        layer = int(module.layer_idx)
        q = query.detach().float().contiguous()
        if self.device.type != "cuda":
            q = q.cpu()
        self.policy.observe(layer=layer, queries=q)
        out = self.policy.attention(layer, q)
        if layer == self.num_layers - 1:
            self.evicting_steps += bool(self.policy.end_step())
            self.steps += 1
        return out.to(device=query.device, dtype=query.dtype).transpose(1, 2).contiguous(), None

    def get_mask_sizes(self, query_length, layer_idx=0, *args, **kwargs):
        """(kv_length, kv_offset): the prompt step's dense mask over its own tokens; decode steps'
        masks are built but not read (ThinKV attends over what it holds)."""
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self._seen + q, 0

    @property
    def is_initialized(self):
        return self._seen > 0

    def batch_repeat_interleave(self, repeats):
        if self._seen > 0 or repeats != 1:
            raise error("ThinKVCache: expanding the batch (num_return_sequences / beams) is not "
                        "supported; the batch is fixed at construction")

    def batch_select_indices(self, indices):
        raise error("ThinKVCache: selecting batch rows is not supported")

    def reset(self):
        raise error("ThinKVCache: reset is not supported; create a new ThinKVCache")

    # ---- benchmarks ----------------------------------------------------------------------------

    @torch.no_grad()
    def fill_synthetic(self, resident, position, dtype=torch.bfloat16, generator=None):
        """Benchmark helper: `resident` random post-RoPE K/V per sequence prefilled into every
        layer (ThinKV's protected segment 0) and the position counter set to `position`, so the
        next forward decodes at position `position` (pass position_ids) over a cache holding
        `resident` tokens. Only RoPE positions reflect `position`: nothing has been demoted."""
        if self._seen > 0:
            raise error("ThinKVCache.fill_synthetic: the cache already holds tokens")
        if not 0 < resident <= position:
            raise error("ThinKVCache.fill_synthetic: need 0 < resident (%d) <= position (%d)"
                        % (resident, position))
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        H = int(self.options["kv_heads"])
        for layer in range(self.num_layers):
            shape = (self.batch, H, resident, self.head_dim)
            k = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            v = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            self.policy.prefill(layer, self._kv(k.to(dtype)), self._kv(v.to(dtype)))
            del k, v
        self._seen = int(position)

    # ---- memory ------------------------------------------------------------------------------

    def resident_bytes(self):
        """Bytes ThinKV's storage holds (codes, scales, metadata, staging), all layers."""
        return self.policy.resident_bytes()

    def fullkv_fp16_bytes(self):
        return self.policy.fullkv_fp16_bytes()
