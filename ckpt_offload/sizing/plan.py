"""plan_memory, the planner's entry point: the budgets (`"auto"` read off the device and the node),
the cost model (profiled on one real step by the planner, or estimated for a model on the meta device)
and the planner's search. It sits above both, so that the planner never imports the estimate."""
from __future__ import annotations

from torch import nn

from .. import planner as _planner
from ..planner import MemoryPlan
from . import budget as _budget
from .estimate import estimate_memory


def plan_memory(model: nn.Module, example_inputs, budget_bytes, *, loss_fn=None, host_budget_bytes=None,
                modes=None, verbose: bool = False, optimizer="default") -> MemoryPlan:
    """Profiles `model`'s repeated blocks on one batch and chooses a mode for each block: the
    assignment with the lowest predicted step time whose predicted peak fits `budget_bytes`.

    The modes: `"none"`, `"offload"` (no recompute; everything the block saves waits on the host),
    `"checkpoint"`, `"checkpoint+offload"` (recomputed; its input waits on the host) and
    `"checkpoint+offload+attention"` (the same with `policy="attention"`). Profiling runs nine
    steps or fewer on the batch, in training mode (each module's mode is restored after), leaves
    every `.grad` allocated and zeroed, restores the RNG state, and resets `stats()` (the profiling
    steps do not count in what the run's steps report). The docs' "Planning for a memory budget" page explains the cost model and where it can
    be wrong.

    Args:
        model: the model; its repeated blocks are those of `find_repeated_blocks(model)`.
        example_inputs: the model's positional arguments (a tuple), a batch of the shape you train
            with.
        budget_bytes: the peak device memory of a training step, including weights, gradients
            (kept allocated) and inputs: `max_memory_allocated` on a GPU,
            `ckpt_offload.testing.LiveBytes` on the CPU test path. `"auto"`: read off the device
            now (`ckpt_offload.sizing.budget.auto_budget`: what torch holds plus what is free, less a
            margin of max(5%, 1 GiB), less the optimizer's states not yet allocated; the optimizer's
            step, temporaries included, checked to fit beside what is held), and the host
            budget too unless `host_budget_bytes` is given; one log line (logger `ckpt_offload`,
            INFO) says what was chosen and why, and the plan's `auto` attribute holds the figures.
        loss_fn: `output -> scalar` to backpropagate (default: `output.loss` when there is one,
            else the mean of the squared output).
        host_budget_bytes: the most bytes a step may send to the host (None: no cap; `"auto"`:
            this rank's share of the node's available memory, `hostmem.host_share_bytes()`).
        modes: the modes to choose from (default: all of `BLOCK_MODES`, the attention one where
            this torch has selective offload; on a CPU without `CKPT_OFFLOAD_TEST_CPU=1`, those
            without offload, as CPU tensors are not offloaded there). A model on the meta device
            is not profiled but estimated (`estimate_memory`: nothing allocated, times from FLOPs
            at a nominal rate), with `"none"`, `"checkpoint"` and `"checkpoint+offload"`.
        verbose: print one line per profiled mode, and the choice, on stderr.
        optimizer: with `"auto"`, the optimizer whose states are counted before they exist:
            `"default"` (the Trainer's default, `recipe.default_optim()`), `"adamw_torch"`, `"sgd"`, None, or the `torch.optim.Optimizer` itself.

    Returns:
        MemoryPlan: the chosen modes and their predictions; `replan(budget)` chooses again for
            another budget without profiling.

    Raises:
        TypeError: `model` is not a module, `example_inputs` is not a tuple, a budget is not an
            int, `loss_fn` is not callable or `verbose` not a bool.
        ValueError: a budget is not positive, `modes` is empty or names an unknown mode, nothing
            fits (the message names the smallest feasible budget), or with `"auto"` the optimizer's
            step alone does not fit.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan_memory: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"plan_memory: example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}")
    auto = None
    if _budget.is_auto(budget_bytes):
        from .. import engine as _engine  # the pool's pinned bytes: WDDM counts them against the device

        pinned = _engine._C.global_pool().stats()["reserved_bytes"]
        auto = _budget.auto_budget(model, optimizer=optimizer, pinned_bytes=pinned)
        budget_bytes = auto.device_bytes
        if host_budget_bytes is None:
            host_budget_bytes = auto.host_bytes
    if _budget.is_auto(host_budget_bytes):
        host_budget_bytes = _budget.host_budget_bytes()
    _planner._check_budget("plan_memory", budget_bytes, host_budget_bytes)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"plan_memory: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(verbose, bool):
        raise TypeError(f"plan_memory: verbose must be True or False, got {verbose!r}")
    modes_given = modes is not None
    modes = _planner.search_modes(model, modes)
    params = list(model.parameters())
    if params and params[0].device.type == "meta":
        # A model on the meta device: the bytes from estimate_memory (no optimizer states, as the
        # budget counts none), the times from FLOPs at a nominal rate; its modes only.
        cost = estimate_memory(model, example_inputs, optimizer=None, loss_fn=loss_fn).cost_model
        missing = [m for m in modes if m not in cost.modes]
        if missing and modes_given:
            raise ValueError(f"plan_memory: on the meta device the modes are {cost.modes}; {missing} cannot be estimated")
        modes = [m for m in modes if m in cost.modes]
    else:
        cost = _planner.profile(model, example_inputs, loss_fn=loss_fn, modes=modes, verbose=verbose)
    if auto is None:
        return _planner.plan_from_cost(cost, budget_bytes, host_budget_bytes=host_budget_bytes, modes=modes, verbose=verbose)
    try:
        plan = _planner.plan_from_cost(cost, budget_bytes, host_budget_bytes=host_budget_bytes, modes=modes, verbose=verbose)
    except ValueError as e:
        raise ValueError(f"{e} ({auto.describe()})") from None
    plan.auto = auto
    _budget.log.info("%s; plan: predicted peak %.3f GiB, host %.3f GiB, modes %s", auto.describe(),
                     plan.predicted_peak_bytes / 2**30, plan.predicted_host_bytes / 2**30, plan.modes)
    return plan
