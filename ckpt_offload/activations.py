"""offload_activations: every activation a forward pass saves, sent to pinned host memory."""
from __future__ import annotations

import torch
from torch import nn

from ._args import check_int as _check_int
from ._args import check_prefetch as _check_prefetch
from .session import OffloadSession


def _same(t):
    return t


def _modules(where, name, value):
    """A list or tuple of nn.Module (None: empty), checked with an error that names the argument."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: {name} must be a list of nn.Module or None, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, nn.Module):
            raise TypeError(f"{where}: {name}[{i}] must be an nn.Module, got {type(m).__name__}")
    return list(value)


class offload_activations:
    """Context manager: every activation saved for backward inside it, of at least min_bytes, is
    copied asynchronously to pinned host memory and prefetched back in backward.

    Parameters, buffers, CPU, meta and subclass tensors stay where they are; views of one storage
    range move once. keep_last: the last N saved tensors stay on the device. prefetch: how many
    saved tensors are on their way back ahead of need (prefetch_bytes caps it by bytes).

    layers: modules (a model's repeated blocks) each of whose forwards begins a new prefetch unit:
    prefetch then counts layers, each with every tensor saved in it (a checkpointed layer saves its
    inputs), instead of tensors. exclude: modules whose forwards' saved tensors stay on the device
    (an output head, whose activations backward needs at once). Both take effect while the context
    is active only.
    """

    def __init__(self, min_bytes: int = 1 << 20, keep_last: int = 0, prefetch: int = 4, prefetch_bytes=None,
                 layers=None, exclude=None):
        _check_int("offload_activations", "min_bytes", min_bytes, 0)
        _check_prefetch("offload_activations", prefetch, prefetch_bytes, keep_last)
        self.layers = _modules("offload_activations", "layers", layers)
        self.exclude = _modules("offload_activations", "exclude", exclude)
        self.session = OffloadSession(
            min_bytes=min_bytes,
            keep_last=keep_last,
            prefetch=prefetch,
            prefetch_bytes=prefetch_bytes,
            track_modules=True,
            prefetch_unit="layer" if self.layers else "tensor",
        )
        self._hooks = None
        self._handles = []
        self._paused = []  # the identity hooks of the excluded modules running now, innermost last

    def __enter__(self):
        if self._hooks is not None:
            raise RuntimeError("offload_activations: this context is already active; create a new one to nest")
        self.session.begin()
        self._hooks = self.session.hooks()
        self._hooks.__enter__()
        new_layer = lambda module, args: self.session.next_layer()  # noqa: E731
        self._handles = [m.register_forward_pre_hook(new_layer) for m in self.layers]
        for m in self.exclude:
            self._handles.append(m.register_forward_pre_hook(self._pause))
            self._handles.append(m.register_forward_hook(self._resume, always_call=True))
        return self

    def _pause(self, module, args):
        # Innermost saved-tensor hooks win: identity hooks inside ours keep the module's tensors as they are.
        hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same)
        hooks.__enter__()
        self._paused.append(hooks)

    def _resume(self, module, args, output):
        if self._paused:
            self._paused.pop().__exit__(None, None, None)

    def __exit__(self, *exc):
        try:
            for h in self._handles:
                h.remove()
            while self._paused:  # a forward that raised inside an excluded module and skipped its hook
                self._paused.pop().__exit__(None, None, None)
            self._hooks.__exit__(*exc)
        finally:
            self._handles = []
            self._hooks = None
            self.session.end()
        return False
