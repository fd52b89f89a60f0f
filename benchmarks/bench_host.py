"""Host-overhead benchmark: the host time of one training step (forward + backward) of tiny models,
whose compute is negligible, under every checkpointing and offload mode side by side in one run,
each against the mode it replaces; on a GPU also the device time, and whether the step was host-bound.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import functools
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import torch
import torch.utils.checkpoint as tuc

if not __package__:  # run as a script: find the benchmarks package beside it
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _ROOT not in sys.path:
        sys.path.append(_ROOT)

import ckpt_offload  # noqa: E402
from benchmarks.hardware import hardware_info, select_device  # noqa: E402
from benchmarks.hf import HFLoss, build_hf_model, hf_support  # noqa: E402
from benchmarks.model import Decoder, make_ids  # noqa: E402
from benchmarks.modes import sync_offload_call  # noqa: E402
from benchmarks.report import CPU_LABEL, fmt_ratio, print_table  # noqa: E402
from benchmarks.timing import host_timed_step, interleaved_timing, train_step  # noqa: E402

# Tiny shapes: the host's bookkeeping per layer and per saved tensor dominates the step.
MLP_STACK = dict(layers=32, hidden=64, mlp=256, batch=1, vocab=64)
DECODER = dict(layers=8, hidden=64, heads=4, kv_heads=2, mlp=128, batch=1, vocab=64, rope=True)
LLAMA = dict(layers=16, hidden=64, heads=4, kv_heads=2, mlp=128, batch=1, vocab=64)

# group -> (model, reference mode, modes): each mode's host time is judged against its group's
# reference, the code it replaces, on a model of the same weights.
GROUPS = {
    "checkpoint": ("mlp", "torch_checkpoint", ["torch_checkpoint", "save_on_cpu+checkpoint", "checkpoint(offload)",
                                               "enable(offload=False)", "enable(offload=True)"]),
    "no_checkpoint": ("mlp", "save_on_cpu", ["none", "save_on_cpu", "offload_activations"]),
    "attention": ("decoder", "torch_sac(attention)", ["torch_sac(attention)", "enable(offload=True)",
                                                      "enable(policy=attention)"]),
    "hf": ("llama", "hf_gc", ["hf_gc", "hf_gc_offload", "hf.enable(offload=True)", "hf.enable(offload=False)"]),
}
MODELS = {"mlp": "blocks of LayerNorm + GELU MLP, hidden 64",
          "decoder": "decoder blocks (RMSNorm, attention through SDPA, SwiGLU), hidden 64",
          "llama": "transformers LlamaForCausalLM layers, hidden 64"}
MODE_HELP = {
    "torch_checkpoint": "torch.utils.checkpoint (non-reentrant) around every block",
    "save_on_cpu+checkpoint": "the same inside torch's save_on_cpu(pin_memory=True) (transformers' offload=True)",
    "checkpoint(offload)": "ckpt_offload.checkpoint(block, x, offload=True) around every block",
    "enable(offload=False)": "ckpt_offload.enable_checkpointing(model, offload=False)",
    "enable(offload=True)": "ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)",
    "torch_sac(attention)": "torch's selective checkpoint around every block, attention outputs saved on the device",
    "enable(policy=attention)": "enable_checkpointing(offload=True, keep_last=1, policy='attention'): attention "
                                "outputs offloaded, not recomputed",
    "none": "no checkpointing, nothing offloaded",
    "save_on_cpu": "no checkpointing, torch's save_on_cpu(pin_memory=True) around the forward",
    "offload_activations": "no checkpointing, ckpt_offload.offload_activations(min_bytes=0) around the forward",
    "hf_gc": "transformers' own checkpointing (every layer, non-reentrant)",
    "hf_gc_offload": "transformers' own checkpointing with offload=True (save_on_cpu)",
    "hf.enable(offload=True)": "ckpt_offload.integrations.hf.enable(model, offload=True, keep_last=1)",
    "hf.enable(offload=False)": "ckpt_offload.integrations.hf.enable(model, offload=False)",
}
# --breakdown: enable(offload=True) with parts of it switched off through the attachment's internals
# (diagnostics, not configurations a user picks), to tell where its host time goes.
BREAKDOWN = {
    "enable(no midpoints)": "enable(offload=True) with the midpoints removed: each layer's reloads start where its "
                            "backward starts",
    "enable(nothing moved)": "enable(offload=True) with min_bytes above every tensor: the session's hooks and "
                             "bookkeeping, nothing copied",
    "enable(neither)": "both: the session's hooks around torch's checkpoint, no midpoints, nothing copied",
}
MODE_HELP.update(BREAKDOWN)
# The targets: (group, mode, host time over the group's reference at most).
TARGETS = [("checkpoint", "enable(offload=True)", 1.05), ("checkpoint", "enable(offload=False)", 1.02),
           ("hf", "hf.enable(offload=True)", 1.05), ("no_checkpoint", "offload_activations", 1.10)]
# The modes that offload through ckpt_offload: each must have moved something in its untimed step.
OURS = ("checkpoint(offload)", "enable(offload=True)", "enable(policy=attention)", "offload_activations",
        "hf.enable(offload=True)")
HOST_BOUND = 1.10  # device time within 10% of host time: the device waited for the host


def _sac_attention():
    """torch's own selective checkpoint that saves the fused attention ops' outputs on the device."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return tuc.CheckpointPolicy.MUST_SAVE if op in ops else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(tuc.create_selective_checkpoint_contexts, policy)


