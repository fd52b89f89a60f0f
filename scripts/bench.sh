#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the main job: the training-step benchmark of every
# mode (checkpointing, offload, transformers-style synchronous offload) on its built-in
# configuration: small on the CPU, Llama-3-8B-shaped layers on a GPU. Results: benchmarks/out/.
# Extra arguments go to benchmarks/bench_step.py (`--disk [DIR]` adds disk_offload, the disk tier's mode).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" benchmarks/bench_step.py "$@"
