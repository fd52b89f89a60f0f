#!/usr/bin/env bash
# The suite against the newest releases of what ckpt_offload runs with (torch, transformers,
# accelerate, peft, trl, deepspeed and the rest, unpinned), to learn of an upstream release before
# CI pins it: CI installs constraints.txt, so a release cannot turn it red, and this script is how a
# release is taken in. It copies the working tree (tracked and untracked, not ignored files) to
# $LATEST_DIR, sets up a venv there with no constraints (pip's own cap lifted: PIP_CONSTRAINT), builds
# the extension against that torch, and runs pytest. Then it says:
#   - which releases differ from constraints.txt;
#   - when tests failed, which release broke which test: each differing release but torch is put alone
#     over the pinned venv (.venv, a .pth overlay as in test_floor.sh) and the failed tests are run
#     again there; what none of them explains is torch's, or a combination's.
# With --freeze it also prints the pins for constraints.txt (take them only from a passing run).
# Extra arguments go to pytest (in place of the whole suite).
#
# Environment: VENV (.venv, the pinned one), LATEST_DIR (/tmp/ckpt_offload_latest).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
LATEST_DIR=${LATEST_DIR:-/tmp/ckpt_offload_latest}
freeze=0
if [ "${1:-}" = "--freeze" ]; then freeze=1; shift; fi

bash scripts/copy_tree.sh "$LATEST_DIR"
cd "$LATEST_DIR"
echo "== the newest releases in $LATEST_DIR/.venv (pip's cap lifted; torch may take a few GB)"
rm -f .venv/.ckpt_offload_requirements.sha256  # always ask pip for the newest
PIP_CONSTRAINT=/dev/null PIP_UPGRADE=1 PIP_UPGRADE_STRATEGY=eager CONSTRAINTS= VENV=.venv bash scripts/setup.sh || exit 2

.venv/bin/python - "$ROOT/constraints.txt" > latest-diff.txt <<'PY'
import importlib.metadata as md, re, sys
from packaging.utils import canonicalize_name as c
pinned = {}
for line in open(sys.argv[1]):
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.split("#")[0].strip())
    if m:
        pinned[c(m.group(1))] = m.group(2)
have = {c(d.metadata["Name"]): d.version for d in md.distributions()}
for name in sorted(pinned):
    if name in have and have[name].split("+")[0] != pinned[name].split("+")[0]:
        print(name, pinned[name], have[name])
PY
if [ -s latest-diff.txt ]; then
  echo "== newer than constraints.txt:"; awk '{print "   " $1 " " $2 " -> " $3}' latest-diff.txt
else
  echo "== the newest releases are the ones constraints.txt pins"
fi

rm -f latest-failed.txt
.venv/bin/python -m pytest -q -rfEs -p no:cacheprovider "${@:-tests}" -o console_output_style=classic \
  --junit-xml=latest.xml > latest-pytest.log 2>&1
rc=$?
tail -n 3 latest-pytest.log
if [ $rc -ne 0 ]; then
  grep -E '^(FAILED|ERROR) ' latest-pytest.log | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u > latest-failed.txt
  echo "== $(wc -l < latest-failed.txt) tests failed on the newest releases; which release breaks which:"
  base=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  explained=()
  while read -r name old new; do
    case "$name" in torch|nvidia-*|cuda-*|triton) continue ;; esac  # torch needs a build of its own
    ov="$LATEST_DIR/overlay-$name"
    rm -rf "$ov"; "$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv "$ov"
    echo "$base" > "$("$ov/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_pinned.pth"
    PIP_CONSTRAINT=/dev/null "$ov/bin/python" -m pip install -q --no-deps "$name==$new" > /dev/null 2>&1 || {
      echo "   $name $new: could not be installed alone over the pinned venv"; continue; }
    # The pinned tree's own build: only $name differs from CI's set.
    (cd "$ROOT" && "$ov/bin/python" -m pytest -q -p no:cacheprovider $(cat "$LATEST_DIR/latest-failed.txt") \
      > "$LATEST_DIR/overlay-$name.log" 2>&1)
    broke=$(grep -E '^(FAILED|ERROR) ' "overlay-$name.log" | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u)
    if [ -n "$broke" ]; then
      echo "   $name $old -> $new alone breaks:"; echo "$broke" | sed 's/^/      /'
      explained+=($broke)
    else
      echo "   $name $old -> $new alone: those tests pass"
    fi
  done < latest-diff.txt
  rest=$(grep -vxF -f <(printf '%s\n' "${explained[@]:-}") latest-failed.txt || true)
  if [ -n "$rest" ]; then
    echo "   not explained by one release alone (torch, or a combination):"; echo "$rest" | sed 's/^/      /'
  fi
  echo "== keep constraints.txt as it is; the log is $LATEST_DIR/latest-pytest.log"
else
  echo "== the suite passes on the newest releases"
  if [ $freeze -eq 1 ]; then
    echo "== pins for constraints.txt:"
    .venv/bin/python -m pip freeze --all 2>/dev/null | grep -v -i -E '^(ckpt.offload|-e )'
  fi
fi
exit $rc
