"""ckpt_offload.timeline(): the copies, layer spans, reload waits and pinned allocations of a training step,
checked against the engine's own counters; its Chrome trace, picture and summary; the names ckpt_offload's
work carries under torch.profiler; and nothing recorded or named outside a timeline.

The step tests run on the simulated asynchronous runtime in a process of their own (engines read the
switches when they are created), with copy delays comparable to the layers' compute."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt_offload
from conftest import requires_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
timeline_module = sys.modules["ckpt_offload.timeline"]


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


def make_model(layers=4, width=64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[Block(width) for _ in range(layers)])


def step(model, x):
    model(x).square().mean().backward()


# -- a step on the simulated runtime ----------------------------------------------------------------
_STEP_SCRIPT = r"""
import json, sys, torch, ckpt_offload
sys.path.insert(0, sys.argv[2])
from test_timeline import make_model, step

prefetch = int(sys.argv[1])
assert ckpt_offload.engine_for("cpu").runtime == "async-sim"
LAYERS = 6
model = make_model(LAYERS, width=384)
ref = make_model(LAYERS, width=384)
x = torch.randn(192, 384, requires_grad=True)
step(ref, x)
ref_grads = [p.grad.clone() for p in ref.parameters()]
x.grad = None
ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0, prefetch=prefetch)
ckpt_offload.synchronize()
ckpt_offload.reset_stats()
with ckpt_offload.timeline() as tl:
    for _ in range(2):  # the first step pins the pool's blocks, the second reuses them
        model.zero_grad(set_to_none=True)
        step(model, x)
