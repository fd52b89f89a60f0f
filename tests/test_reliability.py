"""Reliability of the offload path: lifecycle, aliasing, tensor kinds, faults and GPU stream safety.

Each test compares against the unmodified computation and asserts what really moved (stats()) and
that every host block came back (pool in_use_bytes == 0). Rows of shared/PITFALLS.md are named
where a test covers one. GPU tests are marked `gpu` and skipped with a reason where none is present.
"""
import contextlib
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_offload
from conftest import DEVICES, requires_cuda
from tiny_gpt import grads, loss_of, make_batch, make_model

# A deadlock in the engine must fail a test, not hang the run: calls that can block forever on a
# lock run in a daemon thread joined with this bound (normal runs take well under a second).
HANG_S = 15


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


# -- helpers ---------------------------------------------------------------------------------------
def in_use():
    return ckpt_offload.host_pool().stats()["in_use_bytes"]


def settle(device, collect=True):
    if collect:
        gc.collect()  # about 0.1 s in a full test process: not in per-step loops
    if device == "cuda":
        torch.cuda.synchronize()
    ckpt_offload.synchronize()


def requested_device_bytes():
    """Bytes the live device tensors asked for. memory_allocated() counts allocator blocks, and a
    reused cached block can be up to 1 MiB larger than the request, differently in each run."""
    stats = torch.cuda.memory_stats()
    return stats.get("requested_bytes.all.current", torch.cuda.memory_allocated())


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def assert_grads(got, ref, device, what=""):
    assert got.keys() == ref.keys(), what
    for name in ref:
        if device == "cpu":
            # The CPU kernels are deterministic: recompute and reload must give the same bits.
            assert torch.equal(got[name], ref[name]), f"{what}: gradient of {name} differs"
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5, msg=f"{what}: {name}")


def run_bounded(fn, what, timeout=HANG_S):
    """fn() in a daemon thread; fails (instead of hanging) if it does not return in time."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    t = threading.Thread(target=target, daemon=True, name="bounded-" + what[:20])
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{what} did not return within {timeout} s: the call is blocked (deadlock)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def plain_grads(device, ids, seed=0, **kw):
    ref = make_model(seed=seed, device=device, **kw)
    loss_of(ref, ids).backward()
    return grads(ref)


class Boom(Exception):
    pass


# -- lifecycle: mixed steps ---------------------------------------------------------------------------
MODES = [
    ("ckpt", 1, True, 1),
    ("ckpt", 2, True, 1),
    ("ckpt", 3, True, 0),
    ("ckpt", 1, False, 0),
    ("context",),
    ("accumulate",),
    ("forwards_then_backward",),
]
MIX_KW = dict(hidden=64, layers=6, max_len=64)
# 200 steps on the CPU; on a GPU, where every step also synchronises and compares on the device,
# ten rounds of the seven modes keep the test within a few seconds of the GPU check's test stage.
MIX_STEPS = {"cpu": 200, "cuda": 10 * len(MODES)}


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_steps_return_every_block_and_stay_flat(device, test_cpu):
    """PITFALLS 6/7: modes mixed for 200 steps (70 on a GPU); in_use back to 0 after every
    backward, reserved host bytes, RSS (and device memory) flat after warm-up, every offloaded
    tensor fetched exactly once."""
    pool = ckpt_offload.host_pool()
    model = make_model(device=device, **MIX_KW)
    ref = make_model(device=device, **MIX_KW)
    batches = [make_batch(seed=s, batch=4, seq=64, device=device) for s in range(4)]

    single = []
    for b in batches:
        ref.zero_grad(set_to_none=True)
        loss_of(ref, b).backward()
        single.append(grads(ref))
    ref.zero_grad(set_to_none=True)
    for b in batches:
        loss_of(ref, b).backward()
    accumulated = grads(ref)
    ref.zero_grad(set_to_none=True)
    sum(loss_of(ref, b) for b in batches).backward()
    summed = grads(ref)

    warm = 2 * len(MODES)
    reserved, device_bytes = [], []
    rss_warm = None
    for step in range(MIX_STEPS[device]):
        mode = MODES[step % len(MODES)]
        model.zero_grad(set_to_none=True)
        if mode[0] == "ckpt":
            _, every_n, offload, keep_last = mode
            ckpt_offload.enable_checkpointing(model, every_n_layers=every_n, offload=offload, keep_last=keep_last)
            loss_of(model, batches[step % 4]).backward()
            expected = single[step % 4]
        elif mode[0] == "context":
            ckpt_offload.disable_checkpointing(model)
            with ckpt_offload.offload_activations(min_bytes=1024):
                loss = loss_of(model, batches[step % 4])
            loss.backward()
            del loss
            expected = single[step % 4]
        elif mode[0] == "accumulate":
            ckpt_offload.enable_checkpointing(model, offload=True)
            for b in batches:
                loss_of(model, b).backward()
                assert in_use() == 0, f"step {step}: host blocks still in use after a micro-batch backward"
            expected = accumulated
        else:  # several forwards, then one backward
            ckpt_offload.enable_checkpointing(model, offload=True)
            losses = [loss_of(model, b) for b in batches]
            assert in_use() > 0
            sum(losses).backward()
            del losses
            expected = summed
        assert in_use() == 0, f"step {step} ({mode}): host blocks still in use after backward"
        assert_grads(grads(model), expected, device, f"step {step} {mode}")
        settle(device, collect=step == warm)
        reserved.append(pool.stats()["reserved_bytes"])
        if device == "cuda":
            device_bytes.append(torch.cuda.memory_allocated())
        if step == warm:
            rss_warm = rss_bytes()

    assert max(reserved[warm:]) <= max(reserved[:warm]), "reserved host bytes grew after warm-up"
    gc.collect()
    # The run offloads about 1 MiB a step: leaking even a third of it would exceed this.
    assert rss_bytes() - rss_warm < 64 << 20, "host RSS grew after warm-up"
    if device == "cuda":
        assert max(device_bytes[warm:]) <= max(device_bytes[:warm]) + (1 << 20), "device memory grew"
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] > 0
    assert s["tensors_fetched"] == s["tensors_offloaded"]
    assert s["bytes_prefetched"] == s["bytes_offloaded"]
    assert s["tensors_released"] == 0
    assert s["pending_sources"] == 0
    assert s["tensors_kept_on_device"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_steady_loop_allocates_no_host_memory(device, test_cpu):
    """PITFALLS 7: after warm-up no host allocation happens, and reserved stays within 1.1x of peak."""
    pool = ckpt_offload.host_pool()
    pool.empty_cache()
    ckpt_offload.reset_stats()
    model = make_model(device=device, **MIX_KW)
    ids = make_batch(batch=4, seq=64, device=device)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
    settle(device)
    before = pool.stats()
    for _ in range(20):
        model.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        assert in_use() == 0
    settle(device)
    after = pool.stats()
    assert after["alloc_calls"] == before["alloc_calls"], "host allocations in the steady state"
    assert after["misses"] == before["misses"]
    assert after["free_calls"] == before["free_calls"]
    assert after["hits"] - before["hits"] == 20 * 5  # 6 blocks, the last kept on the device
    assert after["peak_in_use_bytes"] > 0
    assert after["reserved_bytes"] <= 1.1 * after["peak_in_use_bytes"]


# -- lifecycle: forward without backward ------------------------------------------------------------
def _forward_only(case, model, ids):
    """One forward whose backward never runs; returns what must die for the graph to go."""
    if case == "eval_no_grad":
        model.eval()
        with torch.no_grad():
            loss_of(model, ids)
        model.train()
        assert ckpt_offload.stats()["tensors_offloaded"] == 0, "no_grad saves nothing, so nothing moves"
        return None
    if case == "loss_dropped":
        loss = loss_of(model, ids)
        assert in_use() > 0, "nothing was offloaded: the case would prove nothing"
        return loss
    if case == "unused_branch":
        # Two heads; backward only through one: the other's saved tensors die with the graph.
        out = model(ids)
        other = model(ids.flip(1))
        out.float().pow(2).mean().backward()
        assert in_use() > 0, "the unused branch holds no blocks: the case would prove nothing"
        return other
    if case in ("exception", "keyboard_interrupt"):
        exc = Boom if case == "exception" else KeyboardInterrupt

        def raise_mid_forward(mod, args):
            raise exc("raised from a layer")

        handle = model.blocks[4].register_forward_pre_hook(raise_mid_forward)
        try:
            loss_of(model, ids)
        except exc:
            pass
        else:
            pytest.fail("the layer did not raise")
        finally:
            handle.remove()
        assert ckpt_offload.stats()["tensors_offloaded"] > 0
        return None
    raise AssertionError(case)


@pytest.mark.parametrize("how", ["enable_checkpointing", "offload_activations"])
@pytest.mark.parametrize("case", ["eval_no_grad", "loss_dropped", "unused_branch", "exception", "keyboard_interrupt"])
@pytest.mark.parametrize("device", DEVICES)
def test_forward_without_backward_returns_every_block(device, case, how, test_cpu):
    """PITFALLS 6: every host block is back once the graph dies."""
    model = make_model(device=device)
    ids = make_batch(device=device)
    loss_of(model, ids).backward()  # warm-up: lazily created device buffers exist before the baseline
    model.zero_grad(set_to_none=True)
    settle(device)
    base_device = torch.cuda.memory_allocated() if device == "cuda" else None
    if how == "enable_checkpointing":
        ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
        ctx = contextlib.nullcontext()
    else:
        ctx = ckpt_offload.offload_activations(min_bytes=0)
    with ctx:
        keep = _forward_only(case, model, ids)
    del keep
    settle(device)
    assert in_use() == 0, f"{case}: host blocks still in use after the graph died"
    s = ckpt_offload.stats()
    assert s["pending_sources"] == 0
    if case != "eval_no_grad":
        # Handles of the dead graph were given up without a reload.
        assert s["tensors_released"] > 0
        assert s["tensors_released"] + s["tensors_fetched"] == s["tensors_offloaded"]
    if device == "cuda":
        model.zero_grad(set_to_none=True)
        settle(device)
        assert torch.cuda.memory_allocated() <= base_device, f"{case}: device memory not returned"


class _TanhBlock(nn.Module):
    """tanh saves its own output: under hooks that keep it as given, a cycle through its grad_fn."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.lin(h))


