"""End-to-end decode throughput of kvsift in a HuggingFace transformers model on one GPU
(issue 10, item 4): a randomly initialised model with R1-Llama-8B's architecture (32 layers,
hidden 4096, 32 query / 8 KV heads, head_dim 128, bf16, sdpa), greedy decoding with EOS ignored.

For each context position P, method (fullkv = transformers' DynamicCache; kvsift rkv and skipkv
through kvsift.hf.KVSiftCache) and budget (buffer 128 by default):
- decode tokens/s over a steady window of decode steps timed with CUDA events (after warm-up),
  and the window's slowest step (a compressing or evicting step shows there),
- peak GPU memory (torch.cuda.max_memory_allocated) from the cache fill to the window's end,
- the share of the window's GPU time spent in kvsift's compression steps (select + compact of
  every layer, CUDA events around each),
at the given batch sizes and, with --max-batch, at the largest batch that fits (doubling until
CUDA runs out of memory, then bisecting).

How the context position is reached: NOT by prefill. The cache is filled with synthetic K/V:
- fullkv: a DynamicCache holding P random post-RoPE K/V per layer (what a P-token context holds);
- kvsift: a KVSiftCache holding `budget` random K/V at logical position P (the state right after
  a compression during a P-token generation: a budget-based policy never holds more than
  budget + buffer tokens), plus random window inputs; SkipKV's tracker observes `budget`
  synthetic tokens (a delimiter every 25) with random hidden states.
- thinkv: a kvsift.hf_thinkv.ThinKVCache on the GPU (the device pipeline, K/V never leave it)
  holding `budget` random K/V prefilled as its protected segment 0 at logical position P, block
  pools sized for what the window adds (--thinkv-pool-blocks); the decode steps are typed,
  quantized (R4 E4 T2) and demoted by TBE as they come. Not a 32K-step generation: nothing of
  the resident tokens was ever demoted, and the thresholds (--thinkv-thresholds) are not
  calibrated on this random model.
Every decode step then runs the real model at position P + step (position_ids), so kvsift
compresses every `buffer` steps during the window, exactly as in a long generation.

    python3 bench/e2e_generate.py --quick                      # < 3 minutes, one table
    python3 bench/e2e_generate.py --out bench/e2e.md           # the full grid (long: split it)
    python3 bench/e2e_generate.py --contexts 32768 --methods rkv --budgets 1024 --max-batch

Needs: torch with CUDA, transformers >= 5.5, the kvsift package (python/ on PYTHONPATH or
installed) and libkvsift_c built with CUDA ($KVSIFT_LIBRARY or next to the package).
"""

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

# The ThinKV paper's Table 2 (R1-Llama-8B, 32K-token continuous generation, GH200; published,
# different engine and GPU): decode tokens/s.
PAPER_TABLE2 = [("FullKV", "-", "453.9"), ("R-KV (sequential)", "1024", "2,425.8"),
                ("R-KV (overlapped)", "1024", "4,311.3"), ("ThinKV", "-", "10,578.5")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="batch 1 and 8 at 16K, fullkv and rkv@1024, short window (< 3 minutes)")
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--contexts", default="16384,32768", help="context positions")
    p.add_argument("--methods", default="fullkv,rkv,skipkv", help="fullkv, rkv, skipkv, snapkv, "
                   "streaming, thinkv")
    p.add_argument("--budgets", default="1024,2048", help="kvsift budgets")
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--window", type=int, default=8, help="observation window W")
    p.add_argument("--steps", type=int, default=256, help="decode steps in the timed window "
                   "(a multiple of the buffer covers whole compression cycles)")
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--max-batch", action="store_true",
                   help="also find and measure the largest batch that fits per configuration")
    p.add_argument("--max-batch-limit", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32, help="decoder layers (32 = R1-Llama-8B)")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="disable torch's cuDNN SDPA backend (its host-side cost per call is "
                   "~2 ms when the KV length changes every step; see bench/RESULTS.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--thinkv-thresholds", default="0.2,0.5", help="ThinKV theta1,theta2")
    p.add_argument("--thinkv-pool-blocks", type=int, default=0,
                   help="ThinKV blocks per sequence, layer and format pool (0: enough for "
                        "budget + the window)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead of the table: N decode steps of each (context, method, budget, "
                   "batch) under torch.profiler; prints wall vs GPU-busy time per step and the "
                   "top CPU and CUDA operators (where a step's time goes)")
    p.add_argument("--trace", metavar="PREFIX",
                   help="with --profile: also keep each profiled window's torch.profiler trace "
                   "as PREFIX-<method>-<batch>.json.gz (chrome://tracing, Perfetto)")
    p.add_argument("--out", help="also write the markdown table here (rows appended as measured)")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.methods, args.budgets = "1,8", "16384", "fullkv,rkv", \
            "1024"
        args.steps, args.warmup = min(args.steps, 128), min(args.warmup, 8)
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.methods = [x for x in args.methods.split(",") if x]
    args.budgets = [int(x) for x in args.budgets.split(",") if x]
    return args


