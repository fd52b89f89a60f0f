"""What this node's host memory is: total, available, the cgroup's limit, NUMA nodes, and how many
ranks of a job share it. Read from /proc and /sys (Linux); None where a figure cannot be read.

One place for these facts: `python -m ckpt_offload env` reports them and `budget="auto"` divides
them among the node's ranks.
"""
import os
import re

_MEMINFO = "/proc/meminfo"
_CGROUP_ROOT = "/sys/fs/cgroup"
_SELF_CGROUP = "/proc/self/cgroup"
_NODES = "/sys/devices/system/node"
# Tests point these at a stand-in tree.


def _meminfo(field: str):
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        return None
    return None


def memory_total_bytes():
    """The machine's physical memory (`MemTotal`), or None where /proc/meminfo cannot be read."""
    return _meminfo("MemTotal")


def _cgroup_dirs():
    """This process's cgroup folders, innermost first: (version, path) for v2 and for v1's memory
    controller, from /proc/self/cgroup."""
    found = []
    try:
        with open(_SELF_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            # v2; on a hybrid machine (v1 controllers mounted too) it sits under unified/.
            unified = os.path.join(_CGROUP_ROOT, "unified")
            base = unified if os.path.isdir(unified) else _CGROUP_ROOT
            version = 2
        elif "memory" in controllers.split(","):
            base = os.path.join(_CGROUP_ROOT, "memory")
            version = 1
        else:
            continue
        # Walk from the process's own cgroup up to the root: a limit set on a parent binds too.
        path = path.strip("/")
        while True:
            found.append((version, os.path.join(base, path) if path else base))
            if not path:
                break
            path = os.path.dirname(path)
    return found


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max" or not re.fullmatch(r"\d+", text):
        return None
    return int(text)


def cgroup_limit_bytes():
    """The tightest memory limit of the cgroups this process is in (v2 `memory.max`, v1
    `memory.limit_in_bytes`), or None when unlimited or unreadable. v1 writes a huge number for
    "no limit": anything at or above the machine's memory counts as none."""
    total = memory_total_bytes()
    limits = []
    for version, folder in _cgroup_dirs():
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        value = _read_int(os.path.join(folder, name))
        if value is not None and (total is None or value < total):
            limits.append((value, version, folder))
    return min(limits)[0] if limits else None


# Per cgroup version: its usage file, and the key in its memory.stat of the page cache the kernel
# drops first (inactive file pages), which counts as usage there but not as memory taken.
_USAGE = {2: ("memory.current", "inactive_file"), 1: ("memory.usage_in_bytes", "total_inactive_file")}


def available_sources():
    """Where `memory_available_bytes()` reads: (the meminfo file, [(limit, usage file, memory.stat
    file, the stat's inactive-file key)] of every cgroup of this process with a limit below the
    machine's memory). The host pool's node guard reads the same files itself, each time the pool
    grows."""
    total = memory_total_bytes()
    cgroups = []
    for version, folder in _cgroup_dirs():
        limit = _read_int(os.path.join(folder, "memory.max" if version == 2 else "memory.limit_in_bytes"))
        if limit is None or (total is not None and limit >= total):
            continue
        usage, key = _USAGE[version]
        cgroups.append((limit, os.path.join(folder, usage), os.path.join(folder, "memory.stat"), key))
    return _MEMINFO, cgroups


def _stat_value(path, key):
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _cgroup_usage_bytes():
    """What the cgroup with the least room left has left: its limit less its usage (v2
    `memory.current`, v1 `memory.usage_in_bytes`), the inactive file pages of its `memory.stat` not
    counted as used (page cache the kernel drops before it refuses memory, as `docker stats` counts
    it). None where no cgroup has a limit."""
    best = None
    for limit, usage, stat, key in available_sources()[1]:
        used = _read_int(usage)
        if used is None:
            continue
        used -= min(used, _stat_value(stat, key) or 0)
        if best is None or limit - used < best:
            best = limit - used
    return best


def memory_available_bytes():
    """What can still be allocated without swapping or the OOM killer: the kernel's `MemAvailable`,
    or less where the cgroup's limit leaves less (its inactive page cache counted as free, as the
    kernel reclaims it first). None where neither can be read."""
    available = _meminfo("MemAvailable")
    in_cgroup = _cgroup_usage_bytes()
    values = [v for v in (available, in_cgroup) if v is not None]
    return max(0, min(values)) if values else None


def numa_nodes():
    """How many NUMA nodes the machine has (folders node<N> under /sys/devices/system/node), or
    None where that cannot be read."""
    try:
        names = os.listdir(_NODES)
    except OSError:
        return None
    count = sum(1 for n in names if re.fullmatch(r"node\d+", n))
    return count or None


def _slurm_tasks_on_this_node(text, node):
    """The count for node `node` in a SLURM tasks-per-node list: "8", "8(x2)", "4,2", "8(x2),4"."""
    counts = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE must read like 8, 8(x2) or 4,2, got {text!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else counts[-1]


# The launchers' variables for the ranks on this node, in the order they are trusted: torchrun and
# accelerate, DeepSpeed's launcher, Open MPI, MPICH / Intel MPI, then SLURM's (a job step's first).
_RANK_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
              "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def local_world_size() -> int:
    """How many ranks of this job share the node, from the launcher's variables: `LOCAL_WORLD_SIZE`
    (torchrun, accelerate), `LOCAL_SIZE` (DeepSpeed's launcher), `OMPI_COMM_WORLD_LOCAL_SIZE` (Open
    MPI), `MPI_LOCALNRANKS` (MPICH, Intel MPI), SLURM's `SLURM_STEP_TASKS_PER_NODE`,
    `SLURM_NTASKS_PER_NODE` and `SLURM_TASKS_PER_NODE` (lists such as "8(x2)" or "4,2" read at this
    node's `SLURM_NODEID`); 1 when none is set. Never `WORLD_SIZE`, which counts every node's ranks.
    budget="auto", set_capacity("auto") and the estimate command all read it here."""
    name = local_world_size_variable()
    if name is not None:
        value = os.environ[name].strip()
        if name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            node = os.environ.get("SLURM_NODEID", "0").strip() or "0"
            n = _slurm_tasks_on_this_node(value, int(node) if node.isdigit() else 0)
        else:
            try:
                n = int(value)
            except ValueError:
                raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
        if n < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        return n
    return 1


def local_world_size_variable():
    """The launcher's variable local_world_size() reads (the first of them set, not empty), or None
    when none is set and 1 is assumed."""
    return next((name for name in _RANK_VARS if os.environ.get(name, "").strip() != ""), None)


def share_of(available, fraction: float, ranks: int):
    """One rank's share of a node's host memory: floor(available * fraction) // ranks (None where
    `available` is None). The one rule for what a rank may pin: budget="auto", set_capacity("auto")
    and the estimate command's "fits" all take it."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"host_share_bytes: fraction must be a number in (0, 1], got {fraction!r}")
    if available is None:
        return None
    return int(available * fraction) // max(1, int(ranks))


def host_share_bytes(fraction: float = 0.5):
    """This rank's share of the node's host memory: `share_of(memory_available_bytes(), fraction,
    local_world_size())`, the ranks of one node dividing what is available now (the cgroup's limit
    included) equally. None where the available memory cannot be read.

    fraction: the part of the available memory the node's ranks may pin together, in (0, 1]; the
    rest stays for the data loaders, the optimizer's host state and the page cache.
    """
    share_of(0, fraction, 1)  # the fraction checked before anything is read
    return share_of(memory_available_bytes(), fraction, local_world_size())
