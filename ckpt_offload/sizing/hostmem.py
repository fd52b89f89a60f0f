"""What this node's host memory is: total, available, the cgroup's limit, NUMA nodes, and how many
ranks of a job share it; what limits pinning apart from RAM (the memlock limit, WSL, Windows' WDDM);
which NUMA node a GPU sits on. Read from /proc and /sys (Linux); None where a figure cannot be read.

One place for these facts: `python -m ckpt_offload env` reports them and `budget="auto"` divides
them among the node's ranks.
"""
import os
import re
import sys

_MEMINFO = "/proc/meminfo"
_CGROUP_ROOT = "/sys/fs/cgroup"
_SELF_CGROUP = "/proc/self/cgroup"
_NODES = "/sys/devices/system/node"
_PROC_VERSION = "/proc/version"
_PLATFORM = sys.platform
# Tests point these at a stand-in tree (and a stand-in platform).
# The root the NUMA readings start from (sys/bus/pci/devices, sys/devices/system/{node,cpu}); the
# functions below take `root=` to read a stand-in tree instead.
SYSFS_ROOT = "/"
# CKPT_OFFLOAD_NUMA: "auto" (the default) places the pool on the GPU's node, "off" never does.
NUMA_ENV = "CKPT_OFFLOAD_NUMA"
# WSL2 refuses pinned allocations above about this size whatever the memlock limit (microsoft/WSL #14078).
WSL_PIN_LIMIT_BYTES = 500 * 10**6


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


def numa_nodes(root=None):
    """How many NUMA nodes the machine has (folders node<N> under /sys/devices/system/node, or
    under `root`/sys/devices/system/node), or None where that cannot be read."""
    try:
        names = os.listdir(_NODES if root is None else os.path.join(root, "sys", "devices", "system", "node"))
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
    n = launcher_ranks(_RANK_VARS)
    return 1 if n is None else n


# The job's ranks on every node: torchrun, accelerate and DeepSpeed's launcher, Open MPI, MPICH / Intel
# MPI, SLURM.
_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def world_size():
    """How many ranks the whole job has, from the launcher's variables: `WORLD_SIZE` (torchrun,
    accelerate, DeepSpeed's launcher), `OMPI_COMM_WORLD_SIZE` (Open MPI), `PMI_SIZE` (MPICH, Intel
    MPI), `SLURM_NTASKS`; None when none is set. The estimate command divides sharded parts by it."""
    return launcher_ranks(_WORLD_VARS)


def launcher_ranks(names):
    """The first of these launcher variables that is set, as a rank count (SLURM's per-node lists read
    at this node's `SLURM_NODEID`), or None when none is set. The one reader of ranks per node and of
    the job's ranks."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value == "":
            continue
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
    return None


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


# -- what limits pinning apart from RAM ------------------------------------------------------------
def memlock_limit_bytes():
    """This process's soft `RLIMIT_MEMLOCK` in bytes (`ulimit -l` shows it in KiB), or None where it
    is unlimited or the platform has none. The CUDA driver pins through its own module and is not
    always held to it, but containers with a low limit refuse pinned allocations past it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def is_wsl(version_path=None) -> bool:
    """Whether this is Linux under Windows' WSL: /proc/version names Microsoft or WSL."""
    try:
        with open(version_path or _PROC_VERSION) as f:
            text = f.read().lower()
    except OSError:
        return False
    return "microsoft" in text or "wsl" in text


def is_wddm(platform=None) -> bool:
    """Whether the GPU runs under Windows' WDDM driver model, which counts pinned host memory
    against the GPU's own memory: taken as true on Windows (`sys.platform`, or `platform` given),
    where WDDM is the default for every GPU not switched to TCC."""
    return (platform if platform is not None else _PLATFORM).startswith(("win", "cygwin"))


def pinning_limits(version_path=None, platform=None) -> dict:
    """What limits pinned memory here besides RAM: `memlock_limit_bytes` (None: unlimited), `wsl`,
    `wsl_pin_limit_bytes` (the largest pinned allocation WSL2 is known to grant, None off WSL) and
    `wddm` (pinned bytes count against the GPU's memory)."""
    wsl = is_wsl(version_path)
    return {"memlock_limit_bytes": memlock_limit_bytes(), "wsl": wsl,
            "wsl_pin_limit_bytes": WSL_PIN_LIMIT_BYTES if wsl else None, "wddm": is_wddm(platform)}


