"""Finds the CUDA toolkit for the build, also behind an `nvcc` on PATH that is only a wrapper script.

Standard library only: setup.py imports this file before torch's build helpers.
"""
import glob
import os
import re
import shutil


def _is_toolkit(path):
    if not path or not os.path.isfile(os.path.join(path, "include", "cuda_runtime_api.h")):
        return False
    libs = ["lib64/libcudart.so", "lib/libcudart.so", "targets/*/lib/libcudart.so", "lib/x64/cudart.lib"]
    return any(glob.glob(os.path.join(path, pattern)) for pattern in libs)


def _from_nvcc(nvcc):
    """Toolkit roots an nvcc points at: its real location, or paths named inside a wrapper script."""
    real = os.path.realpath(nvcc)
    yield os.path.dirname(os.path.dirname(real))
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        return
    if head.startswith(b"#!"):
        for match in re.finditer(rb"(/[^\s'\"]+)/bin/nvcc", head):
            yield match.group(1).decode(errors="replace")


def find_cuda_toolkit():
    """Returns the toolkit root, or None. CUDA_HOME/CUDA_PATH win when set, and must be valid."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            if not _is_toolkit(value):
                raise SystemExit(
                    f"ckpt_offload setup: {var}={value} is not a CUDA toolkit "
                    "(needs include/cuda_runtime_api.h and lib64/libcudart.so)"
                )
            return value
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.extend(_from_nvcc(nvcc))
    candidates.append("/usr/local/cuda")
    candidates.extend(sorted(glob.glob("/usr/local/cuda-*"), reverse=True))
    for path in candidates:
        if _is_toolkit(path):
            return os.path.realpath(path)
    return None
