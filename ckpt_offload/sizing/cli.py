"""`python -m ckpt_offload estimate`: the memory of a training step of a transformers config, sized on
the meta device (no GPU, no weights, no network), per mode, against a device and a node."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings

from .. import _args

from .._args import command_name

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
           "fp32": "float32", "float32": "float32", "float": "float32"}
MODES = ("none", "checkpoint", "checkpoint+offload", "every_n=2")
# A size given without a unit below this is almost surely a missing unit ("--device-memory 80").
_MIN_BARE_BYTES = 2 ** 20


def parse_size(text: str) -> int:
    """Bytes from "80GiB", "80G" (binary), "80GB" (decimal), "1.5TiB" or a plain number of bytes
    (ckpt_offload._args.parse_size, which host_pool().set_capacity reads sizes with too), with
    argparse's error type so that the command prints the reason. A number without a unit below
    1 MiB is refused: "--device-memory 80" is a missing unit, not 80 bytes."""
    try:
        value = _args.parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    bare = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*", str(text))
    if bare and value < _MIN_BARE_BYTES:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: a number without a unit is bytes, and {value} bytes is surely a missing unit; "
            f"write {bare.group(1)}GiB, {bare.group(1)}GB or the bytes in full")
    return value


def parse_margin(text: str) -> int:
    """parse_size, or 0 (plan to the last byte)."""
    if str(text).strip() == "0":
        return 0
    return parse_size(text)


def _int_at_least(minimum, what):
    """An argparse type: an integer >= minimum, else an error that says `what` was expected."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


_positive = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "a whole number >= 0")


_RUN_FLAGS = (("every_n_layers", "every_n_layers"), ("offload", "offload"), ("keep_last", "keep_last"),
              ("policy", "policy"), ("offload_all", "offload_all"))


def configuration(args, from_file=None):
    """(the keywords of MemoryEstimate.configuration, where they came from) for the run the options and
    --training-args describe, or (None, None) when neither names one. The options win over the file."""
    given = {key: getattr(args, attr) for attr, key in _RUN_FLAGS if getattr(args, attr, None) is not None}
    if not given:
        return (dict(from_file), "--training-args") if from_file is not None else (None, None)
    base = dict(from_file) if from_file is not None else {}
    if base.get("checkpointing") is False and not given.get("offload_all"):
        base = {}  # the options turn checkpointing on: the file's "off" gives way to them
    return {**base, **given}, "the options" if from_file is None else "--training-args and the options"


