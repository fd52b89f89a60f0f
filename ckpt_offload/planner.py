"""The planner: profiles a model's repeated blocks on one batch (`profile`: a CostModel) and chooses, per
block, between keeping, offloading, checkpointing and checkpointing with offload: the fastest predicted
step whose predicted peak fits a device-memory budget (`plan_from_cost`). MemoryPlan holds the choice,
its predictions and its per-block table. `plan_memory` (sizing/plan.py) is the entry point above it.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time

import torch
from torch import nn

from . import engine as _engine
from . import policies
from .midpoints import _in_backward
from .selection import block_modes
from .session import test_cpu_enabled
from .training import training_mode
from .model import BLOCK_MODES, disable_checkpointing, enable_block_modes, find_repeated_blocks

# Modes whose blocks are checkpointed (recomputed in backward), those whose saved bytes live on the host,
# and those of both, whose reloads the nearest checkpointed block above starts from its midpoint.
_CKPT_OFFLOADED = {"checkpoint+offload", "checkpoint+offload+attention"}
_CHECKPOINTED = {"checkpoint"} | _CKPT_OFFLOADED
_OFFLOADED = {"offload"} | _CKPT_OFFLOADED
# Exhaustive search up to this many assignments; beyond it, a local search from the uniform ones.
_EXHAUSTIVE_LIMIT = 1 << 14


def _default_loss(out):
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if not isinstance(out, torch.Tensor):
        if hasattr(out, "to_tuple"):  # a transformers ModelOutput without a loss: its logits
            out = out.to_tuple()
        out = next(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return out.float().square().mean()


def _grad_tensors(obj):
    """The tensors in obj (nested) that carry a gradient, each once."""
    seen, out = set(), []
    for t in torch.utils._pytree.tree_leaves(obj):
        if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class _Probe:
    """Live device bytes, the peak since the last mark, and the time at marks during one step:
    torch.cuda's allocator figures and CUDA events on a GPU, LiveBytes and perf_counter on the CPU."""

    def __init__(self, device, live):
        self.cuda = device.type == "cuda"
        self.device = device
        self.live = live
        self.marks = {}  # name -> (bytes live, peak since the previous mark, time, bytes sent to the host)

    def mark(self, name):
        if self.cuda:
            now = torch.cuda.memory_allocated(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            t = torch.cuda.Event(enable_timing=True)
            t.record()
        else:
            now = peak = 0
            if self.live is not None:
                now = self.live.current()
                peak = max(self.live.peak, now)
                self.live.peak = now
            t = time.perf_counter()
        # Bytes sent to the host so far, in the forward only (stats() would perturb the backward's timing).
        # On the meta device (the estimate) nothing reaches the engine: no copy is ever made there.
        sent = _engine.stats()["bytes_offloaded"] if name.startswith("f") and self.device.type != "meta" else 0
        self.marks[name] = (now, peak, t, sent)

    def elapsed_ms(self, a, b):
        ta, tb = self.marks[a][2], self.marks[b][2]
        return ta.elapsed_time(tb) if self.cuda else (tb - ta) * 1e3


def _measured_step(model, blocks, example_inputs, loss_fn, device, track_memory=True, live=None):
    """One forward and backward with marks at each block boundary. Returns the probe. On the CPU,
    track_memory=False leaves LiveBytes out (its per-op bookkeeping would dwarf the compute); live:
    the tracker to use instead of a new LiveBytes (the estimate's, on the meta device). Inputs: a
    tuple of positional arguments or a dict of keyword arguments."""
    from .testing import LiveBytes

    cuda = device.type == "cuda"
    n = len(blocks)
    handles = []
    hooks = []  # the gradient hooks, removed after the step (an input given to the model may carry them)
    if live is None:
        live = LiveBytes() if not cuda and track_memory else None
    probe = _Probe(device, live)

    def grad_mark(name):
        def hook(grad):
            if name not in probe.marks:  # the first of the tensors hooked for it
                probe.mark(name)

        return hook

    def pre(i):
        def hook(module, args, kwargs=None):
            if _in_backward() or not torch.is_grad_enabled():
                return
            probe.mark(f"f{i}")
            # Every input that carries a gradient (positional or, as diffusers' blocks are called, by
            # keyword): a block may take more than one stream from the block before it (Flux's and
            # HunyuanVideo's image and text tokens), and the first of them whose gradient node runs
            # marks where the block before it starts its backward. A stream's own node may run only
            # after another's has started that block's backward (its recompute, under checkpointing).
            for x in _grad_tensors((args, kwargs or {})):
                hooks.append(x.register_hook(grad_mark(f"b{i}")))

        return hook

    def post(module, args, out):
        if _in_backward() or not torch.is_grad_enabled():
            return
        probe.mark(f"f{n}")
        # Every output that carries a gradient (Flux's last block returns the text stream too, which
        # nothing after it reads): the first gradient to arrive marks the backward's start.
        for y in _grad_tensors(out):
            hooks.append(y.register_hook(grad_mark(f"b{n}")))

    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(pre(i), with_kwargs=True))
    handles.append(blocks[-1].register_forward_hook(post))
    try:
        model.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize(device)
        _engine.synchronize()
        with live if live is not None else contextlib.nullcontext():
            if live is not None:
                live.add([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
                          *(t for t in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor))])
            elif cuda:
                torch.cuda.reset_peak_memory_stats(device)
            probe.mark("start")
            out = model(**example_inputs) if isinstance(example_inputs, dict) else model(*example_inputs)
            loss = loss_fn(out)
            del out
            probe.mark("fwd_end")
            loss.backward()
            del loss
            probe.mark("end")
        if cuda:
            torch.cuda.synchronize(device)
        _engine.synchronize()
    finally:
        for h in [*handles, *hooks]:
            h.remove()
    if "b0" not in probe.marks and "b1" in probe.marks:
        # The first block's input needs no gradient: the block's backward ends the step's.
        now, _, t, sent = probe.marks["end"]
        probe.marks["b0"] = probe.marks["end"]
        probe.marks["end"] = (now, now, t, sent)
    missing = [k for k in [f"b{i}" for i in range(n + 1)] + [f"f{i}" for i in range(n + 1)] if k not in probe.marks]
    if missing:
        raise ValueError(
            f"plan_memory: the repeated blocks' hidden states carry no gradient at {missing}; each block must take "
            "the tensors that flow from block to block as arguments and return them"
        )
    return probe


