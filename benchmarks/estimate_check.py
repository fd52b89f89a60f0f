"""bench_step --estimate: ckpt_offload.estimate_memory's peak per mode, from the same decoder built on the
meta device, against the peak the benchmark measured for the corresponding bench mode.
"""
from __future__ import annotations

import torch

import ckpt_offload

from .model import Decoder, make_ids
from .report import fmt_bytes

# bench mode -> estimate mode. async_offload is "checkpoint+offload" (every block's input on the host)
# only at --keep-last 0: estimate_memory has no keep_last, and keep_last 1 keeps the last block's input on
# the device. The other modes have no estimate counterpart (every4, the offloads of torch's save_on_cpu,
# of offload_activations, of the attention outputs, the disk tier, a plan).
ESTIMATE_MODE = {"none": "none", "full": "checkpoint", "every2": "every_n=2"}
OFFLOAD_MODE = ("async_offload", "checkpoint+offload")


def estimate_mode(mode, a):
    """(estimate mode or None, why not compared)."""
    if mode in ESTIMATE_MODE:
        return ESTIMATE_MODE[mode], None
    if mode == OFFLOAD_MODE[0]:
        if a.keep_last == 0:
            return OFFLOAD_MODE[1], None
        return None, (f"keep_last={a.keep_last}: checkpoint+offload offloads every block's input "
                      "(run with --keep-last 0 to compare)")
    return None, "no estimate mode corresponds"


def measured_peak(row, cuda):
    """(peak, bytes outside the estimate) of the step, counted as the estimate counts it: weights, buffers,
    inputs, gradients kept allocated (row["base_bytes"]) and what the step allocates above them; no optimizer
    states (the benchmark runs no optimizer step). On the CPU the peak of live tensors LiveBytes tracked above
    those. On a GPU max_memory_allocated over the timed steps less what was allocated at the step's start
    besides them (cuBLAS workspaces, the rotary tables' cache: bytes the estimate does not count), which is
    the second figure."""
    base = row.get("base_bytes")
    if cuda:
        peak, start = row.get("peak_device_bytes"), row.get("base_device_bytes")
        if peak is None or start is None or base is None:
            return None, None
        return peak - start + base, start - base
    if row.get("live_peak_bytes") is None or base is None:
        return None, None
    return row["live_peak_bytes"] + base, 0


def estimate_peaks(a, seq, cuda):
    """estimate_memory of the decoder at this length (same config, batch and dtype), built on meta.
    attention: on a GPU what torch picks (the estimate's default); on the CPU torch's flash kernel, which
    keeps the output and the log-sum-exp as the GPU's kernels do."""
    with torch.device("meta"):
        model = Decoder(a, torch.device("meta"), a.torch_dtype).train()
    ids = make_ids(a, seq, torch.device("meta"))
    return ckpt_offload.estimate_memory(model, (ids,), optimizer=None, loss_fn=lambda loss: loss,
                                        attention=None if cuda else "flash")


def compare(rows, a, cuda):
    """One entry per bench mode and length that ran: estimated and measured peak and the relative error
    (estimated / measured - 1), or why the mode is not compared."""
    out, ests = [], {}
    for r in rows:
        mode, seq = r["mode"], r["seq"]
        em, why = estimate_mode(mode, a)
        entry = dict(mode=mode, seq=seq, estimate_mode=em)
        measured, outside = measured_peak(r, cuda)
        if em is not None and measured is None:
            why = r.get("skipped") or r.get("error") or "no peak measured"
        if why is not None:
            entry["not_compared"] = why
            out.append(entry)
            continue
        if seq not in ests:
            try:  # after every measurement: a failed estimate is reported, not the run's end
                ests[seq] = estimate_peaks(a, seq, cuda)
            except Exception as e:  # noqa: BLE001
                ests[seq] = f"estimate_memory failed: {type(e).__name__}: {e}"
        if isinstance(ests[seq], str):
            out.append(dict(entry, not_compared=ests[seq]))
            continue
        est = ests[seq].peak_bytes[em]
        entry.update(estimated_peak_bytes=est, measured_peak_bytes=measured, rel_error=est / measured - 1,
                     outside_estimate_bytes=outside, attention=ests[seq].attention)
        out.append(entry)
    return out


def print_estimate(entries, cuda):
    if not entries:
        return
    what = ("max_memory_allocated less what the step started with besides weights, gradients, inputs" if cuda
            else "LiveBytes above weights, gradients, inputs, plus those")
    print(f"\nestimate_memory against the measured step peak ({what}; no optimizer states):")
    print(f"{'mode':>20} {'seq':>6} {'estimate mode':>18} {'estimated':>11} {'measured':>11} {'error':>8}")
    for e in entries:
        if "not_compared" in e:
            print(f"{e['mode']:>20} {e['seq']:>6} {e['estimate_mode'] or '-':>18}  not compared: {e['not_compared']}")
        else:
            print(f"{e['mode']:>20} {e['seq']:>6} {e['estimate_mode']:>18} {fmt_bytes(e['estimated_peak_bytes']):>11} "
                  f"{fmt_bytes(e['measured_peak_bytes']):>11} {e['rel_error']:>+8.2%}")
