"""bench_step's disk_offload mode: async_offload with the host pool capped at half of what the step
offloads and a disk tier under it (host_pool().set_spill_dir), both set for the span of each step
and put back after it; the tier's figures of each step, and what the output says about them.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import textwrap
import time

import torch

import ckpt_offload

from .bench_disk import filesystem_of
from .report import fmt_bytes, fmt_ratio, print_table
from .timing import run_guarded, settle, train_step

DISK_MODE = "disk_offload"


def offload_probe(model, ids, ctx, cuda):
    """What one step of the async_offload configuration (ctx) offloads, measured, not derived from the
    shapes: one untimed step from an empty pool, and the engine's counts of it (tensors_offloaded,
    bytes_offloaded). The cap is half of those bytes rounded up to whole pool blocks, since the cap
    counts blocks (HostPool.round_size of each request): at three tensors, rounding down would leave
    one block, and every read back from the disk would then take a block past the cap
    (disk_reads_over_cap), a host allocation in every step."""
    settle(cuda)
    pool = ckpt_offload.host_pool()
    pool.empty_cache()
    ckpt_offload.reset_stats()
    train_step(model, ids, ctx)
    settle(cuda)
    s = ckpt_offload.stats()
    n, nbytes = s["tensors_offloaded"], s["bytes_offloaded"]
    if n == 0:
        raise RuntimeError("disk_offload: the async_offload step offloaded nothing, so there is nothing to spill")
    if nbytes % n:  # every offloaded tensor is one block's input: one size
        raise RuntimeError(f"disk_offload: the {n} tensors offloaded ({nbytes} bytes) differ in size; "
                           "the cap is computed for tensors of one size")
    block = ckpt_offload.HostPool.round_size(nbytes // n)
    return dict(probe_tensors_offloaded=n, probe_bytes_offloaded=nbytes, pool_block_bytes=block,
                pool_cap_bytes=-(-n // 2) * block)


def plan_disk(model, ids, a, runnable, seq, cuda, prepare_async):
    """With disk_offload among the modes: measures what the step offloads at this length (offload_probe
    in the async_offload mode, which prepare_async() puts the model in, returning its context factory)
    and keeps it in a.disk_probe for apply_mode. Returns {disk_offload: error row} when that failed
    (it then leaves runnable), else {}."""
    if DISK_MODE not in runnable:
        return {}
    probe, ok = run_guarded(lambda: (offload_probe(model, ids, prepare_async(), cuda), True), DISK_MODE, seq)
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    if ok is None:
        runnable.remove(DISK_MODE)
        return {DISK_MODE: probe}
    a.disk_probe = probe
    return {}


class DiskSteps:
    """apply_mode's context factory for disk_offload. Each step, forward and backward, runs with the
    process-wide pool capped at probe["pool_cap_bytes"] and a disk tier in `root`; both go back to
    what they were when the step's backward ends (at once when its forward fails), so that no other
    mode, and none of the pool's empty_cache() calls between steps, ever sees them. The factory's
    context covers the forward only (timing.train_step), so the end of backward is found through
    the loss: a pre-hook on its grad_fn queues the restore as the backward's final callback.
    steps: the tier's figures of every step, in order (the tier is made for each step, so its
    counts are that step's alone)."""

    def __init__(self, model, root, probe):
        self.model, self.root, self.probe = model, root, probe
        self.steps = []
        self._restore = None  # set while a step holds the cap and the tier

    @contextlib.contextmanager
    def __call__(self):
        self.close()  # a step whose backward never ran gives back the cap and the tier first
        pool = ckpt_offload.host_pool()
        if pool.spill_stats()["io_mode"] is not None:
            raise RuntimeError("disk_offload sets the pool's disk tier itself, and one is already set "
                               "(host_pool().set_spill_dir(None) first)")
        t0 = time.perf_counter()
        before = pool.stats()["capacity_bytes"]
        pool.set_capacity(self.probe["pool_cap_bytes"])
        try:
            pool.set_spill_dir(self.root)
        except BaseException:
            pool.set_capacity(before)
            raise
        setup_ms = (time.perf_counter() - t0) * 1e3

        def restore():
            t1 = time.perf_counter()
            s = pool.spill_stats()  # before the tier goes: its figures go with it
            pool.set_spill_dir(None)
            pool.set_capacity(before)
            self.steps.append(dict(s, capacity_before=before, setup_ms=setup_ms + (time.perf_counter() - t1) * 1e3))

        self._restore = restore
        outputs = []
        hook = self.model.register_forward_hook(lambda module, args, out: outputs.append(out))
        try:
            yield
        except BaseException:
            self.close()
            raise
        finally:
            hook.remove()
        node = outputs[-1].grad_fn if outputs and isinstance(outputs[-1], torch.Tensor) else None
        if node is None:  # no backward will follow (a forward without grad)
            self.close()
        else:
            node.register_prehook(lambda grads: torch.autograd.Variable._execution_engine.queue_callback(self.close))

    def close(self):
        """Gives back the cap and the tier of the step that holds them, if any."""
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()

    def step_figures(self):
        """The tier's figures of the step that ran last (timing.one_timed_step keeps them with the step)."""
        return self.steps[-1] if self.steps else None

    def left_behind(self):
        """What this mode failed to put back: a cap other than before its first step, a tier still set,
        this process's spill directories still under root."""
        pool = ckpt_offload.host_pool()
        out = []
        if self.steps and pool.stats()["capacity_bytes"] != self.steps[0]["capacity_before"]:
            out.append(f"pool capacity {pool.stats()['capacity_bytes']} bytes, "
                       f"{self.steps[0]['capacity_before']} before")
        if pool.spill_stats()["io_mode"] is not None:
            out.append("a disk tier is still set")
        mine = [e for e in os.listdir(self.root) if e.startswith(f"ckpt_offload-{os.getpid()}-")]
        if mine:
            out.append(f"spill directories left in {self.root}: {', '.join(sorted(mine))}")
        return out

    def describe(self):
        """The row's figures of the setting: directory, its filesystem, the cap and what it came from."""
        fs = filesystem_of(self.root)
        return dict(spill_root=os.path.realpath(self.root), spill_device=fs["device"], spill_fstype=fs["fstype"],
                    spill_mount=fs["mount"], **self.probe)


