"""`python -m ckpt_offload estimate`: the memory of a training step of a transformers config, sized on
the meta device (no GPU, no weights, no network), per mode, against a device and a node."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from . import _args

from ._args import command_name

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
           "fp32": "float32", "float32": "float32", "float": "float32"}
MODES = ("none", "checkpoint", "checkpoint+offload", "every_n=2")


def parse_size(text: str) -> int:
    """Bytes from "80GiB", "80G" (binary), "80GB" (decimal), "1.5TiB" or a plain number of bytes
    (ckpt_offload._args.parse_size, which host_pool().set_capacity reads sizes with too), with
    argparse's error type so that the command prints the reason."""
    try:
        return _args.parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_margin(text: str) -> int:
    """parse_size, or 0 (plan to the last byte)."""
    if str(text).strip() == "0":
        return 0
    return parse_size(text)


def _positive(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _parser():
    p = argparse.ArgumentParser(
        prog=f"{command_name()} estimate",
        description="The device and host memory of one training step of a transformers model, per "
                    "checkpointing / offload mode, estimated on the meta device (no GPU, no weights).")
    p.add_argument("--config", required=True, help="a transformers config.json")
    p.add_argument("--seq", type=_positive, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=_positive, default=1, help="sequences per step on one rank (default 1)")
    p.add_argument("--dtype", default=None,
                   help="bf16, fp16 or fp32 (default: the config's dtype, else bf16)")
    p.add_argument("--lora-rank", type=_positive, default=None,
                   help="LoRA adapters of this rank on the attention and MLP projections, the rest frozen")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "none"])
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "efficient", "math", "eager"],
                   help="the SDPA backend counted (auto: what torch picks on a GPU), or eager attention")
    p.add_argument("--device-memory", type=parse_size, default=None,
                   help="device memory per rank, e.g. 80GiB (default: this machine's GPU's free memory, if any)")
    p.add_argument("--margin", type=parse_margin, default=None,
                   help="device memory per rank left unplanned, for what the estimate does not count (default: "
                        "the larger of 5%% of the device memory and 1 GiB, as budget='auto' leaves; 0: none)")
    p.add_argument("--host-memory", type=parse_size, default=None,
                   help="host memory of the node, e.g. 2TiB (default: this machine's available memory)")
    p.add_argument("--ranks-per-node", type=_positive, default=None,
                   help="ranks sharing the node's host memory (default: LOCAL_WORLD_SIZE, else 1)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


class _Progress:
    """Progress lines on stderr, only once the command has run for more than a second."""

    def __init__(self, quiet=False):
        self.start = time.perf_counter()
        self.pending = None
        self.quiet = quiet

    def __call__(self, msg):
        if self.quiet:
            return
        if time.perf_counter() - self.start > 1.0:
            print(f"estimate: {msg}", file=sys.stderr, flush=True)


class _MarginError(ValueError):
    pass


def _fail(msg) -> int:
    print(f"python -m ckpt_offload estimate: error: {msg}", file=sys.stderr)
    return 2


def margin_bytes(device_bytes: int) -> int:
    """The default --margin: what budget="auto" leaves on a device of this size."""
    from . import budget

    return max(int(budget.MARGIN_FRACTION * device_bytes), budget.MARGIN_MIN_BYTES)


def _hardware(args):
    """(device bytes or None, node host bytes or None, ranks per node): the flags, else this machine's."""
    from . import hostmem

    device = args.device_memory
    if device is None:
        import torch

        if torch.cuda.is_available():
            device = int(torch.cuda.mem_get_info()[0])
    host = args.host_memory if args.host_memory is not None else hostmem.memory_available_bytes()
    ranks = args.ranks_per_node if args.ranks_per_node is not None else hostmem.local_world_size()
    return device, host, ranks


def build_model(config_path, dtype_name=None, lora_rank=None, attention="auto"):
    """(model on meta, its name, the torch dtype) from a config.json."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # no notes about use_cache under checkpointing
    cfg = transformers.AutoConfig.from_pretrained(config_path)
    name = (getattr(cfg, "architectures", None) or [cfg.model_type])[0]
    if dtype_name is None:
        dtype_name = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "bfloat16")
        dtype_name = dtype_name.replace("torch.", "")
    dtype = getattr(torch, _DTYPES[dtype_name])
    cfg._attn_implementation = "eager" if attention == "eager" else "sdpa"
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):
                raise
            # transformers lists every class it knows here (some 200): say what matters instead.
            raise ValueError(f"model_type {cfg.model_type!r} ({type(cfg).__name__}) has no causal language model "
                             f"in transformers (AutoModelForCausalLM); the estimate sizes decoder-only language "
                             f"models (an encoder-decoder such as T5 is not one)") from None
        if lora_rank:
            model = _lora(model, lora_rank)
    return model, name, dtype


def _lora(model, rank):
    """peft LoRA on every linear projection inside the repeated blocks (attention and MLP)."""
    import peft
    from torch import nn

    from .model import find_repeated_blocks

    targets = sorted({name.rsplit(".", 1)[-1] for b in find_repeated_blocks(model)
                      for name, m in b.named_modules() if isinstance(m, nn.Linear)})
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


def run(args, progress=None):
    """The report as a dict (the --json schema)."""
    import torch

    from .estimate import estimate_memory

    progress = progress or _Progress(quiet=True)
    progress("building the model on the meta device")
    model, name, dtype = build_model(args.config, args.dtype, args.lora_rank, args.attention)
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    progress(f"estimating batch {args.batch} x {args.seq} tokens")
    attention = None if args.attention in ("auto", "eager") else args.attention
    est = estimate_memory(model, {"input_ids": ids, "labels": ids},
                          optimizer=None if args.optimizer == "none" else args.optimizer, attention=attention)
    device, host, ranks = _hardware(args)
    host_rank = None if host is None else host // ranks
    margin = usable = None
    if device is not None:
        margin = margin_bytes(device) if args.margin is None else args.margin
        usable = device - margin
        if usable <= 0:
            raise _MarginError(f"the margin ({margin} bytes) leaves nothing of the device memory ({device} bytes); "
                             f"pass a smaller --margin")
    longest = {}
    if device is not None:
        progress("fitting the longest sequences")
        longest = est.longest_fitting(usable, host_rank)
    modes = {}
    for m in MODES:
        peak, hb = est.peak_bytes[m], est.host_bytes[m]
        fits = None
        if device is not None:
            fits = bool(peak <= usable and (host is None or hb * ranks <= host))
        modes[m] = dict(device_peak_bytes=int(peak), host_bytes_per_rank=int(hb), host_bytes_per_node=int(hb * ranks),
                        fits=fits, longest_seq=longest.get(m))
    modes["plan"] = None
    if device is not None:
        progress("searching the per-block plans")
        try:
            plan = est.plan(usable, host_rank)
            modes["plan"] = dict(device_peak_bytes=plan.predicted_peak_bytes,
                                 host_bytes_per_rank=plan.predicted_host_bytes,
                                 host_bytes_per_node=plan.predicted_host_bytes * ranks, fits=True,
                                 longest_seq=min(max(args.seq, *(longest[m] for m in MODES)),
                                                 est.max_seq or 1 << 62),
                                 blocks=_runs(plan.modes))
        except ValueError:
            low = min(MODES, key=lambda m: est.peak_bytes[m])
            modes["plan"] = dict(modes[low], fits=False, blocks=_runs(est.modes[low]))
    return {"model": name, "seq": args.seq, "batch": args.batch, "dtype": str(dtype).replace("torch.", ""),
            "device_memory_bytes": device, "device_margin_bytes": margin, "host_memory_bytes": host,
            "ranks_per_node": ranks, "max_seq": est.max_seq,
            "attention": est.attention, "modes": modes, "parts": est.parts}


def _runs(modes):
    """"12 x checkpoint+offload, 68 x none": a plan's modes in runs."""
    out = []
    for m in modes:
        if out and out[-1][1] == m:
            out[-1][0] += 1
        else:
            out.append([1, m])
    return ", ".join(f"{k} x {m}" for k, m in out)


def _gib(b):
    return "-" if b is None else f"{b / 2 ** 30:.2f}"


def format_report(r) -> str:
    lines = [f"{r['model']}: batch {r['batch']} x {r['seq']} tokens, {r['dtype']}, attention "
             f"{'/'.join(r['attention']) or 'eager'}; device {_gib(r['device_memory_bytes'])} GiB"
             + ("" if r["device_margin_bytes"] is None else f" ({_gib(r['device_margin_bytes'])} GiB of it left unplanned)")
             + f", host "
             f"{_gib(r['host_memory_bytes'])} GiB per node, {r['ranks_per_node']} ranks per node",
             f"{'mode':<20} {'device GiB':>10} {'host GiB/rank':>13} {'host GiB/node':>13} {'fits':>5} {'longest seq':>12}"]
    for m, row in r["modes"].items():
        if row is None:
            continue
        fits = "-" if row["fits"] is None else "yes" if row["fits"] else "no"
        longest = "-" if row["longest_seq"] is None else str(row["longest_seq"])
        lines.append(f"{m:<20} {_gib(row['device_peak_bytes']):>10} {_gib(row['host_bytes_per_rank']):>13} "
                     f"{_gib(row['host_bytes_per_node']):>13} {fits:>5} {longest:>12}")
    cap = r.get("max_seq")
    if cap and any(row is not None and row["longest_seq"] == cap for row in r["modes"].values()):
        lines.append(f"longest seq: at most the {cap} positions the model takes (its max_position_embeddings)")
    if cap and r["seq"] > cap:
        lines.append(f"--seq {r['seq']} is past the {cap} positions the model takes")
    plan = r["modes"].get("plan")
    if plan is not None:
        lines.append(f"plan: {plan['blocks']}" + ("" if plan["fits"] else " (the smallest peak; nothing fits)"))
    lines.append("parts: " + ", ".join(f"{k.replace('_bytes', '')} {_gib(v)} GiB" for k, v in r["parts"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if not os.path.isfile(args.config):
        return _fail(f"--config {args.config!r}: no such file")
    if args.dtype is not None and args.dtype.lower() not in _DTYPES:
        return _fail(f"--dtype {args.dtype!r}: unknown; use bf16, fp16 or fp32")
    if args.dtype is not None:
        args.dtype = args.dtype.lower()
    try:
        with open(args.config) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return _fail(f"--config {args.config!r} is not a JSON file: {e}")
    progress = _Progress(quiet=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notes, as peft calls it
            report = run(args, progress)
    except _MarginError as e:
        return _fail(f"--margin: {e}")
    except ImportError as e:
        return _fail(f"{e} (the estimate builds the model with transformers; --lora-rank needs peft)")
    except (ValueError, KeyError) as e:
        return _fail(f"--config {args.config!r}: {e}")
    if args.json:
        out = {k: report[k] for k in ("model", "seq", "batch", "max_seq", "device_margin_bytes")}
        out["modes"] = {m: (None if row is None else {k: row[k] for k in (
            "device_peak_bytes", "host_bytes_per_rank", "host_bytes_per_node", "fits", "longest_seq")})
            for m, row in report["modes"].items()}
        out["parts"] = report["parts"]
        print(json.dumps(out))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