def _parser():
    p = argparse.ArgumentParser(
        prog=f"{command_name()} estimate",
        description="The device and host memory of one training step of a transformers model, per "
                    "checkpointing / offload mode, estimated on the meta device (no GPU, no weights).")
    p.add_argument("--config", default=None, help="a transformers config.json")
    p.add_argument("--diffusers-config", default=None, metavar="PATH",
                   help="instead of --config: a diffusers transformer config.json, its folder, or a pipeline "
                        "folder (model_index.json, transformer/, vae/); with --height, --width and, for a video "
                        "model, --frames")
    p.add_argument("--frames", type=_positive, default=None, help="video frames (--diffusers-config)")
    p.add_argument("--height", type=_positive, default=None, help="pixels (--diffusers-config)")
    p.add_argument("--width", type=_positive, default=None, help="pixels (--diffusers-config)")
    p.add_argument("--text-tokens", type=_positive, default=None,
                   help="text encoder tokens (--diffusers-config; default: the pipeline's max_sequence_length)")
    p.add_argument("--seq", type=_positive, default=None,
                   help="tokens per sequence (default: --training-args' max_length)")
    p.add_argument("--batch", type=_positive, default=None,
                   help="sequences per step on one rank (default: --training-args' per_device_train_batch_size, "
                        "else 1)")
    p.add_argument("--training-args", default=None, metavar="FILE",
                   help="transformers TrainingArguments / TRL SFTConfig JSON (to_json_string()): batch, bf16/fp16, "
                        "optim, activation_checkpointing (or gradient_checkpointing), use_liger_kernel, max_length, fsdp/deepspeed; options given "
                        "here win")
    p.add_argument("--peft-config", default=None, metavar="FILE", help="peft's adapter_config.json (LoRA)")
    p.add_argument("--dtype", default=None,
                   help="the weights' dtype: bf16, fp16 or fp32 (default: the config's dtype, else bf16); "
                        "fp32 with --autocast: fp32 master weights")
    p.add_argument("--autocast", default=None, choices=["bf16", "fp16"],
                   help="the step computes in this dtype under torch.autocast (with --dtype fp32: fp32 master "
                        "weights, gradients and states)")
    p.add_argument("--lora-rank", type=_positive, default=None,
                   help="LoRA adapters of this rank (on --lora-targets), the rest frozen")
    p.add_argument("--lora-targets", default=None,
                   help="LoRA's target modules, comma-separated (default: every linear projection in the blocks)")
    p.add_argument("--lora-dropout", type=float, default=None, help="LoRA dropout (default 0: no dropout mask)")
    p.add_argument("--adapter-dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="the adapters' dtype (default fp32: peft upcasts them)")
    p.add_argument("--quantize", default=None, choices=["nf4", "int8", "fp8"],
                   help="the frozen base linear weights as bitsandbytes stores them (QLoRA: nf4), or fp8 "
                        "(weight-only, one byte a weight, as video trainers run the base)")
    p.add_argument("--optim", default=None, metavar="NAME",
                   help="transformers' optim name: adamw_torch (default), adamw_torch_fused, adamw_bnb_8bit, "
                        "paged_adamw_8bit, adafactor, sgd, ... or none")
    p.add_argument("--optim-args", default=None, help="as transformers' optim_args: amsgrad=True, momentum=0.9")
    p.add_argument("--optimizer", default=None, choices=["adamw", "sgd", "none"], help="older spelling of --optim")
    p.add_argument("--loss", default=None,
                   help="transformers (default: the whole logits and their fp32 copy), chunked:N, or fused "
                        "(a fused linear cross-entropy: Liger's, use_liger_kernel)")
    p.add_argument("--grads", default=None, choices=["kept", "freed"],
                   help="gradients kept between steps (accumulation; the default) or freed (zero_grad(set_to_none="
                        "True); with --training-args: freed unless gradient_accumulation_steps > 1)")
    p.add_argument("--shard", default=None,
                   help="fsdp:N, zero3:N (weights, gradients, states divided among N ranks), zero2:N, zero1:N")
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "efficient", "math", "eager"],
                   help="the SDPA backend counted (auto: what torch picks on a GPU), or eager attention")
    p.add_argument("--device-memory", type=parse_size, default=None,
                   help="device memory per rank, e.g. 80GiB (default: this machine's GPU's free memory, if any)")
    p.add_argument("--margin", type=parse_margin, default=None,
                   help="device memory per rank left unplanned, for what the estimate does not count (default: "
                        "the larger of 5%% of the device memory and 1 GiB, as budget='auto' leaves; 0: none)")
    p.add_argument("--host-memory", type=parse_size, default=None,
                   help="host memory of the node, e.g. 2TiB (default: this machine's available memory)")
    p.add_argument("--ranks", type=_positive, default=None,
                   help="the job's ranks, which a sharded recipe (FSDP, DeepSpeed ZeRO, --cp) divides its weights, "
                        "gradients and states among (default: --accelerate-config's num_processes, the launcher's "
                        "WORLD_SIZE, else --ranks-per-node on one node)")
    p.add_argument("--cp", type=_positive, default=None, metavar="N",
                   help="context parallelism as accelerate's parallelism_config_cp_size: each rank holds 1/N of the "
                        "sequence, FSDP2 shards across the job's ranks (default: --accelerate-config's, else 1)")
    p.add_argument("--accelerate-config", default=None, metavar="FILE",
                   help="accelerate launch's config file (YAML or JSON, read by accelerate): num_processes, "
                        "num_machines, FSDP, parallelism_config_cp_size")
    p.add_argument("--ranks-per-node", type=_positive, default=None,
                   help="ranks sharing the node's host memory (default: the launcher's, as hostmem.local_world_size "
                        "reads it: LOCAL_WORLD_SIZE, SLURM, Open MPI, MPICH; else 1)")
    run_ = p.add_argument_group("your run", "the exact configuration to size as one more row, as "
                                "enable_checkpointing, hf.enable, OffloadCallback and accelerate's FSDP2 offload "
                                "assign it (with --training-args, its gradient_checkpointing and kwargs)")
    run_.add_argument("--every-n-layers", type=_positive, default=None, metavar="N",
                      help="the first block and every N-th after it checkpointed (default 1)")
    run_.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                      help="the checkpointed blocks' inputs on the host (default: offload, as the entry points)")
    run_.add_argument("--keep-last", type=_count, default=None, metavar="K",
                      help="the last K checkpointed blocks keep their inputs on the device (default 1)")
    run_.add_argument("--policy", default=None, choices=["attention"],
                      help="selective checkpointing inside the checkpointed blocks (not sized: refused)")
    run_.add_argument("--offload-all", action="store_true", default=None,
                      help="every saved activation offloaded, as offload_activations and TRL's "
                           "activation_offloading do (not sized: refused)")
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


