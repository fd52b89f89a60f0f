#!/usr/bin/env bash
# Runs the engine, checkpoint, reliability, hf, timeline and disk tests on the simulated asynchronous runtime
# (CKPT_OFFLOAD_TEST_CPU=1 CKPT_OFFLOAD_TEST_ASYNC=1), once per seed: copies really in flight,
# hazards reported. Usage: scripts/test_async_sim.sh [SEED...] (default: 1 2 3); PYTHON picks the
# interpreter (default .venv/bin/python). Extra pytest arguments: PYTEST_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-${VENV:-.venv}/bin/python}
seeds=("$@")
[[ ${#seeds[@]} -gt 0 ]] || seeds=(1 2 3)
for seed in "${seeds[@]}"; do
  echo "== simulated asynchronous runtime, seed $seed"
  CKPT_OFFLOAD_TEST_CPU=1 CKPT_OFFLOAD_TEST_ASYNC=1 CKPT_OFFLOAD_TEST_SEED="$seed" \
    "$python" -m pytest tests/test_engine.py tests/test_checkpoint.py tests/test_reliability.py tests/test_hf.py \
    tests/test_timeline.py \
    tests/test_disk.py \
    -q -p no:cacheprovider ${PYTEST_ARGS:-}
done
