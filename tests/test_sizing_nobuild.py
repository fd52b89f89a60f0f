"""Sizing before the build: with the compiled core hidden (a meta-path finder that refuses
ckpt_offload._C, as a machine that never built it), `import ckpt_offload`, `ckpt_offload.sizing`,
`estimate_memory` and `python -m ckpt_offload estimate` run; what needs the core raises the loader's
error, which says it is not built (not a "circular import") and shows no torch versions."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HIDE = (
    "import sys\n"
    "class Hide:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'ckpt_offload._C':\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, Hide())\n"
)

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
              intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, torch_dtype="bfloat16")


def hidden(code, *argv, cwd=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", HIDE + code, *argv], capture_output=True, text=True, env=env,
                          cwd=cwd or ROOT, timeout=600)


def test_estimate_imports_and_runs_without_the_core(tmp_path):
    code = (
        "import torch, ckpt_offload, ckpt_offload.sizing\n"
        "from ckpt_offload.sizing import estimate\n"
        "assert 'ckpt_offload._C' not in sys.modules and ckpt_offload._load_error is not None\n"
        "from torch import nn\n"
        "with torch.device('meta'):\n"
        "    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])\n"
        "est = ckpt_offload.estimate_memory(model, (torch.empty(8, 64, device='meta'),))\n"
        "print(est.host_bytes['checkpoint+offload'])\n"
        "try:\n"
        "    ckpt_offload.host_pool()\n"
        "except ImportError as e:\n"
        "    print('ERROR', e)\n"
    )
    p = hidden(code)
    assert p.returncode == 0, p.stderr
    sent, error = p.stdout.strip().splitlines()
    assert int(sent) == 4 * 8 * 64 * 4  # every block's fp32 input, as with the core
    assert "ckpt_offload._C is not built" in error and "circular import" not in error
    assert torch.__version__ not in error and "Build it with: pip install" in error


def test_the_command_runs_without_the_core(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    code = ("import runpy\n"
            "sys.argv = ['ckpt_offload', *sys.argv[1:]]\n"
            "runpy.run_module('ckpt_offload', run_name='__main__', alter_sys=True)\n")
    p = hidden(code, "estimate", "--config", str(cfg), "--seq", "128", "--device-memory", "4GiB", "--host-memory",
               "8GiB", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["model"] == "LlamaForCausalLM" and out["modes"]["checkpoint+offload"]["host_bytes_per_rank"] > 0
