"""The simulated asynchronous runtime (CKPT_OFFLOAD_TEST_ASYNC=1): copies really in flight on the CPU,
hazards reported with the handle they concern, each protocol rule shown load-bearing by breaking it
(CKPT_OFFLOAD_TEST_BREAK), and sources handed back by layer or by bytes in flight.

Engines read the switches when they are created, so each test here makes its own engine (or runs a
subprocess for the process-wide ones). The engine, checkpoint, reliability and hf suites run whole
under the simulation in CI (scripts/test_async_sim.sh)."""
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import ckpt_offload

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sim_engine(monkeypatch, max_us=200, brk=None, pool=None):
    """A fresh engine on the simulated runtime (the switches are read here, at creation)."""
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "1")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC_MAX_US", str(max_us))
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_SEED", "7")
    if brk is not None:
        monkeypatch.setenv("CKPT_OFFLOAD_TEST_BREAK", brk)
    try:
        eng = ckpt_offload.CopyEngine("cpu", pool or ckpt_offload.HostPool(pinned=False))
    finally:
        monkeypatch.delenv("CKPT_OFFLOAD_TEST_BREAK", raising=False)
    assert eng.runtime == "async-sim"
    return eng


def tensors(n, numel=64 * 1024):
    return [torch.arange(numel, dtype=torch.float32) + 1000 * i for i in range(n)]


def test_switches_choose_the_runtime(monkeypatch):
    monkeypatch.delenv("CKPT_OFFLOAD_TEST_CPU", raising=False)
    monkeypatch.delenv("CKPT_OFFLOAD_TEST_ASYNC", raising=False)
    assert ckpt_offload.build_info()["test_path"] == "off"
    assert ckpt_offload.CopyEngine("cpu", ckpt_offload.HostPool(pinned=False)).runtime == "sync"
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "1")  # ignored without the CPU test path
    assert ckpt_offload.build_info()["test_path"] == "off"
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "0")
    assert ckpt_offload.build_info()["test_path"] == "sync"
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "1")
    assert ckpt_offload.build_info()["test_path"] == "async-sim"
    assert ckpt_offload.CopyEngine("cpu", ckpt_offload.HostPool(pinned=False)).runtime == "async-sim"
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "yes")
    with pytest.raises(ValueError, match="CKPT_OFFLOAD_TEST_ASYNC must be 0 or 1"):
        ckpt_offload.build_info()
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "0")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_BREAK", "d2h_wait")
    with pytest.raises(ValueError, match="testing aid of the simulated runtime"):
        ckpt_offload.CopyEngine("cpu", ckpt_offload.HostPool(pinned=False))
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_BREAK", "everything")
    with pytest.raises(ValueError, match="CKPT_OFFLOAD_TEST_BREAK must be one of"):
        ckpt_offload.CopyEngine("cpu", ckpt_offload.HostPool(pinned=False))


def test_copies_are_in_flight_and_every_byte_comes_back(monkeypatch):
    eng = sim_engine(monkeypatch, max_us=20_000)  # about 160 ms of copies queued in all
    xs = tensors(16)
    hs = [eng.offload(x) for x in xs]
    # The copies run behind the caller: at least the newest is still on its way.
    assert hs[-1].state == "offloading"
    assert eng.stats()["pending_sources"] > 0
    for h in hs[::2]:
        eng.prefetch(h)
    outs = [eng.fetch(h) for h in hs]
    assert all(torch.equal(o, x) for o, x in zip(outs, xs))
    eng.synchronize()
    assert eng.stats()["pending_sources"] == 0
    assert eng.pool.stats()["in_use_bytes"] == 0


def test_reused_blocks_keep_their_data(monkeypatch):
    # Blocks go back to the pool and are reused at once while other copies are still queued.
    eng = sim_engine(monkeypatch, max_us=500)
    for step in range(20):
        xs = tensors(4, numel=1024 * (1 + step % 3))
        hs = [eng.offload(x * 1) for x in xs]
        assert all(torch.equal(eng.fetch(h), x) for h, x in zip(hs, xs))
    assert eng.pool.stats()["hits"] > 0
    eng.synchronize()
    assert eng.pool.stats()["in_use_bytes"] == 0


# --- each rule of the protocol, broken: the runtime reports it -----------------------------------
# Copies take up to 50 ms here, so a copy the broken rule races is still queued when it is checked:
# a hazard is certain within a few tries (the loops stop at the first).


