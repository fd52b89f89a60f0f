"""Second review round: a failed enter leaves nothing behind, the drop-in checkpoint keeps graphs apart,
retained graphs keep their offload, selective offload honours allow_cache_entry_mutation, torch's
checkpoint always gets an explicit respect_saved_tensors_hooks, and checkpoint works as a decorator."""
import pytest
import torch

import ckpt_offload
from ckpt_offload import session as _session

pytestmark = pytest.mark.usefixtures("test_cpu")


def _module_hook_installed():
    return any(h is _session._note_modules for h in torch.nn.modules.module._global_forward_pre_hooks.values())


def test_a_failed_offload_activations_enter_leaves_no_module_hook_and_the_context_reusable():
    ctx = ckpt_offload.offload_activations(min_bytes=0)
    lin = torch.nn.Linear(16, 16)
    with torch.autograd.graph.disable_saved_tensors_hooks("saved-tensor hooks are off here"):
        with pytest.raises(RuntimeError, match="saved-tensor hooks are off here"):
            ctx.__enter__()
    assert not _module_hook_installed() and not _session._trackers
    lin(torch.randn(4, 16))  # a module call noted into nothing
    assert not ctx.session._module_ptrs
    x = torch.randn(8, 16, requires_grad=True)
    with ctx:  # not "already active"
        y = torch.tanh(lin(x * 2)).sum()
    assert not _module_hook_installed()
    assert ckpt_offload.stats()["tensors_offloaded"] >= 2  # x * 2 and the tanh output, not the weight
    y.backward()
    ref_x = x.detach().clone().requires_grad_()
    torch.tanh(torch.nn.functional.linear(ref_x * 2, lin.weight, lin.bias)).sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
