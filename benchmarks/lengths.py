"""The varying-length pass: a padded length drawn per step, every mode interleaved, host allocations
counted per step (none may follow the longest step).
"""
from __future__ import annotations

import random
import statistics

import ckpt_offload

from .model import make_ids
from .modes import MODES, apply_mode
from .report import CPU_LABEL, fmt_bytes, print_table
from .timing import one_timed_step, run_guarded


def length_schedule(a):
    """The padded sequence length of each step of the varying-length pass: uniform over the
    multiples of a.pad_to in [MIN, MAX], drawn with a.seed."""
    lo, hi = a.length_range
    grid = list(range(-(-lo // a.pad_to) * a.pad_to, hi + 1, a.pad_to))
    rng = random.Random(a.seed)
    return [rng.choice(grid) for _ in range(a.length_steps)]


def run_lengths(a, model, device, cuda):
    """The varying-length pass: a.length_steps steps of every mode in a.length_mode_list, a padded
    length drawn per step (the same for every mode), modes interleaved round by round, from an
    emptied pool. Per mode: host allocations and frees of every step and the step times. Once the
    longest step has run, no step may allocate or free (checked)."""
    lengths = length_schedule(a)
    ckpt_offload.synchronize()
    ckpt_offload.host_pool().empty_cache()  # start empty, so that the allocations show
    modes = list(a.length_mode_list)
    per = {m: [] for m in modes}
    failed = {}
    for i, seq in enumerate(lengths):
        ids = make_ids(a, seq, device)
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            if mode in failed:
                continue
            row, ok = run_guarded(lambda: (one_timed_step(model, ids, apply_mode(model, mode, a), cuda), True), mode, seq)
            if ok is None:
                failed[mode] = row["error"]
            else:
                per[mode].append(row)
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    longest = lengths.index(max(lengths))
    rows, problems = [], []
    for mode in modes:
        if mode in failed:
            rows.append(dict(mode=mode, error=failed[mode]))
            problems.append(f"varying lengths, {mode}: {failed[mode]}")
            continue
        steps = per[mode]
        times = [x["ms"] for x in steps]
        allocs = [x["host_alloc_calls"] for x in steps]
        frees = [x["host_free_calls"] for x in steps]
        row = dict(mode=mode, lengths=lengths, longest_step=longest, host_alloc_calls_per_step=allocs,
                   host_free_calls_per_step=frees, allocs_after_longest=sum(allocs[longest + 1:]),
                   frees_after_longest=sum(frees[longest + 1:]), step_ms_all=times,
                   step_ms_min=min(times), step_ms_median=statistics.median(times), step_ms_max=max(times),
                   host_reserved_bytes=steps[-1]["host_reserved_bytes"],
                   host_peak_bytes=max(x["host_peak_bytes"] for x in steps))
        rows.append(row)
        if row["allocs_after_longest"] or row["frees_after_longest"]:
            problems.append(f"varying lengths, {mode}: {row['allocs_after_longest']} host allocations and "
                            f"{row['frees_after_longest']} frees after the longest step")
    return rows, problems


def print_lengths(rows, a, cuda):
    if not rows:
        return
    lengths = next((r["lengths"] for r in rows if "lengths" in r), [])
    longest = next((r["longest_step"] for r in rows if "longest_step" in r), None)
    print(f"\nvarying lengths: {len(lengths)} steps, padded length drawn uniformly from multiples of {a.pad_to} in "
          f"{a.length_range[0]}..{a.length_range[1]} (seed {a.seed}); modes interleaved step by step; pool emptied "
          f"first; " + ("GPU timings (CUDA events)" if cuda else CPU_LABEL))
    print(f"lengths: {', '.join(map(str, lengths))}; the longest is step {longest}")
    print_table(["mode", "ms min/med/max", "host allocs per step", "after longest", "frees", "host rsv/peak"],
                [[r["mode"], f"{r['step_ms_min']:.2f}/{r['step_ms_median']:.2f}/{r['step_ms_max']:.2f}",
                  ",".join(map(str, r["host_alloc_calls_per_step"])), r["allocs_after_longest"],
                  sum(r["host_free_calls_per_step"]),
                  f"{fmt_bytes(r['host_reserved_bytes'])}/{fmt_bytes(r['host_peak_bytes'])}"]
                 if "error" not in r else [r["mode"], r["error"], "", "", "", ""] for r in rows])


# Defaults of the varying-length pass per configuration: a short pass on the CPU, none on a GPU
# unless asked for (--lengths 2048:8192 there).
LENGTH_DEFAULTS = {"small": dict(lengths="16:64", length_steps=12, pad_to=8),
                   "standard": dict(lengths="off", length_steps=20, pad_to=64)}
LENGTH_MODES = "full,async_offload,offload_activations"


def add_length_args(p):
    p.add_argument("--lengths", metavar="MIN:MAX",
                   help="varying-length pass: a padded length drawn per step from MIN..MAX ('off': none; "
                        "default 16:64 on the CPU, off on a GPU)")
    p.add_argument("--length-steps", type=int, help="steps of the varying-length pass (12 CPU, 20 GPU)")
    p.add_argument("--pad-to", type=int, help="lengths are multiples of this (8 CPU, 64 GPU)")
    p.add_argument("--length-modes", default=LENGTH_MODES, help="modes of the varying-length pass")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths")


def finish_length_args(a, p, config):
    for k, v in LENGTH_DEFAULTS[config].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.length_range = None
    if a.lengths != "off":
        try:
            lo, hi = (int(x) for x in a.lengths.split(":"))
        except ValueError:
            p.error(f"--lengths must be MIN:MAX (two integers) or 'off', got {a.lengths!r}")
        if not 0 < lo <= hi:
            p.error(f"--lengths MIN:MAX needs 0 < MIN <= MAX, got {a.lengths!r}")
        if a.pad_to < 1 or -(-lo // a.pad_to) * a.pad_to > hi:
            p.error(f"--pad-to {a.pad_to}: no multiple of it lies in {lo}..{hi}")
        if a.length_steps < 1:
            p.error("--length-steps must be at least 1")
        a.length_range = (lo, hi)
    a.length_mode_list = a.length_modes.split(",")
    unknown = set(a.length_mode_list) - set(MODES)
    if unknown:
        p.error(f"--length-modes: unknown modes {sorted(unknown)}; choose from {MODES}")
