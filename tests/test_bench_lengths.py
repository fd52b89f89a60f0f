"""bench_step.py's varying-length pass and its noise marks: lengths drawn per step (seeded, padded),
host allocations flat after the longest step, and step-time ratios reported as differences only
when every paired round agrees."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_step  # noqa: E402


def args(*extra):
    return bench_step.parse_args(["--config", "small", *extra])


def test_lengths_are_seeded_padded_and_within_range():
    a = args("--lengths", "20:100", "--pad-to", "16", "--length-steps", "50", "--seed", "3")
    lengths = bench_step.length_schedule(a)
    assert lengths == bench_step.length_schedule(a)  # the same seed, the same lengths
    assert len(lengths) == 50 and all(n % 16 == 0 and 20 <= n <= 100 for n in lengths)
    assert len(set(lengths)) > 3
    assert bench_step.length_schedule(args("--lengths", "20:100", "--pad-to", "16", "--seed", "4")) != lengths[:12]
    assert args("--lengths", "off").length_range is None


def test_bad_lengths_are_refused_with_the_reason(capsys):
    for bad, why in [(["--lengths", "64"], "MIN:MAX"), (["--lengths", "64:16"], "MIN <= MAX"),
                     (["--lengths", "17:23", "--pad-to", "8"], "no multiple"),
                     (["--length-modes", "full,nope"], "unknown modes")]:
        try:
            args(*bad)
        except SystemExit:
            pass
        else:
            raise AssertionError(f"{bad} was accepted")
        assert why in capsys.readouterr().err


def row(mode, times):
    return dict(mode=mode, seq=64, step_ms_all=times, step_ms_median=sorted(times)[len(times) // 2])


def test_ratios_are_within_noise_unless_every_round_agrees():
    rows = [row("full", [10.0, 12.0, 11.0]), row("a", [9.0, 13.0, 11.5]), row("b", [12.0, 13.0, 12.5])]
    bench_step.add_ratios(rows)
    bench_step.mark_noise(rows)
    full, a, b = rows
    assert a["time_vs_full_within_noise"] and a["time_vs_full_paired"] == [0.9, 13.0 / 12.0]
    assert not b["time_vs_full_within_noise"] and b["time_vs_full_paired"][0] > 1
    assert bench_step.fmt_time_ratio(a, "full") == "within noise" and bench_step.fmt_paired(a, "full") == "0.90-1.08"
    assert bench_step.fmt_time_ratio(b, "full") == "1.136x" and bench_step.fmt_paired(b, "full") == "1.08-1.20"
    assert bench_step.fmt_time_ratio(full, "full") == "base"


def test_the_varying_length_pass_allocates_nothing_after_its_longest_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CKPT_OFFLOAD_TEST_CPU", None)
    p = subprocess.run([sys.executable, "benchmarks/bench_step.py", "--config", "small", "--modes", "full,async_offload",
                        "--lengths", "16:64", "--length-steps", "10", "--seed", "1", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.load(open(tmp_path / "bench_step.json"))
    assert result["problems"] == []
    rows = {r["mode"]: r for r in result["lengths"]}
    assert set(rows) == set(bench_step.LENGTH_MODES.split(","))
    asy = rows["async_offload"]
    assert len(asy["host_alloc_calls_per_step"]) == 10 and len(set(asy["lengths"])) > 2
    assert sum(asy["host_alloc_calls_per_step"][: asy["longest_step"] + 1]) >= 3  # the pool started empty
    assert asy["allocs_after_longest"] == 0 and asy["frees_after_longest"] == 0
    assert "varying lengths" in p.stdout and "paired rounds" in p.stdout
    main = {r["mode"]: r for r in result["rows"]}
    assert "time_vs_full_within_noise" in main["async_offload"]