class CostModel:
    """Per-block, per-mode figures measured by plan_memory's profile, and the predictions composed from them.

    Memory (bytes): kept[m][i] what block i holds on the device from its forward to its backward;
    bwd_excess[m][i] how far its backward rises above the level where it starts; fwd_excess[m][i]
    the same for its forward; host[m][i] the bytes it sends to the host. Time (ms): fwd_ms /
    bwd_ms per block, compute only (a checkpointed block's backward includes its recompute; copies
    are modelled from d2h/h2d_gb_per_s and run beside the compute unless synchronous_copies); the
    parts outside the blocks in `outside`.
    """

    FIELDS = ("n", "modes", "kept", "bwd_excess", "fwd_excess", "host", "fwd_ms", "bwd_ms", "outside",
              "d2h_gb_per_s", "h2d_gb_per_s", "synchronous_copies")

    def __init__(self, **kw):
        for k in self.FIELDS:
            setattr(self, k, kw[k])

    def to_dict(self):
        return {k: getattr(self, k) for k in self.FIELDS}

    def _reload_trigger(self, modes):
        """u[j]: for an offloaded block j, the block above it whose backward starts j's reload
        (prefetch=1): for checkpoint+offload(+attention) the nearest checkpointed block, from its
        midpoint; for offload the nearest offload block, when it unpacks its last tensor. None: on demand."""
        u = [None] * self.n
        checkpointed = offloaded = None  # the nearest block above of each kind
        for i in range(self.n - 1, -1, -1):
            m = modes[i]
            if m in _CKPT_OFFLOADED:
                u[i] = checkpointed
            elif m == "offload":
                u[i] = offloaded
            if m in _CHECKPOINTED:
                checkpointed = i
            if m == "offload":
                offloaded = i
        return u

    def peak(self, modes):
        """Predicted peak device bytes of a step with one mode per block."""
        o = self.outside
        u = self._reload_trigger(modes)
        kept = [self.kept[m][i] for i, m in enumerate(modes)]
        shift = sum(kept) - o["kept_none"]
        # Gradients freed between steps (measured kept): none exist in the forward, and a block's
        # appear in its backward (those of the parts outside the blocks counted from the head's on).
        freed = o.get("freed_block_grads") or [0] * self.n
        before = sum(freed) + o.get("freed_outside_grads", 0)
        # Inputs an offloaded block sent that later blocks share (the rotary tables): held by the
        # model's forward while it runs and reloaded for the first backward that needs them, so
        # counted in what the block keeps, but on the host while the head's backward runs.
        shared = o.get("shared_host") or [0] * self.n
        away = sum(shared[i] for i, m in enumerate(modes) if m in _OFFLOADED)
        peaks = [o["fwd_pre_peak"] - before, o["fwd_head_peak"] + shift - before,
                 o["bwd_head_peak"] + shift - sum(freed) - away, o["bwd_pre_peak"]]
        level_fwd = o["fwd_level"] - before
        for i, m in enumerate(modes):
            peaks.append(level_fwd + self.fwd_excess[m][i])
            level_fwd += kept[i]
        # Reloads on the device over block i's backward: its own (prefetched or fetched on demand),
        # and those of offloaded blocks j below it that a block u[j] above it started.
        inflight = [0] * (self.n + 1)
        starts_reload = [0] * self.n  # bytes of the largest reload a block starts from its midpoint
        for j, m in enumerate(modes):
            if m in _OFFLOADED:
                reload = self.host[m][j] - shared[j]  # the shared part is in what the block keeps
                inflight[j] += reload
                inflight[j + 1 if u[j] is None else u[j]] -= reload
                if u[j] is not None and m in _CKPT_OFFLOADED:
                    starts_reload[u[j]] = max(starts_reload[u[j]], reload)
        inflight = list(itertools.accumulate(inflight))
        below = 0  # bytes of earlier blocks still held when block i's backward starts
        not_yet = 0  # freed gradients of the blocks below i, not made when i's backward runs
        for i, m in enumerate(modes):
            excess = self.bwd_excess[m][i]
            if m == "checkpoint" and starts_reload[i]:
                # A reload started from this block's midpoint: as measured where every block offloads
                # its input, else (not profiled) as if it were there at the peak.
                if "checkpoint+offload" in self.bwd_excess:
                    excess = max(excess, self.bwd_excess["checkpoint+offload"][i])
                else:
                    excess += starts_reload[i]
            # A block's backward rises (its recompute, the gradients of its activations) before its
            # weights' gradients are made at its end: those, and those of the blocks under it, not there.
            not_yet += freed[i]
            peaks.append(o["bwd_level"] + below + kept[i] + inflight[i] + excess - not_yet)
            below += kept[i]
        return int(max(peaks))

    def host_bytes(self, modes):
        return int(sum(self.host[m][i] for i, m in enumerate(modes)))

    def step_ms(self, modes):
        """Predicted step time. Copies run on the engine's streams beside the compute (GPU) or in
        line with it (synchronous host copies on the CPU test path)."""
        o = self.outside
        d2h_ms = [self.host[m][i] / (self.d2h_gb_per_s * 1e6) if m in _OFFLOADED else 0.0 for i, m in enumerate(modes)]
        h2d_ms = [self.host[m][i] / (self.h2d_gb_per_s * 1e6) if m in _OFFLOADED else 0.0 for i, m in enumerate(modes)]
        if self.synchronous_copies:
            return (o["fwd_pre_ms"] + o["fwd_head_ms"] + o["bwd_head_ms"] + o["bwd_pre_ms"]
                    + sum(self.fwd_ms[m][i] + self.bwd_ms[m][i] + d2h_ms[i] + h2d_ms[i] for i, m in enumerate(modes)))
        c = o["fwd_pre_ms"]
        d2h_free = 0.0
        for i, m in enumerate(modes):
            if m in _OFFLOADED:
                # A checkpoint's input is saved as it starts; a whole block's tensors through its forward.
                start = c if m in _CKPT_OFFLOADED else c + self.fwd_ms[m][i] / 2
                d2h_free = max(d2h_free, start) + d2h_ms[i]
            c += self.fwd_ms[m][i]
        # The end of the forward returns the sources to the allocator after their copies.
        c = max(c + o["fwd_head_ms"], d2h_free) + o["bwd_head_ms"]
        u = self._reload_trigger(modes)
        trigger = [None] * self.n
        started = [[] for _ in range(self.n)]  # the blocks whose reloads block i starts
        for j, uj in enumerate(u):
            if uj is not None:
                started[uj].append(j)
        h2d_free = c
        for i in range(self.n - 1, -1, -1):
            m = modes[i]
            start = c
            if m in _CKPT_OFFLOADED:
                began = max(h2d_free, trigger[i] if trigger[i] is not None else start)
                h2d_free = began + h2d_ms[i]
                start = max(start, h2d_free)
                end = start + self.bwd_ms[m][i]
            elif m == "offload":
                # Its tensors come back in the order backward uses them: the block waits for the last.
                began = max(h2d_free, trigger[i] if trigger[i] is not None else start)
                h2d_free = began + h2d_ms[i]
                end = max(start + self.bwd_ms[m][i], h2d_free)
            else:
                end = start + self.bwd_ms[m][i]
            for j in started[i]:
                trigger[j] = start + self.bwd_ms[m][i] / 2 if modes[j] in _CKPT_OFFLOADED else end
            c = end
        return c + o["bwd_pre_ms"]

    def predict(self, modes):
        """(peak bytes, step ms, host bytes) of one mode per block."""
        modes = list(modes)
        if len(modes) != self.n or any(m not in self.kept for m in modes):
            raise ValueError(f"CostModel.predict: need {self.n} modes from {sorted(self.kept)}, got {modes}")
        return self.peak(modes), self.step_ms(modes), self.host_bytes(modes)