def build_model(args):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=args.layers, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, bos_token_id=128000,
                                   eos_token_id=128001)
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation=args.attn)
    finally:
        torch.set_default_dtype(old)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


class Oom(Exception):
    pass


def is_oom(e):
    import torch

    oom_type = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    return isinstance(e, oom_type) or "out of memory" in str(e).lower()


def make_cache(model, method, budget, args, batch, position, resident=None):
    """A filled cache at `position` (module docstring: synthetic K/V)."""
    import torch
    import transformers

    g = torch.Generator(device="cuda").manual_seed(args.seed + batch)
    if method == "fullkv":
        cache = transformers.DynamicCache()
        for layer in range(args.layers):
            shape = (batch, 8, position, 128)
            k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            cache.update(k, v, layer)
            del k, v
        return cache
    if method == "thinkv":
        from kvsift.hf_thinkv import ThinKVCache

        theta1, theta2 = (float(x) for x in args.thinkv_thresholds.split(","))
        resident = resident or budget
        pool = args.thinkv_pool_blocks or (resident + args.warmup + args.steps) // 32 + 4
        # L*: four layers spread over the depth (no calibration on a random model).
        lstar = sorted({args.layers * f // 8 for f in (1, 3, 5, 7)})
        cache = ThinKVCache(model, batch, budget=budget, theta1=theta1, theta2=theta2,
                            calibrated_layers=lstar, pool_blocks=pool)
        cache.fill_synthetic(resident, position, torch.bfloat16, generator=g)
        return cache
    import kvsift.hf as hf

    opts = dict(budget=budget, buffer=args.buffer)
    if method in ("rkv", "skipkv", "snapkv"):
        opts["window"] = args.window
    if method == "skipkv":
        opts["vocabulary"] = "r1_llama"
    cache = hf.KVSiftCache(model, method, **opts)
    cache.fill_synthetic(batch, resident or budget, position, torch.bfloat16, "cuda",
                         generator=g)
    cache.record_timing = True
    return cache


def decode(model, cache, batch, position, steps, warmup, on_window_start=None):
    """Greedy decode warmup + steps tokens; returns (seconds of the timed window, tokens, the
    slowest window step in ms). An event marks each window step's start, so a step that
    compresses or evicts shows as one slow step (host work in it included: the GPU waits)."""
    import torch

    ids = torch.randint(1000, 100000, (batch, 1), device="cuda")
    pos = position
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    for step in range(warmup + steps):
        if step == warmup and on_window_start is not None:
            on_window_start()
        if step >= warmup:
            marks[step - warmup].record()
        position_ids = torch.full((batch, 1), pos, device="cuda", dtype=torch.long)
        out = model(input_ids=ids, position_ids=position_ids, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        ids = out.logits[:, -1:].argmax(-1)
        pos += 1
    marks[steps].record()
    torch.cuda.synchronize()
    slowest = max(marks[i].elapsed_time(marks[i + 1]) for i in range(steps))
    return marks[0].elapsed_time(marks[steps]) / 1e3, batch * steps, slowest


def release(*objs):
    import torch

    for o in objs:
        close = getattr(o, "close", None)
        if close is not None:
            close()
    del objs
    gc.collect()
    torch.cuda.empty_cache()


def drop(cache):
    """Uninstalls a KVSiftCache's hooks (DynamicCache has nothing to undo)."""
    close = getattr(cache, "close", None)
    if close is not None:
        close()


def measure(model, method, budget, batch, position, args):
    """One row: dict(tok_s, peak_gib, compress_share, compressions) or raises Oom."""
    import torch

    cache = None
    release()
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            cache = make_cache(model, method, budget, args, batch, position)
            state = {}

            def window_start():
                if method == "thinkv":
                    state["evicting"] = cache.evicting_steps
                elif method != "fullkv":
                    cache.compress_events = []
                    state["compressions"] = cache.compressions

            secs, tokens, slowest = decode(model, cache, batch, position, args.steps,
                                           args.warmup, window_start)
        peak = torch.cuda.max_memory_allocated() / 2**30
        row = {"tok_s": tokens / secs, "peak_gib": peak, "ms_step": 1e3 * secs / args.steps,
               "slowest_ms": slowest}
        if method == "thinkv":  # TBE runs inside each step's end_step: no separate share
            row["resident_mib"] = cache.resident_bytes() / 2**20
            row["evicting_steps"] = cache.evicting_steps - state.get("evicting", 0)
        elif method != "fullkv":
            row["compress_share"] = cache.compression_seconds() / secs
            row["compressions"] = cache.compressions - state.get("compressions", 0)
            row["resident"] = int(cache.resident_lengths().max())
        return row
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        message = str(e).splitlines()[0][:120]
    finally:
        drop(cache)
        cache = None  # its buffers can be returned to the device only once nothing holds them
        release()
    raise Oom(message)


def fits(model, method, budget, batch, position, args):
    """Whether `batch` runs: fill, then decode steps that include a compression."""
    import torch

    cache = None
    release()
    try:
        with torch.no_grad():
            resident = None if method == "fullkv" else budget + args.buffer - 1
            cache = make_cache(model, method, budget, args, batch, position, resident)
            decode(model, cache, batch, position, 2, 0)
        return True
    except Exception as e:  # noqa: BLE001
        if is_oom(e):
            return False
        raise
    finally:
        drop(cache)
        cache = None
        release()


def largest_batch(model, method, budget, position, args, start):
    lo, hi = 0, None
    b = max(1, start)
    while b <= args.max_batch_limit:
        if fits(model, method, budget, b, position, args):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return lo
    while hi - lo > max(1, lo // 16):  # bisect to within ~6 %
        mid = (lo + hi) // 2
        if fits(model, method, budget, mid, position, args):
            lo = mid
        else:
            hi = mid
    return lo


HEADER = ("| context | method | budget | batch | decode tok/s | ms/step | slowest step ms | "
          "peak GiB | compression share | compressions in window |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def fmt_row(position, method, budget, batch, r, note=""):
    if r is None:
        return "| %d | %s | %s | %s | OOM | | | | | %s |" % (position, method, budget, batch,
                                                           note)
    share = "%.1f %%" % (100 * r["compress_share"]) if "compress_share" in r else "-"
    comps = str(r.get("compressions", r.get("evicting_steps", "-")))
    return "| %d | %s | %s | %s | %.1f | %.2f | %.1f | %.1f | %s | %s |" % (
        position, method, budget, batch, r["tok_s"], r["ms_step"], r["slowest_ms"],
        r["peak_gib"], share, comps)


def busy_union(intervals):
    """Sorted (start, end) intervals -> (total covered length, the idle gaps between them)."""
    busy, gaps = 0.0, []
    cur_s, cur_e = intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + cur_e - cur_s, gaps


def print_timeline(prof, n, keep=None):
    """The profiled steps as a timeline: the time some kernel or copy runs on the GPU (the union
    of their intervals over both streams, so overlap counts once) against the span from the first
    to the last, the idle gaps between them, and the host time spent inside CUDA runtime calls (a
    long cudaMemcpyAsync or cudaStreamSynchronize is the host waiting for the GPU)."""
    import collections
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if keep:
            import gzip
            import shutil
            with open(path, "rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not device:
        print("timeline: no device events recorded", flush=True)
        return
    busy, gaps = busy_union(device)
    span = device[-1][1] - device[0][0]
    big = [g for g in gaps if g >= 50]
    print("timeline (µs per step): GPU busy %.0f of a %.0f span (%.0f %%); idle %.0f, of it %.0f "
          "in %.1f gaps >= 50 µs (largest %.0f)" % (
              busy / n, span / n, 100 * busy / span, (span - busy) / n, sum(big) / n,
              len(big) / n, max(gaps, default=0)), flush=True)
    runtime = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            r = runtime[e["name"]]
            r[0] += e.get("dur", 0)
            r[1] += 1
    top = sorted(runtime.items(), key=lambda kv: -kv[1][0])[:8]
    print("host time in CUDA API calls (µs per step, calls per step): " + "; ".join(
        "%s %.0f (%.0f)" % (name, t / n, c / n) for name, (t, c) in top), flush=True)


def profile(model, method, budget, batch, position, args):
    """--profile: where a decode step's time goes. Wall time per step (CUDA events around the N
    steps) against the GPU's busy time per step (the sum of the kernels' durations the profiler
    recorded): a step much longer than its kernels is bound by the host (Python, launches)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    release()
    with torch.no_grad():
        cache = make_cache(model, method, budget, args, batch, position)
        try:
            decode(model, cache, batch, position, 4, 0)  # warm-up outside the trace
            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with torch_profile(activities=acts) as prof:
                secs, _, _ = decode(model, cache, batch, position, args.profile, 0)
        finally:
            release(cache)
            cache = None  # the second pass below needs its memory
            release()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    n = args.profile
    print("\n### profile: context %d, %s, budget %s, batch %d — wall %.2f ms/step, GPU busy %.2f "
          "ms/step (%.0f %%)" % (position, method, budget or "-", batch, 1e3 * secs / n,
                                  gpu_us / 1e3 / n, 100 * gpu_us / 1e6 / secs), flush=True)
    print_timeline(prof, n, args.trace and "%s-%s-%d.json.gz" % (args.trace, method, batch))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=8), flush=True)
    # The host side by Python function (kvsift's ctypes calls count as their Python wrappers):
    # the same N steps again under cProfile, on a fresh cache.
    import cProfile
    import pstats

    release()
    with torch.no_grad():
        cache = make_cache(model, method, budget, args, batch, position)
        try:
            decode(model, cache, batch, position, 4, 0)
            prof_py = cProfile.Profile()
            prof_py.enable()
            decode(model, cache, batch, position, n, 0)
            prof_py.disable()
        finally:
            release(cache)
            cache = None
            release()
    print("host time by function (cProfile, %d steps; tottime = in the function itself):" % n)
    pstats.Stats(prof_py).sort_stats("tottime").print_stats(14)


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("e2e_generate: needs a CUDA device")
    import kvsift
    import transformers

    if args.methods != ["fullkv"] and not kvsift.cuda_available():
        sys.exit("e2e_generate: libkvsift_c (%s) was built without CUDA" % kvsift.find_library())
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.time()
    model = build_model(args)
    dev = torch.cuda.get_device_name()
    lines = ["## End-to-end decode (bench/e2e_generate.py%s)" % (" --quick" if args.quick else ""),
             "",
             "%s; torch %s, transformers %s, kvsift %s; random R1-Llama-8B architecture (%d "
             "layers), bf16, %s; greedy, EOS ignored. Context reached by synthetic K/V, not "
             "prefill: fullkv = DynamicCache holding the full context; kvsift = KVSiftCache "
             "holding `budget` tokens at that position (its state after a compression), "
             "compressing every %d steps. Timed window: %d decode steps after %d warm-up "
             "steps (CUDA events)." % (dev, torch.__version__, transformers.__version__,
                                       kvsift.__version__, args.layers, args.attn, args.buffer,
                                       args.steps, args.warmup),
             "", HEADER]
    print("\n".join(lines), flush=True)
    out = open(args.out, "a") if args.out else None
    if out:
        out.write("\n".join(lines) + "\n")
        out.flush()

    def emit(line):
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    configs = []
    for position in args.contexts:
        for method in args.methods:
            for budget in ([None] if method == "fullkv" else args.budgets):
                configs.append((position, method, budget))
    if args.profile:
        for position, method, budget in configs:
            for batch in args.batches:
                profile(model, method, budget, batch, position, args)
        return
    for position, method, budget in configs:
        largest_seen = 0
        for batch in args.batches:
            try:
                r = measure(model, method, budget, batch, position, args)
                largest_seen = batch
            except Oom:
                r = None
            except Exception as e:  # noqa: BLE001 - report and continue with the next row
                emit("| %d | %s | %s | %d | ERROR: %s | | | | | |" % (
                    position, method, budget or "-", batch, str(e).splitlines()[0]))
                continue
            emit(fmt_row(position, method, budget or "-", batch, r))
        if args.max_batch:
            try:
                best = largest_batch(model, method, budget, position, args, max(largest_seen, 1))
                if best == 0:
                    emit(fmt_row(position, method, budget or "-", "max: none fits", None))
                    continue
                r = None
                while best > 0 and r is None:
                    # fits() decodes 2 steps; the timed window can need a little more (allocator
                    # fragmentation over many steps): step down by 1/8 until it runs. The retry
                    # happens outside the except clause, so the failed attempt's tensors (held by
                    # the exception's frames) are gone first.
                    try:
                        r = measure(model, method, budget, best, position, args)
                    except Oom:
                        r = None
                    if r is None:
                        best = best * 7 // 8
                emit(fmt_row(position, method, budget or "-", "max %d" % best, r))
            except Exception as e:  # noqa: BLE001
                emit("| %d | %s | %s | max | ERROR: %s | | | | | |" % (
                    position, method, budget or "-", str(e).splitlines()[0]))
    emit("")
    emit("Published for comparison (ThinKV paper, Table 2: R1-Llama-8B, 32K continuous "
         "generation, GH200, their engine; not measured here):")
    emit("")
    emit("| method | budget | decode tok/s |\n|---|---|---|")
    for name, budget, tps in PAPER_TABLE2:
        emit("| %s | %s | %s |" % (name, budget, tps))
    emit("")
    emit("(total wall time %.0f s)" % (time.time() - t0))
    if out:
        out.close()


if __name__ == "__main__":
    main()
