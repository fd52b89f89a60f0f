#!/usr/bin/env bash
# The extension built with AddressSanitizer and UndefinedBehaviorSanitizer (the CMake build with
# CKPT_OFFLOAD_SANITIZE=ON, -O1 -g, into a folder of its own: the in-place build is untouched), its
# C++ unit tests under ctest, then the engine, session, pool, disk, timeline, checkpoint and
# reliability tests against it, on the CPU test path with the simulated asynchronous runtime (one
# seed; copies in flight on worker threads), in one pytest run; RUNTIMES="sync async" adds a run on
# the synchronous CPU runtime first. Any sanitizer report fails the run, and every report is printed
# at the end.
#
# Usage: scripts/test_sanitized.sh [BUILD_DIR] [extra cmake arguments...]
#   BUILD_DIR  default build-sanitize; a relative path is taken from the repository root.
#   e.g.       scripts/test_sanitized.sh build-san -DCKPT_OFFLOAD_WITH_CUDA=OFF   (host-only)
# Environment:
#   PYTHON       the interpreter (default: .venv/bin/python of the repo); JOBS: compile jobs
#   SEED         the simulated runtime's seed (default 4: CI's other simulated run uses seed 1)
#   RUNTIMES     which CPU runtimes to run the tests on: "async" (default), "sync", or "sync async"
#   PYTEST_ARGS  extra pytest arguments
#
# The interpreter and torch are not instrumented: the ASan runtime is preloaded (LD_PRELOAD) so that
# it comes first (with libstdc++, whose exceptions it intercepts), and leak detection is off (CPython and torch keep allocations until exit, which
# LeakSanitizer would report; the C++ unit tests, instrumented whole, keep it on).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-build-sanitize}
[[ $# -gt 0 ]] && shift
[[ $build = /* ]] || build=$root/$build
python=${PYTHON:-$root/.venv/bin/python}
[[ $python == */* && $python != /* ]] && python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
seed=${SEED:-4}
runtimes=${RUNTIMES:-async}

# Reports go to files (one per process, children included): pytest's capture would swallow them,
# and a halted process prints nothing else.
logs=$build/sanitizer-logs
rm -rf "$logs"
mkdir -p "$logs"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan"
asan_options="halt_on_error=1:detect_leaks=0:protect_shadow_gap=0:log_path=$logs/asan"

report() {
  local found
  found=$(find "$logs" -type f | wc -l)
  if [[ $found -gt 0 ]]; then
    echo "== test_sanitized: $found sanitizer report file(s):" >&2
    for f in "$logs"/*; do
      echo "---- $f" >&2
      cat "$f" >&2
    done
    return 1
  fi
  echo "== test_sanitized: no sanitizer reports"
}

start=$SECONDS
# The C++ unit tests are instrumented whole: leaks are looked for there.
ASAN_OPTIONS="halt_on_error=1:log_path=$logs/asan" \
  PYTHON="$python" bash "$root/scripts/cmake_build_and_test.sh" "$build" -DCKPT_OFFLOAD_SANITIZE=ON "$@" || {
  report || true
  exit 1
}
report
# The ASan runtime, then libstdc++ (see CMakeLists.txt's CKPT_OFFLOAD_SANITIZER_PRELOAD).
preload=$(sed -n 's/^CKPT_OFFLOAD_SANITIZER_PRELOAD:INTERNAL=//p' "$build/CMakeCache.txt")
[[ -f ${preload%%:*} ]] || { echo "test_sanitized: no ASan runtime found ('$preload')" >&2; exit 1; }
echo "== build and ctest took $((SECONDS - start)) s"

# From the build folder: `python -m pytest` puts the working directory first on sys.path, so the
# instrumented package there is the one imported (PYTHONPATH gives it to child processes too).
cd "$build"
run() {
  env LD_PRELOAD="$preload" ASAN_OPTIONS="$asan_options" PYTHONPATH="$build" CKPT_OFFLOAD_TEST_CPU=1 "$@"
}
run "$python" -c '
import os, sys, ckpt_offload
here = os.path.realpath(ckpt_offload.__file__)
if not here.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    sys.exit(f"test_sanitized: ckpt_offload was imported from {here}, not from the sanitized build")
print("== sanitized build:", ckpt_offload.build_info())
' "$build"

t=$root/tests
files=("$t/test_engine.py" "$t/test_session_scope.py" "$t/test_pool.py" "$t/test_pool_shapes.py" "$t/test_disk.py"
       "$t/test_disk_safety.py" "$t/test_timeline.py" "$t/test_checkpoint.py" "$t/test_reliability.py")
status=0
for rt in $runtimes; do
  step=$SECONDS
  case $rt in
    sync) echo "== sanitized, CPU test path, synchronous runtime"; async=0 ;;
    async) echo "== sanitized, CPU test path, simulated asynchronous runtime, seed $seed"; async=1 ;;
    *) echo "test_sanitized: RUNTIMES takes sync and async, got '$rt'" >&2; exit 2 ;;
  esac
  CKPT_OFFLOAD_TEST_ASYNC=$async CKPT_OFFLOAD_TEST_SEED=$seed \
    run "$python" -m pytest --rootdir "$root" -q -p no:cacheprovider ${PYTEST_ARGS:-} "${files[@]}" || status=1
  echo "== took $((SECONDS - step)) s"
done
echo "== in all $((SECONDS - start)) s"
report || status=1
exit $status
