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
    """PITFALLS 26: no entry point calls torch's checkpoint with respect_saved_tensors_hooks left open under
    active hooks (an error on newer torch). Fails where a release's contract change is met by a version
    string instead of the feature."""
    from functools import partial
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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
    assert len(under_hooks) >= 10, calls  # every call above (with its recompute-free forward) was seen
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
    with pytest.raises(TypeError, match=r"without a function\): unexpected keyword 'prefetch'"):
        ckpt_offload.checkpoint(prefetch=2)
    with pytest.raises(TypeError, match="did you mean 'preserve_rng_state'"):
        ckpt_offload.checkpoint(preserve_rng_stat=False)
    with pytest.raises(TypeError, match="offload must be True or False"):
        ckpt_offload.checkpoint(offload="yes")
    with pytest.raises(TypeError, match="the decorated object must be callable"):
        ckpt_offload.checkpoint()(3)


def test_a_decorated_function_takes_keywords_named_like_checkpoint_options():
    # The options are given when decorating; a call's keywords all go to the function, even one
    # named preserve_rng_state, use_reentrant, offload or session.
    def fn(a, preserve_rng_state, use_reentrant, context_fn, determinism_check, debug, early_stop, offload, session):
        return (a.sin() * preserve_rng_state * use_reentrant * context_fn * determinism_check * debug * early_stop
                * offload * session)

    names = dict(preserve_rng_state=2, use_reentrant=3, context_fn=5, determinism_check=7, debug=11, early_stop=13,
                 offload=17, session=19)
    a = torch.randn(8, 64, requires_grad=True)
    ckpt_offload.reset_stats()
    out = ckpt_offload.checkpoint(preserve_rng_state=False)(fn)(a * 1, **names)
    (got,) = torch.autograd.grad(out.sum(), (a,))
    assert ckpt_offload.stats()["tensors_offloaded"] == 1  # a * 1, still offloaded
    (want,) = torch.autograd.grad(fn(a * 1, **names).sum(), (a,))
    assert torch.equal(got, want)


# -- retain_graph keeps the offload -----------------------------------------------------------------
from ckpt_offload import session as _sess  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

L, S, HID = 5, 24, 32
INPUT_BYTES = 2 * S * HID * 4  # one block input, fp32


def _watch_reloads(monkeypatch):
    """Every tensor an offloaded pack comes back as, by storage: which of them are still alive."""
    seen = []
    real_hook = _sess._engine._C.SessionCore.hook

    def hook(core, kind):  # a session's unpack hook (kind 2), wrapped as it is made
        real = real_hook(core, kind)
        if kind != 2:
            return real

        def unpack(packed):
            offloaded = packed.record is not None
            t = real(packed)
            if offloaded:
                seen.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
            return t

        return unpack

    monkeypatch.setattr(_sess._engine._C.SessionCore, "hook", hook)

    def live():
        return sum(n for ref, n in {r.cdata: (r, n) for r, n in seen}.values() if not ref.expired())

    live.seen = seen  # every reload watched: (storage ref, bytes)
    return live


