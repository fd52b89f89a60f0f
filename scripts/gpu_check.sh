#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, torch preinstalled and no network, builds the
# extension, runs the GPU tests (once more under torch's CUDA stream sanitizer) and both benchmarks,
# and prints a summary table last. Every stage runs under `timeout`; the stage limits add up to
# TOTAL_S (default 555 s, about 9 minutes), 75 s of them for the sanitized tests, 60 s
# for the step benchmark with every block compiled, 50 s for the --budget run, 13 s for the disk tier's
# step, 25 s for the host-overhead run.
#
# Usage: scripts/gpu_check.sh OUTDIR
# Environment: PYTHON (python3), LAYERS (8, at least 8 for the standard run), SEQS (4096,8192),
#              TOTAL_S (555), MAX_JOBS (nproc).
set -u

if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_check.sh OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
PY=${PYTHON:-python3}
LAYERS=${LAYERS:-8}
SEQS=${SEQS:-4096,8192}
TOTAL_S=${TOTAL_S:-555}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# Scripts run as `python benchmarks/x.py` see benchmarks/ first on sys.path; the repository root
# makes an in-place build importable even where the editable install failed.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
START=$SECONDS
STAGES="$OUT/stages.tsv"
printf 'stage\trc\telapsed_s\tlimit_s\n' > "$STAGES"

# stage NAME LIMIT_S CMD...: runs CMD under timeout (clipped to what is left of TOTAL_S), output to
# OUTDIR/NAME.log, and records the exit code; 124 means the stage ran out of time.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((TOTAL_S - (SECONDS - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "== $name: skipped, no time left"
    printf '%s\tskipped\t0\t0\n' "$name" >> "$STAGES"
    return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  # bash -c: timeout runs programs, and some stages are the functions exported below.
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$((SECONDS - t0))
  echo "   $name: rc=$rc, ${dt}s$([ $rc -eq 124 ] && echo ' (timed out)'); log: $OUT/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$limit" >> "$STAGES"
  return 0
}

build() {
  # No network on the GPU machine: no index, no build isolation (setuptools and torch are already
  # installed), no dependency resolution, no self-version check.
  "$PY" -m pip install --no-index --no-build-isolation --no-deps --disable-pip-version-check -e . || {
    echo "editable install failed; building in place instead"
    "$PY" setup.py build_ext --inplace
  }
  cd /tmp && "$PY" -c "import ckpt_offload, json; i = ckpt_offload.build_info(); print(json.dumps(i)); \
assert i['with_cuda'] and i['cuda_usable'], 'the extension cannot use the GPU'"
}

# Only the files that hold GPU tests (marker `gpu`, or the cuda param of DEVICES): today not
# test_hf.py or test_property.py, whose collection imports transformers / hypothesis (seconds of the
# budget, and an import error there would stop every test from running).
GPU_TEST_FILES=$(grep -lE 'mark\.gpu|DEVICES' tests/test_*.py | tr '\n' ' ')

gpu_tests() {
  if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "pytest is not installed: GPU tests not run"
    return 4
  fi
  local txt="$OUT/tests_gpu.pytest.txt" rc
  if [ -z "$GPU_TEST_FILES" ]; then
    echo "no test file marks GPU tests: GPU tests not run"
    return 4
  fi
  echo "GPU test files: $GPU_TEST_FILES"
  # shellcheck disable=SC2086
  "$PY" -m pytest $GPU_TEST_FILES -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    -rfEs --durations=15 --junitxml="$OUT/tests_gpu.xml" 2>&1 | tee "$txt"
  rc=${PIPESTATUS[0]}
  # Every GPU test skipped (the extension or torch cannot use the GPU) must not read as a pass.
  if [ "$rc" -eq 0 ] && ! grep -qE '[0-9]+ passed' "$txt"; then
    echo "no GPU test passed: all were skipped (see the reasons above)"
    rc=5
  fi
  return "$rc"
}

