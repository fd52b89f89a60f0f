#!/usr/bin/env bash
# Sets up .venv with what ckpt_offload needs and builds the extension in place (CUDA variant when
# torch has CUDA and a toolkit is found; see setup.py). Safe to run again: it runs pip only when
# requirements.txt changed since the last successful install into this venv (a stamp in the venv),
# and rebuilds only when the sources changed or the build no longer loads.
#
# Environment: PYTHON (python3.11 if present, else python3), VENV (.venv), CKPT_OFFLOAD_WITH_CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: some steps run from /tmp
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
# The stamp holds the hash of the requirements.txt last installed: pip itself takes seconds even
# when everything is there, and every benchmark and test run starts here.
stamp="$VENV/.ckpt_offload_requirements.sha256"
want=$("$VENV/bin/python" -c 'import hashlib; print(hashlib.sha256(open("requirements.txt", "rb").read()).hexdigest())')
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "== installing requirements (torch is large: the first time takes a few minutes)"
  rm -f "$stamp"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
else
  echo "== requirements.txt unchanged since the last install into $VENV: pip skipped (remove $stamp to force it)"
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
