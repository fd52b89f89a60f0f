"""benchmarks/bench_trl.py runs end to end on a tiny model: ckpt_offload's rows offload through the
engine with the losses of the run without offload; TRL's own offloader runs only with a GPU."""
import json
import os
import sys

import pytest
import torch

pytest.importorskip("trl")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_bench_trl_runs_and_reports(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    import bench_trl

    rows = bench_trl.main(["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--vocab", "64",
                           "--steps", "2", "--warmup", "1", "--dtype", "fp32", "--out", str(tmp_path)])
    by = {(r["mode"], r["checkpointing"]): r for r in rows}
    assert len(by) == 6
    for gc in (False, True):
        none, ours, own = by[("none", gc)], by[("ckpt_offload", gc)], by[("trl", gc)]
        assert ours["losses"] == none["losses"]
        assert ours["engine_bytes_offloaded_per_step"] > 0 and none["engine_bytes_offloaded_per_step"] == 0
        assert ours["host_in_use_bytes_after"] == 0 and ours["host_alloc_calls_timed"] == 0
        if torch.cuda.is_available():
            assert "error" not in own
        else:
            assert "CUDA" in own["error"]
    saved = json.loads((tmp_path / "bench_trl.json").read_text())
    assert saved["kind"] == "bench_trl" and len(saved["rows"]) == 6
    assert saved["gpu"] or "not representative" in saved["label"]
