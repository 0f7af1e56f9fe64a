"""kvsift in HuggingFace `generate` (transformers >= 5.5; Llama, Qwen2, Qwen3):

    from kvsift.hf import KVSiftCache
    cache = KVSiftCache(model, "rkv", budget=1024, buffer=128)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4096)

How it works (docs/python.md):
- Every layer's K/V live in buffers preallocated at the first forward ([batch, kv_heads,
  capacity, head_dim], capacity = max(prompt, budget + buffer)); update() writes the step's K/V
  in place (no torch.cat per step) and returns views of the resident slots.
- A wrapper around every attention module's forward keeps the last `window` hidden states (the
  attention input) and the rotary (cos, sin) of those positions; at compression time they are
  re-projected through the layer's q_proj (and q_norm where the model has one) and rotated, giving
  the post-RoPE window queries kvsift scores with.
- A wrapper around the decoder's forward runs after each step: it feeds the policy what it
  observes (SkipKV: the step's token ids and final-norm hidden states) and, once a sequence
  reaches budget + buffer, plans and compacts every layer in place in one call
  (Policy.compress_step, torch's current stream; on CUDA, R-KV and SkipKV do all layers in one
  call with one wait per step).
- Until a cache first compresses, its slots are exactly DynamicCache's (left pads in the first
  slots, the caller's attention mask untouched), so generation is token-identical. A compaction
  drops a compressed sequence's pads (kvsift's budget counts real tokens) and sequences may then
  hold different lengths; from then on the cache supplies the attention mask itself (the
  decoder's wrapper replaces the 2-D mask with one describing its slots), get_mask_sizes()
  gives the resident length, while get_seq_length() keeps counting the tokens seen, so positions
  (RoPE, the causal mask's query positions) stay those of the full sequence.
What it refuses up front (kvsift.Error): methods that need per-step queries or own their cache
(h2o, thinkv), flash attention with padded rows, beam search (reorder_cache), static or compiled
caches, sliding-window models, and a multi-token step (a new prompt or full input_ids) on a cache
that has compressed.
"""

import functools
import os
import weakref

import numpy as np
import torch

from . import _api, _capi
from ._api import CacheView, make_policy
from ._tensors import error

try:  # transformers >= 5.5
    from transformers import Cache as _HFCache
    from transformers.cache_utils import CacheLayerMixin as _HFLayer
except ImportError:  # pragma: no cover - the module is importable without transformers (docs, CI)
    _HFCache, _HFLayer = object, object

SUPPORTED_METHODS = ("fullkv", "streaming", "snapkv", "rkv", "skipkv")
# Methods whose select() reads window queries (the last `window` post-RoPE queries).
_QUERY_METHODS = ("snapkv", "rkv", "skipkv")
_DEFAULT_WINDOW = 8

# Token ids of the R1 vocabularies (see data/README.md of the repository's shared data):
# SkipKV takes the last id of each delimiter / keyword string; the paragraph-break ids (every
# token whose text contains "\n\n") gate steering.
R1_TOKENS = {
    "r1_qwen": {"delimiters": [198, 624, 340, 271, 382, 692, 1939],
                "keywords": [92014, 14190, 32771],
                "think_start": [151648], "think_end": [151649],
                "paragraph_breaks": "paragraph_break_ids_r1qwen.txt"},
    "r1_llama": {"delimiters": [198, 627, 340, 271, 382, 696, 1980],
                 "keywords": [93114, 14524, 33871],
                 "think_start": [128013], "think_end": [128014],
                 "paragraph_breaks": "paragraph_break_ids_r1llama.txt"},
}
_VOCAB_BY_MODEL_TYPE = {"llama": "r1_llama", "qwen2": "r1_qwen", "qwen3": "r1_qwen"}


def paragraph_break_ids(vocabulary):
    """The ids of `vocabulary` ("r1_qwen" or "r1_llama") whose text contains two newlines."""
    name = R1_TOKENS[vocabulary]["paragraph_breaks"]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", name)) as f:
        return [int(line) for line in f if line.strip()]


def skipkv_token_options(vocabulary):
    """SkipKV's delimiter, keyword and steering-gate ids for an R1 vocabulary."""
    t = R1_TOKENS[vocabulary]
    return {"delimiters": list(t["delimiters"]), "keywords": list(t["keywords"]),
            "steering": {"think_start": list(t["think_start"]), "think_end": list(t["think_end"]),
                         "boundary": paragraph_break_ids(vocabulary)}}


