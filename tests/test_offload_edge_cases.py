"""Edge cases other activation offloaders' suites check (torchtune, TRL, DeepSpeed): views with
offsets, strided and overlapping views, split projections, nested contexts, exceptions mid-forward,
retained graphs, dropout parity, captured intermediates (MoE router logits), inputs the caller reads
again, backward returning a view of a saved tensor. Each runs through every entry point, on the
synchronous CPU test path and on the simulated asynchronous runtime, and compares the loss and the
gradients bitwise with the same computation without ckpt_offload."""
import contextlib
import gc

import pytest
import torch
from torch import nn

import ckpt_offload

ENTRIES = ["offload_activations", "enable_checkpointing", "checkpoint"]


class Runtime:
    """The engine the sessions use and its host pool."""

    def __init__(self, engine, pool):
        self.engine = engine
        self.pool = pool

    def offloaded(self):
        return self.engine.stats()["tensors_offloaded"]


@pytest.fixture(params=["sync", "async-sim"])
def runtime(request, monkeypatch):
    """The runtime under test: its host pool is empty again at the end."""
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    monkeypatch.setattr(ckpt_offload.checkpointing, "_default_session", None)  # made under the switch above
    if request.param == "sync":
        rt = Runtime(ckpt_offload.engine_for("cpu"), ckpt_offload.host_pool())
    else:
        monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "1")
        monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC_MAX_US", "300")
        monkeypatch.setenv("CKPT_OFFLOAD_TEST_SEED", "11")
        host = ckpt_offload.HostPool(pinned=False)
        eng = ckpt_offload.CopyEngine("cpu", host)
        assert eng.runtime == "async-sim"
        monkeypatch.setattr(ckpt_offload.engine, "engine_for", lambda dev: eng)
        rt = Runtime(eng, host)
    yield rt
    gc.collect()
    rt.engine.synchronize()
    assert rt.pool.stats()["in_use_bytes"] == 0


class Stack(nn.Module):
    """Repeated blocks (find_repeated_blocks finds them) and a loss."""

    def __init__(self, make, n=3):
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(n))

    def forward(self, h):
        for b in self.layers:
            h = b(h)
        return h


@contextlib.contextmanager
def entry_point(entry, model):
    """Runs model(x) through one entry point: yields the forward to call."""
    if entry == "offload_activations":
        def fwd(x):
            with ckpt_offload.offload_activations(min_bytes=0):
                return model(x)
        yield fwd
    elif entry == "checkpoint":
        def fwd(x):
            h = x
            for b in model.layers:
                h = ckpt_offload.checkpoint(b, h)
            return h
        yield fwd
    else:
        ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
        try:
            yield model
        finally:
            ckpt_offload.disable_checkpointing(model)


def grads(model, *tensors):
    return [p.grad.clone() for p in model.parameters()] + [t.grad.clone() for t in tensors]


def zero(model, *tensors):
    model.zero_grad(set_to_none=True)
    for t in tensors:
        t.grad = None


def check(runtime, model, entry, make_input, loss_of=lambda out, x: out.square().sum(), seed=0, steps=1):
    """The loss and every gradient, bitwise, with and without the entry point; something moved."""
    zero(model)
    torch.manual_seed(seed)
    x = make_input()
    ref_loss = loss_of(model(x), x)
    ref_loss.backward()
    ref = grads(model, *[t for t in (x,) if t.is_leaf])
    for _ in range(steps):
        zero(model, x)
        before = runtime.offloaded()
        torch.manual_seed(seed)
        x = make_input()
        with entry_point(entry, model) as fwd:
            loss = loss_of(fwd(x), x)
            assert runtime.offloaded() > before
            loss.backward()
        assert torch.equal(loss, ref_loss)
        for g, r in zip(grads(model, *[t for t in (x,) if t.is_leaf]), ref):
            assert torch.equal(g, r)
    return x


class MLP(nn.Module):
    def __init__(self, width=32, p=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, h):
        return h + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(h)))))


def _mlp_stack(p=0.0):
    torch.manual_seed(1)
    return Stack(lambda: MLP(p=p))


@pytest.mark.parametrize("entry", ENTRIES)
def test_plain_parity(runtime, entry):
    check(runtime, _mlp_stack(), entry, lambda: torch.randn(8, 32, requires_grad=True), steps=2)