def _host_in_use():
    return ckpt_offload.stats()["host_in_use_bytes"]


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_a_retained_graph_keeps_its_inputs_on_the_host_and_reloads_them_with_prefetch(monkeypatch, how):
    """PITFALLS 24: a graph kept with retain_graph=True keeps its inputs on the host and reloads them, with
    prefetch, for the next backward. Fails where every reload stays on the device until the graph dies."""
    from tiny_gpt import loss_of, make_batch, make_model

    live_reloads = _watch_reloads(monkeypatch)
    ids = make_batch(seq=S)
    ref = make_model(layers=L, hidden=HID, heads=4, max_len=S)
    model = make_model(layers=L, hidden=HID, heads=4, max_len=S)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1, prefetch=1)
    params, ref_params = list(model.parameters()), list(ref.parameters())

    def backward(loss, ps, retain):
        if how == "backward":
            loss.backward(retain_graph=retain)
            return [p.grad.clone() for p in ps]
        return torch.autograd.grad(loss, ps, retain_graph=retain)

    ref_loss = loss_of(ref, ids)
    ref_first = backward(ref_loss, ref_params, True)
    ref_second = backward(ref_loss, ref_params, False)

    loss = loss_of(model, ids)
    offloaded = ckpt_offload.stats()["bytes_offloaded"]
    assert offloaded == (L - 1) * INPUT_BYTES and _host_in_use() == offloaded
    for i, expected in enumerate((ref_first, ref_second, None)):
        ckpt_offload.reset_stats()
        got = backward(loss, params, retain=i < 2)
        s = ckpt_offload.stats()
        # Each backward reloads every offloaded input again, ahead of need.
        assert s["tensors_fetched"] == L - 1 and s["tensors_prefetched"] == L - 1, (i, s)
        assert s["reloads_on_demand"] == 0 and s["bytes_prefetched"] == offloaded
        if expected is not None:
            assert all(torch.equal(g, e) for g, e in zip(got, expected)), i
        if i < 2:
            # Retained: the host copies stay for the next backward, the reloaded copies are gone.
            assert _host_in_use() == offloaded
            assert len(live_reloads.seen) == (i + 1) * (L - 1) and live_reloads() == 0
        if i == 1 and how == "backward":
            assert all(torch.equal(p.grad, g) for p, g in zip(params, ref_second))  # accumulated as without offload
    del loss
    assert _host_in_use() == 0 and ckpt_offload.stats()["tensors_released"] == 0


def test_views_sharing_one_copy_come_back_from_one_reload_per_backward():
    # q, k, v split from one projection: one copy of the whole storage, shared by three packs.
    ctx = ckpt_offload.offload_activations(min_bytes=0, prefetch=8)
    inp = torch.randn(16, 48, requires_grad=True)
    with ctx:
        qkv = inp * 2
        q, k, v = qkv.split(16, dim=1)
        y = (q.exp() * k.exp() * v.exp()).sum()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 4 and s["shared_views"] >= 1  # inp * 2's storage once, and the exps
    for i in range(2):
        ckpt_offload.reset_stats()
        y.backward(retain_graph=True)
        assert ckpt_offload.stats()["tensors_fetched"] == 4, i
    ref = inp.detach().clone().requires_grad_()
    r = ref * 2
    rq, rk, rv = r.split(16, dim=1)
    (rq.exp() * rk.exp() * rv.exp()).sum().backward()
    assert torch.equal(inp.grad, 2 * ref.grad)


# -- the drop-in checkpoint keeps graphs apart -----------------------------------------------------
def test_the_drop_in_checkpoint_reloads_nothing_of_another_graph_still_alive():
    w = torch.randn(32, 32, requires_grad=True)

    def layer(h):
        return torch.tanh(h @ w)

    def two_layers(x):
        return ckpt_offload.checkpoint(layer, ckpt_offload.checkpoint(layer, x * 1) + 1)

    xa, xb = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    ya = two_layers(xa)  # graph A: alive, no backward yet
    yb = two_layers(xb)
    one = 8 * 32 * 4
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 4 and s["host_in_use_bytes"] == 4 * one
    ckpt_offload.reset_stats()
    yb.sum().backward()
    s = ckpt_offload.stats()
    # B's second layer is reloaded on demand and starts its first layer's reload; nothing of A's
    # (tensors_prefetched counts every copy back, on demand or ahead).
    assert s["tensors_fetched"] == 2 and s["reloads_on_demand"] == 1
    assert s["tensors_prefetched"] == 2 and s["bytes_prefetched"] == 2 * one
    assert s["host_in_use_bytes"] == 2 * one  # A's two inputs, still on the host
    ckpt_offload.reset_stats()
    ya.sum().backward()
    s = ckpt_offload.stats()
    assert s["tensors_fetched"] == 2 and s["tensors_prefetched"] == 2 and s["reloads_on_demand"] == 1
    assert s["host_in_use_bytes"] == 0
    ref_w = w.detach().clone().requires_grad_()
    ref = [x.detach().clone().requires_grad_() for x in (xa, xb)]
    for x in reversed(ref):
        torch.tanh((torch.tanh(x @ ref_w) + 1) @ ref_w).sum().backward()
    assert torch.equal(xa.grad, ref[0].grad) and torch.equal(xb.grad, ref[1].grad)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=0, atol=0)


