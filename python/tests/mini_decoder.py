"""A tiny Llama-style decoder that talks to its cache the way transformers 5.x does (Cache.update
per layer; the causal/padding mask from get_seq_length() as the query offset, get_mask_sizes()
as the key length and offset, and the 2-D attention mask sliced at that offset; RoPE from
position_ids; attention modules called with hidden_states and position_embeddings keywords),
plus a DynamicCache-like reference cache and a greedy loop shaped like generate's (the 2-D mask
grows by one column per step, position_ids from its cumsum). It lets CI exercise
kvsift.hf.KVSiftCache's logic without transformers; tests against the real library are in
test_hf_transformers.py."""

import types

import torch
from torch import nn


class Config:
    model_type = "llama"
    _attn_implementation = "eager"

    def __init__(self, layers=2, hidden=32, heads=4, kv_heads=2, vocab=50, q_norm=False):
        self.num_hidden_layers, self.hidden_size = layers, hidden
        self.num_attention_heads, self.num_key_value_heads = heads, kv_heads
        self.head_dim = hidden // heads
        self.vocab_size = vocab
        self.q_norm = q_norm


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n) + 0.1 * torch.randn(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim) if cfg.q_norm else None
        self.recorded_queries = []  # post-RoPE queries of every call (for the tests)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        B, q, _ = hidden_states.shape
        qs = self.q_proj(hidden_states).view(B, q, -1, self.head_dim)
        if self.q_norm is not None:
            qs = self.q_norm(qs)
        qs = qs.transpose(1, 2)
        ks = self.k_proj(hidden_states).view(B, q, -1, self.head_dim).transpose(1, 2)
        vs = self.v_proj(hidden_states).view(B, q, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        qs = qs * cos + rotate_half(qs) * sin
        ks = ks * cos + rotate_half(ks) * sin
        self.recorded_queries.append(qs.detach().clone())
        ks, vs = past_key_values.update(ks, vs, self.layer_idx)
        g = self.heads // self.kv_heads
        ks = ks.repeat_interleave(g, dim=1)
        vs = vs.repeat_interleave(g, dim=1)
        logits = qs @ ks.transpose(-1, -2) / self.head_dim ** 0.5
        logits = logits.masked_fill(~attention_mask, -1e9)  # finite, as transformers does
        out = torch.softmax(logits, dim=-1) @ vs
        return self.o_proj(out.transpose(1, 2).reshape(B, q, -1)), None


class Layer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg, i)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size), nn.SiLU(),
                                 nn.Linear(2 * cfg.hidden_size, cfg.hidden_size))

    def forward(self, x, mask, pe, cache):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(x), position_embeddings=pe,
                              attention_mask=mask, past_key_values=cache)
        x = x + h
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, **kwargs):
        B, q = input_ids.shape
        x = self.embed_tokens(input_ids)
        cache = past_key_values
        q_offset = cache.get_seq_length()
        kv_len, kv_off = cache.get_mask_sizes(q, 0)
        if position_ids is None:
            position_ids = (q_offset + torch.arange(q))[None].expand(B, -1)
        inv = 1.0 / (10000 ** (torch.arange(0, self.cfg.head_dim, 2).float() / self.cfg.head_dim))
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        pe = (emb.cos(), emb.sin())
        q_pos = q_offset + torch.arange(q)
        kv_pos = kv_off + torch.arange(kv_len)
        mask = (kv_pos[None, :] <= q_pos[:, None])[None, None].expand(B, 1, q, kv_len)
        if attention_mask is not None:
            am = attention_mask.bool()
            if am.shape[1] < kv_off + kv_len:
                am = torch.cat([am, am.new_zeros(B, kv_off + kv_len - am.shape[1])], dim=1)
            mask = mask & am[:, kv_off:kv_off + kv_len][:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask, pe, cache)
        return types.SimpleNamespace(last_hidden_state=self.norm(x), past_key_values=cache)


class MiniLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.generation_config = types.SimpleNamespace(num_beams=1, cache_implementation=None)
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def get_decoder(self):
        return self.model

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=past_key_values)
        return self.lm_head(out.last_hidden_state)


class DynamicLikeCache:
    """torch.cat per step, get_seq_length = resident length: transformers' DynamicCache."""

    def __init__(self):
        self.k, self.v = {}, {}

    def update(self, k, v, i):
        if i in self.k:
            self.k[i] = torch.cat([self.k[i], k], dim=2)
            self.v[i] = torch.cat([self.v[i], v], dim=2)
        else:
            self.k[i], self.v[i] = k, v
        return self.k[i], self.v[i]

    def get_seq_length(self, layer_idx=0):
        return self.k[0].shape[2] if 0 in self.k else 0

    def get_mask_sizes(self, q, layer_idx=0):
        return self.get_seq_length() + q, 0


@torch.no_grad()
def greedy(model, input_ids, attention_mask, cache, steps, after_step=None):
    """generate()-shaped greedy decoding: returns [B, steps] new tokens."""
    mask = attention_mask.clone()
    ids = input_ids
    out = []
    for _ in range(steps):
        pos = mask.long().cumsum(-1) - 1
        pos = pos.masked_fill(mask == 0, 1)[:, -ids.shape[1]:]
        logits = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        ids = nxt
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        if after_step is not None:
            after_step()
    return torch.cat(out, dim=1)
