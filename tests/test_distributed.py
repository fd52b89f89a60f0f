"""DDP and FSDP2 with checkpointing and offload: gradients equal those of the same run without it.

Two processes on one machine over loopback: gloo on the CPU (CKPT_OFFLOAD_TEST_CPU=1 in the
children, so CPU tensors go through the pool and engine), NCCL on two GPUs where there are two.
Each rank trains the same steps with and without offload and writes what it saw to a file; the
parent compares. Everything is time-bound: children that do not finish are killed and the test fails.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import requires_cuda
from procs import free_port, fsdp2_available, join_ranks
from tiny_gpt import loss_of, make_batch, make_model

WORLD = 2
STEPS = 3
TIMEOUT_S = 120  # a run takes about 10 s on two cores; this bounds a hang, not a measurement


# -- in the children ---------------------------------------------------------------------------------
def _train(wrapper, offload, rank, device):
    import ckpt_offload

    model = make_model(seed=0, device=device, hidden=32, layers=4)
    if offload:
        assert ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1) == [0, 1, 2, 3]
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        ckpt_offload.reset_stats()
        opt.zero_grad(set_to_none=True)
        ids = make_batch(seed=100 * step + rank, device=device)  # each rank its own data
        loss = loss_of(run, ids)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if hasattr(g, "to_local"):  # FSDP2: this rank's shard of the gradient
                g = g.to_local()
            grads[name] = g.detach().cpu().clone()
        s = ckpt_offload.stats()
        steps.append(
            {
                "loss": loss.item(),
                "grads": grads,
                "bytes_offloaded": s["bytes_offloaded"],
                "tensors_offloaded": s["tensors_offloaded"],
                "tensors_fetched": s["tensors_fetched"],
                "host_in_use_bytes": s["host_in_use_bytes"],
            }
        )
        opt.step()
    return steps


def _worker(rank, port, wrapper, backend, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",  # loopback only
        NCCL_SOCKET_IFNAME="lo",
        CKPT_OFFLOAD_TEST_CPU="1",  # read when a session is created: before enable_checkpointing
    )
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        result = {offload: _train(wrapper, offload, rank, device) for offload in (False, True)}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


# -- in the parent -----------------------------------------------------------------------------------
def _run_two_ranks(wrapper, backend, tmp_path):
    ctx = mp.start_processes(
        _worker,
        args=(free_port(), wrapper, backend, str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    return join_ranks(ctx, WORLD, tmp_path, TIMEOUT_S, f"{wrapper}/{backend}: the ranks")


def _same(a, b, exact):
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6)


BACKENDS = [
    pytest.param("gloo", id="gloo-cpu"),
    pytest.param(
        "nccl",
        id="nccl-2gpu",
        marks=[
            pytest.mark.gpu,
            requires_cuda,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across two ranks needs two GPUs"),
        ],
    ),
]
WRAPPERS = [
    pytest.param("ddp", id="ddp"),
    pytest.param(
        "fsdp2",
        id="fsdp2",
        marks=pytest.mark.skipif(
            not fsdp2_available(), reason="torch.distributed.fsdp.fully_shard is not importable in this torch"
        ),
    ),
]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_gradients_equal_without_offload(backend, wrapper, tmp_path):
    results = _run_two_ranks(wrapper, backend, tmp_path)
    exact = backend == "gloo"  # CPU kernels are deterministic: the same bits
    for rank, result in enumerate(results):
        plain, offloaded = result[False], result[True]
        assert len(plain) == len(offloaded) == STEPS
        for step, (a, b) in enumerate(zip(plain, offloaded)):
            where = f"{wrapper} rank {rank} step {step}"
            assert a["bytes_offloaded"] == 0, where
            # Blocks 0..2 offloaded (keep_last=1): their inputs, batch 2 x seq 16 x hidden 32 float32.
            assert b["bytes_offloaded"] == 3 * 2 * 16 * 32 * 4, where
            assert b["tensors_fetched"] == b["tensors_offloaded"] == 3, where
            assert b["host_in_use_bytes"] == 0, where
            assert a["loss"] == b["loss"] if exact else abs(a["loss"] - b["loss"]) < 1e-5, where
            assert a["grads"].keys() == b["grads"].keys(), where
            for name in a["grads"]:
                assert _same(a["grads"][name], b["grads"][name], exact), f"{where}: gradient of {name} differs"
    if wrapper == "ddp":
        # The ranks saw different data, and DDP averaged their gradients: both hold the same ones.
        for step in range(STEPS):
            assert results[0][True][step]["loss"] != results[1][True][step]["loss"]
            for name, g in results[0][True][step]["grads"].items():
                assert _same(g, results[1][True][step]["grads"][name], exact), f"ranks differ on {name}"