def test_the_drop_in_checkpoint_keeps_one_graph_one_forward_across_ops_and_branches():
    """Branches and ops between checkpoint calls make one forward with one graph: every reload is
    correct. (It does not hold the defect list's row 25: with the reload order assumed to be the reverse of the
    pack order put back, it still passes; benchmarks/results/mutations-2026-12-07/row-25-probe.txt.)"""
    w = torch.randn(32, 32, requires_grad=True)

    def layer(h):
        return torch.tanh(h @ w)

    x = torch.randn(8, 32, requires_grad=True)
    h = ckpt_offload.checkpoint(layer, x * 1)
    h = torch.nn.functional.layer_norm(h + 1, (32,))
    a = ckpt_offload.checkpoint(layer, h)  # two branches of one input
    b = ckpt_offload.checkpoint(layer, h)
    out = ckpt_offload.checkpoint(layer, a + b)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 and s["shared_views"] == 1  # x * 1, h (once for both), a + b
    ckpt_offload.reset_stats()
    out.sum().backward()
    s = ckpt_offload.stats()
    # One forward (a boundary only where the graphs part): every reload after the first is ahead of need.
    assert s["tensors_fetched"] == 3 and s["reloads_on_demand"] == 1, s
    ref_w, ref_x = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    rh = torch.nn.functional.layer_norm(torch.tanh(ref_x @ ref_w) + 1, (32,))
    torch.tanh((torch.tanh(rh @ ref_w) + torch.tanh(rh @ ref_w)) @ ref_w).sum().backward()
    assert torch.equal(x.grad, ref_x.grad) and torch.equal(w.grad, ref_w.grad)


# -- selective offload honours allow_cache_entry_mutation -------------------------------------------
@pytest.mark.skipif(not ckpt_offload.policies.HAS_OFFLOAD_POLICY, reason="this torch has no MUST_CPU_OFFLOAD")
@pytest.mark.parametrize("how", ["torch contexts", "SelectiveOffload"])
def test_allow_cache_entry_mutation_holds_for_offloaded_outputs(how):
    from functools import partial
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from ckpt_offload.policies import SelectiveOffload

    def writes_after(a, b):
        y = torch.sin(a @ b)
        out = y @ b
        y.mul_(2)  # the saved output changes after the policy saved it
        return out

    def marking(mark):
        def policy(ctx, op, *args, **kwargs):
            return mark if op == torch.ops.aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE
        return policy

    def context(mark, allow):
        if how == "SelectiveOffload":
            return SelectiveOffload(marking(mark), allow_cache_entry_mutation=allow)
        return partial(create_selective_checkpoint_contexts, marking(mark), allow_cache_entry_mutation=allow)

    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    # torch with MUST_SAVE and the flag runs; so does the offloaded output with it, and without it neither.
    torch.utils.checkpoint.checkpoint(writes_after, x, w, use_reentrant=False,
                                      context_fn=partial(create_selective_checkpoint_contexts,
                                                         marking(CheckpointPolicy.MUST_SAVE),
                                                         allow_cache_entry_mutation=True)).sum().backward()
    out = ckpt_offload.checkpoint(writes_after, x, w, context_fn=context(CheckpointPolicy.MUST_CPU_OFFLOAD, False))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    del out  # its copies of x and w go: the next call makes its own
    x.grad = w.grad = None
    ckpt_offload.reset_stats()
    out = ckpt_offload.checkpoint(writes_after, x, w, context_fn=context(CheckpointPolicy.MUST_CPU_OFFLOAD, True))
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 and s["bytes_offloaded"] == 3 * 64 * 64 * 4  # x, w and the sin output
    out.sum().backward()
    assert ckpt_offload.stats()["tensors_fetched"] == 3
    # The copy is the value sin returned, before the write.
    rx, rw = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.sin(rx @ rw) @ rw).sum().backward()
    assert torch.equal(x.grad, rx.grad) and torch.equal(w.grad, rw.grad)