# The GPU tests once more under PyTorch's CUDA stream sanitizer (CSAN, TORCH_CUDA_SANITIZER=1, read
# when torch is imported): an operator that touches a tensor another stream used without an
# ordering torch can see raises CUDASanitizerErrors and prints "CSAN detected a possible data race".
# Any report fails the stage, also one a test caught (pytest's capture tees every line into the log).
# CSAN follows the operators torch dispatches and the events and streams it records; the engine's
# own cudaMemcpyAsync copies and CUDA events are not among them, so what it checks is the torch side
# around the engine: where the reloaded and saved tensors meet the compute stream.
gpu_tests_sanitized() {
  if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "pytest is not installed: sanitized GPU tests not run"
    return 4
  fi
  if [ -z "$GPU_TEST_FILES" ]; then
    echo "no test file marks GPU tests: sanitized GPU tests not run"
    return 4
  fi
  # The switch must really turn the sanitizer on in this torch: otherwise a clean run means nothing.
  if ! TORCH_CUDA_SANITIZER=1 "$PY" -c "import torch.cuda._sanitizer as csan, sys; sys.exit(0 if csan.cuda_sanitizer.enabled else 1)"; then
    echo "TORCH_CUDA_SANITIZER=1 does not enable torch's CUDA sanitizer here: sanitized GPU tests not run"
    return 4
  fi
  local txt="$OUT/tests_gpu_sanitized.pytest.txt" rc reports
  # shellcheck disable=SC2086
  TORCH_CUDA_SANITIZER=1 "$PY" -m pytest $GPU_TEST_FILES -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    --capture=tee-sys -rfEs --junitxml="$OUT/tests_gpu_sanitized.xml" 2>&1 | tee "$txt"
  rc=${PIPESTATUS[0]}
  reports=$(grep -cE "CSAN detected a possible data race|CUDASanitizerErrors" "$txt")
  if [ "$reports" -gt 0 ]; then
    echo "CUDA sanitizer: $reports report line(s) (CSAN detected / CUDASanitizerErrors) in $txt"
    [ "$rc" -eq 0 ] && rc=6
  fi
  if [ "$rc" -eq 0 ] && ! grep -qE '[0-9]+ passed' "$txt"; then
    echo "no GPU test passed under the sanitizer: all were skipped (see the reasons above)"
    rc=5
  fi
  return "$rc"
}

