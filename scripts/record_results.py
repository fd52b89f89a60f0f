"""Files the output of scripts/gpu_check.sh under benchmarks/results/ with a SUMMARY.md written from
the JSON (hardware, versions, date, commands, every table, the target verdicts), and writes the
headline table for the README (HEADLINE.md). Standard library only.

Usage: python scripts/record_results.py OUTDIR [--dest DIR] [--force]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = {"step": "bench_step.json", "hf": "bench_step_hf.json", "bandwidth": "bench_bandwidth.json"}


def load(out, part):
    path = os.path.join(out, part, PARTS[part])
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as err:
        sys.exit(f"record_results: {path} is not valid JSON ({err}); was the run cut short?")


def gib(n):
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def human(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def num(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)


def md_table(headers, rows):
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", (text or "unknown").lower()).strip("-")


def hardware_block(step, bw):
    src = step or bw
    hw = (src or {}).get("hardware", {})
    build = hw.get("ckpt_offload_build") or {}
    mem = hw.get("gpu_memory_bytes")
    lines = [
        f"- GPU: {hw.get('gpu') or 'none'}" + (f", {mem / 2**30:.0f} GiB" if mem else "")
        + (f", compute capability {hw['gpu_capability']}" if hw.get("gpu_capability") else ""),
        f"- Driver, PCIe generation, PCIe width (nvidia-smi): {hw.get('gpu_driver') or 'n/a'}",
        f"- CPU: {hw.get('cpu')} ({hw.get('cpu_count')} logical cores)",
        f"- Python {hw.get('python')}, torch {hw.get('torch')}, CUDA runtime {hw.get('cuda_runtime')}",
        f"- ckpt_offload build: {json.dumps(build, sort_keys=True)}",
        f"- Date (UTC): {hw.get('date')}",
    ]
    return "\n".join(lines)


def step_section(step):
    cfg = step["config"]
    gpu = bool(step["hardware"].get("gpu"))
    peak_key = "peak_device_bytes" if gpu else "live_peak_bytes"
    out = [f"## Training step: decoder stack, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads, "
           f"{cfg['kv_heads']} KV heads, MLP {cfg['mlp']}, batch {cfg['batch']}, {cfg['dtype']}",
           "", f"{step['note']}; timing: {step['timing']}. Command: `{step['hardware']['command']}`", ""]
    rows = []
    for r in step["rows"]:
        if "step_ms_median" not in r:
            rows.append([r["mode"], r["seq"], r.get("error") or r.get("skipped")] + [""] * 8)
            continue
        rows.append([r["mode"], r["seq"], f"{r['step_ms_median']:.1f}", f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}",
                     num(r.get("time_vs_full")), human(r.get(peak_key)), num(r.get("peak_vs_full")),
                     human(r.get("act_host_bytes")), num(r.get("reload_wait_ms_profiled"), "{:.2f}"),
                     f"{num(r.get('d2h_gb_per_s'), '{:.1f}')} / {num(r.get('h2d_gb_per_s'), '{:.1f}')}",
                     r.get("host_alloc_calls_timed")])
    out.append(md_table(["mode", "seq", "ms (median)", "ms min-max", "time / full",
                         "peak allocated" if gpu else "peak live tensors*", "peak / full",
                         "host bytes after forward", "reload wait ms", "D2H / H2D GB/s", "host allocs"], rows))
    if not gpu:
        out.append("\n\\* No device memory on the CPU: the most bytes of live tensors during an untimed step, above "
                   "weights, gradients and inputs (`ckpt_offload.testing.LiveBytes`).")
    for seq, lk in sorted((step.get("link") or {}).items(), key=lambda kv: int(kv[0])):
        if lk:
            out.append(f"\nPinned peak at seq {seq} ({lk['block_bytes'] / 2**20:g} MiB blocks, plain torch): "
                       f"D2H {lk['d2h_gb_per_s']:.1f} GB/s, H2D {lk['h2d_gb_per_s']:.1f} GB/s")
    if step.get("savings"):
        out += ["", md_table(["saving of", "against", "seq", "theoretical", "measured at the peak", "fraction",
                              "measured after forward"],
                             [[s["mode"], s["vs"], s["seq"], human(s["theoretical_bytes"]), human(s["measured_bytes"]),
                               num(s.get("fraction")), human(s.get("after_forward_bytes"))] for s in step["savings"]])]
    if step.get("targets"):
        verdict = lambda t: "met" if t["met"] else ("**missed**" if t["met"] is False else "n/a")  # noqa: E731
        out += ["", "### Targets", "", md_table(
            ["target", "seq", "value", "threshold", "verdict", "figures"],
            [[t["target"], t["seq"] or "all",
              num(t["value"]) if isinstance(t["value"], float) else ("n/a" if t["value"] is None else t["value"]),
              f"{t['threshold']:.3g}", verdict(t), t["note"]] for t in step["targets"]])]
    out += ["", "Checks: " + ("; ".join(step["problems"]) or "passed") if "problems" in step
            else "Checks: INCOMPLETE, the script did not finish"]
    return "\n".join(out)


def hf_section(hf):
    out = ["## transformers LlamaForCausalLM (random weights)", "", f"Command: `{hf['hardware']['command']}`", ""]
    out.append(md_table(["mode", "seq", "ms (median)", "time / hf_gc", "peak GiB", "peak / hf_gc"],
                        [[r["mode"], r["seq"], f"{r['step_ms_median']:.1f}", num(r.get("time_vs_hf_gc")),
                          gib(r.get("peak_device_bytes")), num(r.get("peak_vs_hf_gc"))] if "step_ms_median" in r
                         else [r["mode"], r["seq"], r.get("skipped") or r.get("error"), "", "", ""] for r in hf["rows"]]))
    out += ["", "Checks: " + ("; ".join(hf["problems"]) or "passed") if "problems" in hf
            else "Checks: INCOMPLETE, the script did not finish"]
    return "\n".join(out)


def bandwidth_section(bw):
    out = ["## Copy bandwidth", "", f"Command: `{bw['hardware']['command']}`", ""]
    rows = bw.get("gpu_rows") or []
    if rows:
        sizes = sorted({r["block_bytes"] for r in rows})
        cols = [(m, d) for m in ("engine", "torch_pinned", "pageable") for d in ("d2h", "h2d", "both")]

        def cell(size, m, d):
            return next((f"{r['gb_per_s']:.1f}" for r in rows
                         if r["block_bytes"] == size and r["method"] == m and r["direction"] == d), "")

        out.append("GB/s (10^9 B/s); `both` is D2H + H2D at once.\n")
        out.append(md_table(["block MiB"] + [f"{m} {d}" for m, d in cols],
                            [[f"{s / 2**20:g}"] + [cell(s, m, d) for m, d in cols] for s in sizes]))
    else:
        out.append(f"No GPU rows: {bw.get('label') or 'host path only'}")
    if bw.get("acquire_release"):
        out.append("\nPool acquire + release, ns a pair (Python binding included): " + ", ".join(
            f"{r['block_bytes'] // 1024} KiB {r['pair_ns']:.0f}" for r in bw["acquire_release"]))
    out.append("\nChecks: " + ("; ".join(bw.get("problems") or []) or "passed"))
    return "\n".join(out)


def stages_section(out_dir):
    path = os.path.join(out_dir, "stages.tsv")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        rows = [list(r.values()) for r in csv.DictReader(f, delimiter="\t")]
    text = ["## Stages of scripts/gpu_check.sh", "", md_table(["stage", "exit code", "seconds", "limit s"], rows)]
    tests = os.path.join(out_dir, "tests_gpu.pytest.txt")
    if os.path.exists(tests):
        with open(tests) as f:
            last = [ln.strip() for ln in f if ln.strip()]
        if last:
            text.append(f"\nGPU tests: `{last[-1]}`")
    return "\n".join(text)


def headline(step):
    """The README's headline: step time and peak memory of the main modes against full checkpointing."""
    keep = ["none", "full", "sync_offload", "async_offload", "every2", "every2_async"]
    rows = [r for r in step["rows"] if "step_ms_median" in r and r["mode"] in keep]
    rows.sort(key=lambda r: (r["seq"], keep.index(r["mode"])))
    hw = step["hardware"]
    cfg = step["config"]
    machine = hw.get("gpu") or "CPU only (timings not representative)"
    title = (f"{machine}, torch {hw.get('torch')}, CUDA {hw.get('cuda_runtime')}, {(hw.get('date') or '')[:10]}: "
             f"{cfg['layers']} layers of hidden {cfg['hidden']}, {cfg['heads']} heads, {cfg['kv_heads']} KV heads, "
             f"MLP {cfg['mlp']}, {cfg['dtype']}, batch {cfg['batch']}; step = forward + backward")
    table = md_table(["mode", "seq", "step ms", "time / full", "peak GiB", "peak / full"],
                     [[r["mode"], r["seq"], f"{r['step_ms_median']:.1f}", num(r.get("time_vs_full")),
                       gib(r.get("peak_device_bytes")), num(r.get("peak_vs_full"))] for r in rows])
    return title + "\n\n" + table + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", help="the OUTDIR given to scripts/gpu_check.sh")
    p.add_argument("--dest", help="default: benchmarks/results/<gpu>-<date>")
    p.add_argument("--force", action="store_true", help="write into an existing destination")
    a = p.parse_args(argv)
    if not os.path.isdir(a.outdir):
        p.error(f"{a.outdir} is not a directory")
    step, hf, bw = (load(a.outdir, part) for part in PARTS)
    if step is None and bw is None:
        p.error(f"{a.outdir} holds neither step/bench_step.json nor bandwidth/bench_bandwidth.json")
    hw = (step or bw)["hardware"]
    dest = a.dest or os.path.join(ROOT, "benchmarks", "results", f"{slug(hw.get('gpu') or 'cpu')}-{(hw.get('date') or '')[:10]}")
    if os.path.exists(dest) and not a.force:
        p.error(f"{dest} exists; pass --force to write into it")
    os.makedirs(dest, exist_ok=True)

    copied = []
    for name in sorted(os.listdir(a.outdir)):
        src = os.path.join(a.outdir, name)
        if os.path.isdir(src):
            for f in sorted(os.listdir(src)):
                if f.endswith((".json", ".png")):
                    shutil.copy2(os.path.join(src, f), os.path.join(dest, f))
                    copied.append(f)
        elif name.endswith((".log", ".tsv", ".txt", ".xml")):
            shutil.copy2(src, os.path.join(dest, name))
            copied.append(name)

    parts = [f"# {hw.get('gpu') or 'CPU'} run, {(hw.get('date') or '')[:10]}", "", hardware_block(step, bw)]
    for section in (stages_section(a.outdir), step and step_section(step), hf and hf_section(hf),
                    bw and bandwidth_section(bw)):
        if section:
            parts += ["", section]
    parts += ["", "Files: " + ", ".join(f"`{f}`" for f in copied)]
    with open(os.path.join(dest, "SUMMARY.md"), "w") as f:
        f.write("\n".join(parts) + "\n")
    if step:
        with open(os.path.join(dest, "HEADLINE.md"), "w") as f:
            f.write(headline(step))
    print(f"wrote {os.path.relpath(dest, ROOT)}: SUMMARY.md{', HEADLINE.md' if step else ''} and {len(copied)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
