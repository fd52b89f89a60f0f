#!/usr/bin/env bash
# Sets up .venv with what ckpt_offload, its tests, benchmarks and docs need (pyproject.toml's build
# requirements, dependencies and `dev` extra, listed by scripts/dev_requirements.py) and builds the
# extension in place (CUDA variant when torch has CUDA and a toolkit is found; see setup.py). Safe to
# run again: it runs pip only when that list changed since the last successful install into this
# venv (a stamp in the venv), and rebuilds only when the sources changed or the build no longer loads.
#
# Every version comes from constraints.txt (pip -c), so that the same commit installs the same set
# on every machine; scripts/test_latest.sh sets CONSTRAINTS to nothing to try the newest releases.
#
# Environment: PYTHON (python3.11 if present, else python3), VENV (.venv), CKPT_OFFLOAD_WITH_CUDA,
# CONSTRAINTS (constraints.txt; empty: none).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: some steps run from /tmp
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
CONSTRAINTS=${CONSTRAINTS-constraints.txt}
pin=()
if [ -n "$CONSTRAINTS" ]; then
  [ -f "$CONSTRAINTS" ] || { echo "setup.sh: no constraints file $CONSTRAINTS" >&2; exit 2; }
  pin=(-c "$CONSTRAINTS")
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
# The stamp holds the hash of the requirement list and the constraints last installed: pip itself
# takes seconds even when everything is there, and every benchmark and test run starts here.
stamp="$VENV/.ckpt_offload_requirements.sha256"
reqs="$VENV/.ckpt_offload_dev_requirements.txt"
{ "$VENV/bin/python" scripts/dev_requirements.py; [ -z "$CONSTRAINTS" ] || sed 's/^/# pinned: /' "$CONSTRAINTS"; } > "$reqs.new"
want=$("$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$reqs.new")
mv "$reqs.new" "$reqs"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "== installing requirements from pyproject.toml${CONSTRAINTS:+ at the versions in $CONSTRAINTS} (torch is large: the first time takes a few minutes)"
  rm -f "$stamp"
  "$VENV/bin/python" -m pip install -q --upgrade pip "${pin[@]}"
  "$VENV/bin/python" -m pip install -q -r "$reqs" "${pin[@]}"
  echo "$want" > "$stamp"
else
  echo "== requirements in pyproject.toml unchanged since the last install into $VENV: pip skipped (remove $stamp to force it)"
fi

so=$(ls ckpt_offload/_C*.so 2>/dev/null | head -n 1 || true)
# One import both checks that the build loads and reports it (importing torch takes seconds).
report='import ckpt_offload; print("== ckpt_offload build:", ckpt_offload.build_info())'
info=""
if [ -n "$so" ] && [ -z "$(find csrc setup.py ckpt_offload/_toolkit.py -newer "$so" -print -quit)" ]; then
  # Loads from outside the tree only when the editable install is in place too.
  info=$(cd /tmp && "$VENV/bin/python" -c "$report" 2>/dev/null) || info=""
fi
if [ -z "$info" ]; then
  echo "== building ckpt_offload._C"
  "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -e . > build.log 2>&1 || {
    tail -n 40 build.log
    echo "build failed; full log in build.log" >&2
    exit 1
  }
  info=$(cd /tmp && "$VENV/bin/python" -c "$report")
fi
echo "$info"