# bench_step.py --budget: plan_memory's configuration beside the uniform ones, for a budget halfway
# between async_offload's and every2's measured peaks at the step stage's first sequence length.
budget_run() {
  local budget
  budget=$("$PY" - "$OUT/step/bench_step.json" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
seq = min(r["seq"] for r in rows)
peak = {r["mode"]: r.get("peak_device_bytes") for r in rows if r["seq"] == seq}
print((peak["async_offload"] + peak["every2"]) // 2)
PYEOF
  ) || { echo "no async_offload and every2 peaks in the step stage's JSON: no budget to plan for"; return 4; }
  echo "budget: $budget bytes (seq ${SEQS%%,*})"
  "$PY" benchmarks/bench_step.py --config standard --layers "$LAYERS" --seqs "${SEQS%%,*}" --steps 3 \
    --modes none,full,every2,every4,async_offload,every2_async,attn_offload --budget "$budget" --no-timeline --out "$OUT/budget"
}

summary() {
  "$PY" - "$OUT" <<'EOF'
import csv, json, os, sys
out = sys.argv[1]

def load(path):
    try:
        with open(os.path.join(out, path)) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        print(f"{path}: not available ({err.__class__.__name__})")
        return None

def gib(n):
    return "n/a" if n is None else f"{n / 2**30:.2f}"

def ratio(x):
    return "n/a" if x is None else f"{x:.3f}"

def table(headers, rows):
    w = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]
    for r in [headers, ["-" * x for x in w]] + rows:
        print("  ".join(str(c).rjust(x) for c, x in zip(r, w)))

print("\n==================== summary ====================")
with open(os.path.join(out, "stages.tsv")) as f:
    table(["stage", "rc", "elapsed s", "limit s"], [list(r.values()) for r in csv.DictReader(f, delimiter="\t")])
step = load("step/bench_step.json")
if step:
    hw = step["hardware"]
    print(f"\n{hw.get('gpu')} | driver/PCIe {hw.get('gpu_driver')} | torch {hw.get('torch')} | CUDA {hw.get('cuda_runtime')}"
          f" | build {hw.get('ckpt_offload_build')}")
    print(f"training step (forward+backward, no optimizer), {step['config']['layers']} layers, "
          f"hidden {step['config']['hidden']}, {step['config']['dtype']}")
    rate = lambda x: "n/a" if x is None else f"{x:.1f}"
    table(["mode", "seq", "ms", "t/full", "peak GiB", "peak/full", "host GiB", "wait ms", "D2H GB/s", "H2D GB/s",
           "allocs"],
          [[r["mode"], r["seq"], f"{r['step_ms_median']:.1f}", ratio(r.get("time_vs_full")), gib(r["peak_device_bytes"]),
            ratio(r.get("peak_vs_full")), gib(r["act_host_bytes"]),
            "n/a" if r["reload_wait_ms_profiled"] is None else f"{r['reload_wait_ms_profiled']:.2f}",
            rate(r.get("d2h_gb_per_s")), rate(r.get("h2d_gb_per_s")),
            r["host_alloc_calls_timed"]] if "step_ms_median" in r else [r["mode"], r["seq"], r.get("error") or r.get("skipped")]
           + [""] * 8 for r in step["rows"]])
    timelines = [r for r in step["rows"] if r.get("timeline_files")]
    if timelines:  # kept in step/ beside bench_step.json
        print("timelines of one step (copy time under compute, exposed wait): " + "; ".join(
            f"{r['mode']}@{r['seq']} {ratio(r.get('timeline_overlap_fraction'))}, "
            f"{'n/a' if r.get('timeline_exposed_wait_ms') is None else format(r['timeline_exposed_wait_ms'], '.2f')} ms"
            f" ({', '.join(r['timeline_files'])})" for r in timelines))
    for seq, lk in (step.get("link") or {}).items():
        if lk:
            print(f"pinned peak @ seq {seq} ({lk['block_bytes'] / 2**20:g} MiB blocks): D2H {lk['d2h_gb_per_s']:.1f} GB/s, "
                  f"H2D {lk['h2d_gb_per_s']:.1f} GB/s")
    for s in step.get("savings", []):
        print(f"saving {s['mode']} vs {s['vs']} @ {s['seq']}: theoretical {gib(s['theoretical_bytes'])} GiB, "
              f"measured {gib(s['measured_bytes'])} GiB"
              + (f" ({100 * s['fraction']:.0f}%)" if s.get("fraction") is not None else ""))
        if "recompute_avoided_flop" in s:
            print(f"  attention outputs on the host {gib(s['attn_host_bytes'])} GiB, attention recompute avoided "
                  f"{s['recompute_avoided_flop'] / 1e12:.2f} TFLOP per step")
    if step.get("targets"):
        print("targets:")
        verdict = lambda t: "met" if t["met"] else ("MISSED" if t["met"] is False else "n/a")
        table(["target", "seq", "value", "threshold", "verdict", "figures"],
              [[t["target"], t["seq"] or "all", "n/a" if t["value"] is None else f"{t['value']:.3f}",
                f"{t['threshold']:.3g}", verdict(t), t["note"]] for t in step["targets"]])
    if step.get("lengths"):
        ls = next((r["lengths"] for r in step["lengths"] if "lengths" in r), [])
        print(f"\nvarying lengths {ls} (target: no host allocation or free after the longest step)")
        table(["mode", "allocs per step", "after longest", "frees after longest", "ms min/med/max"],
              [[r["mode"], ",".join(map(str, r["host_alloc_calls_per_step"])), r["allocs_after_longest"],
                r["frees_after_longest"], f"{r['step_ms_min']:.1f}/{r['step_ms_median']:.1f}/{r['step_ms_max']:.1f}"]
               if "allocs_after_longest" in r else [r["mode"], r.get("error", "")] + [""] * 3 for r in step["lengths"]])
    # "problems" is written last: without it the script stopped early (time limit or crash).
    print("checks:", ("; ".join(step["problems"]) or "passed") if "problems" in step
          else "INCOMPLETE: the script did not finish (see step.log)")
    if step.get("incomplete"):
        print(f"INCOMPLETE: {len(step['incomplete'])} mode runs skipped: " + "; ".join(step["incomplete"]))
comp = load("step_compile/bench_step.json")
if comp:
    print(f"\ntraining step with every block compiled ({comp['config']['compile']}), {comp['config']['layers']} layers")
    table(["mode", "seq", "ms", "peak GiB", "graphs", "breaks", "recompiled"],
          [[r["mode"], r["seq"], f"{r['step_ms_median']:.1f}", gib(r["peak_device_bytes"]), r.get("compiled_graphs"),
            r.get("graph_breaks"), r.get("graphs_compiled_in_timed_steps")] if "step_ms_median" in r
           else [r["mode"], r["seq"], r.get("error") or r.get("skipped")] + [""] * 4 for r in comp["rows"]])
    print("checks:", ("; ".join(comp["problems"]) or "passed") if "problems" in comp
          else "INCOMPLETE: the script did not finish (see step_compile.log)")
bud = load("budget/bench_step.json")
if bud:
    print("\nplan_memory for a budget between async_offload's peak and every2's (target: planned ms <= fastest fitting uniform)")
    table(["seq", "budget GiB", "plan peak GiB", "predicted GiB", "plan ms", "fastest fitting", "its ms", "verdict", "note"],
          [[e["seq"], gib(e["budget_bytes"]), gib(e["planned_peak_bytes"]), gib(e["predicted_peak_bytes"]),
            "n/a" if e["planned_ms"] is None else f"{e['planned_ms']:.1f}", e["fastest_uniform"] or "n/a",
            "n/a" if e["fastest_uniform_ms"] is None else f"{e['fastest_uniform_ms']:.1f}",
            "met" if e["met"] else ("MISSED" if e["met"] is False else "n/a"), e["note"]] for e in bud.get("budget", [])])
    for e in bud.get("budget", []):
        print(f"plan @ seq {e['seq']}: {e['plan_modes']}")
    print("checks:", ("; ".join(bud["problems"]) or "passed") if "problems" in bud
          else "INCOMPLETE: the script did not finish (see budget.log)")
hf = load("hf/bench_step_hf.json")
if hf:
    print("\ntransformers LlamaForCausalLM")
    table(["mode", "seq", "ms", "t/hf_gc", "peak GiB", "peak/hf_gc"],
          [[r["mode"], r["seq"], f"{r['step_ms_median']:.1f}", ratio(r.get("time_vs_hf_gc")), gib(r["peak_device_bytes"]),
            ratio(r.get("peak_vs_hf_gc"))] if "step_ms_median" in r else [r["mode"], r["seq"], r.get("skipped") or r.get("error"), "", "", ""]
           for r in hf["rows"]])
    print("checks:", ("; ".join(hf["problems"]) or "passed") if "problems" in hf
          else "INCOMPLETE: the script did not finish (see hf.log)")
disk = load("disk/bench_step.json")
if disk:
    rows = [r for r in disk["rows"] if r["mode"] == "disk_offload"]
    if rows:
        r0 = rows[0]
        print(f"\ndisk tier: spill directory on {r0.get('spill_device')} ({r0.get('spill_fstype')}), "
              f"{r0.get('disk_io_mode')}")
    table(["seq", "ms", "t/async", "cap MiB", "spilled MiB/step", "read waits", "GB/s w/r"],
          [[r["seq"], f"{r['step_ms_median']:.1f}", ratio(r.get("time_vs_async_offload")),
            f"{r['pool_cap_bytes'] / 2**20:.1f}", f"{r['bytes_spilled_per_step'] / 2**20:.1f}",
            r["disk_read_waits_timed"], f"{r.get('disk_write_gb_per_s') or 0:.2f}/{r.get('disk_read_gb_per_s') or 0:.2f}"]
           if "step_ms_median" in r else [r["seq"], r.get("skipped") or r.get("error"), "", "", "", "", ""]
           for r in rows])
    print("checks:", ("; ".join(disk["problems"]) or "passed") if "problems" in disk
          else "INCOMPLETE: the script did not finish (see disk.log)")
host = load("host/bench_host.json")
if host:
    print(f"\nhost time per step of tiny models ({host['timing']}), median of {host['config']['rounds']} rounds")
    key = host["judged"]
    table(["group", "mode", "ms", "/ref", "us/layer", "device ms", "host-bound"],
          [[r["group"], r["mode"], f"{r[key]['median']:.2f}", ratio(r.get("ratio")),
            "n/a" if r.get("us_per_layer_above_reference") is None else f"{r['us_per_layer_above_reference']:+.0f}",
            "n/a" if not r.get("device_ms") else f"{r['device_ms']['median']:.2f}",
            {True: "yes", False: "no"}.get(r.get("host_bound"), "n/a")] if key in r else [r["group"], r["mode"], r.get("error")]
           + [""] * 4 for r in host["rows"]])
    print("host targets: " + "; ".join(f"{t['mode']} {ratio(t['value'])} <= {t['threshold']:.2f}: "
                                        + ("met" if t["met"] else ("MISSED" if t["met"] is False else "n/a"))
                                        for t in host["targets"]))
    print("host checks:", "; ".join(host["problems"]) or "passed")
bw = load("bandwidth/bench_bandwidth.json")
if bw and bw.get("gpu_rows"):
    rows = bw["gpu_rows"]
    print("\ncopy bandwidth GB/s (1e9 B/s) by block size; 'both' = D2H + H2D at once")
    sizes = sorted({r["block_bytes"] for r in rows})
    cols = [(m, d) for m in ("engine", "torch_pinned", "pageable") for d in ("d2h", "h2d", "both")]
    get = lambda s, m, d: next((f"{r['gb_per_s']:.1f}" for r in rows if r["block_bytes"] == s and r["method"] == m
                                and r["direction"] == d), "")
    short = {"engine": "engine", "torch_pinned": "pinned", "pageable": "pageable"}
    table(["block MiB"] + [f"{short[m]} {d}" for m, d in cols], [[f"{s / 2**20:g}"] + [get(s, m, d) for m, d in cols] for s in sizes])
if bw:
    print("bandwidth checks:", "; ".join(bw.get("problems") or []) or "passed")
if bw and bw.get("acquire_release"):
    print("pool acquire+release ns/pair (incl. Python binding):",
          ", ".join(f"{r['block_bytes'] // 1024} KiB {r['pair_ns']:.0f}" for r in bw["acquire_release"]))
EOF
}

