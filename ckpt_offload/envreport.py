"""`python -m ckpt_offload env` (also `ckpt-offload env`): what this machine, its torch and this build
of ckpt_offload are, as the text block to paste into a bug report, or one JSON object (`--json`).

It runs where the compiled core, or torch itself, fails to import: the error is then part of the
report (`build.error`, `torch.error`). `--probe` adds a pinned-copy bandwidth check on a GPU.
"""
import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time

from .sizing import hostmem, nvidia
from ._args import command_name
from ._version import __version__

PACKAGES = ("transformers", "accelerate", "peft", "trl", "deepspeed", "mkdocs")
PROBE_SECONDS = 2.0  # per direction
PROBE_BYTES = 256 << 20


def _error(err):
    return f"{type(err).__name__}: {err}"


def _torch():
    try:
        import torch
    except Exception as err:  # an ImportError, or an OSError from a library torch loads
        return None, {"version": None, "cuda_runtime": None, "built_with_cuda": None, "error": _error(err)}
    return torch, {
        "version": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "built_with_cuda": torch.version.cuda is not None,
        "error": None,
    }


def _core():
    """The compiled core, or None, and the error that kept it from loading (the package keeps it)."""
    import ckpt_offload

    if ckpt_offload._load_error is not None:
        return None, _error(ckpt_offload._load_error)
    return ckpt_offload._C, None


def _build(torch, core, error):
    from . import _loader

    out = {"loaded": core is not None, "error": error, "location": os.path.dirname(os.path.abspath(__file__)),
           "source_checkout": _loader.source_checkout() is not None}
    record = _loader._record()
    out["record"] = None if record is None else {
        "torch_version": record.TORCH_VERSION, "with_cuda": record.WITH_CUDA, "cuda_version": record.CUDA_VERSION}
    if core is not None:
        import ckpt_offload

        out.update(ckpt_offload.build_info())
    built_for = out.get("torch_version") or (record.TORCH_VERSION if record is not None else None)
    out["matches_torch"] = (None if torch is None or built_for is None
                            else _loader._release(built_for) == _loader._release(torch.__version__))
    return out


def _cuda(torch):
    out = {"driver": nvidia.driver_version(), "available": False, "devices": [], "error": None}
    if torch is None or torch.version.cuda is None:
        return out
    try:
        out["available"] = torch.cuda.is_available()
        for i in range(torch.cuda.device_count() if out["available"] else 0):
            p = torch.cuda.get_device_properties(i)
            address = nvidia.pci_address(p.pci_domain_id, p.pci_bus_id, p.pci_device_id)
            out["devices"].append({
                "index": i,
                "name": p.name,
                "total_memory_bytes": p.total_memory,
                "compute_capability": f"{p.major}.{p.minor}",
                "pci_address": address,
                "pcie": nvidia.pcie_link(address),
                "numa_node": hostmem.gpu_numa_node(address),
            })
        if out["devices"]:
            out["current_device"] = torch.cuda.current_device()
    except Exception as err:  # a driver that fails to initialise is what the report is for
        out["error"] = _error(err)
    return out


def _numa(core, cuda):
    """Where this process's pool pins (or would pin) its memory: the placement made in this process
    (a training script's report()), else what the current GPU's node would give."""
    if core is not None:
        from . import engine

        if engine._numa is not None:
            return dict(engine._numa)
    index = cuda.get("current_device")
    address = next((d["pci_address"] for d in cuda["devices"] if d["index"] == index), None)
    try:
        out = hostmem.numa_placement(address)
    except ValueError as err:  # CKPT_OFFLOAD_NUMA set to something else
        return {"node": None, "cpus": [], "gpu_node": None, "pci_address": address, "reason": _error(err),
                "device": index}
    out["device"] = index
    return out


