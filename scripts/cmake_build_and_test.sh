#!/usr/bin/env bash
# Configure, build and test the CMake build of ckpt_offload: the host-pool C++ unit tests and an
# import check of the module, all through ctest. Exits non-zero when any step fails.
#
# Usage: scripts/cmake_build_and_test.sh [BUILD_DIR] [extra cmake arguments...]
#   BUILD_DIR  default build-cmake; a relative path is taken from the repository root.
#   e.g.       scripts/cmake_build_and_test.sh build-host -DCKPT_OFFLOAD_WITH_CUDA=OFF
# Environment:
#   PYTHON     the interpreter whose torch is built against (default: .venv/bin/python of the repo)
#   JOBS       parallel compile jobs (default: the number of CPUs)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-build-cmake}
[[ $# -gt 0 ]] && shift
[[ $build = /* ]] || build=$root/$build
python=${PYTHON:-$root/.venv/bin/python}
# CMake runs from the build dir: a relative interpreter path would not resolve there.
[[ $python == */* && $python != /* ]] && python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}

if ! "$python" -c "import torch, pybind11" 2>/dev/null; then
  echo "cmake_build_and_test: $python cannot import torch and pybind11 (set PYTHON)" >&2
  exit 2
fi

generator=()
# The generator of an existing build dir cannot change; pick one only for a fresh dir.
if [[ ! -f $build/CMakeCache.txt ]]; then
  if command -v ninja >/dev/null; then
    generator=(-G Ninja)
  elif [[ -x $(dirname "$python")/ninja ]]; then
    generator=(-G Ninja "-DCMAKE_MAKE_PROGRAM=$(dirname "$python")/ninja")
  fi
fi

start=$SECONDS
echo "== configure ($build)"
cmake -S "$root" -B "$build" "${generator[@]}" "-DPython_EXECUTABLE=$python" "$@"
echo "== build (-j $jobs)"
cmake --build "$build" --parallel "$jobs"
echo "== build took $((SECONDS - start)) s; test"
cd "$build"
ctest --output-on-failure --no-tests=error
