"""The recipe as the run's own files state it, read by the libraries that read them in the run.

- `--training-args`: transformers' `TrainingArguments` (TRL's `SFTConfig` when the file has TRL's
  fields) built from the JSON by transformers' own `HfArgumentParser`, so that its `__post_init__`
  validates and normalizes it as the run's does (JSON-string fields, `fsdp`/`fsdp_config` in every
  form, the deprecated `gradient_checkpointing*` names, an inline or file DeepSpeed config).
- The optimizer: the class and keyword arguments the Trainer builds (`get_optimizer_cls_and_kwargs`).
- `--peft-config`: the adapter folder or its `adapter_config.json`, loaded by peft's own config loading.

Nothing here parses a field those libraries parse: it reads the objects they build. What it adds
is a check of each value against the type its dataclass declares (so that a wrong type is refused
in one line naming the field, not a traceback later), and the mapping from a checkpointing
configuration to the estimate's row (`row_for_configuration`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import json
import os
import types
import typing
import warnings


class RecipeFileError(ValueError):
    """A file (or an option) the estimate cannot read: one line that names the option, the file and
    the field."""


class UnsizedConfiguration(ValueError):
    """A checkpointing configuration that no row of the estimate sizes exactly."""


def _load(path, option):
    """The JSON object in `path` (one line naming `option` and the file where it is none)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except IsADirectoryError:
        raise RecipeFileError(f"{option} {path!r} is a directory; give the JSON file") from None
    except FileNotFoundError:
        raise RecipeFileError(f"{option} {path!r}: no such file") from None
    except (OSError, ValueError) as e:
        raise RecipeFileError(f"{option} {path!r} is not a JSON file: {_line(e)}") from None
    if not isinstance(data, dict):
        raise RecipeFileError(f"{option} {path!r}: expected a JSON object, got {type(data).__name__}")
    return data


def _line(err) -> str:
    """An exception's message on one line."""
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


# ---- a value against the type its dataclass declares ------------------------------------------

def _accepts(tp, value) -> bool:
    """Whether `value` (from JSON) is of the declared type `tp`; types this cannot judge (classes
    the library builds from a dict or a path, callables) are left to the library."""
    if tp is typing.Any:
        return True
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        return any(_accepts(a, value) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple, set, frozenset):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return isinstance(value, list) and all(_accepts(args[0], v) for v in value) if args else isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, str)  # its values are the library's to check
    if tp in (list, dict):
        return isinstance(value, tp)
    return True


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "an object"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "a string"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(tp, str(tp))


def _check_fields(cls, data, where, skip=(), types_too=True):
    """Each key of `data` a field of the dataclass `cls` (an unknown one refused with its close
    matches), and with `types_too` each value of the type the field declares."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls) if types_too else {}
    for key, value in data.items():
        if key in skip:
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=3)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise RecipeFileError(f"{where}: {key}: not a field of {cls.__name__}{hint}")
        if not types_too:
            continue
        tp = hints.get(key, typing.Any)
        if not _accepts(tp, value):
            raise RecipeFileError(f"{where}: {key}: expected {_type_name(tp)}, got {value!r}")


# ---- TrainingArguments ------------------------------------------------------------------------

def _arguments_classes():
    """(TrainingArguments, SFTConfig or None)."""
    from transformers import TrainingArguments

    try:
        from trl import SFTConfig
    except ImportError:
        SFTConfig = None
    return TrainingArguments, SFTConfig


def _sizing_class(base):
    """`base` as the estimate builds it: the same dataclass, fields and `__post_init__`, but the
    devices it would set up (accelerate's PartialState: a process group under a launcher, the CUDA
    device) are this process's CPU: sizing a run must not start one."""
    import torch

    class Sized(base):
        @property
        def _setup_devices(self):
            self._n_gpu = 0
            self.distributed_state = None
            return torch.device("cpu")

    Sized.__name__ = Sized.__qualname__ = base.__name__
    return Sized