def _randn(shape, generator, device, dtype):
    """Normal samples made on `device` (or on the generator's device, then moved)."""
    device = torch.device(device)
    if generator is not None and generator.device.type != device.type:
        return torch.randn(shape, generator=generator).to(device, dtype)
    return torch.randn(shape, generator=generator, device=device, dtype=dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer(_HFLayer):
    """One decoder layer's slots (a transformers CacheLayerMixin so that the base Cache's helpers
    work); the buffers and their kvsift view are owned by KVSiftCache."""

    is_sliding = False
    is_compileable = False

    # Plain attributes whatever the base class makes of them (views of the resident slots).
    keys = property(lambda self: self._keys, lambda self, v: setattr(self, "_keys", v))
    values = property(lambda self: self._values, lambda self, v: setattr(self, "_values", v))

    def __init__(self):
        self._keys = self._values = None
        if _HFLayer is not object:
            try:
                super().__init__()
            except TypeError:  # a mixin whose constructor takes arguments: not needed here
                pass
        self.keys = self.values = None
        self.is_initialized = False
        self.k_buf = self.v_buf = self.valid = None  # [B, H, C, D], [B, H, C, D], [B, C] uint8
        self.lengths = None                          # [B] int32, the kvsift view's lengths
        self.view = None
        self.hidden = None                           # [B, window, hidden] attention inputs
        self.owner = None                            # weakref to the KVSiftCache
        self.index = 0                               # the layer's index

    # CacheLayerMixin's abstract methods: answered by the owning KVSiftCache (code that reaches
    # for cache.layers[i] directly gets the same answers as the cache).
    def lazy_initialization(self, *args, **kwargs):
        return None

    def _cache(self):
        owner = self.owner() if self.owner is not None else None
        if owner is None:
            raise error("KVSiftCache layer used without its cache")
        return owner

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache().update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self._cache().get_mask_sizes(query_length, self.index)

    def get_seq_length(self, *args, **kwargs):
        return self._cache().get_seq_length(self.index)

    def get_max_cache_shape(self, *args, **kwargs):
        return -1


class _ModelHooks:
    """kvsift's wrappers around one model's decoder forward and attention forwards, installed
    once per model and shared by every KVSiftCache (an instance attribute over the class's
    forward: works with any torch, sees keyword arguments). The decoder wrapper acts when the
    forward's past_key_values is an open KVSiftCache; the attention wrappers feed the cache of the
    forward in progress."""

    ATTR = "_kvsift_hf_hooks"

    @classmethod
    def of(cls, decoder, attentions):
        hooks = decoder.__dict__.get(cls.ATTR)
        if hooks is None:
            hooks = cls(decoder, attentions)
            object.__setattr__(decoder, cls.ATTR, hooks)
        return hooks

    def __init__(self, decoder, attentions):
        self.active = None  # the KVSiftCache of the forward in progress
        self.saved = []     # (module, had its own forward, the forward it had)
        self._wrap(decoder, self._decoder_forward)
        for i, attn in enumerate(attentions):
            self._wrap(attn, functools.partial(self._attention_forward, i))

    def _wrap(self, module, body):
        had_own = "forward" in module.__dict__
        inner = module.forward

        @functools.wraps(inner)  # keeps the signature for code that inspects forward
        def forward(*args, **kwargs):
            return body(inner, args, kwargs)

        module.forward = forward
        self.saved.append((module, had_own, inner))

    def _decoder_forward(self, inner, args, kwargs):
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, KVSiftCache) or cache._closed:
            return inner(*args, **kwargs)
        changed = cache._before_step(args, kwargs)
        if changed is not None:
            args, kwargs = changed
        self.active = cache
        try:
            out = inner(*args, **kwargs)
        except BaseException:
            cache._active = False
            raise
        finally:
            self.active = None
        cache._after_step(out)
        return out

    def _attention_forward(self, i, inner, args, kwargs):
        cache = self.active
        if cache is not None and cache.window > 0:
            cache._capture(i, args, kwargs)
        return inner(*args, **kwargs)

    def uninstall(self, decoder):
        for module, had_own, inner in reversed(self.saved):
            if had_own:
                module.forward = inner
            else:
                module.__dict__.pop("forward", None)
        self.saved = []
        decoder.__dict__.pop(self.ATTR, None)


