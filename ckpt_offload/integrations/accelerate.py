"""accelerate integration: FSDP2's activation_checkpointing_offload=True through the async engine.

install() replaces accelerate's fsdp2_apply_ac wherever accelerate holds it: with the offload flag
on, the layers accelerate would wrap in offload_wrapper(checkpoint_wrapper(...)) are checkpointed by
ckpt_offload.enable_checkpointing(..., offload=True) instead; without it, accelerate's own code runs.
"""
from __future__ import annotations

import functools

try:
    import accelerate.utils.fsdp_utils as _source
except ImportError as err:  # pragma: no cover - exercised only without accelerate
    raise ImportError("ckpt_offload.integrations.accelerate needs accelerate: pip install accelerate") from err

from .. import enable_checkpointing
from .._args import check_prefetch as _check_prefetch
from .._patching import NamePatch
from ..sizing import budget as _budget
from ..engine import host_pool

_NAME = "fsdp2_apply_ac"
_patch = NamePatch("accelerate", _NAME)
_settings = {"keep_last": 1, "prefetch": 1, "prefetch_bytes": None, "budget": None}


def wrapped_layers(plugin, model) -> list:
    """The modules accelerate's fsdp2_apply_ac checkpoints for `plugin` (its auto-wrap policy over
    every submodule but the model itself), in forward order; a match inside another match is
    left out: the outer layer's checkpoint recomputes it already. None without a policy."""
    policy = _source.fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        return None
    chosen = set()
    for _, layer in _source.get_module_children_bottom_up(model, return_fqns=True)[:-1]:
        if policy(layer):
            chosen.add(id(layer))
    layers, inside = [], set()
    for m in model.modules():  # pre-order: an outer match comes before the modules inside it
        if id(m) in inside:
            continue
        if id(m) in chosen:
            layers.append(m)
            inside.update(id(sub) for sub in m.modules())
    return layers


def install(keep_last: int = 1, prefetch: int = 1, prefetch_bytes=None, *, budget=None) -> None:
    """Routes FSDP2's activation_checkpointing_offload=True to the async engine.

    accelerate's fsdp2_apply_ac is replaced in every accelerate module that holds it (fsdp_utils,
    accelerate.utils, accelerator). With activation_checkpointing_offload=True, Accelerator.prepare
    then checkpoints the layers the plugin's auto-wrap policy selects through
    ckpt_offload.enable_checkpointing(model, layers=..., offload=True, keep_last=..., prefetch=...,
    prefetch_bytes=...): their inputs go to the pinned pool asynchronously, the last keep_last stay on
    the device, prefetch layers come back ahead of need. With the flag off, or no auto-wrap policy,
    accelerate's own fsdp2_apply_ac runs. budget="auto": when prepare takes the route, the host
    pool is capped at this rank's share of the node (host_pool().set_capacity("auto")). Calling it
    again changes the settings; uninstall() restores accelerate's own function.
    """
    _check_prefetch("accelerate.install", prefetch, prefetch_bytes, keep_last)
    _budget.check_route_budget("accelerate.install", budget)
    _settings.update(keep_last=keep_last, prefetch=prefetch, prefetch_bytes=prefetch_bytes, budget=budget)
    if _patch.installed():
        return
    original = _source.__dict__[_NAME]

    @functools.wraps(original)
    def routed(accelerator, model):
        plugin = accelerator.state.fsdp_plugin
        layers = wrapped_layers(plugin, model) if plugin.activation_checkpointing_offload else None
        if not layers:
            return original(accelerator, model)
        if _settings["budget"] is not None:
            host_pool().set_capacity("auto")
        enable_checkpointing(
            model,
            layers=layers,
            offload=True,
            keep_last=min(_settings["keep_last"], len(layers)),
            prefetch=_settings["prefetch"],
            prefetch_bytes=_settings["prefetch_bytes"],
        )
        return model

    _patch.install(original, routed)


def uninstall() -> None:
    """Undoes install(): accelerate's own offload_wrapper(checkpoint_wrapper(...)) again. Models
    prepared while it was installed keep their engine offload. No-op if not installed."""
    _patch.uninstall()


def installed() -> bool:
    """Whether install() is in effect."""
    return _patch.installed()