def _hardware(args, job):
    """(device bytes or None, node host bytes or None, ranks per node): the flags, else this machine's."""
    from . import hostmem

    device = args.device_memory
    if device is None:
        import torch

        if torch.cuda.is_available():
            device = int(torch.cuda.mem_get_info()[0])
    host = args.host_memory if args.host_memory is not None else hostmem.memory_available_bytes()
    return device, host, job["ranks_per_node"]


def budgets(args, job):
    """(device bytes, node host bytes, ranks per node, the host bytes one rank may pin, the device
    margin, the device bytes planned): the figures every estimate command plans with (None where
    unknown)."""
    from . import budget, hostmem

    device, host, ranks = _hardware(args, job)
    # One rule for what the node's ranks may pin, as budget="auto" and set_capacity("auto") take it.
    host_rank = hostmem.share_of(host, budget.HOST_FRACTION, ranks)
    margin = usable = None
    if device is not None:
        margin = margin_bytes(device) if args.margin is None else args.margin
        usable = device - margin
        if usable <= 0:
            raise _MarginError(f"the margin ({margin} bytes) leaves nothing of the device memory ({device} bytes); "
                               f"pass a smaller --margin")
    return device, host, ranks, host_rank, margin, usable


def _sources(args):
    """Where the device and host figures came from, in words."""
    device = "--device-memory" if args.device_memory is not None else "this machine's GPU"
    host = "--host-memory" if args.host_memory is not None else "this machine's available memory"
    ranks = ("--ranks-per-node" if args.ranks_per_node is not None else "--accelerate-config"
             if args.accelerate_config else "the launcher's variables")
    return dict(device=device, host=host, ranks=ranks)


def config_dtype(config_path):
    """The dtype a config.json names ("bfloat16"; bf16 where it names none), or a _ConfigError."""
    with open(config_path) as f:
        raw = json.load(f)
    name = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("torch_dtype") or "bfloat16"
    name = str(name).replace("torch.", "")
    if name.lower() not in _DTYPES:
        raise _ConfigError(f"its dtype {name!r} is not one a step trains in; pass --dtype bf16, fp16 or fp32")
    return _DTYPES[name.lower()]