@contextlib.contextmanager
def _no_side_effects():
    """Around building TrainingArguments: transformers' notes and warnings silenced, and what its
    `__post_init__` leaves in the process undone (environment variables it sets, the DeepSpeed
    config it registers globally, which would make the meta model a ZeRO-3 one)."""
    import transformers

    try:
        import transformers.integrations.deepspeed as ds
    except ImportError:  # pragma: no cover
        ds = None
    env = dict(os.environ)
    ref = getattr(ds, "_hf_deepspeed_config_weak_ref", None)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        if ds is not None and hasattr(ds, "_hf_deepspeed_config_weak_ref"):
            ds._hf_deepspeed_config_weak_ref = ref
        transformers.logging.set_verbosity(verbosity)


# Fields that say what this machine can do, not what the run holds: the run's machine checks them
# (bf16 on a GPU, TF32 on Ampere); sizing on a laptop must not refuse them.
_HOST_FIELDS = {"use_cpu": True, "tf32": None}


def _build(cls, data):
    from transformers import HfArgumentParser

    with _no_side_effects():
        return HfArgumentParser(_sizing_class(cls)).parse_dict({**data, **_HOST_FIELDS})[0]


def _blame(cls, data):
    """The field whose value makes the library refuse `data`: the first whose default makes it build."""
    defaults = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
    for key in data:
        if key in _HOST_FIELDS or (key in defaults and data[key] == defaults[key]):
            continue
        trial = {k: v for k, v in data.items() if k != key}
        try:
            _build(cls, trial)
        except Exception:  # noqa: BLE001 - another field's refusal: try the next
            continue
        return key
    return None


def build_training_arguments(data: dict, where: str = "--training-args"):
    """TrainingArguments (TRL's SFTConfig when `data` has TRL's fields and TRL is installed) built
    from `data` by transformers' HfArgumentParser, without touching devices or process groups.
    A field the library refuses: a RecipeFileError naming it."""
    TrainingArguments, SFTConfig = _arguments_classes()
    own = {f.name for f in dataclasses.fields(TrainingArguments)}
    cls = TrainingArguments
    extra = [k for k in data if k not in own]
    if extra and SFTConfig is not None and any(k in {f.name for f in dataclasses.fields(SFTConfig)} for k in extra):
        cls = SFTConfig
    elif extra and SFTConfig is None:
        raise RecipeFileError(f"{where}: {extra[0]}: not a field of transformers' TrainingArguments (TRL's "
                              f"SFTConfig fields need trl installed)")
    # The values are transformers' to judge (its annotations are narrower than what it takes: `fsdp`
    # is declared a string and takes true); the ones the estimate reads are checked as it reads them.
    _check_fields(cls, data, where, skip=_HOST_FIELDS, types_too=False)
    try:
        return _build(cls, data)
    except Exception as err:  # noqa: BLE001 - whatever the library raises for a value it refuses
        field = _blame(cls, data)
        raise RecipeFileError(f"{where}: {field + ': ' if field else ''}{cls.__name__} refuses it: "
                              f"{type(err).__name__}: {_line(err)}") from None


def _positive(where, args, name, required=False):
    value = getattr(args, name, None)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeFileError(f"{where}: {name}: a step needs a whole number >= 1, got {value!r}")
    return value


