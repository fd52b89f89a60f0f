"""Timed steps: one training step, its clock (CUDA events or perf_counter), modes timed round-robin
with the order rotated, the paired rounds that tell a difference from noise.
"""
from __future__ import annotations

import gc
import statistics
import time
import traceback

import torch

import ckpt_offload


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


def host_timed_step(model, ids, ctx, cuda):
    """One step's host time: wall time (perf_counter) and the process's CPU time (process_time) from
    the forward's start until backward returns, and on a GPU its device time (CUDA events around
    the same span): the step is host-bound when device and host time are close, since the device
    then waits for the host to queue its kernels. On a shared CPU the CPU time leaves out the spells
    the process waited for a core. Starts from a settled device and a collected heap, so that
    neither the previous step's queue nor its garbage counts."""
    settle(cuda)
    gc.collect()
    start = end = None
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0, c0 = time.perf_counter(), time.process_time()
    train_step(model, ids, ctx)
    wall, cpu = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
    if not cuda:
        return dict(host_ms=wall, cpu_ms=cpu, device_ms=None)
    end.record()
    end.synchronize()
    return dict(host_ms=wall, cpu_ms=cpu, device_ms=start.elapsed_time(end))


def settle(cuda):
    if cuda:
        torch.cuda.synchronize()
    ckpt_offload.synchronize()


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
    # A context factory that keeps figures of its own per step (disk_offload's: its disk tier lives for
    # the step only, so stats() has its counts no more) hands over those of the step that just ran.
    own = getattr(ctx, "step_figures", None)
    return dict(ms=ms, host_alloc_calls=s["host_alloc_calls"], host_free_calls=s["host_free_calls"],
                bytes_offloaded=s["bytes_offloaded"], bytes_prefetched=s["bytes_prefetched"],
                host_reserved_bytes=s["host_reserved_bytes"], host_peak_bytes=s["host_peak_bytes"],
                peak_device_bytes=torch.cuda.max_memory_allocated() if cuda else None, base_device_bytes=base,
                tensors_kept_on_device=s["tensors_kept_on_device"], disk=own() if own else None)


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


def interleaved_timing(modes, prepare, a, cuda, seq, timer=None):
    """Warm-up steps of every mode, then a.steps rounds, each timing one step of every mode, the
    order rotated by one from round to round: a slow spell of the machine then falls on every mode
    alike, not on whichever mode was running, and round i of two modes makes a pair. prepare(mode)
    puts the model in that mode and returns (model, ids, ctx); timer(model, ids, ctx, cuda) times
    one step (default one_timed_step). Returns ({mode: [step figures]}, {mode: error row}); a mode
    that fails leaves the rotation."""
    timer = timer or one_timed_step
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
                steps[mode].append(timer(model, ids, ctx, cuda))
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
            # A mode timed apart from the round-robin (modes.TIMED_APART) has no rounds to pair.
            if base is None or r["seq"] != seq or "step_ms_all" not in r or r.get("timed_apart"):
                continue
            pairs = [x / y for x, y in zip(r["step_ms_all"], base["step_ms_all"])]
            if len(pairs) == len(base["step_ms_all"]) and pairs:
                r[f"time_vs_{base_mode}_paired"] = [min(pairs), max(pairs)]
                r[f"time_vs_{base_mode}_within_noise"] = min(pairs) <= 1.0 <= max(pairs)


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
