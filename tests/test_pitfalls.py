"""The defects other activation offloaders shipped, each held by a test: the table in
docs/how-it-works.md ("Which test holds each defect") names, for every row of the list, the tests
whose docstrings say "PITFALLS N"; the first test here checks the table against the tests. The
others hold the rows no older test held: a copy shared by views of one storage (43), a reload
ordered after its own layer's offload (44), the RNG flag of a checkpoint (45), growth over many
steps (46) and graph capture (49). scripts/mutations.py puts each defect back and shows these fail."""
import ast
import gc
import os
import re
import subprocess
import sys

import pytest
import torch

import ckpt_offload
from conftest import requires_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = 50  # the rows of the list of defects (PITFALLS.md) the project holds itself to


# --- the table ---------------------------------------------------------------------------------


def _table():
    """{row: [test ids]} from docs/how-it-works.md's table, and the rows it marks GPU-only."""
    text = open(os.path.join(ROOT, "docs", "how-it-works.md"), encoding="utf-8").read()
    section = text.split("## Which test holds each defect", 1)[1].split("\n## ", 1)[0]
    rows, gpu_only = {}, set()
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|(.*)\|", line)
        if not m:
            continue
        row = int(m.group(1))
        assert row not in rows, f"row {row} is in the table twice"
        rows[row] = re.findall(r"`(tests/test_\w+\.py::\w+)`", m.group(2))
        if "GPU only" in m.group(2):
            gpu_only.add(row)
    return rows, gpu_only


