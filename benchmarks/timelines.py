"""One step of a mode under ckpt_offload.timeline(): its Chrome trace and picture written next to the results,
and the overlap and exposed wait it shows, for the mode's row."""
from __future__ import annotations

import os

import ckpt_offload

from .timing import train_step


def timeline_step(model, ids, ctx, a, mode):
    """Where anything went through the engine, writes timeline_<mode>_<seq>.json (Chrome trace) and .png to
    a.out and returns the files and the summary's overlap and exposed wait; {} otherwise or with --no-timeline."""
    if not a.timeline:
        return {}
    with ckpt_offload.timeline() as tl:
        train_step(model, ids, ctx)
    if not any(s.kind == "d2h" for s in tl.spans):
        return {}  # no offload, or transformers-style synchronous offload (not through the engine)
    base = os.path.join(a.out, f"timeline_{mode}_{ids.shape[1]}")
    tl.save_chrome_trace(base + ".json")
    files = [base + ".json"]
    try:
        tl.plot(base + ".png", title=f"ckpt_offload timeline: {mode}, seq {ids.shape[1]}")
        files.append(base + ".png")
    except ImportError as err:  # without matplotlib: the trace alone
        print(f"timeline picture not drawn: {err}")
    s = tl.summary()
    waits = s["exposed_wait_ms_per_step"]
    return dict(timeline_files=[os.path.basename(f) for f in files], timeline_overlap_fraction=s["overlap_fraction"],
                timeline_exposed_wait_ms=waits[-1] if waits else None)