s = ckpt_offload.stats()
grads_equal = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads))
print(json.dumps({
    "spans": [dict(vars(sp)) for sp in tl.spans], "summary": tl.summary(), "runtimes": tl.runtimes,
    "stats": {k: s[k] for k in ("tensors_offloaded", "tensors_prefetched", "reloads_on_demand",
                                "host_alloc_calls")},
    "grads_equal": grads_equal, "dropped": tl.dropped, "unfinished": tl.unfinished, "layers": LAYERS,
}))
"""


def _run_step(prefetch):
    env = dict(os.environ, CKPT_OFFLOAD_TEST_CPU="1", CKPT_OFFLOAD_TEST_ASYNC="1",
               CKPT_OFFLOAD_TEST_ASYNC_MAX_US="8000", CKPT_OFFLOAD_TEST_SEED="5")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _STEP_SCRIPT, str(prefetch), os.path.dirname(__file__)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sim_runs():
    return {1: _run_step(1), 0: _run_step(0)}


def _lane(out, lane, kinds=None):
    spans = [s for s in out["spans"] if s["lane"] == lane and (kinds is None or s["kind"] in kinds)]
    return sorted(spans, key=lambda s: (s["start_ms"], s["end_ms"]))


def _assert_disjoint(spans):
    for s in spans:
        assert s["start_ms"] <= s["end_ms"], s
    for a, b in zip(spans, spans[1:]):
        assert a["end_ms"] <= b["start_ms"], (a, b)


@pytest.mark.parametrize("prefetch", [1, 0])
def test_copy_lanes_match_the_engine_counters(sim_runs, prefetch):
    out = sim_runs[prefetch]
    assert out["runtimes"] == {"cpu": "async-sim"}
    assert out["grads_equal"], "gradients differ from the unmodified model under a timeline"
    assert out["dropped"] == 0 and out["unfinished"] == 0
    d2h, h2d = _lane(out, "D2H"), _lane(out, "H2D")
    assert len(d2h) == out["stats"]["tensors_offloaded"] == 2 * out["layers"]
    assert len(h2d) == out["stats"]["tensors_prefetched"] == 2 * out["layers"]
    assert {s["kind"] for s in d2h} == {"d2h"} and {s["kind"] for s in h2d} == {"h2d"}
    # Every copy is named by the layer that offloaded it, once per step, with its bytes.
    for lane in (d2h, h2d):
        assert sorted((s["step"], s["layer"]) for s in lane) == [(st, i) for st in (0, 1) for i in range(6)]
        assert all(s["bytes"] == 192 * 384 * 4 for s in lane)
    s = out["summary"]
    assert s["steps"] == 2
    assert s["d2h"]["copies"] == len(d2h) and s["d2h"]["bytes"] == sum(x["bytes"] for x in d2h)
    assert s["h2d"]["copies"] == len(h2d) and s["h2d"]["gb_per_s"] > 0


@pytest.mark.parametrize("prefetch", [1, 0])
def test_spans_are_well_formed(sim_runs, prefetch):
    out = sim_runs[prefetch]
    _assert_disjoint(_lane(out, "D2H"))  # one stream: copies run one after another
    _assert_disjoint(_lane(out, "H2D"))
    layers = _lane(out, "compute", {"forward", "backward"})
    _assert_disjoint(layers)
    assert sorted((s["kind"], s["step"], s["layer"]) for s in layers) == sorted(
        (k, st, i) for k in ("forward", "backward") for st in (0, 1) for i in range(6))
    _assert_disjoint(_lane(out, "compute", {"wait", "offload_wait"}))
    waits = _lane(out, "compute", {"wait"})
    assert len(waits) == 2 * out["layers"]
    for w in _lane(out, "compute", {"offload_wait"}):  # named by the copy it waited for
        assert w["layer"] is not None and w["bytes"] == 192 * 384 * 4, w
    backward = [s for s in layers if s["kind"] == "backward"]
    for w in waits:  # the compute stream waits for a reload inside the layer's backward that needs it
        assert any(b["start_ms"] <= w["start_ms"] and w["end_ms"] <= b["end_ms"] and b["layer"] == w["layer"]
                   for b in backward), w
    for c in _lane(out, "D2H") + _lane(out, "H2D"):
        assert c["queued_ms"] <= c["start_ms"], c  # queued by the host before its stream ran it


def test_copies_overlap_compute(sim_runs):
    s = sim_runs[1]["summary"]
    assert s["overlap_fraction"] is not None and 0 < s["overlap_fraction"] <= 1


def test_pinned_allocations_come_in_the_first_step_only(sim_runs):
    out = sim_runs[1]
    allocs = _lane(out, "host")
    assert allocs and {a["kind"] for a in allocs} == {"alloc"}
    assert {a["step"] for a in allocs} == {0}
    assert sum(a["bytes"] for a in allocs) > 0
    assert out["summary"]["pinned_allocations"]["count"] == len(allocs)


def test_without_prefetch_every_reload_is_on_demand_and_exposed_waits_grow(sim_runs):
    with_prefetch, without = sim_runs[1], sim_runs[0]
    # Without prefetch the fetch queues every reload itself; with it only backward's first reload
    # (the last layer's: nothing comes before it to start it from).
    assert without["summary"]["h2d"]["on_demand"] == without["summary"]["h2d"]["copies"] == 12
    assert without["stats"]["reloads_on_demand"] == 12
    assert with_prefetch["summary"]["h2d"]["on_demand"] == 2
    assert with_prefetch["stats"]["reloads_on_demand"] == 2
    # Exposed waits grow: every reload of the run without prefetch is a wait for a whole copy queued
    # at the fetch (12 against 2). Their durations are wall time on a shared CPU, not compared here:
    # benchmarks carry timings, tests do not.
    assert without["summary"]["exposed_wait_ms_per_step"][1] > 0
    longest = without["summary"]["longest_wait"]
    assert longest["ms"] > 0 and 0 <= longest["layer"] < 6
    s = without["summary"]
    assert s["exposed_wait_ms_per_step"] == [a + b for a, b in zip(s["reload_wait_ms_per_step"],
                                                                   s["offload_wait_ms_per_step"])]


def test_example_writes_the_picture_and_the_trace(tmp_path):
    pytest.importorskip("matplotlib", reason="Timeline.plot draws with matplotlib")
    out = tmp_path / "sim"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "timeline_sim.py"), "--max-us", "2000",
                        "--layers", "3", "--width", "64", "--batch", "16", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    summary = json.loads(p.stdout)
    assert summary["runtimes"] == {"cpu": "async-sim"} and summary["d2h"]["copies"] == 3
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "sim.json").read_text())["traceEvents"]


# -- outputs ------------------------------------------------------------------------------------
def _recorded_step(layers=3, prefetch=1):
    model = make_model(layers)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0, prefetch=prefetch)
    x = torch.randn(32, 64, requires_grad=True)
    with ckpt_offload.timeline() as tl:
        step(model, x)
    return tl


def test_chrome_trace_is_valid_json_with_one_lane_per_stream(test_cpu, tmp_path):
    tl = _recorded_step()
    path = tmp_path / "step.json"
    tl.save_chrome_trace(path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(lanes.values()) >= {"compute", "D2H", "H2D"}
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in slices)
    by_lane = {name: [e for e in slices if lanes[e["tid"]] == name] for name in lanes.values()}
    s = ckpt_offload.stats()
    assert len(by_lane["D2H"]) == s["tensors_offloaded"] == 3
    assert len(by_lane["H2D"]) == s["tensors_prefetched"] == 3
    assert sorted(e["name"] for e in by_lane["D2H"]) == ["offload layer 0", "offload layer 1", "offload layer 2"]
    names = {e["name"] for e in by_lane["compute"]}
    assert {"layer 0 forward", "layer 2 backward"} <= names
    assert any(n.startswith("wait layer") for n in names)
    assert all(e["cname"] == "terrible" for e in by_lane["compute"] if "wait" in e["name"])  # red
    assert doc["otherData"]["summary"]["d2h"]["copies"] == 3


def test_plot_writes_a_png(test_cpu, tmp_path):
    pytest.importorskip("matplotlib", reason="Timeline.plot draws with matplotlib")
    tl = _recorded_step()
    path = tmp_path / "step.png"
    tl.plot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_host_only_copies_count_as_not_overlapped(test_cpu):
    # The synchronous host path copies on the compute thread itself: nothing hides under compute. (Under
    # scripts/test_async_sim.sh the process-wide CPU engine runs the simulated streams instead.)
    runtime = ckpt_offload.engine_for("cpu").runtime
    tl = _recorded_step()
    assert tl.runtimes == {"cpu": runtime}
    copies = [s for s in tl.spans if s.kind in ("d2h", "h2d")]
    assert len(copies) == 6
    assert all(s.same_stream == (runtime == "sync") for s in copies)
    if runtime == "sync":
        assert tl.summary()["overlap_fraction"] == 0


# -- the profiler ---------------------------------------------------------------------------------
def test_profiler_shows_named_ranges(test_cpu):
    model = make_model(3)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0, prefetch=1)
    x = torch.randn(32, 64, requires_grad=True)
    step(model, x)  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(model, x)
    names = {e.name for e in prof.events()}
    assert {"ckpt_offload::offload layer 0", "ckpt_offload::offload layer 1", "ckpt_offload::offload layer 2"} <= names
    # Layer 0's reload is started from layer 1's backward; the last layer's is queued by its fetch.
    assert "ckpt_offload::reload layer 0" in names and "ckpt_offload::reload layer 2" in names
    assert "ckpt_offload::wait layer 0" in names
    assert not timeline_module.naming()  # the profiler is gone


# -- off unless asked --------------------------------------------------------------------------------
def test_nothing_is_named_or_recorded_outside_a_timeline(test_cpu, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("named outside a timeline or profiler")

    monkeypatch.setattr(timeline_module, "NamedEngine", refuse)
    monkeypatch.setattr(timeline_module, "run_layer", refuse)
    assert not timeline_module.naming() and not ckpt_offload._C.timeline_recording()
    model = make_model(3)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    step(model, torch.randn(32, 64, requires_grad=True))
    assert ckpt_offload.stats()["tensors_offloaded"] == 3
    # What the engine did outside the timeline left nothing in its ring.
    with ckpt_offload.timeline() as tl:
        pass
    assert tl.spans == [] and tl.dropped == 0


def test_a_full_ring_keeps_the_newest_records(test_cpu):
    model = make_model(3)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    x = torch.randn(32, 64, requires_grad=True)
    with ckpt_offload.timeline(capacity=5) as tl:
        step(model, x)
    assert tl.dropped > 0
    kinds = [s.kind for s in tl.spans]
    assert len(tl.spans) <= 5 and "wait" in kinds  # the waits come last in a step


def test_bad_arguments_and_nesting_are_refused(test_cpu):
    with pytest.raises(TypeError, match=r"ckpt_offload.timeline: capacity must be an int >= 1"):
        ckpt_offload.timeline(capacity="big")
    with pytest.raises(ValueError, match=r"ckpt_offload.timeline: capacity must be an int >= 1"):
        ckpt_offload.timeline(capacity=0)
    with ckpt_offload.timeline():
        with pytest.raises(RuntimeError, match="a timeline is already recording"):
            with ckpt_offload.timeline():
                pass
    assert not ckpt_offload._C.timeline_recording()


# -- on a GPU: CUDA events -------------------------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
def test_gpu_timeline_comes_from_cuda_events():
    torch.manual_seed(0)
    model = make_model(4, width=1024).cuda()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0, prefetch=1)
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    step(model, x)  # the pool pins its blocks
    ckpt_offload.synchronize()
    ckpt_offload.reset_stats()
    with ckpt_offload.timeline() as tl:
        step(model, x)
    dev = f"cuda:{torch.cuda.current_device()}"
    assert tl.runtimes == {dev: "cuda"} and tl.unfinished == 0 and tl.dropped == 0
    s = ckpt_offload.stats()
    d2h, h2d = tl.lane("D2H", dev), tl.lane("H2D", dev)
    assert len(d2h) == s["tensors_offloaded"] == 4 and len(h2d) == s["tensors_prefetched"] == 4
    for lane in (d2h, h2d, [sp for sp in tl.lane("compute", dev) if sp.kind in ("forward", "backward")]):
        assert all(0 <= sp.start_ms <= sp.end_ms for sp in lane)
        assert all(a.end_ms <= b.start_ms for a, b in zip(lane, lane[1:]))
    assert not any(sp.same_stream for sp in d2h + h2d)
    assert tl.summary()["overlap_fraction"] > 0
    assert tl.lane("host", dev) == []  # the warm step pinned every block
