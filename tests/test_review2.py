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


# -- torch's checkpoint always gets an explicit respect_saved_tensors_hooks -------------------------
def _record_checkpoint_calls(monkeypatch):
    """Wraps torch.utils.checkpoint.checkpoint: each call notes its respect_saved_tensors_hooks and
    whether saved-tensor hooks were active around it."""
    import torch.utils.checkpoint as tuc

    calls, real = [], tuc.checkpoint

    def recording(function, *args, **kwargs):
        active = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        calls.append((active, kwargs.get("respect_saved_tensors_hooks", "left out")))
        return real(function, *args, **kwargs)

    monkeypatch.setattr(tuc, "checkpoint", recording)
    return calls


@pytest.mark.skipif(not ckpt_offload.policies.HAS_RESPECT, reason="this torch's checkpoint has no "
                    "respect_saved_tensors_hooks")
def test_no_entry_point_leaves_respect_saved_tensors_hooks_open_under_active_hooks(monkeypatch):
    from functools import partial
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from ckpt_offload import checkpointing, compile as ckcompile
    from tiny_gpt import loss_of, make_batch, make_model

    calls = _record_checkpoint_calls(monkeypatch)
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    def fn(a, b):
        return torch.sin(a @ b) @ b

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op == torch.ops.aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE

    sac = partial(create_selective_checkpoint_contexts, policy)
    outs = [
        ckpt_offload.checkpoint(fn, x, w),
        ckpt_offload.checkpoint(fn, x, w, context_fn=sac),
        ckpt_offload.checkpoint(fn, x, w, respect_saved_tensors_hooks=True),
        ckpt_offload.checkpoint(fn, x, w, session=ckpt_offload.OffloadSession()),
        ckpt_offload.checkpoint(preserve_rng_state=False)(fn)(x, w),
        checkpointing.checkpoint_function(ckpt_offload.OffloadSession())(fn, x, w),  # transformers' layers
        checkpointing.checkpoint_function(ckpt_offload.OffloadSession(), keep=True)(fn, x, w),
        ckcompile.layer_checkpoint_function(ckpt_offload.OffloadSession())(fn, x, w),
    ]
    with torch.autograd.graph.save_on_cpu():  # a user's hooks around the plain drop-in
        outs.append(ckpt_offload.checkpoint(fn, x, w, offload=False))
    for out in outs:
        out.sum().backward()
    for policy_arg in (None, "attention"):
        model = make_model(layers=3)
        ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0, policy=policy_arg)
        loss_of(model, make_batch()).backward()
    model = make_model(layers=3)
    ckpt_offload.enable_block_modes(model, ["checkpoint+offload", "checkpoint", "checkpoint+offload+attention"])
    loss_of(model, make_batch()).backward()
    under_hooks = [respect for active, respect in calls if active]
    assert len(under_hooks) >= 13, calls  # every call above (with its recompute-free forward) was seen
    assert all(isinstance(r, bool) for r in under_hooks), calls


def test_checkpoint_works_as_a_decorator():
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    @ckpt_offload.checkpoint(preserve_rng_state=False)
    def fn(a, b, scale=1.0):
        return torch.sin(a @ b * scale) @ b

    assert fn.__name__ == "fn"
    fn(x * 1, w, scale=2.0).sum().backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 2 and s["tensors_fetched"] == 2  # a * 1 and b went to the host and back
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.utils.checkpoint.checkpoint(lambda a, b: torch.sin(a @ b * 2.0) @ b, x * 1, w,
                                      use_reentrant=False).sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
    with pytest.raises(ValueError, match="without a function it takes only checkpoint options"):
        ckpt_offload.checkpoint(prefetch=2)
    with pytest.raises(TypeError, match="offload must be True or False"):
        ckpt_offload.checkpoint(offload="yes")
    with pytest.raises(TypeError, match="the decorated object must be callable"):
        ckpt_offload.checkpoint()(3)