def stack_mode(model, mode):
    """Puts a benchmarks.model.Decoder in `mode` (a model of its own, once); returns its forward context."""
    ctx = contextlib.nullcontext
    if mode == "torch_checkpoint":
        model.layer_call = lambda block, x: tuc.checkpoint(block, x, use_reentrant=False)
    elif mode == "save_on_cpu+checkpoint":
        model.layer_call = sync_offload_call
    elif mode == "checkpoint(offload)":
        model.layer_call = lambda block, x: ckpt_offload.checkpoint(block, x, offload=True)
    elif mode == "torch_sac(attention)":
        context = _sac_attention()
        model.layer_call = lambda block, x: tuc.checkpoint(block, x, use_reentrant=False, context_fn=context)
    elif mode in BREAKDOWN:
        ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1, layers=list(model.layers))
        att = ckpt_offload.attachment.find(model)
        if mode != "enable(nothing moved)":
            att.handles.remove(att.midpoints)
            att.midpoints.remove()
            att.midpoints = None
            att.session.defer_prefetch = False
        if mode != "enable(no midpoints)":
            att.session.min_bytes = 1 << 62
    elif mode.startswith("enable("):
        ckpt_offload.enable_checkpointing(model, offload=mode != "enable(offload=False)", keep_last=1,
                                          layers=list(model.layers),
                                          policy="attention" if "attention" in mode else None)
    elif mode == "save_on_cpu":
        ctx = lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)  # noqa: E731
    elif mode == "offload_activations":
        ctx = lambda: ckpt_offload.offload_activations(min_bytes=0)  # noqa: E731
    elif mode != "none":
        raise ValueError(f"bench_host: unknown mode {mode!r}")
    return ctx


def llama_mode(model, mode, hf):
    if mode == "hf_gc":
        hf.checkpointing_enable(model, {"use_reentrant": False})
    elif mode == "hf_gc_offload":
        hf.checkpointing_enable(model, {"use_reentrant": False}, offload=True)
    else:
        hf.enable(model, offload=mode == "hf.enable(offload=True)", keep_last=1)
    return contextlib.nullcontext


def build(a, device):
    """One model per mode, each configured once (the same weights within a group): what a mode
    does once per model then stays out of the timed steps, as in training. Returns
    ({"group:mode": (model, ids, ctx)}, {group: layers}, notes)."""
    prepared, layers, notes = {}, {}, []
    bases = {}
    for group in a.group_list:
        kind, _, modes = GROUPS[group]
        modes = modes + (list(BREAKDOWN) if a.breakdown and group == "checkpoint" else [])
        if kind == "llama":
            support, note = hf_support()
            if support is None:
                notes.append(f"{group}: {note}")
                continue
            transformers, hf, _ = support
            cfg = SimpleNamespace(**{**LLAMA, "layers": a.hf_layers}, seq_list=[a.seq])
            if kind not in bases:
                bases[kind] = build_hf_model(transformers, cfg, device, torch.float32)
            configure = lambda m, mode, hf=hf: (HFLoss(m), llama_mode(m, mode, hf))  # noqa: E731
        else:
            shape = MLP_STACK if kind == "mlp" else DECODER
            cfg = SimpleNamespace(**{**shape, "layers": a.layers if kind == "mlp" else a.decoder_layers})
            if kind not in bases:
                torch.manual_seed(0)
                bases[kind] = Decoder(cfg, device, torch.float32, block="mlp" if kind == "mlp" else "transformer").train()
            configure = lambda m, mode: (m, stack_mode(m, mode))  # noqa: E731
        ids = make_ids(SimpleNamespace(vocab=cfg.vocab, batch=cfg.batch), a.seq, device)
        layers[group] = cfg.layers
        for mode in modes:
            model, ctx = configure(copy.deepcopy(bases[kind]), mode)
            prepared[f"{group}:{mode}"] = (model, ids, ctx)
    return prepared, layers, notes