def pinning_advice(limits=None) -> str:
    """One sentence naming the limits in force and the settings that change them, for the messages
    that report a refused pinned allocation."""
    limits = pinning_limits() if limits is None else limits
    found = []
    if limits["memlock_limit_bytes"] is not None:
        found.append(f"the memlock limit is {limits['memlock_limit_bytes']} bytes (raise it: `ulimit -l unlimited`, "
                     "or `docker run --ulimit memlock=-1`)")
    if limits["wsl"]:
        found.append(f"this is WSL, which refuses pinned allocations over about {WSL_PIN_LIMIT_BYTES // 10**6} MB "
                     "whatever the memlock limit")
    if limits["wddm"]:
        found.append("under Windows' WDDM pinned memory counts against the GPU's own memory")
    where = "; ".join(found) if found else "no memlock limit or WSL found; the system's pinnable memory ran out"
    return (f"Pinned memory is limited here: {where}. Cap the pool below the limit with "
            "host_pool().set_capacity(bytes), or give it a disk tier with host_pool().set_spill_dir(path) "
            "(docs: troubleshooting, pinned memory).")


# -- NUMA: the node of a GPU -----------------------------------------------------------------------
def parse_cpulist(text):
    """The CPUs of a sysfs cpulist ("0-3,8,10-11"), as a sorted list; None where it is not one."""
    text = (text or "").strip()
    if not text:
        return []
    cpus = set()
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if not m:
            return None
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            return None
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def _sys_read(root, *parts):
    try:
        with open(os.path.join(root if root is not None else SYSFS_ROOT, "sys", *parts)) as f:
            return f.read().strip()
    except OSError:
        return None


def gpu_numa_node(pci_address, root=None):
    """The NUMA node of the PCI device `pci_address` ("0000:3b:00.0"): its numa_node file under
    sys/bus/pci/devices; None where unknown (no such file, or -1, the kernel's "no node")."""
    text = _sys_read(root, "bus", "pci", "devices", pci_address.lower(), "numa_node")
    if text is None or not re.fullmatch(r"-?\d+", text) or int(text) < 0:
        return None
    return int(text)


def node_cpus(node, root=None):
    """The CPUs of NUMA node `node` (sys/devices/system/node/node<N>/cpulist); None where unreadable."""
    return parse_cpulist(_sys_read(root, "devices", "system", "node", f"node{node}", "cpulist"))


def numa_setting(environ=None) -> str:
    """CKPT_OFFLOAD_NUMA: "auto" (unset) or "off". Raises ValueError on anything else."""
    value = (os.environ if environ is None else environ).get(NUMA_ENV, "").strip().lower()
    if value in ("", "auto", "on", "1"):
        return "auto"
    if value in ("off", "0", "none"):
        return "off"
    raise ValueError(f"{NUMA_ENV} must be 'auto' or 'off', got {value!r}")


def numa_placement(pci_address, *, root=None, affinity=None, environ=None) -> dict:
    """Where the host pool of a rank whose GPU is at `pci_address` pins its memory.

    The GPU's node and its CPUs come from sysfs (under `root`, default "/"). A binding the user made
    wins: when the process's CPU affinity (`affinity`, default `os.sched_getaffinity(0)`) is narrower
    than every online CPU (numactl, taskset, a launcher's binding), or CKPT_OFFLOAD_NUMA=off, nothing
    is placed.

    Returns:
        dict: `node` (int, or None where nothing is placed), `cpus` (the node's CPUs the allocating
            thread binds to while the pool grows; empty when nothing is placed), `gpu_node` (the
            GPU's node as sysfs reads, or None), `reason` (why this node, or why none).
    """
    root = SYSFS_ROOT if root is None else root
    out = {"node": None, "cpus": [], "gpu_node": None, "pci_address": pci_address}
    if numa_setting(environ) == "off":
        return {**out, "reason": f"{NUMA_ENV}=off"}
    if pci_address is None:
        return {**out, "reason": "no CUDA device"}
    gpu = out["gpu_node"] = gpu_numa_node(pci_address, root)
    nodes = numa_nodes(root)
    if nodes is None or nodes < 2:
        return {**out, "reason": "one NUMA node" if nodes == 1 else "NUMA nodes not readable"}
    if gpu is None:
        return {**out, "reason": f"the GPU's NUMA node is unknown (sysfs numa_node of {pci_address})"}
    cpus = node_cpus(gpu, root)
    if not cpus:
        return {**out, "reason": f"node {gpu} lists no CPUs"}
    online = parse_cpulist(_sys_read(root, "devices", "system", "cpu", "online"))
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity is not None and online and set(online) - set(affinity):
        return {**out, "reason": f"the process's CPU affinity was set outside ckpt_offload ({len(affinity)} of "
                                 f"{len(online)} CPUs: numactl, taskset or the launcher); it is left as it is"}
    return {**out, "node": gpu, "cpus": cpus, "reason": f"the GPU's node (sysfs, {pci_address})"}
