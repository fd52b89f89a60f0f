"""How long building ckpt_offload takes: the working tree against a git revision, each built as
`pip install --no-build-isolation .` builds it (pip wheel, which installs nothing), from a fresh copy
with no build folder, one after the other on this machine with the same MAX_JOBS. Prints both times and the ratio.

    python benchmarks/bench_build.py --baseline <rev> [--jobs N] [--host-only] [--rounds R]

A shared machine skews a pair: run it on an idle one, or with --rounds 2 or more, which alternates
which of the two goes first, and read the load averages printed beside each build.
"""
import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout


def export_worktree(dest):
    """The working tree as it is (tracked files, edits included, and untracked files git does not ignore)."""
    for rel in git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        src = os.path.join(ROOT, rel)
        if rel and os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def export_revision(rev, dest):
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def build(src, env, log):
    """Seconds that pip took to build a wheel of src; raises with the log's tail when it failed."""
    out = os.path.join(os.path.dirname(src), "wheel-" + os.path.basename(src))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-w", out, src]
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if rc != 0:
        with open(log) as f:
            sys.exit(f"bench_build: the build of {src} failed:\n" + "".join(f.readlines()[-30:]))
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision to compare with (a commit, branch or tag)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="MAX_JOBS for both builds (default: the CPU count)")
    ap.add_argument("--host-only", action="store_true", help="build the host-only variant (CKPT_OFFLOAD_WITH_CUDA=0)")
    ap.add_argument("--rounds", type=int, default=1, help="pairs of builds; the order alternates (default 1)")
    args = ap.parse_args()

    rev = git("rev-parse", "--short", args.baseline).strip()
    env = dict(os.environ, MAX_JOBS=str(args.jobs))
    # ccache would turn the second build of a source into a lookup.
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if "ccache" not in p)
    env["CCACHE_DISABLE"] = "1"
    if args.host_only:
        env["CKPT_OFFLOAD_WITH_CUDA"] = "0"
    variant = "host-only" if args.host_only else "default variant (CUDA when torch has CUDA and a toolkit is found)"
    print(f"bench_build: {cpu_name()}, {os.cpu_count()} CPUs, MAX_JOBS={args.jobs}, {variant}, "
          f"{args.rounds} round(s); baseline {rev}")

    times = {"baseline": [], "tree": []}
    with tempfile.TemporaryDirectory(prefix="ckpt_offload-bench-build.") as work:
        for r in range(args.rounds):
            order = ["baseline", "tree"] if r % 2 == 0 else ["tree", "baseline"]
            for which in order:
                src = os.path.join(work, f"{which}-{r}")  # a fresh copy each time: no build folder to reuse
                if which == "baseline":
                    export_revision(args.baseline, src)
                else:
                    export_worktree(src)
                load = os.getloadavg()[0]
                seconds = build(src, env, os.path.join(work, f"{which}-{r}.log"))
                times[which].append(seconds)
                print(f"  round {r + 1}: {which:8s} {seconds:7.1f} s   (load average {load:.1f} before, "
                      f"{os.getloadavg()[0]:.1f} after)", flush=True)
                shutil.rmtree(src)

    base, tree = statistics.median(times["baseline"]), statistics.median(times["tree"])
    print(f"baseline {rev}: {base:.1f} s   working tree: {tree:.1f} s   ratio tree/baseline: {tree / base:.2f} "
          f"(medians of {args.rounds})")


if __name__ == "__main__":
    main()