def disk_figures(steps):
    """The row figures of the tier over the timed steps (each step's from DiskSteps.step_figures):
    means per step, totals of the waits, GB/s over all of them; {} for a mode without a tier."""
    disk = [x["disk"] for x in steps if x.get("disk") is not None]
    if not disk:
        return {}
    mean = lambda key: statistics.fmean(d[key] for d in disk)  # noqa: E731
    total = lambda key: sum(d[key] for d in disk)  # noqa: E731
    rate = lambda nbytes, ms: nbytes / ms / 1e6 if nbytes and ms > 0 else None  # noqa: E731
    offloaded = statistics.fmean(x["bytes_offloaded"] for x in steps)
    return dict(disk_io_mode=disk[-1]["io_mode"], tensors_spilled_per_step=mean("tensors_spilled"),
                bytes_spilled_per_step=mean("bytes_spilled"), tensors_read_back_per_step=mean("tensors_read"),
                spilled_fraction=mean("bytes_spilled") / offloaded if offloaded else None,
                disk_read_waits_timed=total("read_waits"), disk_write_waits_timed=total("write_waits"),
                disk_reads_ahead_timed=total("reads_ahead"), disk_reads_over_cap_timed=total("reads_over_cap"),
                disk_errors_timed=total("write_errors") + total("read_errors"),
                disk_write_ms_per_step=mean("write_ms"), disk_read_ms_per_step=mean("read_ms"),
                disk_write_gb_per_s=rate(total("bytes_spilled"), total("write_ms")),
                disk_read_gb_per_s=rate(total("bytes_read"), total("read_ms")),
                disk_files_after_step=max(d["files"] for d in disk),
                disk_setup_ms_median=statistics.median(d["setup_ms"] for d in disk))


