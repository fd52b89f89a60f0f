"""TRL's activation_offloading=True, as its trainers use it: one training step (forward + backward) of a
Llama built from a config, under the context from get_act_offloading_ctx_manager(model): TRL's own
offloader against ckpt_offload's (integrations.trl), and no offload, with and without checkpointing.

GPU: step time (CUDA-synchronised wall clock, median), peak device memory, bytes through the engine.
CPU (no GPU): TRL's own offloader cannot run there (it creates a CUDA stream); ckpt_offload runs on
its CPU test path (CKPT_OFFLOAD_TEST_CPU=1) and the timings are not representative of a GPU step.

    python benchmarks/bench_trl.py                          # GPU defaults: 8 layers, hidden 2048, seq 4096
    python benchmarks/bench_trl.py --layers 2 --hidden 64 --seq 128   # a quick look on the CPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("CKPT_OFFLOAD_TEST_CPU", "1")  # read when a session is created

import transformers  # noqa: E402
import trl.models.activation_offloading as trl_offloading  # noqa: E402

import ckpt_offload  # noqa: E402
from ckpt_offload.integrations import hf  # noqa: E402
from ckpt_offload.integrations import trl as ctrl  # noqa: E402

CPU_LABEL = "CPU (no GPU): ckpt_offload on its test path; timings are not representative of a GPU step"
MODES = ("none", "trl", "ckpt_offload")


def context_makers():
    """{mode: (model) -> context}: TRL's own function, and the one integrations.trl puts in its place."""
    own = trl_offloading.get_act_offloading_ctx_manager
    ctrl.install()
    ours = trl_offloading.get_act_offloading_ctx_manager
    ctrl.uninstall()
    assert ours is not own and trl_offloading.get_act_offloading_ctx_manager is own
    return {"trl": own, "ckpt_offload": ours}


def build(a, device, dtype):
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 4, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.heads, max_position_embeddings=a.seq,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def run_mode(a, mode, checkpointing, maker, device, dtype):
    model = build(a, device, dtype)  # a fresh model: TRL's function leaves hooks on the head it finds
    if checkpointing:
        hf.checkpointing_enable(model, {"use_reentrant": False})
    try:
        ctx = maker(model) if maker is not None else None
    except Exception as err:  # TRL's own offloader without a GPU
        return dict(mode=mode, checkpointing=checkpointing, error=f"{type(err).__name__}: {err}")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(device)
    times, losses = [], []
    peak = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            ckpt_offload.synchronize()
            ckpt_offload.reset_stats()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        if ctx is None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        else:
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        sync()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        model.zero_grad(set_to_none=False)
        del loss
    if CUDA:
        peak = torch.cuda.max_memory_allocated()
    s = ckpt_offload.stats()
    row = dict(mode=mode, checkpointing=checkpointing, step_ms_median=statistics.median(times),
               step_ms_min=min(times), peak_device_bytes=peak, losses=losses,
               engine_bytes_offloaded_per_step=s["bytes_offloaded"] // a.steps,
               engine_tensors_offloaded_per_step=s["tensors_offloaded"] // a.steps,
               host_alloc_calls_timed=s["host_alloc_calls"], host_in_use_bytes_after=s["host_in_use_bytes"])
    del model
    if CUDA:
        torch.cuda.empty_cache()
    return row


def fmt_bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8 if CUDA else 2)
    p.add_argument("--hidden", type=int, default=2048 if CUDA else 64)
    p.add_argument("--heads", type=int, default=16 if CUDA else 2)
    p.add_argument("--seq", type=int, default=4096 if CUDA else 128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000 if CUDA else 256)
    p.add_argument("--steps", type=int, default=5 if CUDA else 2)
    p.add_argument("--warmup", type=int, default=2 if CUDA else 1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16" if CUDA else "fp32")
    p.add_argument("--checkpointing", choices=("both", "on", "off"), default="both")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    a = p.parse_args(argv)
    device = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    makers = context_makers()
    settings = {"both": (False, True), "on": (True,), "off": (False,)}[a.checkpointing]
    rows = [run_mode(a, mode, gc, makers.get(mode), device, dtype) for gc in settings for mode in MODES]

    label = f"GPU: {torch.cuda.get_device_name()}" if CUDA else CPU_LABEL
    print(f"bench_trl: {label}")
    print(f"{'checkpointing':>13} {'mode':>13} {'step ms':>9} {'peak device':>12} {'engine/step':>12} "
          f"{'loss = none':>11}")
    for r in rows:
        gc = "on" if r["checkpointing"] else "off"
        if "error" in r:
            print(f"{gc:>13} {r['mode']:>13}  not run: {r['error'][:90]}")
            continue
        ref = next(x for x in rows if x["mode"] == "none" and x["checkpointing"] == r["checkpointing"])
        diff = max(abs(x - y) for x, y in zip(r["losses"], ref["losses"]))
        same = "yes" if r["losses"] == ref["losses"] else f"max diff {diff:.2e}"
        print(f"{gc:>13} {r['mode']:>13} {r['step_ms_median']:9.1f} {fmt_bytes(r['peak_device_bytes']):>12} "
              f"{fmt_bytes(r['engine_bytes_offloaded_per_step']):>12} {same:>11}")
    os.makedirs(a.out, exist_ok=True)
    hardware = dict(platform=platform.platform(), cpu_count=os.cpu_count(), torch=torch.__version__,
                    gpu=torch.cuda.get_device_name() if CUDA else None, trl=__import__("trl").__version__,
                    transformers=transformers.__version__)
    path = os.path.join(a.out, "bench_trl.json")
    with open(path, "w") as f:
        json.dump(dict(kind="bench_trl", gpu=CUDA, label=label, hardware=hardware, config=vars(a), rows=rows), f,
                  indent=1)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
