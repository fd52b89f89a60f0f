"""Memory that really drops: the peak of a whole training step falls by every offloaded layer input,
measured as live CPU storage bytes on the CPU test path. Gradients stay allocated between steps
(zero_grad(set_to_none=False), as under gradient accumulation), so the peak is the activations'.
On a GPU the same is measured with max_memory_allocated."""
import pytest
import torch

import ckpt_offload
from conftest import requires_cuda
from ckpt_offload.testing import LiveBytes
from tiny_gpt import loss_of, make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu")

L, H, S, B = 6, 64, 128, 2
INPUT_BYTES = B * S * H * 4  # one block input, fp32


def step_peak(model, ids):
    """Peak live bytes of one forward + backward above what exists before it (weights, gradients)."""
    loss_of(model, ids).backward()  # warm-up: gradients allocated, pool filled
    model.zero_grad(set_to_none=False)
    ckpt_offload.reset_stats()
    with LiveBytes() as live:
        live.add([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(), ids])
        base = live.current()
        live.peak = base
        loss_of(model, ids).backward()
    return live.peak - base


def peak_with(prefetch=1, offload=True, from_middle=True):
    torch.manual_seed(0)
    model = make_model(layers=L, hidden=H, heads=4, max_len=S)
    ckpt_offload.enable_checkpointing(model, offload=offload, keep_last=1, prefetch=prefetch)
    if not from_middle:  # what reloading from the start of each layer's backward would cost
        model._ckpt_offload.session.defer_prefetch = False
    return step_peak(model, make_batch(batch=B, seq=S))


def test_offload_lowers_the_step_peak_by_every_offloaded_input():
    full = peak_with(offload=False)
    theoretical = (L - 1) * INPUT_BYTES  # keep_last=1: five of six inputs live on the host
    saving = full - peak_with()
    assert saving >= 0.95 * theoretical, (saving, theoretical)
    assert saving <= theoretical + INPUT_BYTES // 2  # nothing else was moved
    s = ckpt_offload.stats()
    assert s["reloads_on_demand"] == 0 and s["tensors_prefetched"] == L - 1  # and every reload was ahead of need