def uniform_modes(n, every_n, offload, keep_last=1):
    """The modes enable_checkpointing(every_n_layers=every_n, offload=offload, keep_last=keep_last) sets."""
    return block_modes(n, every_n, offload, keep_last, where="uniform_modes")


def uniform_configs(n):
    """{name: modes} of every_n in {1, 2, 4}, offload on and off (keep_last=1), and no checkpointing."""
    out = {"none": ["none"] * n}
    for every in (1, 2, 4):
        for off in (False, True):
            out[f"every{every}" + ("_offload" if off else "")] = uniform_modes(n, every, off)
    return out


def profile(model, example_inputs, *, loss_fn=None, modes=None, verbose=False) -> CostModel:
    """Measures the CostModel of `model` on `example_inputs`: two steps per mode (a warm-up, then one
    with marks at every block boundary), in training mode (each module's mode is restored after).
    Leaves every parameter's .grad allocated and zeroed, and stats() reset: the profiling steps do
    not count in what the run's steps report."""
    blocks = find_repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"plan_memory: no repeated blocks found in {type(model).__name__}: searched for transformers "
            "GradientCheckpointingLayer modules and for runs of at least two same-class modules in an "
            "nn.ModuleList or nn.Sequential"
        )
    n = len(blocks)
    loss_fn = loss_fn or _default_loss
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    modes = ["none"] + [m for m in modes if m != "none"]
    runs = [m for m in BLOCK_MODES if m in modes]
    probes, timed = {}, {}
    rates = []
    disable_checkpointing(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), training_mode(model):
        for k, m in enumerate(runs):
            if verbose:
                print(f"plan_memory: profiling mode {m!r} ({k + 1}/{len(runs)}) on {n} blocks", file=sys.stderr, flush=True)
            if m != "none":
                enable_block_modes(model, [m] * n, layers=blocks)
            try:
                loss = loss_fn(model(*example_inputs))  # warm-up: gradients allocated, pool filled, midpoints learned
                loss.backward()
                del loss
                _engine.reset_stats()
                _engine.profile(m in _OFFLOADED)
                try:
                    probes[m] = _measured_step(model, blocks, example_inputs, loss_fn, device)
                finally:
                    _engine.profile(False)
                if m == "none" and device.type != "cuda":  # times from a step without the memory bookkeeping
                    timed[m] = _measured_step(model, blocks, example_inputs, loss_fn, device, track_memory=False)
                if m in _OFFLOADED:
                    s = _engine.stats()
                    rates.append((s["d2h_gb_per_s"], s["h2d_gb_per_s"]))
            finally:
                disable_checkpointing(model)
    model.zero_grad(set_to_none=False)
    # The profiling steps are not the run's: stats() starts again from zero, so that what a step
    # reports afterwards is that step's (the profiling had already reset it once per mode).
    _engine.synchronize()
    _engine.reset_stats()
    return _compose(probes, timed or probes, n, rates, device)


