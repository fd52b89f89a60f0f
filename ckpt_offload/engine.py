"""Process-wide engines and statistics: the thin Python face of ckpt_offload._C."""
from __future__ import annotations

import time

import torch

from ._args import check_bool, check_size
from ._loader import load
from .sizing import budget as _budget


class _Absent:
    """The compiled core where it did not load: every use raises the loader's error, which says why.
    The rest of the package imports without it, so that sizing (which runs on the meta device and
    moves nothing) works before the extension is built."""

    def __init__(self, error):
        self.error = error

    def __getattr__(self, name):
        raise ImportError(f"{self.error} (needed for ckpt_offload._C.{name})") from self.error


try:
    _C = load()
    load_error = None
except ImportError as _err:
    _C, load_error = _Absent(_err), _err
_pool_set_capacity = _C.HostPool.set_capacity if load_error is None else None
_pool_reserve = _C.HostPool.reserve if load_error is None else None


def _set_capacity(pool, nbytes) -> None:
    """Caps the pinned bytes this pool holds (0 removes the cap): an int of bytes, or a size with a
    unit as the estimate command reads them ("4GiB", "512M", "8GB"); `"auto"` sets this rank's host
    budget: its share of the node's available memory (the cgroup's limit honoured, divided among
    `LOCAL_WORLD_SIZE` ranks), times 0.5. What would go past the cap spills to the disk tier when
    one is set, else stays on the device (one warning; `stats()["tensors_kept_on_device"]`).
    `stats()["host_capacity_bytes"]` shows the cap.

    `"auto"` keeps following the node: at most once a second, when a forward starts, the cap
    becomes the lesser of the share worked out at this call and what the pool holds plus this
    rank's share of what the node has available then. Memory that other processes took meanwhile is
    not pinned; what they give back is offered again. A size in bytes ends that.

    Raises:
        TypeError: neither an int, a size string nor "auto" (a bool, a float, None).
        ValueError: `"auto"` where the node's available memory cannot be read; a negative size; a
            string that is not a size.
    """
    if _budget.is_auto(nbytes):
        nbytes = _budget.host_capacity_auto()
        _budget.log.info("host_pool().set_capacity('auto'): %d bytes (%.3f GiB) for this rank", nbytes, nbytes / 2**30)
        cap_following_node(pool, nbytes)
        return
    nbytes = check_size("host_pool().set_capacity", "nbytes", nbytes)
    global _following, _forward_hook
    if _following is not None and _following[0] is pool:
        _following = None
        _forward_hook = None if _guarded and _numa is not None else _on_forward
    _pool_set_capacity(pool, nbytes)


# A cap that follows the node ("auto", or a plan made with budget="auto"): [pool, the cap worked out
# when it was set, the monotonic time of the last look at the node], or None.
_following = None
FOLLOW_INTERVAL_S = 1.0

# The node guard (HostPool.set_node_guard): the process-wide pool never grows into the last
# max(NODE_RESERVE_FRACTION of the node's memory, NODE_RESERVE_MIN_BYTES) of what the node has
# available, cap or no cap. Set on first use (engine_for, host_pool, a forward's start).
NODE_RESERVE_FRACTION = 0.05
NODE_RESERVE_MIN_BYTES = 1 << 30
_guarded = False


def guard_node(pool) -> int:
    """Sets `pool`'s node guard from this node's figures (hostmem): before the pool grows, the
    node's available memory (`MemAvailable`, or less where a cgroup's limit leaves less), read
    then, must stay at or above the reserve after the allocation, else the tensor stays on the
    device or goes to the disk tier, with the refusal warning, and `stats()["host_node_refusals"]`
    counts it. The process-wide pool is guarded on first use; call this for a pool of your own, or
    again after the node's cgroup changed.

    Returns:
        int: the reserve in bytes: the larger of 5% of the node's memory (its cgroup's limit where
            lower) and 1 GiB; 0 where nothing can be read (the guard is then off).
    """
    from .sizing import hostmem

    meminfo, cgroups = hostmem.available_sources()
    machine = hostmem.memory_total_bytes()  # None: no readable meminfo, which the guard then skips
    total = [v for v in (machine, *(c[0] for c in cgroups)) if v is not None]
    if not total:
        pool.set_node_guard("", [], 0)
        return 0
    reserve = max(int(NODE_RESERVE_FRACTION * min(total)), NODE_RESERVE_MIN_BYTES)
    pool.set_node_guard(meminfo if machine is not None else "", cgroups, reserve)
    return reserve