def _docstrings():
    """{test id: docstring} of every test function in tests/."""
    out = {}
    for name in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        path = os.path.join(ROOT, "tests", name)
        for node in ast.parse(open(path, encoding="utf-8").read()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out[f"tests/{name}::{node.name}"] = ast.get_docstring(node) or ""
    return out


def _rows_named(doc):
    """The rows a docstring names: "PITFALLS 4", "PITFALLS 1, 15", "PITFALLS 6/7"."""
    rows = set()
    for m in re.finditer(r"PITFALLS ((?:\d+)(?:\s*(?:,|/|and)\s*\d+)*)", doc):
        rows.update(int(n) for n in re.findall(r"\d+", m.group(1)))
    return rows


def test_every_row_is_held_by_a_named_test():
    """Every row 1..50 is in the table; every test the table names exists and its docstring says
    "PITFALLS N" for that row; every docstring that says "PITFALLS N" is in the table at row N; a
    row held only by GPU tests says "GPU only". Fails on a row missing from the table, a test
    renamed or deleted, or a docstring and the table that disagree."""
    rows, gpu_only = _table()
    docs = _docstrings()
    assert sorted(rows) == list(range(1, ROWS + 1)), f"rows missing from the table: {set(range(1, ROWS + 1)) - set(rows)}"
    problems = []
    for row, ids in rows.items():
        if not ids:
            problems.append(f"row {row}: no test named")
        for tid in ids:
            if tid not in docs:
                problems.append(f"row {row}: {tid} does not exist")
            elif row not in _rows_named(docs[tid]):
                problems.append(f"row {row}: the docstring of {tid} does not say PITFALLS {row}")
    for tid, doc in docs.items():
        for row in _rows_named(doc):
            if row not in rows or tid not in rows[row]:
                problems.append(f"{tid} says PITFALLS {row} but the table's row {row} does not name it")
    for row, ids in rows.items():
        present = [tid for tid in ids if tid in docs]
        all_gpu = bool(present) and all(_is_gpu_test(tid) for tid in present)
        if all_gpu != (row in gpu_only):
            problems.append(f"row {row}: " + ("every test is a GPU test; the table must say 'GPU only'" if all_gpu
                                              else "a test runs on the CPU; the table must not say 'GPU only'"))
    assert not problems, "\n".join(problems)


def _is_gpu_test(tid):
    path, name = tid.split("::")
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return any("gpu" in ast.unparse(d) or "requires_cuda" in ast.unparse(d) for d in node.decorator_list)
    return False


# --- row 43: views of one storage share a copy, each comes back in its own layout -----------------


def _layouts(views):
    """Shape, strides, offset from its base's and values of (a, a.t(), b, b[2:6], b[9:13])."""
    bases = (views[0], views[0], views[2], views[2], views[2])
    return [(tuple(v.shape), v.stride(), v.storage_offset() - base.storage_offset(), v.detach().clone())
            for v, base in zip(views, bases)]


class _SaveViews(torch.autograd.Function):
    """Saves a base, its transpose, and a second base with two offset slices of it; backward uses
    each (and records what it got back), so a wrong layout or value changes the gradients."""

    sent, got = [], []

    @staticmethod
    def forward(ctx, a, b):
        a, b = a * 1, b * 1  # made here: storages of their own, which the context offloads
        views = (a, a.t(), b, b[2:6], b[9:13])
        ctx.save_for_backward(*views)
        _SaveViews.sent = _layouts(views)
        return (a @ a.t()).sum() + (b[2:6] * b[9:13]).sum()

    @staticmethod
    def backward(ctx, g):
        a, at, b, s1, s2 = ctx.saved_tensors
        _SaveViews.got = _layouts((a, at, b, s1, s2))
        ga = g * (2 * at.t() + (a @ at)[:, :1])
        gb = g * b.clone()
        gb[2:6] += g * s2
        gb[9:13] += g * s1
        return ga, gb


def _views_step(a0, b0):
    a = a0.clone().requires_grad_()
    b = b0.clone().requires_grad_()
    _SaveViews.apply(a, b).backward()
    return a.grad, b.grad


@pytest.mark.usefixtures("test_cpu")
def test_row43_views_sharing_a_copy_come_back_in_their_own_layout():
    """PITFALLS 43: a base and its transpose, and a base with two offset slices of it, saved in one
    forward: each view shares its base's single copy (stats()["shared_views"]) and comes back with
    its own shape, strides and offset and its own values; gradients bitwise those without offload.
    Fails where a shared copy is rebuilt with the base's layout (the transpose comes back as the
    base, the slices at the base's offset)."""
    gen = torch.Generator().manual_seed(43)
    a0 = torch.randn(48, 80, generator=gen)
    b0 = torch.randn(16, 64, generator=gen)
    ref = _views_step(a0, b0)
    with ckpt_offload.offload_activations(min_bytes=0):
        a = a0.clone().requires_grad_()
        b = b0.clone().requires_grad_()
        loss = _SaveViews.apply(a, b)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 2, s  # one copy per storage
    assert s["shared_views"] == 3, s  # the transpose and the two slices
    loss.backward()
    for name, got, sent in zip(("a", "a.t()", "b", "b[2:6]", "b[9:13]"), _SaveViews.got, _SaveViews.sent):
        assert got[:3] == sent[:3], f"{name} came back as shape/stride/offset {got[:3]}, saved as {sent[:3]}"
        assert torch.equal(got[3], sent[3]), f"{name} came back with other values"
    assert torch.equal(a.grad, ref[0]) and torch.equal(b.grad, ref[1])
    assert ckpt_offload.stats()["tensors_fetched"] == 2


@pytest.mark.usefixtures("test_cpu")
def test_row43_checkpoint_inputs_that_are_views_of_one_storage():
    """PITFALLS 43: ckpt_offload.checkpoint's positional inputs x, x.t() and two offset slices of one
    storage: each is rebuilt in its own layout for the recompute; gradients bitwise those of torch's
    checkpoint. Fails where the views are rebuilt with the base's layout (a shape error in the
    recompute, or other gradients)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(80, 80, generator=gen)

    def fn(x, xt, s1, s2):
        return (x @ w @ xt).tanh().sum() + (s1 @ w[:, :4]).sum() * (s2 @ w[:, 4:8]).sum()

    base0 = torch.randn(48, 80, generator=gen)

    def run(offload):
        base = base0.clone().requires_grad_()
        x = base * 1
        out = ckpt_offload.checkpoint(fn, x, x.t(), x[3:11], x[20:28], offload=offload)
        out.backward()
        return base.grad

    ref = run(False)
    got = run(True)
    assert ckpt_offload.stats()["shared_views"] == 3
    assert torch.equal(got, ref)


# --- row 1: sources handed back only after (or ordered after) their copies ------------------------

_SOURCES_SCRIPT = r"""
import torch, ckpt_offload
from torch.multiprocessing.reductions import StorageWeakRef
assert ckpt_offload.build_info()["test_path"] == "async-sim"
torch.manual_seed(0)
layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(4)]
params = [p for l in layers for p in l.parameters()]
x0 = torch.randn(256, 256)

