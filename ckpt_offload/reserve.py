"""reserve_for: pin the host memory of the longest expected batch before training, so that no step,
the first included, allocates pinned memory inside its forward."""
from __future__ import annotations

import contextlib

import torch

from . import engine as _engine
from .training import training_mode


def reserve_for(model: torch.nn.Module, example_inputs, loss_fn=None, context=None) -> dict:
    """Pins the host memory of one training step before training, so that no step, the first
    included, pins memory inside its forward.

    Runs one forward and backward of `model` on `example_inputs`, as the model is configured now
    (`enable_checkpointing`, `integrations.hf.enable`, ...), so that the host pool allocates the
    blocks that step offloads into. The pool keeps every block until `host_pool().empty_cache()`
    and serves any later step whose offloaded tensors are each no larger than this one's from them
    (the pool's rule is in the docs' "Varying shapes and pinning" page): pass the longest batch.

    The step runs in training mode (transformers' layers checkpoint only then; a model fresh from
    `from_pretrained` is in eval mode) and leaves no trace on the model: gradients, buffers
    (BatchNorm statistics), each module's training mode and the random number generators are as
    before.

    Args:
        model: the model, configured for offload.
        example_inputs: the longest batch: a tuple or list (positional arguments), a dict
            (keywords) or one tensor.
        loss_fn: `output -> scalar loss`, the training loop's own (under `context`, what the loss
            saves is offloaded too). By default the output itself when it is a tensor (summed if
            it is not a scalar), else its `.loss` (transformers models given labels).
        context: a callable returning the context manager the training loop runs its forward in,
            e.g. `lambda: ckpt_offload.offload_activations(min_bytes=1 << 20)`.

    Returns:
        dict: the pool's figures: `requests` and `request_bytes` (the blocks the step held at the
            end of its forward, and the bytes requested in them), `block_bytes` (their capacity),
            `alloc_calls` (host allocations the step made) and `reserved_bytes` (the pool's size
            afterwards).

    Raises:
        TypeError: `model` is not a module, `loss_fn` or `context` is not callable,
            `example_inputs` is of another type, or the loss is not a scalar tensor (or cannot be
            told without `loss_fn`).
        RuntimeError: gradients are disabled (`torch.no_grad`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"reserve_for: model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"reserve_for: loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if context is not None and not callable(context):
        raise TypeError(f"reserve_for: context must be a callable returning a context manager, got "
                        f"{type(context).__name__}")
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        raise TypeError(
            "reserve_for: example_inputs must be a tuple or list of positional arguments, a dict of keywords "
            f"or a tensor, got {type(example_inputs).__name__}"
        )
    if not torch.is_grad_enabled():
        raise RuntimeError("reserve_for: gradients are disabled here (torch.no_grad); the step needs a backward")

    pool = _engine.host_pool()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index for p in params if p.device.type == "cuda" and p.device.index is not None})
    before = pool.stats()
    try:
        with torch.random.fork_rng(devices=devices), training_mode(model):
            for p in params:
                p.grad = None
            with context() if context is not None else contextlib.nullcontext():
                output = model(*args, **kwargs)
                loss = _loss(output, loss_fn)
            held = pool.stats()  # the offloaded tensors hold their blocks until backward
            loss.backward()
            del output, loss
        _engine.synchronize()
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    after = pool.stats()
    return dict(
        requests=held["blocks_in_use"] - before["blocks_in_use"],
        request_bytes=held["in_use_bytes"] - before["in_use_bytes"],
        block_bytes=held["in_use_block_bytes"] - before["in_use_block_bytes"],
        alloc_calls=after["alloc_calls"] - before["alloc_calls"],
        reserved_bytes=after["reserved_bytes"],
    )


def _loss(output, loss_fn):
    if loss_fn is not None:
        loss = loss_fn(output)
    elif isinstance(output, torch.Tensor):
        loss = output if output.dim() == 0 else output.sum()
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise TypeError(
            f"reserve_for: cannot tell the loss of a {type(output).__name__} output; pass loss_fn=lambda out: ..."
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError("reserve_for: loss_fn must return a scalar tensor")
    return loss