def checkpointing_configuration(args, where="--training-args", keys=()):
    """The checkpointing the run of these TrainingArguments uses, as the keywords ckpt_offload's own
    entry points receive for it (`hf.install()` and `OffloadCallback` from the checkpointing kwargs,
    the TRL route from `activation_offloading`, accelerate's FSDP from `fsdp_config`), or None for
    no checkpointing and no offload:

    - `every_n_layers` (None: no block checkpointed), `offload`, `keep_last` (the last checkpointed
      blocks whose inputs stay on the device: 1 where offload goes through the engine);
    - `offload_all`: every saved activation offloaded (TRL's `activation_offloading`);
    - `fsdp_activation_checkpointing`: FSDP's own checkpointing of every wrapped layer as well.

    `keys`: the file's fields, so that an error names the one the file used (the deprecated
    `gradient_checkpointing*` or the newer `activation_checkpointing*`).
    """
    on = getattr(args, "activation_checkpointing", None)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) if on is not None else None
    if on is None:  # before transformers' rename
        on = getattr(args, "gradient_checkpointing", False)
        kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
    old = not hasattr(args, "activation_checkpointing") or (
        any(k.startswith("gradient_checkpointing") for k in keys) and not any(k.startswith("activation_") for k in keys))
    name = "gradient_checkpointing_kwargs" if old else "activation_checkpointing_kwargs"
    if not isinstance(on, bool):
        raise RecipeFileError(f"{where}: {name.replace('_kwargs', '')}: expected true or false, got {on!r}")
    kwargs = kwargs or {}
    if not isinstance(kwargs, dict):
        raise RecipeFileError(f"{where}: {name}: expected an object, got {kwargs!r}")
    every = kwargs.get("every_n_layers", 1)
    offload = kwargs.get("offload", False)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise RecipeFileError(f"{where}: {name}: every_n_layers must be a whole number >= 1, got {every!r}")
    if not isinstance(offload, bool):
        raise RecipeFileError(f"{where}: {name}: offload must be true or false, got {offload!r}")
    plugin = getattr(args, "fsdp_plugin_args", None) or {}
    fsdp_ac = bool(getattr(args, "fsdp", None)) and bool(plugin.get("activation_checkpointing"))
    offload_all = bool(getattr(args, "activation_offloading", False))
    if not on and not fsdp_ac and not offload_all:
        return None
    out = {}
    if on:
        out.update(every_n_layers=every, offload=offload, keep_last=1 if offload else 0)
    elif fsdp_ac:
        out.update(every_n_layers=1, offload=False, keep_last=0)
    else:
        out.update(every_n_layers=None, offload=False, keep_last=0)
    if fsdp_ac and on:
        out["fsdp_activation_checkpointing"] = True
    if offload_all:
        out["offload_all"] = True
    return out


def describe_configuration(keywords) -> str:
    """A checkpointing configuration in words."""
    if keywords is None:
        return "no checkpointing"
    every = keywords.get("every_n_layers")
    parts = ["no block checkpointed" if every is None else f"every_n_layers={every}"]
    if every is not None:
        parts.append(f"offload={keywords.get('offload', False)}")
        if keywords.get("offload"):
            parts.append(f"keep_last={keywords.get('keep_last', 1)}")
    for key in ("offload_all", "fsdp_activation_checkpointing", "policy"):
        if keywords.get(key):
            parts.append(f"{key}={keywords[key]}")
    return ", ".join(parts)


def row_for_configuration(keywords) -> dict:
    """The keywords of `MemoryEstimate.configuration` (the estimate's row for exactly this
    configuration, its blocks assigned by `selection.block_modes` as the entry points assign them) for
    a checkpointing configuration read from a file (`checkpointing_configuration`'s keywords; None:
    no checkpointing).

    Raises:
        UnsizedConfiguration: no row sizes it; the message says why.
    """
    if keywords is None:
        return {"checkpointing": False}
    what = describe_configuration(keywords)
    if keywords.get("fsdp_activation_checkpointing"):
        raise UnsizedConfiguration(f"{what}: FSDP's checkpointing of every layer around transformers' own; the "
                                   f"estimate does not size the two nested")
    every = keywords.get("every_n_layers")
    out = {"checkpointing": every is not None, "every_n_layers": every or 1,
           "offload": bool(keywords.get("offload", False)), "keep_last": int(keywords.get("keep_last", 0))}
    for key in ("offload_all", "policy"):
        if keywords.get(key):
            out[key] = keywords[key]  # MemoryEstimate.configuration says why it does not size these
    return out