def _on_forward() -> None:
    """What a forward's start does besides its own work (session.new_forward): the node guard once,
    the NUMA placement once CUDA is up (or at once without CUDA), the cap that follows the node
    while one does. None once there is nothing to do."""
    global _guarded, _forward_hook
    if not _guarded:
        _guarded = True
        guard_node(_C.global_pool())
    if _numa is None and (not torch.cuda.is_available() or torch.cuda.is_initialized()):
        place_pool(_C.global_pool())
    if _following is not None:
        follow_node()
    _forward_hook = _on_forward if _following is not None or _numa is None else None


# The NUMA placement of the process-wide pool (place_pool's answer), or None before it is decided.
_numa = None


def place_pool(pool, device=None, *, root=None) -> dict:
    """Pins `pool`'s growth on the NUMA node of `device`'s GPU (default: the current CUDA device):
    from then on each host allocation of the pool runs with the allocating thread bound to that
    node's CPUs, so the pages land on the GPU's node; the thread's own affinity is put back after
    each. Nothing is placed on a single-node host, without CUDA, where sysfs does not tell the
    GPU's node, with CKPT_OFFLOAD_NUMA=off, or where the process's CPU affinity was already
    narrowed (numactl, taskset, a launcher): a binding the user made wins. The process-wide pool is
    placed at the first forward once CUDA is up; `stats()["host_numa_node"]` and
    `stats()["host_numa"]` report the node and why.

    Args:
        pool: a HostPool.
        device: a CUDA device (index, string or torch.device), or None for the current one.
        root: the filesystem root sysfs is read under (default "/"; tests pass a stand-in tree).

    Returns:
        dict: `hostmem.numa_placement`'s answer (`node`, `cpus`, `gpu_node`, `reason`), with `device`.

    Raises:
        ValueError: CKPT_OFFLOAD_NUMA is neither "auto" nor "off".
    """
    from .sizing import hostmem, nvidia

    global _numa
    address = index = None
    if device is not None or torch.cuda.is_available():
        index = torch.device(device).index if device is not None else None
        if index is None:
            index = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(index)
        address = nvidia.pci_address(p.pci_domain_id, p.pci_bus_id, p.pci_device_id)
    placed = hostmem.numa_placement(address, root=root)
    placed["device"] = index
    pool.set_numa_cpus(placed["node"] if placed["node"] is not None else -1, placed["cpus"])
    if placed["node"] is not None:
        _budget.log.info("host pool pinned on NUMA node %d (CPUs %s), the node of GPU %s (%s)", placed["node"],
                         placed["cpus"], index, address)
    if pool is _C.global_pool():
        _numa = placed
    return placed


def _reserve(pool, sizes, count=None) -> None:
    """Makes sure that requests of these sizes, held at once, are served from free blocks: pairs
    them with the free blocks and pins only what those cannot cover, so a second call with the same
    sizes pins nothing (`ckpt_offload.reserve_for` passes one step's sizes).

    Args:
        sizes: a list of request sizes in bytes, or one size in bytes.
        count: with one size, how many requests of it (default 1).

    Raises:
        RuntimeError: the pool's cap, the node guard or the system refuses; what was pinned before
            stays as free blocks. A refusal by the system names the limits on pinned memory found
            here (the memlock limit, WSL) and the settings that change them.
    """
    try:
        if count is None:
            _pool_reserve(pool, sizes)
        else:
            _pool_reserve(pool, sizes, count)
    except RuntimeError as e:
        if "the system refused" not in str(e):
            raise
        from .sizing import hostmem

        raise RuntimeError(f"{e}. {hostmem.pinning_advice()}") from None


_forward_hook = _on_forward


def cap_following_node(pool, nbytes: int) -> None:
    """Caps `pool` at `nbytes`, this rank's host budget, and lowers the cap from then on whenever
    the node has less available than the budget assumed (see `set_capacity("auto")`)."""
    global _following, _forward_hook
    _pool_set_capacity(pool, nbytes)
    _following = [pool, int(nbytes), time.monotonic()]
    _forward_hook = _on_forward