def _subclass_forward(entry, blocks, x):
    if entry == "offload_activations":
        ctx = ckpt_offload.offload_activations(min_bytes=0)
    elif entry == "keep_last":
        ctx = ckpt_offload.offload_activations(min_bytes=0, keep_last=2)
    elif entry == "checkpoint":
        return ckpt_offload.checkpoint(blocks, x * 1)
    else:  # enable_block_modes / enable_checkpointing: configured on the model
        ctx = contextlib.nullcontext()
    with ctx:
        return blocks(x * 1)


@pytest.mark.parametrize("entry", ["offload_activations", "keep_last", "block_offload", "checkpoint",
                                   "enable_checkpointing"])
def test_subclass_outputs_of_dropped_forwards_are_collected(entry, test_cpu):
    """PITFALLS 30: a __torch_dispatch__ subclass (TwoTensor here, DTensor under FSDP2 and TP) saved
    as an op's output is held detached, as a plain tensor is: forwards dropped without backward
    leave none of their tensors alive. Backward through the hooks still gives the plain gradients."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor", reason="torch's TwoTensor test subclass")
    TwoTensor = two_tensor.TwoTensor
    torch.manual_seed(0)
    blocks = nn.Sequential(_TanhBlock(16), _TanhBlock(16))
    ref = nn.Sequential(_TanhBlock(16), _TanhBlock(16))
    ref.load_state_dict(blocks.state_dict())
    if entry == "block_offload":
        ckpt_offload.enable_block_modes(blocks, ["offload", "offload"], layers=list(blocks))
    elif entry == "enable_checkpointing":
        ckpt_offload.enable_checkpointing(blocks, offload=True, layers=list(blocks))
    x = TwoTensor(torch.randn(8, 16), torch.randn(8, 16)).requires_grad_()

    def alive():
        gc.collect()
        return sum(type(o) is TwoTensor for o in gc.get_objects())

    before = alive()
    for _ in range(50):
        out = _subclass_forward(entry, blocks, x)
        assert type(out) is TwoTensor
        del out
    assert alive() == before, f"{entry}: TwoTensors of forwards dropped without backward are still alive"
    # The subclass went through the hooks (held, not offloaded): backward still sees what it saved.
    _subclass_forward(entry, blocks, x).sum().backward()
    grad = x.grad
    x.grad = None
    ref(x * 1).sum().backward()
    assert type(grad) is TwoTensor
    assert torch.equal(grad.a, x.grad.a) and torch.equal(grad.b, x.grad.b)
    for p, r in zip(blocks.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)
    assert in_use() == 0


def test_error_sending_from_the_keep_last_queue_leaves_no_cycle(monkeypatch, test_cpu):
    """keep_last: the oldest queued tensor is sent by a later pack. An error raised in that send (an
    interrupt arriving in it, a copy error surfacing there) leaves the queued tensor held detached,
    as end() would: a saved output kept with its grad_fn would leak its graph (PITFALLS 30)."""
    timeline = sys.modules["ckpt_offload.timeline"]
    monkeypatch.setattr(timeline, "enabled", True)  # sends go through NamedEngine.offload, in Python
    sent = []

    def interrupted(self, src):
        sent.append(src.shape)
        raise KeyboardInterrupt("arrived inside a send")

    monkeypatch.setattr(timeline.NamedEngine, "offload", interrupted)
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(KeyboardInterrupt, match="inside a send"):
        with ckpt_offload.offload_activations(min_bytes=0, keep_last=1):
            e = x.exp()  # exp saves its output: the queue's first entry
            ref = weakref.ref(e)
            e.tanh()  # saves its output too, which sends exp's from the queue
    assert sent == [(64, 64)], "the send from the queue did not run: the case would prove nothing"
    del e
    gc.collect()
    assert ref() is None, "the queued output whose send raised is still alive with its graph"
    assert in_use() == 0


def test_dead_view_sharing_a_copy_does_not_hold_the_reload(test_cpu):
    """Two saved tensors share one host copy (a tensor and a view of it); the view's graph dies before
    backward. The reload of the other is not held on the device for a view that will never unpack:
    after a backward that retains the graph, only the host copy is left (the next backward reloads)."""
    reloads = []

    class Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, w):
            ctx.save_for_backward(t)
            return t * w

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            reloads.append(StorageWeakRef(t.untyped_storage()))
            return None, (g * t).sum()

    x = torch.randn(64, 64, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0):
        base = x * 1
        loss = Saves.apply(base, w).sum()
        dropped = base[:8] * x[:8]  # saves a view of base: it shares base's host copy
    assert ckpt_offload.stats()["tensors_offloaded"] == 2 and ckpt_offload.stats()["shared_views"] == 1
    del dropped, base
    gc.collect()
    loss.backward(retain_graph=True)
    torch.testing.assert_close(w.grad, x.detach().sum())
    assert len(reloads) == 1
    gc.collect()
    assert reloads[0].expired(), "the reload is still held for a view whose graph died"
    loss.backward()
    assert len(reloads) == 2
    del loss
    gc.collect()
    assert in_use() == 0


def _objects_grown(run, warm, n):
    """Live Python objects added by run(n) after a warm-up of run(warm)."""
    run(warm)
    gc.collect()
    before = len(gc.get_objects())
    run(n)
    gc.collect()
    return len(gc.get_objects()) - before


def test_forward_only_loop_keeps_bookkeeping_bounded(test_cpu):
    """PITFALLS 6: forwards whose backward never runs (grad on, loss dropped), many times: the
    Python-side bookkeeping must not grow with the number of forwards."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)

    def forwards(n):
        for _ in range(n):
            model(torch.randn(4, 16)).sum()  # a fresh input each time, graph dropped at once

    grown = _objects_grown(forwards, warm=300, n=1000)
    assert in_use() == 0
    # 4000 offloads happened; bounded caches may hold a few hundred objects, not one per offload.
    assert grown < 2000, f"{grown} more live objects after 1000 forward-only steps (4000 offloads)"