def _shard(args, ranks, node_ranks, notes, where):
    """The recipe's shard spec (or None) from the FSDP plugin arguments and the DeepSpeed config
    transformers built from the file. Hybrid strategies shard within a node (`node_ranks`)."""
    if getattr(args, "fsdp", None):
        plugin = getattr(args, "fsdp_plugin_args", None)
        if not plugin:  # torch_xla's FSDP
            notes.append("fsdp_config xla: torch_xla's FSDP, not counted")
            return None
        if plugin.get("cpu_offload"):
            notes.append("FSDP cpu_offload (parameters, gradients and states on the host): not counted")
        version = plugin.get("fsdp_version", 1)
        reshard = plugin.get("reshard_after_forward", True)
        if version == 2:
            return f"{'fsdp' if reshard else 'zero2'}:{ranks}"
        strategy = str(reshard).lower()
        kinds = {"full_shard": ("fsdp", ranks), "1": ("fsdp", ranks), "shard_grad_op": ("zero2", ranks),
                 "2": ("zero2", ranks), "hybrid_shard": ("fsdp", node_ranks), "4": ("fsdp", node_ranks),
                 "_hybrid_shard_zero2": ("zero2", node_ranks), "hybrid_shard_zero2": ("zero2", node_ranks),
                 "5": ("zero2", node_ranks)}
        if strategy in ("no_shard", "3"):
            return None
        if strategy not in kinds:
            raise RecipeFileError(f"{where}: fsdp_config: sharding strategy {reshard!r} is not one the estimate sizes")
        kind, n = kinds[strategy]
        return f"{kind}:{n}"
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None and getattr(args, "deepspeed", None):
        stage = ds.get_value("zero_optimization.stage", 0)
        for part in ("offload_optimizer", "offload_param"):
            device = ds.get_value(f"zero_optimization.{part}.device", "none")
            if device not in (None, "none"):
                notes.append(f"DeepSpeed {part} to {device}: not counted")
        if stage in (1, 2, 3):
            return f"zero{stage}:{ranks}"
        if stage not in (0, None):
            raise RecipeFileError(f"{where}: deepspeed: zero_optimization.stage {stage!r} is not a ZeRO stage")
    return None


def _uncounted(args, notes):
    """Settings of the file that change memory and that the estimate does not count."""
    if getattr(args, "torch_compile", False):
        notes.append("torch_compile: not counted (compiled graphs hold other activations)")
    if getattr(args, "auto_find_batch_size", False):
        notes.append("auto_find_batch_size: the run may shrink the batch; the batch counted is the file's")
    if getattr(args, "parallelism_config", None) is not None:
        notes.append("parallelism_config: not counted")
    if getattr(args, "use_liger_kernel", False):
        notes.append("use_liger_kernel: counted as its fused linear cross-entropy only; its other kernels not")


def training_args(path, ranks=1, node_ranks=None, overrides=None) -> dict:
    """The recipe in a TrainingArguments / SFTConfig JSON, as transformers (and TRL) build it.

    Args:
        path: the JSON file (as `to_json_string()` writes it, or by hand).
        ranks: the ranks a full shard divides the static parts among (the file does not say).
        node_ranks: the ranks of one node, which hybrid strategies shard among (default: `ranks`).
        overrides: fields that win over the file's (the command's --optim, --optim-args).

    Returns a dict with `args` (the built object), `batch`, `seq` (TRL's max_length, None without),
    `autocast`, the optimizer's recipe fields (`trainer_optimizer`), `configuration` (the
    checkpointing keywords), `loss`, `grads`, `shard` and `notes` (what is named but not counted).
    """
    data = _load(path, "--training-args")
    where = f"--training-args {path!r}"
    data = {**data, **(overrides or {})}
    args = build_training_arguments(data, where)
    out = _recipe_of(args, where, ranks, node_ranks, set(overrides or ()), keys=set(data))
    out["optim_given"] = "optim" in data
    return out


