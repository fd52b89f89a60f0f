"""torch.compile with offload: a checkpointed block's checkpoint and saved-tensor hooks run eagerly,
at a graph break on the block's boundary, around the block's own forward, which stays compiled.
"""
from __future__ import annotations

import functools
import inspect

import torch

try:  # the eval-frame callback: which torch.compile, if any, is running the caller
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _current_callback
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_callback
except ImportError:  # pragma: no cover - a torch without dynamo
    _current_callback = _set_callback = None


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
