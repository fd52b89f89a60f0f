"""Build plumbing: the toolkit search behind an nvcc wrapper, the build record, the loader's errors."""
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

import ckpt_offload
from ckpt_offload import _build_info, _loader, _toolkit


def fake_toolkit(root):
    os.makedirs(os.path.join(root, "include"))
    os.makedirs(os.path.join(root, "lib64"))
    open(os.path.join(root, "include", "cuda_runtime_api.h"), "w").close()
    open(os.path.join(root, "lib64", "libcudart.so"), "w").close()
    return root


def test_toolkit_found_behind_an_nvcc_wrapper(tmp_path, monkeypatch):
    toolkit = fake_toolkit(str(tmp_path / "cuda-99.0"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(bindir))
    assert _toolkit.find_cuda_toolkit() == os.path.realpath(toolkit)


def test_cuda_home_wins_and_must_be_valid(tmp_path, monkeypatch):
    toolkit = fake_toolkit(str(tmp_path / "tk"))
    monkeypatch.setenv("CUDA_HOME", toolkit)
    assert _toolkit.find_cuda_toolkit() == toolkit
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nothing"))
    with pytest.raises(SystemExit, match="is not a CUDA toolkit"):
        _toolkit.find_cuda_toolkit()


def test_build_info_matches_the_record():
    info = ckpt_offload.build_info()
    assert set(info) >= {"torch_version", "cuda_version", "with_cuda", "cuda_usable"}
    assert info["torch_version"] == _build_info.TORCH_VERSION == torch.__version__
    assert info["with_cuda"] == _build_info.WITH_CUDA
    assert (info["cuda_version"] is None) == (not info["with_cuda"])
    if torch.version.cuda is not None and _build_info.CUDA_HOME is not None:
        # A CUDA torch and a toolkit on the build machine give the CUDA variant, GPU or not.
        assert info["with_cuda"] and info["cuda_version"] == _build_info.CUDA_VERSION


def test_loader_names_both_versions_and_the_rebuild_command(monkeypatch):
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "1.13.0")
    with pytest.raises(ImportError) as err:
        _loader.load()
    msg = str(err.value)
    assert "built for torch 1.13.0" in msg and f"torch {torch.__version__} is installed" in msg
    assert "pip install --no-build-isolation -e ." in msg


def test_loader_ignores_local_version_tags(monkeypatch):
    public = torch.__version__.split("+")[0]
    monkeypatch.setattr(_build_info, "TORCH_VERSION", public + "+somebuild")
    assert _loader.load() is sys.modules["ckpt_offload._C"]


# -- the version floor (ckpt_offload/_floor.py) ------------------------------------------------------
def test_the_torch_floor_compares_releases():
    """PITFALLS 26: the torch floor compares releases, not strings. Fails where a version test misreads a
    release."""
    from ckpt_offload import _floor

    assert _floor.TORCH_MIN == "2.11"
    assert not _floor.torch_too_old("2.11.0+cu130") and not _floor.torch_too_old("2.11.0a0+git1234")
    assert not _floor.torch_too_old("2.15.0") and not _floor.torch_too_old("3.0.0")
    assert _floor.torch_too_old("2.10.1") and _floor.torch_too_old("2.4.0+cpu")