def _recipe_of(args, where, ranks=1, node_ranks=None, given=(), keys=()):
    notes = []
    out = {"args": args, "notes": notes}
    out["batch"] = _positive(where, args, "per_device_train_batch_size", required=True)
    accumulation = _positive(where, args, "gradient_accumulation_steps", required=True)
    seq = None
    for key in ("max_length", "max_seq_length"):
        if getattr(args, key, None) is not None:
            seq = _positive(where, args, key)
            break
    out["seq"] = seq
    for flag in ("bf16", "fp16", "use_liger_kernel", "torch_compile", "auto_find_batch_size", "activation_offloading"):
        value = getattr(args, flag, False)
        if not isinstance(value, bool):
            raise RecipeFileError(f"{where}: {flag}: expected true or false, got {value!r}")
    out["autocast"] = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    out.update(trainer_optimizer(args, where, notes, explicit_args="optim_args" in given))
    out["configuration"] = checkpointing_configuration(args, where, keys)
    out["loss"] = "fused" if getattr(args, "use_liger_kernel", False) else None
    out["grads"] = "kept" if accumulation > 1 else "freed"
    out["shard"] = _shard(args, ranks, node_ranks or ranks, notes, where)
    _uncounted(args, notes)
    return out


# ---- the optimizer as the Trainer builds it ---------------------------------------------------

def _trainer_resolution(args):
    from transformers import Trainer

    with _no_side_effects():
        return Trainer.get_optimizer_cls_and_kwargs(args)


def trainer_optimizer(args, where="--training-args", notes=None, explicit_args=False) -> dict:
    """The recipe's optimizer fields (`optim`, `amsgrad`, `momentum`, `centered`) of the optimizer
    the Trainer builds for these TrainingArguments: its class and keyword arguments as
    `Trainer.get_optimizer_cls_and_kwargs` resolves them (`optim_args` included, as far as the
    Trainer passes them), read by `recipe.optim_of_class`. Parts of `optim_args` the Trainer does
    not pass are refused where the command's --optim-args gave them (`explicit_args`), else named
    in `notes` (the run ignores them too).

    Raises:
        RecipeFileError: an optimizer the Trainer cannot build here (its package absent, no model
            given) whose states are not known by name, or one whose states this estimate does not know.
    """
    from . import recipe as _recipe

    notes = notes if notes is not None else []
    name = str(getattr(args.optim, "value", args.optim))
    optim_args = args.optim_args
    option = "--optim-args" if explicit_args else f"{where}: optim_args"
    try:
        cls, kwargs = _trainer_resolution(args)
    except (ImportError, ValueError, TypeError, NotImplementedError, AttributeError, KeyError) as err:
        if optim_args and isinstance(err, ValueError) and "unpack" in str(err):
            raise RecipeFileError(f"{option} {optim_args!r}: transformers reads key=value pairs separated by "
                                  f"commas: {_line(err)}") from None
        if name in _recipe._OPTIMS and isinstance(err, ImportError):
            # bitsandbytes absent here: its layout is known by transformers' name.
            notes.append(f"optim {name}: {_line(err).split(':')[0]}; sized by its name")
            return dict(optim=name)
        raise RecipeFileError(f"{where}: optim {name!r}: the Trainer cannot build it here ({type(err).__name__}: "
                              f"{_line(err)}); not sized") from None
    known = _recipe.optim_of_class(cls, kwargs)
    if known is None:
        raise RecipeFileError(f"{where}: optim {name!r} ({cls.__module__}.{cls.__name__}): its states are not "
                              f"known to the estimate (it knows torch's AdamW, SGD, Adagrad and RMSprop, "
                              f"transformers' Adafactor and bitsandbytes' optimizers)")
    if optim_args:
        unused = _unused_optim_args(args, kwargs)
        if unused:
            what = f"the Trainer does not pass {', '.join(unused)} to {cls.__name__} ({name})"
            if explicit_args:
                raise RecipeFileError(f"--optim-args {optim_args!r}: {what}")
            notes.append(f"optim_args {optim_args!r}: {what}; the run ignores it, not counted")
    return known