def _compose(probes, timed, n, rates, device):
    kept, bwd_excess, fwd_excess, host, fwd_ms, bwd_ms = {}, {}, {}, {}, {}, {}
    for m, p in probes.items():
        mk = p.marks
        b = [mk[f"b{i}"][0] for i in range(n + 1)]
        seg_peak = [mk[f"b{i}"][1] for i in range(n)]  # the peak of block i's backward, recorded at b_i
        f = [mk[f"f{i}"][0] for i in range(n + 1)]
        h = [mk[f"f{i + 1}"][3] - mk[f"f{i}"][3] for i in range(n)]
        if m not in _OFFLOADED:
            h = [0] * n
        # Every block offloaded: block i's bytes are back on the device where its backward starts
        # (reloaded from inside block i+1's), except the top one's, fetched inside its own backward.
        own = [h[i] if m in _OFFLOADED and i < n - 1 else 0 for i in range(n)]
        kept[m] = [b[i + 1] - b[i] - own[i] + (own[i - 1] if i > 0 else 0) for i in range(n)]
        bwd_excess[m] = [seg_peak[i] - (b[i + 1] - own[i]) for i in range(n)]
        if m in _OFFLOADED:
            bwd_excess[m] = [e - h[i] for i, e in enumerate(bwd_excess[m])]  # the own reload is counted apart
        fwd_excess[m] = [mk[f"f{i + 1}"][1] - f[i] for i in range(n)]
        host[m] = h
    none = probes["none"].marks
    pn = timed["none"]
    outside = dict(
        kept_none=sum(kept["none"]),
        fwd_pre_peak=none["f0"][1],
        fwd_level=none["f0"][0],
        fwd_head_peak=none["fwd_end"][1],
        bwd_head_peak=none[f"b{n}"][1],
        bwd_level=none["b0"][0],
        bwd_pre_peak=none["end"][1],
        fwd_pre_ms=pn.elapsed_ms("start", "f0"),
        fwd_head_ms=pn.elapsed_ms(f"f{n}", "fwd_end"),
        bwd_head_ms=pn.elapsed_ms("fwd_end", f"b{n}"),
        bwd_pre_ms=pn.elapsed_ms("b0", "end"),
    )
    # Compute from the run without checkpointing or copies; copies are modelled from the engine's
    # throughput. A recompute: on a GPU what the checkpoint run's backward takes beyond the unmodified
    # one's; on the CPU, where timings are noise, the block's forward once more (so noise cannot make
    # a recompute look cheaper than keeping).
    t = timed["none"]
    fwd = [t.elapsed_ms(f"f{i}", f"f{i + 1}") for i in range(n)]
    bwd = [t.elapsed_ms(f"b{i + 1}", f"b{i}") for i in range(n)]
    def recompute(m):
        # The attention policy's recompute leaves attention out: timed in its own run (which also
        # holds any wait for its reloads); the others as the plain checkpoint's.
        run = m if m == "checkpoint+offload+attention" else "checkpoint"
        if device.type != "cuda" or run not in probes:
            return fwd
        return [max(0.0, probes[run].elapsed_ms(f"b{i + 1}", f"b{i}") - bwd[i]) for i in range(n)]

    for m in probes:
        fwd_ms[m] = list(fwd)
        bwd_ms[m] = [b + r for b, r in zip(bwd, recompute(m))] if m in _CHECKPOINTED else list(bwd)
    modes = [m for m in BLOCK_MODES if m in probes]
    measured = [(d, h) for d, h in rates if d and h]
    d2h = min(d for d, _ in measured) if measured else 1.0
    h2d = min(h for _, h in measured) if measured else 1.0
    return CostModel(n=n, modes=modes, kept=kept, bwd_excess=bwd_excess, fwd_excess=fwd_excess, host=host,
                     fwd_ms=fwd_ms, bwd_ms=bwd_ms, outside=outside, d2h_gb_per_s=d2h, h2d_gb_per_s=h2d,
                     synchronous_copies=device.type != "cuda")


