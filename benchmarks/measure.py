"""The untimed steps of a mode (check, inspection, profiled), the pinned-memory peak of the link, and
the checks of losses and gradients between modes.
"""
from __future__ import annotations

import statistics

import torch

import ckpt_offload
from ckpt_offload.testing import LiveBytes

from .disk_mode import DiskSteps, disk_figures, disk_problems
from .modes import TIMED_APART, apply_mode, compile_counts, offloaded_layers
from .timelines import timeline_step
from .timing import one_timed_step, settle, summarize_steps, train_step


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
    prof.update(timeline_step(model, ids, ctx, a, mode))  # a timeline of one more step, beside the results
    reserved = ckpt_offload.stats()["host_reserved_bytes"]
    return dict(mode=mode, seq=ids.shape[1], loss=float(ref[0]), **{**summarize_steps(timed), "host_reserved_bytes": reserved},
                act_device_bytes=act, live_peak_bytes=live_peak, act_host_bytes=host, **prof, **compiled,
                **disk_figures(timed)), ref


def measure_mode(model, ids, mode, a, cuda, timed=None):
    if a.compile:
        # Each mode compiles afresh, so its counts are its own (inductor's caches keep it quick).
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    ctx = apply_mode(model, mode, a)
    try:
        row, ref = measure(model, ids, mode, ctx, a, cuda, timed)
    finally:
        if isinstance(ctx, DiskSteps):  # each step's backward gives them back; a failed backward may not have
            ctx.close()
    row["base_bytes"] = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers(), ids)) \
        + sum(p.numel() * p.element_size() for p in model.parameters())  # weights, buffers, inputs, gradients
    if mode == "planned":
        row.update(plan_modes=a.plan.modes, predicted_peak_bytes=a.plan.predicted_peak_bytes,
                   predicted_step_ms=a.plan.predicted_step_ms, predicted_host_bytes=a.plan.predicted_host_bytes)
    row["offloaded_layers"] = offloaded_layers(model, mode)
    if mode in TIMED_APART:
        row["timed_apart"] = True
    if isinstance(ctx, DiskSteps):
        row.update(ctx.describe(), disk_left_behind=ctx.left_behind())
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    return row, ref


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
    problems += disk_problems(rows)
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