def uninstall(model):
    """Removes kvsift's wrappers from `model` (they are installed by the first KVSiftCache made
    for it and do nothing for other caches)."""
    decoder, _ = KVSiftCache._find_modules(model)
    hooks = decoder.__dict__.get(_ModelHooks.ATTR)
    if hooks is not None:
        hooks.uninstall(decoder)


# The cache answers every query itself: abstract methods a newer base class may add must not
# make the layer uninstantiable.
_Layer.__abstractmethods__ = frozenset()


class _SeenPositions:
    """What the kvsift caches answer alike (KVSiftCache, hf_thinkv.ThinKVCache): positions are
    the tokens seen per sequence (self._seen), whatever the cache holds, and the generate features
    they do not support. `_who` names the cache in messages."""

    _who = "KVSiftCache"

    def _init_layers(self):
        """One _Layer per decoder layer (self.num_layers), answered by this cache, and the base
        Cache's constructor where it takes them."""
        self.hf_layers = [_Layer() for _ in range(self.num_layers)]
        for i, layer in enumerate(self.hf_layers):
            layer.owner, layer.index = weakref.ref(self), i
        if _HFCache is not object:
            try:
                super().__init__(layers=self.hf_layers)
            except Exception:  # noqa: BLE001 - a Cache whose constructor differs: we answer
                pass           # every method generate calls ourselves
        self.layers = self.hf_layers

    def get_seq_length(self, layer_idx=0, *args, **kwargs):
        """Tokens seen per sequence (pads included), compressed or not: the next position."""
        return self._seen

    def get_query_offset(self, layer_idx=0, *args, **kwargs):
        return self._seen

    def get_max_cache_shape(self, layer_idx=0, *args, **kwargs):
        return -1

    def get_max_length(self):
        return None

    def get_usable_length(self, new_seq_length=0, layer_idx=0):
        return self._seen

    @property
    def seen_tokens(self):
        return self._seen

    @property
    def is_sliding(self):
        return [False] * self.num_layers

    def __len__(self):
        return self.num_layers

    def reorder_cache(self, beam_idx):
        raise error("%s: beam search (reorder_cache) is not supported" % self._who)

    def crop(self, max_length):
        if self._seen > 0 and (max_length < 0 or max_length < self._seen):
            raise error("%s: crop (assisted decoding) is not supported" % self._who)

    def _generate_kwargs(self, kwargs):
        """kwargs for model.generate with this cache, checked up front (beam search, static
        caches, another cache)."""
        if (kwargs.get("num_beams") or 1) > 1:
            raise error("%s: num_beams = %s; beam search reorders the cache (unsupported)"
                        % (self._who, kwargs["num_beams"]))
        if kwargs.get("cache_implementation") not in (None, "dynamic"):
            raise error("%s: cache_implementation = '%s' cannot be combined with kvsift"
                        % (self._who, kwargs["cache_implementation"]))
        if kwargs.get("past_key_values") not in (None, self):
            raise error("%s.generate: past_key_values is another cache" % self._who)
        return dict(kwargs, past_key_values=self)


