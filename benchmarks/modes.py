"""The checkpointing modes of the decoder stack: how each is switched on and off on one model, and
which modes must give the same gradients bit for bit.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint as tuc

import ckpt_offload

from .disk_mode import DISK_MODE, DiskSteps


MODES = ["none", "full", "every2", "every4", "sync_offload", "async_offload", "every2_async", "offload_activations",
         "attn_offload"]
# Opt-in modes, not in the default list: disk_offload writes files (bench_step --disk [DIR]).
EXTRA_MODES = [DISK_MODE]
# Modes timed on their own after the round-robin: disk_offload's cap returns the pool's free blocks down
# to it, so the next step of any other offload mode would pin them again (host allocations in its timed
# steps, about half a second per GiB on a GPU) if the modes took turns.
TIMED_APART = [DISK_MODE]


# Modes whose gradients must equal another mode's bit for bit (same kernels, values only moved;
# attn_offload: the attention outputs of the forward instead of recomputed ones, the same bits).
BITWISE = {"sync_offload": "full", "async_offload": "full", "every2_async": "every2", "offload_activations": "none",
           "attn_offload": "full", DISK_MODE: "full"}
MODE_HELP = {
    "none": "no checkpointing",
    "full": "every block checkpointed",
    "every2": "blocks 0, 2, 4, ... checkpointed",
    "every4": "blocks 0, 4, 8, ... checkpointed",
    "sync_offload": "full checkpointing, inputs through torch's save_on_cpu (what transformers' offload=True does)",
    "async_offload": "full checkpointing, inputs offloaded by ckpt_offload",
    "every2_async": "every2, inputs offloaded by ckpt_offload",
    "offload_activations": "no checkpointing, every saved activation offloaded (ckpt_offload.offload_activations)",
    "attn_offload": "full checkpointing, inputs and attention outputs offloaded (policy=\"attention\"): "
                    "attention is not recomputed",
    DISK_MODE: "async_offload with the host pool capped at half of what the step offloads and a disk tier "
               "(host_pool().set_spill_dir) in --disk DIR: about half of the offloaded bytes go to files; opt-in",
}


def sync_offload_call(block, x):
    """What transformers 5.x does for activation_checkpointing_enable(offload=True) (formerly
    gradient_checkpointing_enable), per layer."""
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return tuc.checkpoint(block, x, use_reentrant=False)


def apply_mode(model, mode, a):
    """Puts the model in `mode`; returns a factory of the context each forward runs in."""
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    every = {"full": 1, "every2": 2, "every4": 4, "async_offload": 1, "every2_async": 2, "attn_offload": 1,
             DISK_MODE: 1}.get(mode)
    if every is not None:
        # attn_offload: every block checkpointed with its input and its attention outputs offloaded.
        attn = mode == "attn_offload"
        ckpt_offload.enable_checkpointing(model, every_n_layers=every,
                                          offload="async" in mode or attn or mode == DISK_MODE,
                                          keep_last=a.keep_last, prefetch=a.prefetch, layers=list(model.layers),
                                          policy="attention" if attn else None)
    elif mode == "sync_offload":
        model.layer_call = sync_offload_call
    elif mode == "offload_activations":
        return lambda: ckpt_offload.offload_activations(min_bytes=a.min_bytes)
    elif mode == "planned":  # --budget: the plan run_main made for this length
        a.plan.apply(model)
    if mode == DISK_MODE:  # the cap disk_mode.plan_disk measured for this length, the tier in --disk DIR
        return DiskSteps(model, a.disk, a.disk_probe)
    return contextlib.nullcontext


def offloaded_layers(model, mode):
    if mode == "sync_offload":
        return len(model.layers)
    state = ckpt_offload.checkpointing_state(model)
    return 0 if state is None else len(state[1])


def restored_exactly(model) -> bool:
    """disable_checkpointing left no state behind: every block has its own class and no settings of ours."""
    from ckpt_offload.attachment import SLOT, base_class

    return ckpt_offload.checkpointing_state(model) is None and all(
        type(b) is base_class(type(b)) and SLOT not in b.__dict__ for b in model.layers)


def attn_supported():
    """Whether this torch can run attn_offload (selective offload policies)."""
    return ckpt_offload.policies.HAS_OFFLOAD_POLICY


def compile_blocks(model, backend):
    """--compile: every block compiled on its own (block.compile()), in every mode."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in model.layers:
        block.compile(backend=backend)


def compile_counts():
    """(unique graphs, graph breaks) torch.compile has made since the last reset."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
