#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. GPU tests are marked `gpu` and
# skipped, with the reason, where no GPU is present. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" -m pytest tests -q -rs "$@"
