"""The disk tier under the host pool (host_pool().set_spill_dir): what the cap refuses goes to files and
comes back bitwise; files go with their tensors, the per-process directory with the process; disk
faults keep tensors on the device or fail the step naming the file; the simulated runtime reports
each broken ordering of the new stage. CPU test path (CKPT_OFFLOAD_TEST_CPU=1)."""
import errno
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ckpt_offload
from tiny_gpt import grads, loss_of, make_batch, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = 6  # TinyGPT's blocks, each offloading its input (keep_last=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


class Disk:
    def __init__(self, pool, eng, root):
        self.pool, self.eng, self.root = pool, eng, root

    def settle(self):
        gc.collect()
        self.eng.synchronize()

    def files(self):
        d = self.pool.spill_dir
        return sorted(os.listdir(d)) if d else []


@pytest.fixture
def disk(tmp_path, test_cpu, monkeypatch):
    """The process-wide pool (sessions read its read-ahead depth) with an engine of this test's own."""
    pool = ckpt_offload.host_pool()
    pool.empty_cache()
    eng = ckpt_offload.CopyEngine("cpu", pool)
    monkeypatch.setattr(ckpt_offload.engine, "engine_for", lambda dev: eng)
    monkeypatch.setattr(ckpt_offload.session, "_refusal_warned", False)
    ckpt_offload.reset_stats()
    d = Disk(pool, eng, tmp_path)
    yield d
    d.settle()
    pool.set_spill_dir(None)
    pool.set_capacity(0)


def act_bytes(ids):
    return ids.numel() * 32 * 4  # one block's input: batch x seq x hidden float32


def cap_blocks(pool, ids, n):
    pool.set_capacity(n * ckpt_offload.HostPool.round_size(act_bytes(ids)))


def offloading_model():
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    return model


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss_of(model, ids).backward()
    return grads(model)


def assert_equal_grads(got, ref):
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), f"gradient of {name} differs"


def expected_grads(ids):
    ref = make_model()
    loss_of(ref, ids).backward()
    return grads(ref)


# -- the API --------------------------------------------------------------------------------------
def test_bad_paths_raise_at_the_call(tmp_path):
    pool = ckpt_offload.HostPool(pinned=False)
    with pytest.raises(ValueError, match=r"HostPool\.set_spill_dir: path '.*missing' does not exist"):
        pool.set_spill_dir(tmp_path / "missing")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"HostPool\.set_spill_dir: path '.*a_file' is not a directory"):
        pool.set_spill_dir(a_file)
    # Not writable: root passes permission bits, so a directory where nothing can be made stands in.
    if os.geteuid() == 0:
        unwritable = "/proc/self"
    else:
        unwritable = tmp_path / "ro"
        unwritable.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=r"HostPool\.set_spill_dir: path '.*' is not writable"):
        pool.set_spill_dir(unwritable)
    with pytest.raises(ValueError, match="max_bytes must be a positive"):
        pool.set_spill_dir(tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="read_ahead must be"):
        pool.set_spill_dir(tmp_path, read_ahead=-1)
    with pytest.raises(ValueError, match="path must be a str or os.PathLike"):
        pool.set_spill_dir(b"/tmp")
    with pytest.raises(TypeError):
        pool.set_spill_dir(123)
    assert pool.spill_dir is None and pool.spill_stats()["io_mode"] is None  # nothing was switched on
    assert sorted(os.listdir(tmp_path)) == ["a_file"] + (["ro"] if os.geteuid() != 0 else [])


def test_set_spill_dir_makes_a_probed_directory_of_this_process(tmp_path):
    pool = ckpt_offload.HostPool(pinned=False)
    pool.set_spill_dir(str(tmp_path), read_ahead=3)
    proc = pool.spill_dir
    assert re.fullmatch(re.escape(str(tmp_path)) + rf"/ckpt_offload-{os.getpid()}-\w{{6}}", proc)
    assert os.listdir(proc) == []  # the O_DIRECT probe left nothing
    assert pool.spill_stats()["io_mode"] in ("direct", "buffered")
    assert pool.spill_read_ahead == 3
    pool.set_spill_dir(None)
    assert pool.spill_dir is None and pool.spill_read_ahead == 0
    assert os.listdir(tmp_path) == []  # switched off with no file left: the directory went


