"""Loads the compiled core, ckpt_offload._C, and checks it was built for the torch that is running."""
import torch
from packaging.version import Version

from ._floor import torch_message, torch_too_old

REBUILD = "pip install --no-build-isolation -e .   (in the ckpt_offload source folder)"


def _record():
    try:
        from . import _build_info
    except ImportError:
        return None
    return _build_info


def _release(version):
    # 2.14.1+cu130 and 2.14.1 are the same release; a local tag alone does not change the ABI
    # of the headers the extension compiled against, the public version does.
    return Version(version).public


def load():
    record = _record()
    installed = torch.__version__
    if torch_too_old(installed):
        raise ImportError(torch_message("ckpt_offload", installed))
    if record is not None and _release(record.TORCH_VERSION) != _release(installed):
        raise ImportError(
            f"ckpt_offload._C was built for torch {record.TORCH_VERSION} but torch {installed} is installed; "
            f"rebuild it: {REBUILD}"
        )
    try:
        from . import _C
    except ImportError as err:
        built_for = record.TORCH_VERSION if record is not None else "no build record: never built"
        raise ImportError(
            f"ckpt_offload._C could not be loaded ({err}). Built for torch: {built_for}; installed: torch "
            f"{installed}. Build it with: {REBUILD}"
        ) from err
    return _C
