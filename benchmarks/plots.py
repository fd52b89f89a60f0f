"""PNG plots of the step benchmark (matplotlib, Agg): peak memory, step-time ratio, the length sweep.
"""
from __future__ import annotations

import os

from .hf import HF_MODES
from .modes import EXTRA_MODES, MODES
from .report import CPU_LABEL


def plot(rows, a, out_dir, prefix, base):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (the JSON holds every figure)")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "step_ms_median" in r]
    modes = [m for m in MODES + EXTRA_MODES + HF_MODES if any(r["mode"] == m for r in rows)]
    files = []

    def save(fig, name):
        files.append(os.path.join(out_dir, f"{prefix}_{name}.png"))
        fig.tight_layout()
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    for key, label, name in [("peak_device_bytes", "peak device memory (GiB)", "peak_memory"),
                             (f"time_vs_{base}", f"step time / {base}", "time_ratio")]:
        if not any(r.get(key) for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / len(a.seq_list)
        for j, seq in enumerate(a.seq_list):
            vals = [next((r.get(key) or 0 for r in rows if r["mode"] == m and r["seq"] == seq), 0) for m in modes]
            vals = [v / 2**30 for v in vals] if key.endswith("bytes") else vals
            ax.bar([i + j * width for i in range(len(modes))], vals, width, label=f"seq {seq}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(modes))], modes, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.legend()
        ax.set_title(f"{label}{'' if a.cuda else ' - ' + CPU_LABEL}", fontsize=9)
        save(fig, name)
    if len(a.seq_list) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m in modes:
            pts = sorted((r["seq"], r.get(f"time_vs_{base}"), r.get("peak_device_bytes")) for r in rows if r["mode"] == m)
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
            if a.cuda:
                axes[1].plot([p[0] for p in pts], [p[2] / 2**30 for p in pts], marker="o", label=m)
        if not a.cuda:
            axes[1].text(0.5, 0.5, "no device memory on CPU", ha="center", transform=axes[1].transAxes)
        axes[0].set(xlabel="sequence length", ylabel=f"step time / {base}")
        axes[1].set(xlabel="sequence length", ylabel="peak device memory (GiB)")
        axes[0].legend(fontsize=7)
        save(fig, "seq_sweep")
    return files
