"""Training-step benchmark: one decoder-only transformer, every checkpointing mode (none, full,
every-n, transformers-style synchronous offload, ckpt_offload's async offload) on identical weights.
Reports step time, device and host memory, bytes moved and reload waits; writes JSON and plots.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import textwrap
import time
import traceback

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn

import ckpt_offload
from ckpt_offload.testing import LiveBytes

CONFIGS = {
    # Finishes in seconds on a 2-core CPU; the default without a GPU.
    "small": dict(layers=4, hidden=64, heads=4, kv_heads=2, mlp=176, seqs="64", batch=2, dtype="float32",
                  vocab=256, warmup=1, steps=7),
    # Llama-3-8B-shaped layers; the default with a GPU.
    "standard": dict(layers=8, hidden=4096, heads=32, kv_heads=8, mlp=14336, seqs="4096,8192", batch=1,
                     dtype="bfloat16", vocab=1024, warmup=2, steps=5),
}
MODES = ["none", "full", "every2", "every4", "sync_offload", "async_offload", "every2_async", "offload_activations",
         "attn_offload"]
# Modes whose gradients must equal another mode's bit for bit (same kernels, values only moved;
# attn_offload: the attention outputs of the forward instead of recomputed ones, the same bits).
BITWISE = {"sync_offload": "full", "async_offload": "full", "every2_async": "every2", "offload_activations": "none",
           "attn_offload": "full"}
HF_MODES = ["hf_none", "hf_gc", "hf_gc_sync_offload", "hf_gc_async_offload"]
HF_BITWISE = {"hf_gc_sync_offload": "hf_gc", "hf_gc_async_offload": "hf_gc"}
CPU_LABEL = "CPU timings (no GPU): not representative"
OPTIMIZER_NOTE = ("step = forward + backward; the optimizer step is excluded; gradients stay allocated between "
                  "steps (zero_grad(set_to_none=False))")


# -- the model ------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-5, **fk):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, **fk))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


@functools.lru_cache(maxsize=16)
def rope_tables(seq, head_dim, device, dtype, base=500000.0):
    """Rotary cos/sin tables, cached: computed once per shape, shared by every block."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    emb = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq).repeat(1, 2).to(device)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, rope, **fk):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False, **fk)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **fk)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **fk)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False, **fk)
        self.rope = rope

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope_tables(s, self.head_dim, x.device, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden, width, **fk):
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=False, **fk)
        self.up = nn.Linear(hidden, width, bias=False, **fk)
        self.down = nn.Linear(width, hidden, bias=False, **fk)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, hidden, heads, kv_heads, mlp, rope, **fk):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, **fk)
        self.attn = Attention(hidden, heads, kv_heads, rope, **fk)
        self.mlp_norm = RMSNorm(hidden, **fk)
        self.mlp = SwiGLU(hidden, mlp, **fk)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Embedding, blocks, norm, a small LM head (small vocab: the blocks' activations dominate)."""

    def __init__(self, a, device, dtype):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(a.vocab, a.hidden, **fk)
        self.layers = nn.ModuleList(Block(a.hidden, a.heads, a.kv_heads, a.mlp, a.rope, **fk) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, **fk)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False, **fk)
        self.layer_call = None  # set by the sync_offload mode: how each block is called
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x) if self.layer_call is None else self.layer_call(block, x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def sync_offload_call(block, x):
    """What transformers 5.x does for activation_checkpointing_enable(offload=True) (formerly
    gradient_checkpointing_enable), per layer."""
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return tuc.checkpoint(block, x, use_reentrant=False)


# -- modes ----------------------------------------------------------------------------------------
def apply_mode(model, mode, a):
    """Puts the model in `mode`; returns a factory of the context each forward runs in."""
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    every = {"full": 1, "every2": 2, "every4": 4, "async_offload": 1, "every2_async": 2, "attn_offload": 1}.get(mode)
    if every is not None:
        # attn_offload: every block checkpointed with its input and its attention outputs offloaded.
        attn = mode == "attn_offload"
        ckpt_offload.enable_checkpointing(model, every_n_layers=every, offload="async" in mode or attn,
                                          keep_last=a.keep_last, prefetch=a.prefetch, layers=list(model.layers),
                                          policy="attention" if attn else None)
    elif mode == "sync_offload":
        model.layer_call = sync_offload_call
    elif mode == "offload_activations":
        return lambda: ckpt_offload.offload_activations(min_bytes=a.min_bytes)
    elif mode == "planned":  # --budget: the plan run_main made for this length
        a.plan.apply(model)
    return contextlib.nullcontext


def offloaded_layers(model, mode):
    if mode == "sync_offload":
        return len(model.layers)
    state = ckpt_offload.checkpointing_state(model)
    return 0 if state is None else len(state[1])


def restored_exactly(model) -> bool:
    """disable_checkpointing left no instance forward and no state behind."""
    return ckpt_offload.checkpointing_state(model) is None and all("forward" not in b.__dict__ for b in model.layers)


# -- one step and its measurements ----------------------------------------------------------------
def train_step(model, ids, ctx):
    # Gradients stay allocated between steps, as under gradient accumulation and in DDP's and FSDP's
    # gradient buffers: the peak then shows the activations, not the moment gradients are created.
    model.zero_grad(set_to_none=False)
    with ctx():
        loss = model(ids)
    loss.backward()
    return loss


def timed_step(model, ids, ctx, cuda):
    """Milliseconds of one step: CUDA events on a GPU, perf_counter on the CPU."""
    if not cuda:
        t0 = time.perf_counter()
        train_step(model, ids, ctx)
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    train_step(model, ids, ctx)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def settle(cuda):
    if cuda:
        torch.cuda.synchronize()
    ckpt_offload.synchronize()


def reference(model, loss, cuda):
    """What a mode is checked by: the loss and the gradients (on a GPU, per-tensor fingerprints)."""
    grads = [p.grad for p in model.parameters()]
    if cuda:
        grads = [torch.stack([g.double().sum(), g.double().norm()]).cpu() for g in grads]
    else:
        grads = [g.detach().clone() for g in grads]
    return loss.detach().float().cpu(), grads


def inspect_step(model, ids, ctx, cuda):
    """Untimed: device bytes held after forward (copies settled), host pool bytes in use after
    forward, and on the CPU the peak bytes of live tensors over the step above weights, gradients
    and inputs (ckpt_offload.testing.LiveBytes; on a GPU the timed steps' max_memory_allocated)."""
    model.zero_grad(set_to_none=False)
    settle(cuda)
    if cuda:
        before = torch.cuda.memory_allocated()
        with ctx():
            loss = model(ids)
        host = ckpt_offload.stats()["host_in_use_bytes"]
        settle(cuda)
        act = torch.cuda.memory_allocated() - before
        loss.backward()
        settle(cuda)
        return act, host, None
    with LiveBytes() as live:
        live.add([*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
                  *model.buffers(), ids])
        base = live.peak = live.current()
        with ctx():
            loss = model(ids)
        host = ckpt_offload.stats()["host_in_use_bytes"]
        act = live.current() - base
        loss.backward()
    return act, host, live.peak - base


def profiled_step(model, ids, ctx, cuda):
    """Untimed pass with profiling on: how long the compute stream waited for reloads, and the
    throughput of the engine's copies on their own streams while the step ran (GB/s)."""
    ckpt_offload.reset_stats()
    ckpt_offload.profile(True)
    try:
        train_step(model, ids, ctx)
        settle(cuda)
        s = ckpt_offload.stats()
    finally:
        ckpt_offload.profile(False)
    return dict(reload_wait_ms_profiled=s["reload_wait_ms"] if s["reload_waits_measured"] else None,
                d2h_gb_per_s=s["d2h_gb_per_s"], h2d_gb_per_s=s["h2d_gb_per_s"])


def link_peak(nbytes, device, reps=5):
    """The pinned-memory copy bandwidth of this machine at one block size, measured now with plain
    torch (pinned host tensor, copy_(non_blocking=True) on a side stream, CUDA events): the peak
    the engine's copies in the step are judged against. None without a GPU."""
    if device.type != "cuda":
        return None
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device)
    out = dict(block_bytes=nbytes)
    for name, dst, src in (("d2h_gb_per_s", host, dev), ("h2d_gb_per_s", dev, host)):
        times = []
        for _ in range(reps + 1):  # the first copy is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[name] = nbytes / statistics.median(times[1:]) / 1e6
    del dev, host
    torch.cuda.empty_cache()
    return out