def search(cost: CostModel, budget_bytes, host_budget_bytes=None, modes=None):
    """The assignment with the lowest predicted step time whose predicted peak is <= budget_bytes and host
    bytes <= host_budget_bytes: every assignment when there are at most 16384, else a local search
    (one block's mode changed, or two blocks' exchanged, first improvement taken) from every uniform
    configuration, so never predicted slower than the best uniform one that fits.
    Returns (best (modes, ms, peak, host bytes) or None, (smallest peak seen, its modes) or None)."""
    modes = list(modes or cost.modes)
    n = cost.n
    best = None
    smallest = None  # (peak, modes) of the lowest predicted peak within the host budget

    def consider(assign):
        nonlocal best, smallest
        peak, ms, hb = cost.predict(assign)
        if host_budget_bytes is not None and hb > host_budget_bytes:
            return None
        if smallest is None or peak < smallest[0]:
            smallest = (peak, list(assign))
        if peak <= budget_bytes and (best is None or ms < best[1]):
            best = (list(assign), ms, peak, hb)
        return peak, ms

    if len(modes) ** n <= _EXHAUSTIVE_LIMIT:
        for assign in itertools.product(modes, repeat=n):
            consider(assign)
    else:
        seeds = [v for v in uniform_configs(n).values() if set(v) <= set(modes)] + [[m] * n for m in modes]
        for seed in seeds:
            cur = list(seed)
            score = _score(consider(cur), budget_bytes)
            improved = True
            while improved:
                improved = False
                # Neighbours: one block's mode changed, or two blocks' modes exchanged (which moves a
                # mode to another position at the same cost in time).
                moves = [(i, m) for i in range(n) for m in modes if m != cur[i]]
                swaps = [(i, j) for i in range(n) for j in range(i + 1, n) if cur[i] != cur[j]]
                for cand in itertools.chain(
                    (cur[:i] + [m] + cur[i + 1:] for i, m in moves),
                    ([cur[j] if k == i else cur[i] if k == j else x for k, x in enumerate(cur)] for i, j in swaps),
                ):
                    s = _score(consider(cand), budget_bytes)
                    if s < score:
                        cur, score, improved = cand, s, True
                        break
    return best, smallest


