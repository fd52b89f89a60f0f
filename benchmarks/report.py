"""What the benchmarks print: number formats, tables of at most about 120 characters, step-time ratios
(with 'within noise' from the paired rounds), the step table, and a progress bar.
"""
from __future__ import annotations

import sys
import textwrap


CPU_LABEL = "CPU timings (no GPU): not representative"
OPTIMIZER_NOTE = ("step = forward + backward; the optimizer step is excluded; gradients stay allocated between "
                  "steps (zero_grad(set_to_none=False))")


def fmt_bytes(n):
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def fmt_ratio(x):
    return "n/a" if x is None else f"{x:.3f}x"


def fmt_ms(x):
    return "n/a" if x is None else f"{x:.2f} ms"


def fmt_rate(x):
    return "n/a" if x is None else f"{x:.1f} GB/s"


def print_table(headers, rows):
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(line(headers))
    print(line("-" * w for w in widths))
    for r in rows:
        print(line(r))


def fmt_time_ratio(r, base):
    """The step-time ratio, or 'within noise' when the paired rounds disagree on which mode is faster."""
    x = r.get(f"time_vs_{base}")
    if x is None:
        return "n/a"
    if r["mode"] == base:
        return "base"
    return "within noise" if r.get(f"time_vs_{base}_within_noise") else fmt_ratio(x)


def fmt_paired(r, base):
    """The range of the paired-round ratios behind fmt_time_ratio."""
    spread = r.get(f"time_vs_{base}_paired")
    return "n/a" if spread is None or r["mode"] == base else f"{spread[0]:.2f}-{spread[1]:.2f}"


def add_ratios(rows, base_mode="full"):
    for seq in {r["seq"] for r in rows}:
        base = next((r for r in rows if r["seq"] == seq and r["mode"] == base_mode and "step_ms_median" in r), None)
        for r in rows:
            if r["seq"] != seq or "step_ms_median" not in r or base is None:
                continue
            r[f"time_vs_{base_mode}"] = r["step_ms_median"] / base["step_ms_median"]
            # The device peak on a GPU; on the CPU, the peak of live tensors (what the table shows there).
            key = "peak_device_bytes" if base.get("peak_device_bytes") is not None else "live_peak_bytes"
            pb, pr = base.get(key), r.get(key)
            r[f"peak_vs_{base_mode}"] = pr / pb if pb and pr else None


