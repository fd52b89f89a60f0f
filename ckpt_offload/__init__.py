"""ckpt_offload: gradient checkpointing with activations offloaded asynchronously to pinned host memory.

Three ways in: checkpoint() for one call, enable_checkpointing() for a model's repeated blocks,
offload_activations() around any forward pass. integrations.hf, .trl and .accelerate plug into
transformers, TRL (activation_offloading=True) and accelerate (FSDP2 activation_checkpointing_offload=True).
"""
from ._version import __version__  # noqa: F401  (public: ckpt_offload.__version__)
from . import engine as _engine

# The compiled core, or where it did not load (not built, built for another torch) the error saying
# why: everything imports without it, and what needs it raises that error when used. Sizing
# (estimate_memory, `python -m ckpt_offload estimate`) runs on the meta device and needs none.
_C = _engine._C
_load_error = _engine.load_error

from .checkpointing import checkpoint  # noqa: E402
from .engine import engine_for, host_pool, poll, profile, reset_stats, stats, synchronize  # noqa: E402
from .activations import offload_activations  # noqa: E402
from .session import OffloadSession  # noqa: E402
from .model import checkpointing_state, disable_checkpointing, enable_block_modes, enable_checkpointing, find_repeated_blocks  # noqa: E402
from .reserve import reserve_for  # noqa: E402
from .planner import MemoryPlan  # noqa: E402
from .sizing.plan import plan_memory  # noqa: E402
from .sizing.estimate import MemoryEstimate, estimate_memory  # noqa: E402
# The function shadows its module's name in the package (the module stays in sys.modules).
from .timeline import Timeline, timeline  # noqa: E402

_CORE_CLASSES = ("HostPool", "HostBlock", "CopyEngine", "OffloadHandle")
if _load_error is None:
    HostPool = _C.HostPool
    HostBlock = _C.HostBlock
    CopyEngine = _C.CopyEngine
    OffloadHandle = _C.OffloadHandle


def __getattr__(name):
    if name in _CORE_CLASSES:  # only reached where the core did not load
        return getattr(_C, name)
    raise AttributeError(f"module 'ckpt_offload' has no attribute {name!r}")


def build_info():
    """How the compiled core was built, and what it finds now.

    Returns:
        dict: `torch_version` (str, the torch it was built against), `cuda_version` (str, or None
            for a host-only build), `with_cuda` (bool, the CUDA variant was built), `cuda_usable`
            (bool, a driver and a device are there now) and `test_path` (str, the runtime a CPU
            engine created now gets: `"off"`, `"sync"` with `CKPT_OFFLOAD_TEST_CPU=1`, `"async-sim"`
            with `CKPT_OFFLOAD_TEST_ASYNC=1` too; engines read the switches when they are created).
    """
    info = dict(_C.build_info())
    info["cuda_usable"] = _C.cuda_usable()
    info["test_path"] = _C.test_path()
    return info


__all__ = [
    "checkpoint",
    "enable_checkpointing",
    "enable_block_modes",
    "plan_memory",
    "MemoryPlan",
    "estimate_memory",
    "MemoryEstimate",
    "disable_checkpointing",
    "checkpointing_state",
    "find_repeated_blocks",
    "offload_activations",
    "OffloadSession",
    "stats",
    "reset_stats",
    "profile",
    "synchronize",
    "poll",
    "timeline",
    "Timeline",
    "engine_for",
    "host_pool",
    "reserve_for",
    "build_info",
    "HostPool",
    "HostBlock",
    "CopyEngine",
    "OffloadHandle",
]
if _load_error is not None:  # `from ckpt_offload import *` without the core: what exists
    __all__ = [n for n in __all__ if n not in _CORE_CLASSES]
