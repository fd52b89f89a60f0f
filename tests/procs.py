"""Helpers for tests that start processes: a free local port, whether this torch has FSDP2, and
waiting for spawned ranks with a bound on a hang."""
import socket
import time

import pytest
import torch


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_ranks(ctx, world, tmp_path, timeout_s, what="the ranks"):
    """Waits for torch.multiprocessing.start_processes(..., join=False)'s ranks (a failed rank raises
    with its traceback), fails the test after timeout_s (a hang), kills what is left, and returns
    each rank's tmp_path / f"rank{r}.pt"."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not finish within {timeout_s} s (hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
