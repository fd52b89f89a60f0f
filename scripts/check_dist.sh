#!/usr/bin/env bash
# The release as a user gets it: in a plain environment (a new venv with torch, setuptools, build and
# pip from the development venv and nothing else: what docs/install.md lists) builds the sdist, checks
# it carries every header of csrc/, builds a wheel from that sdist (host-only, so it stays short), installs
# the wheel outside the source tree (pip --target), and from another folder imports it, checks its
# metadata and build record, and runs a two-layer offloaded step on the CPU test path. Uses ccache when
# it is there.
#
# Environment: VENV (.venv, set up by scripts/setup.sh when missing), KEEP=1 keeps the work folder.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PY="$VENV/bin/python"
[ -x "$PY" ] || VENV="$VENV" bash scripts/setup.sh  # alone in a fresh clone: the venv first
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ckpt_offload-dist.XXXXXX")
[ "${KEEP:-0}" = 1 ] && echo "== work folder: $WORK (kept)" || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/dist" "$WORK/tmp" "$WORK/site" "$WORK/run"

echo "== a plain environment: torch, setuptools, build, pip"
# A new venv whose site-packages links to those distributions of $VENV and to what they require,
# nothing more: no wheel, pybind11 or ninja package, none of the extras. No download.
"$PY" -m venv --without-pip "$WORK/plain"
PLAIN="$WORK/plain/bin/python"
"$PY" - "$("$PLAIN" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'PY'
import importlib.metadata as md
import os
import re
import sys

from packaging.requirements import Requirement

dest, linked, todo = sys.argv[1], set(), ["torch", "setuptools", "build", "pip", "packaging"]
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in linked:
        continue
    linked.add(name)
    dist = md.distribution(name)
    for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
        src, dst = str(dist.locate_file(top)), os.path.join(dest, top)
        if os.path.exists(src) and not os.path.lexists(dst):
            os.symlink(src, dst)
    todo += [r.name for r in map(Requirement, dist.requires or []) if not r.marker or r.marker.evaluate({"extra": ""})]
print(f"{len(linked)} distributions: {', '.join(sorted(linked))}")
PY
! "$PLAIN" -c 'import wheel' 2>/dev/null && ! "$PLAIN" -c 'import pybind11' 2>/dev/null || {
  echo "the plain environment has wheel or pybind11" >&2; exit 1; }

echo "== sdist, as docs/install.md builds it"
"$PLAIN" -m build --sdist --no-isolation --outdir "$WORK/dist" . > "$WORK/sdist.log" 2>&1 || { tail -n 30 "$WORK/sdist.log"; exit 1; }
sdist=$(ls "$WORK"/dist/ckpt_offload-*.tar.gz)
echo "$(basename "$sdist")"
# Every header the build needs travels (a missing one is the first thing an sdist build trips on).
tar -tzf "$sdist" | sed 's|^[^/]*/||' | sort > "$WORK/sdist.files"
missing=$(find csrc -name '*.h' | sort | comm -23 - "$WORK/sdist.files")
[ -z "$missing" ] || { echo "the sdist lacks: $missing" >&2; exit 1; }
for f in LICENSE README.md CHANGELOG.md CMakeLists.txt pyproject.toml setup.py ckpt_offload/_toolkit.py \
         ckpt_offload/_floor.py ckpt_offload/_version.py; do
  grep -qx "$f" "$WORK/sdist.files" || { echo "the sdist lacks $f" >&2; exit 1; }
done
! grep -qE '(_build_info\.py|\.so)$' "$WORK/sdist.files" || { echo "the sdist carries a build output" >&2; exit 1; }

echo "== wheel from the sdist (host-only)"
if [ -d /usr/lib/ccache ]; then
  # pip unpacks the sdist into a new folder under TMPDIR each time: paths relative to it, and no
  # hash of that folder (Python's flags have -g), let the next run hit the cache.
  export PATH="/usr/lib/ccache:$PATH" CCACHE_BASEDIR="$WORK/tmp" CCACHE_NOHASHDIR=1
