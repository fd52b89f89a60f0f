"""enable_checkpointing / disable_checkpointing: checkpoint (and offload) a model's repeated blocks."""
from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from .checkpointing import checkpoint_function, run_checkpoint, warn_kwarg_tensors
from ._args import check_int as _check_int
from . import policies
from .session import OffloadSession

_STATE_ATTR = "_ckpt_offload_state"


def _gc_layer_class():
    # Only look for transformers' layer class when transformers is already loaded: a model built
    # with it has imported it, and importing it for a plain torch model costs seconds.
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in forward order.

    transformers' GradientCheckpointingLayer modules when there are any; otherwise the longest run
    of same-class children in any nn.ModuleList or nn.Sequential (at least two). Empty if none.
    """
    gc_cls = _gc_layer_class()
    if gc_cls is not None:
        layers = [m for m in model.modules() if isinstance(m, gc_cls)]
        if layers:
            return layers
    best: list[nn.Module] = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        run: list[nn.Module] = []
        for child in container.children():
            if run and type(child) is type(run[0]):
                run.append(child)
            else:
                run = [child]
            if len(run) > len(best):
                best = list(run)
    return best if len(best) >= 2 else []


class _State:
    def __init__(self, layers, checkpointed, offloaded, session, saved_attrs, hooks):
        self.layers = layers
        self.checkpointed = checkpointed
        self.offloaded = offloaded
        self.session = session
        self.saved_attrs = saved_attrs  # [(module, name, previous instance value or _MISSING)]
        self.hooks = hooks


_MISSING = object()


def _set(saved, module, name, value):
    saved.append((module, name, module.__dict__.get(name, _MISSING)))
    setattr(module, name, value)


def _wrap(module: nn.Module, session, keep, context=None):
    original = module.forward
    ckpt_kwargs = {} if context is None else {"context_fn": context}

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        warn_kwarg_tensors(kwargs)
        # Keywords travel in a closure, so torch's checkpoint sees only the positional inputs.
        fn = functools.partial(original, **kwargs) if kwargs else original
        return run_checkpoint(session, fn, args, ckpt_kwargs, keep)

    return forward


def enable_checkpointing(
    model: nn.Module,
    every_n_layers: int = 1,
    offload: bool = False,
    keep_last: int = 1,
    prefetch: int = 1,
    prefetch_bytes: int | None = None,
    layers=None,
    policy=None,
) -> list[int]:
    """Checkpoints the first repeated block and every n-th after it (0-based index % n == 0).

    With offload=True the checkpointed blocks' inputs live in pinned host memory between forward
    and backward, except the last keep_last, which backward needs first. prefetch: how many
    offloaded layers are on their way back ahead of need (prefetch_bytes caps it by bytes).
    layers: an explicit list of blocks instead of the search. Calling again reconfigures.
    policy: selective checkpointing inside the checkpointed blocks, a torch SAC policy function or
    a name ("attention": attention outputs offloaded, the rest recomputed), or a dict of them by
    block index; outputs it marks *_CPU_OFFLOAD go to the host with the block's input (on the
    device in the keep_last blocks and without offload). See ckpt_offload.policies.
    Returns the 0-based indices of the checkpointed blocks.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_checkpointing: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_int("enable_checkpointing", "every_n_layers", every_n_layers, 1)
    _check_int("enable_checkpointing", "keep_last", keep_last, 0)
    _check_int("enable_checkpointing", "prefetch", prefetch, 0)
    if prefetch_bytes is not None:
        _check_int("enable_checkpointing", "prefetch_bytes", prefetch_bytes, 1)
    if not isinstance(offload, bool):
        raise TypeError(f"enable_checkpointing: offload must be True or False, got {offload!r}")

    if layers is None:
        blocks = find_repeated_blocks(model)
        if not blocks:
            raise ValueError(
                f"enable_checkpointing: no repeated blocks found in {type(model).__name__}: searched for "
                "transformers GradientCheckpointingLayer modules and for runs of at least two modules of "
                "one class in an nn.ModuleList or nn.Sequential; pass layers=[...] explicitly"
            )
    else:
        blocks = list(layers)
        if not blocks:
            raise ValueError("enable_checkpointing: layers is empty")
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise TypeError(f"enable_checkpointing: layers[{i}] must be an nn.Module, got {type(b).__name__}")
    gc_cls = _gc_layer_class()
    ours = _STATE_ATTR in model.__dict__
    if not ours and gc_cls is not None and any(isinstance(b, gc_cls) and b.gradient_checkpointing for b in blocks):
        raise ValueError(
            "enable_checkpointing: transformers' own gradient checkpointing is on for this model; call "
            "ckpt_offload.integrations.hf.checkpointing_disable(model) first, or use ckpt_offload.integrations.hf.enable(model, ...)"
        )

    checkpointed = [i for i in range(len(blocks)) if i % every_n_layers == 0]
    if offload and keep_last > len(checkpointed):
        raise ValueError(
            f"enable_checkpointing: keep_last={keep_last} is larger than the {len(checkpointed)} checkpointed "
            f"layers; use 0..{len(checkpointed)}"
        )
    offloaded = checkpointed[: len(checkpointed) - keep_last] if offload else []
    contexts = policies.per_block("enable_checkpointing", policy, checkpointed)

    disable_checkpointing(model)
    session = OffloadSession(prefetch=prefetch, prefetch_bytes=prefetch_bytes) if offloaded else None
    saved = []
    if gc_cls is not None and all(isinstance(b, gc_cls) for b in blocks):
        # transformers layers checkpoint themselves through their own __call__, which also turns
        # off the KV cache that a recompute would update twice: use that path, with our function.
        for m in model.modules():
            if isinstance(getattr(m, "gradient_checkpointing", None), bool) and not isinstance(m, gc_cls):
                _set(saved, m, "gradient_checkpointing", True)  # stops passing caches down
        for i in checkpointed:
            _set(saved, blocks[i], "gradient_checkpointing", True)
            ckpt_kwargs = {} if contexts[i] is None else {"context_fn": contexts[i]}
            _set(saved, blocks[i], "_gradient_checkpointing_func",
                 checkpoint_function(session, i not in offloaded, **ckpt_kwargs))
    else:
        for i in checkpointed:
            _set(saved, blocks[i], "forward", _wrap(blocks[i], session, i not in offloaded, contexts[i]))
    hooks = session.attach(model, [blocks[i] for i in checkpointed]) if session is not None else []
    setattr(model, _STATE_ATTR, _State(blocks, checkpointed, offloaded, session, saved, hooks))
    return checkpointed


def disable_checkpointing(model: nn.Module) -> None:
    """Undoes enable_checkpointing: the blocks' own forward back, no hooks left. No-op if not enabled."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"disable_checkpointing: model must be a torch.nn.Module, got {type(model).__name__}")
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    for module, name, previous in reversed(state.saved_attrs):
        if previous is _MISSING:
            delattr(module, name)
        else:
            setattr(module, name, previous)
    for hook in state.hooks:
        hook.remove()


def checkpointing_state(model: nn.Module):
    """(checkpointed indices, offloaded indices) or None when not enabled."""
    state = model.__dict__.get(_STATE_ATTR)
    return None if state is None else (list(state.checkpointed), list(state.offloaded))
