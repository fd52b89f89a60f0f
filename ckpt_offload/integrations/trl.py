"""TRL integration: `activation_offloading=True` in TRL's trainers (SFT, DPO, KTO, Reward) through the
async engine: pinned pool, prefetch by layer, ckpt_offload.stats(). install() replaces TRL's
get_act_offloading_ctx_manager wherever TRL holds it; uninstall() puts TRL's own back.
"""
from __future__ import annotations

import functools
import inspect
import warnings

try:
    import trl.models.activation_offloading as _source
except ImportError as err:  # pragma: no cover - exercised only without trl
    raise ImportError("ckpt_offload.integrations.trl needs trl: pip install trl") from err

from torch import nn

from .._args import check_bool as _check_bool
from .._args import check_int as _check_int
from .._args import check_prefetch as _check_prefetch
from ..activations import offload_activations
from .. import find_repeated_blocks
from .._patching import NamePatch
from ..sizing import budget as _budget
from ..engine import host_pool

_NAME = "get_act_offloading_ctx_manager"
_patch = NamePatch("trl", _NAME)
_settings = {"keep_last": None, "prefetch": 2, "prefetch_bytes": None, "budget": None}


def output_head(model: nn.Module):
    """The module whose forward TRL's offloader leaves on the device, found as TRL finds it: the model
    unwrapped (.module, then a PEFT model's base_model), then the first of output (or output.linear),
    lm_head, decoder.output or decoder.lm_head, final_layer_norm or ln_f, head. None if none."""
    m = model
    if hasattr(m, "module"):
        m = m.module
    if hasattr(m, "base_model") and hasattr(m, "peft_config"):
        m = m.base_model
    if hasattr(m, "output"):
        out = m.output
        if isinstance(out, nn.Module):
            return out
        linear = getattr(out, "linear", None)
        return linear if isinstance(linear, nn.Module) else None
    if hasattr(m, "lm_head"):
        return m.lm_head
    if hasattr(m, "decoder"):
        decoder = m.decoder
        for name in ("output", "lm_head"):
            if hasattr(decoder, name):
                return getattr(decoder, name)
        return None
    if hasattr(m, "final_layer_norm") or hasattr(m, "ln_f"):
        return getattr(m, "final_layer_norm", None) or m.ln_f
    head = getattr(m, "head", None)
    return head if isinstance(head, nn.Module) else None


def _liger_modules(model):
    # TRL keeps every module with "liger" in its name on the device too (fused kernels that save little).
    return [mod for name, mod in model.named_modules() if "liger" in name.lower()]


def _ctx_manager(model, use_pin_memory=True, use_streams=True, min_offload_size=1024, max_fwd_stash_size=5,
                 warn_if_no_head=True):
    """TRL's get_act_offloading_ctx_manager, served by ckpt_offload: returns an offload_activations
    context (min_bytes=min_offload_size, the output head and Liger modules excluded, prefetch counted
    in the model's repeated blocks, keep_last=max_fwd_stash_size with streams, 0 without)."""
    where = f"{_NAME} (ckpt_offload.integrations.trl)"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("use_pin_memory", use_pin_memory), ("use_streams", use_streams),
                        ("warn_if_no_head", warn_if_no_head)):
        _check_bool(where, name, value)
    _check_int(where, "min_offload_size", min_offload_size, 0)
    _check_int(where, "max_fwd_stash_size", max_fwd_stash_size, 1)
    if not use_pin_memory:
        warnings.warn(f"{where}: use_pin_memory=False is ignored: the host pool's memory is always pinned",
                      UserWarning, stacklevel=2)
    head = output_head(model)
    if head is None and warn_if_no_head:
        warnings.warn(
            f"{where}: no output head found (output, lm_head, decoder.output, ...): its activations are "
            "offloaded with the rest, and backward reloads them first. Pass warn_if_no_head=False to silence this.",
            UserWarning,
            stacklevel=2,
        )
    if _settings["budget"] is not None:
        host_pool().set_capacity("auto")
    keep_last = _settings["keep_last"]
    if keep_last is None:
        # TRL's stash keeps the device copies of the last max_fwd_stash_size saved tensors alive into
        # backward and uses them there; these stay on the device without being copied at all.
        keep_last = max_fwd_stash_size if use_streams else 0
    return offload_activations(
        min_bytes=min_offload_size,
        keep_last=keep_last,
        prefetch=_settings["prefetch"],
        prefetch_bytes=_settings["prefetch_bytes"],
        layers=find_repeated_blocks(model) or None,
        exclude=([head] if head is not None else []) + _liger_modules(model),
    )


def install(keep_last=None, prefetch: int = 2, prefetch_bytes=None, *, budget=None) -> None:
    """Routes TRL's activation_offloading=True to the async engine, for every TRL trainer.

    TRL's get_act_offloading_ctx_manager is replaced in its own module, in trl.models (from which
    the trainers import it, also those imported later) and in every TRL module already holding it.
    The trainers then wrap each training_step in offload_activations: saved tensors of at least
    min_offload_size (1 KiB) go to the pinned pool, parameters never, the output head's stay.
    prefetch / prefetch_bytes: how many of the model's repeated blocks (its layers), counting the one
    backward is in, are on their way back ahead of need: all that a layer saved (with gradient
    checkpointing, its inputs) moves as one unit; tensors for a model without repeated blocks. keep_last:
    the last N saved tensors that stay on the device; None: TRL's max_fwd_stash_size (5) as TRL's
    stash does, 0 with use_streams=False. budget="auto": when a trainer takes the route, the host
    pool is capped at this rank's share of the node (host_pool().set_capacity("auto")); what does
    not fit stays on the device (or goes to the disk tier). Calling it again changes the settings
    for trainers created from then on; uninstall() restores TRL's own function everywhere.
    """
    if keep_last is not None:
        _check_int("trl.install", "keep_last", keep_last, 0)
    _check_prefetch("trl.install", prefetch, prefetch_bytes)
    _budget.check_route_budget("trl.install", budget)
    _settings.update(keep_last=keep_last, prefetch=prefetch, prefetch_bytes=prefetch_bytes, budget=budget)
    if _patch.installed():
        return
    original = _source.__dict__[_NAME]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def routed(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)  # TRL's own argument errors, then ours
        return _ctx_manager(**bound.arguments)

    import trl.models  # the lazy module the trainers import the name from

    _patch.install(original, routed, also=(_source, trl.models))


def uninstall() -> None:
    """Undoes install(): TRL's own offloader again, in every TRL module that holds ours (also those
    imported while installed). Trainers created while installed keep their context until rebuilt.
    No-op if not installed."""
    _patch.uninstall()


def installed() -> bool:
    """Whether install() is in effect."""
    return _patch.installed()
