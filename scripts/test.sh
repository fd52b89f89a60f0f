#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. GPU tests are marked `gpu` and
# skipped, with the reason, where no GPU is present. Extra arguments go to pytest.
#
# Environment: TEST_WORKERS (2): pytest-xdist processes, each taking whole test files (--dist
# loadfile); most tests keep one core busy, so two processes use a 2-core machine. 1 runs the suite in
# this process, as plain pytest does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${TEST_WORKERS:-2}
case "$workers" in ''|*[!0-9]*|0) echo "test.sh: TEST_WORKERS must be a positive integer, not '$workers'" >&2; exit 2 ;; esac
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
exec "${VENV:-.venv}/bin/python" -m pytest tests -q -rs "${parallel[@]}" "$@"
