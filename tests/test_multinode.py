"""Two nodes on one machine: examples/train_fsdp2.py under two torchrun launchers that meet through a
c10d rendezvous, 2 CPU processes (gloo) each. It trains, offloads, and each launcher's ranks divide
their own node's host memory (LOCAL_WORLD_SIZE=2), not the job's (WORLD_SIZE=4)."""
import math
import os
import re
import signal
import subprocess
import sys

import pytest

from procs import free_port, fsdp2_available

pytestmark = [
    pytest.mark.multinode,
    pytest.mark.skipif(not fsdp2_available(), reason="this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES, PER_NODE, STEPS = 2, 2, 2
TIMEOUT_S = 240  # about 20 s on two cores (eager); this bounds a hang, not a measurement


def _launch_two_nodes():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node),
             "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
             "examples/train_fsdp2.py", "--device", "cpu", "--no-compile", "--layers", "4", "--steps", str(STEPS)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # on a timeout the launcher and its workers are killed together
        )
        for node in range(NODES)
    ]
    outputs = []
    try:
        for p in launchers:
            try:
                out, err = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a launcher did not finish in {TIMEOUT_S} s")
            assert p.returncode == 0, out[-3000:] + err[-3000:]
            outputs.append(out)
    finally:
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return outputs


def test_two_nodes_train_and_split_each_node_host_memory():
    outputs = _launch_two_nodes()
    ranks = []
    for node, out in enumerate(outputs):
        lines = re.findall(r"rank (\d+): local world size (\d+) of world (\d+), host share (\d+) bytes of (\d+) available",
                           out)
        assert len(lines) == PER_NODE, out
        for rank, local, world, share, available in lines:
            local, world, share, available = int(local), int(world), int(share), int(available)
            assert (local, world) == (PER_NODE, NODES * PER_NODE), out
            # Half of what is available, split by the node's 2 ranks (read a moment apart: within 1%).
            assert math.isclose(share, available * 0.5 / PER_NODE, rel_tol=0.01), out
            ranks.append(int(rank))
        # Each launcher starts its own node's ranks, consecutive in the job's numbering.
        node_ranks = sorted(int(r) for r, *_ in lines)
        assert node_ranks in ([0, 1], [2, 3]), out
    assert sorted(ranks) == [0, 1, 2, 3]
    first = next(out for out in outputs if "rank 0:" in out)  # global rank 0 reports the run
    assert "4 x cpu, 4 layers" in first and "checkpointed [0, 2], offloaded [0]" in first, first
    losses = [float(x) for x in re.findall(r"step \d: loss (\S+),", first)]
    assert len(losses) == STEPS and all(math.isfinite(x) and x > 0 for x in losses), first
    stats = re.search(r"'bytes_offloaded': (\d+), 'tensors_offloaded': (\d+)", first)
    # One offloaded layer's input (2 x 64 x 64 float32) a step, plus the rotary tables it receives.
    assert int(stats.group(1)) == 2 * 64 * 64 * 4 + 2 * 64 * 4 * 4, first
    assert "'host_in_use_bytes': 0" in first, first
