#!/usr/bin/env python3
"""One R-KV compression step (score, select, compact) on the GPU: kvsift vs. plain PyTorch.

The PyTorch side restates docs/algorithms.md §1.1-§1.3 the way the R-KV reference code computes it: the
full S x S cosine matrix of the keys, softmaxes, topk and a gather for the compaction. The kvsift
side is the "rkv" policy of the C API (libkvsift_c, through the ctypes declarations in
python/kvsift/_capi.py) on the CUDA backend, running on the same tensors and the same stream, as an
engine calls it: kvsift_policy_select (which downloads the plan: one stream wait) then
kvsift_compact, once per layer.

Shapes are R1-Llama-8B attention: 32 query / 8 KV heads, head_dim 128, bf16. A step runs at the
decode trigger, S = budget + buffer tokens (§1.3), with the W = 8 observation-window queries.
Grid: --batches x --budgets x --keys (defaults 1, 8, 32, 64 x 1024, 2048 x random, structured; the
issue's full grid adds batch 128 and budget 4096, see the usage lines below):
  random      i.i.d. N(0, 1): no near-duplicates, kvsift's redundancy search never exits early
              (its worst case);
  structured  per (sequence, KV head) a shared direction a*g, g ~ N(0, I), a ~ U[0.5, 3], plus
              N(0, 1) noise per element, and 20 % planted near-duplicates (an earlier
              non-duplicate row + 0.1 * N(0, 1), cosine > 0.99), as real keys have (no RoPE): the
              same parameters as bench/gpu_bench_rkv's generator (bench/gpu_rkv_inputs.hpp);
  clustered   (older) every key + 2 * one direction per KV head.

Timing: torch.cuda.Event pairs, median of --reps (default: 20, 10 or 5 by input size) after
--warmup, every rep on the next input set of a pool large enough to dwarf the L2 cache (so no rep
finds its inputs cached). kvsift compacts in place, so before each of its reps the keys are
restored from a copy made with them and L2 is flushed, both untimed (key_restorer); the one-call
step and the 32 per-layer calls run on the same 32 layers of inputs. Floors, measured in the same
run:
  HBM floor per layer = 2 B x (B*Hkv*S*D keys read + B*Hq*W*D queries read + B*Hkv*budget*D kept
    values read + 2*B*Hkv*budget*D kept keys and values written) / device-to-device copy
    bandwidth (the same floor as gpu_bench_rkv);
  compute floor per layer = B*Hkv * S(S-1)/2 * D * 2 FLOP (the symmetric near-duplicate search
    without early exit) / the bf16 torch.matmul peak (8192^3, cuBLAS).
The PyTorch formulation needs ~16 B*Hkv*S^2 bytes (its S x S matrices); configurations where that
does not fit in free device memory report it as n/a.

Before timing, a small case and one full-size case check that both sides keep the same token sets
(differences allowed only for near-ties at the cut) and that kvsift's in-place compaction equals a
gather of the kept rows: random and clustered keys decide, structured keys are reported (cosines
near the threshold can move a row's last match between two fp32 orderings; see PARITY_DECISIVE).

  python3 bench/torch_rkv.py --lib build/src/c_api/libkvsift_c.so --out $OUT/rkv_bench.md
  python3 bench/torch_rkv.py --lib ... --batches 1,64 --budgets 1024 --keys structured  # minutes
  python3 bench/torch_rkv.py --lib ... --batches 1,8,32,64,128 --budgets 1024,2048,4096  # full
  python3 bench/torch_rkv.py --self-test [--lib ...]   # pure-logic checks, no torch or GPU needed
"""

import argparse
import ctypes
import math
import os
import statistics
import sys

# The C API's ctypes declarations live in the Python package (python/kvsift/_capi.py); this
# benchmark drives them directly, with the library given by --lib.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from kvsift import _capi as kvsift_c  # noqa: E402

# R1-Llama-8B attention.
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BF16_BYTES = 2
POOL_TARGET_BYTES = 512 << 20  # input pool per config: ~10x an H200's L2 cache
POOL_MIN, POOL_MAX = 4, 32
# The structured keys (same parameters as bench/gpu_rkv_inputs.hpp's StructuredKeys).
STRUCTURED_MAG = (0.5, 3.0)  # a ~ U[lo, hi] per (sequence, KV head)
STRUCTURED_DUP_FRACTION = 0.2
STRUCTURED_DUP_NOISE = 0.1
KEY_KINDS = ("random", "structured", "clustered")
MATMUL_PEAK_N = 8192


# ---------------------------------------------------------------------------------------------
# kvsift through its C API (python/kvsift/_capi.py)
# ---------------------------------------------------------------------------------------------
KvsiftError = kvsift_c.KvsiftError


def rkv_config(budget, window, buffer, mix_lambda, threshold):
    """The "rkv" policy's JSON config (fields of kvsift::RKVConfig; the rest at their §4
    defaults)."""
    return {"budget": budget, "window": window, "buffer": buffer, "mix_lambda": mix_lambda,
            "threshold": threshold}


# ---------------------------------------------------------------------------------------------
# Pure helpers (no torch)
# ---------------------------------------------------------------------------------------------
def layer_floor_bytes(batch, budget, buffer, window):
    """HBM bytes one layer must move at least (gpu_bench_rkv's floor): every key read once (the
    search needs them all), the window queries read, the kept value rows read, the kept key and
    value rows written (every kept row counted as moved: evictions are spread through the
    sequence, so nearly all kept rows change place; kept keys were already read for the search)."""
    seq = budget + buffer
    read_k = batch * KV_HEADS * seq * HEAD_DIM * BF16_BYTES
    read_q = batch * Q_HEADS * window * HEAD_DIM * BF16_BYTES
    read_v_kept = batch * KV_HEADS * budget * HEAD_DIM * BF16_BYTES
    write_kv = 2 * batch * KV_HEADS * budget * HEAD_DIM * BF16_BYTES
    return read_k + read_q + read_v_kept + write_kv


