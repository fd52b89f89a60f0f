"""What a session offloads and prefetches across graphs: views of parameters stay where they are
(FSDP2 frees the unsharded storage after the forward), and a backward prefetches only the records
of its own forward, never those of another graph kept alive."""
import pytest
import torch
import torch.nn.functional as F

import ckpt_offload
from tiny_gpt import grads, loss_of, make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu")


def test_a_view_of_a_parameter_is_never_offloaded():
    # FSDP2 registers its unsharded parameters after the module hooks have run, so the session
    # cannot know them by storage; F.linear saves weight.t(), a view whose base is the parameter.
    weight = torch.nn.Parameter(torch.randn(64, 64))  # held by no module the session sees
    inp = torch.randn(32, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        F.linear(inp * 2, weight)
    assert any(t._base is weight for t in saved)  # the case this test is about does occur
    ckpt_offload.reset_stats()
    with ckpt_offload.offload_activations(min_bytes=0):
        x = inp * 2
        y = F.linear(x, weight)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 1 and s["bytes_offloaded"] == x.numel() * 4  # x alone
    # What FSDP2 does between forward and backward: free the unsharded storage, then refill it.
    data = weight.detach().clone()
    weight.untyped_storage().resize_(0)
    weight.untyped_storage().resize_(data.numel() * 4)
    weight.data.copy_(data)  # FSDP2's all-gather writes the storage without a version bump
    y.square().sum().backward()
    ref_inp = inp.detach().clone().requires_grad_()
    ref_w = data.clone().requires_grad_()
    F.linear(ref_inp * 2, ref_w).square().sum().backward()
    assert torch.equal(inp.grad, ref_inp.grad) and torch.equal(weight.grad, ref_w.grad)


def test_views_of_ordinary_activations_are_still_offloaded():
    with ckpt_offload.offload_activations(min_bytes=0):
        x = torch.randn(32, 64, requires_grad=True) * 2
        y = (x[:, :32] * x[:, 32:]).sum()
    assert ckpt_offload.stats()["tensors_offloaded"] >= 1
    y.backward()


def _records(session):
    """The live records (each holds its host copy while Python holds it)."""
    return session._core.live_records()


@pytest.mark.parametrize("from_middle", [True, False])
def test_backward_prefetches_nothing_of_another_graph_kept_alive(from_middle):
    model = make_model(layers=6, hidden=32, heads=4, max_len=64)
    ref = make_model(layers=6, hidden=32, heads=4, max_len=64)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1, prefetch=2)
    session = model._ckpt_offload.session
    if not from_middle:
        session.defer_prefetch = False
    ids_a, ids_b = make_batch(seed=1, seq=48), make_batch(seed=2, seq=40)

    loss_a = loss_of(model, ids_a)  # graph A: kept alive, no backward yet
    records_a = _records(session)
    assert len(records_a) == 5  # six blocks, the last kept on the device
    ckpt_offload.reset_stats()
    loss_b = loss_of(model, ids_b)
    records_b = [r for r in _records(session) if all(r is not a for a in records_a)]
    bytes_b = ckpt_offload.stats()["bytes_offloaded"]
    assert len(records_b) == 5 and bytes_b == 5 * 2 * 40 * 32 * 4

    loss_b.backward()
    s = ckpt_offload.stats()
    assert not any(r.prefetched for r in records_a)  # A stays on the host, untouched
    assert all(r.handle is not None for r in records_a)
    assert s["bytes_prefetched"] == bytes_b and s["tensors_prefetched"] == 5  # all of B, nothing else
    assert s["reloads_on_demand"] == 0

    loss_a.backward()  # A's own backward still prefetches its layers
    s = ckpt_offload.stats()
    assert s["tensors_prefetched"] == 10 and s["reloads_on_demand"] == 0
    del records_a, records_b  # a record holds its host copy (a retained graph reloads it) until it dies
    assert ckpt_offload.stats()["host_in_use_bytes"] == 0
    # Gradients: both micro-batches accumulated, as without offload.
    loss_of(ref, ids_a).backward()
    loss_of(ref, ids_b).backward()
    g_ref, g = grads(ref), grads(model)
    assert all(torch.allclose(g_ref[n], g[n], rtol=0, atol=1e-6) for n in g_ref)
    ckpt_offload.disable_checkpointing(model)


def test_a_reused_offload_activations_context_prefetches_within_each_forward():
    ctx = ckpt_offload.offload_activations(min_bytes=0, prefetch=64)
    lin = torch.nn.Linear(16, 16)
    inp = torch.randn(8, 16, requires_grad=True)
    with ctx:
        y_a = torch.tanh(lin(inp * 2)).sum()
    records_a = _records(ctx.session)
    with ctx:  # the same session, a second forward
        y_b = torch.tanh(lin(inp * 3)).sum()
    assert records_a
    y_b.backward()
    assert not any(r.prefetched for r in records_a)
    y_a.backward()
    del records_a
    assert ckpt_offload.stats()["host_in_use_bytes"] == 0


def test_a_forward_dropped_without_backward_frees_its_graph_and_host_blocks():
    # Tanh saves its own output, which stays on the device (below min_bytes): held with its grad_fn,
    # the pack would close a cycle node -> pack -> tensor -> node that no collector sees, and every
    # forward dropped without a backward (a skipped step) would keep its graph and host blocks.
    import gc

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8),
                                                      torch.nn.Tanh(), torch.nn.Linear(8, 64)) for _ in range(4)])
    ckpt_offload.reset_stats()
    for _ in range(3):
        x = torch.randn(128, 64)
        with ckpt_offload.offload_activations(min_bytes=16 << 10):  # the 128x64 activations go, 128x8 stay
            y = model(x).sum()
        assert ckpt_offload.stats()["tensors_offloaded"] > 0 and ckpt_offload.stats()["host_in_use_bytes"] > 0
        del y
        gc.collect()
        assert ckpt_offload.stats()["host_in_use_bytes"] == 0  # the graph is gone, and its host copies with it
    # And with a backward the same gradients as without the context.
    ref = [p.grad for p in model.parameters()]
    assert all(g is None for g in ref)
    x = torch.randn(128, 64)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with ckpt_offload.offload_activations(min_bytes=16 << 10):
        y = model(x).sum()
    y.backward()
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)