def _host(core, cuda):
    out = {
        "memory_total_bytes": hostmem.memory_total_bytes(),
        "memory_available_bytes": hostmem.memory_available_bytes(),
        "cgroup_limit_bytes": hostmem.cgroup_limit_bytes(),
        "numa_nodes": hostmem.numa_nodes(),
        "numa_placement": _numa(core, cuda),
        "pinning": hostmem.pinning_limits(),
        "pinned_in_use_bytes": None,
        "spill_dir": None,
        "capacity_bytes": None,
    }
    try:
        out["local_world_size"] = hostmem.local_world_size()
        out["local_world_size_from"] = hostmem.local_world_size_variable()  # None: unset, 1 assumed
    except ValueError as err:
        out["local_world_size"] = _error(err)
    if core is not None:
        # This process's pool: in a fresh `env` process nothing is pinned yet; report() called from a
        # training script shows that script's pool.
        pool = core.global_pool()
        stats = pool.stats()
        out["pinned_in_use_bytes"] = stats["in_use_bytes"]
        out["capacity_bytes"] = stats["capacity_bytes"]  # 0: no cap
        out["spill_dir"] = pool.spill_dir
    return out


def _packages():
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def settings():
    """Every CKPT_OFFLOAD_* environment variable that is set, with its value."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("CKPT_OFFLOAD_")}


def probe(torch, cuda):
    """Pinned-copy bandwidth of the current GPU, each direction for PROBE_SECONDS: GB/s (10^9 bytes)
    against the link's nominal rate."""
    if torch is None or not cuda["available"] or not cuda["devices"]:
        return {"ran": False, "reason": "no CUDA GPU: the bandwidth probe needs one"}
    index = torch.cuda.current_device()
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
    out = {"ran": True, "device": index, "bytes_per_copy": PROBE_BYTES, "seconds_per_direction": PROBE_SECONDS}
    stream = torch.cuda.Stream(index)
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)  # warm-up
            stream.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            copies, t0 = 0, time.perf_counter()
            start.record(stream)
            while time.perf_counter() - t0 < PROBE_SECONDS:
                for _ in range(4):
                    dst.copy_(src, non_blocking=True)
                copies += 4
                stream.synchronize()
            end.record(stream)
            end.synchronize()
        out[f"{name}_gb_per_s"] = round(copies * PROBE_BYTES / (start.elapsed_time(end) / 1e3) / 1e9, 2)
    nominal = next((d["pcie"]["nominal_gb_per_s"] for d in cuda["devices"] if d["index"] == index), None)
    out["nominal_gb_per_s"] = nominal
    for name in ("d2h", "h2d"):
        out[f"{name}_of_nominal"] = round(out[f"{name}_gb_per_s"] / nominal, 2) if nominal else None
    return out


def report(probe_bandwidth=False) -> dict:
    """The report as a dict: `ckpt_offload`, `python`, `platform`, `torch`, `build`, `cuda`, `host`,
    `packages`, `settings`, and `probe` with `probe_bandwidth=True`."""
    torch, torch_info = _torch()
    core, error = _core()
    cuda = _cuda(torch)
    out = {
        "ckpt_offload": __version__,
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": platform.platform(),
        "torch": torch_info,
        "build": _build(torch, core, error),
        "cuda": cuda,
        "host": _host(core, cuda),
        "packages": _packages(),
        "settings": settings(),
    }
    if probe_bandwidth:
        out["probe"] = probe(torch, cuda)
    return out


def _size(n):
    if n is None:
        return "unknown"
    return f"{n / 2**30:.1f} GiB ({n} bytes)"


def _placement(p):
    if p["node"] is None:
        return f"none: {p['reason']}"
    return f"node {p['node']} (CPUs {_cpus(p['cpus'])}): {p['reason']}"


def _cpus(cpus):
    """[0, 1, 2, 3, 8] as "0-3,8"."""
    runs = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _limits(p):
    memlock = "unlimited" if p["memlock_limit_bytes"] is None else f"{p['memlock_limit_bytes']} bytes"
    parts = [f"memlock {memlock} (ulimit -l)", "WSL: " + (
        f"yes, pinned allocations over about {p['wsl_pin_limit_bytes'] // 10**6} MB fail" if p["wsl"] else "no")]
    parts.append("WDDM: " + ("yes, the pool's pinned bytes count against the GPU's memory (budget='auto' subtracts them)"
                             if p["wddm"] else "no"))
    return "; ".join(parts)