def test_training_loop_reusing_one_input_keeps_bookkeeping_bounded(test_cpu):
    """A training loop that feeds the same input tensor every step (its storage lives on): the
    per-storage bookkeeping must not keep one entry per step forever."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(4, 16)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)

    def steps(n):
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

    grown = _objects_grown(steps, warm=300, n=3000)
    assert in_use() == 0
    assert grown < 2000, f"{grown} more live objects after 3000 steps that offload the same input"


# -- lifecycle: several backwards, autograd.grad, double backward ---------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_two_backwards(device, test_cpu):
    ids = make_batch(device=device)
    ref = make_model(device=device)
    loss = loss_of(ref, ids)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = grads(ref)

    model = make_model(device=device)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    loss = loss_of(model, ids)
    offloaded = ckpt_offload.stats()["bytes_offloaded"]
    loss.backward(retain_graph=True)
    assert in_use() == offloaded  # the host copies stay for the next backward
    once = grads(model)
    loss.backward()
    assert_grads(grads(model), expected, device, "two backwards")
    assert_grads({k: 2 * v for k, v in once.items()}, expected, device, "2 x one backward")
    del loss
    settle(device)
    assert in_use() == 0
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 6 and s["tensors_fetched"] == 12  # reloaded by each backward


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_grad_instead_of_backward(device, test_cpu):
    ids = make_batch(device=device)
    expected = plain_grads(device, ids)
    model = make_model(device=device)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    names = [n for n, _ in model.named_parameters()]
    got = torch.autograd.grad(loss_of(model, ids), list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert_grads(dict(zip(names, got)), expected, device, "autograd.grad")
    assert in_use() == 0
    assert ckpt_offload.stats()["bytes_offloaded"] > 0


def _double_backward(run):
    x = torch.linspace(-1, 1, 64).reshape(8, 8).requires_grad_()
    w = (torch.eye(8) + 0.1 * torch.arange(64.0).reshape(8, 8) / 64).requires_grad_()

    def f(a, b):
        return torch.tanh(a @ b).pow(2)

    y = run(f, x * 1, w * 1)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return (gx.detach(),) + torch.autograd.grad(gx.pow(2).sum(), [x, w])


def test_double_backward_through_checkpoint(test_cpu):
    session = ckpt_offload.OffloadSession()

    def plain(f, *a):
        return tuc.checkpoint(f, *a, use_reentrant=False)

    def offloaded(f, *a):
        return ckpt_offload.checkpoint(f, *a, session=session)

    try:
        expected = _double_backward(plain)
    except RuntimeError as err:
        # torch cannot do it without offload either: the same error type, nothing silent.
        with pytest.raises(type(err)):
            _double_backward(offloaded)
        return
    got = _double_backward(offloaded)
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * 64 * 4  # both inputs moved
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert in_use() == 0


# -- lifecycle: threads, nesting, re-enabling -------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_two_models_offloading_from_two_threads(device, test_cpu):
    ids = [make_batch(seed=10 + i, device=device) for i in range(2)]
    expected = [plain_grads(device, ids[i], seed=i) for i in range(2)]
    models = [make_model(seed=i, device=device) for i in range(2)]
    for m in models:
        ckpt_offload.enable_checkpointing(m, offload=True, keep_last=0)
    results = [None, None]
    errors = []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            barrier.wait(HANG_S)
            out = []
            for _ in range(15):
                models[i].zero_grad(set_to_none=True)
                loss_of(models[i], ids[i]).backward()
                out.append(grads(models[i]))
            results[i] = out
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * HANG_S)
    assert not any(t.is_alive() for t in threads), "a thread is blocked (deadlock)"
    assert not errors, errors
    for i in range(2):
        for step, got in enumerate(results[i]):
            assert_grads(got, expected[i], device, f"thread {i} step {step}")
    settle(device)
    assert in_use() == 0
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 2 * 15 * 6 == s["tensors_fetched"]


@pytest.mark.parametrize("device", DEVICES)
def test_nested_offload_contexts(device, test_cpu):
    ids = make_batch(device=device)
    expected = plain_grads(device, ids)
    model = make_model(device=device)
    outer = ckpt_offload.offload_activations(min_bytes=0)
    with outer:
        x = model.embed(ids) + model.pos(model.positions[: ids.shape[1]])
        x = model.blocks[0](x)
        with ckpt_offload.offload_activations(min_bytes=0):
            for block in model.blocks[1:4]:
                x = block(x)
        for block in model.blocks[4:]:
            x = block(x)
        logits = model.head(model.ln(x))
    with pytest.raises(RuntimeError, match="already active"):
        with outer:
            with outer:
                pass
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    del x, logits
    assert ckpt_offload.stats()["bytes_offloaded"] > 0
    loss.backward()
    assert in_use() == 0
    assert_grads(grads(model), expected, device, "nested contexts")

    # Checkpointed, offloaded blocks inside an offload_activations context.
    model.zero_grad(set_to_none=True)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    with ckpt_offload.offload_activations(min_bytes=0):
        loss = loss_of(model, ids)
    loss.backward()
    assert in_use() == 0
    assert_grads(grads(model), expected, device, "checkpoint inside a context")


@pytest.mark.parametrize("device", DEVICES)
def test_enable_disable_enable(device, test_cpu):
    ids = make_batch(device=device)
    expected = plain_grads(device, ids)
    model = make_model(device=device)
    act = ids.numel() * 32 * 4  # one block input: batch x seq x hidden float32

    def step():
        ckpt_offload.reset_stats()
        model.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        assert in_use() == 0
        assert_grads(grads(model), expected, device, str(ckpt_offload.checkpointing_state(model)))
        return ckpt_offload.stats()["bytes_offloaded"]

    assert ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1) == [0, 1, 2, 3, 4, 5]
    assert step() == 5 * act
    ckpt_offload.disable_checkpointing(model)
    assert ckpt_offload.checkpointing_state(model) is None
    assert all(type(b) is ckpt_offload.attachment.base_class(type(b)) and ckpt_offload.attachment.SLOT not in b.__dict__ for b in model.blocks)
    assert step() == 0
    ckpt_offload.disable_checkpointing(model)  # a no-op when not enabled
    assert ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True, keep_last=1) == [0, 2, 4]
    assert ckpt_offload.checkpointing_state(model) == ([0, 2, 4], [0, 2])
    assert step() == 2 * act
    # Enabling again without disabling reconfigures: no double wrapping.
    assert ckpt_offload.enable_checkpointing(model, every_n_layers=3, offload=True, keep_last=0) == [0, 3]
    assert step() == 2 * act
    ckpt_offload.disable_checkpointing(model)
    assert step() == 0


# -- aliasing: through the engine --------------------------------------------------------------------
def _aliasing_cases(device):
    base = torch.arange(64.0, device=device).reshape(8, 8)
    wide = torch.arange(256.0, device=device).reshape(8, 32)
    param = nn.Parameter(torch.arange(64.0, device=device).reshape(8, 8))
    return {
        "transpose": base.t(),
        "offset_slice": torch.arange(100.0, device=device)[10:30],
        "strided_slice": wide[:, 2:4],
        "step_slice": torch.arange(100.0, device=device)[3::7],
        "expand": torch.arange(8.0, device=device).reshape(1, 8).expand(16, 8),
        "as_strided": torch.arange(64.0, device=device).as_strided((4, 4), (1, 4), 3),
        "overlapping_as_strided": torch.arange(16.0, device=device).as_strided((4, 4), (2, 1), 1),
        "param_view": param.t()[1:5],
    }


@pytest.mark.parametrize("device", DEVICES)
def test_views_round_trip_through_the_engine(device):
    pool = ckpt_offload.HostPool()
    eng = ckpt_offload.CopyEngine(device if device == "cpu" else "cuda:0", pool)
    for name, t in _aliasing_cases(device).items():
        expected = t.detach().clone()
        h = eng.offload(t)
        assert h is not None, name
        assert tuple(h.shape) == tuple(t.shape) and h.dtype == t.dtype, name
        out = eng.fetch(h)
        assert out.shape == t.shape and out.device == t.device, name
        assert torch.equal(out, expected), name
        if h.compacted:
            assert name in ("strided_slice", "step_slice", "param_view"), f"{name} compacted needlessly"
            assert out.is_contiguous(), name
            assert h.nbytes == t.numel() * t.element_size(), name
        else:
            assert out.stride() == t.stride(), name
        del h, out
        assert pool.stats()["in_use_bytes"] == 0, name
    # The same tensor offloaded twice: two independent handles, both right.
    t = _aliasing_cases(device)["transpose"]
    h1, h2 = eng.offload(t), eng.offload(t)
    assert torch.equal(eng.fetch(h2), t) and torch.equal(eng.fetch(h1), t)
    del h1, h2
    assert pool.stats()["in_use_bytes"] == 0
    s = eng.stats()
    assert s["tensors_fetched"] == s["tensors_offloaded"] == len(_aliasing_cases(device)) + 2


# -- aliasing: through the hooks ---------------------------------------------------------------------
class SaveAndSee(torch.autograd.Function):
    """Saves the given tensors; backward records what unpacking gave back."""

    seen = []

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        SaveAndSee.seen = list(ctx.saved_tensors)
        return (g,) + (None,) * len(SaveAndSee.seen)


def _hook_cases(device):
    def mk(n):
        return torch.arange(float(n), device=device)

    b64 = mk(64).reshape(8, 8)
    b100 = mk(100)
    c64 = mk(64).reshape(8, 8)
    d64 = mk(64).reshape(8, 8)
    # name: (tensors saved, bytes that must move, shared views, compacted)
    return {
        "transpose": ([mk(64).reshape(8, 8).t()], 256, 0, 0),
        "offset_slice": ([mk(100)[10:30]], 80, 0, 0),
        "slice_inside_slice": ([b100[10:30], b100[15:25]], 80, 1, 0),
        "strided_slice_small_storage": ([mk(64).reshape(8, 8)[:, 2:4]], 256, 0, 0),
        "strided_slice_large_storage": ([mk(256).reshape(8, 32)[:, 2:4]], 64, 0, 1),
        "expand": ([mk(8).reshape(1, 8).expand(16, 8)], 32, 0, 0),
        "as_strided": ([mk(64).as_strided((4, 4), (1, 4), 3)], 64, 0, 0),
        "same_tensor_twice": ([b64, b64], 256, 1, 0),
        "tensor_and_its_transpose": ([c64, c64.t()], 256, 1, 0),
        "q_k_v_split": (list(d64.split(2, dim=1)), 256, 3, 0),
    }


@pytest.mark.parametrize("case", list(_hook_cases("cpu")))
@pytest.mark.parametrize("device", DEVICES)
def test_views_round_trip_through_the_hooks(device, case, test_cpu):
    """PITFALLS 4: values, shapes and strides come back; shared storage moves once."""
    tensors, moved, shared, compacted = _hook_cases(device)[case]
    expected = [(t.clone(), t.shape, t.stride()) for t in tensors]
    x = torch.zeros(3, device=device, requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0):
        y = SaveAndSee.apply(x, *tensors)
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == moved
    assert s["shared_views"] == shared
    assert s["compacted"] == compacted
    del tensors
    y.sum().backward()
    seen = SaveAndSee.seen
    SaveAndSee.seen = []
    assert len(seen) == len(expected)
    for got, (values, shape, stride) in zip(seen, expected):
        assert got.shape == shape
        assert torch.equal(got, values)
        if compacted:
            assert got.is_contiguous()
        else:
            assert got.stride() == stride
    assert torch.equal(x.grad, torch.ones(3, device=device))
    del seen, y
    assert in_use() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_views_through_the_hooks(device, test_cpu):
    """A view of a parameter saved for backward: not offloaded under offload_activations (its
    module ran in the context); passed positionally to a checkpoint it comes back right."""

    class TransposedLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.linspace(-1, 1, 64, device=device).reshape(8, 8))

        def forward(self, a):
            return torch.tanh(a @ self.w.t()[:, 1:7])

    torch.manual_seed(0)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod = TransposedLinear()
    mod(x * 1).sum().backward()
    expected = {"w": mod.w.grad.clone(), "x": x.grad.clone()}

    def check(what):
        got = {"w": mod.w.grad, "x": x.grad}
        assert_grads(got, expected, device, what)
        mod.w.grad = None
        x.grad = None

    check("plain")
    with ckpt_offload.offload_activations(min_bytes=0):
        y = mod(x * 1).sum()
    # Saved: x * 1 (for the weight), the weight view (for x), the tanh output. Only the two
    # activations move; the 8x6 view of the weight (192 bytes) stays.
    assert ckpt_offload.stats()["bytes_offloaded"] == 4 * 8 * 4 + 4 * 6 * 4
    y.backward()
    check("offload_activations")

    session = ckpt_offload.OffloadSession()
    y = ckpt_offload.checkpoint(lambda a, wt: torch.tanh(a @ wt[:, 1:7]), x * 1, mod.w.t(), session=session)
    y.sum().backward()
    check("checkpoint with a weight view as input")
    assert in_use() == 0


class BackwardReturnsViewOfSaved(torch.autograd.Function):
    """The torchtune view-output case: backward returns a view of the unpacked saved tensor."""

    @staticmethod
    def forward(ctx, x, kind):
        act = x.detach() * 2
        if kind == "transpose":
            saved = act.t()
        else:  # a slice with gaps of a storage that also holds other data
            big = torch.zeros(8, 8, device=x.device)
            big[:4, :4] = act
            saved = big[:4, :4]
        ctx.kind = kind
        ctx.save_for_backward(saved)
        return torch.zeros(2, 4, device=x.device)

    @staticmethod
    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        return (saved.t() if ctx.kind == "transpose" else saved[:, :]), None


@pytest.mark.parametrize("kind", ["transpose", "strided_slice"])
@pytest.mark.parametrize("device", DEVICES)
def test_backward_returning_a_view_of_an_unpacked_tensor(device, kind, test_cpu):
    """PITFALLS 4: a backward that returns a view of an unpacked (reloaded) tensor: the view keeps its data
    alive. Fails where the reloaded tensor is freed while a view of it escapes the node."""
    x = torch.arange(16.0, device=device).reshape(4, 4).requires_grad_()
    with ckpt_offload.offload_activations(min_bytes=0):
        y = BackwardReturnsViewOfSaved.apply(x, kind)
    assert ckpt_offload.stats()["bytes_offloaded"] > 0
    y.sum().backward()
    del y
    settle(device)
    # Memory that is given back gets reused; the gradient must not see it.
    junk = [torch.full((64, 64), -7.0, device=device) for _ in range(64)]
    expected = torch.arange(16.0, device=device).reshape(4, 4) * 2
    assert torch.equal(x.grad, expected)
    del junk
    assert in_use() == 0


@pytest.mark.parametrize(
    "how", ["offload_activations", "offload_activations_keep_last", "checkpoint"]
)
def test_inplace_change_of_a_saved_tensor_still_raises(how, test_cpu):
    """Autograd's version check must survive offload: without offload these raise."""
    x = torch.randn(8, 8, requires_grad=True)

    def forward_then_modify():
        if how == "checkpoint":
            a = x * 2
            y = ckpt_offload.checkpoint(torch.sin, a, session=ckpt_offload.OffloadSession())
            a.add_(1)
            return y
        keep_last = 1 if how.endswith("keep_last") else 0
        with ckpt_offload.offload_activations(min_bytes=0, keep_last=keep_last):
            a = x * 2
            b = a.sin()
            a.add_(1)
            return (b * 3).exp()

    # The unmodified computation raises: this is what offload must not hide.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        a = x * 2
        b = tuc.checkpoint(torch.sin, a, use_reentrant=False) if how == "checkpoint" else a.sin()
        a.add_(1)
        b.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward_then_modify().sum().backward()
    gc.collect()
    assert in_use() == 0


