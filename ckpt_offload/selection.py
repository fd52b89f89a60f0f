"""Which repeated blocks an entry point checkpoints and offloads: the one rule that enable_checkpointing,
integrations.hf (enable, OffloadCallback, install), integrations.accelerate and the estimate's row for
a configuration all use. Pure: block counts and indices in, one mode per block out."""
from __future__ import annotations


def checkpointed_indices(n: int, every_n_layers: int = 1) -> list[int]:
    """The blocks checkpointed among n: the first and every n-th after it (0-based index % n == 0), the
    rule of transformers' own selection among its GradientCheckpointingLayer modules."""
    return [i for i in range(n) if i % every_n_layers == 0]


def block_modes(n: int, every_n_layers: int = 1, offload: bool = True, keep_last: int = 1, *, checkpointed=None,
                where: str = "enable_checkpointing") -> list[str]:
    """One mode per block ("none", "checkpoint", "checkpoint+offload"), as the entry points assign them:
    the checkpointed blocks (`checkpointed`, else checkpointed_indices(n, every_n_layers)) offloaded
    with offload=True, except the last keep_last of them, whose inputs backward needs first.

    Raises:
        ValueError: offload=True and keep_last is larger than the number of checkpointed blocks
            (the message starts with `where`).
    """
    ck = checkpointed_indices(n, every_n_layers) if checkpointed is None else list(checkpointed)
    if offload and keep_last > len(ck):
        raise ValueError(f"{where}: keep_last={keep_last} is larger than the {len(ck)} checkpointed layers; "
                         f"use 0..{len(ck)}")
    offloaded = set(ck[: len(ck) - keep_last]) if offload else set()
    ck = set(ck)
    return ["checkpoint+offload" if i in offloaded else "checkpoint" if i in ck else "none" for i in range(n)]
