"""What a new user meets first: arguments checked where they are given (bools as bools, reentrant
refused by name, layer indices), inputs that are not offloaded said out loud, autograd's own
in-place error word for word, a docs page that documents every statistic, and benchmark output and
setup that a reader can use (help text, a table that fits, pip only when the requirements in pyproject.toml change)."""
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc

import ckpt_offload
import ckpt_offload.checkpointing as ck
from conftest import DEVICES
from tiny_gpt import grads, loss_of, make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu")

B, S, H = 2, 16, 32
INPUT_BYTES = B * S * H * 4  # one block input of the tiny model, float32
STATS_PAGE = os.path.join(os.path.dirname(__file__), "..", "docs", "troubleshooting.md")


# -- bools are bools -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ckpt_offload.checkpoint(torch.sin, torch.ones(1), offload="yes"), "ckpt_offload.checkpoint: offload"),
        (lambda: ckpt_offload.enable_checkpointing(make_model(), offload="no"), "enable_checkpointing: offload"),
        (lambda: ckpt_offload.enable_checkpointing(make_model(), offload=1), "enable_checkpointing: offload"),
        (lambda: ckpt_offload.OffloadSession(track_modules="yes"), "OffloadSession: track_modules"),
        (lambda: ckpt_offload.profile("no"), "profile: on"),
    ],
)
def test_bools_are_checked_as_bools(call, match):
    with pytest.raises(TypeError, match=match + " must be True or False"):
        call()
    assert ckpt_offload.stats()["profiling"] is False  # profile("no") did not switch profiling on


# -- use_reentrant ---------------------------------------------------------------------------------
def test_enable_checkpointing_refuses_reentrant_like_checkpoint():
    model = make_model()
    with pytest.raises(ValueError) as ours:
        ckpt_offload.enable_checkpointing(model, use_reentrant=True)
    with pytest.raises(ValueError) as theirs:
        ckpt_offload.checkpoint(torch.sin, torch.ones(1), use_reentrant=True)
    assert str(ours.value).startswith("enable_checkpointing: use_reentrant=True is not supported")
    assert str(ours.value).split(": ", 1)[1] == str(theirs.value).split(": ", 1)[1]
    with pytest.raises(TypeError, match="enable_checkpointing: use_reentrant must be True, False or None"):
        ckpt_offload.enable_checkpointing(model, use_reentrant="no")
    assert ckpt_offload.checkpointing_state(model) is None  # nothing was configured
    assert ckpt_offload.enable_checkpointing(model, every_n_layers=3, use_reentrant=False) == [0, 3]


# -- layers=[indices] ------------------------------------------------------------------------------
def test_layers_as_indices_match_layers_as_modules():
    ids = make_batch()
    by_module = make_model()
    assert ckpt_offload.enable_checkpointing(by_module, layers=[by_module.blocks[1], by_module.blocks[4]],
                                             offload=True, keep_last=0) == [0, 1]
    loss_of(by_module, ids).backward()
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * INPUT_BYTES
    ckpt_offload.reset_stats()

    by_index = make_model()
    # Indices count into find_repeated_blocks(model), and so does what comes back.
    assert ckpt_offload.enable_checkpointing(by_index, layers=[4, 1], offload=True, keep_last=0) == [1, 4]
    assert ckpt_offload.checkpointing_state(by_index) == ([1, 4], [1, 4])
    loss_of(by_index, ids).backward()
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * INPUT_BYTES
    a, b = grads(by_module), grads(by_index)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [(ckpt_offload.attachment.SLOT in m.__dict__) for m in by_index.blocks] == [False, True, False, False, True, False]


def test_enable_checkpointing_returns_what_layers_accepts():
    model = make_model()
    returned = ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True)
    assert returned == [0, 2, 4]
    assert ckpt_offload.enable_checkpointing(model, layers=returned, offload=True, keep_last=1) == returned
    assert ckpt_offload.checkpointing_state(model) == ([0, 2, 4], [0, 2])
    assert [(ckpt_offload.attachment.SLOT in m.__dict__) for m in model.blocks] == [True, False, True, False, True, False]
    # every_n_layers counts within the list given.
    assert ckpt_offload.enable_checkpointing(model, layers=[0, 1, 2, 3], every_n_layers=2) == [0, 2]