def forward(offload):
    h, refs = x0.clone().requires_grad_(), []
    for layer in layers:
        inp = h * 1  # nothing but the engine holds it once the call returns
        refs.append(StorageWeakRef(inp.untyped_storage()))
        h = ckpt_offload.checkpoint(layer, inp, offload=offload)
        del inp
        if offload:
            # The layer ended: its source went back to the allocator, though its copy (up to 50 ms
            # here) may still be queued.
            assert ckpt_offload.stats()["pending_sources"] == 0
    return h.pow(2).sum(), refs

loss, _ = forward(False)
ref = torch.autograd.grad(loss, params)
for step in range(6):
    loss, refs = forward(True)
    assert all(r.expired() for r in refs), "a source is still held after its layer"
    grads = torch.autograd.grad(loss, params)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref)), f"step {step}: gradients differ"
s = ckpt_offload.stats()
assert s["tensors_offloaded"] == 24 == s["tensors_fetched"] and s["host_in_use_bytes"] == 0, s
print("ok")
"""


def test_row1_sources_go_back_to_the_allocator_ordered_after_their_copies():
    """PITFALLS 1: checkpoint calls on the simulated asynchronous runtime with copies of up to 50 ms:
    each layer's input loses its last reference right after the call and goes back to the allocator
    while its copy may still be queued; gradients are bitwise those without offload for 6 steps,
    and the runtime reports no hazard. Fails where a source is handed back without its producer
    being ordered after its copy ("source memory released while its copy is queued"): on a GPU
    the caching allocator would hand that memory to the next layer before the copy read it."""
    rc, out = _run_sim(_SOURCES_SCRIPT, max_us=50_000)
    assert rc == 0 and out.startswith("ok"), out[-3000:]


# --- row 44: each reload ordered after its own layer's offload -----------------------------------

_ORDER_SCRIPT = r"""
import torch, ckpt_offload
assert ckpt_offload.build_info()["test_path"] == "async-sim"
torch.manual_seed(0)
widths = [64, 512, 96, 384, 128, 256]  # layers of different sizes: copies of different lengths
layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:] + widths[:1]))
x0 = torch.randn(64, widths[0])

def forward(x):
    for layer in layers:
        x = torch.tanh(layer(x))
    return x.pow(2).sum()

params = list(layers.parameters())
ref = torch.autograd.grad(forward(x0.clone().requires_grad_()), params)
for step in range(12):
    x = x0.clone().requires_grad_()
    with ckpt_offload.offload_activations(min_bytes=0, prefetch=2):
        loss = forward(x)
        # Backward right after forward, inside the context: the offload copies are still queued
        # (copies take up to 30 ms each here), so every reload races its own offload unless ordered.
        pending = ckpt_offload.stats()["pending_sources"]
        grads = torch.autograd.grad(loss, params)
    assert pending > 0, "no copy was in flight when backward started: the test shows nothing"
    assert all(torch.equal(g, r) for g, r in zip(grads, ref)), "gradients differ"