def build_model(config_path, dtype_name=None, lora_rank=None, attention="auto", lora=None, adapter_dtype=None,
                lora_source=None):
    """(model on meta, its name, the torch dtype) from a config.json, in the dtype the step computes
    in. lora: peft.LoraConfig keyword arguments (lora_rank: r, the targets every linear projection
    of the blocks unless lora names them)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # no notes about use_cache under checkpointing
    try:
        cfg = transformers.AutoConfig.from_pretrained(config_path)
    except Exception as e:  # noqa: BLE001 - transformers' validation (its strict dataclass errors are no ValueError)
        raise _ConfigError(f"transformers refuses it: {_one_line(e)}") from None
    name = (getattr(cfg, "architectures", None) or [cfg.model_type])[0]
    if dtype_name is None:
        dtype_name = config_dtype(config_path)
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
        if lora_rank or lora:
            if lora is None or isinstance(lora, dict):
                lora = dict(lora or {}, **({"r": lora_rank} if lora_rank else {}))
            model = _lora(model, lora, adapter_dtype, lora_source)
    return model, name, dtype


def _lora(model, lora, adapter_dtype=None, lora_source=None):
    """peft LoRA on `model`: a `peft.LoraConfig` as read from --peft-config (applied as peft applies
    it), or LoraConfig keyword arguments from the options (the targets by default every linear
    projection inside the repeated blocks, attention and MLP). Every name in the options' targets
    must match a module, as peft matches them. peft upcasts the adapters to fp32 unless
    adapter_dtype says otherwise."""
    import peft
    import torch
    from torch import nn

    from ..model import find_repeated_blocks

    where = "--peft-config" if lora_source is None else f"--peft-config {lora_source!r}"
    if isinstance(lora, dict):
        where = "--lora-rank/--lora-targets"
        kw = dict(lora)
        kw.setdefault("r", 8)
        kw.setdefault("lora_alpha", 2 * kw["r"])
        if not kw.get("target_modules"):
            kw["target_modules"] = sorted({name.rsplit(".", 1)[-1] for b in find_repeated_blocks(model)
                                           for name, m in b.named_modules() if isinstance(m, nn.Linear)})
        try:
            lora = peft.LoraConfig(**kw)
        except (ValueError, TypeError) as e:
            raise _UsageError(f"{where}: peft refuses it: {_one_line(e)}") from None
    targets = lora.target_modules
    if isinstance(targets, (list, set, tuple)) and targets:
        _check_targets(model, sorted(targets), "--lora-targets" if not where.startswith("--peft-config") else
                       "--peft-config target_modules")
    try:
        model = peft.get_peft_model(model, lora, autocast_adapter_dtype=adapter_dtype in (None, "fp32"))
    except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError, RuntimeError) as e:
        raise _UsageError(f"{where}: peft cannot apply it to this model: {_one_line(e)}") from None
    if adapter_dtype not in (None, "fp32"):
        target = getattr(torch, _DTYPES[adapter_dtype])
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(target)
    return model


def _one_line(err):
    return " ".join(str(err).split())[:300]


def _check_targets(model, targets, option):
    """Each of `targets` matches a module of `model`, as peft matches a target name
    (`check_target_module_exists`); one that matches none is refused with the close names."""
    import difflib

    import peft
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [n for n, _ in model.named_modules() if n]
    for t in targets:
        probe = peft.LoraConfig(target_modules=[t])
        if not any(check_target_module_exists(probe, n) for n in names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            close = difflib.get_close_matches(t, leaves, n=3)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise _UsageError(f"{option}: {t!r} matches no module of the model{hint}")


class _ConfigError(ValueError):
    pass


def resolve(args):
    """The options, --training-args and --peft-config merged (the options win) into
    (seq, batch, compute dtype name or None, Recipe, LoraConfig (or its keyword arguments) or None,
    (the run's configuration row keywords or None, where they came from, why the file's was not sized or
    None), the job (launch.job), notes of what is not counted)."""
    from . import recipe as _recipe
    from . import recipe_files

    from . import launch

    try:
        job = launch.job(args.ranks, args.ranks_per_node, args.cp, args.accelerate_config)
    except launch.LaunchError as e:
        raise _UsageError(str(e)) from None
    ranks = job["ranks"]
    name = args.optim or args.optimizer
    if name is not None and name.lower() != "none":
        name = _recipe._ALIASES.get(name.lower(), name)
    overrides = {}
    if name is not None and name.lower() != "none":
        overrides["optim"] = name
    if args.optim_args is not None:
        if name is not None and name.lower() == "none":
            raise _UsageError(f"--optim-args {args.optim_args!r}: --optim none builds no optimizer to take them")
        overrides["optim_args"] = args.optim_args
    notes = []
    if args.training_args:
        ta = recipe_files.training_args(args.training_args, ranks or 1, job.get("ranks_per_node"),
                                        overrides=overrides)
        notes += ta["notes"]
        optim = {k: ta[k] for k in ("optim", "amsgrad", "momentum", "centered") if k in ta}
    else:
        ta = {}
        optim, more = recipe_files.optimizer_of(overrides.get("optim"), overrides.get("optim_args"))
        notes += more
    if name is not None and name.lower() == "none":
        optim = {"optim": "none"}
    elif name is None and not ta.get("optim_given"):
        notes.append(f"optimizer {optim['optim']}: the Trainer's default (transformers' TrainingArguments.optim)")
    shard = args.shard or ta.get("shard")
    if shard is None and job["shard_kind"] is not None:
        shard = f"{job['shard_kind']}:{ranks or 1}"
    if shard is None and job["cp"] > 1:
        shard = f"fsdp:{ranks}"  # context parallelism runs under FSDP2, across the same ranks
    if ranks is None and not args.shard and shard is not None:
        where = f"--training-args {args.training_args!r}" if ta.get("shard") else f"--accelerate-config {args.accelerate_config!r}"
        raise _UsageError(f"{where} shards the model ({shard.split(':')[0]}) across the job's ranks, and nothing says "
                          f"how many: give --ranks N (or --ranks-per-node N for one node, or run under the launcher, "
                          f"which sets WORLD_SIZE)")
    seq = args.seq if args.seq is not None else ta.get("seq")
    if seq is None:
        raise _UsageError("--seq is required (or a max_length in --training-args)")
    batch = args.batch if args.batch is not None else (ta.get("batch") or 1)
    autocast = args.autocast or ta.get("autocast")
    weights = args.dtype or config_dtype(args.config)
    if autocast is not None and weights is not None and _DTYPES[weights] == "float32":
        compute, master = _recipe.dtype_of(autocast), "fp32"
    else:
        # Pure precision: autocast over weights already in its dtype changes nothing.
        compute, master, autocast = None, weights, None
    lora = None
    if args.peft_config:
        lora, more = recipe_files.peft_config(args.peft_config)
        notes += more
    if args.lora_targets or args.lora_dropout is not None or args.lora_rank:
        changes = {}
        if args.lora_targets:
            changes["target_modules"] = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        if args.lora_dropout is not None:
            changes["lora_dropout"] = args.lora_dropout
        if lora is None:
            lora = changes
        else:
            if args.lora_rank:
                changes["r"] = args.lora_rank
            import dataclasses

            lora = dataclasses.replace(lora, **changes)
    if args.quantize and not (lora or args.lora_rank):
        raise _UsageError("--quantize freezes the base weights: give LoRA adapters too (--lora-rank or --peft-config)")
    try:
        recipe = _recipe.Recipe(**optim, dtype=master if autocast else None, autocast=compute,
                                loss=args.loss or ta.get("loss") or "transformers",
                                grads=args.grads or ta.get("grads", "kept"), quantize=args.quantize,
                                shard=shard)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    # fp32 master weights under autocast: built in fp32, the step run as autocast runs it. Sharded (FSDP's
    # and DeepSpeed's mixed precision), the weights are gathered in the compute dtype: built in it.
    build_dtype = autocast if autocast and recipe.shard else weights
    # The file's checkpointing, as the keywords of the row that sizes it; one it does not size is said,
    # never mapped to another row.
    from_file = refused = None
    if args.training_args:
        try:
            from_file = recipe_files.row_for_configuration(ta.get("configuration"))
        except recipe_files.UnsizedConfiguration as e:
            refused = str(e)
    run_config, source = configuration(args, from_file)
    if run_config is not None:
        from .estimate import configuration_row

        try:
            configuration_row(None, **run_config, where=f"your run ({source})")
        except ValueError as e:
            if source != "--training-args":
                raise _UsageError(str(e)) from None
            run_config, source, refused = None, None, str(e)
    return seq, batch, build_dtype, recipe, lora, (run_config, source, refused), job, notes


def run(args, progress=None):
    """The report as a dict (the --json schema)."""
    import torch

    from . import budget, hostmem
    from .estimate import estimate_memory

    progress = progress or _Progress(quiet=True)
    seq, batch, build_dtype, recipe, lora, (run_config, source, refused), job, notes = resolve(args)
    cp = job["cp"]
    seq_rank = -(-seq // cp)  # context parallelism: this rank's part of the sequence
    progress("building the model on the meta device")
    model, name, dtype = build_model(args.config, build_dtype, args.lora_rank, args.attention, lora=lora,
                                     adapter_dtype=args.adapter_dtype, lora_source=args.peft_config)
    _check_numel(model, batch, seq_rank)
    described = recipe.describe(dtype)
    if cp > 1:
        described += f"; context parallel across {cp} ranks ({seq_rank} tokens a rank)"
    adapters = [p for p in model.parameters() if p.requires_grad]
    if lora or args.lora_rank:
        kinds = sorted({str(p.dtype).replace("torch.", "") for p in adapters})
        cfg = getattr(model, "peft_config", {}).get("default")
        targets = "?" if cfg is None else cfg.target_modules if isinstance(cfg.target_modules, str) else \
            ",".join(sorted(cfg.target_modules or []))
        if cfg is not None and getattr(cfg, "target_parameters", None):
            targets += f" and parameters {','.join(cfg.target_parameters)}"
        if cfg is not None and getattr(cfg, "modules_to_save", None):
            targets += f" (trained whole: {','.join(cfg.modules_to_save)})"
        if cfg is not None and getattr(cfg, "use_dora", False):
            targets += ", DoRA"
        described += (f"; LoRA r={cfg.r if cfg is not None else '?'} on {targets}, adapters "
                      f"{'/'.join(kinds)}, dropout {cfg.lora_dropout if cfg is not None else 0}")
    ids = torch.empty(batch, seq_rank, dtype=torch.long, device="meta")
    progress(f"estimating batch {batch} x {seq_rank} tokens")
    attention = None if args.attention in ("auto", "eager") else args.attention
    try:
        est = estimate_memory(model, {"input_ids": ids, "labels": ids}, attention=attention, recipe=recipe)
    except (ValueError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "overflow" in str(e):
            raise  # torch's limit on a tensor's size: the length's, said by main()
        files = " with ".join(f"{o} {v!r}" for o, v in (("--config", args.config), ("--training-args", args.training_args),
                                                      ("--peft-config", args.peft_config)) if v)
        cfg = getattr(model, "peft_config", {}).get("default")
        why = ("; peft's LoRA on parameters (target_parameters) runs under torch.autocast, which torch refuses on "
               "the meta device the estimate builds on" if getattr(cfg, "target_parameters", None)
               and isinstance(e, RuntimeError) else "")
        raise _UsageError(f"the estimate cannot size the step of {files}: {type(e).__name__}: {_one_line(e)}{why}") \
            from None
    device, host, ranks, host_rank, margin, usable = budgets(args, job)
    row = None
    if run_config is not None:
        from .estimate import configuration_row

        try:
            row = configuration_row(est, **run_config, where=f"your run ({source})")
        except ValueError as e:
            raise _UsageError(str(e)) from None
    longest = {}
    if device is not None:
        progress("fitting the longest sequences")
        longest = est.longest_fitting(usable, host_rank, rows={"your run": row.modes} if row else None)
        # Per rank under context parallelism: the whole sequence is cp times it, within the model's positions.
        longest = {m: (s if s is None or cp == 1 else min(s * cp, est.max_seq or 1 << 62)) for m, s in longest.items()}
    modes = {}
    for m in MODES:
        peak, hb = est.peak_bytes[m], est.host_bytes[m]
        fits = None
        if device is not None:
            fits = bool(peak <= usable and (host_rank is None or hb <= host_rank))
        modes[m] = dict(device_peak_bytes=int(peak), host_bytes_per_rank=int(hb), host_bytes_per_node=int(hb * ranks),
                        fits=fits, longest_seq=longest.get(m))
    your_run = None
    if row is not None:
        fits = None if device is None else bool(row.peak_bytes <= usable and (host_rank is None or
                                                                          row.host_bytes <= host_rank))
        your_run = dict(configuration=row.label, source=source, device_peak_bytes=row.peak_bytes,
                        host_bytes_per_rank=row.host_bytes, host_bytes_per_node=row.host_bytes * ranks, fits=fits,
                        longest_seq=longest.get("your run"), blocks=_counts(row.modes))
    modes["plan"] = None
    static = est.parts["weights_bytes"] + est.parts["grads_bytes"] + est.parts["optimizer_bytes"] + \
        est.parts["in_flight_bytes"]
    why = None
    if device is not None:
        progress("searching the per-block plans")
        try:
            plan = est.plan(usable, host_rank)
            modes["plan"] = dict(device_peak_bytes=plan.predicted_peak_bytes,
                                 host_bytes_per_rank=plan.predicted_host_bytes,
                                 host_bytes_per_node=plan.predicted_host_bytes * ranks, fits=True,
                                 longest_seq=min(max(seq, *(longest[m] for m in MODES)),
                                                 est.max_seq or 1 << 62),
                                 blocks=_runs(plan.modes))
        except ValueError:
            low = min(MODES, key=lambda m: est.peak_bytes[m])
            modes["plan"] = dict(modes[low], fits=False, blocks=_runs(est.modes[low]))
            if max(static, est.step_peak_bytes) > usable:
                why = (f"the weights, gradients and optimizer states alone take {_gib(static)} GiB "
                       f"({_gib(est.step_peak_bytes)} GiB while the optimizer steps) of the "
                       f"{_gib(usable)} GiB planned, before any activation: shard them (--shard), quantize the "
                       f"base (--quantize with LoRA), train adapters, or change the optimizer")
            elif host_rank is not None and min(est.host_bytes[m] for m in MODES) <= host_rank < \
                    est.host_bytes["checkpoint+offload"] and modes["checkpoint+offload"]["device_peak_bytes"] <= usable:
                why = (f"offloading enough needs more host memory than this rank's share "
                       f"({_gib(host_rank)} GiB: {budget.HOST_FRACTION:.0%} of the node's, among {ranks} "
                       f"rank{'s' if ranks != 1 else ''})")
            else:
                why = (f"the smallest peak ({_gib(modes[low]['device_peak_bytes'])} GiB, {low}) is past the "
                       f"{_gib(usable)} GiB planned; logits {_gib(est.parts['logits_bytes'])} GiB (--loss "
                       f"chunked:N or fused holds less), checkpoint inputs "
                       f"{_gib(est.parts['checkpoint_input_bytes'])} GiB")
    return {"model": name, "seq": seq, "batch": batch, "dtype": str(dtype).replace("torch.", ""),
            "device_memory_bytes": device, "device_margin_bytes": margin, "host_memory_bytes": host,
            "host_share_bytes": host_rank, "ranks_per_node": ranks, "max_seq": est.max_seq, "sources": _sources(args),
            "recipe": described, "your_run": your_run, "why_nothing_fits": why,
            "configuration_refused": refused, "not_counted": notes,
            "attention": est.attention, "modes": modes, "parts": est.parts,
            "optimizer_step_peak_bytes": est.step_peak_bytes}


class _UsageError(ValueError):
    pass


def _check_numel(model, batch, seq):
    """Refuse sizes whose tensors could not exist: the logits' or the MLP's elements past int64."""
    from torch import nn

    widest = max((m.out_features for m in model.modules() if isinstance(m, nn.Linear)), default=1)
    if batch * seq * widest >= 2 ** 62:
        raise _UsageError(f"--batch {batch} x --seq {seq} x {widest} (the widest layer's output) is "
                          f"{batch * seq * widest} elements, past what a tensor can hold (2^62 bytes' worth); "
                          f"use a smaller --seq or --batch")


def _runs(modes):
    """"12 x checkpoint+offload, 68 x none": a plan's modes in runs."""
    out = []
    for m in modes:
        if out and out[-1][1] == m:
            out[-1][0] += 1
        else:
            out.append([1, m])
    return ", ".join(f"{k} x {m}" for k, m in out)