def layer_search_flop(batch, seq):
    """Worst-case FLOPs of one layer's symmetric near-duplicate search (no early exit): each pair
    i < j once, S(S-1)/2 dot products of D multiply-adds per (sequence, KV head)."""
    return batch * KV_HEADS * (seq * (seq - 1) // 2) * HEAD_DIM * 2


def torch_formulation_bytes(batch, seq):
    """Rough peak device memory of rkv_scores_torch: its S x S fp32 cosines, the int32 match
    indices, the comparison mask and a temporary (~16 bytes per entry), plus fp32 key copies."""
    return 16 * batch * KV_HEADS * seq * seq + 16 * batch * KV_HEADS * seq * HEAD_DIM


def reps_for(set_bytes, requested):
    """--reps when given, else fewer repetitions for larger inputs (the full grid stays short)."""
    if requested:
        return requested
    return 20 if set_bytes <= (256 << 20) else 10 if set_bytes <= (2 << 30) else 5


def input_set_bytes(batch, seq, window):
    return (2 * batch * KV_HEADS * seq + batch * Q_HEADS * window) * HEAD_DIM * BF16_BYTES


def pool_size(set_bytes):
    """Enough distinct input sets that a pass over the pool cannot live in L2."""
    return max(POOL_MIN, min(POOL_MAX, -(-POOL_TARGET_BYTES // max(set_bytes, 1))))


def compare_kept_sets(kv_rows, ref_rows, ref_scores, n_keep, rel_tol):
    """Compares kept-slot rows of kvsift (kv_rows, -1 = unused) with the reference's (ref_rows).

    A token kept by one side only is a near-cut tie when its reference score lies within
    rel_tol * max|score| of the cut (the n_keep-th largest score of its row); anything else, a
    window token, or a row of the wrong size is a hard mismatch. Returns a summary dict.
    """
    out = {"rows": len(ref_rows), "rows_differing": 0, "tokens_differing": 0, "hard": []}
    for r, (kv_row, ref_row, scores) in enumerate(zip(kv_rows, ref_rows, ref_scores)):
        kv_set = {s for s in kv_row if s >= 0}
        ref_set = set(ref_row)
        if len(kv_set) != len(kv_row) - list(kv_row).count(-1) or len(kv_set) != len(ref_set):
            out["hard"].append((r, "size %d vs %d" % (len(kv_set), len(ref_set))))
            continue
        diff = kv_set ^ ref_set
        if not diff:
            continue
        out["rows_differing"] += 1
        out["tokens_differing"] += len(diff)
        cut = sorted(scores, reverse=True)[n_keep - 1]
        scale = max(abs(x) for x in scores) or 1.0
        for j in sorted(diff):
            if j >= len(scores):
                out["hard"].append((r, "window token %d differs" % j))
            elif abs(scores[j] - cut) > rel_tol * scale:
                out["hard"].append((r, "token %d score %.9g vs cut %.9g" % (j, scores[j], cut)))
    return out


def _cell(x, fmt):
    return fmt % x if x is not None else "n/a"


def format_table(rows, layers=32):
    """Markdown table of the measured rows (dicts), one line per (keys, batch, budget)."""
    head = ("| keys | batch | budget | S | kvsift ms/layer | kvsift score+select ms"
            " | kvsift %d-layer step ms (1 call) | %d per-layer calls ms | HBM floor ms/layer"
            " | layer ÷ HBM floor | step ÷ HBM floor | compute floor ms/layer"
            " | layer ÷ compute floor | PyTorch ms/layer | PyTorch ÷ kvsift |" % (layers, layers))
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        torch_ms = r.get("torch_ms")
        step_layer = r["step_ms"] / layers if r.get("step_ms") is not None else None
        lines.append(
            "| %s | %d | %d | %d | %.3f | %.3f | %s | %s | %.4f | %.2fx | %s | %.4f | %.2fx | %s "
            "| %s |"
            % (r.get("keys", "random"), r["batch"], r["budget"], r["seq"], r["kv_ms"], r["sel_ms"],
               _cell(r.get("step_ms"), "%.3f"), _cell(r.get("calls_ms"), "%.3f"), r["floor_ms"],
               r["kv_ms"] / r["floor_ms"],
               _cell(step_layer / r["floor_ms"] if step_layer is not None else None, "%.2fx"),
               r["compute_ms"], r["kv_ms"] / r["compute_ms"],
               "%.3f" % torch_ms if torch_ms is not None else r.get("torch_note", "n/a"),
               "%.1fx" % (torch_ms / r["kv_ms"]) if torch_ms is not None else "n/a"))
    return "\n".join(lines)


def target_lines(rows, layers):
    """The issue's targets, checked against the measured rows."""
    out = []
    for r in rows:
        keys = r.get("keys", "random")
        if r["batch"] == 64 and r["budget"] == 1024:
            limit = 2.0 if keys == "structured" else 3.0
            ratio = r["kv_ms"] / r["floor_ms"]
            out.append("- batch 64 / budget 1024, %s keys: %.2fx the HBM floor per layer "
                       "(target <= %.0fx): %s" % (keys, ratio, limit,
                                                  "PASS" if ratio <= limit else "FAIL"))
            if r.get("step_ms") is not None:
                sr = r["step_ms"] / layers / r["floor_ms"]
                out.append("- batch 64 / budget 1024, %s keys: %d-layer step %.2fx the HBM floor "
                           "(target <= %.0fx): %s" % (keys, layers, sr, limit,
                                                      "PASS" if sr <= limit else "FAIL"))
            if r.get("torch_ms") is not None:
                sp = r["torch_ms"] / r["kv_ms"]
                out.append("- batch 64 / budget 1024, %s keys: %.1fx faster than PyTorch "
                           "(target >= 40x): %s" % (keys, sp, "PASS" if sp >= 40.0 else "FAIL"))
        if r["batch"] == 1 and r.get("step_ms") is not None:
            out.append("- batch 1 / budget %d, %s keys: %d-layer step %.3f ms (target < 0.3 ms): %s"
                       % (r["budget"], keys, layers, r["step_ms"],
                          "PASS" if r["step_ms"] < 0.3 else "FAIL"))
    return out


def parse_int_list(text):
    return [int(x) for x in text.replace(",", " ").split()]


def parse_keys(text):
    kinds = [x for x in text.replace(",", " ").split()]
    bad = [x for x in kinds if x not in KEY_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError("--keys takes %s, got %r" % (", ".join(KEY_KINDS), text))
    return kinds


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", help="path to libkvsift_c.so (the C API, built with CUDA)")
    p.add_argument("--out", help="write the markdown table here")
    # Defaults: the grid scripts/gpu_check.sh can afford (240 s); the full grid is
    # --batches 1,8,32,64,128 --budgets 1024,2048,4096.
    p.add_argument("--batches", type=parse_int_list, default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=parse_int_list, default=[1024, 2048])
    p.add_argument("--reps", type=int, default=0,
                   help="timed repetitions (default: 20, 10 or 5 by input size)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--mix-lambda", type=float, default=0.1)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--keys", type=parse_keys, default=["random", "structured"],
                   help="comma-separated: random (no near-duplicates: kvsift's redundancy search "
                        "scans every row to the end, its worst case), structured (a shared "
                        "direction per head plus 20%% planted near-duplicates, as real keys), "
                        "clustered (every key has near-duplicates)")
    p.add_argument("--skip-torch", action="store_true", help="time kvsift only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--self-test", action="store_true", help="pure-logic checks, no GPU")
    a = p.parse_args(argv)
    if not a.self_test and not a.lib:
        p.error("--lib is required")
    if a.reps and a.reps < 3:
        p.error("--reps must be >= 3 (got %d)" % a.reps)
    if a.buffer < a.window:
        p.error("--buffer (%d) must be >= --window (%d), docs/algorithms.md §1.3"
                % (a.buffer, a.window))
    return a


# ---------------------------------------------------------------------------------------------
# PyTorch formulation of docs/algorithms.md §1.1-§1.3 (plain torch ops, as the R-KV reference)
# ---------------------------------------------------------------------------------------------
def rkv_scores_torch(k, q, window, kernel=7, mix_lambda=0.1, threshold=0.5):
    """Joint R-KV scores [B, Hkv, S - W] (fp32).

    k: keys [B, Hkv, S, D]; q: window queries [B, Hq, W, D]; any float dtype, math in fp32.
    """
    import torch
    import torch.nn.functional as F

    b, hkv, s, d = k.shape
    g = q.shape[1] // hkv
    n = s - window
    kf = k.float()
    # §1.1 window importance: GQA max over the group's raw logits, softmax over j < S - W only,
    # mean over the window, max-pool (kernel 7, stride 1; -inf padding = max over what exists).
    qf = q.float().view(b, hkv, g, window, d)
    logits = torch.einsum("bhgwd,bhjd->bhgwj", qf, kf[:, :, :n]) / math.sqrt(d)
    probs = torch.softmax(logits.amax(dim=2), dim=-1)  # [B, Hkv, W, n]
    attn = probs.mean(dim=2)  # [B, Hkv, n]
    importance = F.max_pool1d(attn.reshape(b * hkv, 1, n), kernel, stride=1,
                              padding=kernel // 2).view(b, hkv, n)
    # §1.2 key redundancy: the full cosine matrix, diagonal zeroed, each row's last near-duplicate
    # spared (sound mode: rows without a match spare nothing), column means, softmax over all S.
    unit = kf / (kf.norm(dim=-1, keepdim=True) + 1e-8)
    cos = unit @ unit.transpose(-1, -2)  # [B, Hkv, S, S]
    cos.diagonal(dim1=-2, dim2=-1).zero_()
    cols = torch.arange(s, device=k.device, dtype=torch.int32)
    last = torch.where(cos > threshold, cols, -1).amax(dim=-1, keepdim=True)  # [B, Hkv, S, 1]
    spared = cos.gather(-1, last.clamp(min=0).long())
    cos.scatter_(-1, last.clamp(min=0).long(), torch.where(last >= 0, 0.0, spared))
    mean_cos = cos.sum(dim=-2) / s  # [B, Hkv, S]
    redundancy = torch.softmax(mean_cos, dim=-1)[..., :n]
    # §1.3 joint score.
    return mix_lambda * importance - (1.0 - mix_lambda) * redundancy


def rkv_select_torch(scores, seq, budget, window):
    """Kept slots [B, Hkv, budget] (int64, ascending): top (budget - W) scores plus the window."""
    import torch

    top = torch.topk(scores, budget - window, dim=-1).indices.sort(dim=-1).values
    win = torch.arange(seq - window, seq, device=scores.device).expand(*top.shape[:2], window)
    return torch.cat([top, win], dim=-1)


def rkv_step_torch(k, v, q, budget, window, mix_lambda, threshold):
    """One layer's step: scores, selection, and the compacted K, V [B, Hkv, budget, D] by gather."""
    scores = rkv_scores_torch(k, q, window, mix_lambda=mix_lambda, threshold=threshold)
    keep = rkv_select_torch(scores, k.shape[2], budget, window)
    idx = keep.unsqueeze(-1).expand(-1, -1, -1, k.shape[3])
    return k.gather(2, idx), v.gather(2, idx), keep, scores


# ---------------------------------------------------------------------------------------------
# GPU benchmark
# ---------------------------------------------------------------------------------------------
def duplicate_sources(dup, u):
    """Source row of every row (int64, dup's shape [..., S]): a non-duplicate row is its own source;
    a duplicate i takes row floor(u_i * i), stepped back to the nearest non-duplicate at or before
    it (row 0 is never a duplicate, so one always exists). dup: bool, u: uniforms in [0, 1)."""
    import torch

    s = dup.shape[-1]
    idx = torch.arange(s, device=dup.device)
    dup = dup & (idx > 0)
    j = torch.minimum((u * idx).long(), (idx - 1).clamp(min=0))
    last_nondup = torch.cummax(idx.expand_as(dup).masked_fill(dup, -1), dim=-1).values
    return torch.where(dup, last_nondup.gather(-1, j), idx.expand_as(dup))


def structured_keys(batch, seq, gen, device="cuda"):
    """Keys [batch, Hkv, seq, D] fp32 (module docstring: a*g + N(0, 1) with planted
    near-duplicates), the distribution of gpu_bench_rkv's structured keys."""
    import torch

    shape = (batch, KV_HEADS, seq, HEAD_DIM)
    lo, hi = STRUCTURED_MAG
    a = lo + (hi - lo) * torch.rand(batch, KV_HEADS, 1, 1, device=device, generator=gen)
    g = torch.randn(batch, KV_HEADS, 1, HEAD_DIM, device=device, generator=gen)
    base = torch.randn(shape, device=device, generator=gen).add_(a * g)
    dup = torch.rand(batch, KV_HEADS, seq, device=device, generator=gen) < STRUCTURED_DUP_FRACTION
    src = duplicate_sources(dup, torch.rand(batch, KV_HEADS, seq, device=device, generator=gen))
    k = base.gather(2, src.unsqueeze(-1).expand(shape))
    del base
    moved = (src != torch.arange(seq, device=device)).unsqueeze(-1)
    k.add_(torch.randn(shape, device=device, generator=gen).mul_(STRUCTURED_DUP_NOISE * moved))
    return k


def make_inputs(batch, seq, window, keys, gen):
    """(k, v, q) bf16 on the GPU; keys random, structured or clustered (module docstring)."""
    import torch

    if keys == "structured":
        k = structured_keys(batch, seq, gen)
    else:
        k = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device="cuda", generator=gen)
    if keys == "clustered":
        k += 2.0 * torch.randn(1, KV_HEADS, 1, HEAD_DIM, device="cuda", generator=gen)
    v = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device="cuda", generator=gen)
    q = torch.randn(batch, Q_HEADS, window, HEAD_DIM, device="cuda", generator=gen)
    return k.bfloat16(), v.bfloat16(), q.bfloat16()


def copy_bandwidth(reps, warmup):
    """Device-to-device copy bandwidth in bytes/s (read + write) on 1 GiB buffers."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for r in range(warmup + reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        if r >= warmup:
            times.append(e0.elapsed_time(e1))
    del src, dst
    return 2.0 * n / (statistics.median(times) * 1e-3)


def matmul_peak(reps, warmup, n=MATMUL_PEAK_N):
    """bf16 torch.matmul (cuBLAS) throughput in FLOP/s on n x n x n, the compute floor's peak."""
    import torch

    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms = event_times(lambda r: torch.matmul(a, b, out=c), reps, warmup)
    return 2.0 * n ** 3 / (ms * 1e-3)


class KvsiftRunner:
    """One layer's R-KV step through the C API on torch tensors, on torch's current stream, with
    one workspace shared by select and compact (they run one after the other)."""

    def __init__(self, lib, batch, seq, budget, window, buffer, mix_lambda, threshold):
        import torch

        self.lib, self.batch, self.seq, self.budget = lib, batch, seq, budget
        self.policy = lib.policy("rkv", rkv_config(budget, window, buffer, mix_lambda, threshold))
        self.lengths = (ctypes.c_int32 * batch)()
        # Sizing reads shapes only: a view over placeholder tensors of the real shapes.
        k = torch.empty(batch, KV_HEADS, seq, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        q = torch.empty(batch, Q_HEADS, window, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        kv, qt = self._views(k, k, q)
        self.ws_bytes = self.policy.workspace_bytes(0, kv, qt)
        self.ws = torch.empty(max(self.ws_bytes, 1), dtype=torch.uint8, device="cuda")
        # compact's scratch depends on the plan; every plan of these shapes keeps `budget` slots
        # per row, so one plan sizes it for all.
        torch.nn.init.normal_(k)
        torch.nn.init.normal_(q)
        plan = self.select(k, k, q)
        self.ws_bytes = max(self.ws_bytes, lib.compact_workspace_bytes(self._views(k, k, q)[0],
                                                                        plan))
        self.ws = torch.empty(max(self.ws_bytes, 1), dtype=torch.uint8, device="cuda")

    def _views(self, k, v, q):
        for i in range(self.batch):  # compact() shortened them on the last call
            self.lengths[i] = self.seq
        return self.lib.cache_view(k, v, self.lengths), self.lib.tensor_of(q)

    def select(self, k, v, q):
        """The plan of one layer (score + select on the device, then the plan download)."""
        import torch

        kv, qt = self._views(k, v, q)
        return self.policy.select(0, kv, qt, self.ws.data_ptr(), self.ws_bytes,
                                  torch.cuda.current_stream().cuda_stream)

    def step(self, k, v, q):
        """select, then compact in place; returns the plan."""
        import torch

        kv, qt = self._views(k, v, q)
        stream = torch.cuda.current_stream().cuda_stream
        plan = self.policy.select(0, kv, qt, self.ws.data_ptr(), self.ws_bytes, stream)
        self.lib.compact(kv, plan, self.ws.data_ptr(), self.ws_bytes, stream)
        return plan


class KvsiftStepRunner:
    """A whole decode step's compression: every layer (each its own inputs) in ONE
    kvsift_policy_compress_step call — R-KV selects and compacts all layers in one launch sequence
    and waits for the stream once (the kept lengths)."""

    def __init__(self, lib, layer_inputs, budget, window, buffer, mix_lambda, threshold):
        import torch

        self.lib, self.inputs = lib, layer_inputs
        self.policy = lib.policy("rkv", rkv_config(budget, window, buffer, mix_lambda, threshold))
        n = len(layer_inputs)
        self.batch, self.seq = layer_inputs[0][0].shape[0], layer_inputs[0][0].shape[2]
        self.lengths = [(ctypes.c_int32 * self.batch)() for _ in range(n)]
        self.views = (_capi_module().CacheView * n)(
            *[lib.cache_view(k, v, ln) for (k, v, _), ln in zip(layer_inputs, self.lengths)])
        self.queries = (_capi_module().Tensor * n)(*[lib.tensor_of(q) for _, _, q in layer_inputs])
        self._reset_lengths()  # the workspace is sized for the lengths the step will see
        self.ws_bytes = self.policy.step_workspace_bytes(self.views, self.queries)
        self.ws = torch.empty(max(self.ws_bytes, 1), dtype=torch.uint8, device="cuda")

    def _reset_lengths(self):
        for ln in self.lengths:
            for i in range(self.batch):
                ln[i] = self.seq

    def step(self):
        import torch

        self._reset_lengths()  # the last step shortened them
        self.policy.compress_step(self.views, self.queries, self.ws.data_ptr(), self.ws_bytes,
                                  torch.cuda.current_stream().cuda_stream)


def _capi_module():
    from kvsift import _capi

    return _capi


# Key kinds whose parity decides the verdict. Structured keys are checked and reported too, but
# some of their heads have cosines centred near the 0.5 threshold, where a row's last match can
# legitimately differ between two fp32 orderings of the same dot product (torch's matmul vs
# kvsift's fma chain), which moves one spared cosine and so a few scores by ~0.5/S: reported,
# not failed.
PARITY_DECISIVE = ("random", "clustered")


def check_parity(lib, batch, budget, args, gen):
    """Same kept sets as the PyTorch formulation (up to near-cut ties) and an exact compaction."""
    import torch

    seq = budget + args.buffer
    ok = True
    for keys in ("random", "clustered", "structured"):
        k, v, q = make_inputs(batch, seq, args.window, keys, gen)
        k0, v0 = k.clone(), v.clone()
        _, _, keep, scores = rkv_step_torch(k0, v0, q, budget, args.window, args.mix_lambda,
                                            args.threshold)
        runner = KvsiftRunner(lib, batch, seq, budget, args.window, args.buffer, args.mix_lambda,
                              args.threshold)
        plan = runner.step(k, v, q)
        torch.cuda.synchronize()
        compressed = plan.kept_lengths() == [budget] * batch
        slots = torch.tensor(plan.slots(), dtype=torch.int64, device="cuda")
        idx = slots.unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM)
        compact_ok = (compressed and list(runner.lengths) == [budget] * batch
                      and torch.equal(k[:, :, :budget], k0.gather(2, idx))
                      and torch.equal(v[:, :, :budget], v0.gather(2, idx)))
        rows = lambda t: t.reshape(-1, t.shape[-1]).tolist()
        cmp = compare_kept_sets(rows(slots), rows(keep), rows(scores),
                                budget - args.window, rel_tol=1e-4)
        print("parity batch %d budget %d S %d %s keys: %d rows, %d differ (%d tokens, near-cut "
              "ties), %d hard mismatches; compaction %s%s" % (
                  batch, budget, seq, keys, cmp["rows"], cmp["rows_differing"],
                  cmp["tokens_differing"], len(cmp["hard"]), "exact" if compact_ok else "WRONG",
                  "" if keys in PARITY_DECISIVE else " (reported, not decisive)"))
        for row, why in cmp["hard"][:10]:
            print("  row %d: %s" % (row, why))
        # The compaction must be exact for every kind; kept sets decide for PARITY_DECISIVE only.
        ok = ok and compact_ok and (not cmp["hard"] or keys not in PARITY_DECISIVE)
    return ok


def event_times(fn, reps, warmup, setup=None):
    """Median ms of fn(rep) between two CUDA events on the current stream; setup(rep), if given,
    runs before the first event (untimed)."""
    import torch

    times = []
    for r in range(warmup + reps):
        if setup is not None:
            setup(r)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(r)
        e1.record()
        e1.synchronize()
        if r >= warmup:
            times.append(e0.elapsed_time(e1))
    return statistics.median(times)


_L2_FLUSH = []


def flush_l2():
    """Reads a 256 MiB buffer (five times the H200's L2), so the next call finds nothing cached."""
    import torch

    if not _L2_FLUSH:
        _L2_FLUSH.append(torch.ones(64 << 20, dtype=torch.float32, device="cuda"))
    _L2_FLUSH[0].sum()


def key_restorer(inputs):
    """setup(rep) for event_times: copies every (k, v, q) of `inputs` back to its keys as they were
    made, then flushes L2. kvsift compacts in place, and a step over keys it has already compacted
    sees the rows left behind beyond the budget as exact copies of the rows it moved (run 103: the
    search took 36 % longer on them). Values are not restored: their content changes no work."""
    pristine = [k.clone() for k, _, _ in inputs]

    def setup(_rep):
        for (k, _, _), orig in zip(inputs, pristine):
            k.copy_(orig)
        flush_l2()

    return setup


def is_out_of_memory(err):
    return "out of memory" in str(err).lower()


def bench_config(lib, batch, budget, keys, args, bandwidth, peak, gen):
    import torch

    seq = budget + args.buffer
    set_bytes = input_set_bytes(batch, seq, args.window)
    reps = reps_for(set_bytes, args.reps)
    n_sets = pool_size(set_bytes)
    pool = [make_inputs(batch, seq, args.window, keys, gen) for _ in range(n_sets)]
    runner = KvsiftRunner(lib, batch, seq, budget, args.window, args.buffer, args.mix_lambda,
                          args.threshold)
    torch.cuda.synchronize()

    restore_set = key_restorer(pool)  # restores every set: one rep reads one of them
    kv_ms = event_times(lambda r: runner.step(*pool[r % n_sets]), reps, args.warmup, restore_set)
    sel_ms = event_times(lambda r: runner.select(*pool[r % n_sets]), reps, args.warmup,
                         restore_set)
    # The one-call step needs every layer's own buffers (it compacts them all at once); the
    # per-layer calls run on the same buffers, so both read the same keys.
    del pool, restore_set
    torch.cuda.empty_cache()
    step_ms, calls_ms, stepper, layer_inputs = None, None, None, None
    try:
        layer_inputs = [make_inputs(batch, seq, args.window, keys, gen)
                        for _ in range(args.layers)]
        restore_layers = key_restorer(layer_inputs)

        def layer_calls(r):  # one decode step's compression of every layer, one call per layer
            for k, v, q in layer_inputs:
                runner.step(k, v, q)

        calls_ms = event_times(layer_calls, max(3, reps // 2), 1, restore_layers)
        stepper = KvsiftStepRunner(lib, layer_inputs, budget, args.window, args.buffer,
                                   args.mix_lambda, args.threshold)
        step_ms = event_times(lambda r: stepper.step(), max(3, reps // 2), 1, restore_layers)
    except RuntimeError as err:  # torch's out-of-memory error is a RuntimeError
        if not is_out_of_memory(err):
            raise
        print("  %d-layer step: out of memory, skipped" % args.layers)
    finally:
        stepper, layer_inputs, restore_layers = None, None, None
        torch.cuda.empty_cache()
    torch_ms, torch_note = None, "n/a"
    if args.skip_torch:
        torch_note = "skipped"
    else:
        pool = [make_inputs(batch, seq, args.window, keys, gen) for _ in range(n_sets)]
        free, _ = torch.cuda.mem_get_info()
        if torch_formulation_bytes(batch, seq) > 0.9 * free:
            torch_note = "n/a (memory)"
        else:
            def torch_layer(r):
                k, v, q = pool[r % n_sets]
                rkv_step_torch(k, v, q, budget, args.window, args.mix_lambda, args.threshold)

            try:
                torch_ms = event_times(torch_layer, reps, args.warmup)
            except RuntimeError as err:
                if not is_out_of_memory(err):
                    raise
                torch_note = "n/a (memory)"
        pool = None
    runner = None
    torch.cuda.empty_cache()
    floor_ms = layer_floor_bytes(batch, budget, args.buffer, args.window) / bandwidth * 1e3
    compute_ms = layer_search_flop(batch, seq) / peak * 1e3
    row = dict(keys=keys, batch=batch, budget=budget, seq=seq, kv_ms=kv_ms, sel_ms=sel_ms,
               step_ms=step_ms, calls_ms=calls_ms, floor_ms=floor_ms, compute_ms=compute_ms,
               torch_ms=torch_ms, torch_note=torch_note, pool=n_sets, reps=reps)
    print("%s keys, batch %3d budget %4d: kvsift %.3f ms/layer (score+select %.3f), %d-layer step "
          "%s ms (%d per-layer calls %s ms), HBM floor %.4f ms (%.1fx), compute floor %.4f ms "
          "(%.1fx), PyTorch %s, pool %d sets, %d reps" % (
              keys, batch, budget, kv_ms, sel_ms, args.layers,
              _cell(step_ms, "%.3f"), args.layers, _cell(calls_ms, "%.3f"), floor_ms,
              kv_ms / floor_ms, compute_ms, kv_ms / compute_ms,
              "%.3f ms" % torch_ms if torch_ms is not None else torch_note, n_sets, reps),
          flush=True)
    return row


def main(argv):
    args = parse_args(argv)
    if args.self_test:
        return self_test(args.lib)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device present: benchmark skipped")
        return 77
    # fp32 math throughout (docs/algorithms.md preamble): no TF32 in the reference's matmuls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lib = kvsift_c.Library(args.lib)
    if not lib.cuda_available():
        print("%s has no usable CUDA backend (built without CUDA, or no device)" % args.lib)
        return 77
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)

    # A small case and the smallest benchmark case; both run even when the first fails.
    parity_ok = all([check_parity(lib, 2, 256, args, gen), check_parity(lib, 1, 1024, args, gen)])
    bandwidth = copy_bandwidth(10, args.warmup)
    peak = matmul_peak(10, args.warmup)
    name = torch.cuda.get_device_name()
    header = [
        "R-KV compression step (score + select + compact) on %s, torch %s" % (name,
                                                                               torch.__version__),
        "Hq %d / Hkv %d, head_dim %d, bf16, S = budget + %d, window %d; median of %s reps after %d "
        "warm-up, inputs cycled through a pool (>= %d MiB)" % (
            Q_HEADS, KV_HEADS, HEAD_DIM, args.buffer, args.window,
            args.reps or "20/10/5 (by input size)", args.warmup, POOL_TARGET_BYTES >> 20),
        "keys: random = i.i.d. N(0,1); structured = per (sequence, KV head) a*g + N(0,1) per "
        "element, g ~ N(0, I), a ~ U[%g, %g], %d %% planted near-duplicates (an earlier row + "
        "%g*N(0,1), cosine > 0.99); clustered = N(0,1) + 2 * one direction per KV head" % (
            STRUCTURED_MAG[0], STRUCTURED_MAG[1], round(100 * STRUCTURED_DUP_FRACTION),
            STRUCTURED_DUP_NOISE),
        "measured in this run: device-to-device copy bandwidth %.0f GB/s (read + write); bf16 "
        "torch.matmul peak %.0f TFLOP/s (%d^3, cuBLAS)" % (bandwidth * 1e-9, peak * 1e-12,
                                                           MATMUL_PEAK_N),
        "HBM floor per layer = 2 B x (B*Hkv*S*D keys read + B*Hq*W*D queries read + "
        "B*Hkv*budget*D kept values read + 2*B*Hkv*budget*D kept keys and values written) / copy "
        "bandwidth; compute floor per layer = B*Hkv * S(S-1)/2 * D * 2 FLOP (the symmetric "
        "near-duplicate search without early exit) / matmul peak",
        "kvsift %s through its C API (libkvsift_c, policy \"rkv\"): ms/layer = "
        "kvsift_policy_select (score + select, plan downloaded: one stream wait) + kvsift_compact; "
        "%d-layer step = one kvsift_policy_compress_step call; per-layer calls = %d select + "
        "compact back to back" % (lib.version(), args.layers, args.layers),
        "parity vs PyTorch before timing: %s" % ("PASS" if parity_ok else "FAILED"),
    ]
    print("\n".join(header), flush=True)
    rows, errors = [], []
    for keys in args.keys:
        for budget in args.budgets:
            for b in args.batches:
                try:  # one failing configuration must not cost the others (a GPU run is costly)
                    rows.append(bench_config(lib, b, budget, keys, args, bandwidth, peak, gen))
                except (RuntimeError, KvsiftError) as err:
                    errors.append("- %s keys, batch %d, budget %d: error: %s" % (keys, b, budget,
                                                                                err))
                    print(errors[-1], flush=True)
                    torch.cuda.empty_cache()
    text = "\n".join(["# " + header[0], ""] + ["- " + h for h in header[1:]] + [
        "", format_table(rows, args.layers), ""] + target_lines(rows, args.layers) + errors) + "\n"
    print()
    print(text)
    if args.out:  # appended, so several runs collect in one file
        with open(args.out, "a") as f:
            f.write(text)
    return 0 if parity_ok and not errors else 2


# ---------------------------------------------------------------------------------------------
# Self test: the pure logic above (and the C API's host-side validation when --lib is given)
# ---------------------------------------------------------------------------------------------
def self_test(lib_path):
    failures = []

    def expect(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    # Floor: B=1, budget 1024, S 1152, W 8 by hand: K read 8*1152*128*2 = 2359296, Q 32*8*128*2 =
    # 65536, kept V read 8*1024*128*2 = 2097152, kept K and V written 2*2097152 = 4194304.
    expect(layer_floor_bytes(1, 1024, 128, 8) == 2359296 + 65536 + 2097152 + 4194304,
           "floor bytes B=1")
    expect(layer_floor_bytes(64, 1024, 128, 8) == 64 * 8716288, "floor bytes scale with batch")
    # Search: 8 heads * 1152*1151/2 pairs * 128 * 2 = 8 * 662976 * 256.
    expect(layer_search_flop(1, 1152) == 1357774848, "search FLOPs B=1")
    expect(layer_search_flop(64, 1152) == 64 * 1357774848, "search FLOPs scale with batch")
    expect(reps_for(100 << 20, 0) == 20 and reps_for(1 << 30, 0) == 10
           and reps_for(3 << 30, 0) == 5 and reps_for(3 << 30, 7) == 7, "reps by size")
    expect(pool_size(input_set_bytes(1, 1152, 8)) == POOL_MAX, "small sets: pool capped at max")
    expect(pool_size(input_set_bytes(64, 2176, 8)) == POOL_MIN, "large sets: pool at min")
    expect(pool_size(POOL_TARGET_BYTES // 8) == 8 and pool_size(POOL_TARGET_BYTES // 8 - 1) == 9,
           "pool covers the target")

    scores = [[0.9, 0.5, 0.5, 0.1, 0.7]]  # n = 5; keep 3 -> cut 0.5 (tie between 1 and 2)
    same = compare_kept_sets([[0, 1, 4, 5]], [[0, 1, 4, 5]], scores, 3, 1e-4)
    expect(same["rows_differing"] == 0 and not same["hard"], "identical sets")
    tie = compare_kept_sets([[0, 2, 4, 5]], [[0, 1, 4, 5]], scores, 3, 1e-4)
    expect(tie["rows_differing"] == 1 and tie["tokens_differing"] == 2 and not tie["hard"],
           "near-cut tie accepted")
    wrong = compare_kept_sets([[0, 3, 4, 5]], [[0, 1, 4, 5]], scores, 3, 1e-4)
    expect(len(wrong["hard"]) == 1 and "token 3" in wrong["hard"][0][1], "far-from-cut rejected")
    win = compare_kept_sets([[0, 1, 4, 6]], [[0, 1, 4, 5]], scores, 3, 1e-4)
    expect(any("window token" in h[1] for h in win["hard"]), "window difference rejected")
    short = compare_kept_sets([[0, 1, 4, -1]], [[0, 1, 4, 5]], scores, 3, 1e-4)
    expect(short["hard"] and "size" in short["hard"][0][1], "short row rejected")

    row = dict(keys="structured", batch=64, budget=1024, seq=1152, kv_ms=0.5, sel_ms=0.3,
               step_ms=16.0, calls_ms=20.0, floor_ms=0.3, compute_ms=0.25, torch_ms=30.0)
    table = format_table([row, dict(row, batch=128, torch_ms=None, torch_note="n/a (memory)")])
    table_ok = (table.count("\n") == 3 and "| structured | 64 | 1024 | 1152 | 0.500 | 0.300 "
                "| 16.000 | 20.000 | 0.3000 | 1.67x | 1.67x | 0.2500 | 2.00x | 30.000 | 60.0x |"
                in table and "| n/a (memory) | n/a |" in table)
    expect(table_ok, "table rows" + ("" if table_ok else ":\n" + table))
    lines = target_lines([row, dict(row, keys="random", kv_ms=1.0, torch_ms=None),
                          dict(row, batch=1, step_ms=0.25), dict(row, batch=1, step_ms=0.8)], 32)
    expect(any("structured keys: 1.67x the HBM floor per layer (target <= 2x): PASS" in l
               for l in lines), "structured floor target")
    expect(any("structured keys: 32-layer step 1.67x the HBM floor (target <= 2x): PASS" in l
               for l in lines), "structured step floor target")
    expect(any("random keys: 3.33x the HBM floor per layer (target <= 3x): FAIL" in l
               for l in lines), "random floor target")
    expect(any("60.0x faster" in l and "PASS" in l for l in lines), "speedup target")
    expect(any("step 0.250 ms" in l and "PASS" in l for l in lines)
           and any("step 0.800 ms" in l and "FAIL" in l for l in lines), "batch-1 step target")
    a = parse_args(["--lib", "x", "--batches", "1,8", "--budgets", "1024", "--keys", "structured"])
    expect(a.batches == [1, 8] and a.budgets == [1024] and a.keys == ["structured"],
           "argument lists")
    d = parse_args(["--lib", "x"])
    expect(d.batches == [1, 8, 32, 64] and d.budgets == [1024, 2048]
           and d.keys == ["random", "structured"] and d.reps == 0, "default grid")
    expect(parse_error(["--lib", "x", "--keys", "random,bogus"]) and
           parse_error(["--lib", "x", "--reps", "2"]), "bad --keys / --reps rejected")
    self_test_torch(expect)

    if lib_path:
        self_test_library(kvsift_c.Library(lib_path), expect)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


def parse_error(argv):
    """True when parse_args rejects argv (argparse exits; its message is silenced)."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args(argv)
    except SystemExit:
        return True
    return False


def self_test_torch(expect):
    """The structured-key generator on the CPU (skipped when torch is not installed)."""
    try:
        import torch
    except ImportError:
        print("skip torch checks (no torch)")
        return
    dup = torch.tensor([[False, True, True, False, True], [False, False, True, False, True]])
    u = torch.tensor([[0.0, 0.99, 0.5, 0.0, 0.6], [0.0, 0.0, 0.9, 0.0, 0.9]])
    src = duplicate_sources(dup, u).tolist()
    # Row 1: floor(.99*1) = 0. Row 2: floor(.5*2) = 1, a duplicate: back to 0. Row 4: floor(2.4)
    # = 2, a duplicate, back to 0. Second row: floor(1.8) = 1; floor(3.6) = 3, both originals.
    expect(src == [[0, 0, 0, 3, 0], [0, 1, 1, 3, 3]], "duplicate sources: %s" % src)

    gen = torch.Generator().manual_seed(0)
    seq = 512
    for kind in ("structured", "random"):
        k = structured_keys(2, seq, gen, device="cpu") if kind == "structured" else \
            torch.randn(2, KV_HEADS, seq, HEAD_DIM, generator=gen)
        unit = k / k.norm(dim=-1, keepdim=True)
        cos = (unit @ unit.transpose(-1, -2)).tril(diagonal=-1)  # pairs j < i
        near = (cos.amax(dim=-1) > 0.99).float().mean().item()
        neighbour = (unit[:, :, 1:] * unit[:, :, :-1]).sum(-1).mean().item()
        if kind == "structured":
            # 20 % of 2*8*511 rows planted (binomial sd ~0.5 %); a in [0.5, 3] gives neighbour
            # cosines a^2 / (a^2 + 1) in [0.2, 0.9], mean ~0.7.
            expect(0.17 < near < 0.23 and 0.5 < neighbour < 0.85,
                   "structured keys: %.3f near-duplicate rows, neighbour cosine %.3f"
                   % (near, neighbour))
        else:
            expect(near == 0.0 and abs(neighbour) < 0.02,
                   "random keys: %.3f near-duplicate rows, neighbour cosine %.3f"
                   % (near, neighbour))


def self_test_library(lib, expect):
    """The ctypes declarations against a built libkvsift_c, on host memory (no GPU needed): a
    hand-computed plan and the C API's argument checks as this script meets them."""

    def error_of(fn):
        try:
            fn()
        except KvsiftError as e:
            return str(e)
        return ""

    methods = lib.methods()
    names = [m["name"] for m in methods]
    expect("rkv" in names and "streaming" in names, "registry lists rkv and streaming: %s" % names)
    rkv = methods[names.index("rkv")]
    expect(rkv["default_config"]["budget"] == 1024 and not rkv["owns_cache"],
           "rkv defaults: %s" % rkv["default_config"])
    # StreamingLLM by hand (§1.4): budget 6, sink 2; 10 tokens keep 0, 1, 6..9 in every head.
    b, h, c, d = 1, 2, 12, 4
    keys = (ctypes.c_float * (b * h * c * d))(*range(b * h * c * d))
    values = (ctypes.c_float * (b * h * c * d))()
    lengths = (ctypes.c_int32 * b)(10)
    shape = (b, h, c, d)
    kv = lib.cache_view(lib.tensor(ctypes.addressof(keys), kvsift_c.DTYPE_F32,
                                   kvsift_c.DEVICE_CPU, shape),
                        lib.tensor(ctypes.addressof(values), kvsift_c.DTYPE_F32,
                                   kvsift_c.DEVICE_CPU, shape), lengths)
    policy = lib.policy("streaming", {"budget": 6, "sink": 2, "buffer": 1})
    expect(policy.should_compress(kv), "streaming triggers at 10 >= 6 + 1")
    plan = policy.select(0, kv)
    expect(plan.shape() == (1, 2, 12, 6) and plan.kept_lengths() == [6], "plan shape")
    expect(plan.slots() == [[[0, 1, 6, 7, 8, 9]] * 2], "plan slots: %s" % plan.slots())
    lib.compact(kv, plan)
    expect(list(lengths) == [6] and keys[2 * d] == 6 * d and keys[c * d + 5 * d] == (c + 9) * d,
           "compact moved rows 6 and 9 forward")

    msg = error_of(lambda: lib.policy("rkv", {"budget": 8, "window": 8}))
    expect("code 1" in msg and "budget (8)" in msg, "budget <= window: " + msg)
    msg = error_of(lambda: lib.policy("rkv", {"mix_lambda": 1.5}))
    expect("mix_lambda" in msg and "1.5" in msg, "bad lambda: " + msg)
    msg = error_of(lambda: lib.policy("no_such_method"))
    expect("no_such_method" in msg, "unknown method: " + msg)
    msg = error_of(lambda: lib.tensor(ctypes.addressof(keys), 7, kvsift_c.DEVICE_CPU, shape))
    expect("code 1" in msg and "dtype" in msg and "got 7" in msg, "bad dtype: " + msg)
    # A method that owns its cache (ThinKV, the registry's example: 1 sequence, 2 layers, 2 KV
    # heads, head_dim 16): a 5-token prompt per layer; fp16 K + V of it = 2*2*2*5*16*2 bytes.
    thinkv = methods[names.index("thinkv")]
    expect(thinkv["owns_cache"], "thinkv owns its cache")
    owner = lib.owning_policy("thinkv", thinkv["example_config"])
    prompt = (ctypes.c_float * (2 * 5 * 16))(*[(i % 7) / 7.0 - 0.5 for i in range(160)])
    pk = lib.tensor(ctypes.addressof(prompt), kvsift_c.DTYPE_F32, kvsift_c.DEVICE_CPU,
                    (1, 2, 5, 16))
    for layer in range(2):
        owner.prefill(layer, pk, pk)
    expect(owner.batch() == 1 and owner.memory()[1] == 2 * 2 * 2 * 5 * 16 * 2,
           "thinkv prefill memory: %s" % (owner.memory(),))
    expect(owner.resident_positions(0, 0, 0) == [0, 1, 2, 3, 4], "thinkv resident positions")
    msg = error_of(lambda: lib.policy("thinkv", thinkv["example_config"]))
    expect("code 2" in msg and "kvsift_owning_policy_create" in msg, "thinkv as a Policy: " + msg)

    lengths[0] = 13
    msg = error_of(lambda: policy.should_compress(kv))
    expect("lengths[0] = 13" in msg, "length beyond capacity: " + msg)
    lengths[0] = 10
    if not lib.cuda_available():
        gpu = lib.cache_view(lib.tensor(0x1000, kvsift_c.DTYPE_BF16, kvsift_c.DEVICE_CUDA, shape),
                             lib.tensor(0x1000, kvsift_c.DTYPE_BF16, kvsift_c.DEVICE_CUDA, shape),
                             lengths)
        e = None
        try:
            policy.select(0, gpu)
        except KvsiftError as err:
            e = err
        expect(e is not None and e.code == kvsift_c.NO_CUDA, "device view without CUDA: %s" % e)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
