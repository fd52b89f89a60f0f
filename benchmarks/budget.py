"""--budget: the configuration plan_memory chooses for a device budget, beside the uniform ones.
"""
from __future__ import annotations

import ckpt_offload

from .report import fmt_bytes, fmt_ms, print_table
from .timing import run_guarded


# One setting for every block (enable_checkpointing's every_n_layers / offload / policy): the comparison.
UNIFORM = ["none", "full", "every2", "every4", "async_offload", "every2_async", "attn_offload"]


def plan_length(model, ids, a, runnable, seq):
    """With --budget: profiles the model on ids and keeps the plan for a.budget device bytes a step in
    a.plan (apply_mode's "planned"). Returns {"planned": error row} when planning failed (it then
    leaves runnable), else {}."""
    if "planned" not in runnable:
        return {}
    ckpt_offload.disable_checkpointing(model)
    model.layer_call = None
    plan, ok = run_guarded(lambda: (ckpt_offload.plan_memory(model, (ids,), a.budget, loss_fn=lambda loss: loss,
                                                             verbose=True), True), "planned", seq)
    if ok is None:
        runnable.remove("planned")
        return {"planned": plan}
    a.plan = plan
    print(f"\nplan for {a.budget} bytes at seq {seq}:\n{plan.table()}", flush=True)
    return {}


def absolute_peak(r, cuda):
    """The step's peak as the budget counts it: max_memory_allocated on a GPU; on the CPU the live
    bytes above weights, gradients and inputs plus those."""
    if cuda:
        return r.get("peak_device_bytes")
    return None if r.get("live_peak_bytes") is None else r["live_peak_bytes"] + r["base_bytes"]


def evaluate_budget(rows, budget, cuda):
    """Per sequence length: the planned row against the fastest uniform configuration whose measured
    peak fits the budget. met: planned step time <= that one's (judged on a GPU only)."""
    out = []
    for seq in sorted({r["seq"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        plan = by.get("planned")
        fits = [by[m] for m in UNIFORM if m in by and absolute_peak(by[m], cuda) is not None
                and absolute_peak(by[m], cuda) <= budget]
        best = min(fits, key=lambda r: r["step_ms_median"]) if fits else None
        entry = dict(seq=seq, budget_bytes=budget, fastest_uniform=best and best["mode"],
                     fastest_uniform_ms=best and best["step_ms_median"], planned_ms=plan and plan["step_ms_median"],
                     planned_peak_bytes=plan and absolute_peak(plan, cuda),
                     predicted_peak_bytes=plan and plan["predicted_peak_bytes"], plan_modes=plan and plan["plan_modes"])
        if plan is None:
            entry.update(met=None, note="the planned configuration did not run")
        elif best is None:
            entry.update(met=None, note="no uniform configuration fits the budget")
        elif not cuda:
            entry.update(met=None, note="CPU run: judged on a GPU")
        else:
            entry.update(met=plan["step_ms_median"] <= best["step_ms_median"], note="")
        out.append(entry)
    return out


def print_budget(entries):
    print("\n--budget: the planned configuration beside the fastest uniform one that fits (target: planned ms <= it)")
    print_table(["seq", "budget", "plan peak", "predicted", "plan ms", "fastest fitting", "its ms", "verdict", "note"],
                [[e["seq"], fmt_bytes(e["budget_bytes"]), fmt_bytes(e["planned_peak_bytes"]), fmt_bytes(e["predicted_peak_bytes"]),
                  fmt_ms(e["planned_ms"]), e["fastest_uniform"] or "n/a", fmt_ms(e["fastest_uniform_ms"]),
                  "met" if e["met"] else ("MISSED" if e["met"] is False else "n/a"), e["note"]] for e in entries])
    for e in entries:
        if e["plan_modes"]:
            print(f"plan @ seq {e['seq']}: {', '.join(e['plan_modes'])}")
