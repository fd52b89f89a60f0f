"""diffusers integration: a diffusers model's own gradient checkpointing, with the async engine for offload.

diffusers' models checkpoint their blocks from their own forward, as
`self._gradient_checkpointing_func(block, *args)`, with the function that
`ModelMixin.enable_gradient_checkpointing(gradient_checkpointing_func=...)` sets on every module
that has a `gradient_checkpointing` switch. enable() hands diffusers a function of the engine's
there: no model class is patched, and the blocks are exactly those diffusers' own checkpointing
wraps (Flux's double- and single-stream blocks, a UNet's resnets and transformer blocks, ...).
They form one sequence, numbered in the order they first run; every_n_layers, keep_last and
checkpointing_state count in it. install() routes `model.enable_gradient_checkpointing()` of
unmodified training scripts through enable().
"""
from __future__ import annotations

import functools

try:
    import diffusers
    from diffusers import ModelMixin
except ImportError as err:  # pragma: no cover - exercised only without diffusers
    raise ImportError("ckpt_offload.integrations.diffusers needs diffusers>=0.35: pip install diffusers") from err

from .._args import CHECKPOINT_KEYS as _CHECKPOINT_KEYS
from .._args import check_bool as _check_bool
from .._args import check_int as _check_int
from .._args import check_keywords as _check_keywords
from .._args import check_not_reentrant as _check_not_reentrant
from .._args import check_prefetch as _check_prefetch
from ..attachment import Attachment, owner_of
from ..model import checkpointing_state, disable_checkpointing

# The keywords that go on to torch.utils.checkpoint.checkpoint: torch's own options.
CHECKPOINT_KWARGS = ("use_reentrant", *_CHECKPOINT_KEYS)

_installed = []  # [(method name, diffusers' function, our replacement)] while installed


def _diffusers_enable():
    """diffusers' own ModelMixin.enable_gradient_checkpointing, also while install() replaces it."""
    for name, original, _ in _installed:
        if name == "enable_gradient_checkpointing":
            return original
    return ModelMixin.enable_gradient_checkpointing


def _diffusers_disable():
    for name, original, _ in _installed:
        if name == "disable_gradient_checkpointing":
            return original
    return ModelMixin.disable_gradient_checkpointing


def _switch(model, func):
    """diffusers' own switch: checkpointing on in every module of `model` that has one, with `func`."""
    _diffusers_enable()(model, gradient_checkpointing_func=func)


class Schedule:
    """The mode of each block of a diffusers model, by its index in forward order: every_n_layers'
    selection (index % n == 0), offloaded but for the last keep_last checkpointed blocks. Before
    the first forward that runs blocks has ended the count is unknown (n=None), and every
    checkpointed block offloads."""

    def __init__(self, every_n_layers, offload, keep_last):
        self.every_n_layers = every_n_layers
        self.offload = offload
        self.keep_last = keep_last
        self.switch = _switch

    def mode(self, i, n):
        if i % self.every_n_layers:
            return "none"
        if not self.offload:
            return "checkpoint"
        if n is None:
            return "checkpoint+offload"
        checkpointed = len(range(0, n, self.every_n_layers))
        return "checkpoint+offload" if i // self.every_n_layers < checkpointed - self.keep_last else "checkpoint"


def _diffusers_model(where, model):
    """The diffusers model `model` is, or the one inside its wrapper (torch.compile's
    OptimizedModule, DataParallel, DistributedDataParallel as accelerate's prepare makes it)."""
    target = owner_of(model) if hasattr(model, "_modules") else model
    if not isinstance(target, ModelMixin):
        raise TypeError(
            f"{where}: model must be a diffusers ModelMixin (a transformer or UNet) or a wrapper of one "
            f"(torch.compile's OptimizedModule, DataParallel, DistributedDataParallel), got {type(model).__name__}"
        )
    return target


