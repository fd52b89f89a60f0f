"""torch.compile with offload: a checkpointed block's checkpoint and saved-tensor hooks run eagerly,
at a graph break on the block's boundary, around the block's own forward, which stays compiled.
"""
from __future__ import annotations

import functools
import inspect

import torch

from .checkpointing import checkpoint_function

try:  # the eval-frame callback: which torch.compile, if any, is running the caller
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _current_callback
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_callback
except ImportError:  # pragma: no cover - a torch without dynamo
    _current_callback = _set_callback = None


def _skip_frame(code) -> None:
    """Dynamo runs frames of `code` uncompiled (the frames they call are still compiled)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(code)


def compile_options(where: str, compile) -> dict | None:
    """None for compile=False; the torch.compile keywords for compile=True ({}) or a dict."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise TypeError(
            f"{where}: compile must be True, False or a dict of torch.compile keywords "
            f"(e.g. {{'backend': 'inductor', 'dynamic': True}}), got {compile!r}"
        )
    known = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(str(k) for k in compile if k not in known)
    if unknown:
        raise TypeError(f"{where}: compile has keys torch.compile does not take: {unknown}; it takes {sorted(known)}")
    return dict(compile)


def compiled(fn, options: dict | None):
    """fn compiled with torch.compile(**options); fn itself when options is None."""
    return fn if options is None else torch.compile(fn, **options)


def _under(callback, fn, *args, **kwargs):
    # torch's checkpoint runs its function with dynamo off: put back the torch.compile that called
    # the block, so that fn (the block's forward) is compiled as a frame of its own. Its graph is
    # shared by every block of one class (the parameters are graph inputs).
    prior = _set_callback(callback)
    try:
        return fn(*args, **kwargs)
    finally:
        _set_callback(prior)


def _eagerly(run, session, callback, explicit, fn, args, kwargs):
    if callback is not None:
        fn = functools.partial(_under, callback, fn)
    if (callback is not None or explicit) and session is not None and session.defer_prefetch:
        # A compiled body is one autograd node: there is no middle of its backward to start the
        # reloads from (see Midpoints); they start when its backward starts.
        session.defer_prefetch = False
    return run(fn, args, kwargs)


@functools.cache
def _eagerly_disabled():
    # Made on first use: torch.compiler.disable imports torch._dynamo (seconds), which torch's
    # checkpoint imports anyway on its first call, but `import ckpt_offload` should not.
    return torch.compiler.disable(_eagerly)


def eager_boundary(run, session=None, explicit: bool = False):
    """A function boundary(fn, *args, **kwargs) -> run(fn', args, kwargs) that torch.compile never
    traces: under a compiled caller (whole-model compile, block.compile(), torch.compile(block)),
    the graph breaks at the call, `run` (checkpoint plus saved-tensor hooks) runs eagerly, and fn'
    is fn compiled by that same caller as its own frame. Outside compiled code fn' is fn, and the
    call enters no torch.compiler.disable wrapper: nothing compiles there, and each wrapper costs
    the host a dynamo frame switch per layer.

    run(fn, args, kwargs) runs fn(*args, **kwargs) under checkpoint and session's hooks.
    explicit: fn is itself compiled (enable_checkpointing(compile=...)).
    """
    if _current_callback is None:  # pragma: no cover - a torch without dynamo
        return lambda fn, *args, **kwargs: run(fn, args, kwargs)

    eagerly = _eagerly_disabled()

    def compiled_caller(fn, *args, **kwargs):
        # Not traced itself (recursive=False keeps the caller's callback installed, to read it
        # here); everything it calls runs inside _eagerly, which dynamo never enters.
        return eagerly(run, session, _current_callback(), explicit, fn, args, kwargs)

    compiled_caller = torch.compiler.disable(compiled_caller, recursive=False)

    def boundary(fn, *args, **kwargs):
        # Traced by dynamo (it folds is_compiling() to True), or run inside a compiled region (a
        # callback is installed): through the disabled function, where the graph breaks.
        if torch.compiler.is_compiling() or _current_callback() is not None:
            return compiled_caller(fn, *args, **kwargs)
        return _eagerly(run, session, None, explicit, fn, args, kwargs)

    # Run as a frame of its own inside a compiled region, boundary is not compiled itself (its only
    # call breaks the graph anyway); frames it calls still are.
    _skip_frame(boundary.__code__)
    return boundary


def layer_checkpoint_function(session, keep=False, explicit=False, **checkpoint_kwargs):
    """A `_gradient_checkpointing_func` for transformers layers that checkpoints through `session`,
    as an eager boundary under torch.compile (plain checkpoint_function without a session)."""
    func = checkpoint_function(session, keep, **checkpoint_kwargs)
    if session is None:
        return func
    return eager_boundary(lambda fn, args, kwargs: func(fn, *args, **kwargs), session, explicit)