class KVSiftCache(_SeenPositions, _HFCache):
    """A transformers Cache whose layers are kvsift cache views, compressed in place by `method`
    (SUPPORTED_METHODS) with its config fields as keyword options (make_policy). `capacity`
    (optional) preallocates that many slots per sequence; by default max(prompt, budget + buffer),
    grown when a method never compresses (fullkv). For SkipKV the token ids of the model's R1
    vocabulary (delimiters, keywords, paragraph breaks) and hidden_size are filled in unless given;
    pass vocabulary="r1_qwen" or "r1_llama" to choose explicitly."""

    is_compileable = False

    def __init__(self, model, method="rkv", capacity=None, vocabulary=None, **options):
        if method not in SUPPORTED_METHODS:
            raise error("KVSiftCache: method '%s' is not supported here (supported: %s; h2o "
                        "needs every step's queries; thinkv, kivi and pmkvq own their caches)"
                        % (method, ", ".join(SUPPORTED_METHODS)))
        self._check_model(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        self.num_layers = int(config.num_hidden_layers)
        self._init_layers()
        self.method = method
        if method == "skipkv":
            vocab = vocabulary or _VOCAB_BY_MODEL_TYPE.get(getattr(config, "model_type", ""))
            if vocab is None:
                raise error("KVSiftCache: SkipKV needs the delimiter and keyword ids of the "
                            "model's "
                            "vocabulary: pass vocabulary='r1_qwen' or 'r1_llama', or delimiters=, "
                            "keywords= and steering= yourself")
            for k, v in skipkv_token_options(vocab).items():
                options.setdefault(k, v)
            options.setdefault("hidden_size", int(config.hidden_size))
        self.options = dict(options)
        self.policy = make_policy(method, **options)
        self.needs = self.policy.needs
        # Unset fields take the method's defaults (the registry's default config).
        defaults = {m.name: m.default_config for m in _api.policies()}.get(method, {})
        merged = dict(defaults, **options)
        self.budget = int(merged.get("budget", 0))
        self.buffer = int(merged.get("buffer", 0))
        self.window = int(merged.get("window", _DEFAULT_WINDOW)) if method in _QUERY_METHODS else 0
        self.capacity_hint = capacity
        self.head_dim = int(getattr(config, "head_dim", None)
                            or config.hidden_size // config.num_attention_heads)
        self.attn_impl = str(getattr(config, "_attn_implementation", "") or "")
        self._decoder, self._attentions = self._find_modules(model)
        self._seen = 0            # tokens seen per sequence (pads included): the logical length
        self._lengths = None      # [B] int32 resident slots per sequence (all layers agree)
        self._clean = None        # [B] int32 slots whose valid mask is up to date
        self._compressed = False
        self._active = False      # inside a forward that uses this cache
        self._step = None         # the current step's facts (set by the decoder's wrapper)
        self._ring_pos = 0        # next slot of the window rings
        self._cos = self._sin = None  # [B or 1, window, head_dim] rotary of the window positions
        self._valid = None        # [B, capacity] uint8 pad mask, shared by every layer
        self.pads = None          # [B] left pads of the prompt
        self.compressions = 0     # compression steps so far
        self.compress_events = []  # (start, end) CUDA events of each compression (timing)
        self.record_timing = False
        self._install_hooks()

    # ---- checks ------------------------------------------------------------------------------

    @staticmethod
    def _check_model(model):
        if hasattr(model, "_orig_mod"):
            raise error("KVSiftCache: the model is torch.compile'd; compiled graphs need a static "
                        "cache and kvsift compacts in place: use the uncompiled model")
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            if (getattr(gen, "num_beams", 1) or 1) > 1:
                raise error("KVSiftCache: beam search (generation_config.num_beams = %s) reorders "
                            "the cache; kvsift supports greedy and sampling" % gen.num_beams)
            impl = getattr(gen, "cache_implementation", None)
            if impl not in (None, "dynamic"):
                raise error("KVSiftCache: generation_config.cache_implementation = '%s'; static "
                            "and compiled caches cannot be compacted in place" % impl)
        cfg = model.config
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise error("KVSiftCache: sliding-window attention (config.sliding_window = %s) is "
                        "not supported" % cfg.sliding_window)
        types = set(getattr(cfg, "layer_types", None) or [])
        if types - {"full_attention"}:
            raise error("KVSiftCache: layer types %s are not supported (full attention only)"
                        % sorted(types))

    @staticmethod
    def _find_modules(model):
        decoder = None
        if hasattr(model, "get_decoder"):
            try:
                decoder = model.get_decoder()
            except Exception:  # noqa: BLE001 - some models raise instead of returning None
                decoder = None
        if decoder is None or not hasattr(decoder, "layers"):
            decoder = getattr(model, "model", model)
        layers = getattr(decoder, "layers", None)
        if layers is None:
            raise error("KVSiftCache: cannot find the decoder layers (model.model.layers) of %s"
                        % type(model).__name__)
        attentions = []
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None or not hasattr(attn, "q_proj"):
                raise error("KVSiftCache: layer %d has no self_attn.q_proj (Llama, Qwen2 and Qwen3 "
                            "are supported)" % i)
            attentions.append(attn)
        return decoder, attentions

    def generate(self, model, **kwargs):
        """model.generate(**kwargs, past_key_values=self) after checking kwargs up front (beam
        search, static caches, another cache)."""
        return model.generate(**self._generate_kwargs(kwargs))

    # ---- wrappers ----------------------------------------------------------------------------

    def _install_hooks(self):
        self._hooks = _ModelHooks.of(self._decoder, self._attentions)
        self._closed = False

    def close(self):
        """Detaches this cache from the model: its forwards run as without kvsift (the cache's
        contents stay readable). The model keeps kvsift's thin wrappers, shared by every cache;
        kvsift.hf.uninstall(model) removes them."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- one step ----------------------------------------------------------------------------

    def _before_step(self, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            raise error("KVSiftCache: the forward has neither input_ids nor inputs_embeds")
        batch, q = int(ref.shape[0]), int(ref.shape[1])
        mask = kwargs.get("attention_mask")
        # Once compressed the cache replaces whatever mask it is given (2-D, 4-D or a dict of
        # them) with its own slot mask, below.
        if self._seen == 0:
            if isinstance(mask, dict) or (torch.is_tensor(mask) and mask.dim() != 2):
                mask = None  # a prebuilt mask: the prompt is taken as unpadded
            self._start(batch, q, mask, ref.device)
        else:
            if batch != self.batch:
                raise error("KVSiftCache: batch %d after a prompt of batch %d"
                            % (batch, self.batch))
            if q > 1 and self._compressed:
                raise error("KVSiftCache: a %d-token step on a cache that has compressed (it "
                            "holds %d of %d positions): continuing from a compressed cache with "
                            "full input_ids or a new prompt is not supported; start a new "
                            "KVSiftCache" % (q, int(self._lengths.max()), self._seen))
        uniform = bool((self._lengths == self._lengths[0]).all())
        if not uniform and q > 1:
            raise error("KVSiftCache: a %d-token step with sequences of different lengths" % q)
        step = {"q": q, "ids": ids, "uniform": uniform, "start": int(self._lengths.max())}
        need = step["start"] + q
        for L in self.hf_layers:
            if L.k_buf is not None and need > L.k_buf.shape[2]:
                self._grow(L, need)
        if not uniform:
            step["rows"] = torch.arange(batch, device=self._device)
            step["slots"] = torch.from_numpy(self._lengths.astype(np.int64)).to(self._device)
        self._step = step
        self._active = True
        if self._compressed:
            kwargs["attention_mask"] = self._slot_mask(q, mask)
            return args, kwargs
        return None

    def _start(self, batch, q, mask, device):
        """The prompt: batch, pads (left padding only), device; buffers come with the first K/V."""
        self.batch, self._device = batch, device
        if mask is None:
            valid = torch.ones(batch, q, dtype=torch.uint8, device=device)
        else:
            valid = (mask[:, -q:] != 0).to(torch.uint8)
        pads = (valid == 0).sum(dim=1)
        left = torch.arange(q, device=valid.device)[None, :] >= pads[:, None]
        if not torch.equal(left.to(torch.uint8), valid):
            raise error("KVSiftCache: the attention mask is not left padding (pads must lead "
                        "each row)")
        self.pads = pads.to("cpu").numpy().astype(np.int32)
        if self.pads.any() and self.attn_impl.startswith("flash"):
            raise error("KVSiftCache: %s with padded rows is not supported (use sdpa or eager, or "
                        "unpadded batches)" % self.attn_impl)
        self._prompt_valid = valid
        self._lengths = np.zeros(batch, dtype=np.int32)
        self._clean = np.zeros(batch, dtype=np.int32)

    def _slot_mask(self, q, given):
        """[B, resident + q] mask of the slots after this step's append (q == 1 once compressed):
        1 for each sequence's real resident tokens and its new one, 0 for kept pads and for the
        slots past a shorter sequence's length."""
        L = self.hf_layers[0]
        lens = torch.from_numpy(self._lengths.astype(np.int64)).to(self._device)[:, None]
        clean = torch.from_numpy(self._clean.astype(np.int64)).to(self._device)[:, None]
        vis = int(self._lengths.max()) + q
        ar = torch.arange(vis, device=self._device)[None, :]
        valid = L.valid[:, :vis].to(torch.bool) | (ar >= clean)
        m = (ar < lens + q) & valid
        dtype = given.dtype if torch.is_tensor(given) else torch.long
        return m.to(dtype)

    def _capture(self, i, args, kwargs):
        """Before the attention of layer i: keep the last `window` attention inputs (and, once, the
        rotary of their positions)."""
        h = kwargs.get("hidden_states", args[0] if args else None)
        pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        if h is None or pe is None:
            raise error("KVSiftCache: attention layer %d was called without hidden_states and "
                        "position_embeddings (an unsupported architecture?)" % i)
        L, W, q = self.hf_layers[i], self.window, h.shape[1]
        if L.hidden is None or L.hidden.shape[0] != h.shape[0]:
            L.hidden = torch.zeros(h.shape[0], W, h.shape[2], dtype=h.dtype, device=h.device)
        if i == 0:
            cos, sin = pe
            if self._cos is None or self._cos.shape[0] != cos.shape[0]:
                self._cos = torch.zeros(cos.shape[0], W, cos.shape[-1], dtype=cos.dtype,
                                        device=cos.device)
                self._sin = torch.zeros_like(self._cos)
            self._ring_write(self._cos, cos)
            self._ring_write(self._sin, sin)
        self._ring_write(L.hidden, h)

    def _ring_write(self, ring, x):
        W, q, pos = ring.shape[1], x.shape[1], self._ring_pos
        if q >= W:
            ring.copy_(x[:, q - W:])  # the oldest lands in slot 0: the ring restarts at 0
        elif q == 1:
            ring[:, pos].copy_(x[:, 0])
        else:
            for t in range(q):
                ring[:, (pos + t) % W].copy_(x[:, t])

    def _after_step(self, output):
        self._active = False
        q = self._step["q"]
        if self.window > 0:
            self._ring_pos = 0 if q >= self.window else (self._ring_pos + q) % self.window
        first = self._seen == 0
        self._seen += q
        if not self._step["uniform"]:
            self._lengths += 1
        else:
            self._lengths[:] = self._step["start"] + q
        if self.needs & (_capi.NEEDS_TOKENS | _capi.NEEDS_HIDDEN):
            self._observe(output, first)
        L0 = self.hf_layers[0]
        L0.lengths[:] = self._lengths
        if self.policy.should_compress(L0.view):
            self._compress()
        self._step = None

    def _observe(self, output, first):
        ids = self._step["ids"]
        if ids is None:
            raise error("KVSiftCache: %s observes token ids; generate from input_ids, not "
                        "inputs_embeds" % self.method)
        hidden = None
        if self.needs & _capi.NEEDS_HIDDEN:
            hidden = getattr(output, "last_hidden_state", None)
            if hidden is None and isinstance(output, (tuple, list)):
                hidden = output[0]
        self.policy.observe(token_ids=ids.detach().to("cpu"), last_hidden=hidden,
                            pad_counts=self.pads if first else None, kv=self.hf_layers[0].view)

    # ---- transformers Cache API --------------------------------------------------------------

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Writes this step's K/V ([B, kv_heads, q, head_dim], post-RoPE) into layer `layer_idx`'s
        slots in place and returns views of the resident slots."""
        if not self._active:
            raise error("KVSiftCache.update outside a forward of the model it was created for "
                        "(or after close())")
        L, step = self.hf_layers[layer_idx], self._step
        q = step["q"]
        if L.k_buf is None:
            self._allocate(L, key_states, value_states)
        start = step["start"]
        if step["uniform"]:
            if start + q > L.k_buf.shape[2]:
                self._grow(L, start + q)
            L.k_buf[:, :, start:start + q].copy_(key_states)
            L.v_buf[:, :, start:start + q].copy_(value_states)
            vis = start + q
        else:
            if start + 1 > L.k_buf.shape[2]:
                self._grow(L, start + 1)
            L.k_buf[step["rows"], :, step["slots"]] = key_states[:, :, 0]
            L.v_buf[step["rows"], :, step["slots"]] = value_states[:, :, 0]
            vis = start + 1
        L.keys, L.values = L.k_buf[:, :, :vis], L.v_buf[:, :, :vis]
        return L.keys, L.values

    def _allocate(self, L, k, v):
        B, H, q, D = k.shape
        cap = self.capacity_hint or 0
        cap = max(cap, q + 1, (self.budget + self.buffer + 1) if self.method != "fullkv" else 0)
        if self.method == "fullkv" and not self.capacity_hint:
            cap = max(cap, q + 256)
        L.k_buf = torch.zeros(B, H, cap, D, dtype=k.dtype, device=k.device)
        L.v_buf = torch.zeros(B, H, cap, v.shape[-1], dtype=v.dtype, device=v.device)
        # One pad mask for every layer (it describes the sequences): compress_step compacts it
        # once, and R-KV's device step requires it.
        if self._valid is None or tuple(self._valid.shape) != (B, cap):
            self._valid = torch.ones(B, cap, dtype=torch.uint8, device=k.device)
            self._valid[:, :self._prompt_valid.shape[1]] = self._prompt_valid.to(k.device)
        L.valid = self._valid
        L.lengths = np.zeros(B, dtype=np.int32)
        L.view = CacheView(L.k_buf, L.v_buf, L.lengths, valid_mask=L.valid)
        L.is_initialized = True
        self._clean[:] = self._prompt_valid.shape[1]

    def _grow(self, L, need):
        cap = max(need, 2 * L.k_buf.shape[2])
        for name in ("k_buf", "v_buf"):
            old = getattr(L, name)
            new = torch.zeros(old.shape[0], old.shape[1], cap, old.shape[3], dtype=old.dtype,
                              device=old.device)
            new[:, :, :old.shape[2]].copy_(old)
            setattr(L, name, new)
        if self._valid.shape[1] < cap:  # the first layer to grow grows the shared mask
            valid = torch.ones(self._valid.shape[0], cap, dtype=torch.uint8,
                               device=self._valid.device)
            valid[:, :self._valid.shape[1]].copy_(self._valid)
            self._valid = valid
        L.valid = self._valid
        L.view = CacheView(L.k_buf, L.v_buf, L.lengths, valid_mask=L.valid)

    def get_mask_sizes(self, query_length, layer_idx=0, *args, **kwargs):
        """(kv_length, kv_offset) = (resident slots after this step's append, 0). Before any
        compression that is DynamicCache's answer; after one, the step has one query at position
        seen (get_query_offset), every slot index is below it, and the mask is the cache's own
        [B, kv_length] slot mask, so causality holds and the padding mask lines up."""
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        if self._lengths is None:
            return q, 0
        return int(self._lengths.max()) + q, 0

    @property
    def is_initialized(self):
        return self._lengths is not None and all(L.k_buf is not None for L in self.hf_layers)

    def resident_lengths(self):
        """[B] slots each sequence holds now (per layer they all agree)."""
        return None if self._lengths is None else self._lengths.copy()

    def __getitem__(self, layer_idx):
        L = self.hf_layers[layer_idx]
        return L.keys, L.values

    def __iter__(self):
        for i in range(self.num_layers):
            yield self[i]

    def batch_repeat_interleave(self, repeats):
        if self._seen > 0:
            raise error("KVSiftCache: expanding a filled cache (num_return_sequences / beams) is "
                        "not supported")

    def batch_select_indices(self, indices):
        if self._seen > 0:
            raise error("KVSiftCache: selecting batch rows of a filled cache is not supported")

    def reset(self):
        raise error("KVSiftCache: reset is not supported; create a new KVSiftCache")

    # ---- compression -------------------------------------------------------------------------

    def _window_queries(self, i):
        """[B, q_heads, window, head_dim] post-RoPE queries of the last `window` positions of
        layer i, re-projected from the kept attention inputs."""
        attn, L = self._attentions[i], self.hf_layers[i]
        # The rings' oldest entry is at the next write position: roll it to the front.
        pos = self._ring_pos
        h = torch.roll(L.hidden, -pos, dims=1) if pos else L.hidden
        B, W = h.shape[0], h.shape[1]
        q = attn.q_proj(h).view(B, W, -1, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
        q = q.transpose(1, 2)
        cos, sin = self._cos, self._sin
        if pos:
            cos, sin = torch.roll(cos, -pos, dims=1), torch.roll(sin, -pos, dims=1)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        return q.to(L.k_buf.dtype).contiguous()

    @torch.no_grad()
    def _compress(self):
        timing = self.record_timing and self._device.type == "cuda"
        if timing:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        for L in self.hf_layers:
            L.lengths[:] = self._lengths
        self._refresh_valid(self.hf_layers[0])  # the mask all layers share
        wq = ([self._window_queries(i) for i in range(len(self.hf_layers))]
              if self.window > 0 else None)
        # Every layer in one call: on CUDA, R-KV and SkipKV select and compact all layers in one
        # call and wait once per step (the kept lengths; SkipKV also its kept rows), instead of
        # once per layer.
        self.policy.compress_step([L.view for L in self.hf_layers], wq)
        kept = self.hf_layers[0].lengths.copy()
        for i, L in enumerate(self.hf_layers):
            if not np.array_equal(L.lengths, kept):
                raise error("KVSiftCache: layer %d kept %s tokens but layer 0 kept %s"
                            % (i, list(L.lengths), list(kept)))
        self._lengths = kept.astype(np.int32)
        self._clean = kept.astype(np.int32)
        self._compressed = True
        self.compressions += 1
        for L in self.hf_layers:
            vis = int(kept.max())
            L.keys, L.values = L.k_buf[:, :, :vis], L.v_buf[:, :, :vis]
        if timing:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.compress_events.append((start, end))

    def _refresh_valid(self, L):
        """Slots appended since the last compaction are real tokens."""
        if (self._clean >= self._lengths).all():
            return
        ar = torch.arange(L.valid.shape[1], device=L.valid.device)[None, :]
        clean = torch.from_numpy(self._clean.astype(np.int64)).to(L.valid.device)[:, None]
        lens = torch.from_numpy(self._lengths.astype(np.int64)).to(L.valid.device)[:, None]
        L.valid.masked_fill_((ar >= clean) & (ar < lens), 1)

    def compression_seconds(self):
        """Total GPU time of the compressions recorded with record_timing = True."""
        if not self.compress_events:
            return 0.0
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.compress_events) / 1e3

    # ---- test and benchmark helpers ----------------------------------------------------------

    @torch.no_grad()
    def fill_masked_slots_(self, value=1e4, generator=None):
        """Writes large random values into every slot the attention mask hides (left pads,
        evicted-and-not-reused slots past each sequence's length): a correct mask makes the
        next tokens independent of them."""
        for L in self.hf_layers:
            if L.k_buf is None:
                continue
            B, H, C, D = L.k_buf.shape
            ar = torch.arange(C, device=L.valid.device)[None, :]
            lens = torch.from_numpy(self._lengths.astype(np.int64)).to(L.valid.device)[:, None]
            clean = torch.from_numpy(self._clean.astype(np.int64)).to(L.valid.device)[:, None]
            hidden = (ar >= lens) | ((L.valid == 0) & (ar < clean))
            for buf in (L.k_buf, L.v_buf):
                noise = torch.randn(buf.shape, generator=generator, dtype=torch.float32,
                                    device="cpu").to(buf.device, buf.dtype) * value
                buf.copy_(torch.where(hidden[:, None, :, None], noise, buf))

    @torch.no_grad()
    def fill_synthetic(self, batch, resident, position, dtype, device, kv_heads=None,
                       generator=None):
        """Benchmark helper: the state of a cache that has seen `position` tokens per sequence
        and holds `resident` of them (random post-RoPE K/V, random window inputs), as if reached
        by decoding; the next forward continues at position `position` (pass position_ids). No
        padding. Methods that observe tokens (SkipKV) observe `resident` synthetic tokens (a
        delimiter every 25, random hidden states), so that their sentence tracking matches the
        resident cache; only RoPE positions reflect `position`."""
        kv_heads = kv_heads or self._kv_heads_of_model()
        device = torch.device(device)
        self._start(batch, 1, None, device)
        self._prompt_valid = torch.ones(batch, resident, dtype=torch.uint8, device=device)
        for i, L in enumerate(self.hf_layers):
            shape = (batch, kv_heads, resident, self.head_dim)
            k = _randn(shape, generator, device, dtype)
            v = _randn(shape, generator, device, dtype)
            self._allocate(L, k, v)
            L.k_buf[:, :, :resident].copy_(k)
            L.v_buf[:, :, :resident].copy_(v)
            del k, v
            L.keys, L.values = L.k_buf[:, :, :resident], L.v_buf[:, :, :resident]
            if self.window > 0:
                hs = self._attentions[i].q_proj.in_features
                L.hidden = _randn((batch, self.window, hs), generator, device, dtype)
        if self.window > 0:
            self._cos = torch.ones(1, self.window, self.head_dim, dtype=dtype, device=device)
            self._sin = torch.zeros_like(self._cos)
        self._lengths[:] = resident
        self._clean[:] = resident
        L0 = self.hf_layers[0]
        L0.lengths[:] = resident
        if self.needs & _capi.NEEDS_TOKENS:
            ids = torch.randint(1000, 30000, (batch, resident))
            ids[:, 24::25] = int(self.options.get("delimiters", [198])[0])
            hidden_size = int(self.options.get("hidden_size", 0))
            for s in range(0, resident, 256):
                e = min(resident, s + 256)
                hidden = None
                if self.needs & _capi.NEEDS_HIDDEN:
                    hidden = _randn((batch, e - s, hidden_size), generator, device, dtype)
                self.policy.observe(token_ids=ids[:, s:e], last_hidden=hidden, kv=L0.view)
        self._seen = position
        self._compressed = resident < position

    def _kv_heads_of_model(self):
        attn = self._attentions[0]
        return int(attn.k_proj.out_features // self.head_dim)
