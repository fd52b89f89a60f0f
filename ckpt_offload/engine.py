"""Process-wide engines and statistics: the thin Python face of ckpt_offload._C."""
from __future__ import annotations

import threading

import torch

from ._args import check_bool
from ._loader import load

_C = load()

_counters_lock = threading.Lock()
_counters = {"tensors_kept_on_device": 0, "shared_views": 0, "midpoint_misses": 0}


def count(name: str, n: int = 1) -> None:
    with _counters_lock:
        _counters[name] += n


def engine_for(device) -> "_C.CopyEngine":
    """The process-wide copy engine of a device (its own D2H and H2D streams), shared pool."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _C.engine_for(device)


def host_pool() -> "_C.HostPool":
    """The process-wide host pool every engine draws from."""
    return _C.global_pool()


_ENGINE_KEYS = (
    "tensors_offloaded",
    "bytes_offloaded",
    "tensors_prefetched",
    "bytes_prefetched",
    "tensors_fetched",
    "reloads_on_demand",
    "tensors_released",
    "offloads_refused",
    "compacted",
    "pending_sources",
    "reload_wait_ms",
    "reload_waits_measured",
    "d2h_copy_ms",
    "d2h_bytes_timed",
    "d2h_copies_timed",
    "h2d_copy_ms",
    "h2d_bytes_timed",
    "h2d_copies_timed",
)


# The pool's figures that stats() reports, each as host_<name> (and peak_in_use_bytes as host_peak_bytes).
_POOL_KEYS = ("pinned", "reserved_bytes", "in_use_bytes", "alloc_calls", "allocated_bytes", "free_calls", "hits",
              "misses", "cap_refusals", "alloc_failures", "capacity_bytes")


def stats() -> dict:
    """Counters of every engine summed, the host pool's figures (host_*), and the Python layer's."""
    out = {k: 0 for k in _ENGINE_KEYS}
    for eng in _C.all_engines():
        for k, v in eng.stats().items():
            out[k] += v
    pool = _C.global_pool().stats()
    out.update({f"host_{k}": pool[k] for k in _POOL_KEYS})
    out["host_peak_bytes"] = pool["peak_in_use_bytes"]
    with _counters_lock:
        out.update(_counters)
    out["profiling"] = _C.profiling()
    out["d2h_gb_per_s"] = _rate(out["d2h_bytes_timed"], out["d2h_copy_ms"])
    out["h2d_gb_per_s"] = _rate(out["h2d_bytes_timed"], out["h2d_copy_ms"])
    return out


def _rate(nbytes, ms):
    """GB/s (1e9 bytes a second) of the timed copies; None when nothing was timed."""
    return nbytes / ms / 1e6 if nbytes and ms > 0 else None


def reset_stats() -> None:
    """Zeroes every counter; the pool's peak restarts from the bytes in use now."""
    for eng in _C.all_engines():
        eng.reset_stats()
    _C.global_pool().reset_stats()
    with _counters_lock:
        for k in _counters:
            _counters[k] = 0


def profile(on: bool = True) -> None:
    """Measures, with CUDA events, how long the compute stream waits for each reload
    (stats()['reload_wait_ms']) and how long each copy takes on its copy stream
    (d2h_copy_ms / h2d_copy_ms for d2h_bytes_timed / h2d_bytes_timed; on the host-only path, the
    synchronous copies' wall time). Off by default: it adds events to every copy and reload."""
    check_bool("profile", "on", on)
    _C.set_profiling(on)


def synchronize() -> None:
    """Waits for every queued copy and drops the sources whose copies finished."""
    for eng in _C.all_engines():
        eng.synchronize()


def poll() -> int:
    """Drops sources whose device-to-host copies finished, without waiting; returns how many remain."""
    return sum(eng.poll() for eng in _C.all_engines())