def test_reloads_started_mid_backward_stay_off_the_layer_peak():
    # From the middle of each backward, the reload in flight adds nothing to the peak; from the
    # start of the backward it would add one input, and each further layer of depth one more.
    theoretical = (L - 1) * INPUT_BYTES
    full = peak_with(offload=False)
    assert full - peak_with(prefetch=1) >= 0.95 * theoretical
    assert full - peak_with(prefetch=1, from_middle=False) == pytest.approx(theoretical - INPUT_BYTES, abs=INPUT_BYTES // 4)
    assert full - peak_with(prefetch=2) == pytest.approx(theoretical - INPUT_BYTES, abs=INPUT_BYTES // 4)


def test_midpoint_is_the_child_halfway_through_the_forward():
    model = make_model(layers=3, hidden=32, heads=4)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    loss_of(model, make_batch()).backward()
    (midpoints,) = [h for h in model._ckpt_offload.handles if isinstance(h, ckpt_offload.midpoints.Midpoints)]
    # Children in forward order: ln1, qkv, proj, dropout (attention branch), ln2, fc1, fc2.
    assert all(midpoints.mid[b] == "dropout" for b in model.blocks)
    ckpt_offload.disable_checkpointing(model)
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in model.blocks)
    assert all(not c._forward_hooks for b in model.blocks for c in b.children())


def test_blocks_without_children_reload_from_the_start_of_their_backward():
    blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
    model = torch.nn.Sequential(*blocks)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    assert model._ckpt_offload.session.defer_prefetch is False
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()
    s = ckpt_offload.stats()
    assert s["tensors_prefetched"] == 3 and s["reloads_on_demand"] == 0


@requires_cuda
@pytest.mark.gpu
def test_offload_lowers_the_cuda_step_peak_by_every_offloaded_input():
    dev = "cuda"
    peaks = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = make_model(layers=L, hidden=256, heads=4, max_len=512, device=dev)
        ckpt_offload.enable_checkpointing(model, offload=offload, keep_last=1)
        ids = make_batch(batch=4, seq=512, device=dev)
        loss_of(model, ids).backward()
        model.zero_grad(set_to_none=False)
        ckpt_offload.synchronize()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_of(model, ids).backward()
        torch.cuda.synchronize()
        peaks[offload] = torch.cuda.max_memory_allocated() - base
        ckpt_offload.disable_checkpointing(model)
    theoretical = (L - 1) * 4 * 512 * 256 * 4
    assert peaks[False] - peaks[True] >= 0.95 * theoretical, (peaks, theoretical)


@requires_cuda
@pytest.mark.gpu
def test_sources_return_to_the_allocator_while_the_gpu_is_still_behind():
    # The host finishes the forward long before the GPU (kept busy by a sleep kernel) has run a
    # single copy. The offloaded inputs must still leave the allocator's books at once, handed back
    # in stream order, or the saving would appear only when the GPU catches up: a run-ahead host
    # would see no saving at the peak. Gradients stay bitwise those of plain checkpointing.
    dev = "cuda"
    held, grads = {}, {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = make_model(layers=L, hidden=256, heads=4, max_len=512, device=dev)
        ckpt_offload.enable_checkpointing(model, offload=offload, keep_last=1)
        ids = make_batch(batch=4, seq=512, device=dev)
        loss_of(model, ids).backward()  # warm-up: pool filled, gradients allocated
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of everything below
        loss = loss_of(model, ids)
        held[offload] = torch.cuda.memory_allocated() - before
        if offload:
            assert ckpt_offload.stats()["pending_sources"] == 0
        loss.backward()
        torch.cuda.synchronize()
        grads[offload] = [p.grad.clone() for p in model.parameters()]
        ckpt_offload.disable_checkpointing(model)
    theoretical = (L - 1) * 4 * 512 * 256 * 4
    assert held[False] - held[True] >= 0.95 * theoretical, (held, theoretical)
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


class _Rotary(torch.nn.Module):
    def forward(self, x):
        return torch.arange(x.shape[-1], dtype=x.dtype)  # a table: no gradient flows through it


class _Aux(torch.nn.Module):
    def forward(self, x):
        return x.mean()  # needs grad, but the loss never uses it


class _Block(torch.nn.Module):
    def __init__(self, h, middle):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.middle = middle
        self.attn = torch.nn.Linear(h, h)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h))

    def forward(self, x):
        y = self.norm(x)
        table = self.middle(y)
        if table.dim() == 1:
            y = y + 0 * table  # used, but carries no gradient back
        x = x + self.attn(y)
        return x + self.mlp(x)


def _stack(middle_cls, n=6, h=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block(h, middle_cls()) for _ in range(n)))


def test_midpoint_skips_children_without_a_gradient():
    model = _stack(_Rotary)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    x = torch.randn(4, 8, 32)
    for _ in range(2):
        ckpt_offload.reset_stats()
        model(x).square().mean().backward()
        assert ckpt_offload.stats()["reloads_on_demand"] == 0
    (midpoints,) = [h for h in model._ckpt_offload.handles if isinstance(h, ckpt_offload.midpoints.Midpoints)]
    # Forward order norm, middle, attn, mlp: the middle carries no gradient; attn is as near the halfway point.
    assert all(midpoints.mid[b] == "attn" for b in model)


def test_a_midpoint_that_never_fires_falls_back_to_reloading_from_the_start():
    model = _stack(_Aux)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    session = model._ckpt_offload.session
    x = torch.randn(4, 8, 32)
    ref = _stack(_Aux)
    grads = []
    for m in (model, ref):
        m(x).square().mean().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert session.midpoint_misses == 1 and session.defer_prefetch is False
    assert ckpt_offload.stats()["midpoint_misses"] == 1
    ckpt_offload.reset_stats()
    model(x).square().mean().backward()
    assert ckpt_offload.stats()["reloads_on_demand"] == 0