def _offload_then_drop_source(eng):
    for i in range(8):
        x = torch.full((64 * 1024,), float(i))
        h = eng.offload(x)
        del x  # the engine holds the last reference
        eng.release_sources(0)
        eng.release(h)


def _offload_then_prefetch(eng):
    for x in tensors(8):
        h = eng.offload(x)
        eng.prefetch(h)
        assert torch.equal(eng.fetch(h), x)


def _offload_then_fetch(eng):
    for x in tensors(8):
        h = eng.offload(x)
        assert torch.equal(eng.fetch(h), x)


def _two_engines_share_a_block(eng, other):
    # A handle released while its copy runs returns its block at once; the other engine's copy
    # into that block must wait for the first one, or the two writes race.
    for x, y in zip(tensors(8), tensors(8)[::-1]):
        h = eng.offload(x)
        eng.release(h)
        g = other.offload(y)
        assert torch.equal(other.fetch(g), y)


MUTATIONS = [
    ("d2h_wait", _offload_then_fetch,
     "offload copy queued without waiting for the compute stream (its source may not be written yet)"),
    ("reload_wait", _offload_then_prefetch, "reload queued before its offload's event"),
    ("fetch_wait", _offload_then_fetch, "tensor returned by fetch before its reload completed"),
    ("source_wait", _offload_then_drop_source, "source memory released while its copy is queued"),
    ("last_use", _two_engines_share_a_block, "pool block handed to a writer while a queued copy still writes it"),
]


