"""offload_activations(layers=..., exclude=...): prefetch counted in layers, and modules whose saved
tensors stay on the device (on the CPU test path)."""
import pytest
import torch

import ckpt_offload

pytestmark = pytest.mark.usefixtures("test_cpu")


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * x)  # saves x, a(x)'s tanh output, and the product


def _model(n=4, width=32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(width) for _ in range(n)), torch.nn.Linear(width, 8)


def _run(blocks, head, x, **ctx):
    with ckpt_offload.offload_activations(min_bytes=0, **ctx):
        h = x * 1
        for blk in blocks:
            h = blk(h)
        loss = head(h * 2).square().sum()  # the head's input is saved by the head only
    return loss


def test_exclude_keeps_the_modules_tensors_on_the_device():
    blocks, head = _model()
    x = torch.randn(4, 32, requires_grad=True)
    _run(blocks, head, x).backward()
    ref = [p.grad.clone() for p in (*blocks.parameters(), *head.parameters())]
    everything = ckpt_offload.stats()["tensors_offloaded"]
    blocks.zero_grad()
    head.zero_grad()
    ckpt_offload.reset_stats()
    _run(blocks, head, x, exclude=[head]).backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == everything - 1  # the head's input (h * 2) stayed
    assert s["host_in_use_bytes"] == 0
    for p, r in zip((*blocks.parameters(), *head.parameters()), ref):
        assert torch.equal(p.grad, r)
    # The hooks are gone with the context: the head alone offloads again.
    ckpt_offload.reset_stats()
    with ckpt_offload.offload_activations(min_bytes=0):
        head(x * 2).sum().backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 1 and not head._forward_pre_hooks


def test_layers_make_prefetch_count_whole_layers():
    blocks, head = _model()
    x = torch.randn(4, 32, requires_grad=True)
    per_layer = []
    handles = [b.register_forward_hook(lambda *_: per_layer.append(ckpt_offload.stats()["tensors_offloaded"]))
               for b in blocks]
    seen = {}

    def at_boundary(grad):  # layer 3's backward is over, layer 2's has not started
        seen["prefetched"] = ckpt_offload.stats()["tensors_prefetched"]

    with ckpt_offload.offload_activations(min_bytes=0, layers=list(blocks), prefetch=2) as ctx:
        assert ctx.session.prefetch_unit == "layer"
        h = x * 1
        for i, blk in enumerate(blocks):
            if i == 3:
                h.register_hook(at_boundary)
            h = blk(h)
        loss = head(h).square().sum()
    for hd in handles:
        hd.remove()
    total = ckpt_offload.stats()["tensors_offloaded"]
    n0 = per_layer[0]
    assert n0 == 3 and total == 4 * 3 + 2  # three a layer, and the head's input and output
    loss.backward()
    # Once backward has reached layer 3's first tensor, two whole layers are on their way (2 and
    # 1), and none of layer 0. tensors_prefetched counts the reloads started, the first included.
    assert seen["prefetched"] == total - n0
    s = ckpt_offload.stats()
    assert s["host_in_use_bytes"] == 0 and s["tensors_fetched"] == s["tensors_offloaded"]


def test_without_layers_prefetch_counts_tensors():
    blocks, head = _model()
    x = torch.randn(4, 32, requires_grad=True)
    seen = {}
    with ckpt_offload.offload_activations(min_bytes=0, prefetch=2) as ctx:
        assert ctx.session.prefetch_unit == "tensor"
        h = x * 1
        for i, blk in enumerate(blocks):
            if i == 3:
                h.register_hook(lambda g: seen.update(prefetched=ckpt_offload.stats()["tensors_prefetched"]))
            h = blk(h)
        loss = head(h).square().sum()
    loss.backward()
    # Layer 3 and the head (5 tensors), and two tensors of layer 2 ahead: not whole layers.
    assert seen["prefetched"] == 5 + 2


def test_layers_and_exclude_argument_errors():
    with pytest.raises(TypeError, match=r"offload_activations: layers must be a list of nn.Module or None, got str"):
        ckpt_offload.offload_activations(layers="model.layers")
    with pytest.raises(TypeError, match=r"offload_activations: exclude\[1\] must be an nn.Module, got int"):
        ckpt_offload.offload_activations(exclude=[torch.nn.Linear(2, 2), 3])
