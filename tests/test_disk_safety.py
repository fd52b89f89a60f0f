"""The disk tier and the folder it is given: nothing followed by path after set_spill_dir (a swapped-in
symlink, a chdir), nothing of a parent's deleted by a forked child, folders others may rename in
refused, no stale pool bytes in a file, the real errno of a short write. PITFALLS rows 27-29, through
the public API on the CPU test path (CKPT_OFFLOAD_TEST_CPU=1)."""
import gc
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ckpt_offload
from test_disk import LAYERS, ROOT, _one_thread, act_bytes, assert_equal_grads, cap_blocks, disk, expected_grads, offloading_model, step  # noqa: F401
from tiny_gpt import grads, loss_of, make_batch


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def bins(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".bin"))


# -- who may rename in the folder -----------------------------------------------------------------
def test_a_folder_others_can_write_without_the_sticky_bit_is_refused(tmp_path):
    """PITFALLS 27: a spill folder others may rename in is refused. Fails where such a folder is accepted."""
    pool = ckpt_offload.HostPool(pinned=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"path '.*/shared' can be written by others \(mode 0777\) and has no sticky bit"):
        pool.set_spill_dir(shared)
    shared.chmod(0o770)  # a group that may write counts too
    with pytest.raises(ValueError, match=r"mode 0770\) and has no sticky bit"):
        pool.set_spill_dir(shared)
    assert pool.spill_dir is None and os.listdir(shared) == []
    shared.chmod(0o1777)  # as /tmp: others cannot rename what is not theirs
    pool.set_spill_dir(shared)
    assert os.path.dirname(pool.spill_dir) == str(shared)
    assert stat.S_IMODE(os.stat(pool.spill_dir).st_mode) == 0o700
    pool.set_spill_dir(None)
    assert os.listdir(shared) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder that belongs to another user needs root")
def test_a_folder_of_another_user_is_refused(tmp_path):
    pool = ckpt_offload.HostPool(pinned=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ValueError, match=r"path '.*/theirs' belongs to another user \(uid 12345\)"):
        pool.set_spill_dir(theirs)
    assert os.listdir(theirs) == []


# -- nothing followed by path ---------------------------------------------------------------------
def test_a_per_process_folder_swapped_for_a_symlink_is_not_followed(disk, tmp_path):
    """PITFALLS 27: the per-process spill folder swapped for a symlink: the tier neither writes into nor
    empties the link's target. Fails where the folder is used by path."""
    victim = tmp_path / "victim"
    victim.mkdir()
    for i in range(4):
        (victim / f"{i + 1}.bin").write_bytes(b"precious %d" % i)
    root = tmp_path / "root"
    root.mkdir()
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(root)
    proc = disk.pool.spill_dir
    # Someone who may rename in `root` moves the tier's folder away and leaves a link to `victim`.
    os.rename(proc, proc + ".moved")
    os.symlink(victim, proc)
    assert_equal_grads(step(model, ids), expected)
    disk.settle()
    s = ckpt_offload.stats()
    assert s["tensors_spilled"] == LAYERS - 1 == s["tensors_read_back"]  # the files went to the real folder
    disk.pool.set_spill_dir(None)
    assert sorted(os.listdir(victim)) == ["1.bin", "2.bin", "3.bin", "4.bin"]
    assert all((victim / f"{i + 1}.bin").read_bytes() == b"precious %d" % i for i in range(4))
    assert os.path.islink(proc)  # not the tier's: left as it is
    assert os.listdir(proc + ".moved") == []  # its own files went, through its descriptor


def test_a_relative_spill_dir_keeps_working_after_chdir(disk, tmp_path, monkeypatch):
    """PITFALLS 28: a relative spill folder keeps working after the process changes directory mid-step. Fails
    where the path is kept relative."""
    (tmp_path / "spill").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir("spill")
    assert disk.pool.spill_dir.startswith(str(tmp_path / "spill") + "/")  # resolved at the call
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    disk.eng.synchronize()
    assert len(bins(disk.pool.spill_dir)) == LAYERS - 1
    os.chdir(elsewhere)  # the script moves on; the spilled tensors are read back all the same
    loss.backward()
    assert_equal_grads(grads(model), expected)
    del loss
    disk.settle()
    disk.pool.set_spill_dir(None)
    assert os.listdir(tmp_path / "spill") == [] and os.listdir(elsewhere) == []


EXIT_AFTER_CHDIR = textwrap.dedent("""
    import os, sys, torch, ckpt_offload
    os.chdir(sys.argv[1])
    pool = ckpt_offload.host_pool()
    eng = ckpt_offload.engine_for("cpu")
    x = [torch.randn(1 << 16) for _ in range(4)]
    pool.set_capacity(2 * pool.round_size(x[0].numel() * 4))
    pool.set_spill_dir("spill")
    hs = [eng.offload(t) for t in x]
    eng.synchronize()
    print(len(os.listdir(pool.spill_dir)), flush=True)
    os.chdir("/")
    # exits with its tensors still spilled, from another directory
""")


