"""Tensor-subclass inputs in one process: a DTensor's local shard goes through the engine and comes
back as a DTensor of the same layout; another subclass (TwoTensor) stays on the device and is
reported (a warning naming the layer and type, stats()["subclass_tensors_kept"], checkpointing_state).

The DTensors live on a 2-rank mesh of the fake process group (this process is rank 0): nothing here
communicates, so each rank's shard is computed as a real rank's would be. The sharding is uneven (5
rows over 2 ranks: 3 here), so a rewrap that lost the global shape would show.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import ckpt_offload
from ckpt_offload import OffloadSession

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")

ROWS, LOCAL_ROWS, H = 5, 3, 8


@pytest.fixture(scope="module")
def mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _shard(mesh, seed, requires_grad=True):
    from torch.distributed.tensor import DTensor, Shard

    local = torch.randn(LOCAL_ROWS, H, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)
    return local, DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(ROWS, H), stride=(H, 1))


def _replicated(mesh, seed):
    from torch.distributed.tensor import DTensor, Replicate

    w = torch.randn(H, H, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    return w, DTensor.from_local(w, mesh, [Replicate()], run_check=False)


class _Layouts:
    """The layer function: records the layout of each input it gets (forward and recompute)."""

    def __init__(self, w):
        self.w = w
        self.seen = []

    def __call__(self, x):
        self.seen.append((type(x), x.device_mesh, x.placements, x.shape, x.stride(), x.to_local().shape))
        return torch.tanh(x @ self.w) * x


def _grads(mesh, run):
    """Gradients (local shards) of one step of a layer function through `run`, and what it saw."""
    local, x = _shard(mesh, 1)
    w_local, w = _replicated(mesh, 2)
    fn = _Layouts(w)
    out = run(fn, x)
    out.to_local().square().sum().backward()
    return local.grad, w_local.grad, fn.seen


def test_checkpoint_offloads_dtensor_local_shard(mesh, test_cpu):
    ref_x, ref_w, ref_seen = _grads(mesh, lambda fn, x: torch_checkpoint(fn, x, use_reentrant=False))
    session = OffloadSession()
    ckpt_offload.reset_stats()
    gx, gw, seen = _grads(mesh, lambda fn, x: ckpt_offload.checkpoint(fn, x, session=session))
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == s["tensors_fetched"] == 1  # the shard, not the whole tensor
    assert s["bytes_offloaded"] == LOCAL_ROWS * H * 4
    assert s["subclass_tensors_kept"] == 0 and s["host_in_use_bytes"] == 0
    assert torch.equal(gx, ref_x) and torch.equal(gw, ref_w)
    # The recompute got a DTensor of the forward's mesh, placements, global shape and stride.
    assert len(seen) == 2 and seen[0] == seen[1] == ref_seen[0]


class _Block(nn.Module):
    def __init__(self, mesh, seed):
        super().__init__()
        from torch.distributed.tensor import Replicate, distribute_tensor

        torch.manual_seed(seed)
        self.a = nn.Linear(H, H)
        self.b = nn.Linear(H, H)
        for lin in (self.a, self.b):
            for name, p in list(lin.named_parameters()):
                setattr(lin, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Stack(nn.Module):
    def __init__(self, mesh, layers=4):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(mesh, i) for i in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _model_step(mesh, model, seed=1):
    _, x = _shard(mesh, seed)
    model(x).to_local().square().sum().backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_enable_checkpointing_dtensor_residual_stream(mesh, test_cpu):
    """PITFALLS 31: A DTensor residual stream (sharded on its first dimension, as SequenceParallel shards the
    sequence): every offloaded block's input goes to the host, and checkpointing_state says so."""
    ref = _Stack(mesh)
    for b in ref.blocks:
        b.forward = (lambda blk: lambda x: torch_checkpoint(type(blk).forward, blk, x, use_reentrant=False))(b)
    want = _model_step(mesh, ref)
    model = _Stack(mesh)
    assert ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1) == [0, 1, 2, 3]
    for step in range(2):
        ckpt_offload.reset_stats()
        got = _model_step(mesh, model)
        s = ckpt_offload.stats()
        assert s["tensors_offloaded"] == s["tensors_fetched"] == 3, step  # blocks 0..2; block 3 kept
        assert s["bytes_offloaded"] == 3 * LOCAL_ROWS * H * 4, step
        assert s["subclass_tensors_kept"] == 0 and s["host_in_use_bytes"] == 0, step
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"step {step}: gradient of {name} differs"
        assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2, 3], [0, 1, 2])


def test_offload_activations_dtensor(mesh, test_cpu):
    """offload_activations (and TRL's route through it): the DTensors the forward saves go to the
    host as their shards; the DTensor weights stay."""
    ref = _Stack(mesh, layers=2)
    want = _model_step(mesh, ref)
    model = _Stack(mesh, layers=2)
    ckpt_offload.reset_stats()
    with ckpt_offload.offload_activations(min_bytes=0):
        _, x = _shard(mesh, 1)
        out = model(x)
    s = ckpt_offload.stats()
    # Per block: a's input and relu's output, which relu and b both save (one copy, a shared view);
    # the weights (w.t(), a view of a DTensor parameter) stay.
    assert s["tensors_offloaded"] == 2 * 2 and s["shared_views"] == 2
    assert s["bytes_offloaded"] == 2 * 2 * LOCAL_ROWS * H * 4
    out.to_local().square().sum().backward()
    got = {n: p.grad.to_local() for n, p in model.named_parameters()}
    assert ckpt_offload.stats()["tensors_fetched"] == 2 * 2
    for name in want:
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


