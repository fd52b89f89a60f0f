"""scripts/pytorch_tests/ (PyTorch's own checkpoint tests with ckpt_offload substituted) on a small
stand-in for PyTorch's test_utils.py: the selection finds the non-reentrant tests only, the redirect
sends their calls to ckpt_offload (bytes really offloaded), and a test our checkpoint fails, fails."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pytorch_tests", "run.sh")

STAND_IN = '''
import os
import unittest
import torch
from torch.utils.checkpoint import checkpoint


class TestCheckpoint(unittest.TestCase):
    def _run(self):
        x = torch.randn(64, 64, requires_grad=True)
        w = torch.randn(64, 64, requires_grad=True)
        out = checkpoint(lambda a, b: torch.sin(a @ b), x * 2, w, use_reentrant=False)
        out.sum().backward()
        return x, w

    def test_literal(self):
        x = torch.randn(64, 64, requires_grad=True)
        checkpoint(torch.sin, x * 2, use_reentrant=False).sum().backward()
        self.assertTrue(torch.allclose(x.grad, 2 * torch.cos(x * 2)))

    def test_through_a_helper(self):
        import ckpt_offload
        ckpt_offload.reset_stats()
        self._run()
        moved = ckpt_offload.stats()["bytes_offloaded"]
        self.assertEqual(moved > 0, os.environ["PT_REDIRECT"] == "redirect", moved)

    def test_object_identity(self):
        seen = []
        x = torch.randn(64, 64, requires_grad=True)
        y = x * 2
        checkpoint(lambda a: (seen.append(a), a.sin())[1], y, use_reentrant=False).sum().backward()
        self.assertIs(seen[-1], y)  # an offloaded input comes back equal, not the same object

    def test_reentrant_is_not_selected(self):
        x = torch.randn(4, requires_grad=True)
        checkpoint(torch.sin, x, use_reentrant=True).sum().backward()

    def test_literal_named_like_a_case_of_test_literal(self):
        x = torch.randn(4, requires_grad=True)
        checkpoint(torch.sin, x, use_reentrant=True).sum().backward()  # reentrant: not selected either
'''


def _run(tmp_path, mode):
    (tmp_path / "test_utils.py").write_text(STAND_IN)
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run(["bash", SCRIPT, str(tmp_path), mode], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    stats_path = tmp_path / f"pt_{mode}_stats.json"
    assert stats_path.exists(), p.stdout[-3000:] + p.stderr[-3000:]  # pytest ran to its end
    stats = json.loads(stats_path.read_text())
    return p, stats


def test_plain_runs_torch_and_redirect_runs_ours(tmp_path):
    p, stats = _run(tmp_path, "plain")
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert stats["stats"]["redirected"] == 0
    p, stats = _run(tmp_path, "redirect")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 failed, 2 passed" in p.stdout and "FAILED test_utils.py::TestCheckpoint::test_object_identity" in p.stdout
    assert "test_reentrant_is_not_selected" not in p.stdout and "test_literal_named_like" not in p.stdout
    per_test = stats["per_test_redirected"]
    assert per_test == {f"test_utils.py::TestCheckpoint::{t}": 1 for t in
                        ("test_literal", "test_through_a_helper", "test_object_identity")}, per_test
