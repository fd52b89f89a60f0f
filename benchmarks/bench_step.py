"""Training-step benchmark: one decoder-only transformer, every checkpointing mode (none, full,
every-n, transformers-style synchronous offload, ckpt_offload's async offload) on identical weights.
Reports step time, device and host memory, bytes moved and reload waits; writes JSON and plots.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

if not __package__:  # run as a script, or imported with benchmarks/ on sys.path: find the package
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _ROOT not in sys.path:
        sys.path.append(_ROOT)

import ckpt_offload  # noqa: E402

# The names below are this script's interface too (tests and bench_bandwidth.py import them from here).
from benchmarks.budget import evaluate_budget, plan_length, print_budget  # noqa: E402,F401
from benchmarks.disk_mode import DISK_MODE, add_disk_ratios, plan_disk, print_disk  # noqa: E402,F401
from benchmarks.estimate_check import compare as compare_estimate, print_estimate  # noqa: E402
from benchmarks.hardware import hardware_info, select_device  # noqa: E402,F401
from benchmarks.hf import HF_MODES, run_hf  # noqa: E402,F401
from benchmarks.lengths import (LENGTH_MODES, add_length_args, finish_length_args, length_schedule,  # noqa: E402,F401
                                print_lengths, run_lengths)
from benchmarks.measure import link_peak, measure_mode, run_checks  # noqa: E402
from benchmarks.model import CONFIGS, Decoder, make_ids  # noqa: E402
from benchmarks.modes import (BITWISE, EXTRA_MODES, MODE_HELP, MODES, TIMED_APART, apply_mode,  # noqa: E402,F401
                               attn_supported, compile_blocks, restored_exactly)
from benchmarks.plots import plot  # noqa: E402
from benchmarks.report import (CPU_LABEL, OPTIMIZER_NOTE, add_ratios, fmt_bytes, fmt_paired,  # noqa: E402,F401
                               fmt_time_ratio, print_results, print_table, progress_bar)
from benchmarks.savings import attention_figures, savings  # noqa: E402,F401
from benchmarks.targets import evaluate_targets, print_targets  # noqa: E402,F401
from benchmarks.timing import interleaved_timing, mark_noise, run_guarded  # noqa: E402,F401


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="modes:\n" + "\n".join(f"  {m:<20} {MODE_HELP[m]}" for m in MODES + EXTRA_MODES))
    small, std = CONFIGS["small"], CONFIGS["standard"]
    p.add_argument("--config", choices=sorted(CONFIGS), help="small without a GPU, standard with one (the default "
                   "picks by the GPU); the options below override single fields of it")
    sizes = {"layers": "decoder blocks", "hidden": "hidden size", "heads": "attention heads",
             "kv-heads": "key/value heads (grouped-query attention)", "mlp": "MLP width",
             "batch": "sequences per step", "vocab": "vocabulary size (small: the blocks' activations dominate)",
             "warmup": "untimed steps before the timed ones (the first fills the host pool)",
             "steps": "timed steps per mode and length"}
    for name, what in sizes.items():
        key = name.replace("-", "_")
        p.add_argument(f"--{name}", type=int, help=f"{what} (small: {small[key]}, standard: {std[key]})")
    p.add_argument("--seqs", "--seq-sweep", dest="seqs",
                   help=f"comma-separated sequence lengths (small: {small['seqs']}, standard: {std['seqs']})")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help=f"parameter and activation dtype (small: {small['dtype']}, standard: {std['dtype']})")
    p.add_argument("--no-rope", dest="rope", action="store_false", help="leave out rotary position embeddings")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated modes to run, in this order; valid: " + ", ".join(MODES + EXTRA_MODES) +
                   " (default: all but " + ", ".join(EXTRA_MODES) + "; see 'modes' below)")
    p.add_argument("--keep-last", type=int, default=1,
                   help="checkpointed layers whose inputs stay on the device in the async modes (default 1)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="offloaded layers on their way back ahead of need in the async modes (default 1)")
    p.add_argument("--min-bytes", type=int, help="offload_activations threshold (1 MiB on GPU, 0 on CPU)")
    p.add_argument("--hf", action="store_true",
                   help="compare transformers' checkpointing/offload instead (modes " + ", ".join(HF_MODES) + ")")
    p.add_argument("--hf-every", type=int, default=1, help="every_n_layers for the --hf comparison")
    p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="every mode with every block compiled (block.compile(backend=BACKEND), default inductor), "
                        "modes timed one after another; opt-in on the CPU, where compiling is slow")
    p.add_argument("--disk", nargs="?", const=tempfile.gettempdir(), metavar="DIR",
                   help=f"also run {DISK_MODE} (after the others, timed on its own), its spill files in DIR (default: "
                   f"{tempfile.gettempdir()}, the temporary directory; {DISK_MODE} in --modes uses it too); the "
                   "output names DIR's device and filesystem")
    p.add_argument("--budget-s", type=float, help="skip what is left after this many seconds")
    p.add_argument("--budget", type=int, help="device bytes of a step (weights, gradients and inputs included): "
                   "also run the configuration plan_memory chooses for it (mode 'planned') beside the others")
    p.add_argument("--estimate", action=argparse.BooleanOptionalAction,
                   help="compare ckpt_offload.estimate_memory's peak per mode (the same decoder on the meta device) "
                   "with the measured one, for none, full, every2 and async_offload at --keep-last 0 (default: on with "
                   "a GPU, off on the CPU; not with --hf or --compile)")
    p.add_argument("--wide", action="store_true",
                   help="print every column (spread, H2D bytes, host pool, reload wait, copy throughput); the "
                   "default table keeps to about 120 characters; the JSON always holds every figure")
    p.add_argument("--no-timeline", dest="timeline", action="store_false",
                   help="skip the timeline of one step per offload mode (timeline_<mode>_<seq>.json/.png in --out)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                   help="directory for the JSON and the plots (default: benchmarks/out)")
    add_length_args(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    a.cuda = torch.cuda.is_available() and ckpt_offload.build_info()["cuda_usable"]
    if a.config == "standard" and not a.cuda:
        why = ("torch sees no GPU" if not torch.cuda.is_available() else
               f"the extension cannot use it (build_info: {ckpt_offload.build_info()})")
        p.error(f"--config standard needs a GPU the extension can use: {why}")
    for k, v in CONFIGS[a.config or ("standard" if a.cuda else "small")].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    finish_length_args(a, p, a.config or ("standard" if a.cuda else "small"))
    a.seq_list = [int(s) for s in a.seqs.split(",")]
    a.mode_list = a.modes.split(",")
    unknown = set(a.mode_list) - set(MODES + EXTRA_MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES + EXTRA_MODES}")
    if a.compile and a.hf:
        p.error("--compile applies to the decoder stack, not to --hf")
    if a.disk is not None and a.hf:
        p.error("--disk runs the decoder stack's disk_offload, not with --hf")
    if a.disk is not None and DISK_MODE not in a.mode_list:
        a.mode_list.append(DISK_MODE)
    if DISK_MODE in a.mode_list:
        a.disk = a.disk or tempfile.gettempdir()
        if not os.path.isdir(a.disk):
            p.error(f"--disk: {a.disk!r} is not a directory")
    if a.budget is not None:
        if a.budget <= 0 or a.hf:
            p.error("--budget takes a positive number of bytes, and not with --hf")
        a.mode_list.append("planned")
    if a.budget is not None and a.compile:
        p.error("--budget plans and runs eager blocks; leave out --compile")
    if a.estimate and (a.hf or a.compile):
        p.error("--estimate compares the eager decoder stack; leave out --hf and --compile")
    if a.estimate is None:  # a meta-device run per length: no device memory, under a second
        a.estimate = a.cuda and not a.hf and not a.compile
    a.torch_dtype = getattr(torch, a.dtype)
    a.elem = torch.finfo(a.torch_dtype).bits // 8
    if a.min_bytes is None:
        a.min_bytes = 1 << 20 if a.cuda else 0
    return a


def run_main(a, device, cuda, bar, t0, result, write):
    torch.manual_seed(0)
    model = Decoder(a, device, a.torch_dtype).train()
    if a.compile:
        compile_blocks(model, a.compile)
    # Same kernels, values only moved: bitwise, unless a code generator compiles each mode's graphs.
    bitwise = BITWISE if a.compile in (None, "eager", "aot_eager") else {}
    rows, problems, restored = [], [], True
    link = result.setdefault("link", {})
    for seq in a.seq_list:
        ids = make_ids(a, seq, device)
        refs = {}
        if cuda:  # the pinned peak at the size of one layer's input, the block size the step moves
            link[seq] = link_peak(a.batch * seq * a.hidden * a.elem, device)
        spent = a.budget_s and time.monotonic() - t0 > a.budget_s
        runnable = [m for m in a.mode_list if not spent and not (m == "attn_offload" and not attn_supported())]
        bar.set_description(f"timed steps, seq={seq}")
        planning_failed = plan_length(model, ids, a, runnable, seq)
        planning_failed.update(plan_disk(model, ids, a, runnable, seq, cuda,
                                         lambda: apply_mode(model, "async_offload", a)))
        if a.compile:  # one mode after another (measure_mode), each from a reset, with its own counts
            timed, failed = {m: None for m in runnable}, {}
        else:
            together = [m for m in runnable if m not in TIMED_APART]
            timed, failed = interleaved_timing(together, lambda m: (model, ids, apply_mode(model, m, a)), a, cuda,
                                               seq) if together else ({}, {})
            timed.update({m: None for m in runnable if m in TIMED_APART})  # measure_mode times them, each alone
        failed.update(planning_failed)
        ckpt_offload.disable_checkpointing(model)
        model.layer_call = None
        for mode in a.mode_list:
            bar.set_description(f"{mode} seq={seq}")
            if mode in failed:
                rows.append(failed[mode])
            elif mode == "attn_offload" and not attn_supported():
                rows.append(dict(mode=mode, seq=seq, skipped=f"torch {torch.__version__} has no "
                                                             "CheckpointPolicy.MUST_CPU_OFFLOAD (selective offload)"))
            elif mode not in timed or (a.budget_s and time.monotonic() - t0 > a.budget_s):
                rows.append(dict(mode=mode, seq=seq, skipped=f"time budget of {a.budget_s:g} s spent"))
            else:
                row, ref = run_guarded(lambda: measure_mode(model, ids, mode, a, cuda, timed[mode]), mode, seq)
                rows.append(row)
                if ref is not None:  # a mode that ran out of memory never reached disable_checkpointing
                    refs[mode] = ref
                    restored = restored and restored_exactly(model)
            bar.update(1)
        problems += [f"seq {seq}: {p}" for p in run_checks([r for r in rows if r["seq"] == seq], refs, "none",
                                                           bitwise, cuda, restored)]
        add_ratios(rows)
        add_disk_ratios(rows)
        mark_noise(rows)
        result.update(rows=rows)
        write()  # partial results survive a timeout
    return rows, problems


def main(argv=None):
    a = parse_args(argv)
    cuda = a.cuda
    device = select_device(cuda)
    os.makedirs(a.out, exist_ok=True)
    prefix = "bench_step_hf" if a.hf else "bench_step"
    t0 = time.monotonic()
    result = dict(kind=prefix, note=OPTIMIZER_NOTE, timing=("CUDA events" if cuda else CPU_LABEL),
                  hardware=hardware_info(),
                  config={k: v for k, v in vars(a).items() if k not in ("torch_dtype",)})
    json_path = os.path.join(a.out, prefix + ".json")

    def write():
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    total = len(a.seq_list) * (len(HF_MODES) if a.hf else len(a.mode_list))
    with progress_bar(total) as bar:
        if a.hf:
            rows, problems = run_hf(a, device, cuda, bar, result, write)
            add_ratios(rows, "hf_gc")
            mark_noise(rows, "hf_gc")
            saves = []
        else:
            rows, problems = run_main(a, device, cuda, bar, t0, result, write)
            saves = savings(rows, a)
            result["targets"] = evaluate_targets(rows, saves, result.get("link"), cuda)
            if a.length_range:
                bar.set_description("varying lengths")
                torch.manual_seed(0)
                result["lengths"], length_problems = run_lengths(a, Decoder(a, device, a.torch_dtype).train(), device, cuda)
                problems += length_problems
            if a.budget is not None:
                result["budget"] = evaluate_budget(rows, a.budget, cuda)
            if a.estimate:
                result["estimate"] = compare_estimate(rows, a, cuda)
    incomplete = [f"{r['mode']}@{r['seq']}: {r['skipped']}" for r in rows if r.get("skipped")]
    result.update(rows=rows, savings=saves, problems=problems, incomplete=incomplete, elapsed_s=time.monotonic() - t0)
    result["plots"] = plot(rows, a, a.out, prefix, "hf_gc" if a.hf else "full") if rows else []
    write()
    title = (f"transformers LlamaForCausalLM (random weights), every_n_layers={a.hf_every}" if a.hf
             else f"decoder stack, {a.layers} layers, hidden {a.hidden}, {a.dtype}")
    print_results(rows, saves, cuda, "hf_gc" if a.hf else "full", title, wide=a.wide)
    print_disk(rows)
    print_lengths(result.get("lengths", []), a, cuda)
    print_estimate(result.get("estimate", []), cuda)
    if a.compile:
        print(f"\ntorch.compile ({a.compile}), every block: graphs / graph breaks / graphs compiled in timed steps")
        for r in rows:
            if "compiled_graphs" in r:
                print(f"  {r['mode']:>20} @ {r['seq']}: {r['compiled_graphs']} / {r['graph_breaks']} / "
                      f"{r['graphs_compiled_in_timed_steps']}")
    if "targets" in result:
        print_targets(result["targets"])
    if "budget" in result:
        print_budget(result["budget"])
    print(f"\nJSON: {json_path}; plots: {', '.join(result['plots']) or 'none'}; {result['elapsed_s']:.1f} s")
    if incomplete:
        print(f"INCOMPLETE: {len(incomplete)} mode runs skipped:\n  " + "\n  ".join(incomplete))
    if problems:
        print("CHECKS FAILED:\n  " + "\n  ".join(problems))
        return 3
    base = "hf_gc" if a.hf else "none"
    print(("checks passed on what ran: " if incomplete else "checks passed: ") + ("losses and gradient fingerprints agree within bf16 tolerance" if cuda else
                               f"losses and gradients match `{base}` (allclose) and bitwise where expected")
          + "; no host allocations in timed steps" + ("; none after the longest step of the varying-length pass"
                                                        if result.get("lengths") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
