#!/usr/bin/env bash
# The suite's integration and sizing tests against the oldest releases pyproject.toml declares
# (constraints-floor.txt): a venv (.venv-floor) that sees the development venv's packages through a
# .pth file and holds only the floor releases (and what they need) itself, so that it takes seconds,
# not a second torch. Checks first that constraints-floor.txt names pyproject.toml's floors.
# Extra arguments go to pytest (in place of the default test list).
#
# Environment: VENV (.venv, set up by scripts/setup.sh when missing), FLOOR_VENV (.venv-floor),
# TEST_WORKERS (2: pytest-xdist processes, whole files each, as scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
FLOOR_VENV=${FLOOR_VENV:-.venv-floor}
[ -x "$VENV/bin/python" ] || VENV="$VENV" bash scripts/setup.sh
"$VENV/bin/python" scripts/floors.py check

base=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
py=$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')
stamp="$FLOOR_VENV/.floor.sha256"
want=$(cat constraints-floor.txt constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  rm -rf "$FLOOR_VENV"
  "$py" -m venv "$FLOOR_VENV"
  site=$("$FLOOR_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # After the venv's own site-packages on sys.path: a floor release installed here wins.
  echo "$base" > "$site/_ckpt_offload_dev_venv.pth"
  # torch's floor needs a build of its own: scripts/test_floor_torch.sh.
  floor=$(grep -v -E '^(#|torch==)' constraints-floor.txt)
  echo "== installing the floor releases into $FLOOR_VENV: $(echo $floor)"
  # -c constraints.txt too: what a floor release pulls in stays at CI's versions where it can.
  "$FLOOR_VENV/bin/python" -m pip install -q -r <(echo "$floor") \
    -c <(grep -v -f <(grep -v '^#' constraints-floor.txt | sed 's/==.*//; s/.*/^&==/') constraints.txt)
  echo "$want" > "$stamp"
fi
"$FLOOR_VENV/bin/python" scripts/floors.py verify

tests=(tests/test_hf.py tests/test_estimate.py tests/test_estimate_models.py tests/test_recipe.py tests/test_budget.py tests/test_planner.py
       tests/test_finetune.py tests/test_trl.py tests/test_accelerate.py tests/test_compile.py tests/test_diffusers.py
       tests/test_run_files.py tests/test_estimate_configuration.py)
[ $# -eq 0 ] || tests=("$@")
workers=${TEST_WORKERS:-2}
case "$workers" in ''|*[!0-9]*|0) echo "test_floor.sh: TEST_WORKERS must be a positive integer, not '$workers'" >&2; exit 2 ;; esac
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
exec "$FLOOR_VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "${parallel[@]}" "${tests[@]}"