def _counts(modes):
    """"16 of 32 blocks checkpointed (blocks 0, 2, ...), 15 of them offloaded": an assignment in counts."""
    ck = [i for i, m in enumerate(modes) if m != "none"]
    off = sum(m == "checkpoint+offload" for m in modes)
    where = ", ".join(map(str, ck[:3])) + (", ..." if len(ck) > 3 else "")
    return (f"{len(ck)} of {len(modes)} blocks checkpointed" + (f" ({where})" if ck else "")
            + f", {off} of them offloaded")


def _gib(b):
    return "-" if b is None else f"{b / 2 ** 30:.2f}"


def format_report(r) -> str:
    src = r.get("sources") or {}
    ranks = r["ranks_per_node"]
    device = ("device unknown (no --device-memory and no GPU here: fits and longest seq not judged)"
              if r["device_memory_bytes"] is None else
              f"device {_gib(r['device_memory_bytes'])} GiB ({src.get('device', '?')}"
              + ("" if r["device_margin_bytes"] is None else f", {_gib(r['device_margin_bytes'])} GiB of it left unplanned")
              + ")")
    host = ("host unknown (no --host-memory and this machine's memory unreadable)" if r["host_memory_bytes"] is None
            else f"host {_gib(r['host_memory_bytes'])} GiB per node ({src.get('host', '?')}), "
                 f"{_gib(r['host_share_bytes'])} GiB a rank may pin")
    lines = [f"{r['model']}: batch {r['batch']} x {r['seq']} tokens, {r['dtype']}, attention "
             f"{'/'.join(r['attention']) or 'eager'}; {device}; {host}; {ranks} rank{'s' if ranks != 1 else ''} "
             f"per node",
             f"recipe: {r['recipe']}",
             f"{'mode':<20} {'device GiB':>10} {'host GiB/rank':>13} {'host GiB/node':>13} {'fits':>5} {'longest seq':>12}"]
    for m, row in r["modes"].items():
        if row is None:
            continue
        fits = "?" if row["fits"] is None else "yes" if row["fits"] else "no"
        longest = "?" if row["longest_seq"] is None else str(row["longest_seq"])
        lines.append(f"{m:<20} {_gib(row['device_peak_bytes']):>10} {_gib(row['host_bytes_per_rank']):>13} "
                     f"{_gib(row['host_bytes_per_node']):>13} {fits:>5} {longest:>12}")
    mine = r.get("your_run")
    if mine is not None:
        fits = "?" if mine["fits"] is None else "yes" if mine["fits"] else "no"
        longest = "?" if mine["longest_seq"] is None else str(mine["longest_seq"])
        lines.append(f"{'your run':<20} {_gib(mine['device_peak_bytes']):>10} {_gib(mine['host_bytes_per_rank']):>13} "
                     f"{_gib(mine['host_bytes_per_node']):>13} {fits:>5} {longest:>12}")
        lines.append(f"your run: {mine['configuration']} (from {mine['source']}): {mine['blocks']}")
    cap = r.get("max_seq")
    if cap and any(row is not None and row["longest_seq"] == cap for row in r["modes"].values()):
        lines.append(f"longest seq: at most the {cap} positions the model takes (its max_position_embeddings)")
    if cap and r["seq"] > cap:
        lines.append(f"--seq {r['seq']} is past the {cap} positions the model takes")
    if r.get("configuration_refused"):
        lines.append(f"--training-args checkpointing: not sized: {r['configuration_refused']}")
    for note in r.get("not_counted") or ():
        lines.append(f"note: {note}")
    plan = r["modes"].get("plan")
    if plan is not None:
        lines.append(f"plan: {plan['blocks']}" + ("" if plan["fits"] else " (the smallest peak; nothing fits)"))
    if r.get("why_nothing_fits"):
        lines.append(f"nothing fits: {r['why_nothing_fits']}")
    parts = {k: v for k, v in r["parts"].items() if k != "in_flight_bytes" or v}
    lines.append("parts: " + ", ".join(f"{k.replace('_bytes', '').replace('_', ' ')} {_gib(v)} GiB"
                                       for k, v in parts.items())
                 + f"; while the optimizer steps {_gib(r['optimizer_step_peak_bytes'])} GiB")
    return "\n".join(lines)


