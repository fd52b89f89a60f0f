"""transformers integration: its own gradient checkpointing, with the async engine for offload.

enable() keeps transformers' layer selection (GradientCheckpointingLayer, every_n_layers) and only
replaces the synchronous save_on_cpu offload of `activation_checkpointing_enable(offload=True)`
(`gradient_checkpointing_enable` before transformers renamed it).
OffloadCallback does the same for a Trainer run from its TrainingArguments.
"""
from __future__ import annotations

import warnings

try:
    import transformers
    from transformers import TrainerCallback
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "ckpt_offload.integrations.hf needs transformers>=5 (and accelerate for Trainer): pip install transformers accelerate"
    ) from err

from .. import policies
from ..checkpointing import checkpoint_function
from .._args import check_int as _check_int
from ..session import OffloadSession

_STATE_ATTR = "_ckpt_offload_hf"


# transformers renamed its switches during 5.x (gradient_checkpointing_* became
# activation_checkpointing_*, the old names kept as deprecated aliases until v6): these use the new
# names where they exist and the old ones before.
def checkpointing_enable(model, checkpoint_kwargs=None, every_n_layers: int = 1, offload: bool = False) -> None:
    """transformers' own checkpointing of `model`, through whichever name this transformers has."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=checkpoint_kwargs, every_n_layers=every_n_layers, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=checkpoint_kwargs, every_n_layers=every_n_layers, offload=offload
        )


def checkpointing_disable(model) -> None:
    """transformers' own checkpointing off, through whichever name this transformers has."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def checkpointing_args(every_n_layers: int = 1, offload: bool = True, **checkpoint_kwargs) -> dict:
    """TrainingArguments keywords that turn checkpointing on, under this transformers' names:
    transformers.TrainingArguments(..., **checkpointing_args(every_n_layers=2, offload=True))."""
    fields = getattr(transformers.TrainingArguments, "__dataclass_fields__", {})
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"every_n_layers": every_n_layers, "offload": offload, **checkpoint_kwargs}}


def training_args_checkpointing(args):
    """(on, kwargs) of a TrainingArguments: activation_checkpointing[_kwargs], or the older
    gradient_checkpointing[_kwargs]."""
    if hasattr(args, "activation_checkpointing"):
        return bool(args.activation_checkpointing), dict(args.activation_checkpointing_kwargs or {})
    return bool(args.gradient_checkpointing), dict(args.gradient_checkpointing_kwargs or {})


