"""`budget="auto"`: the device and host budgets of a training step, read off this device and node.

The device half is what the step may reach at its peak (the figure `plan_memory` plans for): the
memory torch holds now plus what the device has free (the driver's free bytes and what torch's
allocator holds but does not use), less a margin, less the optimizer's states that are not yet
allocated (AdamW allocates its two states at the first `step()`; a plan made without them would
overshoot there).

The host half is this rank's share of the node's available memory (`hostmem.host_share_bytes`:
the cgroup's limit honoured, divided among `LOCAL_WORLD_SIZE` ranks), times a fraction. The host
pool's capacity is set to it; what would go past it spills to the disk tier when one is set, else
stays on the device, with one warning.

Under Windows' WDDM driver model (`hostmem.is_wddm`), pinned host memory counts against the GPU's
own memory: the bytes the host pool has pinned are taken from the device half too.

On the CPU test path, `CKPT_OFFLOAD_TEST_DEVICE_BYTES=N` stands in for the device's free memory.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from . import hostmem

AUTO = "auto"
# The device margin: the larger of this part of the device's memory and MARGIN_MIN_BYTES (on a real
# device; the CPU stand-in has no floor, its figures being test-sized).
MARGIN_FRACTION = 0.05
MARGIN_MIN_BYTES = 1 << 30
# The part of the node's available host memory its ranks may pin together.
HOST_FRACTION = 0.5
TEST_DEVICE_ENV = "CKPT_OFFLOAD_TEST_DEVICE_BYTES"

log = logging.getLogger("ckpt_offload")


def is_auto(value) -> bool:
    return isinstance(value, str) and value == AUTO


@dataclass
class AutoBudget:
    """What `budget="auto"` chose, and from what.

    Attributes:
        device_bytes: the peak the step may reach (plan_memory's budget_bytes).
        host_bytes: this rank's host budget (the pool's capacity), or None where the node's
            available memory cannot be read.
        allocated_bytes: what the device held at planning time (the model, mostly).
        free_bytes: what it had free then.
        margin_bytes: what was left unplanned.
        optimizer_bytes: the optimizer states counted before they exist.
        step_bytes: what the optimizer's step needs beyond what the device holds now: gradients
            and states still to come, and the temporaries of its step (checked to fit, not taken
            from the activations' budget: the step runs after they are freed).
        local_world_size: the ranks that share this node's host memory.
        source: where the free figure came from (`"cuda"` or the stand-in's variable).
        pinned_bytes: the host pool's pinned bytes taken from the device half (WDDM counts them
            against the GPU's memory); 0 elsewhere.
        wddm: whether the device runs under WDDM (Windows).
    """

    device_bytes: int
    host_bytes: int | None
    allocated_bytes: int
    free_bytes: int
    margin_bytes: int
    optimizer_bytes: int
    step_bytes: int
    local_world_size: int
    source: str
    pinned_bytes: int = 0
    wddm: bool = False

    def describe(self) -> str:
        gib = 2**30
        host = "unknown (the node's available memory could not be read)" if self.host_bytes is None else (
            f"{self.host_bytes / gib:.3f} GiB a rank ({self.local_world_size} rank(s) on this node, "
            f"{HOST_FRACTION:.0%} of the available memory)")
        return (f"budget='auto': device {self.device_bytes / gib:.3f} GiB = held {self.allocated_bytes / gib:.3f} + free "
                f"{self.free_bytes / gib:.3f} ({self.source}) - margin {self.margin_bytes / gib:.3f} - optimizer states "
                f"not yet allocated {self.optimizer_bytes / gib:.3f}"
                + (f" - pinned host memory {self.pinned_bytes / gib:.3f} (WDDM counts it against the device)"
                   if self.wddm else "")
                + " (the optimizer's step needs "
                f"{self.step_bytes / gib:.3f} more, which fits); host {host}")


def _stand_in():
    value = os.environ.get(TEST_DEVICE_ENV, "")
    if value == "":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{TEST_DEVICE_ENV} must be a positive number of bytes, got {value!r}")
    return n


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _storages_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            if s.data_ptr() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def optimizer_state_bytes(model: nn.Module, optimizer="default") -> int:
    """The bytes the optimizer's states will take that are not allocated yet, as
    `ckpt_offload.sizing.recipe` counts them (the estimate counts through the same functions).

    Args:
        model: its parameters with `requires_grad` are the trainable ones.
        optimizer: a transformers `optim` name (`"adamw_torch"`, `"adamw_torch_fused"`, `"adamw_bnb_8bit"`,
            `"adafactor"`, `"sgd"`, ...; `recipe.OPTIMS`; the default, `"default"`, is the Trainer's
            default, `recipe.default_optim()`), `"none"` or None (zero), a
            `ckpt_offload.sizing.recipe.Recipe`, or a `torch.optim.Optimizer` (accelerate's wrapper looked
            through): only its parameters whose state is still empty count, each as that optimizer
            allocates it (AdamW two states in the parameter's dtype, three with amsgrad; SGD one
            with momentum, none without; unknown optimizers two, an upper bound for most).

    Raises:
        ValueError: an unknown optimizer name.
    """
    from . import recipe as _recipe

    if optimizer is None:
        return 0
    if isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "param_groups"):
        return _recipe.pending_state_bytes(optimizer)
    r = _as_recipe(optimizer)
    built = _recipe._model_dtype(model)
    return sum(_recipe.optimizer_bytes(_recipe.local_part(p), r, built)[0] for p in model.parameters() if p.requires_grad)


def _as_recipe(optimizer):
    """The recipe an optimizer's name (or a recipe) stands for; an unknown name is budget='auto''s error."""
    from . import recipe as _recipe

    if isinstance(optimizer, _recipe.Recipe):
        return optimizer
    try:
        return _recipe.Recipe(optim=optimizer)
    except ValueError as e:
        raise ValueError(f"budget='auto': {e}") from None


def optimizer_step_bytes(model: nn.Module, optimizer="default") -> int:
    """What the optimizer's step will need beyond what the device holds now, as the estimate counts
    its step: the gradients still to come (of the parameters with `requires_grad` and no `.grad`),
    the states not yet allocated (`optimizer_state_bytes`) and the step's temporaries
    (`recipe.step_temp_bytes`: torch's foreach AdamW, RMSprop and Adagrad; none for fused or
    8-bit ones). `optimizer` as for `optimizer_state_bytes`."""
    from . import recipe as _recipe

    if optimizer is None:
        return 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    local = [_recipe.local_part(p) for p in trainable]  # a DTensor's shard: its gradient's and states' size
    grads = sum(t.numel() * t.element_size() for p, t in zip(trainable, local) if p.grad is None)
    states = optimizer_state_bytes(model, optimizer)
    if isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "param_groups"):
        temps = _recipe.pending_step_temp_bytes(optimizer)
    else:
        r = _as_recipe(optimizer)
        built = _recipe._model_dtype(model)
        temps = sum(_recipe.optimizer_bytes(t, r, built)[1] for t in local)
    return grads + states + temps


def host_budget_bytes(fraction: float = HOST_FRACTION):
    """This rank's host budget: `hostmem.host_share_bytes(fraction)`, or None where unreadable."""
    return hostmem.host_share_bytes(fraction)


def auto_budget(model: nn.Module, *, optimizer="default", margin_bytes=None, device=None, pinned_bytes=0) -> AutoBudget:
    """The device and host budgets `budget="auto"` plans with, for `model` on its device now.

    Args:
        model: the model about to train, on its device.
        optimizer: as for `optimizer_state_bytes`.
        margin_bytes: what to leave unplanned on the device (default: the larger of 5% of the
            device's memory and 1 GiB; 5% of the stand-in's total on the CPU test path).
        device: the device to read (default: the model's).
        pinned_bytes: what the host pool has pinned (its reserved bytes); under WDDM it is taken
            from the device half, elsewhere it does not count.

    Raises:
        ValueError: the device is not a CUDA device and `CKPT_OFFLOAD_TEST_DEVICE_BYTES` is not
            set, or the margin leaves nothing to plan with.
    """
    device = torch.device(device) if device is not None else _model_device(model)
    stand_in = _stand_in()
    if device.type == "cuda" and stand_in is None:
        free_driver, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        free = free_driver + torch.cuda.memory_reserved(device) - allocated
        margin = max(int(MARGIN_FRACTION * total), MARGIN_MIN_BYTES) if margin_bytes is None else margin_bytes
        source = "cuda"
    elif stand_in is not None:
        held = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *model.buffers()]
        allocated = _storages_bytes(held)
        free = stand_in
        margin = int(MARGIN_FRACTION * (allocated + free)) if margin_bytes is None else margin_bytes
        source = TEST_DEVICE_ENV
    else:
        raise ValueError(
            f"budget='auto' reads the free memory of a CUDA device; the model is on {device}. "
            f"On the CPU test path set {TEST_DEVICE_ENV}=<bytes> to stand in for it, or pass a budget in bytes"
        )
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"budget='auto': margin_bytes must be a non-negative int, got {margin_bytes!r}")
    opt = optimizer_state_bytes(model, optimizer)
    wddm = hostmem.is_wddm()
    pinned = int(pinned_bytes) if wddm else 0
    device_bytes = allocated + free - margin - opt - pinned
    if device_bytes <= allocated:
        wddm_note = f", and the {pinned} bytes of pinned host memory WDDM counts against it" if wddm else ""
        raise ValueError(
            f"budget='auto': the device has {free} bytes free, less than the margin ({margin}) and the optimizer "
            f"states still to come ({opt}){wddm_note}; nothing is left for activations"
        )
    step = optimizer_step_bytes(model, optimizer)
    if step > free - margin - pinned:
        raise ValueError(
            f"budget='auto': the optimizer's step alone does not fit: it needs {step} bytes (gradients and states "
            f"still to come, and its temporaries) beside the {allocated} held, and the device has {free} free less "
            f"the margin ({margin}); a fused or 8-bit optimizer, sharding or LoRA make it smaller"
        )
    return AutoBudget(device_bytes=device_bytes, host_bytes=host_budget_bytes(), allocated_bytes=allocated,
                      free_bytes=free, margin_bytes=margin, optimizer_bytes=opt, step_bytes=step,
                      local_world_size=hostmem.local_world_size(), source=source, pinned_bytes=pinned, wddm=wddm)


def host_capacity_auto() -> int:
    """The pool capacity `host_pool().set_capacity("auto")` sets: this rank's host budget.

    Raises:
        ValueError: the node's available memory cannot be read (no /proc/meminfo, no cgroup).
    """
    n = host_budget_bytes()
    if n is None:
        raise ValueError("set_capacity('auto'): this node's available memory cannot be read (/proc/meminfo, the "
                         "cgroup); pass a capacity in bytes")
    return max(n, 1)


def check_route_budget(where: str, value) -> None:
    """The routes that have no batch to plan with (TRL's, accelerate's) take budget=None or "auto"
    (the host half: the pool capped at this rank's share when the route is taken)."""
    if value is not None and not is_auto(value):
        raise ValueError(f"{where}: budget must be None or 'auto' (the host pool capped at this rank's share of "
                         f"the node), got {value!r}")
