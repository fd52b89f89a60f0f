#!/usr/bin/env python
"""Puts each defect of docs/how-it-works.md's table back, one at a time, in a copy of the tree, and
runs the tests that hold its row: every one of those runs must fail, and the same tests must pass
on the unmutated copy. A test that still passes with its defect back holds nothing.

A mutation is a small patch of the engine (Python, or C++ that is then rebuilt host-only:
CKPT_OFFLOAD_WITH_CUDA=0). Its anchor text must occur exactly once in its file, or the run stops
with the file and the anchor: the patches cannot rot silently as the code moves.

On a machine without a GPU the C++ protocol runs on the simulated asynchronous runtime
(csrc/runtime_sim.cpp), whose copies are really in flight and which raises on every copy the
protocol leaves unordered; the mutations patch the engine code it shares with the CUDA runtime. A
mutation marked gpu (the stream the engine orders after) changes only what a CUDA stream would
see: it is listed, and run only where a GPU is present.

  python scripts/mutations.py --list            one line per mutation: "row N: what -> test ids"
  python scripts/mutations.py                   every mutation (the C++ ones rebuild their copy)
  python scripts/mutations.py --python-only     those that need no rebuild
  python scripts/mutations.py --row 43          the mutations of one row

The copies live under build/mutations/ (--dest): "py" takes the tree's built extension, "cpp" has its
own host-only build, kept between runs so that each C++ mutation recompiles one file. Exit status
0 when every mutation run made each of its tests fail and the unmutated tests passed; 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Mutation:
    row: int
    name: str
    what: str  # the defect put back
    path: str  # the file patched, from the tree's root
    old: str  # the anchor: must occur exactly once
    new: str
    tests: tuple  # pytest node ids, each of which must fail
    env: dict = dataclasses.field(default_factory=dict)  # extra environment of the test run
    gpu: bool = False  # shown only where a GPU is present

    @property
    def cpp(self) -> bool:
        return self.path.startswith("csrc/")


SIM = {"CKPT_OFFLOAD_TEST_CPU": "1", "CKPT_OFFLOAD_TEST_ASYNC": "1", "CKPT_OFFLOAD_TEST_SEED": "1"}

MUTATIONS = [
    # --- C++: the engine's orderings and lifetimes, shown on the simulated runtime ------------------
    Mutation(
        1, "source_wait", "a source handed back to the allocator without ordering its producer after its copy",
        "csrc/copy_engine.cpp",
        "      if (!broken(Break::kSourceWait)) rt_->wait(p.stream, p.done);\n",
        "",
        ("tests/test_pitfalls.py::test_row1_sources_go_back_to_the_allocator_ordered_after_their_copies",
         "tests/test_async_sim.py::test_each_rule_is_load_bearing"),
    ),
    Mutation(
        2, "reload_wait", "a reload queued without waiting for its own offload's event",
        "csrc/copy_engine.cpp",
        "  if (!broken(Break::kReloadWait)) rt_->wait(h2d, h.d2h_done_);\n",
        "",
        ("tests/test_pitfalls.py::test_row44_every_reload_waits_for_its_own_layers_offload",
         "tests/test_async_sim.py::test_each_rule_is_load_bearing"),
    ),
    Mutation(
        15, "last_use", "a host block reused by a new copy before the last copy that reads it completed",
        "csrc/copy_engine.cpp",
        "    if (block->pending() && !broken(Break::kLastUse)) rt_->wait(d2h, block->pending());\n",
        "",
        ("tests/test_async_sim.py::test_each_rule_is_load_bearing",),
    ),
    Mutation(
        44, "handler_early", "the offload's event recorded before its copy is queued (the handler advanced early: "
        "a reload orders itself after the previous copies, not its own)",
        "csrc/copy_engine.cpp",
        "    rt_->copy(d2h, block->data(), src.data_ptr(), h->nbytes_, h->id_);\n"
        "    EventPtr done = rt_->record(d2h, /*timing=*/timed);\n",
        "    EventPtr done = rt_->record(d2h, /*timing=*/timed);\n"
        "    rt_->copy(d2h, block->data(), src.data_ptr(), h->nbytes_, h->id_);\n",
        ("tests/test_pitfalls.py::test_row44_every_reload_waits_for_its_own_layers_offload",),
    ),
    Mutation(
        43, "dedup_layout", "a view sharing its storage's single copy rebuilt with the base's layout",
        "csrc/session_core.cpp",
        "          g_shared_views.fetch_add(1);\n          attach(p, rec, t, true);\n          move(rec, p.seq, p.group);\n",
        "          g_shared_views.fetch_add(1);\n          attach(p, rec, t, false);\n          move(rec, p.seq, p.group);\n",
        ("tests/test_pitfalls.py::test_row43_views_sharing_a_copy_come_back_in_their_own_layout",
         "tests/test_pitfalls.py::test_row43_checkpoint_inputs_that_are_views_of_one_storage"),
    ),
    Mutation(
        21, "address_identity", "a handle that does not hold its storage (weakly): the storage's address, its key, "
        "can be another storage's while a record of the old one can still match",
        "csrc/copy_engine.cpp",
        "  if (tensor.has_storage()) h->storage_.emplace(tensor.storage().getWeakStorageImpl());\n",
        "",
        ("tests/test_host_overhead.py::test_an_offloaded_storage_keeps_its_key_while_the_handle_lives",),
    ),
    Mutation(
        3, "cached_stream", "the compute stream looked up once and kept (stale under a user or FSDP2 stream)",
        "csrc/copy_engine.cpp",
        "  const c10::Stream compute = rt_->current_stream();\n  rt_->check_usable(compute, \"offload\");\n",
        "  static const c10::Stream compute = rt_->current_stream();\n  rt_->check_usable(compute, \"offload\");\n",
        ("tests/test_reliability.py::test_user_stream",),
        gpu=True,
    ),
    Mutation(
        12, "producer_stream", "a saved tensor's copy ordered after today's current stream, not the stream that "
        "produced it (inside a side-stream context: after nothing)",
        "csrc/session_core.cpp",
        "        on_producer.emplace(*p.stream);  // order the copy after the producer, not today's stream\n",
        "",
        ("tests/test_reliability.py::test_user_stream", "tests/test_checkpoint.py::test_gpu_forward_under_user_stream"),
        gpu=True,
    ),
    Mutation(
        25, "pack_order", "the reload order assumed to be the reverse of pack order: a copy shared by a later "
        "pack stays where it was first packed, so it is prefetched after the layers backward needs it in",
        "csrc/session_core.cpp",
        "          move(rec, p.seq, p.group);\n          return;\n",
        "          return;\n",
        ("tests/test_checkpoint.py::test_prefetch_counts_layers_and_a_shared_input_comes_back_with_its_last_user",),
    ),
    # --- Python ------------------------------------------------------------------------------------
    Mutation(
        46, "keep_alive", "a keep-alive list of every checkpoint's inputs (torchtitan #3513)",
        "ckpt_offload/checkpointing.py",
        "    return _run_hooked(session, function, args, kwargs, keep)\n",
        "    globals().setdefault(\"_KEEP_ALIVE\", []).extend(args)\n"
        "    return _run_hooked(session, function, args, kwargs, keep)\n",
        ("tests/test_pitfalls.py::test_row46_two_hundred_steps_stay_flat",),
    ),
    Mutation(
        46, "clear_at_exit", "a leak fix that releases the context's records at its exit (trl #5700): a backward "
        "run after the context finds their copies gone",
        "ckpt_offload/activations.py",
        "            self.session.end()\n        return False\n",
        "            self.session.end()\n"
        "            from . import engine as _engine\n"
        "            for rec in self.session._core.live_records():\n"
        "                for eng in _engine._C.all_engines():\n"
        "                    try:\n"
        "                        eng.release(rec.handle)\n"
        "                    except ValueError:  # another engine's handle\n"
        "                        pass\n"
        "        return False\n",
        ("tests/test_pitfalls.py::test_row46_two_hundred_steps_stay_flat[backward_after_the_context_exits]",),
    ),
    Mutation(
        45, "rng_flag", "the recompute runs without the forward's RNG state (the flag lost on the way to torch)",
        "ckpt_offload/checkpointing.py",
        "    try:\n        return _tuc.checkpoint(function, *args, use_reentrant=False, **kwargs)\n",
        "    try:\n        return _tuc.checkpoint(function, *args, use_reentrant=False,"
        " **{**kwargs, \"preserve_rng_state\": False})\n",
        ("tests/test_pitfalls.py::test_row45_recompute_draws_the_forwards_dropout_mask",),
    ),
    Mutation(
        45, "flag_slot", "a tensor in a checkpoint flag's slot read for its truth",
        "ckpt_offload/checkpointing.py",
        "        if name in kwargs and not isinstance(kwargs[name], bool):\n",
        "        if False:\n",
        ("tests/test_pitfalls.py::test_row45_an_activation_in_a_flag_slot_is_refused",),
    ),
    Mutation(
        49, "capture", "graph capture not detected: the forward with offload is captured",
        "ckpt_offload/session.py",
        "    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():\n",
        "    if False:\n",
        ("tests/test_pitfalls.py::test_row49_capture_is_refused_with_one_clear_error",),
    ),
    Mutation(
        5, "weights_offloaded", "the model's parameters and buffers not excluded: weights passed to a block offloaded",
        "ckpt_offload/session.py",
        "                    if ref is not None:\n                        refs[ref.cdata] = ref\n",
        "                    if False:\n                        refs[ref.cdata] = ref\n",
        ("tests/test_reliability.py::test_weights_passed_positionally_to_checkpointed_blocks_are_not_offloaded",),
    ),
]


def patch(text: str, m: Mutation) -> str:
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutations: the anchor of row {m.row} ({m.name}) occurs {n} times in {m.path}, "
                         f"not once; update the mutation:\n{m.old}")
    return text.replace(m.old, m.new)


def check_anchors() -> None:
    for m in MUTATIONS:
        with open(os.path.join(ROOT, m.path), encoding="utf-8") as f:
            patch(f.read(), m)


def copy_tree(dest: str, with_extension: bool) -> None:
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "copy_tree.sh"), dest], check=True)
    if with_extension:
        for f in glob.glob(os.path.join(ROOT, "ckpt_offload", "_C*.so")) + [
                os.path.join(ROOT, "ckpt_offload", "_build_info.py")]:
            shutil.copy2(f, os.path.join(dest, "ckpt_offload"))


def write(path: str, text: str) -> None:
    # Written afresh (a new mtime), so that the incremental build sees the change and its undoing.
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def build(tree: str, log) -> None:
    env = dict(os.environ, CKPT_OFFLOAD_WITH_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"mutations: the build in {tree} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    log(f"  built in {time.monotonic() - t0:.0f} s")


def run_tests(tree: str, tests, env_extra) -> tuple:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_OFFLOAD_TEST")}
    env.update(env_extra)
    env["PYTHONPATH"] = tree
    out = {}
    for t in tests:
        p = subprocess.run([sys.executable, "-m", "pytest", t, "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu or gpu"],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
        tail = [ln for ln in p.stdout.splitlines() if ln.strip()][-1:] or [p.stderr.strip()[-200:]]
        errors = [ln[1:].strip() for ln in p.stdout.splitlines() if ln.startswith("E ")]
        # A test that runs a child process shows the child's traceback: its hazard or last error is the reason.
        first = next((e for e in errors if "hazard (async-sim)" in e), None) or next(
            (e for e in errors if not e.startswith(("Traceback", "File ", "^", "~"))), "")
        out[t] = (p.returncode, tail[0] + (f"\n      first error: {first[:300]}" if p.returncode and first else ""))
    return out


def has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print one line per mutation and exit")
    ap.add_argument("--row", type=int, action="append", help="run the mutations of this row (repeatable)")
    ap.add_argument("--python-only", action="store_true", help="only the mutations that need no rebuild")
    ap.add_argument("--dest", default=os.path.join(ROOT, "build", "mutations"), help="where the copies live")
    args = ap.parse_args(argv)
    check_anchors()
    if args.list:
        for m in MUTATIONS:
            kind = "C++, rebuilt" if m.cpp else "Python"
            gpu = "; GPU only" if m.gpu else ""
            print(f"row {m.row}: {m.what} [{m.name}, {kind}{gpu}] -> {', '.join(m.tests)}")
        return 0
    chosen = [m for m in MUTATIONS if (not args.row or m.row in args.row) and not (args.python_only and m.cpp)]
    if args.row and not chosen:
        raise SystemExit(f"mutations: no mutation for row(s) {args.row}; --list shows them")
    gpu = has_gpu()
    log = lambda s: print(s, flush=True)  # noqa: E731
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout
    log(f"== scripts/mutations.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip()
        + f"  (tree {head.strip() or '?'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, GPU: {gpu})")
    failures = []

    py_tree = os.path.join(args.dest, "py")
    copy_tree(py_tree, with_extension=True)
    baseline = sorted({(t, tuple(sorted(m.env.items()))) for m in chosen if not m.gpu or gpu for t in m.tests})
    log(f"== unmutated tree: {len(baseline)} test runs")
    for t, env in baseline:
        rc, tail = run_tests(py_tree, [t], dict(env))[t]
        log(f"  {'pass' if rc == 0 else 'FAIL'}  {t}: {tail}")
        if rc != 0:
            failures.append(f"unmutated: {t} fails ({tail})")

    cpp_tree = os.path.join(args.dest, "cpp")
    # Present while the copy's build matches its unmutated sources: copy_tree.sh gives restored files
    # their old times, which an object built from a mutated source would look newer than.
    clean = os.path.join(args.dest, "cpp.clean")
    cpp_built = False
    for m in chosen:
        log(f"== row {m.row}: {m.what} [{m.name}]")
        if m.gpu and not gpu:
            log("  not run: it changes only what a CUDA stream sees, and no GPU is present")
            continue
        tree = cpp_tree if m.cpp else py_tree
        if m.cpp and not cpp_built:
            copy_tree(cpp_tree, with_extension=False)
            if not os.path.exists(clean):  # a first run, or one stopped before its copy was rebuilt unmutated
                for f in glob.glob(os.path.join(cpp_tree, "csrc", "*")):
                    os.utime(f)  # newer than every object: all rebuilt
            else:
                os.remove(clean)
            cpp_built = True
        target = os.path.join(tree, m.path)
        with open(target, encoding="utf-8") as f:
            original = f.read()
        write(target, patch(original, m))
        try:
            if m.cpp:
                build(tree, log)
            results = run_tests(tree, m.tests, m.env)
        finally:
            write(target, original)
        for t, (rc, tail) in results.items():
            failed = rc == 1  # tests ran and failed (2-5: interrupted, a usage or collection error, none run)
            log(f"  {'fails, as it must' if failed else 'PASSES WITH THE DEFECT BACK'}  {t}: {tail}")
            if not failed:
                failures.append(f"row {m.row} [{m.name}]: {t} passes with the defect back ({tail})")
    if cpp_built:
        build(cpp_tree, log)  # the copy's extension back to the unmutated sources
        open(clean, "w").close()
    log("== " + ("every mutation made its tests fail" if not failures else f"{len(failures)} problem(s):"))
    for f in failures:
        log(f"  {f}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