_CONFIG_INTS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                "intermediate_size", "head_dim")


def check_config(raw) -> str | None:
    """What makes a config.json one no model can be built from, in one line (None: nothing)."""
    for c in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else None):
        if c is None:
            continue
        for key in _CONFIG_INTS:
            if key not in c or c[key] is None:
                continue
            v = c[key]
            if isinstance(v, bool) or not isinstance(v, int):
                return f"{key} must be a whole number, got {v!r}"
            if v < 1:
                return f"{key} must be at least 1, got {v}"
        h, heads, kv = c.get("hidden_size"), c.get("num_attention_heads"), c.get("num_key_value_heads")
        if h and heads and not c.get("head_dim") and h % heads:
            return f"hidden_size {h} is not divisible by num_attention_heads {heads} (and no head_dim is given)"
        if heads and kv and heads % kv:
            return f"num_key_value_heads {kv} does not divide num_attention_heads {heads}"
    return None


def main(argv=None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.diffusers_config is not None:
        from . import diffusion

        return diffusion.main(args, sys.modules[__name__])
    if args.config is None:
        return _fail("--config (a transformers config.json) or --diffusers-config is required")
    if os.path.isdir(args.config):
        return _fail(f"--config {args.config!r} is a directory; give its config.json")
    if not os.path.isfile(args.config):
        return _fail(f"--config {args.config!r}: no such file")
    if args.dtype is not None and args.dtype.lower() not in _DTYPES:
        return _fail(f"--dtype {args.dtype!r}: unknown; use bf16, fp16 or fp32")
    if args.dtype is not None:
        args.dtype = args.dtype.lower()
    try:
        with open(args.config) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        return _fail(f"--config {args.config!r} is not a JSON file: {e}")
    if not isinstance(raw, dict):
        return _fail(f"--config {args.config!r}: expected a JSON object")
    bad = check_config(raw)
    if bad:
        return _fail(f"--config {args.config!r}: {bad}")
    if args.dtype is None:
        try:
            config_dtype(args.config)
        except _ConfigError as e:
            return _fail(f"--config {args.config!r}: {e}")
    progress = _Progress(quiet=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notes, as peft calls it
            report = run(args, progress)
    except _MarginError as e:
        return _fail(f"--margin: {e}")
    except _UsageError as e:
        return _fail(str(e))
    except _ConfigError as e:
        return _fail(f"--config {args.config!r}: {e}")
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        # torch's own limit on a tensor's elements, met inside the model (an [s, s] mask, say).
        return _fail(f"--seq {args.seq}" + (f" / --batch {args.batch}" if args.batch else "") + f": torch cannot make this step's tensors "
                     f"({_one_line(e)}); use a smaller --seq or --batch")
    except ValueError as e:
        if type(e).__name__ == "RecipeFileError":
            return _fail(str(e))
        return _fail(f"--config {args.config!r}: {e}")
    except ImportError as e:
        return _fail(f"{e} (the estimate builds the model with transformers; LoRA needs peft)")
    except KeyError as e:
        return _fail(f"--config {args.config!r}: {e}")
    if args.json:
        out = {k: report[k] for k in ("model", "seq", "batch", "max_seq", "device_margin_bytes", "host_share_bytes",
                                      "recipe", "your_run", "configuration_refused", "not_counted",
                                      "why_nothing_fits")}
        out["modes"] = {m: (None if row is None else {k: row[k] for k in (
            "device_peak_bytes", "host_bytes_per_rank", "host_bytes_per_node", "fits", "longest_seq")})
            for m, row in report["modes"].items()}
        out["parts"] = report["parts"]
        out["optimizer_step_peak_bytes"] = report["optimizer_step_peak_bytes"]
        print(json.dumps(out))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
