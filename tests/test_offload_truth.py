"""Offloads that must not silently keep tensors on the device: leaves that need grad but are no
weight, CPU tensors on a machine without the test path, configurations that offload nothing, and
nested contexts that save one tensor (copied once, no false hazard on the simulated runtime)."""
import gc
import warnings

import pytest
import torch

import ckpt_offload

MiB = 1 << 20


def _unmovable_warnings(records):
    return [w for w in records if issubclass(w.category, RuntimeWarning) and "unmovable_tensors_kept" in str(w.message)]


# -- leaves that need grad --------------------------------------------------------------------------
class _RMSNorm(torch.autograd.Function):
    """A custom norm that reshapes its input before saving it (a view of the input, a leaf inside forward)."""

    @staticmethod
    def forward(ctx, x, w):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        return (x2 * torch.rsqrt(x2.square().mean(-1, keepdim=True) + 1e-6) * w).reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        r = torch.rsqrt(x2.square().mean(-1, keepdim=True) + 1e-6)
        n = x2 * r
        gw = (g2 * n).sum(0)
        gn = g2 * w
        gx = r * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx.reshape(g.shape), gw


class _Tiny(torch.nn.Module):
    """A frozen embedding whose output is made to need grad, as peft's enable_input_require_grads does,
    then a custom norm and a trainable projection."""

    def __init__(self, vocab=64, width=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.embed.weight.requires_grad_(False)
        self.embed.register_forward_hook(lambda m, i, out: out.requires_grad_(True))
        self.norm_w = torch.nn.Parameter(torch.ones(width))
        self.proj = torch.nn.Linear(width, width)

    def forward(self, ids):
        h = self.embed(ids)  # a leaf that needs grad: no weight, the first layer's input
        h = _RMSNorm.apply(h, self.norm_w)
        return self.proj(h).square().mean()


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_leaf_inputs_and_saved_views_that_need_grad_are_offloaded(test_cpu):
    """PITFALLS 38: a leaf that needs grad but is no weight, and views saved inside an autograd.Function, are
    offloaded. Fails where 'keep weights' is taken as 'keep every leaf that requires grad'."""
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 64, (8, 512))  # 8 x 512 x 256 floats: 4 MiB activations
    model(ids).backward()
    ref = _grads(model)
    model.zero_grad()
    ckpt_offload.reset_stats()
    with ckpt_offload.offload_activations(min_bytes=MiB):
        loss = model(ids)
    s = ckpt_offload.stats()
    # Saved of at least 1 MiB: the norm's view of the embedding output (a leaf inside forward), the
    # projection's input (the norm's output) and its output (square). The weights stay.
    assert s["tensors_offloaded"] == 3
    assert s["bytes_offloaded"] == 3 * 8 * 512 * 256 * 4
    loss.backward()
    for g, r in zip(_grads(model), ref):
        assert torch.equal(g, r)
    del loss
    gc.collect()
    ckpt_offload.synchronize()
    assert ckpt_offload.stats()["host_in_use_bytes"] == 0


def test_weights_and_their_views_still_stay(test_cpu):
    """PITFALLS 38: A parameter, its transpose (F.linear's save), and plain tensors that are a module's weights
    (torch.func.functional_call) are not copied."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512, bias=False)  # 1 MiB weight
    x = torch.randn(4, 512, requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0):
        y = lin(x)  # saves x and the weight
        z = (y @ lin.weight.t()).sum()  # saves y and the weight's view
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * 4 * 512 * 4  # x and y only
    z.backward()
    ckpt_offload.reset_stats()
    weights = {"weight": lin.weight.detach().clone().requires_grad_(True)}  # a plain leaf that needs grad
    with ckpt_offload.offload_activations(min_bytes=0):
        out = torch.func.functional_call(lin, weights, (x,)).sum()
    assert ckpt_offload.stats()["bytes_offloaded"] == 4 * 512 * 4  # x only
    out.backward()
    assert torch.equal(weights["weight"].grad, x.detach().sum(0, keepdim=True).expand(512, 512))


# -- a plain CPU, without the test path -----------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.lin(h))


class _Stack(torch.nn.Module):
    def __init__(self, n=3, width=256):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(n))

    def forward(self, h):
        for b in self.layers:
            h = b(h)
        return h.square().mean()


def test_cpu_without_the_test_path_reports_what_stayed(monkeypatch):
    monkeypatch.delenv("CKPT_OFFLOAD_TEST_CPU", raising=False)
    monkeypatch.setattr(ckpt_offload.session, "_unmovable_warned", False)
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(1024, 256, requires_grad=True)  # 1 MiB inputs
    model(x).backward()
    ref = _grads(model)
    model.zero_grad()
    assert ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0) == [0, 1, 2]
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        model(x).backward()
        model.zero_grad()
        model(x).backward()
    assert len(_unmovable_warnings(records)) == 1  # once
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 0
    assert s["unmovable_tensors_kept"] == 6  # three layer inputs, two forwards
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [])  # nothing moved: none offloaded
    for g, r in zip(_grads(model), ref):
        assert torch.equal(g, r)
    ckpt_offload.disable_checkpointing(model)

    ckpt_offload.reset_stats()
    with ckpt_offload.offload_activations(min_bytes=MiB):
        loss = model(x)
    assert ckpt_offload.stats()["unmovable_tensors_kept"] > 0
    loss.backward()


def test_plain_cpu_state_claims_no_offload_before_any_step(monkeypatch):
    """Before any step, a model on a CPU outside the test path reports no offloaded layer: the
    state is what can run (the session's own rule for what the engine moves), not the modes asked
    for; moved to the test path's session it does report them, before a step as after one."""
    monkeypatch.delenv("CKPT_OFFLOAD_TEST_CPU", raising=False)
    model = _Stack()
    assert ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1) == [0, 1, 2]
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [])  # before any step
    x = torch.randn(64, 256, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x).backward()
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [])  # after one: the same
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [0, 1])
    model(x).backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 2
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [0, 1])
    ckpt_offload.disable_checkpointing(model)