def add_disk_ratios(rows, base="async_offload"):
    """time_vs_async_offload of each disk_offload row: medians at the same length (timed apart from the
    round-robin, so no paired rounds)."""
    for r in rows:
        if r["mode"] != DISK_MODE or "step_ms_median" not in r:
            continue
        b = next((x for x in rows if x["mode"] == base and x["seq"] == r["seq"] and "step_ms_median" in x), None)
        r[f"time_vs_{base}"] = r["step_ms_median"] / b["step_ms_median"] if b else None


def disk_problems(rows):
    """Failed checks of the disk rows: nothing spilled, I/O errors, files or settings left behind."""
    out = []
    for r in rows:
        if r["mode"] != DISK_MODE or "step_ms_median" not in r:
            continue
        where = f"{DISK_MODE}@{r['seq']}"
        if not r.get("bytes_spilled_per_step"):
            out.append(f"{where}: nothing went to disk (pool cap {r.get('pool_cap_bytes')} bytes)")
        if r.get("disk_errors_timed"):
            out.append(f"{where}: {r['disk_errors_timed']} disk I/O errors in timed steps")
        if r.get("disk_files_after_step"):
            out.append(f"{where}: {r['disk_files_after_step']} spill files left at the end of a step")
        out += [f"{where}: {x}" for x in r.get("disk_left_behind", [])]
    return out


def print_disk(rows):
    """The disk rows' own lines: where the files went, the cap, step time against async_offload, how
    much went to disk and how often a step waited for it."""
    disk = [r for r in rows if r["mode"] == DISK_MODE and "step_ms_median" in r]
    if not disk:
        return
    r0 = disk[0]
    io = {"direct": "O_DIRECT", "buffered": "buffered I/O (the filesystem refuses O_DIRECT)"}.get(r0["disk_io_mode"],
                                                                                             "no I/O")
    print()
    _wrap(f"{DISK_MODE}: async_offload with the host pool capped at half of the bytes its step offloads (rounded up "
          "to whole blocks) and a disk tier under it, both set for each step and put back after it; timed on its own "
          "after the round-robin (its t/full above compares medians, no paired rounds)")
    _wrap(f"spill directory {r0['spill_root']} on {r0['spill_device']} ({r0['spill_fstype']}, mounted at "
          f"{r0['spill_mount']}), {io}")
    print_table(["seq", "ms med", "t/async", "offloaded (n)", "cap", "spilled (n)", "share", "waits r/w*", "over cap*",
                 "GB/s w/r", "setup ms"],
                [[r["seq"], f"{r['step_ms_median']:.2f}", fmt_ratio(r.get("time_vs_async_offload")),
                  f"{fmt_bytes(r['probe_bytes_offloaded'])} ({r['probe_tensors_offloaded']})",
                  fmt_bytes(r["pool_cap_bytes"]),
                  f"{fmt_bytes(r['bytes_spilled_per_step'])} ({r['tensors_spilled_per_step']:g})",
                  "n/a" if r["spilled_fraction"] is None else f"{100 * r['spilled_fraction']:.0f}%",
                  f"{r['disk_read_waits_timed']}/{r['disk_write_waits_timed']}", r["disk_reads_over_cap_timed"],
                  f"{_gbps(r['disk_write_gb_per_s'])}/{_gbps(r['disk_read_gb_per_s'])}",
                  f"{r['disk_setup_ms_median']:.2f}"] for r in disk])
    for i, note in enumerate([
            "t/async: step time over async_offload's at the same length; offloaded (n): bytes (tensors) of one "
            "async_offload step, measured in an untimed step; spilled (n): written to disk per timed step, share: "
            "of the bytes offloaded",
            "waits r/w, over cap: over all timed steps, reloads that found their read from disk still running / "
            "offloads that waited for a write, and reads that took a pool block past the cap",
            "GB/s w/r: the tier's workers inside pwrite / pread; setup ms: set_capacity and set_spill_dir at the "
            "step's start and their undoing at its end, inside the step time"]):
        _wrap(note, first="* " if i == 0 else "  ", rest="    ")


def _wrap(text, first="", rest="  "):
    print(textwrap.fill(text, width=120, initial_indent=first, subsequent_indent=rest))


def _gbps(x):
    return "n/a" if x is None else f"{x:.2f}"
