"""ckpt_offload.checkpoint: torch's non-reentrant checkpoint with its saved inputs offloaded."""
from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as _pytree
import torch.utils.checkpoint as _tuc

from ._args import check_bool as _check_bool
from ._args import check_not_reentrant as _check_not_reentrant
from . import policies
from . import timeline as _timeline
from .session import OffloadSession

# Keywords torch.utils.checkpoint.checkpoint consumes itself; everything else goes to the function.
_CHECKPOINT_KEYS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
                    "respect_saved_tensors_hooks")

_default_session = None
_kwarg_warned = False
_container_warned = False


def default_session() -> OffloadSession:
    global _default_session
    if _default_session is None:
        _default_session = OffloadSession(prefetch=1)
    return _default_session


def warn_kwarg_tensors(kwargs) -> None:
    """Saved-tensor hooks only see a checkpoint's positional tensor inputs; say so once."""
    global _kwarg_warned
    if _kwarg_warned:
        return
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            _kwarg_warned = True
            warnings.warn(
                f"ckpt_offload: the tensor passed as keyword {key!r} requires grad but is not offloaded: "
                "a checkpoint offloads only its positional tensor inputs (keywords and closures are "
                "invisible to saved-tensor hooks). Pass it positionally to offload it. Shown once.",
                UserWarning,
                stacklevel=3,
            )
            return


def warn_container_tensors(args) -> None:
    """torch's checkpoint saves only the tensors among its positional arguments through the hooks;
    one inside a list, tuple or dict is kept as part of that object, on the device. Say so once."""
    global _container_warned
    for i, value in enumerate(args):
        if isinstance(value, (list, tuple, dict)) and any(
            isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in _pytree.tree_leaves(value)
        ):
            _container_warned = True
            warnings.warn(
                f"ckpt_offload: positional argument {i} is a {type(value).__name__} holding a tensor that "
                "requires grad; it is not offloaded: a checkpoint offloads only the tensors passed directly "
                "as positional arguments, not those inside a list, tuple or dict. Pass them one by one to "
                "offload them. Shown once.",
                UserWarning,
                stacklevel=4,
            )
            return


def run_checkpoint(session, function, args, kwargs, keep=False):
    """Non-reentrant checkpoint whose saved inputs go through `session` (None: stay on device;
    keep=True: stay on device but start the reloads of earlier layers when backward reaches them).
    A selective-checkpoint context_fn offloads what its policy marks through the same session."""
    if "context_fn" in kwargs or "respect_saved_tensors_hooks" in kwargs:
        kwargs = policies.bind(kwargs, session, keep)
    if session is None or not torch.is_grad_enabled():
        return _tuc.checkpoint(function, *args, use_reentrant=False, **kwargs)
    if not keep and not _container_warned:
        warn_container_tensors(args)
    if _timeline.naming() and not torch.compiler.is_compiling():  # a layer's spans, for a timeline or profiler
        return _timeline.run_layer(session, args, lambda: _run_hooked(session, function, args, kwargs, keep))
    return _run_hooked(session, function, args, kwargs, keep)


def _run_hooked(session, function, args, kwargs, keep):
    with session.hooks(keep=keep):
        return _tuc.checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_function(session, keep=False, **checkpoint_kwargs):
    """A `_gradient_checkpointing_func` for transformers layers: checkpoints through `session`."""

    def func(function, *args, **kwargs):
        return run_checkpoint(session, function, args, {**checkpoint_kwargs, **kwargs}, keep)

    return func


def checkpoint(function, *args, offload: bool = True, use_reentrant=None, session=None, **kwargs):
    """Drop-in for torch.utils.checkpoint.checkpoint (non-reentrant only).

    With offload=True the tensors the checkpoint keeps, its positional tensor inputs, are copied
    asynchronously to pinned host memory and prefetched back in backward; gradients are bitwise
    those of torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False). Tensors
    passed through keywords or closures, or inside a list, tuple or dict, are not offloaded
    (saved-tensor hooks cannot see them; a warning says so once). An offloaded input comes back
    in backward as an equal tensor, not the same Python object.

    context_fn accepts torch's selective checkpointing,
    functools.partial(create_selective_checkpoint_contexts, policy_fn): outputs the policy marks
    MUST_/PREFER_CPU_OFFLOAD are saved, not recomputed, and offloaded with the inputs; *_SAVE
    outputs stay on the device (respect_saved_tensors_hooks=True offloads them too). See
    ckpt_offload.policies.
    """
    _check_not_reentrant("ckpt_offload.checkpoint", use_reentrant)
    if not callable(function):
        raise TypeError(f"ckpt_offload.checkpoint: function must be callable, got {type(function).__name__}")
    _check_bool("ckpt_offload.checkpoint", "offload", offload)
    warn_kwarg_tensors({k: v for k, v in kwargs.items() if k not in _CHECKPOINT_KEYS})
    if offload and session is None:
        session = default_session()
    return run_checkpoint(session if offload else None, function, args, kwargs)
