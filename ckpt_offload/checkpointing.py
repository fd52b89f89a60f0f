"""ckpt_offload.checkpoint: torch's non-reentrant checkpoint with its saved inputs offloaded."""
from __future__ import annotations

import collections
import difflib
import functools
import inspect
import warnings

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.utils._pytree as _pytree
import torch.utils.checkpoint as _tuc

from ._args import CHECKPOINT_KEYS as _CHECKPOINT_KEYS
from ._args import check_bool as _check_bool
from ._args import check_keywords as _check_keywords
from ._args import check_not_reentrant as _check_not_reentrant
from . import policies
from . import timeline as _timeline
from .session import OffloadSession, refuse_capture

# checkpoint()'s own names: a keyword that nearly matches one is a misspelling, not the function's.
_OWN_NAMES = ("offload", "use_reentrant", "session", *_CHECKPOINT_KEYS)

_default_session = None
# Where the default session's forwards (graphs) begin, learnt from the graph itself: each call
# tags the autograd nodes of its inputs and outputs with the number of its forward (in the
# nodes' metadata: nothing here holds a graph alive), and a call whose inputs reach no node of
# the current forward within _WALK nodes upstream starts a new one.
_TAG = "ckpt_offload.forward"
_WALK = 64
_forward = [0]  # the number of the default session's current forward
_kwarg_warned = False
_container_warned = False
# Left out, torch takes respect_saved_tensors_hooks=None, which it plans to refuse under active
# saved-tensor hooks (ours are): False is what None means today, and it changes nothing without a
# context_fn. (Read, never written: passed as **.)
_NO_RESPECT = {"respect_saved_tensors_hooks": False} if policies.HAS_RESPECT else {}


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
    if session is not None and _top_hooks(False) is not None and _in_checkpoint():
        # Nested in another checkpoint (its forward or its recompute): what this one saves lies in
        # the outer's region, which saves nothing of it but recomputes it; a copy made now would
        # never be reloaded. Plain in both, or the outer's recompute would save a different number
        # of tensors than its forward (torch checks).
        session = None
    if not kwargs:
        kwargs = _NO_RESPECT
    elif "context_fn" in kwargs or "respect_saved_tensors_hooks" in kwargs:
        kwargs = policies.bind(kwargs, session, keep)
    elif policies.HAS_RESPECT:
        kwargs = {**kwargs, **_NO_RESPECT}
    if session is None or not torch.is_grad_enabled():
        return _tuc.checkpoint(function, *args, use_reentrant=False, **kwargs)
    if not keep and not _container_warned:
        for a in args:
            if isinstance(a, (list, tuple, dict)):
                warn_container_tensors(args)
                break
    if (_timeline.enabled or _autograd_profiler._is_profiler_enabled) and not torch.compiler.is_compiling():
        # A layer's spans, for a timeline or profiler.
        return _timeline.run_layer(session, args, lambda: _run_hooked(session, function, args, kwargs, keep))
    return _run_hooked(session, function, args, kwargs, keep)


def _run_hooked(session, function, args, kwargs, keep):
    # session.hooks(keep), without the context manager's frames: a new layer, the hooks pushed, and
    # when the layer's forward is over its sources handed back (see _LayerHooks).
    session.next_layer()
    _push_hooks(session.pack_kept if keep else session.pack, session.unpack)
    try:
        return _tuc.checkpoint(function, *args, use_reentrant=False, **kwargs)
    finally:
        _pop_hooks()
        session.poll()


def run_learned(session, function, args, keep, walk):
    """run_checkpoint(session, function, args, {}, keep) for a block whose midpoint path is learned
    (walk, a _C.NodePath), with the midpoint hooked in the same call to the session's core. Returns
    (out, armed): armed as SessionCore.run_layer, or None where this call took run_checkpoint's own
    path (nested in a checkpoint, a timeline or profiler on) and the midpoint is still to hook."""
    if _top_hooks(False) is not None or _timeline.enabled or _autograd_profiler._is_profiler_enabled:
        return run_checkpoint(session, function, args, {}, keep), None
    if not keep and not _container_warned:
        for a in args:
            if isinstance(a, (list, tuple, dict)):
                warn_container_tensors(args)
                break
    specs = session._layer_specs
    if specs is None:
        kwargs = {"use_reentrant": False, **_NO_RESPECT}
        specs = session._layer_specs = ((_push_hooks, _pop_hooks, session.pack, session.unpack, _tuc, kwargs),
                                        (_push_hooks, _pop_hooks, session.pack_kept, session.unpack, _tuc, kwargs))
    return session._core.run_layer(specs[keep], function, args, walk)


_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