@pytest.mark.parametrize(
    "layers,error,match",
    [
        (lambda m: [0, 6], ValueError, r"layers index 6 is out of range: the model has 6 repeated blocks .* 0\.\.5"),
        (lambda m: [-1], ValueError, r"layers index -1 is out of range"),
        (lambda m: [1, 1], ValueError, r"layers names an index more than once: \[1, 1\]"),
        (lambda m: "blocks", TypeError, r"layers\[0\] is a str: layers must be all nn.Module blocks or all int indices"),
        (lambda m: [m.blocks[0], 3], TypeError, r"layers\[1\] is a int: .*not a mix"),
        (lambda m: [3, m.blocks[0]], TypeError, r"layers\[0\] is a int: .*not a mix"),
        (lambda m: [True], TypeError, r"layers\[0\] is a bool"),
        (lambda m: [], ValueError, r"layers is empty"),
    ],
)
def test_layers_errors(layers, error, match):
    model = make_model()
    with pytest.raises(error, match="enable_checkpointing: " + match):
        ckpt_offload.enable_checkpointing(model, layers=layers(model))
    assert ckpt_offload.checkpointing_state(model) is None


def test_layers_as_indices_need_repeated_blocks():
    with pytest.raises(ValueError, match=r"find_repeated_blocks\(model\), which found no repeated blocks"):
        ckpt_offload.enable_checkpointing(torch.nn.Linear(2, 2), layers=[0])
    model = make_model()
    block = model.blocks[2]
    with pytest.raises(ValueError, match="layers names a block more than once"):
        ckpt_offload.enable_checkpointing(model, layers=[block, block])


