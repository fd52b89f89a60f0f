"""offload_activations: every activation a forward pass saves, sent to pinned host memory."""
from __future__ import annotations

from ._args import check_int as _check_int
from ._args import check_prefetch as _check_prefetch
from .session import OffloadSession


class offload_activations:
    """Context manager: every activation saved for backward inside it, of at least min_bytes, is
    copied asynchronously to pinned host memory and prefetched back in backward.

    Parameters, buffers, CPU, meta and subclass tensors stay where they are; views of one storage
    range move once. keep_last: the last N saved tensors stay on the device. prefetch: how many
    saved tensors are on their way back ahead of need (prefetch_bytes caps it by bytes).
    """

    def __init__(self, min_bytes: int = 1 << 20, keep_last: int = 0, prefetch: int = 4, prefetch_bytes=None):
        _check_int("offload_activations", "min_bytes", min_bytes, 0)
        _check_prefetch("offload_activations", prefetch, prefetch_bytes, keep_last)
        self.session = OffloadSession(
            min_bytes=min_bytes,
            keep_last=keep_last,
            prefetch=prefetch,
            prefetch_bytes=prefetch_bytes,
            track_modules=True,
            prefetch_unit="tensor",
        )
        self._hooks = None

    def __enter__(self):
        if self._hooks is not None:
            raise RuntimeError("offload_activations: this context is already active; create a new one to nest")
        self.session.begin()
        hooks = self.session.hooks()
        try:
            hooks.__enter__()  # refused inside disable_saved_tensors_hooks (as torch.func runs)
        except BaseException:
            self.session.end()  # leaves nothing behind: the process-wide module hook goes too
            raise
        self._hooks = hooks
        return self

    def __exit__(self, *exc):
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._hooks = None
            self.session.end()
        return False