@pytest.mark.parametrize("brk,scenario,hazard", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_each_rule_is_load_bearing(monkeypatch, brk, scenario, hazard):
    """PITFALLS 1, 2, 15: each rule of the copy protocol, broken on purpose (CKPT_OFFLOAD_TEST_BREAK), makes
    the simulated runtime report its hazard, and the intact protocol reports none: a source handed back
    before its copy (1), a reload before its own offload (2), a block written while a copy still uses it
    (15). Fails where the intact engine leaves one of these unordered, or where a rule is not
    load-bearing."""
    pool = ckpt_offload.HostPool(pinned=False)

    def engines(broken):
        # The rule broken is the one of the engine that acts second in the two-engine scenario
        # (its copy writes the shared block); its own copies need no delay.
        first = sim_engine(monkeypatch, max_us=50_000, brk=None if scenario is _two_engines_share_a_block else broken,
                           pool=pool)
        if scenario is not _two_engines_share_a_block:
            return [first]
        return [first, sim_engine(monkeypatch, max_us=0, brk=broken, pool=pool)]

    intact = engines(None)
    scenario(*intact)  # the intact protocol: no hazard, every byte back
    for eng in intact:
        eng.synchronize()
    assert pool.stats()["in_use_bytes"] == 0

    broken = engines(brk)
    message = r"ckpt_offload hazard \(async-sim\): " + re.escape(hazard) + r": handle #\d+;"
    with pytest.raises(RuntimeError, match=message):
        scenario(*broken)
    for eng in broken:
        eng.synchronize()


def test_hazard_names_the_handle(monkeypatch):
    eng = sim_engine(monkeypatch, max_us=50_000, brk="reload_wait")
    for x in tensors(8):
        h = eng.offload(x)
        try:
            eng.prefetch(h)
        except RuntimeError as e:
            assert f"reload queued before its offload's event: handle #{h.id};" in str(e)
            break
        eng.release(h)
    else:
        pytest.fail("no hazard reported")


def test_worker_error_surfaces_on_the_calling_thread(monkeypatch):
    # The third copy fails on its worker thread; the next engine call on this thread raises it.
    eng = sim_engine(monkeypatch, max_us=0, brk="copy_error")
    with pytest.raises(RuntimeError, match=r"the simulated D2H stream failed its copy of handle #\d+"):
        hs = [eng.offload(x) for x in tensors(3)]
        eng.synchronize()
    eng.synchronize()  # reported once
    x = tensors(1)[0]
    assert torch.equal(eng.fetch(eng.offload(x)), x)


# --- sources handed back by bytes in flight and by layer (issue 9) --------------------------------


def test_offload_hands_back_sources_with_enough_bytes_queued_after_them(monkeypatch):
    eng = sim_engine(monkeypatch, max_us=20_000)
    per = 16 * MiB
    assert eng.HAND_BACK_BYTES == 64 * MiB
    refs, hs = [], []
    for i in range(6):
        x = torch.full((per // 4,), float(i))
        refs.append(StorageWeakRef(x.untyped_storage()))
        hs.append(eng.offload(x))
        del x
    # 80 and 64 MiB were queued after the first two: handed back (freed), the rest may still be held.
    assert [r.expired() for r in refs[:2]] == [True, True]
    assert eng.stats()["pending_sources"] <= 4
    assert eng.release_sources(0) == 0
    assert all(r.expired() for r in refs)
    for i, h in enumerate(hs):
        assert torch.equal(eng.fetch(h), torch.full((per // 4,), float(i)))


_HAND_BACK_SCRIPT = r"""
import torch, ckpt_offload
from torch.multiprocessing.reductions import StorageWeakRef
from ckpt_offload.testing import LiveBytes

torch.manual_seed(0)
layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)]
params = [p for l in layers for p in l.parameters()]
x = torch.randn(512, 256, requires_grad=True)


def run(offload):
    with LiveBytes() as live:
        live.add(params + [x])
        base = live.current()
        h, inputs, pending = x, [], []
        for layer in layers:
            inp = h * 1  # the checkpoint's input: nothing but the engine holds it after the call
            inputs.append(StorageWeakRef(inp.untyped_storage()))
            h = ckpt_offload.checkpoint(layer, inp, offload=offload)
            del inp
            pending.append(ckpt_offload.stats()["pending_sources"])
        loss = h.sum()
        held = live.current() - base  # at the start of backward
        alive = sum(not r.expired() for r in inputs)
        loss.backward()
    return pending, held, alive, [p.grad.clone() for p in params] + [x.grad.clone()]


assert ckpt_offload.build_info()["test_path"] == "async-sim"
pending, held, alive, grads = run(True)
for p in params + [x]:
    p.grad = None
_, held_plain, alive_plain, ref = run(False)
assert all(torch.equal(a, b) for a, b in zip(grads, ref)), "gradients differ"
assert pending == [0, 0, 0, 0], pending
assert alive == 0, alive
out_bytes = 512 * 256 * 4
# Offloaded: only the last output (and the loss) are live when backward starts; plain checkpointing
# keeps its four inputs on the device as well.
assert held <= out_bytes + 64, held
assert held_plain >= held + 4 * out_bytes, (held_plain, held)
assert alive_plain == 4
s = ckpt_offload.stats()
assert s["host_in_use_bytes"] == 0 and s["pending_sources"] == 0, s
print("ok", pending, held, held_plain)
"""


def _run_sim(script, max_us):
    env = dict(os.environ, CKPT_OFFLOAD_TEST_CPU="1", CKPT_OFFLOAD_TEST_ASYNC="1",
               CKPT_OFFLOAD_TEST_ASYNC_MAX_US=str(max_us), CKPT_OFFLOAD_TEST_SEED="3")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_checkpoint_hands_back_its_inputs_when_its_layer_ends():
    # Copies take up to 20 ms: without the hand-back at the end of each checkpoint call, its input
    # would still be held (pending) after the call and into backward.
    assert _run_sim(_HAND_BACK_SCRIPT, max_us=20_000).startswith("ok")


_ACTIVATIONS_SCRIPT = r"""
import torch, ckpt_offload
from torch.multiprocessing.reductions import StorageWeakRef

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
x = torch.randn(256, 256, requires_grad=True)
ref = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
with ckpt_offload.offload_activations(min_bytes=1024):
    loss = model(x).sum()
    # Far fewer bytes than HAND_BACK_BYTES were queued: every source whose copy may still run is held.
    during = ckpt_offload.stats()["pending_sources"]
after = ckpt_offload.stats()["pending_sources"]
grads = torch.autograd.grad(loss, [x, *model.parameters()])
assert all(torch.equal(a, b) for a, b in zip(grads, ref)), "gradients differ"
assert during > 0 and after == 0, (during, after)
assert ckpt_offload.stats()["host_in_use_bytes"] == 0
print("ok", during, after)
"""


def test_offload_activations_holds_sources_until_its_context_ends():
    assert _run_sim(_ACTIVATIONS_SCRIPT, max_us=50_000).startswith("ok")