@pytest.mark.parametrize("entry", ENTRIES)
def test_dropout_and_rng_parity(runtime, entry):
    """PITFALLS 45: dropout and the RNG through offload: gradients bitwise those of torch's checkpoint. Fails
    where the recompute draws another mask."""
    model = _mlp_stack(p=0.3).train()
    check(runtime, model, entry, lambda: torch.randn(8, 32, requires_grad=True))
    # The generator is where the unmodified run leaves it: the next draw agrees.
    torch.manual_seed(5)
    with entry_point(entry, model) as fwd:
        fwd(torch.randn(8, 32, requires_grad=True)).sum().backward()
    after = torch.rand(4)
    zero(model)
    torch.manual_seed(5)
    model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert torch.equal(after, torch.rand(4))


@pytest.mark.parametrize("entry", ENTRIES)
def test_input_view_with_storage_offset(runtime, entry):
    """PITFALLS 4: an input that is a view at a storage offset round-trips with its offset and values. Fails
    where a view comes back at its base's offset."""
    def make():
        base = torch.randn(10, 32)
        x = base[2:].detach().requires_grad_(True)
        assert x.storage_offset() > 0
        return x
    check(runtime, _mlp_stack(), entry, make)


@pytest.mark.parametrize("entry", ENTRIES)
def test_strided_and_transposed_inputs(runtime, entry):
    """PITFALLS 13: transposed and strided inputs round-trip with their strides under the entry points;
    gradients bitwise. Fails where a non-contiguous saved tensor crashes or comes back with other strides."""
    def strided():
        x = torch.randn(8, 64)[:, ::2].detach().requires_grad_(True)
        assert not x.is_contiguous()
        return x

    def transposed():
        return torch.randn(32, 8).t().detach().requires_grad_(True)

    check(runtime, _mlp_stack(), entry, strided)
    check(runtime, _mlp_stack(), entry, transposed)


@pytest.mark.parametrize("entry", ENTRIES)
def test_overlapping_views(runtime, entry):
    """PITFALLS 4: An expanded input (stride 0: elements overlap) and a block that saves overlapping slices."""

    class Overlap(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, h):
            a, b = h[:, :24], h[:, 8:]  # overlapping columns of one storage, both saved by the products
            return self.lin(torch.cat([a * a.sin(), b[:, 16:] * b[:, :8]], dim=1))

    torch.manual_seed(1)
    model = Stack(Overlap)

    def expanded():
        x = torch.randn(1, 32, requires_grad=True).expand(8, 32)
        assert 0 in x.stride()
        return x
    check(runtime, model, entry, expanded)
    check(runtime, model, entry, lambda: torch.randn(8, 32, requires_grad=True))


@pytest.mark.parametrize("entry", ENTRIES)
def test_split_projection_views(runtime, entry):
    """PITFALLS 13: q, k, v split from one projection: strided views of one storage with gaps between elements."""

    class Attention(nn.Module):
        def __init__(self, width=32):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width, width)

        def forward(self, h):
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            scores = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
            return h + self.out(scores @ v)

    torch.manual_seed(1)
    check(runtime, Stack(Attention), entry, lambda: torch.randn(2, 8, 32, requires_grad=True))