def enable(model, every_n_layers: int = 1, offload: bool = True, keep_last: int = 1, prefetch: int = 1,
           prefetch_bytes=None, **checkpoint_kwargs) -> None:
    """Turns on diffusers' gradient checkpointing for `model` through diffusers' own
    `gradient_checkpointing_func` hook; with offload=True the checkpointed blocks' inputs go
    through the async engine (the last keep_last checkpointed blocks stay on the device).

    | argument | default | meaning |
    |---|---|---|
    | every_n_layers | 1 | the first block and every n-th after it (index % n == 0), in forward order |
    | offload | True | True by default, as at every ckpt_offload entry point; False: checkpointing only |
    | keep_last | 1 | the last checkpointed blocks whose inputs stay on the device |
    | prefetch, prefetch_bytes | 1, None | offloaded blocks on their way back ahead of need |
    | **checkpoint_kwargs | | only torch.utils.checkpoint.checkpoint's own options: use_reentrant (False or None), preserve_rng_state, context_fn, determinism_check, debug, early_stop, respect_saved_tensors_hooks |

    The blocks are those the model's own checkpointing hands over (Flux: the double-stream blocks,
    then the single-stream ones; a UNet: its resnets and transformer blocks as they interleave),
    numbered in the order they first run. Until the first forward under grad has run, the count
    is not known: that forward offloads every checkpointed block, and keep_last applies from the
    next one; checkpointing_state(model) reports the blocks once they have run. Tensors inside a
    tuple or dict argument (rotary tables) are offloaded as the others; a tensor passed to several
    blocks (the text embeddings, the rotary tables, the timestep embedding) is copied once.

    model: a diffusers ModelMixin whose class supports gradient checkpointing, or a wrapper of one.
    Any keyword that is none of these raises TypeError naming the closest parameter. Calling again
    reconfigures; disable(model) (or diffusers' own disable_gradient_checkpointing under install())
    removes it.
    """
    _check_keywords("diffusers.enable", checkpoint_kwargs, CHECKPOINT_KWARGS, own=enable)
    target = _diffusers_model("diffusers.enable", model)
    _check_int("diffusers.enable", "every_n_layers", every_n_layers, 1)
    _check_prefetch("diffusers.enable", prefetch, prefetch_bytes, keep_last)
    _check_bool("diffusers.enable", "offload", offload)
    _check_not_reentrant("diffusers.enable", checkpoint_kwargs.pop("use_reentrant", None))
    if not target._supports_gradient_checkpointing:
        raise ValueError(f"diffusers.enable: {type(target).__name__} does not support gradient checkpointing "
                         "(diffusers' _supports_gradient_checkpointing is False)")
    if not any(hasattr(m, "gradient_checkpointing") for m in target.modules()):
        raise ValueError(f"diffusers.enable: {type(target).__name__} has no module with a gradient_checkpointing "
                         "switch, so no block to checkpoint")
    # Everything is checked: from here on the model changes.
    disable_checkpointing(target)
    Attachment(target, [], [], checkpoint_kwargs=checkpoint_kwargs, prefetch=prefetch, prefetch_bytes=prefetch_bytes,
               schedule=Schedule(every_n_layers, offload, keep_last)).attach()


def disable(model) -> None:
    """diffusers' own checkpointing off, and ckpt_offload's configuration gone. model: as for enable()."""
    target = _diffusers_model("diffusers.disable", model)
    disable_checkpointing(target)
    if target._supports_gradient_checkpointing:
        _diffusers_disable()(target)


def state(model):
    """(checkpointed indices, offloaded indices) of a model enable() configured, in forward order,
    once its blocks have run (see ckpt_offload.checkpointing_state); None if not configured."""
    return checkpointing_state(model)


def install() -> None:
    """Routes diffusers' own `enable_gradient_checkpointing()` to the async engine, for every model.

    After it, model.enable_gradient_checkpointing() (as diffusers' training scripts call it for
    --gradient_checkpointing) checkpoints and offloads as enable(model) does: every block, offload
    on, keep_last=1, prefetch=1. A call that passes its own gradient_checkpointing_func is
    diffusers' own path, unchanged; so is disable_gradient_checkpointing, which also drops the
    engine's hooks. Calling it again does nothing; uninstall() restores diffusers' own methods.
    """
    if _installed:
        return
    original = ModelMixin.__dict__["enable_gradient_checkpointing"]
    off_original = ModelMixin.__dict__["disable_gradient_checkpointing"]

    @functools.wraps(original)
    def routed(self, gradient_checkpointing_func=None):
        if gradient_checkpointing_func is not None:
            disable_checkpointing(self)  # the caller's own function replaces ours: our hooks go
            return original(self, gradient_checkpointing_func=gradient_checkpointing_func)
        enable(self)

    @functools.wraps(off_original)
    def routed_off(self):
        disable_checkpointing(self)
        return off_original(self)

    for name, f in (("enable_gradient_checkpointing", routed), ("disable_gradient_checkpointing", routed_off)):
        _installed.append((name, ModelMixin.__dict__[name], f))
        setattr(ModelMixin, name, f)


def uninstall() -> None:
    """Undoes install(): diffusers' own methods again. Models configured while it was installed
    keep their engine offload until reconfigured. No-op if not installed."""
    for name, _, routed in _installed:
        if ModelMixin.__dict__.get(name) is not routed:
            raise RuntimeError(
                f"diffusers.uninstall: diffusers.ModelMixin.{name} was replaced again after install(); undo "
                "that replacement first, so that restoring diffusers' own does not drop it"
            )
    while _installed:
        name, original, _ = _installed.pop()
        setattr(ModelMixin, name, original)


def installed() -> bool:
    """Whether install() is in effect."""
    return bool(_installed)


__all__ = ["enable", "disable", "state", "install", "uninstall", "installed"]