# -- tensor kinds: parameters, buffers, meta, subclasses ---------------------------------------------
def test_parameters_and_buffers_are_never_offloaded_by_the_context(test_cpu):
    """PITFALLS 5: a module whose only saved tensors are a parameter and a buffer: nothing moves."""

    class OnlyWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))
            self.frozen = nn.Parameter(torch.randn(64, 64), requires_grad=False)
            self.register_buffer("scale", torch.rand(64, 64))

        def forward(self):
            return (self.w.sin() + self.w * self.scale + self.w * self.frozen).sum()

    m = OnlyWeights()
    m().backward()
    expected = m.w.grad.clone()
    m.w.grad = None
    with ckpt_offload.offload_activations(min_bytes=0):
        y = m()
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == 0 and s["tensors_offloaded"] == 0
    y.backward()
    assert torch.equal(m.w.grad, expected)

    # Linear -> Tanh -> Linear on an input without grad: only the input and the tanh output move
    # (the tanh output once, though saved twice); the transposed weights stay.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(32, 8)
    ckpt_offload.reset_stats()
    with ckpt_offload.offload_activations(min_bytes=0):
        y = net(x).sum()
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == 32 * 8 * 4 + 32 * 16 * 4
    assert s["shared_views"] == 1
    y.backward()
    assert in_use() == 0


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, scale):
        return torch.tanh(self.lin(x)) * scale


