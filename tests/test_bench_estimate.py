"""bench_step.py --estimate: estimate_memory's peak per mode, from the decoder on the meta device, against the
peak the benchmark measures for the corresponding mode (on the CPU: LiveBytes plus weights, gradients, inputs)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_step  # noqa: E402
from benchmarks.estimate_check import estimate_mode, measured_peak  # noqa: E402


def test_only_modes_that_correspond_are_compared():
    a = bench_step.parse_args(["--config", "small"])
    assert [estimate_mode(m, a)[0] for m in ("none", "full", "every2")] == ["none", "checkpoint", "every_n=2"]
    mode, why = estimate_mode("async_offload", a)  # keep_last 1 keeps the last input on the device
    assert mode is None and "--keep-last 0" in why
    assert estimate_mode("async_offload", bench_step.parse_args(["--config", "small", "--keep-last", "0"]))[0] == \
        "checkpoint+offload"
    assert all(estimate_mode(m, a)[0] is None for m in ("every4", "sync_offload", "every2_async", "offload_activations"))


def test_gpu_peak_leaves_out_what_the_step_started_with_besides_weights_gradients_inputs():
    # 1000 bytes of weights, gradients and inputs; 1200 allocated at the step's start (200 of cuBLAS
    # workspaces and cached tables); the step reached 5200: 4000 above its start.
    row = dict(peak_device_bytes=5200, base_device_bytes=1200, base_bytes=1000, live_peak_bytes=None)
    assert measured_peak(row, cuda=True) == (5000, 200)
    assert measured_peak(dict(live_peak_bytes=4000, base_bytes=1000), cuda=False) == (5000, 0)
    assert measured_peak(dict(mode="none", skipped="time budget spent"), cuda=True) == (None, None)


def test_estimate_flag_defaults_and_refusals(capsys):
    a = bench_step.parse_args(["--config", "small"])
    assert a.estimate == a.cuda  # on with a GPU, opt-in on the CPU
    assert bench_step.parse_args(["--config", "small", "--no-estimate"]).estimate is False
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--config", "small", "--estimate", "--hf"])
    assert "eager decoder stack" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU --config small measures max_memory_allocated, "
                    "where at a few MiB the cuBLAS workspaces weigh; scripts/gpu_check.sh compares the standard config")
def test_bench_step_estimate_within_3_percent_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CKPT_OFFLOAD_TEST_CPU", None)  # bench_step sets it without a GPU
    p = subprocess.run([sys.executable, "benchmarks/bench_step.py", "--config", "small", "--modes", "none,full,every2",
                        "--estimate", "--lengths", "off", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    entries = json.load(open(tmp_path / "bench_step.json"))["estimate"]
    assert {e["mode"]: e["estimate_mode"] for e in entries} == {"none": "none", "full": "checkpoint",
                                                                "every2": "every_n=2"}
    for e in entries:
        assert e["estimated_peak_bytes"] == pytest.approx(e["measured_peak_bytes"], rel=0.03), e
    peaks = {e["mode"]: e["measured_peak_bytes"] for e in entries}
    assert peaks["none"] > peaks["every2"] > peaks["full"]  # the modes differ: the comparison is not trivial
    assert "estimate_memory against the measured step peak" in p.stdout


def test_bench_estimate_times_the_command_and_its_import_floor(tmp_path):
    # benchmarks/bench_estimate.py: the estimate command and the imports beneath it, in fresh
    # processes; one short run here checks what it writes (its times are the benchmark's business).
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_estimate.py"), "--runs", "1",
                        "--seq", "2048", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    r = json.load(open(tmp_path / "bench_estimate.json"))
    assert r["kind"] == "bench_estimate" and r["config"]["seq"] == 2048
    assert len(r["seconds"]["imports"]) == len(r["seconds"]["estimate"]) == 1
    assert 0 < r["seconds"]["imports"][0] and 0 < r["seconds"]["estimate"][0]
    assert r["met"] == (r["median_seconds"]["estimate"] < 5.0)
    # The 70B shape was estimated: in pure bf16 its weights, gradients and AdamW's two states (torch
    # allocates them in the parameters' dtype) alone are 526 GiB (70.6e9 parameters x 8 bytes),
    # before any activation.
    assert r["checkpoint_offload_peak_bytes"] > 526 * 2 ** 30
    assert "target: under 5 s:" in p.stdout