def offloaded_per_step(model, ids, ctx, cuda):
    """Tensors and bytes ckpt_offload moved in one untimed step: a mode that should offload and moved
    nothing would be timing nothing."""
    ckpt_offload.synchronize()
    ckpt_offload.reset_stats()
    train_step(model, ids, ctx)
    if cuda:
        torch.cuda.synchronize()
    ckpt_offload.synchronize()
    s = ckpt_offload.stats()
    return s["tensors_offloaded"], s["bytes_offloaded"]


def summarize(steps, key):
    xs = [x[key] for x in steps if x[key] is not None]
    if not xs:
        return None
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs))


def evaluate(rows, layers, key):
    """Per mode: its host time's ratio to its group's reference (median over median, and the range of
    the paired rounds), microseconds per layer above it; on a GPU host-bound or not. Then the targets.
    key: the host time judged, "host_ms" (wall) on a GPU, "cpu_ms" (the process's CPU time) on a CPU."""
    by = {(r["group"], r["mode"]): r for r in rows if key in r}
    for (group, mode), r in by.items():
        ref = by.get((group, GROUPS[group][1]))
        r["reference"] = GROUPS[group][1]
        if ref is not None:
            r["ratio"] = r[key]["median"] / ref[key]["median"]
            r["us_per_layer_above_reference"] = (r[key]["median"] - ref[key]["median"]) * 1e3 / layers[group]
            pairs = [x / y for x, y in zip(r[f"{key}_all"], ref[f"{key}_all"])]
            r["ratio_paired"] = [min(pairs), max(pairs)]
        if r.get("device_ms"):
            r["host_bound"] = r["device_ms"]["median"] <= HOST_BOUND * r["host_ms"]["median"]
    targets = []
    for group, mode, threshold in TARGETS:
        r = by.get((group, mode))
        value = r.get("ratio") if r else None
        targets.append(dict(group=group, mode=mode, reference=GROUPS[group][1], value=value, threshold=threshold,
                            met=None if value is None else value <= threshold, note="" if value else "did not run"))
    return targets