def _score(result, budget):
    if result is None:
        return (2, 0.0, 0.0)
    peak, ms = result
    return (0, ms, peak) if peak <= budget else (1, peak, ms)


class MemoryPlan:
    """One mode per repeated block, in forward order, and what the cost model predicts for it.

    Made by `plan_memory` (or `MemoryPlan.from_json`); apply it with `plan.apply(model)`.

    Attributes:
        modes (list[str]): one of `BLOCK_MODES` per repeated block: `"none"`, `"offload"`,
            `"checkpoint"`, `"checkpoint+offload"` or `"checkpoint+offload+attention"`.
        predicted_peak_bytes (int): the predicted peak device memory of a training step.
        predicted_step_ms (float): the predicted time of a step (forward and backward).
        predicted_host_bytes (int): the bytes a step sends to the host.
        budget_bytes (int | None): the budget the plan was chosen for.
        smallest_peak_bytes (int | None): the smallest predicted peak of any assignment searched:
            the smallest budget `replan` can meet.
        rows (list[dict]): per block, `mode`, `device_bytes`, `host_bytes` and `ms`, as `table()`
            prints them.
        cost_model (CostModel | None): the measurements; None for a plan read with `from_json`.
        auto (ckpt_offload.sizing.budget.AutoBudget | None): for `budget_bytes="auto"`, the figures the
            budgets were read from (`auto.describe()` says them in a line).
    """

    def __init__(self, modes, predicted_peak_bytes, predicted_step_ms, predicted_host_bytes, budget_bytes=None,
                 rows=None, cost_model=None, smallest_peak_bytes=None):
        self.modes = list(modes)
        self.predicted_peak_bytes = int(predicted_peak_bytes)
        self.predicted_step_ms = float(predicted_step_ms)
        self.predicted_host_bytes = int(predicted_host_bytes)
        self.budget_bytes = budget_bytes
        self.rows = rows or []  # per block: mode, device_bytes, host_bytes, ms
        self.cost_model = cost_model  # None for a plan read back with from_json
        self.smallest_peak_bytes = smallest_peak_bytes  # the smallest feasible budget found
        self.auto = None  # budget='auto': the figures it was read from (ckpt_offload.sizing.budget.AutoBudget)
        self._modes_allowed = None  # the modes the search chose from (None: all that were measured)

    def replan(self, budget_bytes: int, host_budget_bytes=None) -> "MemoryPlan":
        """The plan for another budget, from the same measurements (no profiling).

        Args:
            budget_bytes: the peak device bytes a step may reach.
            host_budget_bytes: the most bytes a step may send to the host (None: no cap).

        Returns:
            MemoryPlan: the fastest assignment predicted to fit, among the modes this plan chose from.

        Raises:
            ValueError: the plan was read from JSON (it holds no measurements), a budget is not
                positive, or nothing fits (the message names the smallest feasible budget).
            TypeError: a budget is not an int.
        """
        if self.cost_model is None:
            raise ValueError("MemoryPlan.replan: this plan was read from JSON and holds no measurements; call plan_memory")
        _check_budget("MemoryPlan.replan", budget_bytes, host_budget_bytes)
        return plan_from_cost(self.cost_model, budget_bytes, host_budget_bytes, self._modes_allowed)

    def apply(self, model: nn.Module) -> list[str]:
        """Configures `model` with this plan's modes, through `ckpt_offload.enable_block_modes`.

        `ckpt_offload.disable_checkpointing(model)` undoes it. A plan made with `budget="auto"`
        also caps the host pool at its host budget, following the node as `set_capacity("auto")`
        does, so that what would go past it spills to the disk tier when one is set, else stays on
        the device.

        Args:
            model: the model that was profiled (or one with the same repeated blocks).

        Returns:
            list[str]: the modes applied, one per repeated block.
        """
        modes = enable_block_modes(model, self.modes)
        if self.auto is not None and self.auto.host_bytes is not None:
            _engine.cap_following_node(_engine.host_pool(), max(self.auto.host_bytes, 1))
        return modes

    def table(self) -> str:
        """The plan as a table, one row per block, and a line of totals.

        Returns:
            str: per block the mode, the device MiB it keeps from its forward to its backward, the
                host MiB it sends and its forward + backward ms; then the predicted peak, budget,
                step time and host bytes.
        """
        lines = [f"{'block':>5}  {'mode':<18} {'device MiB':>10} {'host MiB':>9} {'ms':>8}"]
        for i, r in enumerate(self.rows):
            lines.append(f"{i:>5}  {r['mode']:<18} {r['device_bytes'] / 2**20:>10.2f} {r['host_bytes'] / 2**20:>9.2f} "
                         f"{r['ms']:>8.2f}")
        budget = "" if self.budget_bytes is None else f" (budget {self.budget_bytes / 2**20:.2f} MiB)"
        lines.append(f"predicted peak {self.predicted_peak_bytes / 2**20:.2f} MiB{budget}, step "
                     f"{self.predicted_step_ms:.2f} ms, host {self.predicted_host_bytes / 2**20:.2f} MiB")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The plan as JSON, to reuse on the next run without profiling (`MemoryPlan.from_json`).

        Returns:
            str: the modes, the predictions and the table's rows; the measurements stay behind, so
                a plan read back cannot `replan`.
        """
        return json.dumps(dict(modes=self.modes, predicted_peak_bytes=self.predicted_peak_bytes,
                               predicted_step_ms=self.predicted_step_ms, predicted_host_bytes=self.predicted_host_bytes,
                               budget_bytes=self.budget_bytes, rows=self.rows, smallest_peak_bytes=self.smallest_peak_bytes))

    @classmethod
    def from_json(cls, text: str) -> "MemoryPlan":
        """A plan written by `to_json`.

        Args:
            text: the JSON text.

        Returns:
            MemoryPlan: the plan, without measurements (`cost_model` is None).

        Raises:
            ValueError: a mode is not one of `BLOCK_MODES`.
        """
        d = json.loads(text)
        for i, m in enumerate(d.get("modes", ())):
            if m not in BLOCK_MODES:
                raise ValueError(f"MemoryPlan.from_json: modes[{i}] is {m!r}; expected one of {BLOCK_MODES}")
        return cls(d["modes"], d["predicted_peak_bytes"], d["predicted_step_ms"], d["predicted_host_bytes"],
                   d.get("budget_bytes"), d.get("rows"), smallest_peak_bytes=d.get("smallest_peak_bytes"))

    def summary(self) -> str:
        """One line for a person: the blocks of each mode (runs of indices), the predicted peak and
        host bytes, and for budget='auto' the figures the budget was read from."""
        runs, start = [], 0
        for i in range(1, len(self.modes) + 1):
            if i == len(self.modes) or self.modes[i] != self.modes[start]:
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                runs.append(f"{span} {self.modes[start]}")
                start = i
        gib = 2**30
        text = (f"blocks {', '.join(runs)}; predicted peak {self.predicted_peak_bytes / gib:.3f} GiB, "
                f"host {self.predicted_host_bytes / gib:.3f} GiB")
        return text + (f" ({self.auto.describe()})" if self.auto is not None else "")

    def __repr__(self):
        return (f"MemoryPlan(modes={self.modes}, predicted_peak_bytes={self.predicted_peak_bytes}, "
                f"predicted_step_ms={self.predicted_step_ms:.3f}, predicted_host_bytes={self.predicted_host_bytes})")


def search_modes(model, modes=None):
    """The modes plan_memory chooses from: `modes` checked, or (None) every mode this torch and the
    model's device can run."""
    if modes is None:
        modes = [m for m in BLOCK_MODES if m != "checkpoint+offload+attention" or policies.HAS_OFFLOAD_POLICY]
        params = list(model.parameters())
        if (not params or params[0].device.type == "cpu") and not test_cpu_enabled():
            # CPU tensors are never offloaded outside the test path: those modes would move nothing.
            modes = [m for m in modes if m not in _OFFLOADED]
    modes = list(modes)
    bad = [m for m in modes if m not in BLOCK_MODES]
    if bad or not modes:
        raise ValueError(f"plan_memory: modes must be a non-empty list from {BLOCK_MODES}, got {modes!r}")
    return modes