def _unused_optim_args(args, kwargs):
    """The items of `optim_args` that change nothing the Trainer passes to the optimizer."""
    items = [i for i in str(args.optim_args).split(",") if i.strip()]
    unused = []
    saved = args.optim_args
    try:
        args.optim_args = None
        without = _trainer_resolution(args)[1]
        for item in items:
            args.optim_args = item
            try:
                alone = _trainer_resolution(args)[1]
            except Exception:  # noqa: BLE001 - an item transformers cannot read: not passed either
                alone = without
            if _same(alone, without):
                unused.append(item.strip())
    finally:
        args.optim_args = saved
    return unused


def _same(a, b):
    try:
        return a == b
    except Exception:  # noqa: BLE001 - tensors or other values without a plain ==
        return repr(a) == repr(b)


def optimizer_of(optim=None, optim_args=None) -> tuple:
    """(recipe fields, notes) of the optimizer a Trainer builds for `optim` (None: the
    Trainer's default) and `optim_args`, as the command's --optim / --optim-args give them."""
    data = {}
    if optim is not None:
        data["optim"] = optim
    if optim_args is not None:
        data["optim_args"] = optim_args
    try:
        args = build_training_arguments(data, "--optim")
    except RecipeFileError as err:
        raise RecipeFileError(str(err).replace("--optim: optim_args", "--optim-args", 1)) from None
    notes = []
    return trainer_optimizer(args, "--optim", notes, explicit_args=optim_args is not None), notes


# ---- peft's adapter config --------------------------------------------------------------------

def peft_config(path):
    """The adapter config at `path` (the folder `save_pretrained` writes, or its adapter_config.json),
    loaded by peft's own config loading (`PeftConfig.from_pretrained` / `from_json_file` and
    `from_peft_type`): a `peft.LoraConfig`, with `notes` of what peft ignores.

    Raises:
        RecipeFileError: no such file, not JSON, a field of the wrong type, a value peft refuses,
            or an adapter that is not LoRA.
    """
    import peft

    option = "--peft-config"
    where = f"{option} {path!r}"
    if os.path.isdir(path):
        file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(file):
            raise RecipeFileError(f"{where} is a folder without an adapter_config.json (what save_pretrained writes)")
    else:
        file = path
    data = _load(file, option)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            raw = peft.PeftConfig.from_json_file(file)
        except Exception as err:  # noqa: BLE001
            raise RecipeFileError(f"{where}: peft cannot read it: {_line(err)}") from None
    kind = raw.get("peft_type", "LORA")
    if not isinstance(kind, str) or kind.upper() != "LORA":
        raise RecipeFileError(f"{where}: peft_type: {kind!r}; the estimate sizes LoRA adapters")
    raw = {**raw, "peft_type": "LORA"}
    known = {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init}
    ignored = sorted(k for k in raw if k not in known)
    _check_fields(peft.LoraConfig, {k: v for k, v in raw.items() if k in known}, where, skip=("peft_type",))
    with warnings.catch_warnings(record=True) as more:
        warnings.simplefilter("always")
        try:
            kwargs = peft.PeftConfig.check_kwargs(**raw) if hasattr(peft.PeftConfig, "check_kwargs") else raw
            config = peft.PeftConfig.from_peft_type(**kwargs)
        except Exception as err:  # noqa: BLE001 - peft's validation, whatever it raises
            field = next((k for k in raw if k in str(err)), None)
            raise RecipeFileError(f"{where}: {field + ': ' if field else ''}peft refuses it: {_line(err)}") from None
    del data, caught, more
    notes = [f"adapter_config {k}: ignored by peft {peft.__version__}" for k in ignored]
    return config, notes