def follow_node() -> None:
    """The cap that follows the node, brought up to date if a second has passed since the last look:
    min(the budget, held + this rank's share of what is available now). Called as forwards start."""
    f = _following
    now = time.monotonic()
    if f is None or now - f[2] < FOLLOW_INTERVAL_S:
        return
    f[2] = now
    share = _budget.host_budget_bytes()
    if share is None:  # unreadable now: the cap stays as it is
        return
    pool, budget_bytes = f[0], f[1]
    s = pool.stats()
    cap = max(1, min(budget_bytes, s["reserved_bytes"] + share))
    if cap != s["capacity_bytes"]:
        _budget.log.info("host pool cap %d -> %d bytes: the pool holds %d, this rank's share of what the node has "
                         "available now is %d (budget %d)", s["capacity_bytes"], cap, s["reserved_bytes"], share,
                         budget_bytes)
        _pool_set_capacity(pool, cap)


# "auto" is worked out here, above the compiled pool, from the node's figures (hostmem).
if load_error is None:
    _C.HostPool.set_capacity = _set_capacity
    _C.HostPool.reserve = _reserve

# Counted in Python (session.py): saved tensors of a tensor subclass the engine cannot take (not a
# DTensor), kept on the device.
python_counters = {"subclass_tensors_kept": 0}


def engine_for(device) -> "_C.CopyEngine":
    """The process-wide copy engine of a device, created on first use.

    Each engine has its own device-to-host and host-to-device streams; every engine draws from the
    one host pool (`host_pool()`). The entry points (`checkpoint`, `enable_checkpointing`,
    `offload_activations`) use these engines; call this to inspect one or to drive it directly.

    Args:
        device: a `torch.device` or a string such as `"cuda:0"`. `"cuda"` without an index means
            the current CUDA device.

    Returns:
        CopyEngine: the engine of that device (the same object on every call).
    """
    if not _guarded:
        _on_forward()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _C.engine_for(device)


def host_pool() -> "_C.HostPool":
    """The process-wide pinned host pool every engine draws from.

    Use it to cap host memory (`host_pool().set_capacity(nbytes)`, 0 removes the cap), to pin
    memory before training (`host_pool().reserve([sizes of one step])`, or
    `ckpt_offload.reserve_for`), to give its free blocks back (`empty_cache()`), or to read its
    figures (`stats()`; `ckpt_offload.stats()` reports them as `host_*`).

    Returns:
        HostPool: the pool (the same object on every call).
    """
    if not _guarded:
        _on_forward()
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
              "misses", "cap_refusals", "alloc_failures", "failed_alloc_bytes", "node_refusals", "capacity_bytes",
              "numa_placed_allocs")


# The disk tier's figures (host_pool().set_spill_dir) that stats() reports, under the names on the right.
_SPILL_KEYS = {
    "tensors_spilled": "tensors_spilled",
    "bytes_spilled": "bytes_spilled",
    "tensors_read": "tensors_read_back",
    "bytes_read": "bytes_read_back",
    "write_ms": "disk_write_ms",
    "read_ms": "disk_read_ms",
    "reads_ahead": "disk_reads_ahead",
    "read_waits": "disk_read_waits",
    "write_waits": "disk_write_waits",
    "reads_over_cap": "disk_reads_over_cap",
    "write_errors": "disk_write_errors",
    "read_errors": "disk_read_errors",
    "files": "disk_files",
    "disk_bytes": "disk_bytes",
    "peak_disk_bytes": "disk_peak_bytes",
    "io_mode": "disk_io_mode",
}


