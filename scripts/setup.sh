#!/usr/bin/env bash
# Sets up .venv with what ckpt_offload needs and builds the extension in place (CUDA variant when
# torch has CUDA and a toolkit is found; see setup.py). Safe to run again: it rebuilds only when
# the sources changed or the build no longer loads.
#
# Environment: PYTHON (python3.11 if present, else python3), VENV (.venv), CKPT_OFFLOAD_WITH_CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
echo "== installing requirements (torch is large: the first time takes a few minutes)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r requirements.txt

so=$(ls ckpt_offload/_C*.so 2>/dev/null | head -n 1 || true)
stale=1
if [ -n "$so" ] && [ -z "$(find csrc setup.py ckpt_offload/_toolkit.py -newer "$so" -print -quit)" ]; then
  # Loads from outside the tree only when the editable install is in place too.
  (cd /tmp && "$OLDPWD/$VENV/bin/python" -c "import ckpt_offload" 2>/dev/null) && stale=0
fi
if [ "$stale" = 1 ]; then
  echo "== building ckpt_offload._C"
  "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -e . > build.log 2>&1 || {
    tail -n 40 build.log
    echo "build failed; full log in build.log" >&2
    exit 1
  }
fi
(cd /tmp && "$OLDPWD/$VENV/bin/python" -c "import ckpt_offload; print('== ckpt_offload build:', ckpt_offload.build_info())")
