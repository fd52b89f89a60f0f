"""enable_checkpointing / disable_checkpointing: checkpoint (and offload) a model's repeated blocks."""
from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from .checkpointing import run_checkpoint, warn_kwarg_tensors
from .compile import compile_options, compiled, eager_boundary, layer_checkpoint_function
from ._args import check_bool as _check_bool
from ._args import check_int as _check_int
from ._args import check_prefetch as _check_prefetch
from ._args import check_not_reentrant as _check_not_reentrant
from . import policies
from .session import OffloadSession

_STATE_ATTR = "_ckpt_offload_state"
# integrations.hf.enable (directly, through OffloadCallback or hf.install) keeps its state here:
# (checkpointed indices, offloaded indices, hook handles).
HF_STATE_ATTR = "_ckpt_offload_hf"


def _gc_layer_class():
    # Only look for transformers' layer class when transformers is already loaded: a model built
    # with it has imported it, and importing it for a plain torch model costs seconds.
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in forward order.

    transformers' GradientCheckpointingLayer modules when there are any; otherwise the longest run
    of same-class children in any nn.ModuleList or nn.Sequential (at least two). Empty if none.
    """
    gc_cls = _gc_layer_class()
    if gc_cls is not None:
        layers = [m for m in model.modules() if isinstance(m, gc_cls)]
        if layers:
            return layers
    best: list[nn.Module] = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        run: list[nn.Module] = []
        for child in container.children():
            if run and type(child) is type(run[0]):
                run.append(child)
            else:
                run = [child]
            if len(run) > len(best):
                best = list(run)
    return best if len(best) >= 2 else []


class _State:
    def __init__(self, layers, checkpointed, offloaded, session, saved_attrs, hooks):
        self.layers = layers
        self.checkpointed = checkpointed
        self.offloaded = offloaded
        self.session = session
        self.saved_attrs = saved_attrs  # [(module, name, previous instance value or _MISSING)]
        self.hooks = hooks


_MISSING = object()


def _set(saved, module, name, value):
    saved.append((module, name, module.__dict__.get(name, _MISSING)))
    setattr(module, name, value)


def _wrap(module: nn.Module, session, keep, context=None, options=None):
    original = module.forward
    body = compiled(original, options)
    ckpt_kwargs = {} if context is None else {"context_fn": context}

    def run(fn, args, kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        warn_kwarg_tensors(kwargs)
        # Keywords travel in a closure, so torch's checkpoint sees only the positional inputs.
        fn = functools.partial(fn, **kwargs) if kwargs else fn
        return run_checkpoint(session, fn, args, ckpt_kwargs, keep)

    if session is None:
        # Without offload torch.compile traces torch's checkpoint itself: nothing to keep eager.
        @functools.wraps(original)
        def forward(*args, **kwargs):
            return run(body, args, kwargs)

        return forward
    boundary = eager_boundary(run, session, explicit=options is not None)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return boundary(body, *args, **kwargs)

    return forward


def enable_checkpointing(
    model: nn.Module,
    every_n_layers: int = 1,
    offload: bool = False,
    keep_last: int = 1,
    prefetch: int = 1,
    prefetch_bytes: int | None = None,
    layers=None,
    use_reentrant=None,
    policy=None,
    compile=False,
) -> list[int]:
    """Checkpoints the first repeated block and every n-th after it (0-based index % n == 0).

    With offload=True the checkpointed blocks' inputs live in pinned host memory between forward
    and backward, except the last keep_last, which backward needs first. prefetch: how many
    offloaded layers are on their way back ahead of need (prefetch_bytes caps it by bytes).
    layers: the blocks to consider instead of all repeated blocks: either modules, in forward
    order, or 0-based indices into find_repeated_blocks(model) (such as this function returns).
    every_n_layers then counts within that list. Calling again reconfigures.
    Returns the 0-based indices of the checkpointed blocks: into find_repeated_blocks(model), or
    with layers=[modules], into that list. use_reentrant: only None or False (non-reentrant).
    policy: selective checkpointing inside the checkpointed blocks, a torch SAC policy function or
    a name ("attention": attention outputs offloaded, the rest recomputed), or a dict of them by
    block index (numbered as the returned indices); outputs it marks *_CPU_OFFLOAD go to the host
    with the block's input (on the device in the keep_last blocks and without offload). See
    ckpt_offload.policies.
    compile: True or a dict of torch.compile keywords compiles each checkpointed block's forward
    with them, the checkpoint and offload staying eager around it (see ckpt_offload.compile).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_checkpointing: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_int("enable_checkpointing", "every_n_layers", every_n_layers, 1)
    _check_prefetch("enable_checkpointing", prefetch, prefetch_bytes, keep_last)
    _check_bool("enable_checkpointing", "offload", offload)
    _check_not_reentrant("enable_checkpointing", use_reentrant)
    options = compile_options("enable_checkpointing", compile)

    numbering = None  # with layers=[indices]: the index of each block among the repeated blocks
    if layers is None or (isinstance(layers, (list, tuple)) and layers and all(_is_index(i) for i in layers)):
        blocks = find_repeated_blocks(model)
        if layers is not None:
            numbering = _check_indices(layers, len(blocks))
            blocks = [blocks[i] for i in numbering]
        if not blocks:
            raise ValueError(
                f"enable_checkpointing: no repeated blocks found in {type(model).__name__}: searched for "
                "transformers GradientCheckpointingLayer modules and for runs of at least two modules of "
                "one class in an nn.ModuleList or nn.Sequential; pass layers=[...] explicitly"
            )
    else:
        blocks = list(layers)
        if not blocks:
            raise ValueError("enable_checkpointing: layers is empty")
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise TypeError(
                    f"enable_checkpointing: layers[{i}] is a {type(b).__name__}: layers must be all nn.Module "
                    "blocks or all int indices into find_repeated_blocks(model), not a mix"
                )
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("enable_checkpointing: layers names a block more than once")
    gc_cls = _gc_layer_class()
    ours = _STATE_ATTR in model.__dict__
    if not ours and gc_cls is not None and any(isinstance(b, gc_cls) and b.gradient_checkpointing for b in blocks):
        raise ValueError(
            "enable_checkpointing: transformers' own gradient checkpointing is on for this model; call "
            "ckpt_offload.integrations.hf.checkpointing_disable(model) first, or use ckpt_offload.integrations.hf.enable(model, ...)"
        )

    checkpointed = [i for i in range(len(blocks)) if i % every_n_layers == 0]
    if offload and keep_last > len(checkpointed):
        raise ValueError(
            f"enable_checkpointing: keep_last={keep_last} is larger than the {len(checkpointed)} checkpointed "
            f"layers; use 0..{len(checkpointed)}"
        )
    offloaded = checkpointed[: len(checkpointed) - keep_last] if offload else []
    if isinstance(policy, dict) and numbering is not None:
        # Keys count as the returned indices do (into the repeated blocks): back to positions in blocks.
        position = {n: i for i, n in enumerate(numbering)}
        policy = {position.get(k, k) if _is_index(k) else k: p for k, p in policy.items()}
    contexts = policies.per_block("enable_checkpointing", policy, checkpointed)

    disable_checkpointing(model)
    session = OffloadSession(prefetch=prefetch, prefetch_bytes=prefetch_bytes) if offloaded else None
    saved = []
    hf_layers = gc_cls is not None and all(isinstance(b, gc_cls) for b in blocks)
    if hf_layers:
        _stop_passing_caches(saved, model, gc_cls)
    for i in checkpointed:
        _install_checkpoint(saved, blocks[i], hf_layers, session, i not in offloaded, contexts[i], options)
    hooks = []
    if session is not None:  # compiled bodies have no midpoint (see ckpt_offload.compile)
        hooks = session.attach(model, [blocks[i] for i in checkpointed], midpoints=options is None)
    if numbering is not None:
        checkpointed = [numbering[i] for i in checkpointed]
        offloaded = [numbering[i] for i in offloaded]
    setattr(model, _STATE_ATTR, _State(blocks, checkpointed, offloaded, session, saved, hooks))
    return checkpointed


