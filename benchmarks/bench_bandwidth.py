"""Host<->device copy bandwidth through ckpt_offload's engine and pool, against plain torch copies.

GPU: device-to-host, host-to-device and both at once, 64 KiB..1 GiB blocks: the engine path
(CopyEngine offload / prefetch / fetch into its pinned pool), torch pin_memory() tensors with
copy_(non_blocking=True) on side streams, and pageable tensors. CUDA events time every batch.
CPU (no GPU): the pool's acquire+release cost and the host-path round trip, labelled as CPU.
--disk DIR: only the disk tier's figures instead (bench_disk.py): write and read GB/s in DIR with
and without O_DIRECT, and through the tier's worker threads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

import ckpt_offload

if not __package__:  # run as a script: find the benchmarks package beside it
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _ROOT not in sys.path:
        sys.path.append(_ROOT)
from benchmarks.hardware import hardware_info  # noqa: E402
from benchmarks.report import fmt_bytes, print_table, progress_bar  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CPU_LABEL = "CPU host path (no GPU): not representative of a GPU link"
ACQUIRE_GOAL_NS = 2000  # an acquire+release pair, Python binding included


# -- GPU: the engine path -----------------------------------------------------------------------
def batch_count(size, batch_bytes):
    """Copies per timed batch: enough bytes to hide launch latency, bounded for pinned memory."""
    return max(1, min(256, batch_bytes // size))


def engine_d2h_end(eng, tiny):
    """Makes the current stream wait for every queued D2H copy: a tiny offload queued behind them on the
    same in-order D2H stream, fetched back (its reload waits for its own offload)."""
    eng.fetch(eng.offload(tiny))


def time_events(fn):
    """Milliseconds between events on the current stream around fn (fn orders its copies after the
    start event and makes the current stream wait for them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def engine_run(eng, src, k, tiny):
    """One repetition of each direction through the engine: {direction: ms}."""
    def offload():
        handles = [eng.offload(src) for _ in range(k)]
        engine_d2h_end(eng, tiny)
        return handles

    ms = {}
    ms["d2h"], handles = time_events(offload)
    eng.synchronize()

    def reload():
        for h in handles:
            eng.prefetch(h)
        return [eng.fetch(h) for h in handles]

    ms["h2d"], outs = time_events(reload)
    del outs
    on_host = [eng.offload(src) for _ in range(k)]
    eng.synchronize()

    def both():
        new = []
        for h in on_host:
            new.append(eng.offload(src))
            eng.prefetch(h)
        outs = [eng.fetch(h) for h in on_host]
        engine_d2h_end(eng, tiny)
        return new, outs

    ms["both"], _ = time_events(both)
    eng.synchronize()
    return ms


def engine_method(size, k, reps):
    pool = ckpt_offload.HostPool(pinned=True)
    # A CUDA engine needs an explicit device index (only engine_for() fills in the current one).
    eng = ckpt_offload.CopyEngine(torch.device("cuda", torch.cuda.current_device()), pool)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    tiny = torch.zeros(512, dtype=torch.uint8, device="cuda")
    # Correctness and warm-up: the first run fills the pool and the device caching allocator.
    back = eng.fetch(eng.offload(src))
    if not torch.equal(back, src):
        raise RuntimeError(f"engine round trip of {size} bytes changed the data")
    engine_run(eng, src, k, tiny)
    pool.reset_stats()
    runs = [engine_run(eng, src, k, tiny) for _ in range(reps)]
    extra = dict(pool_alloc_calls_timed=pool.stats()["alloc_calls"], pool_reserved_bytes=pool.stats()["reserved_bytes"])
    del eng, pool
    return runs, extra


# -- GPU: plain torch copies ------------------------------------------------------------------------
def torch_run(dev_src, dev_dst, host_src, host_dst, k):
    """D2H into host_dst, H2D from host_src, and both at once on two side streams: {direction: ms}."""
    cur = torch.cuda.current_stream()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ms = {}
    for direction in ("d2h", "h2d", "both"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        s1.wait_event(start)
        s2.wait_event(start)
        for _ in range(k):
            if direction in ("d2h", "both"):
                with torch.cuda.stream(s1):
                    host_dst.copy_(dev_src, non_blocking=True)
            if direction in ("h2d", "both"):
                with torch.cuda.stream(s2):
                    dev_dst.copy_(host_src, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)
        end.record(cur)
        end.synchronize()
        ms[direction] = start.elapsed_time(end)
    return ms


def torch_method(size, k, reps, pinned):
    dev_src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    dev_dst = torch.empty_like(dev_src)
    host_src = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    host_dst = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    torch_run(dev_src, dev_dst, host_src, host_dst, 1)  # warm-up
    runs = [torch_run(dev_src, dev_dst, host_src, host_dst, k) for _ in range(reps)]
    del host_src, host_dst
    if pinned and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # torch caches pinned blocks; give them back between sizes
    return runs, {}


def gpu_rows(a, bar, problems):
    rows = []
    methods = {"engine": engine_method, "torch_pinned": lambda s, k, r: torch_method(s, k, r, True),
               "pageable": lambda s, k, r: torch_method(s, k, r, False)}
    for size in a.size_list:
        k = batch_count(size, a.batch_mib * MiB)
        for name, fn in methods.items():
            bar.set_description(f"{name} {fmt_bytes(size)}")
            try:
                runs, extra = fn(size, k, a.reps)
            except Exception as err:  # noqa: BLE001 - record it, measure the rest
                traceback.print_exc()
                problems.append(f"{name} {size} bytes: {type(err).__name__}: {err}")
                bar.update(1)
                continue
            for direction in ("d2h", "h2d", "both"):
                times = [r[direction] for r in runs]
                moved = k * size * (2 if direction == "both" else 1)
                rows.append(dict(method=name, direction=direction, block_bytes=size, copies_per_batch=k,
                                 ms_median=statistics.median(times), ms_all=times,
                                 gb_per_s=moved / (statistics.median(times) * 1e-3) / 1e9, **extra))
            torch.cuda.empty_cache()
            bar.update(1)
    return rows


# -- CPU: pool and host path ----------------------------------------------------------------------
def ns_per_call(fn, n):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def acquire_rows(a, bar):
    """acquire+release pairs of one size: the block dies at once, so each call is one pair."""
    rows = []
    for size in (4 * KiB, 64 * KiB, MiB, 64 * MiB):
        pool = ckpt_offload.HostPool(pinned=ckpt_offload.build_info()["cuda_usable"])
        acquire, round_size = pool.acquire, ckpt_offload.HostPool.round_size
        acquire(size)  # the one allocation; every later pair reuses the block
        pool.reset_stats()
        pair = min(ns_per_call(lambda: acquire(size), a.iters) for _ in range(3))
        binding = min(ns_per_call(lambda: round_size(size), a.iters) for _ in range(3))
        s = pool.stats()
        rows.append(dict(block_bytes=size, pair_ns=pair, trivial_binding_call_ns=binding,
                         pair_minus_trivial_call_ns=pair - binding, alloc_calls_timed=s["alloc_calls"],
                         hits=s["hits"], goal_ns=ACQUIRE_GOAL_NS, meets_goal=pair < ACQUIRE_GOAL_NS))
        bar.update(1)
    return rows


def host_round_trip_rows(a, bar, problems):
    """CopyEngine('cpu'): offload copies into a pool block, fetch copies back (the test path)."""
    pool = ckpt_offload.HostPool(pinned=False)
    eng = ckpt_offload.CopyEngine("cpu", pool)
    rows = []
    for size in [64 * KiB * 4**i for i in range(6)]:  # 64 KiB .. 64 MiB
        t = torch.randint(0, 256, (size,), dtype=torch.uint8)
        if not torch.equal(eng.fetch(eng.offload(t)), t):
            problems.append(f"host-path round trip of {size} bytes changed the data")
        n = max(3, min(2000, (256 * MiB) // size))
        engine = min(ns_per_call(lambda: eng.fetch(eng.offload(t)), n) for _ in range(3))
        scratch = torch.empty_like(t)
        plain = min(ns_per_call(lambda: torch.empty_like(t).copy_(scratch.copy_(t)), n) for _ in range(3))
        rows.append(dict(block_bytes=size, round_trip_us=engine / 1e3, round_trip_gb_per_s=size / engine,
                         moved_gb_per_s=2 * size / engine, plain_copy_pair_us=plain / 1e3,
                         plain_copy_pair_gb_per_s=size / plain))
        bar.update(1)
    return rows


# -- output ---------------------------------------------------------------------------------------
def print_gpu(rows):
    print("\nGB/s = 1e9 bytes/s, median of repetitions, CUDA events; 'both' = D2H and H2D at once (sum of both)")
    table = []
    for size in sorted({r["block_bytes"] for r in rows}):
        cells = [fmt_bytes(size)]
        for method in ("engine", "torch_pinned", "pageable"):
            for d in ("d2h", "h2d", "both"):
                cells.append(next((f"{r['gb_per_s']:.1f}" for r in rows if r["block_bytes"] == size
                                   and r["method"] == method and r["direction"] == d), "failed"))
        table.append(cells)
    print_table(["block"] + [f"{m} {d}" for m in ("engine", "pinned", "pageable") for d in ("d2h", "h2d", "both")],
                table)
    allocs = {r["pool_alloc_calls_timed"] for r in rows if r["method"] == "engine"}
    print(f"engine pool allocations during timed batches: {sorted(allocs)}")


def print_host(acq, rt, gpu):
    print("\n" + ("host pool (pinned)" if gpu else CPU_LABEL))
    print(f"pool acquire+release, per pair, perf_counter_ns over many iterations; includes the Python binding "
          f"call (and its GIL release); goal < {ACQUIRE_GOAL_NS / 1e3:.0f} us")
    print_table(["block", "pair ns", "trivial binding call ns", "difference ns", "allocs timed", "goal met"],
                [[fmt_bytes(r["block_bytes"]), f"{r['pair_ns']:.0f}", f"{r['trivial_binding_call_ns']:.0f}",
                  f"{r['pair_minus_trivial_call_ns']:.0f}", r["alloc_calls_timed"], r["meets_goal"]] for r in acq])
    if not rt:
        return
    print("\nhost-path round trip (CopyEngine('cpu'): offload into a pool block, fetch back) vs two plain copies")
    print_table(["block", "round trip us", "GB/s (block/time)", "plain pair us", "plain GB/s"],
                [[fmt_bytes(r["block_bytes"]), f"{r['round_trip_us']:.1f}", f"{r['round_trip_gb_per_s']:.2f}",
                  f"{r['plain_copy_pair_us']:.1f}", f"{r['plain_copy_pair_gb_per_s']:.2f}"] for r in rt])


def plot(result, out_dir):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (the JSON holds every figure)")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, "bench_bandwidth.png")
    if result["gpu"]:
        rows = result["gpu_rows"]
        fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
        for ax, d in zip(axes, ("d2h", "h2d", "both")):
            for method in ("engine", "torch_pinned", "pageable"):
                pts = sorted((r["block_bytes"], r["gb_per_s"]) for r in rows if r["method"] == method and r["direction"] == d)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set(xscale="log", xlabel="block bytes", title=d)
        axes[0].set_ylabel("GB/s")
        axes[0].legend()
    else:
        rows = result["cpu_round_trip"]
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in (("round_trip_gb_per_s", "engine round trip"), ("plain_copy_pair_gb_per_s", "plain copies")):
            ax.plot([r["block_bytes"] for r in rows], [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", xlabel="block bytes", ylabel="GB/s (block / round trip)", title=CPU_LABEL)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", help="comma-separated block bytes (default 64 KiB..1 GiB, powers of 4)")
    p.add_argument("--batch-mib", type=int, default=256, help="bytes per timed batch (at most 256 copies)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--iters", type=int, default=100_000, help="acquire+release pairs per CPU measurement")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    p.add_argument("--disk", metavar="DIR", help="measure the disk tier in DIR instead (see bench_disk.py)")
    p.add_argument("--disk-block-mib", type=int, default=64, help="bytes per file with --disk (a layer's input)")
    p.add_argument("--disk-mib", type=int, default=1024, help="bytes written and read per pass with --disk")
    a = p.parse_args(argv)
    a.size_list = [int(s) for s in a.sizes.split(",")] if a.sizes else [64 * KiB * 4**i for i in range(8)]
    return a


def disk_main(a):
    from benchmarks.bench_disk import disk_result, print_disk

    os.makedirs(a.out, exist_ok=True)
    result = dict(kind="bench_disk", hardware=hardware_info(), config=vars(a))
    result.update(disk_result(a.disk, a.disk_block_mib * MiB, a.disk_mib * MiB))
    path = os.path.join(a.out, "bench_disk.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print_disk(result)
    print(f"\nJSON: {path}")
    if result["problems"]:
        print("PROBLEMS:\n  " + "\n  ".join(result["problems"]))
        return 3
    return 0


def main(argv=None):
    a = parse_args(argv)
    if a.disk:
        return disk_main(a)
    gpu = torch.cuda.is_available() and ckpt_offload.build_info()["cuda_usable"]
    os.makedirs(a.out, exist_ok=True)
    t0 = time.monotonic()
    result = dict(kind="bench_bandwidth", gpu=gpu, hardware=hardware_info(), config=vars(a), problems=[])
    total = len(a.size_list) * 3 if gpu else 4 + 6
    with progress_bar(total) as bar:
        if gpu:
            result["gpu_rows"] = gpu_rows(a, bar, result["problems"])
        # The pool's own cost is measured on every machine (pinned blocks where CUDA is usable).
        result["acquire_release"] = acquire_rows(a, bar)
        if not gpu:
            result["label"] = CPU_LABEL
            result["cpu_round_trip"] = host_round_trip_rows(a, bar, result["problems"])
    result["plots"] = plot(result, a.out)
    result["elapsed_s"] = time.monotonic() - t0
    path = os.path.join(a.out, "bench_bandwidth.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    if gpu:
        print_gpu(result["gpu_rows"])
    print_host(result["acquire_release"], result.get("cpu_round_trip"), gpu)
    print(f"\nJSON: {path}; plots: {', '.join(result['plots'])}; {result['elapsed_s']:.1f} s")
    if result["problems"]:
        print("PROBLEMS:\n  " + "\n  ".join(result["problems"]))
        return 3
    print("round trips returned the bytes they were given")
    return 0


if __name__ == "__main__":
    sys.exit(main())