class _ModelPassingWeights(nn.Module):
    def __init__(self, what):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        if what == "buffer":
            self.register_buffer("scale", torch.rand(16))
        else:
            self.scale = nn.Parameter(torch.rand(16), requires_grad=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, self.scale)
        return x.sum()


@pytest.mark.parametrize("what", ["buffer", "frozen_parameter"])
def test_weights_passed_positionally_to_checkpointed_blocks_are_not_offloaded(what, test_cpu):
    """PITFALLS 5: a buffer (an attention mask, rotary tables) or a frozen parameter handed to each
    block positionally is model state, not an activation: offloading it copies it every step and
    frees nothing. bytes_offloaded must be the block inputs only."""
    torch.manual_seed(0)
    model = _ModelPassingWeights(what)
    x = torch.randn(32, 16)
    model(x).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    ckpt_offload.reset_stats()
    model(x).backward()
    assert in_use() == 0
    assert_grads({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, expected, "cpu")
    moved, inputs = ckpt_offload.stats()["bytes_offloaded"], 4 * x.numel() * 4
    assert moved == inputs, f"{moved} bytes offloaded, the 4 block inputs are {inputs}: the {what} moved too"


def test_parameters_passed_to_checkpoint_are_not_offloaded(test_cpu):
    w = nn.Parameter(torch.randn(16, 16))
    x = torch.randn(8, 16)
    y = ckpt_offload.checkpoint(lambda a, b: torch.tanh(a @ b), x * 1, w, session=ckpt_offload.OffloadSession())
    assert ckpt_offload.stats()["bytes_offloaded"] == x.numel() * 4
    y.sum().backward()
    assert torch.allclose(w.grad, ((x.t() @ (1 - torch.tanh(x @ w) ** 2))), rtol=1e-5, atol=1e-6)
    assert in_use() == 0


class TrivialSubclass(torch.Tensor):
    pass


def test_meta_subclass_fake_and_parameters_pass_through_untouched(test_cpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    session = ckpt_offload.OffloadSession(min_bytes=0)
    meta = torch.empty(64, 64, device="meta")
    sub = torch.Tensor._make_subclass(TrivialSubclass, torch.randn(64, 64))
    param = nn.Parameter(torch.randn(64, 64))
    with FakeTensorMode():
        fake = torch.randn(64, 64)
    for t in (meta, sub, param, fake):
        assert session.unpack(session.pack(t)) is t, type(t).__name__  # the very object back
    assert ckpt_offload.stats()["tensors_offloaded"] == 0
    plain = torch.randn(64, 64)
    packed = session.pack(plain)
    # The check above is not vacuous: a plain CPU tensor (test path) does go.
    assert ckpt_offload.stats()["tensors_offloaded"] == 1
    assert torch.equal(session.unpack(packed), plain)
    del packed
    assert in_use() == 0
    ckpt_offload.reset_stats()

    # End to end: autograd on meta, subclass and fake tensors under the context.
    xm = torch.randn(16, 16, device="meta", requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0):
        (xm * 2).sin().sum().backward()
    assert xm.grad.shape == (16, 16) and xm.grad.is_meta

    base = torch.randn(16, 16)
    xs = torch.Tensor._make_subclass(TrivialSubclass, base, True)
    with ckpt_offload.offload_activations(min_bytes=0):
        y = (xs * 2).sin().sum()
    assert type(y) is TrivialSubclass
    y.backward()
    torch.testing.assert_close(xs.grad.as_subclass(torch.Tensor), 2 * torch.cos(2 * base))

    with FakeTensorMode():
        xf = torch.randn(16, 16, requires_grad=True)
        with ckpt_offload.offload_activations(min_bytes=0):
            y = (xf * 2).sin().sum()
        y.backward()
        assert xf.grad.shape == (16, 16)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 0 and s["bytes_offloaded"] == 0


def test_cpu_tensors_are_not_offloaded_without_the_test_switch(monkeypatch):
    monkeypatch.delenv("CKPT_OFFLOAD_TEST_CPU", raising=False)
    x = torch.randn(32, 32, requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0):
        y = (x * 2).sin().sum()
    y.backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 0
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()), rtol=0, atol=0)


