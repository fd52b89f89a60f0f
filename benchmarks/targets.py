"""The step benchmark's targets on a GPU: value, threshold and verdict (met, missed, or not judged
with the reason), with the figures that explain a miss.
"""
from __future__ import annotations

from .report import fmt_bytes, fmt_ms, fmt_rate, print_table


# The targets of the standard run on a GPU (benchmarks/README.md says where they come from).
TARGET_TIME_VS_FULL = 1.03        # async offload step time / full checkpointing
TARGET_OVERHEAD_VS_SYNC = 1 / 3   # async overhead over full / synchronous offload's overhead over full
TARGET_SAVING_FRACTION = 0.95     # measured peak saving / theoretical saving
TARGET_LINK_FRACTION = 0.85       # copy throughput in the step / pinned peak measured in this run
TARGET_ATTN_TIME_VS_FULL = 0.96   # attn_offload step time / full checkpointing, judged from ATTN_TARGET_SEQ
TARGET_ATTN_ACT_VS_ASYNC = 1.05   # attn_offload activation bytes at the step peak / async_offload's
ATTN_TARGET_SEQ = 8192            # shorter sequences: too little attention to win back the extra copy


def evaluate_targets(rows, saves, link, cuda):
    """One entry per target and sequence length: value, threshold, met (True, False, or None when it
    cannot be judged, with the reason), and the figures that explain a miss."""
    out = []

    def add(target, seq, value, threshold, met, note=""):
        out.append(dict(target=target, seq=seq, value=value, threshold=threshold, met=met, note=note))

    for seq in sorted({r["seq"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        asy, full, sync = by.get("async_offload"), by.get("full"), by.get("sync_offload")
        why = "CPU run: targets are judged on a GPU" if not cuda else ""
        explain = ""
        if asy:
            explain = (f"reload wait {fmt_ms(asy.get('reload_wait_ms_profiled'))} in a profiled step; copies "
                       f"D2H {fmt_rate(asy.get('d2h_gb_per_s'))}, H2D {fmt_rate(asy.get('h2d_gb_per_s'))}")
        if asy and full:
            t = asy["step_ms_median"] / full["step_ms_median"]
            add("async_offload time / full", seq, t, TARGET_TIME_VS_FULL,
                None if why else t <= TARGET_TIME_VS_FULL, why or explain)
        else:
            add("async_offload time / full", seq, None, TARGET_TIME_VS_FULL, None, "async_offload or full did not run")
        if asy and full and sync:
            over_a = asy["step_ms_median"] - full["step_ms_median"]
            over_s = sync["step_ms_median"] - full["step_ms_median"]
            if over_s > 0:
                v = over_a / over_s
                add("async overhead / sync overhead", seq, v, TARGET_OVERHEAD_VS_SYNC,
                    None if why else v <= TARGET_OVERHEAD_VS_SYNC, why or explain)
            else:
                add("async overhead / sync overhead", seq, None, TARGET_OVERHEAD_VS_SYNC, None,
                    why or f"sync_offload was not slower than full ({over_s:+.2f} ms): no overhead to compare")
        else:
            add("async overhead / sync overhead", seq, None, TARGET_OVERHEAD_VS_SYNC, None,
                "async_offload, sync_offload or full did not run")
        sv = next((x for x in saves if x["seq"] == seq and x["mode"] == "async_offload"), None)
        frac = sv["fraction"] if sv else None
        add("async_offload saving / theoretical", seq, frac, TARGET_SAVING_FRACTION,
            None if why or frac is None else frac >= TARGET_SAVING_FRACTION,
            why or ("" if frac is not None else "no measured saving") or
            (f"theoretical {fmt_bytes(sv['theoretical_bytes'])}, measured {fmt_bytes(sv['measured_bytes'])}; "
             f"device bytes after forward: async {fmt_bytes(asy and asy.get('act_device_bytes'))}, "
             f"full {fmt_bytes(full and full.get('act_device_bytes'))}"))
        peak = (link or {}).get(seq)
        for d in ("d2h", "h2d"):
            key = f"{d}_gb_per_s"
            got, ref = (asy or {}).get(key), (peak or {}).get(key)
            frac = got / ref if got and ref else None
            add(f"{d.upper()} throughput in the step / pinned peak", seq, frac, TARGET_LINK_FRACTION,
                None if why or frac is None else frac >= TARGET_LINK_FRACTION,
                why or (f"{fmt_rate(got)} in the step, pinned peak {fmt_rate(ref)} at "
                        f"{fmt_bytes(peak['block_bytes'])} blocks" if frac is not None else "not measured"))
    attn_targets(rows, cuda, add)
    allocs = [r for r in rows if "step_ms_median" in r and r.get("host_alloc_calls_timed")]
    timed = [r for r in rows if "step_ms_median" in r]
    add("host allocations after the first step", None, sum(r["host_alloc_calls_timed"] for r in allocs), 0,
        (not allocs) if timed else None,
        ", ".join(f"{r['mode']}@{r['seq']}: {r['host_alloc_calls_timed']}" for r in allocs) or
        ("" if timed else "no mode ran"))
    return out


def attn_targets(rows, cuda, add):
    """The attn_offload targets, only where that mode ran: faster than full checkpointing, at the
    device memory of async_offload."""
    for seq in sorted({r["seq"] for r in rows if r["mode"] == "attn_offload"}):
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        att, full, asy = by.get("attn_offload"), by.get("full"), by.get("async_offload")
        why = "CPU run: targets are judged on a GPU" if not cuda else ""
        if att and full:
            t = att["step_ms_median"] / full["step_ms_median"]
            short = "" if seq >= ATTN_TARGET_SEQ else f"judged at seq {ATTN_TARGET_SEQ} and longer"
            add("attn_offload time / full", seq, t, TARGET_ATTN_TIME_VS_FULL,
                None if why or short else t <= TARGET_ATTN_TIME_VS_FULL,
                why or short or f"reload wait {fmt_ms(att.get('reload_wait_ms_profiled'))} in a profiled step")
        else:
            add("attn_offload time / full", seq, None, TARGET_ATTN_TIME_VS_FULL, None, "attn_offload or full did not run")
        # Activation bytes at the step peak (above weights, gradients and inputs). After forward the
        # keep_last layers' attention outputs add to attn_offload; at the peak, full checkpointing's
        # recompute of that layer materialises them too.
        acts = [x and activation_peak(x) for x in (att, asy)]
        if all(acts):
            v = acts[0] / acts[1]
            add("attn_offload activation peak / async_offload", seq, v, TARGET_ATTN_ACT_VS_ASYNC,
                None if why else v <= TARGET_ATTN_ACT_VS_ASYNC,
                why or f"{fmt_bytes(acts[0])} against {fmt_bytes(acts[1])}; after forward "
                       f"{fmt_bytes(att['act_device_bytes'])} against {fmt_bytes(asy['act_device_bytes'])}")
        else:
            add("attn_offload activation peak / async_offload", seq, None, TARGET_ATTN_ACT_VS_ASYNC, None,
                "attn_offload or async_offload did not run")


def activation_peak(r):
    """Bytes of activations at the step peak: max_memory_allocated above what the step started with
    on a GPU, the tracked live peak on the CPU; None when not measured."""
    if r.get("base_device_bytes") is not None and r.get("peak_device_bytes") is not None:
        return r["peak_device_bytes"] - r["base_device_bytes"]
    return r.get("live_peak_bytes")


def print_targets(targets):
    print("\ntargets (standard run on a GPU):")
    verdict = lambda t: "met" if t["met"] else ("MISSED" if t["met"] is False else "n/a")  # noqa: E731
    value = lambda t: "n/a" if t["value"] is None else (  # noqa: E731
        f"{t['value']:.3f}" if isinstance(t["value"], float) else str(t["value"]))
    print_table(["target", "seq", "value", "threshold", "verdict", "figures"],
                [[t["target"], t["seq"] or "all", value(t), f"{t['threshold']:.3g}", verdict(t), t["note"]]
                 for t in targets])
    missed = [t for t in targets if t["met"] is False]
    if missed:
        print("TARGETS MISSED: " + "; ".join(f"{t['target']} @ {t['seq'] or 'all'}" for t in missed))