def measure(model, ids, mode, ctx, a, cuda, timed=None):
    """Timed steps, a check step, an inspection step and a profiled step of the model as configured
    now. timed: this mode's timed steps from interleaved_timing (None: warm-up and a.steps timed
    steps here, one after another). The check step runs on other tokens than the timed ones, after
    them: a reload that returned stale pool memory would then show in the gradients. The untimed
    steps start from an empty host pool: the reserved bytes reported are then this mode's own, not
    what the other modes left reserved."""
    compiled = {}
    if timed is None:
        for _ in range(a.warmup):
            train_step(model, ids, ctx)  # the first warm-up step fills the pool (and compiles)
        warm = compile_counts() if a.compile else None
        timed = [one_timed_step(model, ids, ctx, cuda) for _ in range(a.steps)]
        if a.compile:  # taken before the check and inspection steps, which run other inputs or modes
            graphs, breaks = compile_counts()
            compiled = dict(compiled_graphs=graphs, graph_breaks=breaks, graphs_compiled_in_timed_steps=graphs - warm[0])
    settle(cuda)
    ckpt_offload.host_pool().empty_cache()
    check_ids = torch.roll(ids, 1, dims=1) + 1 if ids.shape[1] > 1 else ids
    ref = reference(model, train_step(model, check_ids.remainder(a.vocab), ctx), cuda)
    act, host, live_peak = inspect_step(model, ids, ctx, cuda)
    prof = profiled_step(model, ids, ctx, cuda)
    reserved = ckpt_offload.stats()["host_reserved_bytes"]
    return dict(mode=mode, seq=ids.shape[1], loss=float(ref[0]), **{**summarize_steps(timed), "host_reserved_bytes": reserved},
                act_device_bytes=act, live_peak_bytes=live_peak, act_host_bytes=host, **prof, **compiled), ref


def compile_blocks(model, backend):
    """--compile: every block compiled on its own (block.compile()), in every mode."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in model.layers:
        block.compile(backend=backend)


def compile_counts():
    """(unique graphs, graph breaks) torch.compile has made since the last reset."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def measure_mode(model, ids, mode, a, cuda, timed=None):
    if a.compile:
        # Each mode compiles afresh, so its counts are its own (inductor's caches keep it quick).
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    ctx = apply_mode(model, mode, a)
    row, ref = measure(model, ids, mode, ctx, a, cuda, timed)
    row["base_bytes"] = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers(), ids)) \
        + sum(p.numel() * p.element_size() for p in model.parameters())  # weights, buffers, inputs, gradients
    if mode == "planned":
        row.update(plan_modes=a.plan.modes, predicted_peak_bytes=a.plan.predicted_peak_bytes,
                   predicted_step_ms=a.plan.predicted_step_ms, predicted_host_bytes=a.plan.predicted_host_bytes)
    row["offloaded_layers"] = offloaded_layers(model, mode)
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    return row, ref