def test_offload_activations_dtensor_leaf_input(mesh, test_cpu):
    """A DTensor leaf that needs grad and is no module's weight (a first layer's input under peft's
    enable_input_require_grads) is an activation: its shard goes to the host like the others."""
    from torch.distributed.tensor import DTensor, Shard

    def leaf():
        local, _ = _shard(mesh, 1, requires_grad=False)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(ROWS, H),
                                  stride=(H, 1)).requires_grad_(True)

    model = _Stack(mesh, layers=2)
    x = leaf()
    assert x.is_leaf and x.requires_grad
    model(x).to_local().square().sum().backward()
    want = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    want_x = x.grad.to_local().clone()
    model.zero_grad(set_to_none=True)
    ckpt_offload.reset_stats()
    x = leaf()
    with ckpt_offload.offload_activations(min_bytes=0):
        out = model(x)
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * 2 * LOCAL_ROWS * H * 4  # the leaf input too
    out.to_local().square().sum().backward()
    assert torch.equal(x.grad.to_local(), want_x)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad.to_local(), want[n]), f"gradient of {n} differs"


def test_trl_context_manager_offloads_dtensor_shards(mesh, test_cpu):
    """TRL's get_act_offloading_ctx_manager as ckpt_offload serves it (trl.install()): the same
    shards go to the host and come back as DTensors, gradients bitwise."""
    pytest.importorskip("trl", reason="trl is an optional dependency (the TRL integration)")
    from ckpt_offload.integrations import trl as trl_route

    ref = _Stack(mesh, layers=2)
    want = _model_step(mesh, ref)
    model = _Stack(mesh, layers=2)
    ckpt_offload.reset_stats()
    with trl_route._ctx_manager(model, min_offload_size=0, use_streams=False, warn_if_no_head=False):
        _, x = _shard(mesh, 1)
        out = model(x)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 2 * 2 and s["bytes_offloaded"] == 2 * 2 * LOCAL_ROWS * H * 4
    assert s["subclass_tensors_kept"] == 0
    out.to_local().square().sum().backward()
    assert ckpt_offload.stats()["tensors_fetched"] == 2 * 2
    got = {n: p.grad.to_local() for n, p in model.named_parameters()}
    for name in want:
        assert torch.equal(got[name], want[name]), f"gradient of {name} differs"


# -- a subclass the engine cannot take: reported, never counted as offloaded ---------------------------
def _two(seed):
    from torch.testing._internal.two_tensor import TwoTensor

    g = torch.Generator().manual_seed(seed)
    return TwoTensor(torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)).requires_grad_(True)


class _PlainStack(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_unsupported_subclass_is_reported(test_cpu):
    """PITFALLS 31: a subclass the engine cannot take is reported (warning, counter, state), never silently
    kept while the state says offloaded."""
    model = _PlainStack()
    assert ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1) == [0, 1, 2]
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [0, 1])  # configured, not run yet
    with pytest.warns(RuntimeWarning) as caught:
        model(_two(1)).sum().backward()
    ours = [str(w.message) for w in caught if "stays on the device" in str(w.message)]
    assert len(ours) == 2, ours  # one per offloaded layer: it names the layer and the type
    assert "'blocks.0' (0)" in ours[0] and "'blocks.1' (1)" in ours[1]
    assert all("TwoTensor" in m for m in ours)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 0 and s["subclass_tensors_kept"] == 2
    # Nothing was offloaded in the last step: no layer is reported as offloaded.
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [])
    ckpt_offload.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per layer and type, not every step
        model(_two(2)).sum().backward()
    assert ckpt_offload.stats()["subclass_tensors_kept"] == 2
    # Plain inputs again: the layers offload, and the state follows what ran.
    model(torch.randn(4, H)).sum().backward()
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [0, 1])


def test_unsupported_subclass_gradients_unchanged(test_cpu):
    from torch.testing._internal.two_tensor import TwoTensor

    def grads(run):
        x = _two(3)
        w = torch.randn(H, H, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
        out = run(lambda t: torch.tanh(t @ w), x)
        assert isinstance(out, TwoTensor)
        out.square().sum().backward()
        return [part for g in (x.grad, w.grad) for part in ((g.a, g.b) if isinstance(g, TwoTensor) else (g,))]

    want = grads(lambda fn, x: torch_checkpoint(fn, x, use_reentrant=False))
    session = OffloadSession()
    with pytest.warns(RuntimeWarning, match="TwoTensor stays on the device"):
        got = grads(lambda fn, x: ckpt_offload.checkpoint(fn, x, session=session))
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert ckpt_offload.stats()["subclass_tensors_kept"] == 1


def test_unpack_refuses_other_objects():
    session = OffloadSession()
    with pytest.raises(TypeError, match="expected a Packed, got int"):
        session.unpack(3)
