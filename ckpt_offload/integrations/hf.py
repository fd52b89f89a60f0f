"""transformers integration: its own gradient checkpointing, with the async engine for offload.

enable() keeps transformers' layer selection (GradientCheckpointingLayer, every_n_layers) and only
replaces the synchronous save_on_cpu offload of `activation_checkpointing_enable(offload=True)`
(`gradient_checkpointing_enable` before transformers renamed it).
OffloadCallback does the same for a Trainer run from its TrainingArguments; install() does it
for transformers' own offload=True everywhere.
"""
from __future__ import annotations

import functools
import inspect
import logging
import warnings

import torch

try:
    import transformers
    from transformers import TrainerCallback
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "ckpt_offload.integrations.hf needs transformers>=5 (and accelerate for Trainer): pip install transformers accelerate"
    ) from err

from ..sizing import budget as _budget
from .. import policies
from ..attachment import Attachment, offloaded_of, owner_of
from .._args import CHECKPOINT_KEYS as _CHECKPOINT_KEYS
from .._args import check_bool as _check_bool
from .._args import check_keywords as _check_keywords
from .._args import check_int as _check_int
from .._args import check_prefetch as _check_prefetch
from .._args import check_not_reentrant as _check_not_reentrant
from .._args import warn_at_caller as _warn_at_caller
from ..model import checkpointing_state, disable_checkpointing
from ..selection import block_modes, checkpointed_indices

log = logging.getLogger("ckpt_offload")

# The keywords that go on to torch.utils.checkpoint.checkpoint (through transformers' checkpointing
# kwargs): torch's own options, nothing else; anything else would reach the decoder layer's
# **kwargs, which ignore it.
CHECKPOINT_KWARGS = ("use_reentrant", *_CHECKPOINT_KEYS)
# What the checkpointing kwargs of TrainingArguments may hold for OffloadCallback and hf.install().
_TRAINING_KWARGS = ("every_n_layers", "offload", *CHECKPOINT_KWARGS)


# transformers renamed its switches during 5.x (gradient_checkpointing_* became
# activation_checkpointing_*, the old names kept as deprecated aliases until v6): these use the new
# names where they exist and the old ones before.
def checkpointing_enable(model, checkpoint_kwargs=None, every_n_layers: int = 1, offload: bool = False) -> None:
    """transformers' own checkpointing of `model`, through whichever name this transformers has.

    offload: False by default, transformers' own default: this is transformers' call (with its
    synchronous save_on_cpu for offload=True), the one switch of this package that is not
    ckpt_offload's. Every ckpt_offload entry point offloads by default.
    """
    _check_int("hf.checkpointing_enable", "every_n_layers", every_n_layers, 1)
    _check_bool("hf.checkpointing_enable", "offload", offload)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=checkpoint_kwargs, every_n_layers=every_n_layers, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=checkpoint_kwargs, every_n_layers=every_n_layers, offload=offload
        )


