"""`python -m ckpt_offload env`: the report's keys and types, host memory read through hostmem's
paths (a stand-in /proc and /sys), the settings it picks up, the JSON a subprocess prints, a GPU's
PCIe link from a stand-in sysfs, and a report that still comes when the compiled core does not load."""
import contextlib
import glob
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import HAS_CUDA, requires_cuda
from ckpt_offload import __main__ as dispatcher
from ckpt_offload import envreport
from ckpt_offload.sizing import hostmem, nvidia

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"ckpt_offload", "python", "platform", "torch", "build", "cuda", "host", "packages", "settings"}
HOST_KEYS = {"memory_total_bytes", "memory_available_bytes", "cgroup_limit_bytes", "numa_nodes",
             "pinned_in_use_bytes", "spill_dir", "capacity_bytes"}
INT_OR_NONE = (int, type(None))


def run_env(*args, cwd, env=None):
    p = subprocess.run([sys.executable, "-m", "ckpt_offload", "env", *args], cwd=cwd, capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_report_keys_and_types():
    import ckpt_offload

    r = envreport.report()
    assert set(r) == KEYS
    assert r["ckpt_offload"] == ckpt_offload.__version__
    assert r["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert r["torch"] == {"version": torch.__version__, "cuda_runtime": torch.version.cuda,
                          "built_with_cuda": torch.version.cuda is not None, "error": None}
    b = r["build"]
    assert b["loaded"] is True and b["error"] is None and b["matches_torch"] is True
    assert {k: b[k] for k in ckpt_offload.build_info()} == ckpt_offload.build_info()
    assert b["location"] == os.path.dirname(ckpt_offload.__file__) and b["source_checkout"] is True
    c = r["cuda"]
    assert isinstance(c["driver"], (str, type(None))) and isinstance(c["devices"], list)
    assert len(c["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for d in c["devices"]:
        assert isinstance(d["name"], str) and d["total_memory_bytes"] > 0
        assert set(d["pcie"]) == {"gen", "width", "max_gen", "max_width", "nominal_gb_per_s", "source"}
    h = r["host"]
    assert set(h) >= HOST_KEYS
    assert all(isinstance(h[k], INT_OR_NONE) for k in HOST_KEYS - {"spill_dir"})
    assert h["pinned_in_use_bytes"] == ckpt_offload.stats()["host_in_use_bytes"]
    assert h["capacity_bytes"] == ckpt_offload.host_pool().stats()["capacity_bytes"]
    assert set(r["packages"]) == set(envreport.PACKAGES)
    assert all(isinstance(v, (str, type(None))) for v in r["packages"].values())
    json.dumps(r)  # one JSON object, nothing that does not serialise


def test_host_memory_read_through_hostmem(tmp_path, monkeypatch):
    """A stand-in /proc/meminfo, /proc/self/cgroup and cgroup v2 tree: the report shows hostmem's figures."""
    (tmp_path / "meminfo").write_text("MemTotal:       65536000 kB\nMemAvailable:   32768000 kB\n")
    (tmp_path / "cgroup").write_text("0::/job/step\n")
    step = tmp_path / "fs" / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (tmp_path / "fs" / "job" / "memory.max").write_text(f"{8 << 30}\n")
    (tmp_path / "fs" / "job" / "memory.current").write_text(f"{3 << 30}\n")
    nodes = tmp_path / "nodes"
    for n in ("node0", "node1", "possible"):
        (nodes / n).mkdir(parents=True)
    monkeypatch.setattr(hostmem, "_MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(hostmem, "_SELF_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(hostmem, "_CGROUP_ROOT", str(tmp_path / "fs"))
    monkeypatch.setattr(hostmem, "_NODES", str(nodes))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    h = envreport.report()["host"]
    assert h["memory_total_bytes"] == 65536000 * 1024
    assert h["cgroup_limit_bytes"] == 8 << 30  # the parent's limit binds the step's unlimited cgroup
    assert h["memory_available_bytes"] == 5 << 30  # what the limit leaves, below MemAvailable
    assert h["numa_nodes"] == 2 and h["local_world_size"] == 4
    text = envreport.format_text(envreport.report())
    assert "cgroup limit:        8.0 GiB (8589934592 bytes)" in text and "NUMA nodes:          2" in text


def test_settings_are_the_ckpt_offload_variables(monkeypatch):
    for k in [k for k in os.environ if k.startswith("CKPT_OFFLOAD_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_SEED", "7")
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    monkeypatch.setenv("CKPT_OFFLOADX", "not ours")
    r = envreport.report()
    assert r["settings"] == {"CKPT_OFFLOAD_TEST_CPU": "1", "CKPT_OFFLOAD_TEST_SEED": "7"}
    assert "settings:            CKPT_OFFLOAD_TEST_CPU=1, CKPT_OFFLOAD_TEST_SEED=7" in envreport.format_text(r)


def test_the_command_prints_one_json_object(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, CKPT_OFFLOAD_TEST_SEED="3")
    r = json.loads(run_env("--json", cwd=tmp_path, env=env))
    assert set(r) == KEYS and r["settings"]["CKPT_OFFLOAD_TEST_SEED"] == "3"
    assert r["build"]["loaded"] and r["build"]["location"] == os.path.join(ROOT, "ckpt_offload")
    text = run_env(cwd=tmp_path, env=env)
    assert text.startswith(f"ckpt_offload:        {r['ckpt_offload']}\n") and "host memory:" in text


def copy_package(dest):
    """The package's Python files without the compiled core and its build record (each test writes its own:
    where the copy has none, an editable install's finder would supply the checkout's)."""
    for path in glob.glob(os.path.join(ROOT, "ckpt_offload", "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, ROOT)
        if os.path.basename(rel) == "_build_info.py":
            continue
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        shutil.copy(path, os.path.join(dest, rel))


def test_a_core_that_does_not_load_is_reported(tmp_path):
    """A _C that is no shared library: the report still comes, with the loader's error in `build`, and
    the rebuild hint of a package outside a checkout, and no torch versions (the build record's equals the
    installed one: not the cause). `import ckpt_offload` works (sizing needs no core); using the core fails."""
    copy_package(tmp_path / "site")
    (tmp_path / "site" / "ckpt_offload" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_text("broken\n")
    (tmp_path / "site" / "ckpt_offload" / "_build_info.py").write_text(
        f"TORCH_VERSION = {torch.__version__!r}\nWITH_CUDA = False\nCUDA_VERSION = None\nCUDA_HOME = None\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    r = json.loads(run_env("--json", cwd=tmp_path, env=env))
    b = r["build"]
    assert b["loaded"] is False and b["matches_torch"] is True
    assert b["record"] == {"torch_version": torch.__version__, "with_cuda": False, "cuda_version": None}
    assert "ckpt_offload._C could not be loaded" in b["error"] and torch.__version__ not in b["error"]
    assert "pip install --no-build-isolation --no-deps --force-reinstall" in b["error"]
    assert b["source_checkout"] is False and r["torch"]["version"] == torch.__version__
    assert r["host"]["pinned_in_use_bytes"] is None and r["host"]["memory_total_bytes"] == hostmem.memory_total_bytes()
    assert "build:               does not load: ImportError: ckpt_offload._C could not be loaded" in run_env(
        cwd=tmp_path, env=env)
    p = subprocess.run([sys.executable, "-c", "import ckpt_offload; ckpt_offload.host_pool()"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "ckpt_offload._C could not be loaded" in p.stderr, p.stderr


def test_a_build_for_another_torch_is_reported(tmp_path):
    copy_package(tmp_path / "site")
    (tmp_path / "site" / "ckpt_offload" / "_build_info.py").write_text(
        "TORCH_VERSION = '2.11.0+cu128'\nWITH_CUDA = True\nCUDA_VERSION = '12.8'\nCUDA_HOME = None\n")
    r = json.loads(run_env("--json", cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path / "site"))))
    b = r["build"]
    assert b["loaded"] is False and b["matches_torch"] is False
    assert b["record"] == {"torch_version": "2.11.0+cu128", "with_cuda": True, "cuda_version": "12.8"}
    assert f"built for torch 2.11.0+cu128 but torch {torch.__version__} is installed" in b["error"]


@pytest.mark.parametrize("argv0, name", [
    ("/venv/bin/ckpt-offload", "ckpt-offload"),
    (os.path.join(ROOT, "ckpt_offload", "__main__.py"), "python -m ckpt_offload"),
])
def test_usage_names_the_command_as_it_was_typed(monkeypatch, capsys, argv0, name):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    assert dispatcher.main() == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {name} <command> [options]") and f"`{name} <command> --help`" in out, out
    for command in ("env", "estimate"):
        with contextlib.suppress(SystemExit):  # argparse's exit, or the command's return code
            dispatcher.main([command, "--help"])
        assert capsys.readouterr().out.startswith(f"usage: {name} {command} "), command


def test_a_missing_command_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(dispatcher.COMMANDS, "later", ("ckpt_offload.not_written_yet", "a command to come"))
    assert dispatcher.main(["later"]) == 2
    assert "the 'later' command is not part of this installation (ckpt_offload.not_written_yet is missing)" in (
        capsys.readouterr().err)


def test_pcie_link_and_driver_from_sysfs(tmp_path, monkeypatch):
    dev = tmp_path / "devices" / "0000:3b:00.0"
    dev.mkdir(parents=True)
    for name, value in (("current_link_speed", "16.0 GT/s PCIe"), ("current_link_width", "16"),
                        ("max_link_speed", "32.0 GT/s PCIe"), ("max_link_width", "16")):
        (dev / name).write_text(value + "\n")
    (tmp_path / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)\n")
    monkeypatch.setattr(nvidia, "_PCI_DEVICES", str(tmp_path / "devices"))
    monkeypatch.setattr(nvidia, "_DRIVER_VERSION", str(tmp_path / "version"))
    assert nvidia.pci_address(0, 0x3b, 0) == "0000:3b:00.0"
    assert nvidia.pcie_link("0000:3b:00.0") == {"gen": 4, "width": 16, "max_gen": 5, "max_width": 16,
                                                "source": "sysfs", "nominal_gb_per_s": 31.51}
    assert nvidia.driver_version() == "580.95.05"
    assert nvidia.nominal_gb_per_s(3, 8) == 7.88 and nvidia.nominal_gb_per_s(None, 16) is None


@pytest.mark.skipif(HAS_CUDA, reason="checks the report without a GPU; the GPU test is test_probe_measures_both_directions")
def test_probe_without_a_gpu_says_so():
    r = envreport.report(probe_bandwidth=True)
    assert r["probe"] == {"ran": False, "reason": "no CUDA GPU: the bandwidth probe needs one"}
    assert "bandwidth probe:     not run: no CUDA GPU" in envreport.format_text(r)


@pytest.mark.gpu
@requires_cuda
def test_probe_measures_both_directions():
    r = envreport.report(probe_bandwidth=True)
    p = r["probe"]
    assert p["ran"] and p["d2h_gb_per_s"] > 0 and p["h2d_gb_per_s"] > 0
    if p["nominal_gb_per_s"]:
        assert 0 < p["d2h_of_nominal"] and 0 < p["h2d_of_nominal"]


def test_ranks_per_node_unset_is_said_not_shown_as_one(monkeypatch):
    # No launcher variable: the report says so (1 is what is assumed), not "LOCAL_WORLD_SIZE: 1" as
    # if a launcher had set it; a variable that is set is shown with its name.
    for name in hostmem._RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    text = envreport.format_text(envreport.report())
    line = next(l for l in text.splitlines() if l.startswith("LOCAL_WORLD_SIZE:"))
    assert line.split(":", 1)[1].strip().startswith("unset") and "1 assumed" in line
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    line = next(l for l in envreport.format_text(envreport.report()).splitlines() if l.startswith("LOCAL_WORLD_SIZE:"))
    assert line == "LOCAL_WORLD_SIZE:    1 (from OMPI_COMM_WORLD_LOCAL_SIZE)"