# -- faults: host cap, pinned allocation refused ------------------------------------------------------
@pytest.mark.parametrize("refusal", ["cap", "alloc_failure"])
@pytest.mark.parametrize("device", DEVICES)
def test_engine_returns_none_when_the_pool_refuses(device, refusal):
    """The engine's own contract: a refused block gives None (the caller keeps the tensor)."""

    def scenario():
        # Everything that touches the engine lives here: if it blocks, nothing outside this
        # thread holds a handle whose destructor would need the engine's lock.
        pool = ckpt_offload.HostPool()
        eng = ckpt_offload.CopyEngine("cpu" if device == "cpu" else "cuda:0", pool)
        first = torch.randn(1024, device=device)  # 4 KiB: one block
        second = torch.randn(1024, device=device)
        h1 = eng.offload(first)
        if refusal == "cap":
            pool.set_capacity(ckpt_offload.HostPool.round_size(4096))
        else:
            pool.inject_alloc_failures(1)
        h2 = eng.offload(second)
        back = eng.fetch(h1)
        del h1
        return h2, torch.equal(back, first), eng.stats(), pool.stats()

    h2, first_ok, s, p = run_bounded(scenario, "CopyEngine.offload refused by the pool")
    assert h2 is None
    assert first_ok
    assert s["offloads_refused"] == 1
    assert s["tensors_released"] == 0  # no handle was given out, so none was given up
    assert p["cap_refusals" if refusal == "cap" else "alloc_failures"] == 1
    assert p["in_use_bytes"] == 0


class FailOps(TorchDispatchMode):
    """Raises out-of-memory from the chosen aten ops: an allocation failing inside the engine."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops:
            raise torch.OutOfMemoryError("injected: out of memory")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("where", ["compaction", "host_copy"])
def test_error_inside_offload_propagates_and_engine_stays_usable(where):
    """An error raised inside offload (out of memory while compacting a strided view, or while
    copying) comes out as that exception: it never blocks the engine, nothing leaks, and the
    engine keeps working."""

    def scenario():
        pool = ckpt_offload.HostPool(pinned=False)
        eng = ckpt_offload.CopyEngine("cpu", pool)
        base = torch.randn(8, 8)
        src = base[:, 1:3] if where == "compaction" else base[1:3]
        op = torch.ops.aten.clone.default if where == "compaction" else torch.ops.aten.copy_.default
        try:
            with FailOps({op}):
                h = eng.offload(src)
        except torch.OutOfMemoryError:
            outcome = "raised"
        else:
            # An engine that does not go through that op: then the copy must simply be right.
            outcome = "offloaded" if torch.equal(eng.fetch(h), src) else "wrong values"
            del h
        h = eng.offload(src)
        again = torch.equal(eng.fetch(h), src)
        del h
        return outcome, again, pool.stats()["in_use_bytes"]

    outcome, again, used = run_bounded(scenario, "CopyEngine.offload raising inside")
    assert outcome in ("raised", "offloaded"), outcome
    assert again, "the engine does not work after the error"
    assert used == 0


@pytest.fixture
def private_engine(monkeypatch, request):
    """Sessions get an engine of their own over the process-wide pool: if a refused block ever
    blocked the engine again, only this engine's lock would be held, not the process-wide one."""
    device = request.node.callspec.params["device"]
    pool = ckpt_offload.host_pool()
    pool.empty_cache()  # every block below is a fresh allocation: the counts are exact
    ckpt_offload.reset_stats()
    eng = ckpt_offload.CopyEngine("cpu" if device == "cpu" else "cuda:0", pool)
    monkeypatch.setattr(ckpt_offload.engine, "engine_for", lambda dev: eng)
    monkeypatch.setattr(ckpt_offload.session, "_refusal_warned", False)
    return eng, pool


def _refusal_warnings(records):
    return [
        w for w in records if issubclass(w.category, RuntimeWarning) and "host pool refused" in str(w.message)
    ]


def _bounded_steps(model, ids, pool, n, what):
    """n training steps under a deadlock guard: per step (grads, pool bytes in use), and warnings."""

    def steps():
        out = []
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            loss_of(model, ids).backward()
            out.append((grads(model), pool.stats()["in_use_bytes"]))
        return out

    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        results = run_bounded(steps, what)
    return results, records


