"""accelerate's FSDP2 activation_checkpointing_offload=True through the engine (integrations.accelerate).

Ranks on one machine over loopback gloo, CKPT_OFFLOAD_TEST_CPU=1 in the children. accelerate turns
FSDP on only for accelerator devices, so on the CPU each child sets the state's distributed_type to
FSDP after Accelerator(); the rest is accelerate's own Accelerator.prepare (fsdp2_apply_ac, then
fully_shard per decoder layer). Each rank trains the same steps with accelerate's own offload
(offload_wrapper(checkpoint_wrapper(layer)), save_on_cpu) and with ours; the parent compares.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from procs import free_port, fsdp2_available, join_ranks

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import ckpt_offload  # noqa: E402
from ckpt_offload.integrations import accelerate as cacc  # noqa: E402

STEPS = 3
LAYERS, BATCH, SEQ, HIDDEN = 3, 2, 16, 32
TIMEOUT_S = 180  # bounds a hang, not a measurement

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and fsdp2_available()), reason="needs torch.distributed with fully_shard (FSDP2)"
)


# -- in the children ---------------------------------------------------------------------------------
def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _full(grad):
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()  # a DTensor shard: all of it


def _train(ours, rank):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state()
    if ours:
        cacc.install(keep_last=1, prefetch=1)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True,
                                            activation_checkpointing_offload=True,
                                            auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP  # see the module docstring
    accelerator.state.fsdp_plugin = plugin
    model = _tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    layers = list(model.model.layers)
    record = {
        "layer_types": [type(m).__name__ for m in layers],
        "state": ckpt_offload.checkpointing_state(model),
        "steps": [],
    }
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=gen)
        ckpt_offload.reset_stats()
        loss = model(input_ids=ids, labels=ids).loss
        after_forward = ckpt_offload.stats()
        accelerator.backward(loss)
        s = ckpt_offload.stats()
        # Names without the wrappers' "_checkpoint_wrapped_module." parts: the same parameter either way.
        grads = {n.replace("_checkpoint_wrapped_module.", ""): _full(p.grad) for n, p in model.named_parameters()}
        record["steps"].append({
            "loss": loss.item(), "grads": grads, "offloaded_after_forward": after_forward["bytes_offloaded"],
            "host_in_use_after_forward": after_forward["host_in_use_bytes"],
            **{k: s[k] for k in ("tensors_offloaded", "bytes_offloaded", "tensors_fetched", "host_in_use_bytes",
                                 "host_alloc_calls", "tensors_prefetched")},
        })
        opt.step()
        opt.zero_grad()
    cacc.uninstall()
    return record


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      CKPT_OFFLOAD_TEST_CPU="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = {ours: _train(ours, rank) for ours in (False, True)}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


# -- in the parent -----------------------------------------------------------------------------------
def _run(world, tmp_path):
    ctx = mp.start_processes(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=False,
                             start_method="spawn")
    return join_ranks(ctx, world, tmp_path, TIMEOUT_S, f"the {world} ranks")


@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "two-ranks"])
def test_fsdp2_activation_checkpointing_offload_through_the_engine(world, tmp_path):
    for rank, result in enumerate(_run(world, tmp_path)):
        own, ours = result[False], result[True]
        assert own["layer_types"] == ["OffloadWrapper"] * LAYERS  # accelerate's own path, really taken
        assert own["state"] is None
        assert ours["layer_types"] == ["FSDPLlamaDecoderLayer"] * LAYERS  # sharded in place, no wrapper
        assert ours["state"] == ([0, 1, 2], [0, 1])  # every layer checkpointed; the last kept on the device
        layer_input = BATCH * SEQ * HIDDEN * 4
        for step, (a, b) in enumerate(zip(own["steps"], ours["steps"])):
            where = f"rank {rank} of {world}, step {step}"
            assert a["bytes_offloaded"] == 0, where  # save_on_cpu does not use the engine
            # The inputs of layers 0 and 1 went to the pool during forward and came back in backward.
            assert b["offloaded_after_forward"] == b["host_in_use_after_forward"] == 2 * layer_input, where
            assert b["tensors_offloaded"] == b["tensors_fetched"] == 2, where
            assert b["tensors_prefetched"] >= 1, where  # layer 0's input was on its way before needed
            assert b["host_in_use_bytes"] == 0, where
            assert b["host_alloc_calls"] == (2 if step == 0 else 0), where  # same shapes: the pool's blocks again
            # CPU kernels are deterministic and a checkpoint recomputes the same ops: the same bits.
            assert a["loss"] == b["loss"], where
            assert a["grads"].keys() == b["grads"].keys(), where
            for name, g in a["grads"].items():
                assert torch.equal(g, b["grads"][name]), f"{where}: gradient of {name} differs"


def test_install_patches_every_accelerate_reference_and_uninstall_restores_them():
    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.fsdp_utils

    holders = (accelerate.accelerator, accelerate.utils, accelerate.utils.fsdp_utils)
    original = accelerate.utils.fsdp_utils.fsdp2_apply_ac
    assert all(m.fsdp2_apply_ac is original for m in holders)
    cacc.install()
    assert cacc.installed()
    routed = accelerate.accelerator.fsdp2_apply_ac
    assert routed is not original and all(m.fsdp2_apply_ac is routed for m in holders)
    cacc.uninstall()
    assert not cacc.installed() and all(m.fsdp2_apply_ac is original for m in holders)
    cacc.uninstall()  # a second call does nothing
    assert all(m.fsdp2_apply_ac is original for m in holders)


def test_wrapped_layers_are_the_policys_outermost_matches():
    from accelerate import FullyShardedDataParallelPlugin

    model = _tiny_llama()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    plugin.set_auto_wrap_policy(model)
    assert cacc.wrapped_layers(plugin, model) == list(model.model.layers)
    # A size policy matches a layer and modules inside it: only the layer is checkpointed.
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=4000)
    plugin.set_auto_wrap_policy(model)
    layers = cacc.wrapped_layers(plugin, model)
    assert layers and all(not any(a is not b and b in a.modules() for b in layers) for a in layers)


def test_install_argument_errors():
    with pytest.raises(ValueError, match=r"accelerate.install: keep_last must be an int >= 0, got -1"):
        cacc.install(keep_last=-1)
    with pytest.raises(TypeError, match=r"accelerate.install: prefetch_bytes must be an int >= 1"):
        cacc.install(prefetch_bytes=1.5)
    assert not cacc.installed()
