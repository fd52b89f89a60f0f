"""The recipe as the run's own files state it: transformers' TrainingArguments (or TRL's SFTConfig)
as `to_json_string()` writes them, and peft's adapter_config.json. Read into the estimate command's
options, so that one set of rules (the command's) turns them into a `recipe.Recipe`."""
from __future__ import annotations

import json


class RecipeFileError(ValueError):
    pass


def _load(path, what):
    try:
        with open(path) as f:
            data = json.load(f)
    except IsADirectoryError:
        raise RecipeFileError(f"{what} {path!r} is a directory; give the JSON file") from None
    except FileNotFoundError:
        raise RecipeFileError(f"{what} {path!r}: no such file") from None
    except (OSError, ValueError) as e:
        raise RecipeFileError(f"{what} {path!r} is not a JSON file: {e}") from None
    if not isinstance(data, dict):
        raise RecipeFileError(f"{what} {path!r}: expected a JSON object, got {type(data).__name__}")
    return data


def parse_optim_args(text) -> dict:
    """transformers' `optim_args` ("momentum=0.9,amsgrad=True"): the keys the recipe reads."""
    out = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise RecipeFileError(f"optim_args {text!r}: expected key=value pairs separated by commas")
        if key == "amsgrad":
            out["amsgrad"] = value.lower() in ("true", "1", "yes")
        elif key == "momentum":
            try:
                out["momentum"] = float(value)
            except ValueError:
                raise RecipeFileError(f"optim_args {text!r}: momentum must be a number") from None
    return out


def _shard_of(args, ranks):
    """(shard spec or None, from what) from the fsdp / deepspeed entries."""
    fsdp = args.get("fsdp") or ""
    if isinstance(fsdp, list):
        fsdp = " ".join(fsdp)
    if "full_shard" in fsdp or "hybrid_shard" in fsdp:
        return f"fsdp:{ranks}", "fsdp"
    if "shard_grad_op" in fsdp:
        return f"zero2:{ranks}", "fsdp"
    ds = args.get("deepspeed")
    if isinstance(ds, str) and ds:
        ds = _load(ds, "deepspeed config")
    if isinstance(ds, dict):
        stage = (ds.get("zero_optimization") or {}).get("stage", 0)
        if stage == 3:
            return f"zero3:{ranks}", "deepspeed"
        if stage in (1, 2):
            return f"zero{stage}:{ranks}", "deepspeed"
    return None, None


def training_args(path, ranks=1) -> dict:
    """The recipe in a TrainingArguments / SFTConfig JSON: batch, precision, optimizer, checkpointing
    (the mode it selects), the loss, the length, the gradients (kept under accumulation), sharding
    (across `ranks`, the JSON not saying how many). Keys absent from the file are absent here."""
    a = _load(path, "--training-args")
    out = {}
    if "per_device_train_batch_size" in a:
        out["batch"] = int(a["per_device_train_batch_size"])
    for key in ("max_length", "max_seq_length"):
        if a.get(key):
            out["seq"] = int(a[key])
            break
    if a.get("bf16"):
        out["autocast"] = "bf16"
    elif a.get("fp16"):
        out["autocast"] = "fp16"
    if a.get("optim"):
        out["optim"] = str(a["optim"])
    if a.get("optim_args"):
        out.update(parse_optim_args(a["optim_args"]))
    # transformers 5.2x's names, activation_checkpointing[_kwargs], win where set, as its
    # TrainingArguments resolve them; gradient_checkpointing[_kwargs] before the rename (and in
    # files that still use them).
    name = next((n for n in ("activation_checkpointing", "gradient_checkpointing") if a.get(n) is not None), None)
    if name is not None:
        out["configuration"] = row_for_configuration(
            {"gradient_checkpointing": a[name], "gradient_checkpointing_kwargs": a.get(f"{name}_kwargs")})
    if a.get("use_liger_kernel"):
        out["loss"] = "fused"
    if "gradient_accumulation_steps" in a:
        out["grads"] = "kept" if int(a["gradient_accumulation_steps"]) > 1 else "freed"
    shard, _ = _shard_of(a, ranks)
    if shard:
        out["shard"] = shard
    return out


def row_for_configuration(keywords) -> dict:
    """The run's checkpointing, as the keywords of `MemoryEstimate.configuration` (the row sized for
    it): transformers' `gradient_checkpointing` and its kwargs' `every_n_layers` and `offload`, run
    through ckpt_offload (OffloadCallback, hf.install: keep_last=1). Off: checkpointing=False."""
    if not keywords.get("gradient_checkpointing"):
        return {"checkpointing": False}
    kw = keywords.get("gradient_checkpointing_kwargs") or {}
    return {"every_n_layers": int(kw.get("every_n_layers", 1) or 1), "offload": bool(kw.get("offload", False)),
            "keep_last": 1}


def peft_config(path) -> dict:
    """peft's adapter_config.json (LoRA): the keyword arguments of a `peft.LoraConfig`."""
    import dataclasses

    import peft

    c = _load(path, "--peft-config")
    kind = str(c.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise RecipeFileError(f"--peft-config {path!r}: peft_type {kind!r}; the estimate sizes LoRA adapters")
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    skip = {"peft_type", "base_model_name_or_path", "revision", "inference_mode", "task_type", "auto_mapping"}
    return {k: v for k, v in c.items() if k in fields and k not in skip}