def format_text(r: dict) -> str:
    """The report as the text block for a bug report."""
    t, b, c, h = r["torch"], r["build"], r["cuda"], r["host"]
    lines = [
        f"ckpt_offload:        {r['ckpt_offload']}",
        f"python:              {r['python']['version']} ({r['python']['implementation']}, {r['python']['executable']})",
        f"platform:            {r['platform']}",
        f"torch:               {t['version'] or 'does not import: ' + t['error']}"
        + (f", CUDA runtime {t['cuda_runtime']}" if t["cuda_runtime"] else ", built without CUDA" if t["version"] else ""),
    ]
    if b["loaded"]:
        variant = f"CUDA {b['cuda_version']}" if b["with_cuda"] else "host-only"
        lines.append(f"build:               {variant}, built for torch {b['torch_version']}"
                     f" ({'matches' if b['matches_torch'] else 'does NOT match'} the running torch),"
                     f" CUDA usable: {b['cuda_usable']}, test path: {b['test_path']}")
    else:
        lines.append(f"build:               does not load: {b['error']}")
    lines.append(f"package at:          {b['location']}" + (" (source checkout)" if b["source_checkout"] else ""))
    lines.append(f"NVIDIA driver:       {c['driver'] or 'none found'}")
    if c["error"]:
        lines.append(f"CUDA error:          {c['error']}")
    if not c["devices"]:
        lines.append("GPUs:                none visible to torch")
    for d in c["devices"]:
        link = d["pcie"]
        pcie = (f"PCIe gen {link['gen']} x{link['width']} ({link['nominal_gb_per_s']} GB/s per direction;"
                f" max gen {link['max_gen']} x{link['max_width']}, from {link['source']})"
                if link["gen"] else "PCIe link unknown")
        node = f"NUMA node {d['numa_node']}" if d["numa_node"] is not None else "NUMA node unknown"
        lines.append(f"GPU {d['index']}:               {d['name']}, {_size(d['total_memory_bytes'])}, "
                     f"compute {d['compute_capability']}, {d['pci_address']}, {node}, {pcie}")
    lines += [
        f"host memory:         {_size(h['memory_total_bytes'])} total, {_size(h['memory_available_bytes'])} available",
        f"cgroup limit:        {_size(h['cgroup_limit_bytes']) if h['cgroup_limit_bytes'] is not None else 'none'}",
        f"NUMA nodes:          {h['numa_nodes'] if h['numa_nodes'] is not None else 'unknown'}",
        f"pool NUMA placement: {_placement(h['numa_placement'])}",
        f"pinning limits:      {_limits(h['pinning'])}",
        f"LOCAL_WORLD_SIZE:    {_ranks_per_node(h)}",
        f"pinned in use:       {h['pinned_in_use_bytes'] if h['pinned_in_use_bytes'] is not None else 'n/a'} bytes"
        f" (cap: {h['capacity_bytes'] or 'none'}; spill dir: {h['spill_dir'] or 'none'})",
        "packages:            " + ", ".join(f"{k} {v or '-'}" for k, v in r["packages"].items()),
        "settings:            " + (", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "no CKPT_OFFLOAD_* set"),
    ]
    if "probe" in r:
        p = r["probe"]
        if not p["ran"]:
            lines.append(f"bandwidth probe:     not run: {p['reason']}")
        else:
            of = (lambda k: f" ({p[k]:.0%} of nominal {p['nominal_gb_per_s']} GB/s)" if p[k] is not None else "")
            lines.append(f"bandwidth probe:     GPU {p['device']}, pinned, {PROBE_SECONDS:g} s a direction: "
                         f"D2H {p['d2h_gb_per_s']} GB/s{of('d2h_of_nominal')}, H2D {p['h2d_gb_per_s']} GB/s{of('h2d_of_nominal')}")
    return "\n".join(lines)


def _ranks_per_node(h):
    """The ranks per node as the launcher set them (and which variable), or "unset" with what is assumed."""
    source = h.get("local_world_size_from")
    if source is None and isinstance(h["local_world_size"], int):
        return "unset (no launcher variable says how many ranks share this node: 1 assumed)"
    return f"{h['local_world_size']}" + (f" (from {source})" if source else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{command_name()} env",
        description="What this machine, its torch and this build of ckpt_offload are: paste it into a bug report.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text block")
    parser.add_argument("--probe", action="store_true",
                        help=f"measure pinned-copy bandwidth on the GPU, {PROBE_SECONDS:g} s per direction")
    args = parser.parse_args(argv)
    r = report(probe_bandwidth=args.probe)
    print(json.dumps(r, indent=2) if args.json else format_text(r))
    return 0