def _stop_passing_caches(saved, model, gc_cls):
    """transformers layers checkpoint themselves through their own __call__, which also turns off
    the KV cache that a recompute would update twice: the modules above them stop passing caches
    down once their gradient_checkpointing is on."""
    for m in model.modules():
        if isinstance(getattr(m, "gradient_checkpointing", None), bool) and not isinstance(m, gc_cls):
            _set(saved, m, "gradient_checkpointing", True)


def _install_checkpoint(saved, block, hf_layer, session, keep, context, options=None):
    """Checkpoints `block` through `session` (keep: its inputs stay on the device): a transformers
    layer through its own checkpointing path with our function, any other block by its forward.
    context: a selective-checkpoint context_fn or None; options: torch.compile keywords for the
    block's body, or None."""
    if hf_layer:
        _set(saved, block, "gradient_checkpointing", True)
        ckpt_kwargs = {} if context is None else {"context_fn": context}
        func = layer_checkpoint_function(session, keep, explicit=options is not None, **ckpt_kwargs)
        _set(saved, block, "_gradient_checkpointing_func", func)
        if options is not None:
            _set(saved, block, "forward", compiled(block.forward, options))
    else:
        _set(saved, block, "forward", _wrap(block, session, keep, context, options))


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_indices(layers, count):
    """layers=[indices]: each within find_repeated_blocks' count, none twice; in forward order."""
    if count == 0:
        raise ValueError(
            "enable_checkpointing: layers=[indices] counts into find_repeated_blocks(model), which found no "
            "repeated blocks in this model; pass the blocks themselves as layers=[module, ...]"
        )
    for i in layers:
        if not 0 <= i < count:
            raise ValueError(
                f"enable_checkpointing: layers index {i} is out of range: the model has {count} repeated "
                f"blocks (find_repeated_blocks), so indices run 0..{count - 1}"
            )
    if len(set(layers)) != len(layers):
        raise ValueError(f"enable_checkpointing: layers names an index more than once: {list(layers)}")
    return sorted(layers)


BLOCK_MODES = ("none", "offload", "checkpoint", "checkpoint+offload", "checkpoint+offload+attention")


