"""Shared fixtures: the CPU test path switch, clean statistics, one intra-op thread, and the markers."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import ckpt_offload  # noqa: E402

# The process-wide pool's node guard reads this machine's /proc and cgroup files from its first use
# on: taken here, before any test points hostmem at a stand-in tree (tests that guard a pool by a
# stand-in call ckpt_offload.engine.guard_node themselves, and put it back).
ckpt_offload.host_pool()

HAS_CUDA = ckpt_offload.build_info()["cuda_usable"] and torch.cuda.is_available()
NO_GPU_REASON = "needs a CUDA GPU and a CUDA build of the extension (none here)"
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU_REASON)

# Devices a test written once runs on: the CPU through the test path, and the GPU when present.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped with a reason where none is present")
    config.addinivalue_line(
        "markers", "deepspeed: DeepSpeed ZeRO under the Trainer on 2 CPU processes; skipped where deepspeed is not installed"
    )
    config.addinivalue_line(
        "markers", "multinode: two torchrun launchers on this machine as two nodes, 2 CPU processes each"
    )
    config.addinivalue_line("markers", "tensor_parallel: tensor / sequence parallelism on several gloo processes "
                            "(tests/test_tensor_parallel.py); run alone with -m tensor_parallel")


@pytest.fixture
def test_cpu(monkeypatch):
    """CKPT_OFFLOAD_TEST_CPU=1: CPU tensors go through the pool and the engine too."""
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: two cores shared with other jobs, so more only
    oversubscribe them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def clean_stats():
    ckpt_offload.synchronize()
    ckpt_offload.reset_stats()
    yield
    ckpt_offload.profile(False)


@pytest.fixture(autouse=True)
def warnings_not_yet_shown(monkeypatch):
    """The warnings the package shows once per process are unshown before every test, so that a test
    sees them as it would alone, whichever tests ran before it in the same process (scripts/test.sh
    hands whole files to two processes, in no fixed order)."""
    import ckpt_offload.checkpointing as checkpointing
    import ckpt_offload.session as session

    for module, name in ((checkpointing, "_kwarg_warned"), (checkpointing, "_container_warned"),
                         (session, "_refusal_warned"), (session, "_unmovable_warned")):
        monkeypatch.setattr(module, name, False)
    monkeypatch.setattr(session, "_subclass_warned", set())


@pytest.fixture(autouse=True)
def no_hf_routing():
    """hf.install() (implied by hf.install_checkpointing_args(offload=True)) patches transformers for the
    whole process: undone after every test, so that no test sees another's routing."""
    yield
    # trl.install() and accelerate.install() patch their libraries for the whole process too.
    for name in ("hf", "trl", "accelerate", "diffusers"):
        integration = sys.modules.get(f"ckpt_offload.integrations.{name}")
        if integration is not None:
            integration.uninstall()