class Router(nn.Module):
    """A mixture-of-experts block that keeps its router logits for an auxiliary loss, as MoE models
    return them (output_router_logits)."""

    def __init__(self, width=32, experts=4):
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.captured = []

    def forward(self, h):
        logits = self.gate(h)
        self.captured.append(logits)
        weights = torch.softmax(logits, dim=-1)
        top, idx = weights.topk(2, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            chosen = (idx == e).any(-1, keepdim=True).to(h.dtype)
            out = out + chosen * (top * (idx == e)).sum(-1, keepdim=True) * expert(h)
        return h + out


@pytest.mark.parametrize("entry", ENTRIES)
def test_captured_router_logits(runtime, entry):
    torch.manual_seed(1)
    model = Stack(Router)

    def loss_of(out, x):
        logits = [b.captured.pop() for b in model.layers]
        assert all(not b.captured for b in model.layers)
        aux = sum(torch.softmax(lg, -1).mean(0).square().sum() for lg in logits)  # a load-balancing term
        return out.square().sum() + 0.01 * aux

    # Under a checkpoint the logits are recomputed in backward (and captured again there): only the
    # forward's are read here, so each forward's are popped before backward.
    check(runtime, model, entry, lambda: torch.randn(16, 32, requires_grad=True), loss_of=loss_of)
    for b in model.layers:
        b.captured.clear()


@pytest.mark.parametrize("entry", ENTRIES)
def test_input_the_caller_reads_again(runtime, entry):
    """The input is offloaded, and the caller reads it after the forward and uses it in the loss."""
    torch.manual_seed(1)
    model = _mlp_stack()
    seen = []

    def loss_of(out, x):
        seen.append(x.detach().clone())
        return out.square().sum() + (x * x).sum() + x[1:].sum()

    torch.manual_seed(3)
    inp = torch.randn(8, 32, requires_grad=True)
    x = inp * 1
    loss_of(model(x), x).backward()
    ref = grads(model, inp)
    zero(model, inp)
    before = runtime.offloaded()
    with entry_point(entry, model) as fwd:
        x = inp * 1  # an activation: offloaded by every entry point
        kept = x.detach().clone()
        loss = loss_of(fwd(x), x)
        assert torch.equal(x, kept)  # read again after the forward: the same values
        assert torch.equal(seen[0], seen[1])
        loss.backward()
    assert runtime.offloaded() > before
    for g, r in zip(grads(model, inp), ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("entry", ENTRIES)
def test_retained_graph(runtime, entry):
    torch.manual_seed(1)
    model = _mlp_stack()
    torch.manual_seed(2)
    x = torch.randn(8, 32, requires_grad=True)
    ref_loss = model(x).square().sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    ref = grads(model, x)
    zero(model, x)
    with entry_point(entry, model) as fwd:
        loss = fwd(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()  # reloaded again from the host copy
    for g, r in zip(grads(model, x), ref):
        assert torch.equal(g, r)
    del loss


@pytest.mark.parametrize("entry", ENTRIES)
def test_exception_mid_forward_leaves_nothing_behind(runtime, entry):
    torch.manual_seed(1)
    model = _mlp_stack()
    fail = {"at": 1}
    original = MLP.forward

    def forward(self, h):
        if fail["at"] is not None and self is model.layers[fail["at"]]:
            raise RuntimeError("boom")
        return original(self, h)

    x = torch.randn(8, 32, requires_grad=True)
    MLP.forward = forward
    try:
        with entry_point(entry, model) as fwd:
            with pytest.raises(RuntimeError, match="boom"):
                fwd(x)
            fail["at"] = None
            gc.collect()
            runtime.engine.synchronize()
            assert runtime.pool.stats()["in_use_bytes"] == 0  # what the failed forward offloaded went with it
            loss = fwd(x).square().sum()
            loss.backward()
    finally:
        MLP.forward = original
    # No hooks are left: a plain forward afterwards offloads nothing.
    before = runtime.offloaded()
    model(x).sum().backward()
    assert runtime.offloaded() == before
    got = grads(model, x)
    zero(model, x)
    model(x).square().sum().backward()
    model(x).sum().backward()
    for g, r in zip(got, grads(model, x)):
        assert torch.equal(g, r)


@pytest.mark.parametrize("entry", ENTRIES)
def test_nested_inside_offload_activations(runtime, entry):
    """The entry point inside an offload_activations context that saved the same input before."""
    torch.manual_seed(1)
    model = _mlp_stack()
    torch.manual_seed(2)
    inp = torch.randn(8, 32, requires_grad=True)
    x = inp * 1
    (x.sin() * model(x)).sum().backward()
    ref = grads(model, inp)
    zero(model, inp)
    with ckpt_offload.offload_activations(min_bytes=0):
        x = inp * 1
        s = x.sin()  # saves x in the outer context
        with entry_point(entry, model) as fwd:
            out = fwd(x)  # saves x again, in the inner one
        loss = (s * out).sum()
    loss.backward()
    for g, r in zip(grads(model, inp), ref):
        assert torch.equal(g, r)


class _ViewBack(torch.autograd.Function):
    """Backward returns a view of the tensor it unpacked (torchtune's case: the reloaded tensor must
    not be freed or reused while that view is alive)."""

    @staticmethod
    def forward(ctx, h):
        saved = h.t() * 1
        ctx.save_for_backward(saved)
        return h * 2

    @staticmethod
    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        return g * 2 + saved.t()


class ViewBackBlock(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return self.lin(_ViewBack.apply(h))


@pytest.mark.parametrize("entry", ENTRIES)
def test_backward_returns_a_view_of_the_reloaded_tensor(runtime, entry):
    torch.manual_seed(1)
    check(runtime, Stack(ViewBackBlock, n=4), entry, lambda: torch.randn(16, 32, requires_grad=True))


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_grad_forward_offloads_nothing(runtime, entry):
    model = _mlp_stack()
    x = torch.randn(8, 32)
    ref = model(x)
    before = runtime.offloaded()
    with torch.no_grad(), entry_point(entry, model) as fwd:
        out = fwd(x)
    assert torch.equal(out, ref.detach())
    assert runtime.offloaded() == before