def _wrap_offload(module: nn.Module, session):
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        with session.hooks():
            return original(*args, **kwargs)

    return forward


def _offload_function(session):
    """A `_gradient_checkpointing_func` that does not checkpoint: the layer runs under session's hooks."""

    def func(function, *args):
        with session.hooks():
            return function(*args)

    return func


def enable_block_modes(model: nn.Module, modes, prefetch: int = 1, prefetch_bytes: int | None = None,
                       layers=None) -> list[str]:
    """One mode per repeated block (find_repeated_blocks order, or `layers`), as plan_memory chooses:

    "none"; "checkpoint"; "checkpoint+offload" (its inputs in pinned host memory between forward and
    backward, as enable_checkpointing(offload=True) does, prefetch / prefetch_bytes ahead of need);
    "checkpoint+offload+attention" (the same with policy="attention": the attention outputs are
    offloaded too, not recomputed); "offload" (no recompute: every tensor the block saves goes to
    the host, as offload_activations does, and comes back when the block's backward starts).
    disable_checkpointing undoes it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_block_modes: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_prefetch("enable_block_modes", prefetch, prefetch_bytes)
    blocks = find_repeated_blocks(model) if layers is None else list(layers)
    modes = list(modes)
    if not blocks or len(modes) != len(blocks):
        raise ValueError(
            f"enable_block_modes: {len(modes)} modes for {len(blocks)} repeated blocks of {type(model).__name__}; "
            "pass one mode per block (find_repeated_blocks order), or layers=[...]"
        )
    for i, m in enumerate(modes):
        if m not in BLOCK_MODES:
            raise ValueError(f"enable_block_modes: modes[{i}] is {m!r}; choose from {BLOCK_MODES}")
    disable_checkpointing(model)
    checkpointed = [i for i, m in enumerate(modes) if m.startswith("checkpoint")]
    ckpt_offloaded = [i for i, m in enumerate(modes) if m.startswith("checkpoint+offload")]
    attention = None
    if "checkpoint+offload+attention" in modes:
        attention = policies.resolve("enable_block_modes", "attention")
    plain_offloaded = [i for i, m in enumerate(modes) if m == "offload"]
    # Two sessions: the checkpointed blocks' reloads start mid-backward of the block above (Midpoints,
    # counted in layers); an "offload" block's tensors come back when its own backward starts.
    session = OffloadSession(prefetch=prefetch, prefetch_bytes=prefetch_bytes) if ckpt_offloaded else None
    whole = OffloadSession(prefetch=1) if plain_offloaded else None
    gc_cls = _gc_layer_class()
    hf_layers = gc_cls is not None and all(isinstance(b, gc_cls) for b in blocks)
    saved = []
    if hf_layers and (checkpointed or plain_offloaded):
        _stop_passing_caches(saved, model, gc_cls)
    for i in checkpointed:
        context = attention if modes[i] == "checkpoint+offload+attention" else None
        _install_checkpoint(saved, blocks[i], hf_layers, session, i not in ckpt_offloaded, context)
    for i in plain_offloaded:
        if hf_layers:
            _set(saved, blocks[i], "gradient_checkpointing", True)
            _set(saved, blocks[i], "_gradient_checkpointing_func", _offload_function(whole))
        else:
            _set(saved, blocks[i], "forward", _wrap_offload(blocks[i], whole))
    if hf_layers:
        for i in (i for i, m in enumerate(modes) if m == "none"):
            _set(saved, blocks[i], "gradient_checkpointing", False)  # even where transformers' own was on
    hooks = session.attach(model, [blocks[i] for i in checkpointed]) if session is not None else []
    if whole is not None:
        hooks += [
            model.register_forward_pre_hook(lambda module, args: whole.exclude_module_tensors(module)),
            model.register_forward_hook(lambda *_: whole.poll()),
        ]
    state = _State(blocks, checkpointed, sorted(ckpt_offloaded + plain_offloaded), session, saved, hooks)
    state.modes = modes
    setattr(model, _STATE_ATTR, state)
    return modes


def disable_checkpointing(model: nn.Module) -> None:
    """Undoes enable_checkpointing: the blocks' own forward back, no hooks left. No-op if not enabled."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"disable_checkpointing: model must be a torch.nn.Module, got {type(model).__name__}")
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    for module, name, previous in reversed(state.saved_attrs):
        if previous is _MISSING:
            delattr(module, name)
        else:
            setattr(module, name, previous)
    for hook in state.hooks:
        hook.remove()


def checkpointing_state(model: nn.Module):
    """(checkpointed indices, offloaded indices), as enable_checkpointing or integrations.hf.enable
    (also through OffloadCallback or hf.install) returned them; None when neither configured the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"checkpointing_state: model must be a torch.nn.Module, got {type(model).__name__}")
    state = model.__dict__.get(_STATE_ATTR)
    if state is not None:
        return list(state.checkpointed), list(state.offloaded)
    hf_state = model.__dict__.get(HF_STATE_ATTR)
    return None if hf_state is None else (list(hf_state[0]), list(hf_state[1]))