def _in_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are a non-reentrant checkpoint's, in its forward or
    its recompute (torch's pack hooks there are closures, known by their qualified names)."""
    top = _top_hooks(False)
    return top is not None and getattr(top[0], "__qualname__", "").startswith(_TORCH_HOOKS)


_TORCH_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")


def checkpoint(function=None, *args, offload: bool = True, use_reentrant=None, session=None, **kwargs):
    """Drop-in for torch.utils.checkpoint.checkpoint (non-reentrant only).

    Without a function (and no arguments) it returns a decorator, as torch's does:
    ``@ckpt_offload.checkpoint(preserve_rng_state=False)`` above a function checkpoints each call.

    | argument | default | meaning |
    |---|---|---|
    | offload | True | True by default, as at every ckpt_offload entry point; False: torch's checkpoint as it is |
    | use_reentrant | None | None or False only (non-reentrant) |
    | session | None | an OffloadSession; None: one shared by every call |
    | **kwargs | | torch's checkpoint options (preserve_rng_state, context_fn, ...); with a function, the others are the function's, as in torch (by name or through its **kwargs), except a near miss of an option (offlaod=, context=) that the function cannot take: TypeError naming the option; without a function, any other raises TypeError |

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
    if function is None and not args:
        return _decorator(offload, session, kwargs)
    if not callable(function):
        raise TypeError(f"ckpt_offload.checkpoint: function must be callable, got {type(function).__name__}")
    _check_bool("ckpt_offload.checkpoint", "offload", offload)
    if kwargs and not torch.compiler.is_compiling():  # eager calls: the check is not traced
        check_near_misses(function, kwargs)
        check_flags(kwargs)
    if offload:
        refuse_capture("ckpt_offload.checkpoint")
    warn_kwarg_tensors({k: v for k, v in kwargs.items() if k not in _CHECKPOINT_KEYS})
    if offload and session is None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # One session serves every call: without a boundary, a backward would reload the last
        # layer of another graph still alive (ya = f(xa); yb = f(xb); yb.sum().backward()).
        session = default_session()
        if _forward_of(args) != _forward[0]:
            _forward[0] += 1
            session.new_forward()
        out = run_checkpoint(session, function, args, kwargs)
        for t in (*_pytree.tree_leaves(out), *args):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.metadata[_TAG] = _forward[0]
        return out
    if offload and session is None:
        session = default_session()
    return run_checkpoint(session if offload else None, function, args, kwargs)


def check_near_misses(function, kwargs) -> None:
    """Keywords that are not checkpoint options go to the function, as torch's checkpoint passes
    them: one the function takes, by name or through its **kwargs, goes through as torch sends it.
    One the function cannot take and that nearly matches checkpoint's own names (offlaod=,
    preserve_rng=, context=) is refused with the match, before anything runs: torch would hand it to
    the function, which would raise for a keyword it does not know."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read: the function's own business
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    for name in kwargs:
        if name in _CHECKPOINT_KEYS or not difflib.get_close_matches(name, _OWN_NAMES, n=1, cutoff=0.8):
            continue
        parameter = parameters.get(name)
        if parameter is None or parameter.kind in (parameter.VAR_POSITIONAL, parameter.POSITIONAL_ONLY):
            _check_keywords("ckpt_offload.checkpoint", [name], (), own=_OWN_NAMES,
                            note=" (other keywords go to the function, but it takes no such keyword: it is "
                                 "not one of its parameters and it has no **kwargs)")


# torch's checkpoint options that are flags: a tensor there (an activation passed one slot too far by
# a wrapper) would be read for its truth, or fail deep in torch with an ambiguous-boolean error.
_FLAGS = ("preserve_rng_state", "debug")


def check_flags(kwargs) -> None:
    """Refuses a checkpoint flag (preserve_rng_state, debug) that is not a bool, naming it: a
    wrapper that passes an activation where torch expects the flag would otherwise have its
    randomness decided by the tensor's truth, and the recompute's dropout mask could differ from
    the forward's with nothing raised."""
    for name in _FLAGS:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise TypeError(f"ckpt_offload.checkpoint: {name} must be a bool, got {type(kwargs[name]).__name__}"
                            + (" (a tensor: an activation passed where the flag goes?)"
                               if isinstance(kwargs[name], torch.Tensor) else ""))


def _forward_of(args):
    """The forward of the nearest tagged node upstream of the positional inputs (an earlier call's
    output or input: the next layer, or a second branch of one input), None when there is none."""
    todo = collections.deque(a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None)
    for _ in range(_WALK):  # nearest first: the ops between two layers are few
        if not todo:
            break
        node = todo.popleft()
        found = node.metadata.get(_TAG)
        if found is not None:
            return found
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return None


def _decorator(offload, session, options):
    """checkpoint(**options) without a function: what checkpoint(fn, ...) runs, for fn decorated."""
    _check_bool("ckpt_offload.checkpoint", "offload", offload)
    # Without a function no keyword can be the function's: each must be a checkpoint option.
    _check_keywords("ckpt_offload.checkpoint (without a function)", options, _CHECKPOINT_KEYS,
                    own=("offload", "use_reentrant", "session"))

    def decorate(function):
        if not callable(function):
            raise TypeError(f"ckpt_offload.checkpoint: the decorated object must be callable, "
                            f"got {type(function).__name__}")

        @functools.wraps(function)
        def checkpointed(*args, **kwargs):
            # A call's keywords are the function's, whatever their names (preserve_rng_state,
            # use_reentrant, offload, ...): bound to it here, they never meet the options.
            if kwargs:
                warn_kwarg_tensors(kwargs)
                return checkpoint(functools.partial(function, **kwargs), *args, offload=offload, session=session,
                                  **options)
            return checkpoint(function, *args, offload=offload, session=session, **options)

        return checkpointed

    return decorate