def test_plain_cpu_warning_names_the_callers_line(monkeypatch):
    """The "stays on cpu" warning is said from inside torch's checkpoint (the pack hook): it is
    attributed to the user's own line nearest the pack, the model's call of its block (in this
    file), not to torch's checkpoint.py."""
    monkeypatch.delenv("CKPT_OFFLOAD_TEST_CPU", raising=False)
    monkeypatch.setattr(ckpt_offload.session, "_unmovable_warned", False)
    model = _Stack()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    x = torch.randn(64, 256, requires_grad=True)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        loss = model(x)
    loss.backward()
    (w,) = _unmovable_warnings(records)
    assert w.filename == __file__, w.filename
    with open(__file__) as f:
        assert f.read().splitlines()[w.lineno - 1].strip() == "h = b(h)"  # _Stack.forward's call of a block
    ckpt_offload.disable_checkpointing(model)


def test_a_lazy_conjugate_view_is_counted_and_named(test_cpu, monkeypatch):
    monkeypatch.setattr(ckpt_offload.session, "_unmovable_warned", False)
    x = torch.randn(128, 128, dtype=torch.complex64, requires_grad=True)
    y = (x * 1).conj()
    (ref,) = torch.autograd.grad((y * y).abs().sum(), x)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with ckpt_offload.offload_activations(min_bytes=0):
            y = (x * 1).conj()
            assert y.is_conj()
            loss = (y * y).abs().sum()  # the product saves the lazy conjugate twice
    (got,) = torch.autograd.grad(loss, x)
    assert torch.equal(got, ref)
    assert ckpt_offload.stats()["unmovable_tensors_kept"] == 2
    (w,) = _unmovable_warnings(records)
    assert "lazy conjugate or negative view" in str(w.message)


def test_state_turns_offloaded_once_the_tensors_move(test_cpu):
    """The state follows what ran: the same model offloads once its tensors can move."""
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(1024, 256, requires_grad=True)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    model(x).backward()
    assert ckpt_offload.stats()["unmovable_tensors_kept"] == 0
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [0, 1, 2])
    ckpt_offload.disable_checkpointing(model)


def test_offload_that_offloads_nothing_says_so(test_cpu):
    model = _Stack(n=3)
    with pytest.warns(RuntimeWarning, match="offload=True offloads nothing"):
        assert ckpt_offload.enable_checkpointing(model, every_n_layers=4, offload=True, keep_last=1) == [0]
    assert ckpt_offload.checkpointing_state(model) == ([0], [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True, keep_last=1)  # offloads layer 0
    assert ckpt_offload.checkpointing_state(model) == ([0, 2], [0])
    ckpt_offload.disable_checkpointing(model)


# -- nested contexts ------------------------------------------------------------------------------
def _sim_engine(monkeypatch, max_us):
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "1")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC_MAX_US", str(max_us))
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_SEED", "5")
    eng = ckpt_offload.CopyEngine("cpu", ckpt_offload.HostPool(pinned=False))
    assert eng.runtime == "async-sim"
    monkeypatch.setattr(ckpt_offload.engine, "engine_for", lambda dev: eng)
    return eng


def _nested(x, inner_slice):
    with ckpt_offload.offload_activations(min_bytes=0):
        h = x * 2
        a = (h[: h.shape[0] // 2] if inner_slice else h).sin()  # the outer context saves h (or its first half)
        with ckpt_offload.offload_activations(min_bytes=0):
            b = h.cos()  # the inner context saves h
    return (a.sum() + b.sum()) * 1


def test_nested_contexts_copy_a_tensor_once(test_cpu):
    x = torch.randn(256, 1024, requires_grad=True)
    ref_loss = (x * 2)[:].sin().sum() + (x * 2).cos().sum()
    (ref,) = torch.autograd.grad(ref_loss, x)
    loss = _nested(x, inner_slice=False)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 1 and s["bytes_offloaded"] == x.numel() * 4
    loss.backward()
    assert torch.equal(x.grad, ref)


@pytest.mark.parametrize("inner_slice", [False, True])
def test_nested_contexts_on_the_simulated_runtime(monkeypatch, inner_slice):
    """Two contexts whose copies overlap in memory: the first's source goes back while the second's
    copy is queued, which is safe (each copy holds its own reference)."""
    eng = _sim_engine(monkeypatch, max_us=20000)
    x = torch.randn(256, 1024, requires_grad=True)
    h = x * 2
    ref_loss = (h[:128] if inner_slice else h).sin().sum() + h.cos().sum()
    (ref,) = torch.autograd.grad(ref_loss, x)
    loss = _nested(x, inner_slice)
    loss.backward()
    eng.synchronize()
    assert torch.equal(x.grad, ref)
    assert eng.stats()["tensors_offloaded"] == (2 if inner_slice else 1)
