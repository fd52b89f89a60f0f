"""benchmarks/soak.py: a short soak passes its own --check on the CPU test path, and the check
fails on growth (the long run is CI's, see docs/testing.md)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import soak  # noqa: E402


def test_short_soak_passes_its_check():
    """PITFALLS 22: a short soak (mixed lengths, modes, dropped forwards, the disk tier) passes its growth
    check. Fails on growth of RSS, fds, threads, pool bytes, files or live objects."""
    env = dict(os.environ, CKPT_OFFLOAD_TEST_CPU="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--steps", "30", "--warmup", "10",
                        "--sample", "5", "--device", "cpu", "--check", "--exceptions", "0.2", "--dropped", "0.2",
                        # 20 steps fit: the allocator's first growth is no slope per 1000 steps
                        "--max-rss-mib", "1000"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "--check passed" in out
    for label in ("RSS MiB", "open fds", "threads", "pool reserved MiB", "pool in use MiB", "spill files",
                  "Python objects"):
        assert f"\n{label}" in out, label
    # The mix really happened: spills to the disk tier, dropped forwards and raised ones.
    spilled = int(out.split("spilled ")[1].split()[0])
    assert spilled > 0, out
    counts = out.split(" full steps, ")[1].split(";")[0]
    assert not counts.startswith("0 forwards") and " 0 raised" not in counts, counts


def _samples(step_growth):
    base = dict(rss=900 << 20, fds=9, threads=5, pool_reserved=1 << 18, pool_in_use=0, spill_files=0, objects=1000)
    out = []
    for step in range(0, 101, 10):
        s = dict(base, step=step)
        for key, per_step in step_growth.items():
            s[key] = base[key] + per_step * step
        out.append(s)
    return out


@pytest.mark.parametrize("growth, message", [
    ({}, None),
    ({"rss": 1 << 20}, "RSS grows"),
    ({"objects": 5}, "live Python objects grow"),
    ({"fds": 1}, "open fds"),
    ({"threads": 1}, "threads"),
    ({"pool_reserved": 1 << 18}, "pool reserved"),
    ({"pool_in_use": 1}, "bytes in use after the last step"),
    ({"spill_files": 1}, "files left in the spill folder"),
])
def test_check_names_each_growth(growth, message, capsys):
    args = soak.parse_args(["--steps", "100", "--warmup", "20"])
    stats = dict(tensors_offloaded=1, tensors_spilled=1, tensors_read_back=1, tensors_kept_on_device=0)
    problems = soak.report(args, _samples(growth), dict.fromkeys(soak.EVENTS, 1), 1.0, stats, 0, 1 << 18)
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1 and message in problems[0], problems
    assert soak.report(args, _samples({}), dict.fromkeys(soak.EVENTS, 1), 1.0, stats, 3, 1 << 18) == [
        "3 files left in the spill folder after set_spill_dir(None)"]