def enable(model, every_n_layers: int = 1, offload: bool = True, keep_last: int = 1, prefetch: int = 1,
           prefetch_bytes=None, policy=None, **checkpoint_kwargs) -> list[int]:
    """Turns on transformers' gradient checkpointing for `model` with the same layer selection
    transformers uses for every_n_layers; with offload=True the checkpointed layers' inputs go
    through the async engine (the last keep_last checkpointed layers stay on the device).
    checkpoint_kwargs go to torch.utils.checkpoint.checkpoint (non-reentrant only).
    policy: selective checkpointing inside the layers, as for enable_checkpointing ("attention":
    the outputs of scaled-dot-product attention, transformers' default, offloaded with the layer).
    Returns the 0-based indices of the checkpointed GradientCheckpointingLayer modules.
    """
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"hf.enable: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    _check_int("hf.enable", "every_n_layers", every_n_layers, 1)
    _check_int("hf.enable", "keep_last", keep_last, 0)
    _check_int("hf.enable", "prefetch", prefetch, 0)
    if checkpoint_kwargs.pop("use_reentrant", False):
        raise ValueError("hf.enable: use_reentrant=True is not supported; ckpt_offload checkpoints non-reentrantly")
    if policy is not None and "context_fn" in checkpoint_kwargs:
        raise ValueError("hf.enable: pass policy= or a context_fn, not both (policy builds the context_fn)")
    policy = policies.prepare("hf.enable", policy)
    checkpointing_enable(model, {"use_reentrant": False, **checkpoint_kwargs}, every_n_layers=every_n_layers)
    _forget(model)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    checkpointed = [i for i, m in enumerate(layers) if m.gradient_checkpointing]
    model.__dict__[_STATE_ATTR] = (checkpointed, [], [])
    contexts = policies.per_block("hf.enable", policy, checkpointed)
    if not offload:
        for i in checkpointed:
            if contexts[i] is not None:  # the policy's offload outputs stay on the device, saved
                layers[i]._gradient_checkpointing_func = checkpoint_function(None, True, context_fn=contexts[i],
                                                                             **checkpoint_kwargs)
        return checkpointed
    if keep_last > len(checkpointed):
        raise ValueError(
            f"hf.enable: keep_last={keep_last} is larger than the {len(checkpointed)} checkpointed layers; "
            f"use 0..{len(checkpointed)}"
        )
    offloaded = checkpointed[: len(checkpointed) - keep_last]
    session = OffloadSession(prefetch=prefetch, prefetch_bytes=prefetch_bytes)
    func = checkpoint_function(session, False, **checkpoint_kwargs)
    for i in checkpointed:
        # The kept layers still mark where backward reaches them, to start earlier reloads.
        ctx = {} if contexts[i] is None else {"context_fn": contexts[i]}
        layers[i]._gradient_checkpointing_func = checkpoint_function(session, i not in offloaded,
                                                                     **checkpoint_kwargs, **ctx)
    # Modules that checkpoint their children themselves (older model code) offload too.
    for m in model.modules():
        if hasattr(m, "gradient_checkpointing") and not isinstance(m, GradientCheckpointingLayer):
            if m.gradient_checkpointing:
                m._gradient_checkpointing_func = func
    hooks = session.attach(model, [layers[i] for i in checkpointed])
    model.__dict__[_STATE_ATTR] = (checkpointed, offloaded, hooks)
    return checkpointed


def disable(model) -> None:
    """transformers' own checkpointing off, and forgets the offload settings."""
    checkpointing_disable(model)
    _forget(model)


def _forget(model):
    previous = model.__dict__.pop(_STATE_ATTR, None)
    if previous is not None:
        for hook in previous[2]:
            hook.remove()


def state(model):
    """(checkpointed indices, offloaded indices) set by enable(), or None."""
    st = model.__dict__.get(_STATE_ATTR)
    return None if st is None else (st[0], st[1])


class OffloadCallback(TrainerCallback):
    """Makes a Trainer run use the async engine.

    Use with TrainingArguments(activation_checkpointing=True, activation_checkpointing_kwargs=
    {"every_n_layers": 4, "offload": True}) (gradient_checkpointing / gradient_checkpointing_kwargs
    in transformers releases before the rename); at the start of training the model's checkpointing
    is re-enabled through enable() with those settings. keep_last / prefetch / prefetch_bytes are
    this callback's own.
    """

    def __init__(self, keep_last: int = 1, prefetch: int = 1, prefetch_bytes=None):
        _check_int("OffloadCallback", "keep_last", keep_last, 0)
        _check_int("OffloadCallback", "prefetch", prefetch, 0)
        self.keep_last = keep_last
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self.checkpointed = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        on, gc_kwargs = training_args_checkpointing(args)
        if not on:
            warnings.warn("OffloadCallback: checkpointing is off in TrainingArguments; nothing to offload")
            return
        every_n_layers = gc_kwargs.pop("every_n_layers", 1)
        offload = gc_kwargs.pop("offload", False)
        if not offload:
            warnings.warn(
                "OffloadCallback: the checkpointing kwargs of TrainingArguments have no 'offload': True; "
                "checkpointing runs without offload"
            )
        self.checkpointed = enable(
            model,
            every_n_layers=every_n_layers,
            offload=bool(offload),
            keep_last=min(self.keep_last, self._count(model, every_n_layers)),
            prefetch=self.prefetch,
            prefetch_bytes=self.prefetch_bytes,
            **gc_kwargs,
        )

    @staticmethod
    def _count(model, every_n_layers):
        n = sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
        return len(range(0, n, every_n_layers))
