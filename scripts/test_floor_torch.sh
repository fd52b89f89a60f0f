#!/usr/bin/env bash
# The oldest torch pyproject.toml declares (constraints-floor.txt's torch line, with the other floor
# releases) in a venv of its own, the extension built against it in a copy of the tree
# ($TORCH_FLOOR_DIR), then the engine, checkpoint, compile and integration tests. Not in CI: a
# second torch is a few GB to download and a build; run it before moving a floor or a pin of torch.
# Extra arguments go to pytest (in place of the default list).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH_FLOOR_DIR=${TORCH_FLOOR_DIR:-/tmp/ckpt_offload_torch_floor}
bash scripts/copy_tree.sh "$TORCH_FLOOR_DIR"
cd "$TORCH_FLOOR_DIR"
# The floor releases, and constraints.txt for the rest less torch, what pip installs with it, and
# setuptools (torch 2.11 asks for setuptools<82).
{ grep -v '^#' constraints-floor.txt
  grep -v -E -i '^(#|torch==|nvidia-|cuda-|triton==|setuptools==)' constraints.txt \
    | grep -v -i -f <(grep -v '^#' constraints-floor.txt | sed 's/==.*//; s/.*/^&==/'); } > constraints-torch-floor.txt
grep -q '^torch==' constraints-torch-floor.txt || { echo "constraints-floor.txt names no torch" >&2; exit 2; }
PIP_CONSTRAINT=/dev/null CONSTRAINTS=constraints-torch-floor.txt VENV=.venv bash scripts/setup.sh
.venv/bin/python - <<'PY'
import torch, transformers
print("== torch", torch.__version__, "transformers", transformers.__version__)
PY
tests=(tests/test_engine.py tests/test_checkpoint.py tests/test_session_scope.py tests/test_offload_activations.py
       tests/test_compile.py tests/test_policies.py tests/test_hf.py tests/test_trl.py tests/test_estimate.py)
[ $# -eq 0 ] || tests=("$@")
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider "${tests[@]}"