# -- spilling -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spill_ahead", [0, 1])
def test_gradients_bitwise_equal_when_the_cap_forces_spilling(disk, spill_ahead):
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root, spill_ahead=spill_ahead)
    got = step(model, ids)
    disk.settle()
    assert_equal_grads(got, expected)
    s = ckpt_offload.stats()
    act = act_bytes(ids)
    assert disk.eng.stats()["tensors_offloaded"] == LAYERS and s["tensors_kept_on_device"] == 0
    # Four inputs went past a cap of two blocks; spill_ahead writes one more early (the oldest on
    # host when the pool filled), so that the next layer's copy need not wait for a write.
    assert s["bytes_spilled"] == (LAYERS - 2 + spill_ahead) * act
    assert s["tensors_spilled"] == LAYERS - 2 + spill_ahead == s["tensors_read_back"]
    assert s["bytes_read_back"] == s["bytes_spilled"]
    assert s["disk_io_mode"] in ("direct", "buffered")
    assert s["disk_peak_bytes"] >= s["bytes_spilled"] - act
    assert s["disk_write_errors"] == 0 == s["disk_read_errors"] == s["disk_reads_over_cap"]
    assert s["disk_gb_per_s"] is not None and s["disk_write_ms"] > 0 and s["disk_read_ms"] > 0
    assert s["host_reserved_bytes"] <= s["host_capacity_bytes"]  # the cap held throughout
    assert s["host_in_use_bytes"] == 0
    assert s["disk_files"] == 0 == s["disk_bytes"] and disk.files() == []  # gone after backward


def _eight_under_a_cap_of_four(disk):
    """Eight 256 KiB tensors offloaded under a cap of four blocks, no writes ahead: the first four
    go to disk. Returns (tensors, handles) once every copy and write is done."""
    x = [torch.randn(64 * 1024) for _ in range(8)]
    disk.pool.set_capacity(4 * ckpt_offload.HostPool.round_size(x[0].numel() * 4))
    disk.pool.set_spill_dir(disk.root, spill_ahead=0)
    hs = [disk.eng.offload(t) for t in x]
    disk.eng.synchronize()
    return x, hs


def test_the_earliest_layers_go_to_disk(disk):
    x, hs = _eight_under_a_cap_of_four(disk)
    assert [h.state for h in hs] == ["on_disk"] * 4 + ["on_host"] * 4
    assert len(disk.files()) == 4
    back = [disk.eng.fetch(h) for h in reversed(hs)][::-1]
    assert all(torch.equal(a, b) for a, b in zip(back, x))
    s = ckpt_offload.stats()
    assert s["tensors_read_back"] == 4 and s["disk_reads_ahead"] == 0  # each read when fetched
    assert disk.files() == []


def test_read_ahead_starts_reads_before_the_reload(disk):
    x, hs = _eight_under_a_cap_of_four(disk)
    assert not disk.eng.read_ahead(hs[0])  # the cap is full: no block to read into, ask again later
    back = {i: disk.eng.fetch(hs[i]) for i in range(7, 3, -1)}  # the host ones: their blocks go back
    assert all(disk.eng.read_ahead(h) for h in hs)  # a read started for each spilled one; no-op for the rest
    assert ckpt_offload.stats()["disk_reads_ahead"] == 4
    back.update({i: disk.eng.fetch(hs[i]) for i in range(3, -1, -1)})
    assert all(torch.equal(back[i], x[i]) for i in range(8))
    s = ckpt_offload.stats()
    assert s["tensors_read_back"] == 4 and s["disk_reads_over_cap"] == 0 and disk.files() == []