fi
start=$SECONDS
TMPDIR="$WORK/tmp" CKPT_OFFLOAD_WITH_CUDA=0 MAX_JOBS=${MAX_JOBS:-$(nproc)} nice "$PLAIN" -m pip wheel \
  --no-build-isolation --no-deps --no-index -w "$WORK/dist" "$sdist" > "$WORK/wheel.log" 2>&1 || {
  tail -n 40 "$WORK/wheel.log"; exit 1; }
wheel=$(ls "$WORK"/dist/ckpt_offload-*.whl)
echo "$(basename "$wheel") ($((SECONDS - start)) s)"

echo "== installed outside the tree, used from another folder"
"$PLAIN" -m pip install -q --no-deps --no-index --target "$WORK/site" "$wheel"
cd "$WORK/run"
PYTHONPATH="$WORK/site" CKPT_OFFLOAD_TEST_CPU=1 "$PY" - "$ROOT" "$WORK/site" <<'PY'
import importlib.metadata
import os
import sys

import torch

import ckpt_offload

root, site = (os.path.realpath(p) for p in sys.argv[1:3])
here = os.path.realpath(ckpt_offload.__file__)
assert here.startswith(site + os.sep), f"imported {here}, not the installed wheel under {site}"
assert not here.startswith(root + os.sep), f"imported the checkout's copy: {here}"
# Every module of the package from the wheel (an editable install's finder would fill gaps from a checkout).
others = {n: m.__file__ for n, m in sys.modules.items() if n.split(".")[0] == "ckpt_offload"
          and not os.path.realpath(m.__file__).startswith(site + os.sep)}
assert not others and os.path.realpath(ckpt_offload._C.__file__).startswith(site + os.sep), others

info = ckpt_offload.build_info()
assert info["torch_version"] == torch.__version__ and not info["with_cuda"], info
from ckpt_offload import _build_info  # the record the wheel carries, written by its build

assert _build_info.TORCH_VERSION == torch.__version__ and _build_info.WITH_CUDA is False

meta = importlib.metadata.distribution("ckpt_offload")
assert os.path.realpath(str(meta.locate_file(""))) == site, meta.locate_file("")
assert meta.version == ckpt_offload.__version__, (meta.version, ckpt_offload.__version__)
assert meta.metadata["License-Expression"] == "Apache-2.0", meta.metadata["License-Expression"]
required = sorted(r.split(">")[0].split("=")[0].strip() for r in meta.requires if "extra ==" not in r)
assert required == ["packaging", "torch"], meta.requires
assert any(e.name == "ckpt-offload" and e.value == "ckpt_offload.__main__:main" for e in meta.entry_points)

# Two layers, the first offloaded, against the same layers without ckpt_offload.
torch.manual_seed(0)
layers = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(2)]
plain = torch.nn.Sequential(*layers)
offloaded = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(2)])
offloaded.load_state_dict(plain.state_dict())
x = torch.randn(8, 32)
plain(x).sum().backward()
ckpt_offload.reset_stats()
assert ckpt_offload.enable_checkpointing(offloaded, offload=True) == [0, 1]
offloaded(x).sum().backward()
s = ckpt_offload.stats()
assert s["tensors_offloaded"] == 1 and s["bytes_offloaded"] == x.numel() * x.element_size(), s
assert s["tensors_fetched"] == 1 and s["host_in_use_bytes"] == 0, s
for a, b in zip(plain.parameters(), offloaded.parameters()):
    assert torch.equal(a.grad, b.grad)
print(f"ok: ckpt_offload {ckpt_offload.__version__} from {here}: {s['tensors_offloaded']} tensor offloaded, "
      f"gradients equal; built for torch {info['torch_version']}, host-only")
PY
# The console script the wheel installs, and the report's JSON.
PYTHONPATH="$WORK/site" "$WORK/site/bin/ckpt-offload" env --json | "$PY" -c '
import json, sys
r = json.load(sys.stdin)
assert r["build"]["loaded"] and r["build"]["matches_torch"] and not r["build"]["source_checkout"], r["build"]
print("ok: ckpt-offload env --json")'