def checkpointing_disable(model) -> None:
    """transformers' own checkpointing off, through whichever name this transformers has."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def install_checkpointing_args(every_n_layers: int = 1, offload: bool = True, **checkpoint_kwargs) -> dict:
    """Calls install() when offload=True (a process-wide change: transformers' own offload=True goes
    through the async engine for every model and Trainer of this process, until uninstall()), and
    returns the TrainingArguments keywords that turn checkpointing on, under this transformers' names:
    transformers.TrainingArguments(..., **install_checkpointing_args(every_n_layers=2)).

    | argument | default | meaning |
    |---|---|---|
    | every_n_layers | 1 | transformers' layer selection: layer index % n == 0 |
    | offload | True | True by default, as at every ckpt_offload entry point; False: checkpointing only, and nothing installed |
    | **checkpoint_kwargs | | only torch.utils.checkpoint.checkpoint's own options: use_reentrant (False or None), preserve_rng_state, context_fn, determinism_check, debug, early_stop, respect_saved_tensors_hooks |

    With offload=True, the install is what makes the Trainer's own offload=True go through the engine
    with or without OffloadCallback; with the callback, its settings (keep_last, prefetch) apply.
    Without this call, the keywords alone would make transformers offload with its own save_on_cpu.
    Its earlier name, checkpointing_args, remains as a deprecated alias that warns.

    Raises:
        TypeError: a keyword that is none of these (the message names the closest one); transformers
            would hand it to the decoder layers, which ignore it.
    """
    where = "hf.install_checkpointing_args"
    _check_keywords(where, checkpoint_kwargs, CHECKPOINT_KWARGS, own=install_checkpointing_args)
    _check_int(where, "every_n_layers", every_n_layers, 1)
    _check_bool(where, "offload", offload)
    _check_not_reentrant(where, checkpoint_kwargs.get("use_reentrant"))
    if offload:
        install()
    fields = getattr(transformers.TrainingArguments, "__dataclass_fields__", {})
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"every_n_layers": every_n_layers, "offload": offload, **checkpoint_kwargs}}


def checkpointing_args(every_n_layers: int = 1, offload: bool = True, **checkpoint_kwargs) -> dict:
    """Deprecated alias of install_checkpointing_args, whose name says that with offload=True it
    also calls install() (a process-wide change), which this name hid. Warns (FutureWarning)."""
    _warn_at_caller(
        "hf.checkpointing_args is deprecated: use hf.install_checkpointing_args, the same call under a name that says "
        "what it does (with offload=True it calls hf.install(), routing transformers' own offload=True through "
        "the engine for the whole process)",
        FutureWarning,
    )
    return install_checkpointing_args(every_n_layers, offload, **checkpoint_kwargs)


def training_args_checkpointing(args):
    """(on, kwargs) of a TrainingArguments: activation_checkpointing[_kwargs], or the older
    gradient_checkpointing[_kwargs]."""
    if hasattr(args, "activation_checkpointing"):
        return bool(args.activation_checkpointing), dict(args.activation_checkpointing_kwargs or {})
    return bool(args.gradient_checkpointing), dict(args.gradient_checkpointing_kwargs or {})


def _transformers_model(where, model):
    """The transformers model `model` is, or the one inside its wrapper (peft's PeftModel,
    torch.compile's OptimizedModule, DataParallel)."""
    target = owner_of(model) if isinstance(model, torch.nn.Module) else model
    if not isinstance(target, transformers.PreTrainedModel):
        raise TypeError(
            f"{where}: model must be a transformers PreTrainedModel or a wrapper of one (peft's PeftModel, "
            f"torch.compile's OptimizedModule, DataParallel), got {type(model).__name__}"
        )
    return target


def enable(model, every_n_layers: int = 1, offload: bool = True, keep_last: int = 1, prefetch: int = 1,
           prefetch_bytes=None, policy=None, *, budget_bytes=None, example_inputs=None, loss_fn=None,
           host_budget_bytes=None, optimizer="default", **checkpoint_kwargs):
    """Turns on transformers' gradient checkpointing for `model` with the same layer selection
    transformers uses for every_n_layers; with offload=True the checkpointed layers' inputs go
    through the async engine (the last keep_last checkpointed layers stay on the device).

    | argument | default | meaning |
    |---|---|---|
    | every_n_layers | 1 | transformers' selection: layer index % n == 0 |
    | offload | True | True by default, as at every ckpt_offload entry point; False: checkpointing only |
    | keep_last | 1 | the last checkpointed layers whose inputs stay on the device |
    | prefetch, prefetch_bytes | 1, None | offloaded layers on their way back ahead of need |
    | **checkpoint_kwargs | | only torch.utils.checkpoint.checkpoint's own options: use_reentrant (False or None), preserve_rng_state, context_fn, determinism_check, debug, early_stop, respect_saved_tensors_hooks |

    Any other keyword raises TypeError naming the closest parameter (a misspelt offload= would
    otherwise reach the decoder layers' **kwargs, which ignore it).
    policy: selective checkpointing inside the layers, as for enable_checkpointing ("attention":
    the outputs of scaled-dot-product attention, transformers' default, offloaded with the layer).
    Returns the 0-based indices of the checkpointed GradientCheckpointingLayer modules.

    model: a PreTrainedModel, or a wrapper of one (peft's PeftModel, as get_peft_model and
    SFTTrainer(peft_config=...) make; torch.compile's OptimizedModule; DataParallel). A model that
    becomes a PeftModel afterwards keeps the configuration. Every argument is checked before the
    model is touched: a call that raises leaves the earlier configuration as it was.

    When transformers' own enable runs again on the model (a Trainer or SFTTrainer with
    gradient_checkpointing on does, at the start of training), this configuration stays in force,
    with one warning; transformers' own disable (or disable(model)) removes it.

    With budget_bytes: ckpt_offload.plan_memory(model, example_inputs, budget_bytes, loss_fn=...,
    host_budget_bytes=...) chooses a mode per layer instead, and the plan is applied and returned.
    budget_bytes="auto" reads both budgets off the device and the node (see plan_memory; optimizer:
    whose states to count before they exist); example_inputs should then be the longest batch the
    run will see.
    """
    _check_keywords("hf.enable", checkpoint_kwargs, CHECKPOINT_KWARGS, own=enable)
    target = _transformers_model("hf.enable", model)
    if budget_bytes is not None:
        return _enable_planned(model, target, budget_bytes, example_inputs, loss_fn, host_budget_bytes,
                               checkpoint_kwargs, optimizer)
    _check_int("hf.enable", "every_n_layers", every_n_layers, 1)
    _check_prefetch("hf.enable", prefetch, prefetch_bytes, keep_last)
    _check_bool("hf.enable", "offload", offload)
    _check_not_reentrant("hf.enable", checkpoint_kwargs.pop("use_reentrant", None))
    if policy is not None and "context_fn" in checkpoint_kwargs:
        raise ValueError("hf.enable: pass policy= or a context_fn, not both (policy builds the context_fn)")
    if not target.supports_gradient_checkpointing:
        raise ValueError(f"hf.enable: {type(target).__name__} does not support gradient checkpointing")
    policy = policies.prepare("hf.enable", policy)
    layers = [m for m in target.modules() if isinstance(m, GradientCheckpointingLayer)]
    # transformers' own selection (PreTrainedModel._set_gradient_checkpointing): layer index % n == 0.
    checkpointed = checkpointed_indices(len(layers), every_n_layers)
    block_modes(len(layers), offload=offload, keep_last=keep_last, checkpointed=checkpointed, where="hf.enable")
    contexts = policies.per_block("hf.enable", policy, checkpointed)
    # Everything is checked: from here on the model changes.
    disable_checkpointing(target)
    checkpointing_enable(target, {"use_reentrant": False, **checkpoint_kwargs}, every_n_layers=every_n_layers)
    # The layers transformers' selection checkpointed, read off them; which of those offload is ours.
    checkpointed = [i for i, m in enumerate(layers) if m.gradient_checkpointing]
    modes = block_modes(len(layers), offload=offload, keep_last=keep_last, checkpointed=checkpointed, where="hf.enable")
    offloaded_of("hf.enable", modes, offload, keep_last, every_n_layers)
    Attachment(target, layers, modes, hf=True, contexts=contexts, checkpoint_kwargs=checkpoint_kwargs,
               prefetch=prefetch, prefetch_bytes=prefetch_bytes).attach()
    return checkpointed


def _enable_planned(model, target, budget_bytes, example_inputs, loss_fn, host_budget_bytes, checkpoint_kwargs,
                    optimizer="default"):
    from ..planner import _check_budget
    from ..sizing.plan import plan_memory

    if not isinstance(example_inputs, tuple):
        raise TypeError(
            "hf.enable: budget_bytes needs example_inputs, a tuple of the model's positional arguments (input_ids,), "
            f"got {type(example_inputs).__name__}"
        )
    if checkpoint_kwargs:
        raise TypeError(f"hf.enable: budget_bytes takes no checkpoint keywords, got {sorted(checkpoint_kwargs)}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"hf.enable: loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if not _budget.is_auto(budget_bytes):
        _check_budget("hf.enable", budget_bytes, None if _budget.is_auto(host_budget_bytes) else host_budget_bytes)
    disable(target)
    plan = plan_memory(model, example_inputs, budget_bytes, loss_fn=loss_fn, host_budget_bytes=host_budget_bytes,
                       optimizer=optimizer)
    plan.apply(model)
    return plan


def disable(model) -> None:
    """transformers' own checkpointing off, and ckpt_offload's configuration (offload, a plan's
    modes) gone. model: as for enable()."""
    target = _transformers_model("hf.disable", model)
    disable_checkpointing(target)
    checkpointing_disable(target)


def state(model):
    """(checkpointed indices, offloaded indices) of a model enable() configured, read off what its
    layers run (see ckpt_offload.checkpointing_state), or None."""
    return checkpointing_state(model)


def _arrow_longest(dataset):
    """The longest `input_ids` row of a datasets.Dataset read off its Arrow table (list lengths, no
    Python lists made), or None: another dataset, or one whose rows are a selection of its table
    (select, shuffle, filter), which is read row by row instead."""
    table = getattr(dataset, "data", None)
    if getattr(dataset, "_indices", None) is not None or not hasattr(table, "column"):
        return None
    if "input_ids" not in (getattr(dataset, "column_names", None) or ()):
        return None
    try:
        import pyarrow.compute as pc

        n = pc.max(pc.list_value_length(table.column("input_ids"))).as_py()
    except (ImportError, TypeError, ValueError, KeyError, NotImplementedError, AttributeError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def _notice(state, message):
    """Something a Trainer user should see (a plan, a setting the callback made): printed on the main
    process, as the Trainer prints its own logs, and logged at INFO on the "ckpt_offload" logger."""
    log.info(message)
    if state is None or getattr(state, "is_world_process_zero", True):
        print(message, flush=True)


class OffloadCallback(TrainerCallback):
    """Makes a Trainer run checkpoint and offload through the async engine; on its own it is enough.

    At the start of training the model is configured through enable(): with the settings of the
    TrainingArguments' checkpointing kwargs (activation_checkpointing_kwargs, or
    gradient_checkpointing_kwargs before transformers' rename: every_n_layers, offload, torch's
    checkpoint options; any other key raises TypeError) when they turn checkpointing on; when they
    do not, every layer is checkpointed and offloaded (a notice says so, printed on the main process
    and logged at INFO on the "ckpt_offload" logger), unless ckpt_offload already configured the model (hf.enable before the Trainer),
    which is kept. offload is True unless those kwargs say "offload": False, as at every
    ckpt_offload entry point. keep_last / prefetch / prefetch_bytes are this callback's own.
    Arguments from install_checkpointing_args(offload=True) offload through the engine without the
    callback too (that call installs the routing, see install()); the callback adds its settings.

    budget="auto": at the start of training, a mode per layer is planned instead
    (enable(budget_bytes="auto")) for the longest batch the run will see: `max_length` if given
    here, else the training arguments' `max_length` / `max_seq_length` (TRL's configs), else the
    longest `input_ids` of the training dataset, at `per_device_train_batch_size`. The Trainer's
    optimizer is counted before its first step allocates its states. The plan is `self.plan`; its
    summary is printed on the main process (and logged). Where the TrainingArguments turn
    checkpointing on and the plan checkpoints other layers (or none), a warning says what it
    replaced. The plan's profiling steps do not count in stats(), which starts again from zero.
    """

    def __init__(self, keep_last: int = 1, prefetch: int = 1, prefetch_bytes=None, *, budget=None, max_length=None):
        _check_prefetch("OffloadCallback", prefetch, prefetch_bytes, keep_last)
        if budget is not None and not _budget.is_auto(budget):
            raise ValueError(f"OffloadCallback: budget must be None or 'auto', got {budget!r} "
                             "(a budget in bytes: hf.enable(model, budget_bytes=..., example_inputs=...))")
        if max_length is not None:
            _check_int("OffloadCallback", "max_length", max_length, 1)
        self.keep_last = keep_last
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self.budget = budget
        self.max_length = max_length
        self.checkpointed = None
        self.plan = None

    def _longest(self, args, train_dataloader):
        for n in (self.max_length, getattr(args, "max_length", None), getattr(args, "max_seq_length", None)):
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
        dataset = getattr(train_dataloader, "dataset", None)
        dataset_format = getattr(dataset, "format", None)
        if isinstance(dataset_format, dict) and dataset_format.get("type") == "custom":
            # with_transform / set_transform: the rows are made as they are read, so neither the
            # Arrow table's lengths nor any column is theirs, and reading them all would run the
            # transform (a tokenizer) over the whole dataset.
            raise ValueError(self._unknown_length("the training dataset's rows are made by a transform "
                                                  "(with_transform / set_transform) as they are read"))
        n = _arrow_longest(dataset)
        if n:
            return n
        try:
            # A datasets.Dataset hands its column over at once; a map-style dataset is read row by row.
            column = dataset["input_ids"] if hasattr(dataset, "column_names") else None
            rows = column if column is not None else (dataset[i]["input_ids"] for i in range(len(dataset)))
            lengths = [len(r) for r in rows]
        except (TypeError, KeyError, IndexError, ValueError):  # datasets: ValueError for a missing column
            lengths = []
        if lengths:
            return max(lengths)
        raise ValueError(self._unknown_length("no 'input_ids' in the training dataset"))

    @staticmethod
    def _unknown_length(why):
        return ("OffloadCallback(budget='auto'): the longest batch of the run is unknown (no max_length here or in "
                f"the training arguments, and {why}); pass OffloadCallback(budget='auto', max_length=N)")

    def _enable_auto(self, args, state, model, kwargs):
        target = _transformers_model("OffloadCallback", model)
        seq = self._longest(args, kwargs.get("train_dataloader"))
        batch = args.per_device_train_batch_size
        vocab = target.config.get_text_config().vocab_size
        device = next(p.device for p in target.parameters())
        gen = torch.Generator(device="cpu").manual_seed(0)
        input_ids = torch.randint(vocab, (batch, seq), generator=gen).to(device)

        def loss_fn(out):
            # As transformers' causal-LM loss does: the logits upcast to fp32 before the cross-entropy.
            return torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), input_ids.flatten())

        optimizer = kwargs.get("optimizer") or "default"
        self.plan = enable(model, budget_bytes="auto", example_inputs=(input_ids,), loss_fn=loss_fn,
                           optimizer=optimizer)
        self.checkpointed = [i for i, m in enumerate(self.plan.modes) if m.startswith("checkpoint")]
        _notice(state, f"OffloadCallback(budget='auto'): planned for batch {batch} x {seq} tokens: {self.plan.summary()}")
        on, gc_kwargs = training_args_checkpointing(args)
        every_n_layers = gc_kwargs.get("every_n_layers", 1)
        asked = list(range(0, len(self.plan.modes), every_n_layers)) if isinstance(every_n_layers, int) and every_n_layers > 0 else None
        if on and asked != self.checkpointed:
            # The plan replaces a setting the user made: said where a Trainer user sees it.
            _warn_at_caller(
                f"OffloadCallback(budget='auto'): the TrainingArguments turn checkpointing on (layers {asked}, "
                f"every_n_layers={every_n_layers}); the plan replaces that: layers {self.checkpointed} checkpointed, "
                f"offloaded {checkpointing_state(model)[1]} (leave budget out to keep the TrainingArguments' checkpointing)",
                UserWarning,
            )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.budget is not None:
            self._enable_auto(args, state, model, kwargs)
            return
        on, gc_kwargs = training_args_checkpointing(args)
        where = "OffloadCallback (checkpointing kwargs of TrainingArguments)"
        _check_keywords(where, gc_kwargs, _TRAINING_KWARGS)
        every_n_layers = gc_kwargs.pop("every_n_layers", 1)
        offload = gc_kwargs.pop("offload", True)
        _check_int(where, "every_n_layers", every_n_layers, 1)
        _check_bool(where, "offload", offload)
        _check_not_reentrant(where, gc_kwargs.pop("use_reentrant", None))
        configured = None if on else checkpointing_state(model)
        if configured is not None:
            # hf.enable (or a plan) configured the model before the Trainer: that configuration stands.
            self.checkpointed = configured[0]
            _notice(state, "OffloadCallback: checkpointing is off in the TrainingArguments; the model keeps the "
                           "configuration ckpt_offload gave it before training (checkpointed %s, offloaded %s)"
                           % configured)
            return
        if not offload:
            warnings.warn(
                "OffloadCallback: the checkpointing kwargs of TrainingArguments say 'offload': False; "
                "checkpointing runs without offload (leave the key out, or set it True, to offload)"
            )
        self.checkpointed = enable(
            model,
            every_n_layers=every_n_layers,
            offload=offload,
            keep_last=min(self.keep_last, self._count(model, every_n_layers)),
            prefetch=self.prefetch,
            prefetch_bytes=self.prefetch_bytes,
            **gc_kwargs,
        )
        if not on:
            _notice(state, "OffloadCallback: checkpointing is off in the TrainingArguments; the callback turns it on "
                           "(hf.enable): every_n_layers=%d (%d layers checkpointed), offload=%s, keep_last=%d; "
                           "checkpointed %s, offloaded %s"
                           % (every_n_layers, len(self.checkpointed), offload,
                              min(self.keep_last, len(self.checkpointed)) if offload else 0,
                              *checkpointing_state(model)))

    @staticmethod
    def _count(model, every_n_layers):
        n = sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
        return len(checkpointed_indices(n, every_n_layers))


# -- install(): transformers' own offload=True through the engine -------------------------------------
# Both names (activation_checkpointing_enable and the deprecated gradient_checkpointing_enable), the
# Trainer and subclasses that override either all end in one PreTrainedModel method: the private
# _activation_checkpointing_enable since the rename, gradient_checkpointing_enable itself before.
# That method is the one replaced, so every way in is covered by one patch; its disable twin too,
# so that transformers' own disable also removes the engine's hooks.
_installed = []  # [(method name, transformers' function, our replacement)] while installed


def _patch_point(kind):
    owner = transformers.PreTrainedModel
    for name in (f"_activation_checkpointing_{kind}", f"gradient_checkpointing_{kind}"):
        if name in owner.__dict__:
            return name
    raise RuntimeError(  # pragma: no cover - a transformers release this module does not know
        f"hf.install: transformers {transformers.__version__} has neither PreTrainedModel._activation_checkpointing_{kind} "
        f"nor gradient_checkpointing_{kind}; this release is not supported"
    )


def install() -> None:
    """Routes transformers' own offload=True to the async engine, for every model and Trainer.

    After it, model.activation_checkpointing_enable(..., offload=True) (gradient_checkpointing_enable
    in older releases and as the deprecated alias), and a Trainer whose TrainingArguments carry
    {"offload": True} in their checkpointing kwargs, keep transformers' layer selection and offload
    as enable(model, every_n_layers=..., offload=True) does, with keep_last=1 and prefetch=1.
    offload=False is transformers' own path, unchanged; so is its disable, which also drops the
    engine's hooks. Calling it again does nothing; uninstall() restores transformers' own code.
    """
    if _installed:
        return
    name = _patch_point("enable")
    original = transformers.PreTrainedModel.__dict__[name]
    signature = inspect.signature(original)
    kwargs_name = list(signature.parameters)[1]  # activation_ or gradient_checkpointing_kwargs

    @functools.wraps(original)
    def routed(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        offload = bound.arguments.get("offload", False)
        where = f"{type(self).__name__}.{name.lstrip('_')} under hf.install()"
        _check_bool(where, "offload", offload)
        checkpoint_kwargs = dict(bound.arguments.get(kwargs_name) or {})
        # Checked on both paths, when checkpointing is turned on (a Trainer does it as train() starts):
        # transformers would hand a misspelt key to torch's checkpoint, which refuses it only at the
        # first forward. The Trainer takes every_n_layers and offload out of its kwargs first, so a
        # near miss of those is named too.
        _check_keywords(where, checkpoint_kwargs, CHECKPOINT_KWARGS, own=("every_n_layers", "offload"),
                        note=" (the keys of the TrainingArguments' checkpointing kwargs: every_n_layers, offload and "
                             "these)")
        if not offload:
            disable_checkpointing(self)  # transformers' own checkpointing replaces ours: our hooks go
            return original(*bound.args, **bound.kwargs)
        _check_not_reentrant(where, checkpoint_kwargs.pop("use_reentrant", None))
        every_n_layers = bound.arguments.get("every_n_layers", 1)
        _check_int(where, "every_n_layers", every_n_layers, 1)
        # enable() turns transformers' checkpointing on through this method again, with
        # offload=False (transformers' own path above), then puts the engine in.
        enable(self, every_n_layers=every_n_layers, offload=True,
               keep_last=min(1, OffloadCallback._count(self, every_n_layers)), **checkpoint_kwargs)

    off_name = _patch_point("disable")
    off_original = transformers.PreTrainedModel.__dict__[off_name]

    @functools.wraps(off_original)
    def routed_off(self, *args, **kwargs):
        disable_checkpointing(self)
        return off_original(self, *args, **kwargs)

    for n, f in ((name, routed), (off_name, routed_off)):
        _installed.append((n, transformers.PreTrainedModel.__dict__[n], f))
        setattr(transformers.PreTrainedModel, n, f)


def uninstall() -> None:
    """Undoes install(): transformers' own offload=True (save_on_cpu) again. Models configured
    while it was installed keep their engine offload until reconfigured. No-op if not installed."""
    for name, _, routed in _installed:
        if transformers.PreTrainedModel.__dict__.get(name) is not routed:
            raise RuntimeError(
                f"hf.uninstall: transformers.PreTrainedModel.{name} was replaced again after hf.install(); "
                "undo that replacement first, so that restoring transformers' own does not drop it"
            )
    while _installed:
        name, original, _ = _installed.pop()
        setattr(transformers.PreTrainedModel, name, original)


def installed() -> bool:
    """Whether install() is in effect."""
    return bool(_installed)