def test_files_go_when_the_graph_dies_without_backward(disk):
    ids = make_batch()
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root)
    loss = loss_of(model, ids)
    disk.eng.synchronize()
    assert len(disk.files()) == LAYERS - 1 == ckpt_offload.stats()["disk_files"]
    del loss
    disk.settle()
    assert disk.files() == [] and ckpt_offload.stats()["disk_files"] == 0
    assert disk.pool.stats()["in_use_bytes"] == 0


def test_empty_cache_removes_the_process_directory(disk):
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root)
    step(model, ids)
    disk.settle()
    first = disk.pool.spill_dir
    assert os.listdir(first) == []
    disk.pool.empty_cache()
    assert disk.pool.spill_dir is None and os.listdir(disk.root) == []
    assert_equal_grads(step(model, ids), expected)  # spills again, into a new directory
    assert ckpt_offload.stats()["tensors_spilled"] == 2 * (LAYERS - 1)
    assert disk.pool.spill_dir is not None and disk.files() == []


def test_hundred_steps_keep_disk_and_host_flat(disk):
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root)
    marks = []
    for i in range(100):
        got = step(model, ids)
        s = ckpt_offload.stats()
        marks.append((s["disk_files"], s["disk_bytes"], s["disk_peak_bytes"], s["host_reserved_bytes"],
                      s["host_in_use_bytes"]))
    assert_equal_grads(got, expected)
    assert len(set(marks)) == 1, marks[:3]  # the same figures after every step
    files, disk_bytes, peak, reserved, in_use = marks[0]
    assert files == 0 == disk_bytes == in_use and 0 < peak <= (LAYERS - 1) * act_bytes(ids) * 2
    assert reserved <= disk.pool.stats()["capacity_bytes"]
    s = ckpt_offload.stats()
    assert s["tensors_spilled"] == 100 * (LAYERS - 1) == s["tensors_read_back"]
    assert s["host_alloc_calls"] == 2  # the two blocks of the cap, allocated in the first step


def test_disk_budget_keeps_the_rest_on_device(disk):
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    act = act_bytes(ids)  # 4 KiB: the same with and without O_DIRECT alignment
    disk.pool.set_spill_dir(disk.root, max_bytes=2 * act, spill_ahead=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert_equal_grads(step(model, ids), expected)
    s = ckpt_offload.stats()
    assert s["tensors_spilled"] == 2 and s["tensors_kept_on_device"] == LAYERS - 4
    assert s["disk_peak_bytes"] == 2 * act


def test_switched_off_the_cap_keeps_tensors_on_device_again(disk):
    ids = make_batch()
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root)
    disk.pool.set_spill_dir(None)
    with pytest.warns(RuntimeWarning, match="refused a block"):
        step(model, ids)
    s = ckpt_offload.stats()
    assert s["tensors_spilled"] == 0 and s["tensors_kept_on_device"] == LAYERS - 2
    assert os.listdir(disk.root) == []


# -- faults ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["disk_full", "directory_vanished"])
def test_write_fault_keeps_tensors_on_device(disk, fault, capfd):
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root)
    if fault == "disk_full":
        disk.pool.inject_spill_fault("write", 1, errno.ENOSPC)
        reason = r"No space left on device \(errno 28\) \(injected\)"
    else:
        shutil.rmtree(disk.pool.spill_dir)
        reason = r"No such file or directory \(errno 2\)"
    with pytest.warns(RuntimeWarning, match="disk tier stopped after a write error"):
        got = step(model, ids)
    disk.settle()
    assert_equal_grads(got, expected)
    s = ckpt_offload.stats()
    assert s["disk_write_errors"] == 1 and s["tensors_spilled"] == 0
    assert s["tensors_kept_on_device"] == LAYERS - 2 and s["disk_files"] == 0
    assert s["host_in_use_bytes"] == 0
    # The engine's own warning names the file and the errno.
    err = capfd.readouterr().err
    assert re.search(r"writing a spilled tensor to '.*/1\.bin' failed: " + reason, err), err
    if fault == "disk_full":
        assert disk.files() == []  # the partial file went with the failed write
    else:
        assert os.listdir(disk.root) == []  # nothing made again in the place of the vanished directory