s = ckpt_offload.stats()
assert s["tensors_fetched"] == s["tensors_offloaded"] > 0, s
assert s["host_in_use_bytes"] == 0, s
print("ok", s["tensors_offloaded"])
"""


def _run_sim(script, max_us, seed=5):
    env = dict(os.environ, CKPT_OFFLOAD_TEST_CPU="1", CKPT_OFFLOAD_TEST_ASYNC="1",
               CKPT_OFFLOAD_TEST_ASYNC_MAX_US=str(max_us), CKPT_OFFLOAD_TEST_SEED=str(seed))
    env.pop("CKPT_OFFLOAD_TEST_BREAK", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_row44_every_reload_waits_for_its_own_layers_offload():
    """PITFALLS 44, 2: layers of different sizes on the simulated asynchronous runtime with copies
    of up to 30 ms, backward started right after the forward while the offload copies are still
    queued: no hazard (the runtime raises on a reload queued before its own offload's copy
    completed, "reload queued before its offload's event"), gradients bitwise those without
    offload, every offloaded tensor reloaded once. Fails where a reload is ordered after an event
    recorded before its own copy was queued (a handler advanced one layer early), or after none."""
    rc, out = _run_sim(_ORDER_SCRIPT, max_us=30_000)
    assert rc == 0 and out.startswith("ok"), out[-3000:]


# --- row 45: the RNG flag of a checkpoint --------------------------------------------------------


class _Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x, scale=None):
        h = torch.nn.functional.dropout(self.a(x), p=0.5, training=True)
        if scale is not None:
            h = h * scale
        return self.b(h).sum()


@pytest.mark.usefixtures("test_cpu")
@pytest.mark.parametrize("call", ["positional", "keyword", "flag_keyword", "decorator"])
def test_row45_recompute_draws_the_forwards_dropout_mask(call):
    """PITFALLS 45: checkpoint calls with dropout, its inputs positional, as keywords, with
    preserve_rng_state=True given, and through the decorator: the recompute draws the forward's
    mask, so the gradients are bitwise those of the same step without any checkpoint (a different
    mask in the recompute changes them). Fails where the RNG state is not restored for the
    recompute (the flag lost, or set from the wrong argument)."""
    m = _Dropout()
    x0 = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    scale = torch.full((64,), 0.5)

    def grads(run):
        x = x0.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        torch.manual_seed(45)
        run(x).backward()
        return [x.grad] + [p.grad for p in m.parameters()]

    ref = grads(lambda x: m(x, scale))
    if call == "positional":
        got = grads(lambda x: ckpt_offload.checkpoint(m, x, scale))
    elif call == "keyword":
        got = grads(lambda x: ckpt_offload.checkpoint(m, x, scale=scale))
    elif call == "flag_keyword":
        got = grads(lambda x: ckpt_offload.checkpoint(m, x, scale, preserve_rng_state=True))
    else:
        wrapped = ckpt_offload.checkpoint(preserve_rng_state=True)(m)
        got = grads(lambda x: wrapped(x, scale))
    assert ckpt_offload.stats()["tensors_offloaded"] >= 1
    assert all(torch.equal(g, r) for g, r in zip(got, ref)), "the recompute drew another dropout mask"


@pytest.mark.usefixtures("test_cpu")
def test_row45_an_activation_in_a_flag_slot_is_refused():
    """PITFALLS 45: an activation passed where torch expects a flag (preserve_rng_state=x, debug=x,
    use_reentrant=x) is a TypeError naming the flag, before anything runs. Fails where the tensor is
    read for its truth (a one-element activation decides whether the RNG is restored) or fails deep
    in torch with an ambiguous-boolean error."""
    m = _Dropout()
    x = torch.randn(32, 64, requires_grad=True)
    one = torch.ones(())
    for name in ("preserve_rng_state", "debug"):
        for value in (one, x):
            with pytest.raises(TypeError, match=rf"ckpt_offload\.checkpoint: {name} must be a bool, got Tensor"):
                ckpt_offload.checkpoint(m, x, **{name: value})
    with pytest.raises((TypeError, ValueError), match="use_reentrant"):
        ckpt_offload.checkpoint(m, x, use_reentrant=one)
    assert ckpt_offload.stats()["tensors_offloaded"] == 0


# --- row 46: flat over many steps -------------------------------------------------------------------


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_tensor_bytes():
    """Bytes of the distinct storages of live plain tensors (parameters left out)."""
    gc.collect()
    seen = {}
    for o in gc.get_objects():
        if type(o) is torch.Tensor and o.device.type == "cpu":
            st = o.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


STEPS = 200


@pytest.mark.usefixtures("test_cpu")
@pytest.mark.parametrize("pattern", ["checkpoint", "enable_checkpointing", "backward_after_the_context_exits"])
def test_row46_two_hundred_steps_stay_flat(pattern, one_thread):
    """PITFALLS 46: 200 steps of each pattern (checkpoint calls, enable_checkpointing, and
    offload_activations with backward run after the context exited): gradients bitwise every step,
    host blocks all back after each step, the pool's pinned/reserved bytes unchanged after the
    first step, live tensor bytes (the device's tensors on this test path) and RSS flat from step
    10 to 200. Fails with a keep-alive list of offloaded tensors (growth), or with records
    cleared at the context's exit (a backward after it finds nothing to reload)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(4)])
    xs = [torch.randn(256, 128, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    params = list(model.parameters())
    refs = [torch.autograd.grad(model(x).sum(), params) for x in xs]
    if pattern == "enable_checkpointing":
        ckpt_offload.enable_checkpointing(model, layers=list(model), offload=True, keep_last=0)

    def step(x):
        x = x.clone()
        if pattern == "checkpoint":
            h = x
            for block in model:
                h = ckpt_offload.checkpoint(block, h)
            return torch.autograd.grad(h.sum(), params)
        if pattern == "enable_checkpointing":
            return torch.autograd.grad(model(x).sum(), params)
        with ckpt_offload.offload_activations(min_bytes=0):
            loss = model(x).sum()
        return torch.autograd.grad(loss, params)  # after the context exited

    marks = {}
    try:
        for i in range(STEPS):
            grads = step(xs[i % 4])
            assert all(torch.equal(g, r) for g, r in zip(grads, refs[i % 4])), f"step {i}: gradients differ"
            del grads
            s = ckpt_offload.stats()
            assert s["host_in_use_bytes"] == 0, (i, s["host_in_use_bytes"])
            if i == 0:
                reserved = s["host_reserved_bytes"]
            assert s["host_reserved_bytes"] == reserved, (i, s["host_reserved_bytes"], reserved)
            if i in (10, STEPS - 1):
                marks[i] = (_live_tensor_bytes(), _rss())
    finally:
        if pattern == "enable_checkpointing":
            ckpt_offload.disable_checkpointing(model)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] >= 4 * STEPS and s["tensors_fetched"] == s["tensors_offloaded"], s
    (live0, rss0), (live1, rss1) = marks[10], marks[STEPS - 1]
    one_input = 256 * 128 * 4
    assert live1 - live0 < one_input, f"live tensor bytes grew by {live1 - live0} over {STEPS - 11} steps"
    # RSS also moves with the C allocator's arenas: 16 MiB of slack; one 128 KiB input kept a step is 24 MiB here.
    assert rss1 - rss0 < 16 * 2**20, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {STEPS - 11} steps"


# --- row 49: graph capture -------------------------------------------------------------------------


@pytest.fixture
def fake_capture(monkeypatch):
    """torch.cuda reports a stream capture in progress, as inside torch.cuda.graph(g)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


@pytest.mark.usefixtures("test_cpu")
@pytest.mark.parametrize("entry", ["checkpoint", "enable_checkpointing", "offload_activations"])
def test_row49_capture_is_refused_with_one_clear_error(entry, monkeypatch):
    """PITFALLS 49, 42: a forward with offload started while the current stream captures a CUDA
    graph raises one RuntimeError that says so, at every entry point, before anything is copied, and
    leaves nothing behind (no host block in use, the entry point usable once capture ends);
    offload=False under capture is torch's own business and goes through. Fails where capture is
    not detected: the captured step would replay copies into host blocks since reused and reload
    into addresses it no longer owns (garbage gradients, nothing raised)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    x = torch.randn(32, 64, requires_grad=True)
    if entry == "enable_checkpointing":
        ckpt_offload.enable_checkpointing(model, layers=list(model), offload=True, keep_last=0)

    def forward():
        if entry == "checkpoint":
            h = x
            for layer in model:
                h = ckpt_offload.checkpoint(layer, h)
            return h.sum()
        if entry == "enable_checkpointing":
            return model(x).sum()
        with ckpt_offload.offload_activations(min_bytes=0):
            return model(x).sum()

    try:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_initialized", lambda: True)
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            with pytest.raises(RuntimeError, match="during CUDA graph capture is not supported") as e:
                forward()
            assert "\n" not in str(e.value)
            assert ckpt_offload.stats()["tensors_offloaded"] == 0
            if entry == "checkpoint":  # offload=False under capture: plain torch checkpoint
                ckpt_offload.checkpoint(model[0], x, offload=False).sum().backward()
        assert ckpt_offload.stats()["host_in_use_bytes"] == 0
        forward().backward()  # capture over: the same entry point works
        assert ckpt_offload.stats()["tensors_offloaded"] > 0
        assert ckpt_offload.stats()["host_in_use_bytes"] == 0
    finally:
        if entry == "enable_checkpointing":
            ckpt_offload.disable_checkpointing(model)


@pytest.mark.gpu
@requires_cuda
def test_row49_gpu_capture_of_an_offloading_step_is_refused():
    """PITFALLS 49, 42: a real torch.cuda.graph capture around a forward with offload raises the
    clear error (no garbage gradients, no hang), and the process can still train eagerly after.
    Fails where capture goes unnoticed: a replay would copy into reused host blocks and reload
    into stale addresses."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)]).cuda()
    ckpt_offload.enable_checkpointing(model, layers=list(model), offload=True, keep_last=0)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    model(x).sum().backward()  # warm-up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="graph capture is not supported"):
        with torch.cuda.graph(g):
            model(x).sum().backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    torch.cuda.synchronize()
    assert ckpt_offload.stats()["host_in_use_bytes"] == 0
    ckpt_offload.disable_checkpointing(model)