@pytest.mark.parametrize("device", DEVICES)
def test_host_cap_keeps_tensors_on_device_with_one_warning(device, test_cpu, private_engine):
    """PITFALLS 7: a cap makes tensors stay on the device with a warning instead of failing."""
    eng, pool = private_engine
    ids = make_batch(device=device)
    expected = plain_grads(device, ids)
    model = make_model(device=device)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    act = ids.numel() * 32 * 4
    pool.set_capacity(ckpt_offload.HostPool.round_size(act))  # room for one layer input
    try:
        results, records = _bounded_steps(model, ids, pool, 3, "a training step with the host pool at its cap")
    finally:
        pool.set_capacity(0)
    for step, (got, used) in enumerate(results):
        assert used == 0
        assert_grads(got, expected, device, f"capped step {step}")
    assert len(_refusal_warnings(records)) == 1
    s = ckpt_offload.stats()
    assert s["tensors_kept_on_device"] == 3 * 5
    assert s["host_cap_refusals"] == 3 * 5
    e = eng.stats()
    assert e["offloads_refused"] == 3 * 5
    assert e["tensors_offloaded"] == 3 == e["tensors_fetched"]


@pytest.mark.parametrize("failures", [2, 1000])
@pytest.mark.parametrize("device", DEVICES)
def test_refused_pinned_allocation_falls_back_to_device(device, failures, test_cpu, private_engine):
    """PITFALLS 41: a refused pinned allocation keeps the tensor on the device, gradients unchanged. Fails
    where a failed pin crashes the step."""
    eng, pool = private_engine
    ids = make_batch(device=device)
    expected = plain_grads(device, ids)
    model = make_model(device=device)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    pool.inject_alloc_failures(failures)
    try:
        results, records = _bounded_steps(model, ids, pool, 2, "a training step whose host allocations fail")
    finally:
        pool.inject_alloc_failures(0)
    for step, (got, used) in enumerate(results):
        assert used == 0
        assert_grads(got, expected, device, f"step {step} with failing host allocations")
    assert len(_refusal_warnings(records)) == 1
    kept = ckpt_offload.stats()["tensors_kept_on_device"]
    if failures == 2:
        # The first two allocations fail; the next four succeed and serve the second step too.
        assert ckpt_offload.stats()["host_alloc_failures"] == 2
        assert kept == 2
        assert eng.stats()["tensors_offloaded"] == 4 + 6
    else:
        assert kept == 12
        assert eng.stats()["tensors_offloaded"] == 0
    assert pool.stats()["in_use_bytes"] == 0


# -- bad arguments -----------------------------------------------------------------------------------
class _NoRepeats(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.ReLU()


BAD_ARGS = [
    ("every_n_layers=0", lambda m: ckpt_offload.enable_checkpointing(m, every_n_layers=0), ValueError, "every_n_layers"),
    ("every_n_layers=-1", lambda m: ckpt_offload.enable_checkpointing(m, every_n_layers=-1), ValueError, "every_n_layers"),
    ("every_n_layers=1.5", lambda m: ckpt_offload.enable_checkpointing(m, every_n_layers=1.5), TypeError, "every_n_layers"),
    ("every_n_layers=True", lambda m: ckpt_offload.enable_checkpointing(m, every_n_layers=True), TypeError, "every_n_layers"),
    ("keep_last>layers", lambda m: ckpt_offload.enable_checkpointing(m, offload=True, keep_last=7), ValueError, "keep_last"),
    (
        "keep_last>checkpointed",
        lambda m: ckpt_offload.enable_checkpointing(m, every_n_layers=2, offload=True, keep_last=4),
        ValueError,
        "keep_last",
    ),
    ("keep_last=-1", lambda m: ckpt_offload.enable_checkpointing(m, keep_last=-1), ValueError, "keep_last"),
    ("prefetch=-1", lambda m: ckpt_offload.enable_checkpointing(m, prefetch=-1), ValueError, "prefetch"),
    ("prefetch_bytes=0", lambda m: ckpt_offload.enable_checkpointing(m, prefetch_bytes=0), ValueError, "prefetch_bytes"),
    ("offload=1", lambda m: ckpt_offload.enable_checkpointing(m, offload=1), TypeError, "offload"),
    ("no repeated blocks", lambda m: ckpt_offload.enable_checkpointing(_NoRepeats()), ValueError, "layers"),
    ("empty layers", lambda m: ckpt_offload.enable_checkpointing(m, layers=[]), ValueError, "layers"),
    ("non-module layer", lambda m: ckpt_offload.enable_checkpointing(m, layers=[m.blocks[0], 3]), TypeError, "layers"),
    ("non-module model", lambda m: ckpt_offload.enable_checkpointing(lambda x: x), TypeError, "model"),
    ("disable non-module", lambda m: ckpt_offload.disable_checkpointing(object()), TypeError, "model"),
    ("min_bytes=-1", lambda m: ckpt_offload.offload_activations(min_bytes=-1), ValueError, "min_bytes"),
    ("min_bytes=1.5", lambda m: ckpt_offload.offload_activations(min_bytes=1.5), TypeError, "min_bytes"),
    ("context keep_last=-1", lambda m: ckpt_offload.offload_activations(keep_last=-1), ValueError, "keep_last"),
    ("session min_bytes=-1", lambda m: ckpt_offload.OffloadSession(min_bytes=-1), ValueError, "min_bytes"),
    ("session keep_last=-1", lambda m: ckpt_offload.OffloadSession(keep_last=-1), ValueError, "keep_last"),
    ("session prefetch=1.5", lambda m: ckpt_offload.OffloadSession(prefetch=1.5), TypeError, "prefetch"),
    ("checkpoint non-callable", lambda m: ckpt_offload.checkpoint(3, torch.ones(1)), TypeError, "function"),
    (
        "checkpoint use_reentrant",
        lambda m: ckpt_offload.checkpoint(torch.sin, torch.ones(1), use_reentrant=True),
        ValueError,
        "use_reentrant",
    ),
    ("checkpoint offload='yes'", lambda m: ckpt_offload.checkpoint(torch.sin, torch.ones(1), offload="yes"), TypeError, "offload"),
    ("pool capacity -1", lambda m: ckpt_offload.HostPool(pinned=False).set_capacity(-1), ValueError, "nbytes"),
]


@pytest.mark.parametrize("call,exc,name", [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_name_the_argument(call, exc, name):
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=False)
    before = ckpt_offload.checkpointing_state(model)
    with pytest.raises(exc, match=name):
        call(model)
    # A refused call leaves a model's configuration as it was.
    assert ckpt_offload.checkpointing_state(model) == before


# -- GPU: streams, synchronisation, CUDA graphs ------------------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def mlp_stack(width=1024, depth=8, seed=0, device="cuda"):
    # LayerNorm, GELU and matmuls only: deterministic kernels, so gradients compare bit for bit.
    torch.manual_seed(seed)
    return nn.Sequential(*[MLPBlock(width) for _ in range(depth)]).to(device)


def mlp_loss(model, x):
    return model(x).float().pow(2).mean()


def param_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


SLEEP_CYCLES = 20_000_000  # about 10 ms of a busy compute stream
# Each step waits for one or two sleeps plus ~10 ms of fp32 matmuls: 40 steps take about 1-1.5 s.
BUSY_STEPS = 40


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("variant", ["reuse_freed_memory", "immediate_backward"])
def test_busy_stream_dropped_sources_bitwise_equal_over_many_steps(variant):
    """PITFALLS 1/2: the CPU runs ahead of a busy GPU, the sources' last references go right after
    the forward, freed memory is refilled with NaN (or backward starts at once): gradients are
    bitwise those of plain torch.utils.checkpoint, for BUSY_STEPS steps."""
    ref = mlp_stack()
    ckpt_offload.enable_checkpointing(ref, offload=False)
    inputs = [torch.randn(2048, 1024, generator=torch.Generator().manual_seed(s)).cuda() for s in range(4)]
    expected = []
    for x in inputs:
        ref.zero_grad(set_to_none=True)
        mlp_loss(ref, x).backward()
        expected.append(param_grads(ref))
    del ref

    model = mlp_stack()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    for step in range(BUSY_STEPS):
        model.zero_grad(set_to_none=True)
        x = inputs[step % 4].clone()
        torch.cuda._sleep(SLEEP_CYCLES)  # everything below queues behind this
        loss = mlp_loss(model, x)
        del x
        if variant == "reuse_freed_memory":
            junk = [torch.full((2048, 1024), float("nan"), device="cuda") for _ in range(8)]
            del junk
            torch.cuda._sleep(SLEEP_CYCLES)
        loss.backward()
        del loss
        got = param_grads(model)
        for name, g in expected[step % 4].items():
            assert torch.equal(got[name], g), f"step {step}: gradient of {name} differs"
        assert in_use() == 0
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == BUSY_STEPS * 8 == s["tensors_fetched"]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("where", ["forward_and_backward_in_stream", "forward_in_stream_backward_outside"])
def test_user_stream(where):
    """PITFALLS 3, 12: the current stream is looked up at each pack/unpack, never cached."""
    ref = mlp_stack(width=512)
    x = torch.randn(1024, 512, device="cuda")
    mlp_loss(ref, x).backward()
    expected = param_grads(ref)

    model = mlp_stack(width=512)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)
            loss = mlp_loss(model, x)
            if where == "forward_and_backward_in_stream":
                loss.backward()
        torch.cuda.current_stream().wait_stream(s)
        if where != "forward_and_backward_in_stream":
            loss.backward()
        torch.cuda.synchronize()
        got = param_grads(model)
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)
        assert in_use() == 0
    assert ckpt_offload.stats()["tensors_fetched"] == 3 * 8