@pytest.mark.parametrize("fault", ["read_error", "truncated"])
def test_read_fault_fails_the_step_naming_the_file(disk, fault):
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root)
    loss = loss_of(model, ids)
    disk.eng.synchronize()
    if fault == "read_error":
        disk.pool.inject_spill_fault("read", 1, errno.EIO)
        reason = r"Input/output error \(errno 5\) \(injected\)"
    else:
        for name in disk.files():
            os.truncate(os.path.join(disk.pool.spill_dir, name), 100)
        reason = r"the file is shorter than the tensor"
    with pytest.raises(RuntimeError, match=r"reading a spilled tensor from '.*\.bin' failed: " + reason):
        loss.backward()
    assert ckpt_offload.stats()["disk_read_errors"] >= 1
    del loss
    model.zero_grad(set_to_none=True)
    disk.settle()
    assert disk.files() == [] and disk.pool.stats()["in_use_bytes"] == 0
    if fault == "read_error":  # the fault was one read: the next step is whole again
        assert_equal_grads(step(model, ids), expected)


# -- processes ------------------------------------------------------------------------------------
CHILD = textwrap.dedent("""
    import os, sys, torch, ckpt_offload
    pool = ckpt_offload.host_pool()
    eng = ckpt_offload.engine_for("cpu")
    x = [torch.randn(1 << 16) for _ in range(4)]
    pool.set_capacity(2 * pool.round_size(x[0].numel() * 4))
    pool.set_spill_dir(sys.argv[1])
    hs = [eng.offload(t) for t in x]
    eng.synchronize()
    print(pool.spill_dir, len(os.listdir(pool.spill_dir)), flush=True)
    # exits with its tensors still spilled
""")