def test_a_backward_that_stops_partway_leaves_no_false_miss():
    model = make_model(layers=L, hidden=32, heads=4)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    session = model._ckpt_offload.session
    ids = make_batch()
    loss_of(model, ids).backward()
    # A gradient with respect to a tensor inside block 3, ahead of its midpoint: that backward
    # reaches block 3's reload point but never its midpoint, and leaves a reload point behind.
    captured = []
    hook = model.blocks[3].proj.register_forward_hook(lambda m, a, out: captured.append(out))
    loss = loss_of(model, ids)
    hook.remove()
    torch.autograd.grad(loss, captured[0])
    assert session._core.pending() is not None
    ckpt_offload.reset_stats()
    loss_of(model, ids).backward()  # a new backward: the point left behind is stale, not a miss
    assert session.midpoint_misses == 0 and session.defer_prefetch is True
    assert ckpt_offload.stats()["reloads_on_demand"] == 0


class _ScaledBlock(_Block):
    def __init__(self, h):
        super().__init__(h, torch.nn.Identity())

    def forward(self, x, scale):
        return super().forward(x * scale)


class _ScaledStack(torch.nn.Module):
    """Each block also receives a weight of the model positionally: saved, but never offloaded."""

    def __init__(self, n=5, h=32):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(h))
        self.blocks = torch.nn.ModuleList(_ScaledBlock(h) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.scale)
        return x


def test_tensors_a_layer_saves_but_does_not_offload_do_not_count_as_missed_midpoints():
    torch.manual_seed(0)
    model = _ScaledStack()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    session = model._ckpt_offload.session
    x = torch.randn(4, 8, 32)
    for _ in range(2):
        ckpt_offload.reset_stats()
        model(x).square().mean().backward()
    s = ckpt_offload.stats()
    assert session.midpoint_misses == 0 and session.defer_prefetch is True
    assert s["reloads_on_demand"] == 0 and s["tensors_offloaded"] == 4


def test_a_first_forward_that_raises_inside_a_block_leaks_nothing():
    # Before the midpoints are known, the first forward notes each child's autograd node; an
    # exception inside a block (an out-of-memory, say) must not leave them holding the graph.
    import gc

    model = make_model(layers=L, hidden=64, heads=4, max_len=S)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    ids = make_batch(batch=B, seq=S)

    def boom(module, args, out):
        raise MemoryError("simulated")

    hook = model.blocks[4].fc1.register_forward_hook(boom)
    with pytest.raises(MemoryError):
        loss_of(model, ids)
    hook.remove()
    gc.collect()
    assert ckpt_offload.stats()["host_in_use_bytes"] == 0
    ckpt_offload.reset_stats()
    loss_of(model, ids).backward()  # and the next step learns the midpoints as usual
    loss_of(model, ids).backward()
    s = ckpt_offload.stats()
    assert s["reloads_on_demand"] == 0 and s["midpoint_misses"] == 0 and s["host_in_use_bytes"] == 0


def test_live_bytes_counts_a_storage_out_the_moment_it_is_freed():
    # Not at the next op: the count is right between ops too. A storage that a view or autograd's
    # saved tensors still hold stays counted; the graph's end frees it.
    with LiveBytes() as live:
        w = torch.randn(256, requires_grad=True)  # 1 KiB
        base = live.now
        y = w * 2  # 1 KiB, which sin saves for its backward
        z = y.sin()  # 1 KiB
        v = y[128:]
        assert live.now == base + 2048
        del y
        assert live.now == base + 2048  # the view and the saved tensor hold it
        del v
        assert live.now == base + 2048  # the saved tensor holds it
        del z  # the graph goes, and y's storage with it
        assert live.now == base
        assert live.peak == base + 2048
