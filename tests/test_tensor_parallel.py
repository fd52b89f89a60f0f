"""Tensor and sequence parallelism with checkpointing and offload: a tiny Llama (transformers, built
from its config) parallelised as torchtitan composes it, trained with transformers' own
checkpointing and with ckpt_offload's, on gloo processes on the CPU (CKPT_OFFLOAD_TEST_CPU=1).

- "colwise": ColwiseParallel / RowwiseParallel on attention and MLP; the layers' inputs are plain.
- "sequence": the same with SequenceParallel norms, the embedding's output and the o_proj / down_proj
  outputs DTensors sharded on the sequence: every layer's input is a DTensor (its local shard is
  what goes to the host).
- "fsdp2_tp": "sequence" on the tp dimension of a 2 x 2 mesh, then fully_shard over dp (4 processes).

Each world starts once and runs all its cases; each rank writes what it saw, the parent compares:
losses and gradients (each rank's shards) bitwise equal, the offloaded tensors counted exactly.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from procs import free_port, fsdp2_available, join_ranks

pytestmark = [
    pytest.mark.tensor_parallel,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build"),
]
transformers = pytest.importorskip("transformers", reason="the tests build a tiny Llama with transformers")

LAYERS, KEEP_LAST = 4, 1
B, S, H = 2, 16, 32
STEPS = 2
TIMEOUT_S = 240  # bounds a hang; a world takes well under a minute on two busy cores


# -- in the children ---------------------------------------------------------------------------------
def _tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


def _parallelize(model, tp, sequence):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if sequence:
        parallelize_module(model, tp, {
            # The residual stream stays a DTensor sharded on the sequence (use_local_output=False).
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    for layer in model.model.layers:
        plan = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "mlp.gate_proj", "mlp.up_proj")}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        if sequence:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                # transformers' layers call attention with keywords, the MLP positionally.
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            })
        parallelize_module(layer, tp, plan)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _train(case, ours, meshes, data_rank):
    import ckpt_offload
    from ckpt_offload.integrations import hf

    model = _tiny_llama()
    _parallelize(model, meshes["tp"], sequence=case != "colwise")
    if ours:
        assert hf.enable(model, offload=True, keep_last=KEEP_LAST) == list(range(LAYERS))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case == "fsdp2_tp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=meshes["dp"])
        fully_shard(model, mesh=meshes["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        ckpt_offload.reset_stats()
        opt.zero_grad(set_to_none=True)
        # The ranks of one tensor-parallel group share their batch; data-parallel ranks have their own.
        ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(100 * step + data_rank))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        s = ckpt_offload.stats()
        state = ckpt_offload.checkpointing_state(model)
        steps.append({
            "loss": _local(loss).item(),
            "grads": {n: _local(p.grad).detach().clone() for n, p in model.named_parameters()},
            "stats": {k: s[k] for k in ("tensors_offloaded", "tensors_fetched", "bytes_offloaded",
                                        "subclass_tensors_kept", "host_in_use_bytes")},
            "offloaded_layers": None if state is None else state[1],
        })
        opt.step()
    return steps


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      CKPT_OFFLOAD_TEST_CPU="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        if world == 2:
            meshes = {"tp": init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))}
            cases, data_rank = ("colwise", "sequence"), 0
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            meshes = {"tp": mesh["tp"], "dp": mesh["dp"]}
            cases, data_rank = ("fsdp2_tp",), mesh["dp"].get_local_rank()
        result = {case: {ours: _train(case, ours, meshes, data_rank) for ours in (False, True)} for case in cases}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    # The results are written: leave without the interpreter's teardown of torch, transformers and
    # DTensor, which takes 10 s and more a process on two busy cores. (A rank that raised left above.)
    os._exit(0)


# -- in the parent -----------------------------------------------------------------------------------
def _run(world, tmp_path):
    ctx = mp.start_processes(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=False,
                             start_method="spawn")
    return join_ranks(ctx, world, tmp_path, TIMEOUT_S, f"{world} tensor-parallel ranks")


def _check(results, case, local_seq):
    """Bitwise equal to transformers' own checkpointing; the first LAYERS - KEEP_LAST layers' inputs
    (B x local_seq x H float32 each: the rank's shard) offloaded and fetched on every rank."""
    offloaded = LAYERS - KEEP_LAST
    for rank, result in enumerate(results):
        plain, ours = result[case][False], result[case][True]
        for step, (a, b) in enumerate(zip(plain, ours)):
            where = f"{case} rank {rank} step {step}"
            assert a["stats"]["tensors_offloaded"] == 0, where
            assert b["stats"] == {"tensors_offloaded": offloaded, "tensors_fetched": offloaded,
                                  "bytes_offloaded": offloaded * B * local_seq * H * 4,
                                  "subclass_tensors_kept": 0, "host_in_use_bytes": 0}, where
            assert b["offloaded_layers"] == list(range(offloaded)), where
            assert a["loss"] == b["loss"], where
            assert a["grads"].keys() == b["grads"].keys(), where
            for name, g in a["grads"].items():
                assert torch.equal(g, b["grads"][name]), f"{where}: gradient of {name} differs"


def test_tp_and_sequence_parallel(tmp_path):
    results = _run(2, tmp_path)
    _check(results, "colwise", S)
    _check(results, "sequence", S // 2)  # the layers' inputs are DTensors sharded on the sequence


@pytest.mark.skipif(not fsdp2_available(), reason="torch.distributed.fsdp.fully_shard is not importable in this torch")
def test_fsdp2_times_tp(tmp_path):
    results = _run(4, tmp_path)
    _check(results, "fsdp2_tp", S // 2)
    # The two data-parallel groups saw different batches.
    assert results[0]["fsdp2_tp"][True][0]["loss"] != results[2]["fsdp2_tp"][True][0]["loss"]