# -- inputs that are not offloaded ------------------------------------------------------------------
@pytest.mark.parametrize("container", ["list", "tuple", "dict"])
def test_tensors_inside_a_positional_container_warn_once(monkeypatch, container):
    monkeypatch.setattr(ck, "_container_warned", False)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    wrap = {"list": lambda t: [t], "tuple": lambda t: (t,), "dict": lambda t: {"w": t}}[container]
    unwrap = {"list": lambda c: c[0], "tuple": lambda c: c[0], "dict": lambda c: c["w"]}[container]

    def fn(a, c):
        return (a @ unwrap(c)).sin()

    session = ckpt_offload.OffloadSession()
    with pytest.warns(UserWarning, match=f"positional argument 1 is a {container} holding a tensor that requires grad; it is not offloaded"):
        y = ckpt_offload.checkpoint(fn, x, wrap(w), session=session)
    y.sum().backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 1 and s["bytes_offloaded"] == 64 * 64 * 4  # x only, not w
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    tuc.checkpoint(fn, ref_x, wrap(ref_w), use_reentrant=False).sum().backward()
    assert torch.equal(x.grad, ref_x.grad) and torch.equal(w.grad, ref_w.grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        ckpt_offload.checkpoint(fn, x, wrap(w), session=session).sum().backward()


def test_containers_without_grad_tensors_and_kept_layers_do_not_warn(monkeypatch):
    monkeypatch.setattr(ck, "_container_warned", False)
    x = torch.randn(8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt_offload.checkpoint(lambda a, c: a * c[0], x, [torch.ones(8)], session=ckpt_offload.OffloadSession())
        ckpt_offload.checkpoint(lambda a, size: a.view(size), x, torch.Size([2, 4]))
        ckpt_offload.checkpoint(lambda a, c: a * c[0], x, [x], offload=False)
    assert ck._container_warned is False


def test_an_offloaded_input_comes_back_equal_not_identical():
    seen = []

    def fn(a):
        seen.append(a)
        return a.sin()

    x = torch.randn(16, 16, requires_grad=True)
    h = x * 2
    ckpt_offload.checkpoint(fn, h, session=ckpt_offload.OffloadSession()).sum().backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 1
    forward_input, recompute_input = seen
    assert forward_input is h and recompute_input is not h  # the copy that came back from the host
    assert torch.equal(recompute_input, h) and recompute_input.data_ptr() != h.data_ptr()


# -- autograd's in-place error, word for word ------------------------------------------------------
def _error_of(run):
    with pytest.raises(RuntimeError) as err:
        run()
    return str(err.value)


@pytest.mark.parametrize("case", ["offloaded", "kept", "view", "without_grad", "anomaly"])
@pytest.mark.parametrize("device", DEVICES)
def test_inplace_error_is_torchs_own(case, device):
    x = torch.randn(8, 8, requires_grad=True, device=device)
    source = torch.randn(4, 8, 8, device=device)

    def mistake(checkpoint):
        def run():
            a = x * 2 if case != "without_grad" else source[1] + 0
            arg = a[2:6] if case == "view" else a
            y = checkpoint(lambda t: t.sin() * (x if case == "without_grad" else 1), arg)
            a.add_(1)
            y.sum().backward()

        if case == "anomaly":
            with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True):
                warnings.simplefilter("ignore")  # anomaly mode prints the forward trace as a warning
                return _error_of(run)
        return _error_of(run)

    torchs = mistake(lambda fn, t: tuc.checkpoint(fn, t, use_reentrant=False))
    keep = 1 if case == "kept" else 0
    ours = mistake(lambda fn, t: ckpt_offload.checkpoint(fn, t, session=ckpt_offload.OffloadSession(keep_last=keep)))
    assert ckpt_offload.stats()["tensors_offloaded"] == (0 if case == "kept" else 1)
    assert ours == torchs
    assert "offloaded tensor" not in ours
    assert ("[torch.cuda.FloatTensor [" if device == "cuda" else "[torch.FloatTensor [") in ours
    assert ("Good luck!" if case == "anomaly" else "set_detect_anomaly(True") in ours


def test_inplace_error_of_an_offloaded_tensor_that_is_gone_keeps_type_and_shape():
    x = torch.randn(8, 8, requires_grad=True)
    a = x.double() * 2
    y = ckpt_offload.checkpoint(torch.sin, a, session=ckpt_offload.OffloadSession())
    a.add_(1)
    del a  # the tensor is gone; its version counter and its copy remain
    message = _error_of(lambda: y.sum().backward())
    assert message == (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        "[torch.DoubleTensor [8, 8]] is at version 1; expected version 0 instead. Hint: enable anomaly "
        "detection to find the operation that failed to compute its gradient, with "
        "torch.autograd.set_detect_anomaly(True, check_nan=False)."
    )


# -- the docs document every statistic ------------------------------------------------------------
def _documented_stats_keys():
    with open(STATS_PAGE) as f:
        text = f.read()
    start = text.index("## Every key of `stats()`")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break  # the end of the table
    keys = set()
    for row in rows[2:]:  # after the header and its rule
        first = row.split("|")[1]
        keys.update(re.findall(r"`([a-z0-9_]+)`", first))
    return keys


def test_docs_stats_table_names_every_key_of_stats():
    documented = _documented_stats_keys()
    actual = set(ckpt_offload.stats())
    assert actual - documented == set(), "stats() keys missing from the table in docs/troubleshooting.md"
    assert documented - actual == set(), "keys in the table of docs/troubleshooting.md that stats() does not return"


# -- benchmark output and setup ---------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_step():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_step
    finally:
        sys.path.pop(0)
    return bench_step


def test_bench_step_help_describes_every_option_and_lists_the_modes():
    bench_step = _bench_step()
    parser = bench_step.build_parser()
    missing = [a.option_strings for a in parser._actions if not (a.help or "").strip()]
    assert missing == []
    modes_help = next(a.help for a in parser._actions if "--modes" in a.option_strings)
    assert all(m in modes_help for m in bench_step.MODES)
    text = parser.format_help()
    assert all(f"  {m} " in text for m in bench_step.MODES)  # the epilog: one line per mode


def _row(mode, seq, **kw):
    r = dict(mode=mode, seq=seq, step_ms_median=1234.56, step_ms_min=1200.01, step_ms_max=1300.99,
             time_vs_full=1.0123, peak_device_bytes=70 * 2**30, live_peak_bytes=70 * 2**30, peak_vs_full=0.9876,
             act_device_bytes=12 * 2**30, act_host_bytes=14 * 2**30, bytes_offloaded_per_step=14 * 2**30,
             bytes_prefetched_per_step=14 * 2**30, host_reserved_bytes=15 * 2**30, host_peak_bytes=14 * 2**30,
             host_alloc_calls_timed=0, reload_wait_ms_profiled=12.34, d2h_gb_per_s=50.1, h2d_gb_per_s=51.2)
    r.update(kw)
    return r


@pytest.mark.parametrize("cuda", [False, True])
def test_bench_step_default_table_keeps_to_120_characters(capsys, cuda):
    bench_step = _bench_step()
    rows = [_row(m, 16384) for m in bench_step.MODES]
    bench_step.print_results(rows, [], cuda, "full", "decoder stack, 32 layers, hidden 4096, bfloat16")
    narrow = capsys.readouterr().out
    assert max(len(line) for line in narrow.splitlines()) <= 120, narrow
    assert "offload_activations  16384" in narrow and "0.988x" in narrow  # peak/full is shown
    header = next(line for line in narrow.splitlines() if line.strip().startswith("mode"))
    assert "host rsv/peak" not in header and "ms min-max" not in header and "--wide adds" in narrow
    assert ("wait ms*" in header) == cuda  # the reload wait is measured on a GPU only
    bench_step.print_results(rows, [], cuda, "full", "decoder stack", wide=True)
    wide = capsys.readouterr().out
    header = next(line for line in wide.splitlines() if line.strip().startswith("mode"))
    assert "host rsv/peak" in header and "1200.01-1300.99" in wide and "50.1/51.2" in wide


def test_bench_step_rows_start_from_an_empty_pool_and_cpu_rows_have_a_peak_ratio(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("CKPT_OFFLOAD_TEST_CPU", None)
    cmd = [sys.executable, "benchmarks/bench_step.py", "--config", "small", "--layers", "2", "--seqs", "16,32",
           "--modes", "async_offload,none,full", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.load(open(tmp_path / "bench_step.json"))["rows"]
    by = {(r["mode"], r["seq"]): r for r in rows}
    for seq in (16, 32):
        # async_offload ran first and reserved host memory; the modes after it reserved none.
        assert by["async_offload", seq]["host_reserved_bytes"] > 0
        assert by["none", seq]["host_reserved_bytes"] == by["full", seq]["host_reserved_bytes"] == 0
        assert by["full", seq]["peak_vs_full"] == 1.0
        assert by["async_offload", seq]["peak_vs_full"] < 1.0 < by["none", seq]["peak_vs_full"]
    lines = p.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("mode"))
    table = lines[start:start + 2 + len(rows)]
    assert table[-1].strip().startswith("full") and "n/a" not in "\n".join(table)
    assert max(len(line) for line in table) <= 120, table


def test_setup_runs_pip_only_when_requirements_changed(tmp_path):
    """PITFALLS 40: scripts/setup.sh against a stand-in venv whose python logs pip calls (and runs the real
    interpreter for everything else): the first run installs the list scripts/dev_requirements.py
    derives from pyproject.toml, the second skips pip; a changed stamp brings it back."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    (venv / "bin" / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> {log}; exit 0; fi\n'
        f'PYTHONPATH={ROOT} exec {sys.executable} "$@"\n'
    )
    (venv / "bin" / "python").chmod(0o755)
    env = dict(os.environ, VENV=str(venv))
    reqs = venv / ".ckpt_offload_dev_requirements.txt"
    # CI's versions: every install is constrained by constraints.txt (a copy here, to change it).
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(open(os.path.join(ROOT, "constraints.txt")).read())
    env["CONSTRAINTS"] = str(constraints)
    install = f"-m pip install -q -r {reqs} -c {constraints}"

    def run():
        p = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return p.stdout, [c for c in calls if " -r " in c]

    out, calls = run()
    assert calls == [install] and "installing requirements" in out
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import dev_requirements
    finally:
        sys.path.pop(0)
    listed = reqs.read_text().splitlines()
    assert [r for r in listed if not r.startswith("#")] == dev_requirements.dev_requirements(dev_requirements.load())
    assert [r[len("# pinned: "):] for r in listed if r.startswith("#")] == constraints.read_text().splitlines()
    out, calls = run()
    assert calls == [] and "pip skipped" in out
    (venv / ".ckpt_offload_requirements.sha256").write_text("an older list\n")
    out, calls = run()
    assert calls == [install]
    # A moved pin installs again, though pyproject.toml did not change.
    out, calls = run()
    assert calls == []
    constraints.write_text(constraints.read_text().replace("\ntorch==", "\n# torch, unpinned: "))
    out, calls = run()
    assert calls == [install] and "at the versions in" in out


# -- one rule for offload's default ----------------------------------------------------------------
def test_offload_defaults_to_true_at_every_entry_point():
    """offload=True unless asked otherwise, wherever ckpt_offload takes the switch: a model enabled
    without it offloads its checkpointed blocks but the last (keep_last=1), bytes moved."""
    import inspect

    from ckpt_offload.integrations import hf

    for f in (ckpt_offload.checkpoint, ckpt_offload.enable_checkpointing, hf.enable, hf.install_checkpointing_args):
        assert inspect.signature(f).parameters["offload"].default is True, f.__qualname__
        assert "offload" in (f.__doc__ or "") and "True by default" in f.__doc__, f.__qualname__
    model = make_model(layers=4)
    assert ckpt_offload.enable_checkpointing(model) == [0, 1, 2, 3]
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2, 3], [0, 1, 2])
    loss_of(model, make_batch()).backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 and s["bytes_offloaded"] == 3 * INPUT_BYTES


# -- host_pool().set_capacity takes sizes as the estimate command does -----------------------------
def test_set_capacity_takes_sizes_with_units_and_refuses_the_rest():
    pool = ckpt_offload.host_pool()
    try:
        pool.set_capacity("4GiB")
        assert ckpt_offload.stats()["host_capacity_bytes"] == 4 * 2**30
        pool.set_capacity("1.5 MB")
        assert ckpt_offload.stats()["host_capacity_bytes"] == 1_500_000
        pool.set_capacity(4096)
        assert ckpt_offload.stats()["host_capacity_bytes"] == 4096
        for bad in (True, False, 1.5, None, b"4GiB"):
            with pytest.raises(TypeError, match=r"set_capacity: nbytes must be a number of bytes .*'4GiB'"):
                pool.set_capacity(bad)
        for bad in ("four", "4 parsecs", "-1GiB", "0GiB", ""):
            with pytest.raises(ValueError, match=r"set_capacity: bad size"):
                pool.set_capacity(bad)
        with pytest.raises(ValueError, match="set_capacity: nbytes must be an int >= 0, got -1"):
            pool.set_capacity(-1)
        assert ckpt_offload.stats()["host_capacity_bytes"] == 4096  # the refused calls changed nothing
    finally:
        pool.set_capacity(0)
    assert ckpt_offload.stats()["host_capacity_bytes"] == 0


def test_estimate_command_reads_sizes_with_the_same_parser():
    import argparse

    from ckpt_offload import _args
    from ckpt_offload.sizing import cli

    assert cli.parse_size("80GiB") == _args.parse_size("80GiB") == 80 * 2**30
    with pytest.raises(argparse.ArgumentTypeError, match="bad size 'x'"):
        cli.parse_size("x")


# -- the refusal warning says what is true --------------------------------------------------------
def test_refusal_warning_says_the_node_guard_is_off_instead_of_minus_one(monkeypatch):
    pool = ckpt_offload.host_pool()
    monkeypatch.setattr(ckpt_offload.session, "_refusal_warned", False)
    model = make_model(layers=3)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    pool.empty_cache()
    pool.set_node_guard("", [], 0)  # the guard off: node_available() is -1
    assert pool.node_available() == -1
    try:
        pool.set_capacity(1)  # nothing fits
        with pytest.warns(RuntimeWarning, match="refused a block") as caught:
            loss_of(model, make_batch()).backward()
    finally:
        pool.set_capacity(0)
        ckpt_offload.engine.guard_node(pool)
    text = " ".join(str(w.message) for w in caught if "refused a block" in str(w.message))
    assert "-1 bytes" not in text
    assert "node guard off" in text
    assert ckpt_offload.stats()["tensors_kept_on_device"] == 3


# -- CKPT_OFFLOAD_TEST_CPU is read when a session is made -------------------------------------------
def test_test_cpu_switch_is_read_when_a_session_is_made(monkeypatch):
    """docs/testing.md: the switch counts for the sessions made after it is set; the drop-in
    checkpoint's shared session keeps the value it saw when it was made."""
    monkeypatch.setattr(ck, "_default_session", None)
    w = torch.randn(H, H, requires_grad=True)
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "0")
    ckpt_offload.checkpoint(lambda h: torch.tanh(h @ w), torch.randn(4, H) * 2).sum().backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 0
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    ckpt_offload.checkpoint(lambda h: torch.tanh(h @ w), torch.randn(4, H) * 2).sum().backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 0  # the shared session was made with "0"
    monkeypatch.setattr(ck, "_default_session", None)  # a new session reads "1"
    ckpt_offload.checkpoint(lambda h: torch.tanh(h @ w), torch.randn(4, H) * 2).sum().backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 1
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "testing.md")).read()
    assert "read at every offload" not in page
    assert "read when a session is made" in page