def test_exit_removes_only_this_process_directory(disk):
    x = [torch.randn(1 << 16) for _ in range(4)]
    disk.pool.set_capacity(2 * ckpt_offload.HostPool.round_size(x[0].numel() * 4))
    disk.pool.set_spill_dir(disk.root)
    hs = [disk.eng.offload(t) for t in x]
    disk.eng.synchronize()
    ours = disk.files()
    assert len(ours) >= 2
    env = dict(os.environ, PYTHONPATH=ROOT, CKPT_OFFLOAD_TEST_CPU="1")
    p = subprocess.run([sys.executable, "-c", CHILD, str(disk.root)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    child_dir, child_files = p.stdout.split()
    assert int(child_files) >= 2 and child_dir != disk.pool.spill_dir
    assert not os.path.exists(child_dir)  # removed at the child's exit
    assert os.listdir(disk.root) == [os.path.basename(disk.pool.spill_dir)]  # ours untouched
    assert disk.files() == ours
    assert all(torch.equal(disk.eng.fetch(h), t) for h, t in zip(hs, x))


# -- the simulated runtime: the new orderings, each rule broken once -------------------------------
def sim_engine(monkeypatch, pool, copy_us, brk=None):
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC", "1")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_ASYNC_MAX_US", str(copy_us))
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_SEED", "3")
    if brk:
        monkeypatch.setenv("CKPT_OFFLOAD_TEST_BREAK", brk)
    try:
        eng = ckpt_offload.CopyEngine("cpu", pool)
    finally:
        monkeypatch.delenv("CKPT_OFFLOAD_TEST_BREAK", raising=False)
    assert eng.runtime == "async-sim"
    return eng


def sim_spill_dir(monkeypatch, pool, path, disk_us, brk=None):
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_DISK_MAX_US", str(disk_us))
    if brk:
        monkeypatch.setenv("CKPT_OFFLOAD_TEST_BREAK", brk)
    try:
        pool.set_spill_dir(path)
    finally:
        monkeypatch.delenv("CKPT_OFFLOAD_TEST_BREAK", raising=False)


def _two_through_one_block(eng, check=True):
    """A cap of one block: the first tensor is spilled to make room for the second, then both come back.
    check=False (a broken protocol): only run the calls; the hazard report is what the test expects."""
    x = [torch.arange(64 * 1024, dtype=torch.float32) + 1000 * i for i in range(2)]
    hs = [eng.offload(t) for t in x]
    if check:
        assert all(h is not None for h in hs)
    back = [eng.fetch(h) for h in hs if h is not None]
    if check:
        assert all(torch.equal(a, b) for a, b in zip(back, x))


# (break, where it is broken, copy delay us, disk delay us, hazard)
DISK_MUTATIONS = [
    ("spill_write", "tier", 0, 50_000, "pool block handed to a writer while its disk write is queued"),
    ("spill_d2h", "tier", 50_000, 0, "disk write started before the offload copy into its block completed"),
    ("spill_read", "engine", 0, 50_000, "reload queued before its disk read completed"),
]


@pytest.mark.parametrize("brk,where,copy_us,disk_us,hazard", DISK_MUTATIONS, ids=[m[0] for m in DISK_MUTATIONS])
def test_each_disk_rule_is_load_bearing(monkeypatch, tmp_path, brk, where, copy_us, disk_us, hazard):
    def setup(broken):
        pool = ckpt_offload.HostPool(pinned=False)
        pool.set_capacity(ckpt_offload.HostPool.round_size(256 * 1024))
        eng = sim_engine(monkeypatch, pool, copy_us, brk=broken if where == "engine" else None)
        sim_spill_dir(monkeypatch, pool, tmp_path, disk_us, brk=broken if where == "tier" else None)
        return pool, eng

    pool, eng = setup(None)
    _two_through_one_block(eng)  # the intact protocol: no hazard, every byte back
    eng.synchronize()
    assert pool.spill_stats()["tensors_spilled"] >= 1 and pool.stats()["in_use_bytes"] == 0

    pool, eng = setup(brk)
    message = r"ckpt_offload hazard \(async-sim\): " + re.escape(hazard) + r": handle #\d+;"
    with pytest.raises(RuntimeError, match=message):
        _two_through_one_block(eng, check=False)
        eng.synchronize()
        eng.offload(torch.zeros(4))  # a hazard found on a disk worker surfaces at the next call
    # Drain the broken run: its disk workers may report again, at any engine's next call; the next
    # test must not see this run's reports.
    for _ in range(5):
        try:
            eng.synchronize()
            pool.set_spill_dir(None)
            eng.offload(torch.zeros(4))
            eng.synchronize()
            break
        except RuntimeError:
            continue


# -- the benchmark ----------------------------------------------------------------------------------
def test_bench_bandwidth_disk_measures_both_modes_and_the_tier(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CKPT_OFFLOAD_TEST_CPU", None)
    env.pop("CKPT_OFFLOAD_TEST_ASYNC", None)
    p = subprocess.run([sys.executable, "benchmarks/bench_bandwidth.py", "--disk", str(tmp_path), "--disk-mib", "8",
                        "--disk-block-mib", "1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.load(open(out / "bench_disk.json"))
    assert result["filesystem"]["fstype"] != "unknown" and result["problems"] == []
    raw = [r for r in result["rows"] if r["path"] == "pwrite/pread"]
    assert [r["o_direct"] for r in raw] == [True, False]
    assert raw[1]["read_cold_gb_per_s"] > 0 and raw[1]["write_gb_per_s"] > 0
    assert raw[0].get("error") or raw[0]["write_gb_per_s"] > 0  # tmpfs refuses O_DIRECT, and says so
    tier = result["rows"][-1]
    assert tier["path"] == "disk tier" and tier["round_trip_ok"] and tier["tensors_spilled"] == 8 - 2 + 1
    assert sorted(os.listdir(tmp_path)) == ["out"]  # every file it wrote is gone
    assert "disk: " + os.path.realpath(tmp_path) in p.stdout
