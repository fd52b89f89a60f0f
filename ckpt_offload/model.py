"""enable_checkpointing / disable_checkpointing: checkpoint (and offload) a model's repeated blocks."""
from __future__ import annotations

from torch import nn

from .attachment import MODES as BLOCK_MODES
from .attachment import Attachment, base_class, find, gc_layer_class, offloaded_of, owner_of
from .compile import compile_options
from ._args import check_bool as _check_bool
from ._args import check_int as _check_int
from ._args import check_prefetch as _check_prefetch
from ._args import check_not_reentrant as _check_not_reentrant
from . import policies
from .selection import block_modes

_gc_layer_class = gc_layer_class


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
            if run and base_class(type(child)) is base_class(type(run[0])):
                run.append(child)
            else:
                run = [child]
            if len(run) > len(best):
                best = list(run)
    return best if len(best) >= 2 else []


def enable_checkpointing(
    model: nn.Module,
    every_n_layers: int = 1,
    offload: bool = True,
    keep_last: int = 1,
    prefetch: int = 1,
    prefetch_bytes: int | None = None,
    layers=None,
    use_reentrant=None,
    policy=None,
    compile=False,
) -> list[int]:
    """Checkpoints the first repeated block and every n-th after it (0-based index % n == 0).

    | argument | default | meaning |
    |---|---|---|
    | every_n_layers | 1 | the first block and every n-th after it |
    | offload | True | True by default, as at every ckpt_offload entry point; False: checkpointing only |
    | keep_last | 1 | the last checkpointed blocks whose inputs stay on the device |
    | prefetch, prefetch_bytes | 1, None | offloaded blocks on their way back ahead of need |

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
    ours = find(model) is not None
    if not ours and gc_cls is not None and any(isinstance(b, gc_cls) and b.gradient_checkpointing for b in blocks):
        raise ValueError(
            "enable_checkpointing: transformers' own gradient checkpointing is on for this model; call "
            "ckpt_offload.integrations.hf.checkpointing_disable(model) first, or use ckpt_offload.integrations.hf.enable(model, ...)"
        )

    modes = block_modes(len(blocks), every_n_layers, offload, keep_last)
    checkpointed = [i for i, m in enumerate(modes) if m != "none"]
    offloaded = offloaded_of("enable_checkpointing", modes, offload, keep_last, every_n_layers)
    if isinstance(policy, dict) and numbering is not None:
        # Keys count as the returned indices do (into the repeated blocks): back to positions in blocks.
        position = {n: i for i, n in enumerate(numbering)}
        policy = {position.get(k, k) if _is_index(k) else k: p for k, p in policy.items()}
    contexts = policies.per_block("enable_checkpointing", policy, checkpointed)

    hf_layers = gc_cls is not None and all(isinstance(b, gc_cls) for b in blocks)
    att = Attachment(owner_of(model), blocks, modes, hf=hf_layers, contexts=contexts, options=options,
                     numbering=numbering, prefetch=prefetch, prefetch_bytes=prefetch_bytes)
    att.attach()
    return att.state()[0]


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
    contexts = {}
    if "checkpoint+offload+attention" in modes:
        attention = policies.resolve("enable_block_modes", "attention")
        contexts = {i: attention for i, m in enumerate(modes) if m == "checkpoint+offload+attention"}
    gc_cls = _gc_layer_class()
    hf_layers = gc_cls is not None and all(isinstance(b, gc_cls) for b in blocks)
    Attachment(owner_of(model), blocks, modes, hf=hf_layers, contexts=contexts, prefetch=prefetch,
               prefetch_bytes=prefetch_bytes).attach()
    return modes


def disable_checkpointing(model: nn.Module) -> None:
    """Undoes enable_checkpointing, enable_block_modes and integrations.hf.enable's engine offload: the
    blocks' own forward back, no hooks left. transformers' own checkpointing flags are as they were
    before ckpt_offload configured the model. No-op if not configured."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"disable_checkpointing: model must be a torch.nn.Module, got {type(model).__name__}")
    att = find(model)
    if att is not None:
        att.detach()


def checkpointing_state(model: nn.Module):
    """(checkpointed indices, offloaded indices) of a model ckpt_offload configured (enable_checkpointing,
    enable_block_modes, a plan, integrations.hf.enable, OffloadCallback, hf.install), read off what its
    blocks run now, numbered as the entry point returned them; None when ckpt_offload did not configure
    it. A wrapper (peft's PeftModel, torch.compile's OptimizedModule, DataParallel) answers for the model
    inside. A layer that transformers' own checkpointing took over since counts as checkpointed, not
    offloaded; so does a layer whose last run kept an input on the device for its type (a tensor
    subclass the engine cannot take: not a DTensor), because the host pool refused it (its cap, the
    node's memory) or because the engine cannot move it (a CPU tensor on a machine without a GPU)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"checkpointing_state: model must be a torch.nn.Module, got {type(model).__name__}")
    att = find(model)
    return None if att is None else att.state()