def _check_budget(fn, budget_bytes, host_budget_bytes):
    for name, v in (("budget_bytes", budget_bytes), ("host_budget_bytes", host_budget_bytes)):
        if v is None and name == "host_budget_bytes":
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{fn}: {name} must be an int (bytes) or 'auto', got {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"{fn}: {name} must be positive (bytes), got {v}")


def plan_from_cost(cost: CostModel, budget_bytes, host_budget_bytes=None, modes=None, verbose=False) -> MemoryPlan:
    """plan_memory's search on a measured CostModel (no profiling)."""
    modes = list(modes or cost.modes)
    best, smallest = search(cost, budget_bytes, host_budget_bytes, modes)
    if best is None:
        if smallest is None:
            raise ValueError(
                f"plan_memory: no assignment keeps the host bytes within host_budget_bytes={host_budget_bytes}; "
                f"the smallest is {min(cost.host_bytes([m] * cost.n) for m in modes)} bytes; raise host_budget_bytes"
            )
        how = "" if len(modes) ** cost.n <= _EXHAUSTIVE_LIMIT else ", the smallest the local search found"
        raise ValueError(
            f"plan_memory: nothing fits budget_bytes={budget_bytes}; the smallest feasible budget is {smallest[0]} "
            f"bytes ({'/'.join(smallest[1])}{how}); raise budget_bytes to at least {smallest[0]}"
        )
    assign, ms, peak, hb = best
    if verbose:
        print(f"plan_memory: chose {assign}: peak {peak} bytes, {ms:.2f} ms, host {hb} bytes", file=sys.stderr, flush=True)
    rows = []
    for i, m in enumerate(assign):
        copy = 0.0
        if m in _OFFLOADED:
            copy = cost.host[m][i] / (cost.d2h_gb_per_s * 1e6) + cost.host[m][i] / (cost.h2d_gb_per_s * 1e6)
        rows.append(dict(mode=m, device_bytes=int(cost.kept[m][i]), host_bytes=int(cost.host[m][i]),
                         ms=cost.fwd_ms[m][i] + cost.bwd_ms[m][i] + (copy if cost.synchronous_copies else 0.0)))
    plan = MemoryPlan(assign, peak, ms, hb, budget_bytes, rows, cost, smallest_peak_bytes=smallest[0])
    plan._modes_allowed = modes
    return plan
