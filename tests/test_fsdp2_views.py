"""FSDP2 and offload_activations: the views of unsharded parameters that the forward saves (F.linear
saves weight.t()) are never offloaded, since FSDP2 frees their storage after the forward; gradients
equal those of the same FSDP2 run without offload. Likewise a DTensor parameter's local view
(to_local()). One gloo process, in a child interpreter."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import os, tempfile, torch, torch.distributed as dist
import ckpt_offload
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))

def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(3)])
    for block in model:  # the Linear itself is the FSDP unit: its unsharded weight is registered
        fully_shard(block[0], mesh=mesh, reshard_after_forward=True)  # after the module hooks ran
    fully_shard(model, mesh=mesh)
    return model

x = torch.randn(16, 32)
ref = build()
ref(x).square().sum().backward()

model = build()
views, others = [], {}
def spy(t):
    if type(t) is torch.Tensor:
        if isinstance(t._base, torch.nn.Parameter):
            views.append(t)
        else:  # a tensor saved twice (tanh's output, the next Linear's input) moves once
            others[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
    return t
with torch.autograd.graph.saved_tensors_hooks(spy, lambda t: t):
    model(x)  # what this forward saves, seen as offload_activations sees it
ckpt_offload.reset_stats()
with ckpt_offload.offload_activations(min_bytes=0):
    loss = model(x).square().sum()
s = ckpt_offload.stats()
loss.backward()
same = all(torch.equal(a.grad.full_tensor(), b.grad.full_tensor()) for a, b in zip(ref.parameters(), model.parameters()))
print(len(views), len(others), sum(others.values()), s["tensors_offloaded"], s["bytes_offloaded"], same)

# A DTensor parameter used through to_local(): F.linear saves that plain view of the local tensor.
from torch.distributed.tensor import Replicate, distribute_tensor

class LocalLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(distribute_tensor(torch.randn(32, 32), mesh, [Replicate()]))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to_local())

layer = LocalLinear()
inp = torch.randn(16, 32, requires_grad=True)
ckpt_offload.reset_stats()
with ckpt_offload.offload_activations(min_bytes=0):
    h = inp * 2  # an activation, offloaded
    out = layer(h)
s = ckpt_offload.stats()
out.sum().backward()
print(s["tensors_offloaded"], s["bytes_offloaded"], h.numel() * 4)
dist.destroy_process_group()
'''


@pytest.mark.skipif(sys.platform != "linux", reason="gloo file store in a child interpreter: Linux only here")
def test_fsdp2_parameter_views_are_not_offloaded():
    pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")
    env = dict(os.environ, PYTHONPATH=ROOT, CKPT_OFFLOAD_TEST_CPU="1")
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    views, others, other_bytes, offloaded, offloaded_bytes, same, *local = p.stdout.split()[-9:]
    # The case occurs: the Linears after the first (whose input needs no gradient) saved a view of
    # their unsharded weight, which the session could not know by storage.
    assert int(views) == 2
    # Offloaded: exactly the other saved tensors (inputs and activations), none of the views.
    assert (int(offloaded), int(offloaded_bytes)) == (int(others), int(other_bytes))
    assert same == "True"
    # The DTensor parameter's local view stays too: only the activation moved.
    local_offloaded, local_bytes, activation_bytes = map(int, local)
    assert (local_offloaded, local_bytes) == (1, activation_bytes)