def test_a_process_that_exits_after_chdir_leaves_no_file(tmp_path):
    """PITFALLS 28: a process that changed directory leaves no spill file at exit. Fails where the cleanup
    resolves a relative path against the new directory."""
    (tmp_path / "spill").mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, CKPT_OFFLOAD_TEST_CPU="1")
    p = subprocess.run([sys.executable, "-c", EXIT_AFTER_CHDIR, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout) >= 2  # it had spilled
    assert os.listdir(tmp_path / "spill") == []


# -- fork -----------------------------------------------------------------------------------------
def _wait_child(pid, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not finish within {timeout} s (waiting on the parent's disk workers?)")


@pytest.mark.skipif(ckpt_offload.build_info()["test_path"] == "async-sim",
                    reason="the simulated runtime's streams are threads, which a forked child does not inherit "
                           "(as CUDA is unusable in one): the child's reloads would wait on them forever")
def test_a_forked_child_neither_deletes_its_parents_files_nor_hangs(disk):
    """PITFALLS 29: a forked child exits without deleting its parent's files or waiting on threads it did not
    inherit. Fails where the child runs the parent's cleanup."""
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root, spill_ahead=0)
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    disk.eng.synchronize()  # every write done: the child inherits files, not queued work
    ours = bins(disk.pool.spill_dir)
    assert len(ours) == LAYERS - 2
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker that touches what it inherited, then drops it
        code = 1
        try:
            loss.backward()  # reads the parent's files on its own thread: no worker of its own
            code = 0 if all(torch.equal(grads(model)[k], expected[k]) for k in expected) else 3
            model.zero_grad(set_to_none=True)
            gc.collect()
            ckpt_offload.host_pool().set_spill_dir(None)
        except BaseException as e:  # noqa: BLE001  (reported through the exit code)
            os.write(2, f"child: {e!r}\n".encode())
            code = 2
        os._exit(code)
    assert _wait_child(pid) == 0
    assert bins(disk.pool.spill_dir) == ours  # the parent's files are still there
    loss.backward()
    assert_equal_grads(grads(model), expected)
    del loss
    disk.settle()
    assert bins(disk.pool.spill_dir) == []


@pytest.mark.skipif(ckpt_offload.build_info()["test_path"] == "async-sim",
                    reason="the simulated runtime's streams are threads, which a forked child does not inherit")
def test_fork_waits_until_no_disk_worker_is_between_jobs(disk):
    # A worker that has just finished a job still returns its block to the pool (the pool's lock) and
    # lets go of the job (the job's lock, maybe the exit list's) before it takes the tier's lock again.
    # Forked in that moment, the child finds those locks held by a thread it does not have, forever:
    # the child of the test above hung so on a loaded machine. Here every worker lingers after each
    # job, as one the scheduler set aside there would, so the moment is open when fork() is called.
    ids = make_batch()
    expected = expected_grads(ids)
    model = offloading_model()
    cap_blocks(disk.pool, ids, 2)
    disk.pool.set_spill_dir(disk.root, spill_ahead=0)
    disk.pool.set_spill_worker_linger(1.0)
    try:
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, ids)
        disk.eng.synchronize()  # the writes are done; their workers linger
        assert disk.pool.spill_stats()["workers_busy"] >= 1  # the moment is open
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # The child's copy of the tier: no worker was between jobs when it was made.
                code = 4 if ckpt_offload.host_pool().spill_stats()["workers_busy"] != 0 else 1
                loss.backward()
                if code == 1:
                    code = 0 if all(torch.equal(grads(model)[k], expected[k]) for k in expected) else 3
            except BaseException as e:  # noqa: BLE001  (reported through the exit code)
                os.write(2, f"child: {e!r}\n".encode())
                code = 2
            os._exit(code)
        assert _wait_child(pid) == 0  # 4: forked with a worker between jobs
        # The parent's workers take jobs again after the fork.
        disk.pool.set_spill_worker_linger(0)
        loss.backward()
        assert_equal_grads(grads(model), expected)
        del loss
        disk.settle()
        assert disk.pool.spill_stats()["workers_busy"] == 0
        assert bins(disk.pool.spill_dir) == []
    finally:
        if disk.pool.spill_stats()["io_mode"] is not None:  # the tier is still there
            disk.pool.set_spill_worker_linger(0)


@pytest.mark.skipif(ckpt_offload.build_info()["test_path"] == "async-sim",
                    reason="the simulated runtime's streams are threads, which a forked child does not inherit")
@pytest.mark.parametrize("tensors", [2, 3])
def test_a_forked_child_lets_go_of_the_tier_it_inherited_idle(disk, tensors):
    # Each spill write wakes one of the two workers (a notify_one). After an odd number of them glibc's
    # condition variable holds the worker that was not woken in its older wait group and the one that
    # was, back to waiting, in the newer. The child's copy records both, and its first broadcast (the
    # tier letting go of its workers in stop()) waited for them to leave, forever: the child of the
    # test above hung so in the full suite. Both parities here.
    xs = [torch.randn(1 << 16) for _ in range(tensors)]
    disk.pool.set_capacity(disk.pool.round_size(xs[0].numel() * 4))  # one tensor's block
    disk.pool.set_spill_dir(disk.root, spill_ahead=0)
    time.sleep(0.2)  # both workers are waiting for a job
    hs = []
    for x in xs:
        hs.append(disk.eng.offload(x))
        disk.eng.synchronize()
        time.sleep(0.1)  # the worker that wrote is back to waiting
    spilled = ckpt_offload.stats()["tensors_spilled"]
    assert spilled >= tensors - 1
    ours = bins(disk.pool.spill_dir)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ckpt_offload.host_pool().set_spill_dir(None)  # stop(): the broadcast that hung
            code = 0
        except BaseException as e:  # noqa: BLE001  (reported through the exit code)
            os.write(2, f"child: {e!r}\n".encode())
            code = 2
        os._exit(code)
    assert _wait_child(pid, timeout=60) == 0
    assert bins(disk.pool.spill_dir) == ours  # the parent's files are still there
    assert all(torch.equal(disk.eng.fetch(h), x) for h, x in zip(hs, xs))  # and read back whole
    assert ckpt_offload.stats()["tensors_read_back"] == spilled


# -- what goes into a file ------------------------------------------------------------------------
def test_the_padding_of_a_direct_write_holds_no_stale_pool_bytes(disk):
    disk.pool.set_spill_dir(disk.root, spill_ahead=0)
    if disk.pool.spill_stats()["io_mode"] != "direct":
        pytest.skip(f"{disk.root} does not take O_DIRECT: no padding is written")
    stale = torch.full((1024,), 0x2A2A2A2A, dtype=torch.int32).view(torch.float32)  # bytes 0x2a, all of it
    n = 1000  # 4000 bytes: the file is padded to 4096
    size = ckpt_offload.HostPool.round_size(n * 4)
    assert size == ckpt_offload.HostPool.round_size(stale.numel() * 4)  # the same blocks get reused
    for h in [disk.eng.offload(stale.clone()) for _ in range(2)]:
        disk.eng.fetch(h)  # two blocks back in the pool, full of the old tensor
    disk.pool.set_capacity(2 * size)
    x = [torch.randn(n) for _ in range(3)]
    hs = [disk.eng.offload(t) for t in x]
    disk.eng.synchronize()
    assert hs[0].state == "on_disk"
    data = open(os.path.join(disk.pool.spill_dir, bins(disk.pool.spill_dir)[0]), "rb").read()
    assert len(data) == 4096
    assert data[: n * 4] == x[0].numpy().tobytes()
    assert data[n * 4:] == bytes(4096 - n * 4)  # zeros, not the stale tensor's bytes
    assert all(torch.equal(disk.eng.fetch(h), t) for h, t in zip(hs, x))


SHORT_WRITE = textwrap.dedent("""
    import os, resource, signal, sys, warnings, torch, ckpt_offload
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit returns EFBIG instead
    pool = ckpt_offload.host_pool()
    eng = ckpt_offload.engine_for("cpu")
    pool.set_spill_dir(sys.argv[1], spill_ahead=0)
    print(pool.spill_stats()["io_mode"], flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))  # a file stops growing at 6000 bytes
    x = [torch.randn(4096) for _ in range(3)]  # 16 KiB each: the first write comes back short
    pool.set_capacity(2 * pool.round_size(x[0].numel() * 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hs = [eng.offload(t) for t in x]
        eng.synchronize()
    s = ckpt_offload.stats()
    print(s["disk_write_errors"], s["tensors_spilled"], flush=True)
    assert all(torch.equal(eng.fetch(h), t) for h, t in zip(hs, x) if h is not None)
""")


def test_a_short_direct_write_reports_the_real_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, CKPT_OFFLOAD_TEST_CPU="1")
    p = subprocess.run([sys.executable, "-c", SHORT_WRITE, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    mode, counts = p.stdout.split("\n", 1)
    if mode != "direct":
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    assert counts.split() == ["1", "0"]
    # The limit's own error, not the EINVAL an unaligned O_DIRECT offset would give after the short write.
    assert "File too large (errno 27)" in p.stderr, p.stderr
    assert "Invalid argument" not in p.stderr
    assert os.listdir(tmp_path) == []


# -- the core's Python calls ----------------------------------------------------------------------
class Raising:
    def __bool__(self):
        raise RuntimeError("no truth here")


def test_a_flag_whose_truth_test_raises_is_an_error_not_a_systemerror(test_cpu, monkeypatch):
    model = offloading_model()
    ids = make_batch()
    monkeypatch.setattr(sys.modules["ckpt_offload.timeline"], "enabled", Raising())  # the module (the function shadows it)
    with pytest.raises(RuntimeError, match="no truth here"):
        loss_of(model, ids).backward()
    monkeypatch.undo()
    gc.collect()
    ckpt_offload.synchronize()
    loss_of(model, ids).backward()  # nothing left set: the next step runs