# -- interleaved timing, noise, varying lengths ----------------------------------------------------
def one_timed_step(model, ids, ctx, cuda):
    """One timed step and what it did: host allocations and frees, bytes moved, peaks."""
    settle(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else None  # weights, gradients, inputs: under the peak
    ckpt_offload.reset_stats()
    ms = timed_step(model, ids, ctx, cuda)
    settle(cuda)
    s = ckpt_offload.stats()
    return dict(ms=ms, host_alloc_calls=s["host_alloc_calls"], host_free_calls=s["host_free_calls"],
                bytes_offloaded=s["bytes_offloaded"], bytes_prefetched=s["bytes_prefetched"],
                host_reserved_bytes=s["host_reserved_bytes"], host_peak_bytes=s["host_peak_bytes"],
                peak_device_bytes=torch.cuda.max_memory_allocated() if cuda else None, base_device_bytes=base,
                tensors_kept_on_device=s["tensors_kept_on_device"])


def summarize_steps(steps):
    """The row figures of a mode's timed steps (see benchmarks/README.md, JSON fields)."""
    times = [x["ms"] for x in steps]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    top = max(steps, key=lambda x: x["peak_device_bytes"] or 0)  # the step of the peak, and what it started with
    return dict(step_ms_median=statistics.median(times), step_ms_min=min(times), step_ms_max=max(times),
                step_ms_iqr=[q[0], q[2]], step_ms_all=times, peak_device_bytes=top["peak_device_bytes"],
                base_device_bytes=top["base_device_bytes"],
                host_reserved_bytes=steps[-1]["host_reserved_bytes"],
                host_peak_bytes=max(x["host_peak_bytes"] for x in steps),
                host_alloc_calls_timed=sum(x["host_alloc_calls"] for x in steps),
                bytes_offloaded_per_step=statistics.fmean(x["bytes_offloaded"] for x in steps),
                bytes_prefetched_per_step=statistics.fmean(x["bytes_prefetched"] for x in steps),
                tensors_kept_on_device=sum(x["tensors_kept_on_device"] for x in steps))


def interleaved_timing(modes, prepare, a, cuda, seq):
    """Warm-up steps of every mode, then a.steps rounds, each timing one step of every mode, the
    order rotated by one from round to round: a slow spell of the machine then falls on every mode
    alike, not on whichever mode was running, and round i of two modes makes a pair. prepare(mode)
    puts the model in that mode and returns (model, ids, ctx). Returns ({mode: [step figures]},
    {mode: error row}); a mode that fails leaves the rotation."""
    steps, failed = {m: [] for m in modes}, {}
    settle(cuda)
    # Every length starts from an empty host pool, so that no other length's blocks serve this one.
    ckpt_offload.host_pool().empty_cache()

    def guarded(mode, fn):
        row, ok = run_guarded(lambda: (fn(), True), mode, seq)
        if ok is None:
            failed[mode] = row
            steps.pop(mode, None)
        return row

    for mode in modes:
        def warm(mode=mode):
            model, ids, ctx = prepare(mode)
            for _ in range(a.warmup):
                train_step(model, ids, ctx)  # the first warm-up step fills the pool
        guarded(mode, warm)
    for r in range(a.steps):
        order = [m for m in modes[r % len(modes):] + modes[:r % len(modes)] if m in steps]
        for mode in order:
            def step(mode=mode):
                model, ids, ctx = prepare(mode)
                steps[mode].append(one_timed_step(model, ids, ctx, cuda))
            guarded(mode, step)
    return steps, failed


def mark_noise(rows, base_mode="full"):
    """Pairs each mode's timed steps with the base mode's of the same round: the ratios of the pairs
    give the spread of time_vs_<base> ([min, max] in time_vs_<base>_paired); when they fall on both
    sides of 1 the difference is within noise (time_vs_<base>_within_noise). A ratio reported as a
    difference thus has every round agree on its direction: for two equal modes that happens with
    probability 2 / 2^steps (1.6% for 7 steps)."""
    for seq in {r["seq"] for r in rows}:
        base = next((r for r in rows if r["seq"] == seq and r["mode"] == base_mode and "step_ms_all" in r), None)
        for r in rows:
            if base is None or r["seq"] != seq or "step_ms_all" not in r:
                continue
            pairs = [x / y for x, y in zip(r["step_ms_all"], base["step_ms_all"])]
            if len(pairs) == len(base["step_ms_all"]) and pairs:
                r[f"time_vs_{base_mode}_paired"] = [min(pairs), max(pairs)]
                r[f"time_vs_{base_mode}_within_noise"] = min(pairs) <= 1.0 <= max(pairs)


def fmt_time_ratio(r, base):
    """The step-time ratio, or 'within noise' when the paired rounds disagree on which mode is faster."""
    x = r.get(f"time_vs_{base}")
    if x is None:
        return "n/a"
    if r["mode"] == base:
        return "base"
    return "within noise" if r.get(f"time_vs_{base}_within_noise") else fmt_ratio(x)


def fmt_paired(r, base):
    """The range of the paired-round ratios behind fmt_time_ratio."""
    spread = r.get(f"time_vs_{base}_paired")
    return "n/a" if spread is None or r["mode"] == base else f"{spread[0]:.2f}-{spread[1]:.2f}"


def length_schedule(a):
    """The padded sequence length of each step of the varying-length pass: uniform over the
    multiples of a.pad_to in [MIN, MAX], drawn with a.seed."""
    lo, hi = a.length_range
    grid = list(range(-(-lo // a.pad_to) * a.pad_to, hi + 1, a.pad_to))
    rng = random.Random(a.seed)
    return [rng.choice(grid) for _ in range(a.length_steps)]


def run_lengths(a, model, device, cuda):
    """The varying-length pass: a.length_steps steps of every mode in a.length_mode_list, a padded
    length drawn per step (the same for every mode), modes interleaved round by round, from an
    emptied pool. Per mode: host allocations and frees of every step and the step times. Once the
    longest step has run, no step may allocate or free (checked)."""
    lengths = length_schedule(a)
    ckpt_offload.synchronize()
    ckpt_offload.host_pool().empty_cache()  # start empty, so that the allocations show
    modes = list(a.length_mode_list)
    per = {m: [] for m in modes}
    failed = {}
    for i, seq in enumerate(lengths):
        ids = make_ids(a, seq, device)
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            if mode in failed:
                continue
            row, ok = run_guarded(lambda: (one_timed_step(model, ids, apply_mode(model, mode, a), cuda), True), mode, seq)
            if ok is None:
                failed[mode] = row["error"]
            else:
                per[mode].append(row)
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    longest = lengths.index(max(lengths))
    rows, problems = [], []
    for mode in modes:
        if mode in failed:
            rows.append(dict(mode=mode, error=failed[mode]))
            problems.append(f"varying lengths, {mode}: {failed[mode]}")
            continue
        steps = per[mode]
        times = [x["ms"] for x in steps]
        allocs = [x["host_alloc_calls"] for x in steps]
        frees = [x["host_free_calls"] for x in steps]
        row = dict(mode=mode, lengths=lengths, longest_step=longest, host_alloc_calls_per_step=allocs,
                   host_free_calls_per_step=frees, allocs_after_longest=sum(allocs[longest + 1:]),
                   frees_after_longest=sum(frees[longest + 1:]), step_ms_all=times,
                   step_ms_min=min(times), step_ms_median=statistics.median(times), step_ms_max=max(times),
                   host_reserved_bytes=steps[-1]["host_reserved_bytes"],
                   host_peak_bytes=max(x["host_peak_bytes"] for x in steps))
        rows.append(row)
        if row["allocs_after_longest"] or row["frees_after_longest"]:
            problems.append(f"varying lengths, {mode}: {row['allocs_after_longest']} host allocations and "
                            f"{row['frees_after_longest']} frees after the longest step")
    return rows, problems


def print_lengths(rows, a, cuda):
    if not rows:
        return
    lengths = next((r["lengths"] for r in rows if "lengths" in r), [])
    longest = next((r["longest_step"] for r in rows if "longest_step" in r), None)
    print(f"\nvarying lengths: {len(lengths)} steps, padded length drawn uniformly from multiples of {a.pad_to} in "
          f"{a.length_range[0]}..{a.length_range[1]} (seed {a.seed}); modes interleaved step by step; pool emptied "
          f"first; " + ("GPU timings (CUDA events)" if cuda else CPU_LABEL))
    print(f"lengths: {', '.join(map(str, lengths))}; the longest is step {longest}")
    print_table(["mode", "ms min/med/max", "host allocs per step", "after longest", "frees", "host rsv/peak"],
                [[r["mode"], f"{r['step_ms_min']:.2f}/{r['step_ms_median']:.2f}/{r['step_ms_max']:.2f}",
                  ",".join(map(str, r["host_alloc_calls_per_step"])), r["allocs_after_longest"],
                  sum(r["host_free_calls_per_step"]),
                  f"{fmt_bytes(r['host_reserved_bytes'])}/{fmt_bytes(r['host_peak_bytes'])}"]
                 if "error" not in r else [r["mode"], r["error"], "", "", "", ""] for r in rows])


# Defaults of the varying-length pass per configuration: a short pass on the CPU, none on a GPU
# unless asked for (--lengths 2048:8192 there).
LENGTH_DEFAULTS = {"small": dict(lengths="16:64", length_steps=12, pad_to=8),
                   "standard": dict(lengths="off", length_steps=20, pad_to=64)}
LENGTH_MODES = "full,async_offload,offload_activations"


def add_length_args(p):
    p.add_argument("--lengths", metavar="MIN:MAX",
                   help="varying-length pass: a padded length drawn per step from MIN..MAX ('off': none; "
                        "default 16:64 on the CPU, off on a GPU)")
    p.add_argument("--length-steps", type=int, help="steps of the varying-length pass (12 CPU, 20 GPU)")
    p.add_argument("--pad-to", type=int, help="lengths are multiples of this (8 CPU, 64 GPU)")
    p.add_argument("--length-modes", default=LENGTH_MODES, help="modes of the varying-length pass")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths")


def finish_length_args(a, p, config):
    for k, v in LENGTH_DEFAULTS[config].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.length_range = None
    if a.lengths != "off":
        try:
            lo, hi = (int(x) for x in a.lengths.split(":"))
        except ValueError:
            p.error(f"--lengths must be MIN:MAX (two integers) or 'off', got {a.lengths!r}")
        if not 0 < lo <= hi:
            p.error(f"--lengths MIN:MAX needs 0 < MIN <= MAX, got {a.lengths!r}")
        if a.pad_to < 1 or -(-lo // a.pad_to) * a.pad_to > hi:
            p.error(f"--pad-to {a.pad_to}: no multiple of it lies in {lo}..{hi}")
        if a.length_steps < 1:
            p.error("--length-steps must be at least 1")
        a.length_range = (lo, hi)
    a.length_mode_list = a.length_modes.split(",")
    unknown = set(a.length_mode_list) - set(MODES)
    if unknown:
        p.error(f"--length-modes: unknown modes {sorted(unknown)}; choose from {MODES}")


# -- --budget: the configuration plan_memory chooses, beside the uniform ones ----------------------
# One setting for every block (enable_checkpointing's every_n_layers / offload / policy): the comparison.
UNIFORM = ["none", "full", "every2", "every4", "async_offload", "every2_async", "attn_offload"]


def plan_length(model, ids, a, runnable, seq):
    """With --budget: profiles the model on ids and keeps the plan for a.budget device bytes a step in
    a.plan (apply_mode's "planned"). Returns {"planned": error row} when planning failed (it then
    leaves runnable), else {}."""
    if "planned" not in runnable:
        return {}
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    plan, ok = run_guarded(lambda: (ckpt_offload.plan_memory(model, (ids,), a.budget, loss_fn=lambda loss: loss,
                                                             verbose=True), True), "planned", seq)
    if ok is None:
        runnable.remove("planned")
        return {"planned": plan}
    a.plan = plan
    print(f"\nplan for {a.budget} bytes at seq {seq}:\n{plan.table()}", flush=True)
    return {}


def absolute_peak(r, cuda):
    """The step's peak as the budget counts it: max_memory_allocated on a GPU; on the CPU the live
    bytes above weights, gradients and inputs plus those."""
    if cuda:
        return r.get("peak_device_bytes")
    return None if r.get("live_peak_bytes") is None else r["live_peak_bytes"] + r["base_bytes"]


def evaluate_budget(rows, budget, cuda):
    """Per sequence length: the planned row against the fastest uniform configuration whose measured
    peak fits the budget. met: planned step time <= that one's (judged on a GPU only)."""
    out = []
    for seq in sorted({r["seq"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        plan = by.get("planned")
        fits = [by[m] for m in UNIFORM if m in by and absolute_peak(by[m], cuda) is not None
                and absolute_peak(by[m], cuda) <= budget]
        best = min(fits, key=lambda r: r["step_ms_median"]) if fits else None
        entry = dict(seq=seq, budget_bytes=budget, fastest_uniform=best and best["mode"],
                     fastest_uniform_ms=best and best["step_ms_median"], planned_ms=plan and plan["step_ms_median"],
                     planned_peak_bytes=plan and absolute_peak(plan, cuda),
                     predicted_peak_bytes=plan and plan["predicted_peak_bytes"], plan_modes=plan and plan["plan_modes"])
        if plan is None:
            entry.update(met=None, note="the planned configuration did not run")
        elif best is None:
            entry.update(met=None, note="no uniform configuration fits the budget")
        elif not cuda:
            entry.update(met=None, note="CPU run: judged on a GPU")
        else:
            entry.update(met=plan["step_ms_median"] <= best["step_ms_median"], note="")
        out.append(entry)
    return out


def print_budget(entries):
    print("\n--budget: the planned configuration beside the fastest uniform one that fits (target: planned ms <= it)")
    print_table(["seq", "budget", "plan peak", "predicted", "plan ms", "fastest fitting", "its ms", "verdict", "note"],
                [[e["seq"], fmt_bytes(e["budget_bytes"]), fmt_bytes(e["planned_peak_bytes"]), fmt_bytes(e["predicted_peak_bytes"]),
                  fmt_ms(e["planned_ms"]), e["fastest_uniform"] or "n/a", fmt_ms(e["fastest_uniform_ms"]),
                  "met" if e["met"] else ("MISSED" if e["met"] is False else "n/a"), e["note"]] for e in entries])
    for e in entries:
        if e["plan_modes"]:
            print(f"plan @ seq {e['seq']}: {', '.join(e['plan_modes'])}")


# -- checks ---------------------------------------------------------------------------------------
def compare(ref, other, cuda, bitwise):
    """Empty string when they agree, else what differs."""
    (l0, g0), (l1, g1) = ref, other
    if cuda:  # bf16, and attention backward may use atomics: (sum, norm) within tolerance, scaled by the norm
        bad = sum(not (abs(a[1] - b[1]) <= 2e-2 * a[1] + 1e-12 and abs(a[0] - b[0]) <= 5e-2 * a[1] + 1e-12)
                  for a, b in zip(g0, g1))
        if not torch.allclose(l0, l1, rtol=1e-2, atol=1e-3):
            return f"loss differs ({l0.item()} vs {l1.item()})"
        return f"{bad} gradient fingerprints differ beyond bf16 tolerance" if bad else ""
    if bitwise:
        if not torch.equal(l0, l1):
            return f"loss differs bitwise ({l0.item()!r} vs {l1.item()!r})"
        bad = sum(not torch.equal(a, b) for a, b in zip(g0, g1))
        return f"{bad} gradients differ bitwise" if bad else ""
    if not torch.allclose(l0, l1, rtol=1e-5, atol=1e-6):
        return f"loss differs ({l0.item()} vs {l1.item()})"
    bad = sum(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g0, g1))
    return f"{bad} gradients differ" if bad else ""


def run_checks(rows, refs, base, bitwise_pairs, cuda, restored):
    problems = []
    for mode, ref in refs.items():
        if mode != base and base in refs and (err := compare(refs[base], ref, cuda, False)):
            problems.append(f"{mode} vs {base}: {err}")
        other = bitwise_pairs.get(mode)
        if other in refs and (err := compare(refs[other], ref, cuda, True)):
            problems.append(f"{mode} vs {other} (bitwise): {err}")
    for r in rows:
        if r.get("error", "").startswith("failed"):
            problems.append(f"{r['mode']}@{r['seq']}: {r['error']}")
        if r.get("host_alloc_calls_timed"):
            problems.append(f"{r['mode']}@{r['seq']}: {r['host_alloc_calls_timed']} host allocations in timed steps")
        if r.get("compiled_graphs") == 0:
            problems.append(f"{r['mode']}@{r['seq']}: --compile made no graph (the blocks ran eagerly)")
        if r.get("graphs_compiled_in_timed_steps"):
            problems.append(f"{r['mode']}@{r['seq']}: {r['graphs_compiled_in_timed_steps']} recompiles in timed steps")
    if not restored:
        problems.append("disable_checkpointing did not restore the model exactly")
    return problems


# -- the transformers comparison --------------------------------------------------------------------
def hf_support():
    """(transformers, integrations.hf, parameters of transformers' checkpointing switch) or
    (None, reason)."""
    try:
        import inspect

        import transformers
        from ckpt_offload.integrations import hf
    except ImportError as err:
        return None, f"transformers comparison skipped: {err}"
    switch = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
    switch = switch or transformers.PreTrainedModel.gradient_checkpointing_enable
    return (transformers, hf, set(inspect.signature(switch).parameters)), ""


def build_hf_model(transformers, a, device, dtype):
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=max(a.seq_list),
        attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def apply_hf_mode(model, mode, a, hf, params):
    """Returns an error string when this transformers lacks what the mode needs."""
    hf.disable(model)
    if mode == "hf_none":
        return ""
    if "every_n_layers" not in params:
        return "this transformers' checkpointing switch has no every_n_layers"
    kw = dict(checkpoint_kwargs={"use_reentrant": False}, every_n_layers=a.hf_every)
    if mode == "hf_gc":
        hf.checkpointing_enable(model, **kw)
    elif mode == "hf_gc_sync_offload":
        if "offload" not in params:
            return "this transformers' checkpointing switch has no offload"
        hf.checkpointing_enable(model, **kw, offload=True)
    else:
        hf.enable(model, every_n_layers=a.hf_every, offload=True, keep_last=a.keep_last, prefetch=a.prefetch)
    return ""


class HFLoss(nn.Module):
    """Gives the transformers model this script's (ids -> loss) call."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def run_hf(a, device, cuda, bar, result, write):
    support, note = hf_support()
    if support is None:
        print(note)
        return [], [note]
    transformers, hf, params = support
    model = build_hf_model(transformers, a, device, a.torch_dtype)
    wrapped = HFLoss(model)
    rows, problems = [], []
    for seq in a.seq_list:
        ids = make_ids(a, seq, device)
        refs, skipped = {}, {}
        for mode in HF_MODES:  # which modes this transformers can run
            try:
                err = apply_hf_mode(model, mode, a, hf, params)
            except Exception as exc:  # a transformers version this script does not know: say so, go on
                err = f"{type(exc).__name__}: {exc}"
            if err:
                print(f"{mode}: skipped: {err}")
                skipped[mode] = err
        modes = [m for m in HF_MODES if m not in skipped]

        def prepare(mode):
            apply_hf_mode(model, mode, a, hf, params)
            return wrapped, ids, contextlib.nullcontext

        bar.set_description(f"timed steps, seq={seq}")
        timed, failed = interleaved_timing(modes, prepare, a, cuda, seq)
        for mode in HF_MODES:
            bar.set_description(f"{mode} seq={seq}")
            if mode in skipped:
                rows.append(dict(mode=mode, seq=seq, skipped=skipped[mode]))
            elif mode in failed:
                rows.append(failed[mode])
            else:
                prepare(mode)
                row, refs[mode] = run_guarded(
                    lambda: measure(wrapped, ids, mode, contextlib.nullcontext, a, cuda, timed[mode]), mode, seq)
                rows.append(row)
            bar.update(1)
            result.update(rows=rows)
            write()  # partial results survive a timeout
        hf.disable(model)
        refs = {m: r for m, r in refs.items() if r is not None}
        problems += run_checks([r for r in rows if r["seq"] == seq], refs, "hf_gc", HF_BITWISE, cuda, True)
    return rows, problems


# -- environment, output --------------------------------------------------------------------------
def hardware_info():
    info = dict(python=platform.python_version(), torch=torch.__version__, cuda_runtime=torch.version.cuda,
                cpu=cpu_model(), cpu_count=os.cpu_count(), gpu=None, gpu_driver=None)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, gpu_capability=f"{p.major}.{p.minor}")
        q = "driver_version,pcie.link.gen.current,pcie.link.width.current"
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["gpu_driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
        except (OSError, subprocess.SubprocessError):
            pass  # no nvidia-smi: the driver stays unknown
    info["ckpt_offload_build"] = ckpt_offload.build_info()
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info["command"] = " ".join([sys.executable] + sys.argv)
    return info


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def fmt_ratio(x):
    return "n/a" if x is None else f"{x:.3f}x"


def print_table(headers, rows):
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(line(headers))
    print(line("-" * w for w in widths))
    for r in rows:
        print(line(r))


def add_ratios(rows, base_mode="full"):
    for seq in {r["seq"] for r in rows}:
        base = next((r for r in rows if r["seq"] == seq and r["mode"] == base_mode and "step_ms_median" in r), None)
        for r in rows:
            if r["seq"] != seq or "step_ms_median" not in r or base is None:
                continue
            r[f"time_vs_{base_mode}"] = r["step_ms_median"] / base["step_ms_median"]
            # The device peak on a GPU; on the CPU, the peak of live tensors (what the table shows there).
            key = "peak_device_bytes" if base.get("peak_device_bytes") is not None else "live_peak_bytes"
            pb, pr = base.get(key), r.get(key)
            r[f"peak_vs_{base_mode}"] = pr / pb if pb and pr else None


def savings(rows, a):
    """Theoretical (offloaded layers x b x s x h x bytes) beside measured peak differences."""
    out = []
    pairs = [("async_offload", "full"), ("every2_async", "every2"), ("sync_offload", "full"), ("attn_offload", "full")]
    for seq in a.seq_list:
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        for mode, base in pairs:
            if mode in by and base in by:
                theory = by[mode]["offloaded_layers"] * a.batch * seq * a.hidden * a.elem
                key = "peak_device_bytes" if a.cuda else "live_peak_bytes"  # CPU: tracked live tensor bytes
                pb, pm = by[base].get(key), by[mode].get(key)
                measured = pb - pm if pb is not None and pm is not None else None
                ab, am = by[base]["act_device_bytes"], by[mode]["act_device_bytes"]
                out.append(dict(seq=seq, mode=mode, vs=base, theoretical_bytes=theory, measured_bytes=measured,
                                fraction=measured / theory if measured is not None and theory else None,
                                after_forward_bytes=ab - am if ab is not None and am is not None else None))
                if mode == "attn_offload":
                    out[-1].update(attention_figures(a, seq, by[mode]["offloaded_layers"]))
    return out


def attention_figures(a, seq, offloaded_layers):
    """What attn_offload moves and spares per step: the attention outputs (b x s x h, plus the fp32
    logsumexp b x heads x s) of the offloaded layers go to the host, device bytes a policy saving them
    on the device would hold; and the attention forward every checkpointed layer does not recompute,
    2·b·s²·h FLOPs for QKᵀ and PV each, halved by the causal mask."""
    per_layer = a.batch * seq * a.hidden * a.elem + a.batch * a.heads * seq * 4
    return dict(attn_host_bytes=offloaded_layers * per_layer,
                recompute_avoided_flop=a.layers * 2 * a.batch * seq * seq * a.hidden)


# The targets of the standard run on a GPU (benchmarks/README.md says where they come from).
TARGET_TIME_VS_FULL = 1.03        # async offload step time / full checkpointing
TARGET_OVERHEAD_VS_SYNC = 1 / 3   # async overhead over full / synchronous offload's overhead over full
TARGET_SAVING_FRACTION = 0.95     # measured peak saving / theoretical saving
TARGET_LINK_FRACTION = 0.85       # copy throughput in the step / pinned peak measured in this run
TARGET_ATTN_TIME_VS_FULL = 0.96   # attn_offload step time / full checkpointing, judged from ATTN_TARGET_SEQ
TARGET_ATTN_ACT_VS_ASYNC = 1.05   # attn_offload activation bytes at the step peak / async_offload's
ATTN_TARGET_SEQ = 8192            # shorter sequences: too little attention to win back the extra copy


def evaluate_targets(rows, saves, link, cuda):
    """One entry per target and sequence length: value, threshold, met (True, False, or None when it
    cannot be judged, with the reason), and the figures that explain a miss."""
    out = []

    def add(target, seq, value, threshold, met, note=""):
        out.append(dict(target=target, seq=seq, value=value, threshold=threshold, met=met, note=note))

    for seq in sorted({r["seq"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        asy, full, sync = by.get("async_offload"), by.get("full"), by.get("sync_offload")
        why = "CPU run: targets are judged on a GPU" if not cuda else ""
        explain = ""
        if asy:
            explain = (f"reload wait {fmt_ms(asy.get('reload_wait_ms_profiled'))} in a profiled step; copies "
                       f"D2H {fmt_rate(asy.get('d2h_gb_per_s'))}, H2D {fmt_rate(asy.get('h2d_gb_per_s'))}")
        if asy and full:
            t = asy["step_ms_median"] / full["step_ms_median"]
            add("async_offload time / full", seq, t, TARGET_TIME_VS_FULL,
                None if why else t <= TARGET_TIME_VS_FULL, why or explain)
        else:
            add("async_offload time / full", seq, None, TARGET_TIME_VS_FULL, None, "async_offload or full did not run")
        if asy and full and sync:
            over_a = asy["step_ms_median"] - full["step_ms_median"]
            over_s = sync["step_ms_median"] - full["step_ms_median"]
            if over_s > 0:
                v = over_a / over_s
                add("async overhead / sync overhead", seq, v, TARGET_OVERHEAD_VS_SYNC,
                    None if why else v <= TARGET_OVERHEAD_VS_SYNC, why or explain)
            else:
                add("async overhead / sync overhead", seq, None, TARGET_OVERHEAD_VS_SYNC, None,
                    why or f"sync_offload was not slower than full ({over_s:+.2f} ms): no overhead to compare")
        else:
            add("async overhead / sync overhead", seq, None, TARGET_OVERHEAD_VS_SYNC, None,
                "async_offload, sync_offload or full did not run")
        sv = next((x for x in saves if x["seq"] == seq and x["mode"] == "async_offload"), None)
        frac = sv["fraction"] if sv else None
        add("async_offload saving / theoretical", seq, frac, TARGET_SAVING_FRACTION,
            None if why or frac is None else frac >= TARGET_SAVING_FRACTION,
            why or ("" if frac is not None else "no measured saving") or
            (f"theoretical {fmt_bytes(sv['theoretical_bytes'])}, measured {fmt_bytes(sv['measured_bytes'])}; "
             f"device bytes after forward: async {fmt_bytes(asy and asy.get('act_device_bytes'))}, "
             f"full {fmt_bytes(full and full.get('act_device_bytes'))}"))
        peak = (link or {}).get(seq)
        for d in ("d2h", "h2d"):
            key = f"{d}_gb_per_s"
            got, ref = (asy or {}).get(key), (peak or {}).get(key)
            frac = got / ref if got and ref else None
            add(f"{d.upper()} throughput in the step / pinned peak", seq, frac, TARGET_LINK_FRACTION,
                None if why or frac is None else frac >= TARGET_LINK_FRACTION,
                why or (f"{fmt_rate(got)} in the step, pinned peak {fmt_rate(ref)} at "
                        f"{fmt_bytes(peak['block_bytes'])} blocks" if frac is not None else "not measured"))
    attn_targets(rows, cuda, add)
    allocs = [r for r in rows if "step_ms_median" in r and r.get("host_alloc_calls_timed")]
    timed = [r for r in rows if "step_ms_median" in r]
    add("host allocations after the first step", None, sum(r["host_alloc_calls_timed"] for r in allocs), 0,
        (not allocs) if timed else None,
        ", ".join(f"{r['mode']}@{r['seq']}: {r['host_alloc_calls_timed']}" for r in allocs) or
        ("" if timed else "no mode ran"))
    return out


def attn_targets(rows, cuda, add):
    """The attn_offload targets, only where that mode ran: faster than full checkpointing, at the
    device memory of async_offload."""
    for seq in sorted({r["seq"] for r in rows if r["mode"] == "attn_offload"}):
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        att, full, asy = by.get("attn_offload"), by.get("full"), by.get("async_offload")
        why = "CPU run: targets are judged on a GPU" if not cuda else ""
        if att and full:
            t = att["step_ms_median"] / full["step_ms_median"]
            short = "" if seq >= ATTN_TARGET_SEQ else f"judged at seq {ATTN_TARGET_SEQ} and longer"
            add("attn_offload time / full", seq, t, TARGET_ATTN_TIME_VS_FULL,
                None if why or short else t <= TARGET_ATTN_TIME_VS_FULL,
                why or short or f"reload wait {fmt_ms(att.get('reload_wait_ms_profiled'))} in a profiled step")
        else:
            add("attn_offload time / full", seq, None, TARGET_ATTN_TIME_VS_FULL, None, "attn_offload or full did not run")
        # Activation bytes at the step peak (above weights, gradients and inputs). After forward the
        # keep_last layers' attention outputs add to attn_offload; at the peak, full checkpointing's
        # recompute of that layer materialises them too.
        acts = [x and activation_peak(x) for x in (att, asy)]
        if all(acts):
            v = acts[0] / acts[1]
            add("attn_offload activation peak / async_offload", seq, v, TARGET_ATTN_ACT_VS_ASYNC,
                None if why else v <= TARGET_ATTN_ACT_VS_ASYNC,
                why or f"{fmt_bytes(acts[0])} against {fmt_bytes(acts[1])}; after forward "
                       f"{fmt_bytes(att['act_device_bytes'])} against {fmt_bytes(asy['act_device_bytes'])}")
        else:
            add("attn_offload activation peak / async_offload", seq, None, TARGET_ATTN_ACT_VS_ASYNC, None,
                "attn_offload or async_offload did not run")


def activation_peak(r):
    """Bytes of activations at the step peak: max_memory_allocated above what the step started with
    on a GPU, the tracked live peak on the CPU; None when not measured."""
    if r.get("base_device_bytes") is not None and r.get("peak_device_bytes") is not None:
        return r["peak_device_bytes"] - r["base_device_bytes"]
    return r.get("live_peak_bytes")


def fmt_ms(x):
    return "n/a" if x is None else f"{x:.2f} ms"


def fmt_rate(x):
    return "n/a" if x is None else f"{x:.1f} GB/s"


def print_targets(targets):
    print("\ntargets (standard run on a GPU):")
    verdict = lambda t: "met" if t["met"] else ("MISSED" if t["met"] is False else "n/a")  # noqa: E731
    value = lambda t: "n/a" if t["value"] is None else (  # noqa: E731
        f"{t['value']:.3f}" if isinstance(t["value"], float) else str(t["value"]))
    print_table(["target", "seq", "value", "threshold", "verdict", "figures"],
                [[t["target"], t["seq"] or "all", value(t), f"{t['threshold']:.3g}", verdict(t), t["note"]]
                 for t in targets])
    missed = [t for t in targets if t["met"] is False]
    if missed:
        print("TARGETS MISSED: " + "; ".join(f"{t['target']} @ {t['seq'] or 'all'}" for t in missed))


def print_results(rows, saves, cuda, base, title, wide=False):
    print("\n" + textwrap.fill(f"{title}; {OPTIMIZER_NOTE}; " + ("GPU timings (CUDA events)" if cuda else CPU_LABEL),
                               width=120, subsequent_indent="  "))
    fb = lambda key: lambda r: fmt_bytes(r[key])  # noqa: E731
    # (header, cell, in the default table): the default keeps to about 120 characters; --wide and
    # the JSON have the rest.
    cols = [("mode", lambda r: r["mode"], True), ("seq", lambda r: r["seq"], True),
            ("ms med", lambda r: f"{r['step_ms_median']:.2f}", True),
            ("ms min-max", lambda r: f"{r['step_ms_min']:.2f}-{r['step_ms_max']:.2f}", False),
            (f"t/{base}", lambda r: fmt_time_ratio(r, base), True),
            (f"t/{base} rounds", lambda r: fmt_paired(r, base), False),
            ("peak dev" if cuda else "peak live*", fb("peak_device_bytes" if cuda else "live_peak_bytes"), True),
            (f"peak/{base}", lambda r: fmt_ratio(r.get(f"peak_vs_{base}")), True),
            ("act dev", fb("act_device_bytes"), True),
            ("act host", fb("act_host_bytes"), False), ("D2H/step", fb("bytes_offloaded_per_step"), True),
            ("H2D/step", fb("bytes_prefetched_per_step"), False),
            ("host rsv/peak", lambda r: f"{fmt_bytes(r['host_reserved_bytes'])}/{fmt_bytes(r['host_peak_bytes'])}",
             False),
            ("allocs", lambda r: r["host_alloc_calls_timed"], True),
            ("wait ms*", lambda r: "n/a" if r["reload_wait_ms_profiled"] is None else f"{r['reload_wait_ms_profiled']:.2f}",
             cuda),
            ("D2H/H2D GB/s*", lambda r: "n/a" if r["d2h_gb_per_s"] is None else
             f"{r['d2h_gb_per_s']:.1f}/{r['h2d_gb_per_s'] or 0:.1f}", False)]
    cols = [c for c in cols if wide or c[2]]
    print_table([c[0] for c in cols], [[f(r) for _, f, _ in cols] for r in rows if "step_ms_median" in r])
    shown = {c[0] for c in cols}
    notes = [f"t/{base}, peak/{base}: step time and peak over {base}'s at the same length; the peak is "
             + ("the device's (max_memory_allocated)" if cuda else "the peak of live tensors (no device memory on CPU)"),
             f"t/{base}: modes timed round-robin; 'within noise' when the ratios of the paired rounds fall on both "
             f"sides of 1 (t/{base} rounds, with --wide: their range)",
             "act dev: device bytes held after forward; D2H/step: bytes offloaded per step; allocs: host pool "
             "allocations in the timed steps (0 in steady state)"]
    if not cuda:
        notes.append("peak live: most bytes of live tensors during a step above weights, gradients and inputs "
                     "(tracked on the CPU)")
    if "wait ms*" in shown:
        notes.append("wait ms: compute-stream wait for reloads, in a separate profiled step (GPU only)")
    if "D2H/H2D GB/s*" in shown:
        notes.append("D2H/H2D GB/s: throughput of the engine's copies on their copy streams in that profiled step "
                     "(CPU: synchronous copies)")
    if "host rsv/peak" in shown:
        notes.append("act host: pool bytes in use after forward; host rsv/peak: pool bytes this mode's untimed steps "
                     "reserved, from an empty pool / peak in use in the timed steps")
    if not wide:
        notes.append(f"--wide adds: spread, t/{base} rounds, act host, H2D/step, host rsv/peak" + ("" if cuda else ", wait ms")
                     + ", copy GB/s; the JSON holds every figure")
    for i, n in enumerate(notes):
        print(textwrap.fill(n, width=120, initial_indent="* " if i == 0 else "  ", subsequent_indent="    "))
    for r in rows:
        if "step_ms_median" not in r:
            print(f"{r['mode']} seq={r['seq']}: {r.get('skipped') or r.get('error')}")
    for s in saves:
        print(f"saving {s['mode']} vs {s['vs']} @ seq {s['seq']}: theoretical {fmt_bytes(s['theoretical_bytes'])}, "
              f"measured at the peak {fmt_bytes(s['measured_bytes'])}"
              + (f" ({100 * s['fraction']:.1f}%)" if s["fraction"] is not None else " (no device memory on CPU)")
              + (f", after forward {fmt_bytes(s['after_forward_bytes'])}" if s["after_forward_bytes"] is not None else "")
              + (" (CPU tensors: save_on_cpu has nothing to move)" if not cuda and s["mode"] == "sync_offload" else ""))
        if "recompute_avoided_flop" in s:
            print(f"  attn_offload @ seq {s['seq']}: attention outputs moved to the host {fmt_bytes(s['attn_host_bytes'])}"
                  f" (device bytes a save-on-device policy would hold); attention recompute avoided "
                  f"{s['recompute_avoided_flop'] / 1e9:.4g} GFLOP per step")


def plot(rows, a, out_dir, prefix, base):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (the JSON holds every figure)")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "step_ms_median" in r]
    modes = [m for m in MODES + HF_MODES if any(r["mode"] == m for r in rows)]
    files = []

    def save(fig, name):
        files.append(os.path.join(out_dir, f"{prefix}_{name}.png"))
        fig.tight_layout()
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    for key, label, name in [("peak_device_bytes", "peak device memory (GiB)", "peak_memory"),
                             (f"time_vs_{base}", f"step time / {base}", "time_ratio")]:
        if not any(r.get(key) for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / len(a.seq_list)
        for j, seq in enumerate(a.seq_list):
            vals = [next((r.get(key) or 0 for r in rows if r["mode"] == m and r["seq"] == seq), 0) for m in modes]
            vals = [v / 2**30 for v in vals] if key.endswith("bytes") else vals
            ax.bar([i + j * width for i in range(len(modes))], vals, width, label=f"seq {seq}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(modes))], modes, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.legend()
        ax.set_title(f"{label}{'' if a.cuda else ' - ' + CPU_LABEL}", fontsize=9)
        save(fig, name)
    if len(a.seq_list) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m in modes:
            pts = sorted((r["seq"], r.get(f"time_vs_{base}"), r.get("peak_device_bytes")) for r in rows if r["mode"] == m)
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
            if a.cuda:
                axes[1].plot([p[0] for p in pts], [p[2] / 2**30 for p in pts], marker="o", label=m)
        if not a.cuda:
            axes[1].text(0.5, 0.5, "no device memory on CPU", ha="center", transform=axes[1].transAxes)
        axes[0].set(xlabel="sequence length", ylabel=f"step time / {base}")
        axes[1].set(xlabel="sequence length", ylabel="peak device memory (GiB)")
        axes[0].legend(fontsize=7)
        save(fig, "seq_sweep")
    return files


# -- driver ---------------------------------------------------------------------------------------
class _NoBar:
    """Stands in for tqdm where it is not installed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_description(self, *_):
        pass

    def update(self, *_):
        pass


def progress_bar(total):
    """A tqdm bar on stderr when tqdm is installed (transformers depends on it), else a silent one."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, file=sys.stderr, leave=False)


MODE_HELP = {
    "none": "no checkpointing",
    "full": "every block checkpointed",
    "every2": "blocks 0, 2, 4, ... checkpointed",
    "every4": "blocks 0, 4, 8, ... checkpointed",
    "sync_offload": "full checkpointing, inputs through torch's save_on_cpu (what transformers' offload=True does)",
    "async_offload": "full checkpointing, inputs offloaded by ckpt_offload",
    "every2_async": "every2, inputs offloaded by ckpt_offload",
    "offload_activations": "no checkpointing, every saved activation offloaded (ckpt_offload.offload_activations)",
    "attn_offload": "full checkpointing, inputs and attention outputs offloaded (policy=\"attention\"): "
                    "attention is not recomputed",
}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="modes:\n" + "\n".join(f"  {m:<20} {MODE_HELP[m]}" for m in MODES))
    small, std = CONFIGS["small"], CONFIGS["standard"]
    p.add_argument("--config", choices=sorted(CONFIGS), help="small without a GPU, standard with one (the default "
                   "picks by the GPU); the options below override single fields of it")
    sizes = {"layers": "decoder blocks", "hidden": "hidden size", "heads": "attention heads",
             "kv-heads": "key/value heads (grouped-query attention)", "mlp": "MLP width",
             "batch": "sequences per step", "vocab": "vocabulary size (small: the blocks' activations dominate)",
             "warmup": "untimed steps before the timed ones (the first fills the host pool)",
             "steps": "timed steps per mode and length"}
    for name, what in sizes.items():
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=int, help=f"{what} (small: {small[key]}, standard: {std[key]})")
    p.add_argument("--seqs", "--seq-sweep", dest="seqs",
                   help=f"comma-separated sequence lengths (small: {small['seqs']}, standard: {std['seqs']})")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help=f"parameter and activation dtype (small: {small['dtype']}, standard: {std['dtype']})")
    p.add_argument("--no-rope", dest="rope", action="store_false", help="leave out rotary position embeddings")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated modes to run, in this order; valid: " + ", ".join(MODES) +
                   " (default: all; see 'modes' below)")
    p.add_argument("--keep-last", type=int, default=1,
                   help="checkpointed layers whose inputs stay on the device in the async modes (default 1)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="offloaded layers on their way back ahead of need in the async modes (default 1)")
    p.add_argument("--min-bytes", type=int, help="offload_activations threshold (1 MiB on GPU, 0 on CPU)")
    p.add_argument("--hf", action="store_true",
                   help="compare transformers' checkpointing/offload instead (modes " + ", ".join(HF_MODES) + ")")
    p.add_argument("--hf-every", type=int, default=1, help="every_n_layers for the --hf comparison")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="every mode with every block compiled (block.compile(backend=BACKEND), default inductor), "
                        "modes timed one after another; opt-in on the CPU, where compiling is slow")
    p.add_argument("--budget-s", type=float, help="skip what is left after this many seconds")
    p.add_argument("--budget", type=int, help="device bytes of a step (weights, gradients and inputs included): "
                   "also run the configuration plan_memory chooses for it (mode 'planned') beside the others")
    p.add_argument("--wide", action="store_true",
                   help="print every column (spread, H2D bytes, host pool, reload wait, copy throughput); the "
                   "default table keeps to about 120 characters; the JSON always holds every figure")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                   help="directory for the JSON and the plots (default: benchmarks/out)")
    add_length_args(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    a.cuda = torch.cuda.is_available() and ckpt_offload.build_info()["cuda_usable"]
    if a.config == "standard" and not a.cuda:
        why = ("torch sees no GPU" if not torch.cuda.is_available() else
               f"the extension cannot use it (build_info: {ckpt_offload.build_info()})")
        p.error(f"--config standard needs a GPU the extension can use: {why}")
    for k, v in CONFIGS[a.config or ("standard" if a.cuda else "small")].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    finish_length_args(a, p, a.config or ("standard" if a.cuda else "small"))
    a.seq_list = [int(s) for s in a.seqs.split(",")]
    a.mode_list = a.modes.split(",")
    unknown = set(a.mode_list) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if a.compile and a.hf:
        p.error("--compile applies to the decoder stack, not to --hf")
    if a.budget is not None:
        if a.budget <= 0 or a.hf:
            p.error("--budget takes a positive number of bytes, and not with --hf")
        a.mode_list.append("planned")
    if a.budget is not None and a.compile:
        p.error("--budget plans and runs eager blocks; leave out --compile")
    a.torch_dtype = getattr(torch, a.dtype)
    a.elem = torch.finfo(a.torch_dtype).bits // 8
    if a.min_bytes is None:
        a.min_bytes = 1 << 20 if a.cuda else 0
    return a


def make_ids(a, seq, device):
    g = torch.Generator().manual_seed(seq)
    return torch.randint(0, a.vocab, (a.batch, seq), generator=g).to(device)


def run_guarded(fn, mode, seq):
    """Runs one mode; a failure becomes a row that says so (an error other than out of memory is
    also a failed check), and the next mode still runs."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError as err:
        error = f"out of memory: {str(err).splitlines()[0]}"
    except Exception as err:  # noqa: BLE001 - one broken mode must not lose the others' figures
        traceback.print_exc()
        error = f"failed: {type(err).__name__}: {err}"
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(mode=mode, seq=seq, error=error), None


def attn_supported():
    """Whether this torch can run attn_offload (selective offload policies)."""
    return ckpt_offload.policies.HAS_OFFLOAD_POLICY


def run_main(a, device, cuda, bar, t0, result, write):
    torch.manual_seed(0)
    model = Decoder(a, device, a.torch_dtype).train()
    if a.compile:
        compile_blocks(model, a.compile)
    # Same kernels, values only moved: bitwise, unless a code generator compiles each mode's graphs.
    bitwise = BITWISE if a.compile in (None, "eager", "aot_eager") else {}
    rows, problems, restored = [], [], True
    link = result.setdefault("link", {})
    for seq in a.seq_list:
        ids = make_ids(a, seq, device)
        refs = {}
        if cuda:  # the pinned peak at the size of one layer's input, the block size the step moves
            link[seq] = link_peak(a.batch * seq * a.hidden * a.elem, device)
        spent = a.budget_s and time.monotonic() - t0 > a.budget_s
        runnable = [m for m in a.mode_list if not spent and not (m == "attn_offload" and not attn_supported())]
        bar.set_description(f"timed steps, seq={seq}")
        planning_failed = plan_length(model, ids, a, runnable, seq)
        if a.compile:  # one mode after another (measure_mode), each from a reset, with its own counts
            timed, failed = {m: None for m in runnable}, {}
        else:
            timed, failed = interleaved_timing(runnable, lambda m: (model, ids, apply_mode(model, m, a)), a, cuda, seq)
        failed.update(planning_failed)
        ckpt_offload.disable_checkpointing(model)
        model.layer_call = None
        for mode in a.mode_list:
            bar.set_description(f"{mode} seq={seq}")
            if mode in failed:
                rows.append(failed[mode])
            elif mode == "attn_offload" and not attn_supported():
                rows.append(dict(mode=mode, seq=seq, skipped=f"torch {torch.__version__} has no "
                                                             "CheckpointPolicy.MUST_CPU_OFFLOAD (selective offload)"))
            elif mode not in timed or (a.budget_s and time.monotonic() - t0 > a.budget_s):
                rows.append(dict(mode=mode, seq=seq, skipped=f"time budget of {a.budget_s:g} s spent"))
            else:
                row, ref = run_guarded(lambda: measure_mode(model, ids, mode, a, cuda, timed[mode]), mode, seq)
                rows.append(row)
                if ref is not None:  # a mode that ran out of memory never reached disable_checkpointing
                    refs[mode] = ref
                    restored = restored and restored_exactly(model)
            bar.update(1)
        problems += [f"seq {seq}: {p}" for p in run_checks([r for r in rows if r["seq"] == seq], refs, "none",
                                                           bitwise, cuda, restored)]
        add_ratios(rows)
        mark_noise(rows)
        result.update(rows=rows)
        write()  # partial results survive a timeout
    return rows, problems


def main(argv=None):
    a = parse_args(argv)
    cuda = a.cuda
    if not cuda:
        os.environ["CKPT_OFFLOAD_TEST_CPU"] = "1"  # read when a session is created: CPU tensors use the pool
        torch.set_num_threads(1)  # tiny tensors; extra threads only spin against other processes
    device = torch.device("cuda" if cuda else "cpu")
    os.makedirs(a.out, exist_ok=True)
    prefix = "bench_step_hf" if a.hf else "bench_step"
    t0 = time.monotonic()
    result = dict(kind=prefix, note=OPTIMIZER_NOTE, timing=("CUDA events" if cuda else CPU_LABEL),
                  hardware=hardware_info(),
                  config={k: v for k, v in vars(a).items() if k not in ("torch_dtype",)})
    json_path = os.path.join(a.out, prefix + ".json")

    def write():
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    total = len(a.seq_list) * (len(HF_MODES) if a.hf else len(a.mode_list))
    with progress_bar(total) as bar:
        if a.hf:
            rows, problems = run_hf(a, device, cuda, bar, result, write)
            add_ratios(rows, "hf_gc")
            mark_noise(rows, "hf_gc")
            saves = []
        else:
            rows, problems = run_main(a, device, cuda, bar, t0, result, write)
            saves = savings(rows, a)
            result["targets"] = evaluate_targets(rows, saves, result.get("link"), cuda)
            if a.length_range:
                bar.set_description("varying lengths")
                torch.manual_seed(0)
                result["lengths"], length_problems = run_lengths(a, Decoder(a, device, a.torch_dtype).train(), device, cuda)
                problems += length_problems
            if a.budget is not None:
                result["budget"] = evaluate_budget(rows, a.budget, cuda)
    incomplete = [f"{r['mode']}@{r['seq']}: {r['skipped']}" for r in rows if r.get("skipped")]
    result.update(rows=rows, savings=saves, problems=problems, incomplete=incomplete, elapsed_s=time.monotonic() - t0)
    result["plots"] = plot(rows, a, a.out, prefix, "hf_gc" if a.hf else "full") if rows else []
    write()
    title = (f"transformers LlamaForCausalLM (random weights), every_n_layers={a.hf_every}" if a.hf
             else f"decoder stack, {a.layers} layers, hidden {a.hidden}, {a.dtype}")
    print_results(rows, saves, cuda, "hf_gc" if a.hf else "full", title, wide=a.wide)
    print_lengths(result.get("lengths", []), a, cuda)
    if a.compile:
        print(f"\ntorch.compile ({a.compile}), every block: graphs / graph breaks / graphs compiled in timed steps")
        for r in rows:
            if "compiled_graphs" in r:
                print(f"  {r['mode']:>20} @ {r['seq']}: {r['compiled_graphs']} / {r['graph_breaks']} / "
                      f"{r['graphs_compiled_in_timed_steps']}")
    if "targets" in result:
        print_targets(result["targets"])
    if "budget" in result:
        print_budget(result["budget"])
    print(f"\nJSON: {json_path}; plots: {', '.join(result['plots']) or 'none'}; {result['elapsed_s']:.1f} s")
    if incomplete:
        print(f"INCOMPLETE: {len(incomplete)} mode runs skipped:\n  " + "\n  ".join(incomplete))
    if problems:
        print("CHECKS FAILED:\n  " + "\n  ".join(problems))
        return 3
    base = "hf_gc" if a.hf else "none"
    print(("checks passed on what ran: " if incomplete else "checks passed: ") + ("losses and gradient fingerprints agree within bf16 tolerance" if cuda else
                               f"losses and gradients match `{base}` (allclose) and bitwise where expected")
          + "; no host allocations in timed steps" + ("; none after the longest step of the varying-length pass"
                                                        if result.get("lengths") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