def profile_mode(prepared, mode, steps, cuda, top):
    """cProfile over `steps` steps of one mode (after the timed ones): the functions by own time."""
    model, ids, ctx = prepared[mode]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        train_step(model, ids, ctx)
    if cuda:
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="modes (group: reference first):\n" + "\n".join(
                                    f"  {g}: " + ", ".join(GROUPS[g][2]) for g in GROUPS) + "\n" +
                                "\n".join(f"  {m:<26} {h}" for m, h in MODE_HELP.items()))
    p.add_argument("--rounds", type=int, default=15, help="timed rounds, each one step of every mode (default 15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each mode first (default 2)")
    p.add_argument("--layers", type=int, default=MLP_STACK["layers"],
                   help="MLP blocks of the checkpoint and no_checkpoint groups (default 32)")
    p.add_argument("--decoder-layers", type=int, default=DECODER["layers"],
                   help="decoder blocks of the attention group (default 8)")
    p.add_argument("--hf-layers", type=int, default=LLAMA["layers"], help="layers of the tiny Llama (default 16)")
    p.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    p.add_argument("--groups", default=",".join(GROUPS),
                   help="comma-separated groups to run: " + ", ".join(GROUPS) + " (default: all)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time enable(offload=True) without midpoints, without copies and without either in the "
                        "checkpoint group: where its host time goes (see the modes below)")
    p.add_argument("--profile", metavar="GROUP:MODE",
                   help="also profile that mode with cProfile after the timed rounds (e.g. checkpoint:enable(offload=True))")
    p.add_argument("--profile-steps", type=int, default=20, help="steps of the --profile run (default 20)")
    p.add_argument("--profile-top", type=int, default=25, help="functions the --profile run prints (default 25)")
    p.add_argument("--processes", type=int, default=1,
                   help="run the whole benchmark this many times, each in a fresh process, and judge the targets "
                        "by the median of the processes' ratios (default 1: this process). A process's model "
                        "instances and their memory layout move its ratios as a whole; more rounds do not average "
                        "that out, more processes do")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                   help="directory for bench_host.json (default: benchmarks/out)")
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    a.group_list = a.groups.split(",")
    unknown = set(a.group_list) - set(GROUPS)
    if unknown:
        p.error(f"--groups: unknown groups {sorted(unknown)}; choose from {sorted(GROUPS)}")
    for name in ("rounds", "warmup", "layers", "decoder_layers", "hf_layers", "seq", "profile_steps", "processes"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    keys = [f"{g}:{m}" for g in a.group_list for m in GROUPS[g][2]]
    if a.breakdown:
        if "checkpoint" not in a.group_list:
            p.error("--breakdown adds modes to the checkpoint group, which --groups leaves out")
        keys += [f"checkpoint:{m}" for m in BREAKDOWN]
    if a.profile is not None and a.profile not in keys:
        p.error(f"--profile: {a.profile!r} is not a GROUP:MODE of the groups run: {keys}")
    a.cuda = torch.cuda.is_available() and ckpt_offload.build_info()["cuda_usable"]
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.processes > 1:
        return run_processes(a, sys.argv[1:] if argv is None else list(argv))
    cuda = a.cuda
    device = select_device(cuda)
    t0 = time.monotonic()
    prepared, layers, notes = build(a, device)
    # What exists now lives for the whole run: out of the collector's sight, so that a full collection
    # (host_timed_step collects before each step) stays short and the same for every mode.
    gc.collect()
    gc.freeze()
    keys = list(prepared)
    run = SimpleNamespace(warmup=a.warmup, steps=a.rounds)
    steps, failed = interleaved_timing(keys, lambda k: prepared[k], run, cuda, a.seq, timer=host_timed_step)
    rows = []
    for key in keys:
        group, mode = key.split(":", 1)
        if key in failed:
            rows.append(dict(group=group, mode=mode, error=failed[key]["error"]))
            continue
        tensors, nbytes = offloaded_per_step(*prepared[key], cuda)
        rows.append(dict(group=group, mode=mode, host_ms=summarize(steps[key], "host_ms"),
                         cpu_ms=summarize(steps[key], "cpu_ms"), device_ms=summarize(steps[key], "device_ms"),
                         host_ms_all=[x["host_ms"] for x in steps[key]], cpu_ms_all=[x["cpu_ms"] for x in steps[key]],
                         tensors_offloaded_per_step=tensors, bytes_offloaded_per_step=nbytes))
    judged = "host_ms" if cuda else "cpu_ms"
    targets = evaluate(rows, layers, judged)
    problems = [f"{r['group']}:{r['mode']}: {r['error']}" for r in rows if "error" in r]
    problems += [f"{r['group']}:{r['mode']}: offloaded nothing" for r in rows
                 if r["mode"] in OURS and r.get("tensors_offloaded_per_step") == 0]
    profile = profile_mode(prepared, a.profile, a.profile_steps, cuda, a.profile_top) if a.profile else None
    elapsed = time.monotonic() - t0
    result = dict(kind="bench_host", judged=judged,
                  timing=("host wall time (perf_counter), device CUDA events" if cuda else
                          f"host CPU time (process_time) judged, wall time beside it; {CPU_LABEL}"),
                  hardware=hardware_info(), config=vars(a), layers=layers, rows=rows, targets=targets,
                  problems=problems, notes=notes, profile=profile, elapsed_s=elapsed)
    os.makedirs(a.out, exist_ok=True)
    json_path = os.path.join(a.out, "bench_host.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print_report(result, cuda)
    if profile:
        print(f"\ncProfile of {a.profile}, {a.profile_steps} steps, by own time:\n{profile}")
    print(f"\nJSON: {json_path}; {elapsed:.1f} s")
    if problems:
        print("CHECKS FAILED:\n  " + "\n  ".join(problems))
        return 3
    return 0


def _without(argv, *options):
    """argv less the given options and their values (--opt v and --opt=v)."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok in options:
            skip = True
        elif not any(tok.startswith(o + "=") for o in options):
            out.append(tok)
    return out


def run_processes(a, argv):
    """The benchmark a.processes times, each run in a fresh process (its own models, allocations and
    memory layout), then one report: each mode's ratio is the median of the processes' ratios, and
    so is each target's value; the rounds of every process are pooled for the times shown."""
    t0 = time.monotonic()
    json_path = os.path.join(a.out, "bench_host.json")
    if os.path.exists(json_path):
        os.remove(json_path)  # a run that fails leaves no result of an earlier one behind
    child = [sys.executable, os.path.abspath(__file__), *_without(argv, "--processes", "--out", "--profile")]
    results = []
    for i in range(a.processes):
        out = os.path.join(a.out, f"process{i + 1}")
        # --processes 1 last: it wins over any spelling of the option left in (argparse takes prefixes).
        cmd = child + ["--out", out, "--processes", "1"] + (
            ["--profile", a.profile] if a.profile and i == a.processes - 1 else [])
        start = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        path = os.path.join(out, "bench_host.json")
        if p.returncode not in (0, 3) or not os.path.exists(path):
            print(f"process {i + 1}/{a.processes} failed (exit {p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
            return 1
        with open(path) as f:
            results.append(json.load(f))
        values = ", ".join(f"{t['mode']} {fmt_ratio(t['value'])}" for t in results[-1]["targets"])
        print(f"process {i + 1}/{a.processes}: {values} ({time.monotonic() - start:.1f} s)", flush=True)
    result = combine(results, a)
    result["hardware"] = dict(result["hardware"], command=" ".join([sys.executable, os.path.abspath(__file__), *argv]))
    result["elapsed_s"] = time.monotonic() - t0
    os.makedirs(a.out, exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print()
    print_report(result, a.cuda)
    if result["profile"]:
        print(f"\ncProfile of {a.profile} (last process), {a.profile_steps} steps, by own time:\n{result['profile']}")
    print(f"\nJSON: {json_path} (each process's under process1..{a.processes}); {result['elapsed_s']:.1f} s")
    if result["problems"]:
        print("CHECKS FAILED:\n  " + "\n  ".join(result["problems"]))
        return 3
    return 0


def combine(results, a):
    """One bench_host result from several processes' (see run_processes)."""
    first = results[0]
    key = first["judged"]
    rows = []
    for r0 in first["rows"]:
        same = [next(r for r in res["rows"] if (r["group"], r["mode"]) == (r0["group"], r0["mode"])) for res in results]
        if any(key not in r for r in same):
            rows.append(dict(group=r0["group"], mode=r0["mode"],
                             error="; ".join(r["error"] for r in same if "error" in r)))
            continue
        row = dict(group=r0["group"], mode=r0["mode"], reference=r0.get("reference"),
                   tensors_offloaded_per_step=r0["tensors_offloaded_per_step"],
                   bytes_offloaded_per_step=r0["bytes_offloaded_per_step"])
        for k in ("host_ms", "cpu_ms"):
            row[f"{k}_all"] = [x for r in same for x in r[f"{k}_all"]]
            row[k] = summarize([{k: x} for x in row[f"{k}_all"]], k)
        device = [r["device_ms"] for r in same if r.get("device_ms")]
        row["device_ms"] = dict(median=statistics.median(d["median"] for d in device)) if device else None
        # A ratio where the process's reference ran too (a reference failing in one process leaves
        # that process out of its group's ratios).
        judged = [r for r in same if "ratio" in r]
        if judged:
            row["ratio_processes"] = [r["ratio"] for r in judged]
            row["ratio"] = statistics.median(row["ratio_processes"])
            row["us_per_layer_above_reference"] = statistics.median(r["us_per_layer_above_reference"] for r in judged)
            row["ratio_paired"] = [min(r["ratio_paired"][0] for r in judged), max(r["ratio_paired"][1] for r in judged)]
        bound = [r["host_bound"] for r in same if "host_bound" in r]
        if bound:
            row["host_bound"] = sum(bound) * 2 > len(bound)  # in most processes
        rows.append(row)
    targets = []
    for t0 in first["targets"]:
        values = [next(t["value"] for t in res["targets"] if t["mode"] == t0["mode"]) for res in results]
        if any(v is None for v in values):  # did not run in every process: not judged
            targets.append(dict(t0, value=None, met=None, values=values,
                                note="did not run in every process"))
            continue
        value = statistics.median(values)
        targets.append(dict(t0, value=value, met=value <= t0["threshold"], values=values,
                            met_in=sum(v <= t0["threshold"] for v in values)))
    problems = sorted({f"process {i + 1}: {p}" for i, res in enumerate(results) for p in res["problems"]})
    config = dict(first["config"], processes=a.processes, out=a.out, profile=a.profile)
    return dict(kind="bench_host", judged=key, timing=first["timing"], hardware=first["hardware"], config=config,
                layers=first["layers"], rows=rows, targets=targets, problems=problems, notes=first["notes"],
                profile=results[-1]["profile"], processes=results)


def print_report(result, cuda):
    cfg, layers, key = result["config"], result["layers"], result["judged"]
    processes = cfg.get("processes", 1)
    print(textwrap.fill(
        f"host time of one step (forward + backward), median of {cfg['rounds']} rounds, modes timed round-robin "
        f"in rotated order; "
        + (f"{processes} processes, each mode's ratio the median of theirs, times pooled over their rounds; "
           if processes > 1 else "")
        + f"seq {cfg['seq']}, batch 1, float32; "
        + ("GPU: host wall time (perf_counter), device time (CUDA events)" if cuda else
           f"{CPU_LABEL}: the process's CPU time is judged (wall time beside it); noisy from run to run"),
        width=120))
    for group, (kind, ref, modes) in GROUPS.items():
        rows = [r for r in result["rows"] if r["group"] == group]
        if not rows:
            continue
        print(f"\n{group}: {layers[group]} {MODELS[kind]}; reference {ref}")
        headers = ["mode", "host ms" if cuda else "cpu ms", "min-max", "/ref", "rounds", "us/layer", "offloaded"]
        headers += ["device ms", "host-bound"] if cuda else ["wall ms"]
        table = []
        for r in rows:
            if key not in r:
                table.append([r["mode"], r["error"]] + [""] * (len(headers) - 2))
                continue
            h, own = r[key], r["mode"] == ref
            line = [r["mode"], f"{h['median']:.2f}", f"{h['min']:.2f}-{h['max']:.2f}",
                    "ref" if own else fmt_ratio(r.get("ratio")),
                    "" if own or "ratio_paired" not in r else f"{r['ratio_paired'][0]:.2f}-{r['ratio_paired'][1]:.2f}",
                    "" if own or "us_per_layer_above_reference" not in r else f"{r['us_per_layer_above_reference']:+.0f}",
                    r["tensors_offloaded_per_step"]]
            if cuda:
                d = r.get("device_ms")
                line += ["n/a" if d is None else f"{d['median']:.2f}",
                         "n/a" if "host_bound" not in r else ("yes" if r["host_bound"] else "no")]
            else:
                line.append(f"{r['host_ms']['median']:.2f}")
            table.append(line)
        print_table(headers, table)
    print("\n" + textwrap.fill(
        ("* /ref: median host time over the reference's" if processes == 1 else
         "* /ref: the median of the processes' ratios, each its median host time over the reference's")
        + "; rounds: range of the ratios of paired rounds; us/layer: "
        "microseconds per layer above the reference; offloaded: tensors ckpt_offload moved in a step"
        + ("; host-bound: device time within 10% of host time (the device waited for the host)" if cuda else
           "; wall ms: median wall time, which on a shared CPU includes waiting for a core"),
        width=120, subsequent_indent="  "))
    for n in result["notes"]:
        print(n)
    print("\ntargets (host time over the reference's" + ("" if cuda else ", CPU time on this CPU run")
          + (f"; the median of {processes} processes" if processes > 1 else "") + "):")
    verdict = lambda t: "met" if t["met"] else ("MISSED" if t["met"] is False else "n/a")  # noqa: E731
    headers = ["mode", "reference", "value", "threshold", "verdict"]
    table = [[t["mode"], t["reference"], fmt_ratio(t["value"]), f"{t['threshold']:.2f}x", verdict(t)]
             for t in result["targets"]]
    if processes > 1:
        headers += ["met in", "each process"]
        for line, t in zip(table, result["targets"]):
            line += [f"{t['met_in']} of {processes}" if "met_in" in t else "n/a",
                     " ".join(fmt_ratio(v) for v in t["values"] if v is not None)]
    print_table(headers, table)
    missed = [t["mode"] for t in result["targets"] if t["met"] is False]
    if missed:
        print("TARGETS MISSED: " + ", ".join(missed) + ("" if cuda else " (CPU timings are noisy: rerun to confirm)"))


if __name__ == "__main__":
    sys.exit(main())
