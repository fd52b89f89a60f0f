"""Disk bandwidth for the disk tier (host_pool().set_spill_dir): what the filesystem of a directory
gives pwrite/pread with and without O_DIRECT, and what the tier's worker threads get through the pool.
Run as `bench_bandwidth.py --disk DIR` (a module of the benchmarks package); the output names the
device and filesystem of DIR."""
from __future__ import annotations

import mmap
import os
import time

import torch

import ckpt_offload

MiB = 1 << 20


def filesystem_of(path):
    """(device, fstype, mount point) of the mount holding path, from /proc/mounts."""
    real = os.path.realpath(path)
    best = ("unknown", "unknown", "/")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[2]):
                    best = (dev, fstype, mnt)
    except OSError:
        pass
    return dict(device=best[0], fstype=best[1], mount=best[2])


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds > 0 else None


def _open(path, flags, direct):
    """os.open with O_DIRECT when asked; None when the filesystem refuses it (tmpfs: EINVAL)."""
    try:
        return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
    except OSError:
        if direct:
            return None
        raise


def raw_rows(directory, size, count):
    """pwrite/preadv of `count` files of `size` bytes from one page-aligned buffer, one thread."""
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(min(size, 16 * MiB)) * max(1, size // (16 * MiB)))
    rows = []
    for direct in (True, False):
        paths = [os.path.join(directory, f"bench-{os.getpid()}-{i}.bin") for i in range(count)]
        row = dict(path="pwrite/pread", o_direct=direct, block_bytes=size, blocks=count)
        try:
            t0 = time.perf_counter()
            for p in paths:
                fd = _open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
                if fd is None:
                    row["error"] = "O_DIRECT refused by the filesystem"
                    break
                os.pwrite(fd, buf, 0)
                os.close(fd)
            if "error" in row:
                rows.append(row)
                continue
            t1 = time.perf_counter()
            for p in paths:  # what is still in the page cache goes to the disk, then out of the cache
                fd = os.open(p, os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            t2 = time.perf_counter()
            view = memoryview(buf)
            for p in paths:
                fd = _open(p, os.O_RDONLY, direct)
                os.preadv(fd, [view], 0)
                os.close(fd)
            t3 = time.perf_counter()
            total = size * count
            row.update(write_gb_per_s=_gbps(total, t1 - t0), write_synced_gb_per_s=_gbps(total, t2 - t0),
                       read_cold_gb_per_s=_gbps(total, t3 - t2))
            if not direct:
                t4 = time.perf_counter()
                for p in paths:  # read again: from the page cache this time
                    fd = os.open(p, os.O_RDONLY)
                    os.preadv(fd, [view], 0)
                    os.close(fd)
                row["read_cached_gb_per_s"] = _gbps(total, time.perf_counter() - t4)
            view.release()
        finally:
            for p in paths:
                if os.path.exists(p):
                    os.unlink(p)
        rows.append(row)
    buf.close()
    return rows


def tier_row(directory, size, count):
    """count tensors of size bytes offloaded through a pool capped at two blocks, then fetched: every
    tensor but the last two goes to the disk and back, through the tier's workers."""
    os.environ["CKPT_OFFLOAD_TEST_CPU"] = "1"  # CPU tensors through the engine (the host path)
    pool = ckpt_offload.HostPool(pinned=False)
    eng = ckpt_offload.CopyEngine("cpu", pool)
    pool.set_capacity(2 * ckpt_offload.HostPool.round_size(size))
    pool.set_spill_dir(directory)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    t0 = time.perf_counter()
    handles = [eng.offload(src) for _ in range(count)]
    eng.synchronize()
    t1 = time.perf_counter()
    ok = all(torch.equal(eng.fetch(h), src) for h in reversed(handles))
    t2 = time.perf_counter()
    s = pool.spill_stats()
    pool.set_spill_dir(None)
    row = dict(path="disk tier", o_direct=s["io_mode"] == "direct", block_bytes=size, blocks=count,
               tensors_spilled=s["tensors_spilled"], bytes_spilled=s["bytes_spilled"], round_trip_ok=ok,
               write_gb_per_s=_gbps(s["bytes_spilled"], s["write_ms"] / 1e3),
               read_cold_gb_per_s=_gbps(s["bytes_read"], s["read_ms"] / 1e3),
               offload_wall_gb_per_s=_gbps(size * count, t1 - t0), fetch_wall_gb_per_s=_gbps(size * count, t2 - t1),
               read_waits=s["read_waits"], write_waits=s["write_waits"])
    return row


def disk_result(directory, size=64 * MiB, total=1 << 30):
    if not os.path.isdir(directory):
        raise SystemExit(f"bench_bandwidth --disk: {directory!r} is not a directory")
    count = max(3, total // size)
    fs = filesystem_of(directory)
    rows = raw_rows(directory, size, count) + [tier_row(directory, size, count)]
    problems = [f"disk tier round trip of {size} bytes came back different"
                for r in rows if r.get("round_trip_ok") is False]
    return dict(directory=os.path.realpath(directory), filesystem=fs, rows=rows, problems=problems)


def print_disk(result):
    fs = result["filesystem"]
    print(f"\ndisk: {result['directory']} on {fs['device']} ({fs['fstype']}, mounted at {fs['mount']})")
    cols = ["write_gb_per_s", "write_synced_gb_per_s", "read_cold_gb_per_s", "read_cached_gb_per_s"]
    head = ["path", "O_DIRECT", "block", "blocks", "write GB/s", "write+fsync GB/s", "read (cold) GB/s",
            "read (cached) GB/s"]
    table = [head]
    for r in result["rows"]:
        if "error" in r:
            table.append([r["path"], r["o_direct"], r["block_bytes"] // MiB, r["blocks"], r["error"], "", "", ""])
            continue
        cells = ["" if r.get(c) is None else f"{r[c]:.2f}" for c in cols]
        table.append([r["path"], "yes" if r["o_direct"] else "no", f"{r['block_bytes'] // MiB} MiB", r["blocks"]]
                     + cells)
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for k, row in enumerate(table):
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    tier = result["rows"][-1]
    print(f"disk tier: {tier['tensors_spilled']} tensors spilled and read back through its workers "
          f"({'O_DIRECT' if tier['o_direct'] else 'buffered'}); round trip "
          f"{'returned the bytes it was given' if tier['round_trip_ok'] else 'FAILED'}; "
          f"{tier['read_waits']} reads waited for (no read ahead here: fetched at once)")
