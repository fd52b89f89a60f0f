#!/bin/bash
# PyTorch's own non-reentrant checkpoint tests, run with torch's checkpoint (plain) or with
# ckpt_offload.checkpoint(..., offload=True) substituted for it (redirect).
#
# Usage: scripts/pytorch_tests/run.sh TESTDIR [plain|redirect]
#   TESTDIR holds PyTorch's test/test_autograd.py and/or test/test_utils.py, from the PyTorch
#   source tree matching the installed torch (they need `pip install expecttest`).
# Writes TESTDIR/pt_<mode>.xml (junit) and TESTDIR/pt_<mode>_stats.json (calls redirected).
# PYTHON (default: python) runs it; CKPT_OFFLOAD_TEST_CPU=1 is set, so it runs without a GPU.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dir=${1:?usage: run.sh TESTDIR [plain|redirect]}
mode=${2:-redirect}
py=${PYTHON:-python}
cd "$dir"
export PYTHONPATH="$here:$root${PYTHONPATH:+:$PYTHONPATH}" CKPT_OFFLOAD_TEST_CPU=1
export PT_REDIRECT=$mode PT_REDIRECT_STATS="$PWD/pt_${mode}_stats.json"
mapfile -t ids < <("$py" "$here/select_tests.py")
[ ${#ids[@]} -gt 0 ] || { echo "run.sh: no checkpoint tests found in $dir" >&2; exit 2; }
exec "$py" -m pytest -p redirect -p no:cacheprovider -q -rfEs --junitxml="pt_$mode.xml" "${ids[@]}"