def test_the_loader_refuses_a_torch_below_the_floor(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(ImportError, match=r"torch 2\.10\.0\+cu128 is older than 2\.11, the oldest release "
                                          r"ckpt_offload supports; install torch>=2\.11"):
        _loader.load()


@pytest.mark.skipif(torch.version.cuda is None, reason="the toolkit check runs for a CUDA torch only")
def test_setup_refuses_a_cuda_toolkit_below_the_floor(tmp_path):
    import subprocess

    toolkit = fake_toolkit(str(tmp_path / "cuda-11.8"))
    with open(os.path.join(toolkit, "include", "cuda_runtime_api.h"), "w") as f:
        f.write("#define CUDART_VERSION 11080\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    before = open(os.path.join(root, "ckpt_offload", "_build_info.py")).read()
    env = dict(os.environ, CUDA_HOME=toolkit, CKPT_OFFLOAD_WITH_CUDA="1")
    run = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert f"the CUDA toolkit at {toolkit} is 11.8, older than 12.0" in run.stderr
    assert open(os.path.join(root, "ckpt_offload", "_build_info.py")).read() == before  # nothing written


# -- the rebuild command the loader names ----------------------------------------------------------
class FakeDistribution:
    def __init__(self, location, direct_url):
        self.location, self.direct_url = location, direct_url

    def locate_file(self, path):
        return os.path.join(self.location, path)

    def read_text(self, name):
        return self.direct_url if name == "direct_url.json" else None


@pytest.mark.parametrize("direct_url, source", [
    ('{"url": "https://example.org/ckpt_offload.git", "vcs_info": {"vcs": "git", "requested_revision": "v0.1.0", '
     '"commit_id": "abc"}}', "git+https://example.org/ckpt_offload.git@abc"),
    # Installed from a branch's head: the commit it had then, not whatever the branch holds now.
    ('{"url": "https://example.org/ckpt_offload.git", "vcs_info": {"vcs": "git", "commit_id": "0123abcd"}}',
     "git+https://example.org/ckpt_offload.git@0123abcd"),
    ('{"url": "file:///dl/ckpt_offload-0.1.0.tar.gz", "archive_info": {}}', "/dl/ckpt_offload-0.1.0.tar.gz"),
    # A built wheel would come back as the same build: no source named.
    ('{"url": "file:///dl/ckpt_offload-0.1.0-cp311-linux_x86_64.whl", "archive_info": {}}',
     "<the sdist or git URL ckpt_offload was installed from>"),
])
def test_outside_a_checkout_the_rebuild_is_pips_reinstall_from_the_source(monkeypatch, direct_url, source):
    site = os.path.dirname(os.path.dirname(os.path.abspath(_loader.__file__)))
    monkeypatch.setattr(_loader, "source_checkout", lambda: None)
    monkeypatch.setattr(_loader.metadata, "distribution", lambda name: FakeDistribution(site, direct_url))
    assert _loader.rebuild_command() == f"pip install --no-build-isolation --no-deps --force-reinstall {source}"
    # Another copy's record (an install elsewhere on sys.path) does not name this copy's source.
    monkeypatch.setattr(_loader.metadata, "distribution", lambda name: FakeDistribution("/elsewhere", direct_url))
    assert _loader.rebuild_command().endswith("<the sdist or git URL ckpt_offload was installed from>")


def test_in_a_checkout_the_rebuild_is_the_in_place_build():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert _loader.source_checkout() == os.path.dirname(os.path.dirname(os.path.abspath(_loader.__file__))) == root
    assert _loader.rebuild_command() == f"pip install --no-build-isolation -e .   (in {root})"


def test_a_source_folder_in_front_of_an_installed_copy_says_so(tmp_path):
    """Python started in a clone's root imports the clone's package, not the copy pip installed. With no
    build in the clone the first use of the core fails (the import itself works: sizing needs no build);
    the error names both folders and says to run from elsewhere."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = os.path.join(root, "ckpt_offload")
    clone, site = tmp_path / "clone", tmp_path / "site"
    copy = shutil.ignore_patterns("_C.*", "_build_info.py", "__pycache__")
    shutil.copytree(package, clone / "ckpt_offload", ignore=copy)
    (clone / "csrc").mkdir()
    (clone / "setup.py").write_text("")
    # Stands in for site-packages: the package with its build.
    shutil.copytree(package, site / "ckpt_offload", ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no .pth files, so no editable install's finder fills in ckpt_offload._C; torch comes from its folder.
    path = os.pathsep.join([str(site), os.path.dirname(os.path.dirname(torch.__file__))])
    env = dict(os.environ, PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-S", "-c", "import ckpt_offload; ckpt_offload.host_pool()"], cwd=clone,
                         capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode != 0
    assert (f"imported from the source folder {clone}, which has no build of ckpt_offload._C, and not from the "
            f"copy installed at {site / 'ckpt_offload'}") in run.stderr, run.stderr
    assert "run from another directory" in run.stderr
    # From another folder the same path reaches the installed copy.
    elsewhere = subprocess.run([sys.executable, "-S", "-c", "import ckpt_offload; print(ckpt_offload._C.__file__)"],
                               cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert elsewhere.stdout.strip().startswith(str(site / "ckpt_offload" / "_C.")), elsewhere.stderr
