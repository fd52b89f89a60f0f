"""ckpt_offload: gradient checkpointing with activations offloaded asynchronously to pinned host memory."""
from ._loader import load as _load

_C = _load()
HostPool = _C.HostPool
CopyEngine = _C.CopyEngine


def build_info():
    """How the compiled core was built: torch_version, cuda_version (None host-only), with_cuda."""
    return dict(_C.build_info())
