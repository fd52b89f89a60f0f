"""Host work that a step must not do: no torch.compiler.disable wrapper (a dynamo frame switch) per
layer where nothing compiles, and once the midpoints are known, no forward hook on a block's other
children (each would send that module through torch's slow call path, in forward and recompute)."""
import os
import sys

import pytest
import torch
from torch import nn

import ckpt_offload

pytestmark = pytest.mark.usefixtures("test_cpu")

PACKAGE = os.path.dirname(os.path.abspath(ckpt_offload.__file__))
DYNAMO = os.path.dirname(os.path.abspath(torch._dynamo.__file__))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make(layers=4):
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(layers)])


def dynamo_entries_from_the_package(fn):
    """How many times code of torch._dynamo (its disable wrappers) is called directly from
    ckpt_offload's own code while fn runs."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(DYNAMO):
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
                count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("offload", [True, False])
def test_eager_steps_enter_no_compile_boundary(offload):
    model = make()
    ckpt_offload.enable_checkpointing(model, offload=offload, keep_last=1)
    x = torch.randn(2, 8, 32, requires_grad=True)

    def step():
        model(x).square().sum().backward()

    step()  # the first step: the boundary's disabled function is made on first use
    ckpt_offload.reset_stats()
    assert dynamo_entries_from_the_package(step) == 0
    assert ckpt_offload.stats()["tensors_offloaded"] == (3 if offload else 0)  # the step did offload


def test_gradients_through_the_eager_boundary_are_bitwise_torchs():
    model, ref = make(), make()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    x = torch.randn(2, 8, 32)
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad()
            m(x.clone().requires_grad_()).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_only_the_midpoint_child_keeps_a_hook_once_learned():
    model = make()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    x = torch.randn(2, 8, 32, requires_grad=True)
    hooked = lambda b: [name for name, c in b.named_children() if c._forward_hooks]  # noqa: E731
    assert all(hooked(b) == ["norm", "up", "down"] for b in model)  # learning the order
    ckpt_offload.reset_stats()
    model(x).square().sum().backward()
    assert all(hooked(b) == ["up"] for b in model)  # the middle of norm, up, down
    assert ckpt_offload.stats()["midpoint_misses"] == 0
    # Later steps still reload from the midpoints (a miss would switch them off and count).
    for _ in range(2):
        model(x).square().sum().backward()
    state = ckpt_offload.checkpointing_state(model)
    assert state is not None and ckpt_offload.stats()["midpoint_misses"] == 0
    ckpt_offload.disable_checkpointing(model)
    assert not any(c._forward_hooks for b in model for c in b.children())


def test_the_model_tensors_excluded_are_those_of_parameters_and_buffers():
    # The walk before each forward (one pass over the modules) must find what model.parameters()
    # and model.buffers() hold: shared modules once, None buffers skipped, freed storages by their
    # identity, a tensor subclass with a local tensor (a DTensor) by that local tensor.
    from ckpt_offload.session import _storage_ref

    class Local(torch.Tensor):
        pass

    model = make(3)
    shared = nn.Linear(4, 4)
    model.add_module("a", shared)
    model.add_module("b", shared)
    model.add_module("norm", nn.BatchNorm1d(4))  # 2 parameters, 3 buffers (running stats, a counter)
    model.register_buffer("nothing", None)
    model.register_buffer("freed", torch.zeros(8))
    model.freed.untyped_storage().resize_(0)
    local = torch.randn(5)
    sub = local.as_subclass(Local)
    sub._local_tensor = local
    model.a.register_buffer("sharded", sub)
    expected = {r.cdata for r in map(_storage_ref, (*model.parameters(), *model.buffers())) if r is not None}
    assert local.untyped_storage()._cdata in expected and len(expected) == 3 * 6 + 2 + 5 + 2
    session = ckpt_offload.OffloadSession()
    session.exclude_module_tensors(model)
    assert set(session._module_ptrs) == expected
    assert not session._is_candidate(model.norm.running_mean)  # a buffer passed on as an input
