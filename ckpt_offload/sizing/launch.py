"""The job the estimate sizes one rank of: its ranks, ranks per node and context parallelism, from the
command's options, accelerate's config file (read by accelerate's own loader) and the launcher's
environment (hostmem's one reader of the launcher's variables)."""
from __future__ import annotations

from . import hostmem


class LaunchError(ValueError):
    pass


def accelerate_config(path) -> dict:
    """What an `accelerate launch` config file (YAML or JSON, as `accelerate config` writes it) says of
    the job, read by accelerate's own `load_config_from_file`: `ranks` (num_processes, when set),
    `ranks_per_node` (num_processes / num_machines), `cp` (parallelism_config's
    `parallelism_config_cp_size`), `shard` (`"fsdp"` or `"zero2"` for FSDP, else None)."""
    try:
        from accelerate.commands.config.config_args import load_config_from_file
    except ImportError as e:
        raise LaunchError(f"--accelerate-config {path!r} is read with accelerate, which does not import here: {e}") \
            from None
    try:
        cfg = load_config_from_file(path)
    except FileNotFoundError:
        raise LaunchError(f"--accelerate-config {path!r}: no such file") from None
    except IsADirectoryError:
        raise LaunchError(f"--accelerate-config {path!r} is a directory; give the config file") from None
    except Exception as e:  # yaml's and the config dataclasses' own errors: the file is not one accelerate reads
        raise LaunchError(f"--accelerate-config {path!r}: accelerate cannot read it: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    out = {}
    processes, machines = getattr(cfg, "num_processes", -1), getattr(cfg, "num_machines", 1) or 1
    if isinstance(processes, int) and processes > 0:
        out["ranks"] = processes
        out["ranks_per_node"] = max(1, processes // machines)
    parallel = getattr(cfg, "parallelism_config", None) or {}
    cp = parallel.get("parallelism_config_cp_size", 1)
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise LaunchError(f"--accelerate-config {path!r}: parallelism_config_cp_size must be a positive "
                          f"integer, got {cp!r}")
    out["cp"] = cp
    kind = str(getattr(cfg, "distributed_type", "")).rsplit(".", 1)[-1].upper()
    if kind == "FSDP":
        fsdp = getattr(cfg, "fsdp_config", None) or {}
        strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
        if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "1", "2"):
            raise LaunchError(f"--accelerate-config {path!r}: fsdp_sharding_strategy {strategy} is not sized (full "
                              f"and gradient-and-state sharding are); pass --shard")
        reshard = str(fsdp.get("fsdp_reshard_after_forward", True)).lower()
        out["shard"] = "zero2" if strategy in ("SHARD_GRAD_OP", "2") or reshard == "false" else "fsdp"
    return out


def job(ranks=None, ranks_per_node=None, cp=None, accelerate_file=None) -> dict:
    """The job, each figure from the first that says it: the option, the accelerate config file, the
    launcher's environment. Returns `ranks` (the job's, or None where nothing says), `ranks_per_node`,
    `cp` (1 without context parallelism), `shard_kind` (the config file's, or None) and `sources`."""
    acc = accelerate_config(accelerate_file) if accelerate_file else {}
    out = {"sources": {}}
    if ranks is not None:
        out["ranks"], out["sources"]["ranks"] = ranks, "--ranks"
    elif "ranks" in acc:
        out["ranks"], out["sources"]["ranks"] = acc["ranks"], "--accelerate-config"
    elif hostmem.world_size() is not None:
        out["ranks"], out["sources"]["ranks"] = hostmem.world_size(), "the launcher's WORLD_SIZE"
    elif ranks_per_node is not None:
        out["ranks"], out["sources"]["ranks"] = ranks_per_node, "--ranks-per-node (one node)"
    else:
        out["ranks"] = None
    if ranks_per_node is not None:
        out["ranks_per_node"] = ranks_per_node
    elif "ranks_per_node" in acc:
        out["ranks_per_node"] = acc["ranks_per_node"]
    else:
        out["ranks_per_node"] = hostmem.local_world_size()
    out["cp"] = cp if cp is not None else acc.get("cp", 1)
    if out["ranks"] is None and out["cp"] > 1:
        # Context parallelism alone: a job of the cp group's ranks.
        out["ranks"], out["sources"]["ranks"] = out["cp"], "--cp (a job of its ranks alone)"
    if out["ranks"] is not None and out["ranks"] % out["cp"]:
        raise LaunchError(f"--cp {out['cp']} does not divide the job's {out['ranks']} ranks "
                          f"({out['sources']['ranks']})")
    out["shard_kind"] = acc.get("shard")
    return out