def print_results(rows, saves, cuda, base, title, wide=False):
    print("\n" + textwrap.fill(f"{title}; {OPTIMIZER_NOTE}; " + ("GPU timings (CUDA events)" if cuda else CPU_LABEL),
                               width=120, subsequent_indent="  "))
    fb = lambda key: lambda r: fmt_bytes(r[key])  # noqa: E731
    # (header, cell, in the default table): the default keeps to about 120 characters; --wide and
    # the JSON have the rest.
    cols = [("mode", lambda r: r["mode"], True), ("seq", lambda r: r["seq"], True),
            ("ms med", lambda r: f"{r['step_ms_median']:.2f}", True),
            ("ms min-max", lambda r: f"{r['step_ms_min']:.2f}-{r['step_ms_max']:.2f}", False),
            (f"t/{base}", lambda r: fmt_time_ratio(r, base), True),
            (f"t/{base} rounds", lambda r: fmt_paired(r, base), False),
            ("peak dev" if cuda else "peak live*", fb("peak_device_bytes" if cuda else "live_peak_bytes"), True),
            (f"peak/{base}", lambda r: fmt_ratio(r.get(f"peak_vs_{base}")), True),
            ("act dev", fb("act_device_bytes"), True),
            ("act host", fb("act_host_bytes"), False), ("D2H/step", fb("bytes_offloaded_per_step"), True),
            ("H2D/step", fb("bytes_prefetched_per_step"), False),
            ("host rsv/peak", lambda r: f"{fmt_bytes(r['host_reserved_bytes'])}/{fmt_bytes(r['host_peak_bytes'])}",
             False),
            ("allocs", lambda r: r["host_alloc_calls_timed"], True),
            ("wait ms*", lambda r: "n/a" if r["reload_wait_ms_profiled"] is None else f"{r['reload_wait_ms_profiled']:.2f}",
             cuda),
            ("D2H/H2D GB/s*", lambda r: "n/a" if r["d2h_gb_per_s"] is None else
             f"{r['d2h_gb_per_s']:.1f}/{r['h2d_gb_per_s'] or 0:.1f}", False)]
    cols = [c for c in cols if wide or c[2]]
    print_table([c[0] for c in cols], [[f(r) for _, f, _ in cols] for r in rows if "step_ms_median" in r])
    shown = {c[0] for c in cols}
    notes = [f"t/{base}, peak/{base}: step time and peak over {base}'s at the same length; the peak is "
             + ("the device's (max_memory_allocated)" if cuda else "the peak of live tensors (no device memory on CPU)"),
             f"t/{base}: modes timed round-robin; 'within noise' when the ratios of the paired rounds fall on both "
             f"sides of 1 (t/{base} rounds, with --wide: their range)",
             "act dev: device bytes held after forward; D2H/step: bytes offloaded per step; allocs: host pool "
             "allocations in the timed steps (0 in steady state)"]
    if not cuda:
        notes.append("peak live: most bytes of live tensors during a step above weights, gradients and inputs "
                     "(tracked on the CPU)")
    if "wait ms*" in shown:
        notes.append("wait ms: compute-stream wait for reloads, in a separate profiled step (GPU only)")
    if "D2H/H2D GB/s*" in shown:
        notes.append("D2H/H2D GB/s: throughput of the engine's copies on their copy streams in that profiled step "
                     "(CPU: synchronous copies)")
    if "host rsv/peak" in shown:
        notes.append("act host: pool bytes in use after forward; host rsv/peak: pool bytes this mode's untimed steps "
                     "reserved, from an empty pool / peak in use in the timed steps")
    if not wide:
        notes.append(f"--wide adds: spread, t/{base} rounds, act host, H2D/step, host rsv/peak" + ("" if cuda else ", wait ms")
                     + ", copy GB/s; the JSON holds every figure")
    for i, n in enumerate(notes):
        print(textwrap.fill(n, width=120, initial_indent="* " if i == 0 else "  ", subsequent_indent="    "))
    for r in rows:
        if "step_ms_median" not in r:
            print(f"{r['mode']} seq={r['seq']}: {r.get('skipped') or r.get('error')}")
    for s in saves:
        print(f"saving {s['mode']} vs {s['vs']} @ seq {s['seq']}: theoretical {fmt_bytes(s['theoretical_bytes'])}, "
              f"measured at the peak {fmt_bytes(s['measured_bytes'])}"
              + (f" ({100 * s['fraction']:.1f}%)" if s["fraction"] is not None else " (no device memory on CPU)")
              + (f", after forward {fmt_bytes(s['after_forward_bytes'])}" if s["after_forward_bytes"] is not None else "")
              + (" (CPU tensors: save_on_cpu has nothing to move)" if not cuda and s["mode"] == "sync_offload" else ""))
        if "recompute_avoided_flop" in s:
            print(f"  attn_offload @ seq {s['seq']}: attention outputs moved to the host {fmt_bytes(s['attn_host_bytes'])}"
                  f" (device bytes a save-on-device policy would hold); attention recompute avoided "
                  f"{s['recompute_avoided_flop'] / 1e9:.4g} GFLOP per step")


class _NoBar:
    """Stands in for tqdm where it is not installed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_description(self, *_):
        pass

    def update(self, *_):
        pass


def progress_bar(total):
    """A tqdm bar on stderr when tqdm is installed (transformers depends on it), else a silent one."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, file=sys.stderr, leave=False)
