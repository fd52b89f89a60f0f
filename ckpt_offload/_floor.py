"""The oldest torch and CUDA toolkit ckpt_offload builds against (docs/compatibility.md says what was tested).

Standard library only, but for packaging: setup.py and CMakeLists.txt read it before any build helper runs.
"""
TORCH_MIN = "2.11"
# host_pool.cpp asks the runtime for driver entry points with a query result: CUDA 12.0 and newer
# (12.5 and newer through cudaGetDriverEntryPointByVersion, the only one CUDA 13 keeps).
CUDA_MIN = (12, 0)


def torch_too_old(version: str) -> bool:
    """Whether a torch version ("2.11.0+cu130", "2.12.0a0+git...") is a release below TORCH_MIN."""
    from packaging.version import Version

    return Version(Version(version).base_version) < Version(TORCH_MIN)


def torch_message(where: str, version: str) -> str:
    return (f"{where}: torch {version} is older than {TORCH_MIN}, the oldest release ckpt_offload supports; "
            f"install torch>={TORCH_MIN}")


def cuda_message(where: str, version, toolkit: str) -> str:
    found = ".".join(map(str, version)) if version else "unknown"
    return (f"{where}: the CUDA toolkit at {toolkit} is {found}, older than "
            f"{'.'.join(map(str, CUDA_MIN))}, the oldest ckpt_offload builds against; set CUDA_HOME to a newer "
            "toolkit, or build host-only with CKPT_OFFLOAD_WITH_CUDA=0")
