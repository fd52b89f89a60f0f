"""The machine a benchmark ran on, recorded in its JSON: Python, torch, CUDA, CPU and GPU, the
extension's build, the date and the command line.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch

import ckpt_offload


def hardware_info():
    info = dict(python=platform.python_version(), torch=torch.__version__, cuda_runtime=torch.version.cuda,
                cpu=cpu_model(), cpu_count=os.cpu_count(), gpu=None, gpu_driver=None)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, gpu_capability=f"{p.major}.{p.minor}")
        q = "driver_version,pcie.link.gen.current,pcie.link.width.current"
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["gpu_driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
        except (OSError, subprocess.SubprocessError):
            pass  # no nvidia-smi: the driver stays unknown
    info["ckpt_offload_build"] = ckpt_offload.build_info()
    info["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info["command"] = " ".join([sys.executable] + sys.argv)
    return info


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def select_device(cuda: bool) -> torch.device:
    """The device a benchmark runs on. Without a GPU: the CPU path, with CPU tensors through the pool
    and engine (CKPT_OFFLOAD_TEST_CPU=1, read when a session is created) and one intra-op thread
    (tiny tensors; extra threads only spin against other processes)."""
    if not cuda:
        os.environ["CKPT_OFFLOAD_TEST_CPU"] = "1"
        torch.set_num_threads(1)
    return torch.device("cuda" if cuda else "cpu")