def stats() -> dict:
    """The counters of every engine summed, the host pool's figures and the Python layer's.

    Cumulative since the last `reset_stats()`. Every key is explained in the docs' "Reading
    stats()" page, with what to do when one looks wrong.

    Returns:
        dict: `tensors_offloaded`, `bytes_offloaded`, `tensors_prefetched`, `bytes_prefetched`,
            `tensors_fetched`, `reloads_on_demand`, `tensors_released`, ... (engine counters, ints);
            the pool's `host_*` figures (`host_in_use_bytes`, `host_reserved_bytes`,
            `host_alloc_calls`, ...; `host_numa_node` and `host_numa`, the NUMA node the pool pins on
            and why, see `place_pool`); `tensors_kept_on_device`, `subclass_tensors_kept`,
            `unmovable_tensors_kept`, `shared_views`, `midpoint_misses`;
            `profiling` (bool); the profiled times in ms (floats) and `d2h_gb_per_s` /
            `h2d_gb_per_s` (float, or None when nothing was timed); the disk tier's figures
            (`tensors_spilled`, `bytes_spilled`, `disk_*`; zero without a tier, see docs/disk.md).
    """
    out = {k: 0 for k in _ENGINE_KEYS}
    for eng in _C.all_engines():
        for k, v in eng.stats().items():
            out[k] += v
    pool = _C.global_pool().stats()
    out.update({f"host_{k}": pool[k] for k in _POOL_KEYS})
    out["host_peak_bytes"] = pool["peak_in_use_bytes"]
    out["host_numa_node"] = pool["numa_node"] if pool["numa_node"] >= 0 else None
    out["host_numa"] = _numa["reason"] if _numa is not None else "not decided yet (no forward has run)"
    spill = _C.global_pool().spill_stats()
    out.update({name: spill[k] for k, name in _SPILL_KEYS.items()})
    out.update(_C.session_counters())  # the sessions' own: tensors_kept_on_device, shared_views, midpoint_misses, ...
    out.update(python_counters)
    out["profiling"] = _C.profiling()
    out["d2h_gb_per_s"] = _rate(out["d2h_bytes_timed"], out["d2h_copy_ms"])
    out["h2d_gb_per_s"] = _rate(out["h2d_bytes_timed"], out["h2d_copy_ms"])
    # The worker threads' time inside open/pwrite/pread/close (always measured: one clock read an I/O).
    out["disk_write_gb_per_s"] = _rate(spill["bytes_spilled"], spill["write_ms"])
    out["disk_read_gb_per_s"] = _rate(spill["bytes_read"], spill["read_ms"])
    out["disk_gb_per_s"] = _rate(spill["bytes_spilled"] + spill["bytes_read"], spill["write_ms"] + spill["read_ms"])
    return out


def _rate(nbytes, ms):
    """GB/s (1e9 bytes a second) of the timed copies; None when nothing was timed."""
    return nbytes / ms / 1e6 if nbytes and ms > 0 else None


def reset_stats() -> None:
    """Zeroes every counter of `stats()`.

    The pool's peak (`host_peak_bytes`) restarts from the bytes in use now; figures that describe
    the present (`host_in_use_bytes`, `host_reserved_bytes`, `pending_sources`) are not counters
    and keep their values.
    """
    for eng in _C.all_engines():
        eng.reset_stats()
    _C.global_pool().reset_stats()
    _C.reset_session_counters()
    for k in python_counters:
        python_counters[k] = 0


def profile(on: bool = True) -> None:
    """Turns the timing of copies and reload waits on or off, for every engine.

    While on, CUDA events measure how long the compute stream waits for each reload
    (`stats()["reload_wait_ms"]`, `reload_waits_measured`) and how long each copy takes on its copy
    stream (`d2h_copy_ms` / `h2d_copy_ms` for `d2h_bytes_timed` / `h2d_bytes_timed`, and the rates
    `d2h_gb_per_s` / `h2d_gb_per_s`). On the host-only path it times the synchronous copies' wall
    time. Off by default: it adds events to every copy and reload.

    Args:
        on: True to measure, False to stop.

    Raises:
        TypeError: `on` is not a bool.
    """
    check_bool("profile", "on", on)
    _C.set_profiling(on)


def synchronize() -> None:
    """Waits on the host for every queued copy of every engine, then drops the sources whose
    copies finished.

    Training never needs it (the engine orders everything with events); use it before reading
    figures that depend on copies being done, or in tests.
    """
    if load_error is not None:
        return  # without the core no engine exists, and no copy was ever queued
    for eng in _C.all_engines():
        eng.synchronize()


def poll() -> int:
    """Drops the sources whose device-to-host copies have finished, without waiting.

    Returns:
        int: how many sources are still held (`stats()["pending_sources"]`).
    """
    return sum(eng.poll() for eng in _C.all_engines())
