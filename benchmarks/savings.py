"""Memory savings: the theoretical saving of each offload mode beside the measured one.
"""
from __future__ import annotations


def savings(rows, a):
    """Theoretical (offloaded layers x b x s x h x bytes) beside measured peak differences."""
    out = []
    pairs = [("async_offload", "full"), ("every2_async", "every2"), ("sync_offload", "full"), ("attn_offload", "full")]
    for seq in a.seq_list:
        by = {r["mode"]: r for r in rows if r["seq"] == seq and "step_ms_median" in r}
        for mode, base in pairs:
            if mode in by and base in by:
                theory = by[mode]["offloaded_layers"] * a.batch * seq * a.hidden * a.elem
                key = "peak_device_bytes" if a.cuda else "live_peak_bytes"  # CPU: tracked live tensor bytes
                pb, pm = by[base].get(key), by[mode].get(key)
                measured = pb - pm if pb is not None and pm is not None else None
                ab, am = by[base]["act_device_bytes"], by[mode]["act_device_bytes"]
                out.append(dict(seq=seq, mode=mode, vs=base, theoretical_bytes=theory, measured_bytes=measured,
                                fraction=measured / theory if measured is not None and theory else None,
                                after_forward_bytes=ab - am if ab is not None and am is not None else None))
                if mode == "attn_offload":
                    out[-1].update(attention_figures(a, seq, by[mode]["offloaded_layers"]))
    return out


def attention_figures(a, seq, offloaded_layers):
    """What attn_offload moves and spares per step: the attention outputs (b x s x h, plus the fp32
    logsumexp b x heads x s) of the offloaded layers go to the host, device bytes a policy saving them
    on the device would hold; and the attention forward every checkpointed layer does not recompute,
    2·b·s²·h FLOPs for QKᵀ and PV each, halved by the causal mask."""
    per_layer = a.batch * seq * a.hidden * a.elem + a.batch * a.heads * seq * 4
    return dict(attn_host_bytes=offloaded_layers * per_layer,
                recompute_avoided_flop=a.layers * 2 * a.batch * seq * seq * a.hidden)