# -- retain_graph: each backward reloads ---------------------------------------------------------
def test_retain_graph_reloads_for_each_backward_as_documented():
    """PITFALLS 24: each backward of a retained graph reloads its offloaded inputs (tensors_fetched counts
    them). Fails where the first reload is held on the device."""
    model = make_model(layers=3)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    loss = loss_of(model, make_batch())
    loss.backward(retain_graph=True)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 and s["tensors_fetched"] == 3
    loss.backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 and s["tensors_fetched"] == 6  # reloaded again, not held
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "how-it-works.md")).read()
    assert "reloads its offloaded inputs for each backward" in page


def test_checkpoint_refuses_a_near_miss_of_its_own_keywords():
    """PITFALLS 39: a near miss of an option (offlaod=, context=) that the function cannot take is
    refused with the match, before anything runs; torch would pass it on and the function would raise."""
    w = torch.randn(H, H, requires_grad=True)

    def layer(h, *args, scale=1.0):
        return torch.tanh(h @ w) * scale

    with pytest.raises(TypeError, match=r"ckpt_offload.checkpoint: unexpected keyword 'offlaod'; did you mean 'offload'"):
        ckpt_offload.checkpoint(layer, torch.randn(4, H) * 2, offlaod=False)
    with pytest.raises(TypeError, match=r"did you mean 'preserve_rng_state'"):
        ckpt_offload.checkpoint(layer, torch.randn(4, H) * 2, preserve_rng=False)
    with pytest.raises(TypeError, match=r"unexpected keyword 'context'; did you mean 'context_fn'"):
        ckpt_offload.checkpoint(layer, torch.randn(4, H) * 2, context=None)
    assert ckpt_offload.stats()["tensors_offloaded"] == 0

    def scaled(h, scale=1.0, offloads=0):  # named by the function: its own keywords, passed on
        return torch.tanh(h @ w) * scale + offloads

    x = torch.randn(4, H, requires_grad=True)
    ckpt_offload.checkpoint(scaled, x * 2, scale=2.0, offloads=1).sum().backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 1
    want = torch.autograd.grad((torch.tanh((x * 2) @ w) * 2.0 + 1).sum(), x)[0]
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("by_name", [True, False])
def test_checkpoint_passes_a_keyword_the_function_takes_as_torch_does(by_name):
    """torch's checkpoint hands keywords it does not own to the function (the usual **kwargs
    wrapper of a layer): context=, a near miss of context_fn, taken by name or through **kwargs,
    goes through and reaches the function, with the gradients of torch's own checkpoint."""
    w = torch.randn(H, H, requires_grad=True)
    seen = []

    if by_name:
        def layer(h, context=None):
            seen.append(context)
            return torch.tanh(h @ w) * context["scale"]
    else:
        def layer(h, **kwargs):
            seen.append(kwargs["context"])
            return torch.tanh(h @ w) * kwargs["context"]["scale"]

    ctx = {"scale": 3.0}
    x = torch.randn(4, H, requires_grad=True)
    ckpt_offload.checkpoint(layer, x * 2, context=ctx).sum().backward()
    assert seen and all(c is ctx for c in seen)  # the forward and the recompute both got it
    got = x.grad
    x.grad = None
    torch.utils.checkpoint.checkpoint(layer, x * 2, context=ctx, use_reentrant=False).sum().backward()
    assert torch.equal(got, x.grad)