@pytest.mark.gpu
@requires_cuda
def test_steady_state_step_has_no_hidden_synchronisation():
    """PITFALLS 8: a steady-state step under torch.cuda.set_sync_debug_mode('error')."""
    ref = mlp_stack(width=512)
    x = torch.randn(1024, 512, device="cuda")
    mlp_loss(ref, x).backward()
    expected = param_grads(ref)
    model = mlp_stack(width=512)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    for _ in range(3):  # warm-up: pool blocks and allocator blocks exist
        model.zero_grad(set_to_none=True)
        mlp_loss(model, x).backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    try:
        torch.cuda.set_sync_debug_mode("error")
        loss = mlp_loss(model, x)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    got = param_grads(model)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert ckpt_offload.stats()["bytes_offloaded"] > 0


@pytest.mark.gpu
@requires_cuda
def test_device_memory_really_drops_after_forward():
    """PITFALLS 5: offloaded block inputs leave the device once their copies finished."""
    width, tokens, depth = 1024, 2048, 8
    act = width * tokens * 4
    x = torch.randn(tokens, width, device="cuda")
    after_forward = {}
    for offload in (False, True):
        model = mlp_stack(width, depth)
        ckpt_offload.enable_checkpointing(model, offload=offload, keep_last=1)
        mlp_loss(model, x).backward()  # warm-up
        model.zero_grad(set_to_none=True)
        settle("cuda")
        ckpt_offload.reset_stats()
        loss = mlp_loss(model, x)
        settle("cuda")
        after_forward[offload] = requested_device_bytes()
        if offload:
            # Block 0's input is x, which the test still holds; blocks 0..6 are offloaded.
            assert ckpt_offload.stats()["bytes_offloaded"] == (depth - 1) * act
        loss.backward()
        del loss, model
        settle("cuda")
    # Inputs of blocks 1..6 were freed on the device.
    assert after_forward[False] - after_forward[True] >= 6 * act - (1 << 20)


_GRAPH_SCRIPT = textwrap.dedent(
    """
    import json, sys, traceback
    import torch
    from torch import nn
    import torch.nn.functional as F
    import ckpt_offload

    class Block(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(w), nn.Linear(w, 2 * w), nn.Linear(2 * w, w)
        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    class Net(nn.Module):
        def __init__(self, offload):
            super().__init__()
            self.blocks = nn.ModuleList(Block(256) for _ in range(4))
            self.offload = offload
        def forward(self, x):
            for block in self.blocks:
                # preserve_rng_state=False: torch's checkpoint reads the CUDA RNG state otherwise,
                # which torch refuses during capture before the offload is ever reached.
                x = ckpt_offload.checkpoint(block, x, offload=self.offload, preserve_rng_state=False)
            return x

    def build(offload):
        torch.manual_seed(0)
        return Net(offload).cuda()

    def chain(err):
        out = []
        while err is not None and len(out) < 5:
            out.append(type(err).__name__ + ": " + str(err))
            err = err.__cause__ or err.__context__
        return out

    result = {}
    try:
        model = build(True)
        static_x = torch.randn(512, 256, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                model(static_x).float().pow(2).mean().backward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = model(static_x).float().pow(2).mean()
            static_loss.backward()
        new_x = torch.randn(512, 256, device="cuda")
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        eager = build(False)
        eager(new_x).float().pow(2).mean().backward()
        worst = max((got[n] - p.grad).abs().max().item() for n, p in eager.named_parameters())
        scale = max(p.grad.abs().max().item() for p in eager.parameters())
        result = {"outcome": "match" if worst <= 1e-4 * scale + 1e-6 else "mismatch", "worst": worst}
    except BaseException as err:
        result = {"outcome": "error", "chain": chain(err), "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)
    """
)


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_capture_works_or_fails_clearly(tmp_path):
    """PITFALLS 9, 42, 49: capturing a step with offload either matches eager after replay or raises an
    error that says what went wrong; never silently wrong, never a hang. It runs in a child process
    so that a broken capture cannot leave this one's CUDA context in a bad state."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + sys.path)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _GRAPH_SCRIPT], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
        )
    except subprocess.TimeoutExpired:
        pytest.fail("capturing a step with offload hung for 120 s (deadlock)")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the child died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    if result["outcome"] == "error":
        text = " | ".join(result["chain"]).lower()
        assert "captur" in text or "graph" in text, f"unclear error: {result['chain']}\n{result['traceback']}"
    else:
        assert result["outcome"] == "match", f"replayed graph gives other gradients than eager: {result}"