export PY OUT GPU_TEST_FILES
export -f build gpu_tests gpu_tests_sanitized budget_run summary

echo "ckpt_offload GPU check: output in $OUT, budget ${TOTAL_S}s, layers $LAYERS, seqs $SEQS"
stage env 15 bash -c "nvidia-smi; $PY -c 'import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'; $PY -c 'import transformers; print(\"transformers\", transformers.__version__)'"
stage build 80 build
stage tests_gpu 60 gpu_tests
stage tests_gpu_sanitized 75 gpu_tests_sanitized
stage bandwidth 25 "$PY" benchmarks/bench_bandwidth.py --out "$OUT/bandwidth"
# Every mode of bench_step, attn_offload (inputs and attention outputs offloaded) included, then a
# varying-length pass (lengths 2048..8192 padded to 64, drawn per step): no host allocation after
# the longest step. --estimate: estimate_memory against the measured peaks (none, full, every2).
stage step 112 "$PY" benchmarks/bench_step.py --config standard --layers "$LAYERS" --seqs "$SEQS" --budget-s 80 --estimate \
  --lengths 2048:8192 --length-steps 12 --out "$OUT/step"
# Every mode with each block compiled by inductor (4 layers, one length: compiling is most of it).
stage step_compile 60 "$PY" benchmarks/bench_step.py --compile --config standard --layers 4 --seqs 4096 --steps 3 \
  --budget-s 45 --no-timeline --out "$OUT/step_compile"
stage budget 50 budget_run
# The disk tier under a host cap of half of what async_offload's step offloads, files on this
# machine's disk (the output names its device and filesystem), against async_offload.
mkdir -p "$OUT/spill"
stage disk 13 "$PY" benchmarks/bench_step.py --config standard --layers 4 --seqs 4096 --steps 3 \
  --modes full,async_offload --disk "$OUT/spill" --no-timeline --out "$OUT/disk"
stage hf 30 "$PY" benchmarks/bench_step.py --hf --config standard --layers 4 --seqs 4096 --steps 3 --out "$OUT/hf"
# Host time per step of tiny models, every mode beside what it replaces: host-bound or not, targets.
stage host 25 "$PY" benchmarks/bench_host.py --rounds 11 --out "$OUT/host"
stage summary 10 summary
cat "$OUT/summary.log"
echo "total: $((SECONDS - START))s"
