"""examples/train_fsdp2.py as a user runs it: torchrun, 2 CPU processes over gloo. With offload the
losses equal plain checkpointing's bit for bit, every block stays compiled, and bytes really moved."""
import os
import re
import signal
import subprocess
import sys

import pytest

from procs import free_port, fsdp2_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240  # about 20 s a run on 2 cores with aot_eager; this bounds a hang


def _run(*extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # A session of its own: on a timeout the launcher and both workers are killed together.
    p = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "examples/train_fsdp2.py", "--device", "cpu", "--backend", "aot_eager", "--layers", "4", "--steps", "3",
         *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the example did not finish in {TIMEOUT_S} s:\n{out[-3000:]}{err[-3000:]}")
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return out


@pytest.mark.skipif(not fsdp2_available(), reason="this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
def test_train_fsdp2_example_on_two_cpu_processes():
    out = _run()
    plain = _run("--no-offload")
    losses = re.findall(r"step \d: loss (\S+),", out)
    assert len(losses) == 3 and losses == re.findall(r"step \d: loss (\S+),", plain)
    assert "checkpointed [0, 2], offloaded [0]" in out
    graphs, breaks = map(int, re.search(r"torch.compile: (\d+) graphs, (\d+) graph breaks", out).groups())
    assert graphs >= 1 and breaks == 0  # compile= and block.compile(): nothing compiled around a boundary
    stats = re.search(r"'bytes_offloaded': (\d+)", out)
    # One offloaded layer's input (2 x 64 x 64 float32) a step, plus the rotary tables it receives.
    assert int(stats.group(1)) == 2 * 64 * 64 * 4 + 2 * 64 * 4 * 4
    assert "'host_in_use_bytes': 0" in out


def _sft(*extra):
    env = dict(os.environ, CKPT_OFFLOAD_TEST_CPU="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "examples/sft_lora.py", "--steps", "6", *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [tuple(c.strip() for c in line.split("|")) for line in p.stdout.splitlines()
            if re.match(r"^\d+ \| \d+ \| ", line)]
    assert len(rows) == 6, p.stdout
    return p.stdout, [(int(s), int(n), l, int(o), int(a), int(u)) for s, n, l, o, a, u in rows]


def test_sft_lora_example_offloads_with_transformers_own_losses():
    pytest.importorskip("trl", reason="trl is an optional dependency")
    pytest.importorskip("peft", reason="peft is an optional dependency")
    out, rows = _sft()
    _, plain = _sft("--no-offload")
    assert [r[2] for r in rows] == [r[2] for r in plain]  # the same losses as transformers' own checkpointing
    assert "checkpointing_state: ([0, 1, 2, 3], [0, 1, 2])" in out and "model: PeftModelForCausalLM" in out
    assert "configuration stays in force" in out  # SFTTrainer enabled transformers' checkpointing again
    assert "all LoRA: True" in out
    assert all(r[3] == 3 and r[5] == 0 for r in rows)  # 3 layers offloaded a step, host memory back to 0
    longest = max(range(len(rows)), key=lambda i: rows[i][1])
    assert all(r[4] == 0 for r in rows[longest + 1:])  # no host allocation after the longest step
    assert all(r[3] == 0 for r in plain)
