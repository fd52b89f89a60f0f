"""ckpt_offload.timeline(): what one or more training steps did on each stream (every copy, each checkpointed
layer's forward and backward, each reload wait, each pinned allocation), as a Chrome trace, a picture and a
summary; and the names ckpt_offload's work carries under torch.profiler and NVTX.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.utils._pytree as _pytree

from . import engine as _engine
from ._args import check_int as _check_int

_C = _engine._C

# The phases of a layer mark (the flags of a "mark" record).
_FORWARD_BEGIN, _FORWARD_END, _BACKWARD_BEGIN, _BACKWARD_END = 0, 1, 2, 3

# Whether ckpt_offload's work is named (record_function ranges, NVTX ranges): while a timeline records, or
# always with CKPT_OFFLOAD_NVTX=1 (for nsys runs, which torch cannot tell us about). Under an active torch
# profiler too, which the hot path asks torch about itself: `enabled or _autograd_profiler._is_profiler_enabled`
# is the one check pack and unpack make when nothing records (two attribute loads).
_NVTX_ENV = "CKPT_OFFLOAD_NVTX"
enabled = os.environ.get(_NVTX_ENV, "0") == "1"

_lock = threading.Lock()
_recorder = None  # the _Recorder of the timeline that records now


def naming() -> bool:
    """True when ckpt_offload's work is named now: a timeline records, a torch profiler is active, or
    CKPT_OFFLOAD_NVTX=1."""
    return enabled or _autograd_profiler._is_profiler_enabled


class _Layers:
    """Numbers checkpointed layers within a step: a layer's forward that begins after a backward has
    begun opens the next step. What a session's layer (its hooks() group) is called in names and records."""

    _BOUND = 8192  # under a profiler alone nothing resets this: the oldest entries go beyond it

    def __init__(self):
        self.step = 0
        self.index = 0
        self.backward_seen = False
        self.info = {}  # key -> (step, layer index)
        self.groups = {}  # (id(session), group) -> key
        self.open_backward = {}  # id(engine) -> end hooks of the layer backwards that have begun
        self.next_key = 0
        self._tls = threading.local()  # .open: keys of the layer forwards running on this thread

    def begin(self):
        if self.backward_seen:
            self.step, self.index, self.backward_seen = self.step + 1, 0, False
        key = self.next_key
        self.next_key += 1
        self.info[key] = (self.step, self.index)
        self.index += 1
        if len(self.info) > self._BOUND and _recorder is None:
            for k in list(self.info)[: self._BOUND // 2]:
                del self.info[k]
        self._open().append(key)
        return key

    def end(self, key):
        stack = self._open()
        if stack and stack[-1] == key:
            stack.pop()

    def _open(self):
        tls = self._tls
        if not hasattr(tls, "open"):
            tls.open = []
        return tls.open

    def key_of(self, session, group, offloading=False):
        """The layer key of a session's group; an offload inside a layer's forward names the group."""
        k = (id(session), group)
        stack = self._open() if offloading else None
        if not stack:
            return self.groups.get(k)
        key = self.groups[k] = stack[-1]
        if len(self.groups) > self._BOUND and _recorder is None:
            for old in list(self.groups)[: self._BOUND // 2]:
                del self.groups[old]
        return key

    def label(self, key):
        info = self.info.get(key) if key is not None else None
        return f" layer {info[1]}" if info is not None else ""


_layers = _Layers()


class _Range:
    """A record_function range, and an NVTX range on a CUDA device."""

    __slots__ = ("name", "nvtx", "rf")

    def __init__(self, name, cuda):
        self.name = name
        self.nvtx = cuda
        self.rf = None

    def __enter__(self):
        self.rf = _autograd_profiler.record_function(self.name)
        self.rf.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc):
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self.rf.__exit__(*exc)
        return False


class NamedEngine:
    """A copy engine seen through one session's layer: offload, prefetch and fetch run inside ranges named
    "ckpt_offload::offload layer N", "ckpt_offload::reload layer N" (a reload queued, by prefetch or by a
    fetch that nothing prefetched) and "ckpt_offload::wait layer N" (a fetch of a prefetched tensor: the
    compute stream's wait for its reload). Used by the session only while naming() is true."""

    __slots__ = ("engine", "session", "group", "prefetched")

    def __init__(self, engine, session, group, prefetched=False):
        self.engine = engine
        self.session = session
        self.group = group
        self.prefetched = prefetched

    def _name(self, what, offloading=False):
        return f"ckpt_offload::{what}{_layers.label(_layers.key_of(self.session, self.group, offloading))}"

    def offload(self, src):
        with _Range(self._name("offload", offloading=True), src.is_cuda):
            handle = self.engine.offload(src)
        rec = _recorder
        if rec is not None and handle is not None:
            rec.handles[handle.id] = _layers.key_of(self.session, self.group)
        return handle

    def prefetch(self, handle):
        with _Range(self._name("reload"), self.engine.uses_cuda):
            self.engine.prefetch(handle)

    def fetch(self, handle, keep_host=False):
        _layers.backward_seen = True  # a fetch is backward's: the next layer forward opens a new step
        with _Range(self._name("wait" if self.prefetched else "reload"), self.engine.uses_cuda):
            return self.engine.fetch(handle, keep_host)


def run_layer(session, args, run):
    """Runs one checkpointed layer (run()) with its forward marked on the compute stream and, while a
    timeline records, hooks that mark its backward: from the moment backward reaches the layer's output
    to the moment its inputs' gradients are ready (or the backward ends, for inputs without a graph)."""
    key = _layers.begin()
    eng = _mark_engine(args)
    _mark(eng, _FORWARD_BEGIN, key)
    try:
        out = run()
    finally:
        _layers.end(key)
    _mark(eng, _FORWARD_END, key)
    if _recorder is not None and torch.is_grad_enabled():
        _mark_backward(out, args, eng, key)
    return out


def _mark_engine(args):
    """The engine whose compute stream a layer's marks go on: that of its first tensor input's device (the
    host clock where that device has no engine: CPU tensors outside the test path)."""
    for t in args:
        if isinstance(t, torch.Tensor):
            if t.is_cuda or (t.device.type == "cpu" and _C.test_path() != "off"):
                return _engine.engine_for(t.device)
            return None
    return None


def _mark(eng, phase, key):
    if _recorder is None:
        return
    if eng is not None:
        eng.timeline_mark(phase, key)
    else:
        _C.timeline_mark(phase, key)


def _mark_backward(out, args, eng, key):
    node = next((t.grad_fn for t in _pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn), None)
    if node is None:
        return
    state = {"open": False, "closed": False}
    open_spans = _layers.open_backward.setdefault(id(eng), [])

    def end(*_):
        if state["open"] and not state["closed"]:
            state["closed"] = True
            _mark(eng, _BACKWARD_END, key)
            if end in open_spans:
                open_spans.remove(end)

    def begin(grad_outputs):
        if not state["open"]:
            # The layer after this one in forward order is done once backward reaches this layer's output:
            # its end hook sits on this very node, behind this hook.
            for other in list(open_spans):
                other()
            state["open"] = True
            _layers.backward_seen = True
            _mark(eng, _BACKWARD_BEGIN, key)
            open_spans.append(end)
            # Inputs that are leaves, or whose gradient is never asked for, end the span with the backward.
            torch.autograd.Variable._execution_engine.queue_callback(end)

    node.register_prehook(begin)
    for t in args:
        # The node that consumes an input's gradient: reached once this layer's backward is done. (Not a
        # tensor hook: on a leaf fed every step it would stay, and fire, forever.)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(end)


class _Recorder:
    def __init__(self):
        self.handles = {}  # handle id -> layer key


# -- the recording --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Span:
    """One interval on one lane. kind: "forward", "backward", "wait" (the compute stream waiting for a
    reload), "offload_wait" (the stream that produced an offloaded tensor waiting for its copy before the
    memory goes back to the allocator) on the compute lane; "d2h", "h2d" on the copy lanes; "alloc" (pinned
    allocations) on the host lane. Times are milliseconds since the timeline began."""

    lane: str  # "compute", "D2H", "H2D" or "host"
    kind: str
    start_ms: float
    end_ms: float
    device: str
    step: int
    layer: int | None = None  # index of the checkpointed layer within its step's forward
    bytes: int = 0
    queued_ms: float | None = None  # copies and waits: when the host queued them
    handle: int | None = None
    on_demand: bool = False  # reloads and their waits: queued by the fetch itself (nothing prefetched it)
    same_stream: bool = False  # a copy that ran on the compute stream itself (host-only runtime)

    @property
    def ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def name(self) -> str:
        layer = f"layer {self.layer}" if self.layer is not None else ""
        what = {"forward": f"{layer} forward", "backward": f"{layer} backward", "d2h": f"offload {layer}",
                "h2d": f"reload {layer}", "wait": f"wait {layer}", "offload_wait": f"offload wait {layer}",
                "alloc": "pinned allocation"}[self.kind]
        return what.strip() + (" (on demand)" if self.on_demand and self.kind in ("h2d", "wait") else "")


_LANES = ("compute", "D2H", "H2D", "host")


class Timeline:
    """What ckpt_offload.timeline() recorded: spans (see Span), the runtime of each device ("cuda",
    "async-sim": simulated copy streams, or "sync": host copies), and how many records the ring dropped."""

    def __init__(self, spans=(), runtimes=None, dropped=0, unfinished=0):
        self.spans = sorted(spans, key=lambda s: (s.start_ms, s.end_ms))
        self.runtimes = dict(runtimes or {})
        self.dropped = dropped
        self.unfinished = unfinished  # records whose events had not completed (not shown)

    def lane(self, lane, device=None):
        return [s for s in self.spans if s.lane == lane and (device is None or s.device == device)]

    @property
    def devices(self):
        return sorted({s.device for s in self.spans})

    @property
    def steps(self) -> int:
        return 1 + max((s.step for s in self.spans), default=-1)

    # -- the summary ------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Per direction: copies, bytes, copy time and GB/s; overlap_fraction: the part of the copy time
        during which the compute stream was busy (a layer's forward or backward, not waiting); per step, the
        exposed wait: the compute stream waiting for reloads (reload_wait_ms_per_step) and for offload copies
        of the sources it hands back (offload_wait_ms_per_step); the longest exposed wait and its layer."""
        out = {"steps": self.steps, "runtimes": dict(self.runtimes)}
        for kind in ("d2h", "h2d"):
            copies = [s for s in self.spans if s.kind == kind]
            ms = sum(s.ms for s in copies)
            nbytes = sum(s.bytes for s in copies)
            out[kind] = {"copies": len(copies), "bytes": nbytes, "copy_ms": ms,
                         "gb_per_s": nbytes / ms / 1e6 if ms > 0 else None,
                         "on_demand": sum(1 for s in copies if s.on_demand)}
        copy_ms = overlapped = 0.0
        for dev in self.devices:
            busy = _busy(self, dev)
            for s in self.spans:
                if s.device == dev and s.kind in ("d2h", "h2d"):
                    copy_ms += s.ms
                    if not s.same_stream:  # a copy on the compute stream is never under compute
                        overlapped += _covered(s.start_ms, s.end_ms, busy)
        out["copy_ms"] = copy_ms
        out["overlap_fraction"] = overlapped / copy_ms if copy_ms > 0 else None
        for kind in ("wait", "offload_wait"):
            per_step = [0.0] * self.steps
            for s in self.spans:
                if s.kind == kind:
                    per_step[s.step] += s.ms
            out["reload_wait_ms_per_step" if kind == "wait" else "offload_wait_ms_per_step"] = per_step
        waits = [s for s in self.spans if s.kind in ("wait", "offload_wait")]
        out["exposed_wait_ms_per_step"] = [a + b for a, b in zip(out["reload_wait_ms_per_step"],
                                                                 out["offload_wait_ms_per_step"])]
        out["waits"] = sum(1 for s in waits if s.kind == "wait")
        out["offload_waits"] = sum(1 for s in waits if s.kind == "offload_wait")
        longest = max(waits, key=lambda s: s.ms, default=None)
        out["longest_wait"] = None if longest is None else {
            "ms": longest.ms, "kind": "reload" if longest.kind == "wait" else "offload", "layer": longest.layer,
            "step": longest.step, "on_demand": longest.on_demand}
        allocs = [s for s in self.spans if s.kind == "alloc"]
        out["pinned_allocations"] = {"count": len(allocs), "bytes": sum(s.bytes for s in allocs),
                                     "ms": sum(s.ms for s in allocs)}
        out["dropped_records"] = self.dropped
        return out

    # -- Chrome trace -----------------------------------------------------------------------------
    def save_chrome_trace(self, path) -> None:
        """Chrome trace-event JSON (opens in Perfetto, ui.perfetto.dev, and chrome://tracing): one process per
        device, one thread (lane) per stream: compute, D2H, H2D, and the host's pinned allocations."""
        events = []
        for pid, dev in enumerate(self.devices, start=1):
            runtime = self.runtimes.get(dev, "?")
            events.append({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": f"ckpt_offload {dev} ({runtime})"}})
            for tid, lane in enumerate(_LANES, start=1):
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})
            for s in self.spans:
                if s.device != dev:
                    continue
                args = {"step": s.step, "layer": s.layer}
                if s.bytes:
                    args["bytes"] = s.bytes
                if s.kind in ("d2h", "h2d") and s.ms > 0:
                    args["GB/s"] = round(s.bytes / s.ms / 1e6, 3)
                if s.queued_ms is not None:
                    args["queued_ms"] = round(s.queued_ms, 6)
                if s.handle is not None:
                    args["handle"] = s.handle
                ev = {"name": s.name, "cat": s.kind, "ph": "X", "pid": pid, "tid": _LANES.index(s.lane) + 1,
                      "ts": s.start_ms * 1e3, "dur": max(s.ms, 0.0) * 1e3, "args": args}
                if s.kind in ("wait", "offload_wait"):
                    ev["cname"] = "terrible"  # red in chrome://tracing
                events.append(ev)
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"producer": "ckpt_offload.timeline", "summary": _jsonable(self.summary())}}
        with open(path, "w") as f:
            json.dump(doc, f)

    # -- the picture ------------------------------------------------------------------------------
    def plot(self, path, title=None) -> None:
        """A PNG of the lanes over time (matplotlib): forward and backward of each layer on the compute lane
        with its number, offloads and reloads on the D2H and H2D lanes, waits in red. title replaces
        "ckpt_offload timeline"; a simulated or host-only runtime is said after it either way."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
            from matplotlib.patches import Patch
        except ImportError as err:
            raise ImportError("Timeline.plot needs matplotlib (pip install matplotlib)") from err
        colors = {"forward": "#4c72b0", "backward": "#55a868", "d2h": "#8172b2", "h2d": "#64b5cd",
                  "wait": "#d62728", "offload_wait": "#8c1c13", "alloc": "#7f7f7f"}
        rows = []  # (device, lane), top to bottom
        for dev in self.devices:
            rows += [(dev, lane) for lane in _LANES if lane != "host" or self.lane("host", dev)]
        fig, ax = plt.subplots(figsize=(12, 0.75 * max(len(rows), 1) + 1.6), dpi=100)
        end = max((s.end_ms for s in self.spans), default=1.0) or 1.0
        for y, (dev, lane) in enumerate(rows):
            spans = self.lane(lane, dev)
            for s in spans:
                # Waits lie inside layer spans on the compute lane: drawn over them, a little thinner.
                wait = s.kind in ("wait", "offload_wait")
                h = 0.5 if wait else 0.7
                ax.broken_barh([(s.start_ms, max(s.ms, end * 1e-4))], (y - h / 2, h), facecolors=colors[s.kind],
                               edgecolor="#7f0000" if wait else "white", linewidth=0.4, zorder=3 if wait else 2)
                if s.layer is not None and not wait and s.ms > end * 0.012:
                    ax.text(s.start_ms + s.ms / 2, y, f"L{s.layer}", ha="center", va="center", fontsize=7,
                            color="white", zorder=4)
        ax.set_yticks(range(len(rows)))
        multi = len(self.devices) > 1
        ax.set_yticklabels([f"{dev} {lane}" if multi else lane for dev, lane in rows])
        ax.set_ylim(len(rows) - 0.4, -0.6)
        ax.set_xlim(0, end * 1.01)
        ax.set_xlabel("time since the timeline began (ms)")
        ax.grid(axis="x", alpha=0.3)
        runtimes = ", ".join(f"{d}: {r}" for d, r in sorted(self.runtimes.items()))
        title = title or "ckpt_offload timeline"
        if any(r == "async-sim" for r in self.runtimes.values()):  # said on every picture made this way
            title += " (CPU, simulated copy streams: not GPU timings)"
        elif any(r == "sync" for r in self.runtimes.values()):
            title += " (host-only path: copies run on the compute thread)"
        summary = self.summary()
        ov = summary["overlap_fraction"]
        ms = lambda key: ", ".join(f"{w:.1f}" for w in summary[key])  # noqa: E731
        sub = f"copy time under compute: {ov:.0%}" if ov is not None else "no copies"
        if summary["steps"]:
            sub += (f"; exposed wait per step: {ms('exposed_wait_ms_per_step')} ms (reloads "
                    f"{ms('reload_wait_ms_per_step')}, offloads {ms('offload_wait_ms_per_step')})")
        ax.set_title(f"{title}\n{sub}" + (f"  [{runtimes}]" if runtimes else ""), fontsize=10)
        legend = [Patch(color=colors[k], label=lbl) for k, lbl in (
            ("forward", "layer forward"), ("backward", "layer backward (recompute + grad)"),
            ("d2h", "offload copy (D2H)"), ("h2d", "reload copy (H2D)"), ("wait", "reload wait"),
            ("offload_wait", "offload wait"), ("alloc", "pinned allocation"))]
        ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=7, fontsize=8,
                  frameon=False)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _busy(tl, device):
    """The compute stream's busy intervals on a device: layer forwards and backwards, minus reload waits
    and minus copies that ran on the compute stream itself; sorted and disjoint."""
    work = _union([(s.start_ms, s.end_ms) for s in tl.spans
                   if s.device == device and s.kind in ("forward", "backward")])
    holes = _union([(s.start_ms, s.end_ms) for s in tl.spans if s.device == device and (
        s.kind in ("wait", "offload_wait") or (s.same_stream and s.kind in ("d2h", "h2d")))])
    return _subtract(work, holes)


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _subtract(work, holes):
    out = []
    for a, b in work:
        cur = a
        for h0, h1 in holes:
            if h1 <= cur or h0 >= b:
                continue
            if h0 > cur:
                out.append([cur, h0])
            cur = max(cur, h1)
        if cur < b:
            out.append([cur, b])
    return out


def _covered(a, b, busy):
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def _jsonable(d):
    return json.loads(json.dumps(d, default=str))


# -- the context manager ---------------------------------------------------------------------------
class timeline:
    """Context manager around one or more training steps; returns the Timeline it fills on exit.

    with ckpt_offload.timeline() as tl:
        loss = model(x).sum(); loss.backward()
    tl.save_chrome_trace("step.json"); tl.plot("step.png"); print(tl.summary())

    It waits for every queued copy (and, on a GPU, the device) at its start and end. Inside it, each copy
    and reload wait carries timing events (CUDA events on a GPU; the simulated streams stamp their own on
    the CPU test path), each checkpointed layer's forward and backward are marked on the compute stream,
    and ckpt_offload's work is named under torch.profiler and NVTX. capacity: how many records are kept
    (the oldest are overwritten beyond it; Timeline.dropped counts them). Outside one nothing is recorded.
    """

    def __init__(self, capacity: int = 1 << 16):
        _check_int("ckpt_offload.timeline", "capacity", capacity, 1)
        self.capacity = capacity
        self.result = None
        self._origin = None
        self._recorder = None

    def __enter__(self) -> Timeline:
        global _recorder, enabled, _layers
        with _lock:
            if _recorder is not None or _C.timeline_recording():
                raise RuntimeError("ckpt_offload.timeline: a timeline is already recording; nest none inside another")
            _wait_for_streams()
            self._recorder = _Recorder()
            _layers = _Layers()
            _C.timeline_start(self.capacity)
            self._origin = _C.timeline_now_ns()
            _recorder = self._recorder
            enabled = True
        self.result = Timeline()
        return self.result

    def __exit__(self, *exc):
        global _recorder, enabled
        with _lock:
            try:
                _wait_for_streams()
            finally:
                records, dropped = _C.timeline_stop()
                _recorder = None
                enabled = os.environ.get(_NVTX_ENV, "0") == "1"
        spans, unfinished = _spans(records, self._recorder, _layers, self._origin)
        runtimes = {str(e.device): e.runtime for e in _C.all_engines()}
        self.result.__init__(spans, {d: runtimes.get(d, "host") for d in {s.device for s in spans}}, dropped,
                             unfinished)
        return False


def _wait_for_streams():
    _engine.synchronize()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _spans(records, recorder, layers, origin):
    """Turns the recorder's records into spans: layer marks paired into forward and backward spans, each
    copy and wait named by the layer that offloaded its tensor, each assigned to a step."""
    spans = []
    unfinished = 0
    ms = lambda ns: (ns - origin) / 1e6  # noqa: E731
    marks = {}  # (key, phase) -> (device, ns)
    for r in records:
        if r["kind"] == "mark":
            if r["start_ns"] >= 0:
                marks[(r["id"], r["flags"])] = (r["device"], r["start_ns"])
            else:
                unfinished += 1
    steps = {}  # step -> ns where its first layer forward began
    for (key, phase), (dev, ns) in marks.items():
        info = layers.info.get(key)
        if info is None:
            continue
        if phase == _FORWARD_BEGIN:
            steps[info[0]] = min(ns, steps.get(info[0], ns))
        if phase in (_FORWARD_BEGIN, _BACKWARD_BEGIN):
            end = marks.get((key, phase + 1))
            if end is not None:
                kind = "forward" if phase == _FORWARD_BEGIN else "backward"
                spans.append(Span("compute", kind, ms(ns), ms(end[1]), dev, info[0], info[1]))
    starts = sorted((ns, step) for step, ns in steps.items())

    def step_at(ns):
        found = starts[0][1] if starts else 0
        for t, step in starts:
            if t <= ns:
                found = step
        return found

    on_demand = {r["id"] for r in records if r["kind"] == "wait" and r["flags"] & 1}
    offloaded = {r["id"]: r["bytes"] for r in records if r["kind"] == "d2h"}
    for r in records:
        kind = r["kind"]
        if kind == "mark":
            continue
        if kind == "wait" and r["flags"] & 2:  # the producer waiting for an offload copy (the handle's)
            kind = "offload_wait"
            r = dict(r, bytes=offloaded.get(r["id"], 0))
        if r["start_ns"] < 0 or r["end_ns"] < 0:
            unfinished += 1
            continue
        key = recorder.handles.get(r["id"]) if kind != "alloc" else None
        info = layers.info.get(key) if key is not None else None
        layer = info[1] if info is not None else None
        step = step_at(r["start_ns"]) if kind not in ("d2h", "offload_wait") or info is None else info[0]
        lane = {"d2h": "D2H", "h2d": "H2D", "wait": "compute", "offload_wait": "compute", "alloc": "host"}[kind]
        spans.append(Span(lane, kind, ms(r["start_ns"]), ms(r["end_ns"]), r["device"], step, layer, r["bytes"],
                          ms(r["queued_ns"]), r["id"], kind in ("h2d", "wait") and r["id"] in on_demand,
                          bool(r["same_stream"])))
    return spans, unfinished