# -- weights known by storage identity, not by address -----------------------------------------------
def test_an_activation_at_a_weight_s_former_address_is_still_offloaded():
    """PITFALLS 21: an activation allocated at a freed weight's former address is still offloaded. Fails
    where a reused address is mistaken for a live parameter."""
    # FSDP2 frees an unsharded weight after its module's forward, and the allocator may hand that
    # address to an activation of a later module. Two storages over one buffer stand for it here.
    import numpy as np

    buf = np.random.default_rng(0).standard_normal(32 * 32).astype(np.float32)
    lin = torch.nn.Linear(32, 32, bias=False)
    lin.weight = torch.nn.Parameter(torch.from_numpy(buf).view(32, 32))
    x = torch.randn(8, 32, requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0) as ctx:
        h = lin(x * 1)  # the module runs: its weight's storage is noted
        act = torch.from_numpy(buf).view(32, 32)  # another storage, at the weight's data address
        assert act.data_ptr() == lin.weight.data_ptr()
        assert act.untyped_storage()._cdata != lin.weight.untyped_storage()._cdata
        y = (h @ act).sum()  # act is saved for h's gradient
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 2 and s["bytes_offloaded"] == 8 * 32 * 4 + 32 * 32 * 4  # x * 1 and act
    assert ctx.session._module_ptrs == {}  # nothing kept once the context is over
    y.backward()
    rx, rw = x.detach().clone().requires_grad_(), torch.from_numpy(buf.copy()).view(32, 32).requires_grad_()
    (torch.nn.functional.linear(rx * 1, rw) @ torch.from_numpy(buf.copy()).view(32, 32)).sum().backward()
    assert torch.equal(x.grad, rx.grad) and torch.equal(lin.weight.grad, rw.grad)


# -- nested checkpoints offload only what is reloaded ------------------------------------------------
def _nested_cases():
    ck = ckpt_offload.checkpoint
    w = torch.randn(32, 32, requires_grad=True)

    def layer(h):
        return torch.tanh(h @ w)

    return w, {  # the nested arrangement, and the same computation without checkpoints
        "inner in outer": (lambda x: ck(lambda a: ck(layer, a * 2) + 1, x), lambda x: layer(x * 2) + 1),
        "inner input is the outer's": (lambda x: ck(lambda a: ck(layer, a) + 1, x), lambda x: layer(x) + 1),
        "two inner": (lambda x: ck(lambda a: ck(layer, ck(layer, a * 2)), x), lambda x: layer(layer(x * 2))),
        "three levels": (lambda x: ck(lambda a: ck(lambda b: ck(layer, b * 3), a * 2), x), lambda x: layer(x * 2 * 3)),
        "inner with its own session": (
            lambda x: ck(lambda a: ck(layer, a * 2, session=ckpt_offload.OffloadSession()), x), lambda x: layer(x * 2)),
    }


@pytest.mark.parametrize("case", ["inner in outer", "inner input is the outer's", "two inner", "three levels",
                                  "inner with its own session"])
def test_a_checkpoint_nested_in_another_offloads_only_the_outer_input(case):
    w, cases = _nested_cases()
    nested, reference = cases[case]
    x = torch.randn(8, 32, requires_grad=True)
    out = nested(x * 1)
    s = ckpt_offload.stats()
    # The outer's input alone: what the inner ones save lies in the outer's region (recomputed).
    assert s["tensors_offloaded"] == 1 and s["bytes_offloaded"] == 8 * 32 * 4, s
    out.sum().backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 1 and s["tensors_fetched"] == 1 and s["host_in_use_bytes"] == 0
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    reference(x * 1).sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def test_enable_checkpointing_inside_a_checkpoint_offloads_only_the_outer_input():
    from tiny_gpt import grads, loss_of, make_batch, make_model

    ids = make_batch()
    ref = make_model(layers=4)
    loss_of(ref, ids).backward()
    for keep_last in (0, 2):
        model = make_model(layers=4)
        ckpt_offload.enable_checkpointing(model, offload=True, keep_last=keep_last)
        ckpt_offload.reset_stats()
        scale = torch.ones((), requires_grad=True)
        loss = ckpt_offload.checkpoint(lambda s: loss_of(model, ids) * s, scale * 1)
        assert ckpt_offload.stats()["tensors_offloaded"] == 1  # the outer's input, not the layers'
        loss.backward()
        s = ckpt_offload.stats()
        # The layers' recompute inside the outer's backward is plain checkpointing too.
        assert s["tensors_offloaded"] == s["tensors_fetched"] == 1 and s["host_in_use_bytes"] == 0, s
        g, g_ref = grads(model), grads(ref)
        assert g.keys() == g_ref.keys() and all(torch.equal(g[k], g_ref[k]) for k in g)
