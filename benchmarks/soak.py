"""A soak: many training steps that mix what a long job meets, watching the process's resources.

Each step draws a sequence length, an offload mode (checkpoint, checkpoint+offload,
checkpoint+offload with keep_last, offload_activations, offload_activations with keep_last) and
an event: a full step (forward, backward, optimizer), a forward dropped without backward, or an
exception raised in the middle of the forward. The host pool is capped below one step's offloads
with the disk tier in a temporary folder, so every offloading step spills and reads back.

Every --sample steps (after gc and synchronize) it records the resident set size, open file
descriptors, threads, the pool's bytes (reserved, in use), files in the spill folder and live
Python objects; it prints them at the start, after warm-up and at the end, with each one's slope
per 1000 steps from a linear fit over the samples after warm-up. --check turns growth beyond the
stated limits into a non-zero exit with a message naming each one.

    python benchmarks/soak.py                       # 2000 steps, on the GPU when there is one
    python benchmarks/soak.py --steps 300 --check   # CI: the CPU test path
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import tempfile
import time

MiB = 1 << 20
MODES = ("checkpoint", "checkpoint+offload", "checkpoint+offload keep_last", "offload_activations",
         "offload_activations keep_last")
EVENTS = ("step", "dropped", "exception")
# Each metric: (label, unit divisor, unit).
METRICS = {
    "rss": ("RSS", MiB, "MiB"),
    "fds": ("open fds", 1, ""),
    "threads": ("threads", 1, ""),
    "pool_reserved": ("pool reserved", MiB, "MiB"),
    "pool_in_use": ("pool in use", MiB, "MiB"),
    "spill_files": ("spill files", 1, ""),
    "objects": ("Python objects", 1, ""),
}


class Boom(Exception):
    """Raised in the middle of a forward (the exception event)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu runs the CPU test path (CKPT_OFFLOAD_TEST_CPU=1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lengths", default="16,32,48,64,96,128", help="sequence lengths drawn from")
    p.add_argument("--dropped", type=float, default=0.15, help="share of forwards dropped without backward")
    p.add_argument("--exceptions", type=float, default=0.05, help="share of forwards that raise midway")
    p.add_argument("--sample", type=int, default=10, help="steps between two samples")
    p.add_argument("--warmup", type=int, default=None, help="steps before the fit (default: a fifth, at most 200)")
    p.add_argument("--check", action="store_true", help="exit non-zero on growth beyond the limits below")
    p.add_argument("--max-rss-mib", type=float, default=64.0, help="RSS slope, MiB per 1000 steps")
    p.add_argument("--max-objects", type=float, default=2000.0, help="live Python objects' slope, per 1000 steps")
    p.add_argument("--max-fds", type=int, default=4, help="open fds above the warm-up figure, at any sample")
    p.add_argument("--max-threads", type=int, default=2, help="threads above the warm-up figure, at any sample")
    p.add_argument("--max-pool-mib", type=float, default=1.0,
                   help="pool reserved: the most above the warm-up figure, MiB (reads past the cap may add blocks)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.sample < 1:
        p.error("--steps and --sample must be >= 1")
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.warmup is None:
        args.warmup = min(200, args.steps // 5)
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    return args


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def count_files(root):
    return sum(len(files) for _, _, files in os.walk(root))


def fit_slope(xs, ys):
    """Least-squares slope of ys over xs (0 for fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def build(torch, nn, width, layers):
    class MLPBlock(nn.Module):  # a pre-norm MLP block: its saved tensors scale with the length
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, h):
            return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(MLPBlock() for _ in range(layers))
            self.head = nn.Linear(width, 1)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x).float().square().mean()

    return Stack


def main(argv=None):
    args = parse_args(argv)
    import torch
    from torch import nn

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["CKPT_OFFLOAD_TEST_CPU"] = "1"  # before the first engine: CPU tensors through the engine
    import ckpt_offload

    torch.manual_seed(args.seed)
    if device == "cpu":
        torch.set_num_threads(1)  # small matrices: more intra-op threads only contend
    rng = random.Random(args.seed)
    Stack = build(torch, nn, args.width, args.layers)
    # One model per checkpointing configuration (configured once), one plain for the contexts.
    models = {"checkpoint": Stack(), "checkpoint+offload": Stack(), "checkpoint+offload keep_last": Stack(),
              "plain": Stack()}
    for m in models.values():
        m.to(device)
    ckpt_offload.enable_checkpointing(models["checkpoint"], offload=False)
    ckpt_offload.enable_checkpointing(models["checkpoint+offload"], offload=True, keep_last=0)
    ckpt_offload.enable_checkpointing(models["checkpoint+offload keep_last"], offload=True, keep_last=1)
    params = [p for m in models.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=1e-4)

    pool = ckpt_offload.host_pool()
    spill_root = tempfile.mkdtemp(prefix="ckpt_offload-soak-")
    # The cap: two layers' inputs at the longest length; every offloading step spills.
    layer_input = args.batch * max(args.lengths) * args.width * 4
    cap = 2 * pool.round_size(layer_input)
    pool.set_capacity(cap)
    pool.set_spill_dir(spill_root)

    def forward(mode, x):
        if mode.startswith("offload_activations"):
            with ckpt_offload.offload_activations(min_bytes=0, keep_last=2 if mode.endswith("keep_last") else 0):
                return models["plain"](x)
        return models[mode](x)

    def raise_midway(module, inputs):
        raise Boom("raised in the middle of the forward")

    def one_step(i):
        length = rng.choice(args.lengths)
        mode = rng.choice(MODES)
        r = rng.random()
        event = "exception" if r < args.exceptions else "dropped" if r < args.exceptions + args.dropped else "step"
        x = torch.randn(args.batch, length, args.width, device=device, requires_grad=True)
        model = models["plain"] if mode.startswith("offload_activations") else models[mode]
        if event == "exception":
            handle = model.layers[len(model.layers) // 2].register_forward_pre_hook(raise_midway)
            try:
                forward(mode, x)
            except Boom:
                pass
            else:
                raise SystemExit("soak: the forward did not raise")
            finally:
                handle.remove()
        elif event == "dropped":
            forward(mode, x)  # the loss and its graph go at once
        else:
            loss = forward(mode, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return event

    def sample(step):
        gc.collect()
        if device == "cuda":
            torch.cuda.synchronize()
        ckpt_offload.synchronize()
        s = pool.stats()
        return dict(step=step, rss=rss_bytes(), fds=len(os.listdir("/proc/self/fd")),
                    threads=len(os.listdir("/proc/self/task")), pool_reserved=s["reserved_bytes"],
                    pool_in_use=s["in_use_bytes"], spill_files=count_files(spill_root), objects=len(gc.get_objects()))

    print(f"soak: ckpt_offload from {os.path.dirname(ckpt_offload.__file__)}")
    print(f"soak: {args.steps} steps on {device} ({ckpt_offload.build_info()['test_path']} test path), "
          f"{args.layers} layers of width {args.width}, batch {args.batch}, lengths {args.lengths}; host cap "
          f"{cap / MiB:.2f} MiB with the disk tier in {spill_root}; warm-up {args.warmup} steps", flush=True)
    samples = [sample(0)]
    counts = dict.fromkeys(EVENTS, 0)
    t0 = time.perf_counter()
    every = max(1, args.steps // 20)
    try:
        for i in range(1, args.steps + 1):
            counts[one_step(i)] += 1
            if i % args.sample == 0 or i == args.steps or i == args.warmup:
                if samples[-1]["step"] != i:
                    samples.append(sample(i))
            if i % every == 0 or i == args.steps:
                last = samples[-1]
                print(f"  step {i:>6}/{args.steps}  {time.perf_counter() - t0:7.1f} s  RSS {last['rss'] / MiB:7.1f} MiB"
                      f"  fds {last['fds']:>3}  threads {last['threads']:>3}  pool {last['pool_reserved'] / MiB:6.2f} "
                      f"MiB reserved, {last['pool_in_use'] / MiB:5.2f} in use  files {last['spill_files']}"
                      f"  objects {last['objects']}", flush=True)
        elapsed = time.perf_counter() - t0
        s = ckpt_offload.stats()
    finally:
        pool.set_spill_dir(None)
        pool.set_capacity(0)
        left = count_files(spill_root)
        shutil.rmtree(spill_root, ignore_errors=True)
    problems = report(args, samples, counts, elapsed, s, left, cap)
    if args.check and problems:
        print("soak: FAILED --check:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if args.check:
        print("soak: --check passed")
    return 0


def report(args, samples, counts, elapsed, s, left_after_off, cap):
    """Prints the table and returns the --check problems."""
    start = samples[0]
    warm = next(x for x in samples if x["step"] >= args.warmup)
    end = samples[-1]
    fit = [x for x in samples if x["step"] >= args.warmup]
    xs = [x["step"] for x in fit]
    print(f"\n{counts['step']} full steps, {counts['dropped']} forwards dropped without backward, "
          f"{counts['exception']} raised midway; {elapsed:.1f} s ({1e3 * elapsed / args.steps:.1f} ms a step)")
    print(f"offloaded {s['tensors_offloaded']} tensors, spilled {s['tensors_spilled']} to disk, read back "
          f"{s['tensors_read_back']}, kept on the device {s['tensors_kept_on_device']}")
    print(f"\n{'':<16}{'start':>12}{'warm-up':>12}{'end':>12}{'slope/1000':>14}   (fit over {len(fit)} samples, "
          f"steps {xs[0]}-{xs[-1]})")
    slopes = {}
    for key, (label, div, unit) in METRICS.items():
        slope = fit_slope(xs, [x[key] for x in fit]) * 1000
        slopes[key] = slope
        fmt = (lambda v: f"{v / div:.2f}") if div != 1 else (lambda v: f"{v:.0f}")
        print(f"{label + (' ' + unit if unit else ''):<16}{fmt(start[key]):>12}{fmt(warm[key]):>12}"
              f"{fmt(end[key]):>12}{slope / div:>14.2f}")
    problems = []
    if slopes["rss"] / MiB > args.max_rss_mib:
        problems.append(f"RSS grows {slopes['rss'] / MiB:.1f} MiB per 1000 steps (limit {args.max_rss_mib})")
    if slopes["objects"] > args.max_objects:
        problems.append(f"live Python objects grow {slopes['objects']:.0f} per 1000 steps (limit {args.max_objects:.0f})")
    for key, limit in (("fds", args.max_fds), ("threads", args.max_threads)):
        peak = max(x[key] for x in fit)
        if peak - warm[key] > limit:
            problems.append(f"{METRICS[key][0]}: {peak} at most after warm-up, {warm[key]} at its end "
                            f"(limit +{limit})")
    if end["pool_in_use"] != 0:
        problems.append(f"the pool still has {end['pool_in_use']} bytes in use after the last step")
    most = max(x["pool_reserved"] for x in fit)
    if most - warm["pool_reserved"] > args.max_pool_mib * MiB:
        problems.append(f"the pool reserved {most / MiB:.2f} MiB at most after warm-up, {warm['pool_reserved'] / MiB:.2f} "
                        f"at its end (limit +{args.max_pool_mib} MiB; its cap is {cap / MiB:.2f} MiB)")
    files = [x["spill_files"] for x in samples]
    if any(files):
        problems.append(f"files left in the spill folder between steps: at most {max(files)} "
                        f"(at steps {[x['step'] for x in samples if x['spill_files']][:5]})")
    if left_after_off:
        problems.append(f"{left_after_off} files left in the spill folder after set_spill_dir(None)")
    return problems


if __name__ == "__main__":
    sys.exit(main())
