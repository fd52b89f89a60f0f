"""Selective offload inside checkpoints: torch's selective-checkpoint policies honoured in eager, with
the outputs a policy marks MUST_CPU_OFFLOAD / PREFER_CPU_OFFLOAD sent through the copy engine and
prefetched back with their layer's input; named policies ("attention") and their per-block resolution.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.utils.checkpoint as _tuc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .session import Packed as _Packed
from .session import _Shard

# What this module needs from torch, looked up by feature, not by version string.
_Policy = getattr(_tuc, "CheckpointPolicy", None)
_Context = getattr(_tuc, "SelectiveCheckpointContext", None)
_TorchCaching = getattr(_tuc, "_CachingTorchDispatchMode", None)
_TorchCached = getattr(_tuc, "_CachedTorchDispatchMode", None)
HAS_SELECTIVE = _Policy is not None and _Context is not None
HAS_OFFLOAD_POLICY = HAS_SELECTIVE and hasattr(_Policy, "MUST_CPU_OFFLOAD")
# torch 2.14 added checkpoint(respect_saved_tensors_hooks=...) and warns when it is left open.
HAS_RESPECT = "respect_saved_tensors_hooks" in inspect.signature(_tuc.checkpoint).parameters
TORCH_NEEDED = "2.14"  # the release these features were checked with (CheckpointPolicy.MUST_CPU_OFFLOAD)

# Outputs smaller than this (an RNG seed or offset beside an attention output) stay on the device
# even when marked: a host block and two copies cost more than they free.
MIN_OFFLOAD_BYTES = 1024

if HAS_SELECTIVE:
    _SAVE = frozenset({_Policy.MUST_SAVE, _Policy.PREFER_SAVE})
    _RECOMPUTE = frozenset({_Policy.MUST_RECOMPUTE, _Policy.PREFER_RECOMPUTE})
    _OFFLOAD = frozenset({_Policy.MUST_CPU_OFFLOAD, _Policy.PREFER_CPU_OFFLOAD}) if HAS_OFFLOAD_POLICY else frozenset()
else:  # no selective checkpointing in this torch: nothing below is reached (require() raises first)
    _SAVE = _RECOMPUTE = _OFFLOAD = frozenset()
# Ops run a different number of times in forward and recompute (checkpoint's own detaches): never cached.
_IGNORED = frozenset(getattr(_tuc, "SAC_IGNORED_OPS", ())) | {torch.ops.aten.detach.default}
_storage_key = getattr(_tuc, "_sac_storage_key", None)
# torch 2.14 hands the policy the op's output (ctx.op_output); 2.11's context has only is_recompute.
_CONTEXT_HAS_OUTPUT = _Context is not None and "op_output" in inspect.signature(_Context.__init__).parameters
_CONSUMED = object()
# The recompute of a selectively checkpointed function ran an op the forward did not (torch's words
# for it, "not found in storage", lead the message).
_MISMATCH = ("A selectively checkpointed function must run the same ops in its forward and its recompute: "
             "no dependence on global state or randomness outside torch's RNG.")


def require(where: str) -> None:
    """Raises when this torch lacks what selective offload is built on."""
    if not HAS_OFFLOAD_POLICY:
        raise RuntimeError(
            f"{where}: selective offload needs torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD and "
            f"SelectiveCheckpointContext, which torch {torch.__version__} lacks; install torch>={TORCH_NEEDED}"
        )


# -- named policies --------------------------------------------------------------------------------
def _attention_ops() -> frozenset:
    """The fused scaled-dot-product-attention ops of this torch (and of flash_attn when it is loaded):
    their outputs (attention output, logsumexp) are what their backward needs besides q, k, v."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        try:  # flash_attn registers these torch ops when it is imported (2.6 and newer)
            ops.add(getattr(torch.ops.flash_attn, name).default)
        except (AttributeError, RuntimeError):
            pass
    return frozenset(ops)


def attention_policy():
    """A policy function: the outputs of scaled-dot-product attention are offloaded (saved, on the
    host between forward and backward), every other op is recomputed.

    aten's math fallback is not among them: it decomposes into matmuls and a softmax before any
    dispatch mode sees it, and its backward needs the full attention matrix; it is recomputed.
    """
    require("attention_policy")
    ops = _attention_ops()
    offload, recompute = _Policy.PREFER_CPU_OFFLOAD, _Policy.PREFER_RECOMPUTE

    def policy(ctx, op, *args, **kwargs):
        return offload if op in ops else recompute

    return policy


NAMED = {"attention": attention_policy}


class SelectiveOffload:
    """A `context_fn` for checkpoint: selective checkpointing by `policy_fn` (torch's signature:
    ctx, op, *args, **kwargs -> CheckpointPolicy or bool), with its offload policies honoured.

    ckpt_offload's entry points bind it to their session; called directly (torch's own checkpoint,
    transformers without offload) it keeps the offload policies' outputs on the device, saved.
    """

    def __init__(self, policy_fn, allow_cache_entry_mutation: bool = False):
        if not callable(policy_fn):
            raise TypeError(f"SelectiveOffload: policy_fn must be callable, got {type(policy_fn).__name__}")
        if not isinstance(allow_cache_entry_mutation, bool):
            raise TypeError(f"SelectiveOffload: allow_cache_entry_mutation must be True or False, "
                            f"got {allow_cache_entry_mutation!r}")
        require("SelectiveOffload")
        self.policy_fn = policy_fn
        self.allow_cache_entry_mutation = allow_cache_entry_mutation

    def __call__(self):
        return _modes(self.policy_fn, self.allow_cache_entry_mutation, None, True, False)


def resolve(where: str, policy):
    """A policy name or function -> SelectiveOffload; None stays None."""
    if policy is None or isinstance(policy, SelectiveOffload):
        return policy
    if isinstance(policy, str):
        if policy not in NAMED:
            raise ValueError(f"{where}: policy must be one of {sorted(NAMED)} or a policy function, got {policy!r}")
        return SelectiveOffload(NAMED[policy]())
    if callable(policy):
        return SelectiveOffload(policy)
    raise TypeError(f"{where}: policy must be a name ({', '.join(sorted(NAMED))}), a policy function or a dict of "
                    f"them by block index, got {type(policy).__name__}")


def prepare(where: str, policy):
    """Checks and resolves `policy` (each value of a dict too) before a model is touched."""
    if isinstance(policy, dict):
        return {i: resolve(f"{where}: policy[{i!r}]", p) for i, p in policy.items()}
    return resolve(where, policy)


def per_block(where: str, policy, checkpointed) -> dict:
    """{checkpointed block index: SelectiveOffload or None} for `policy`: one name or function for
    every checkpointed block, or a dict from block index to a name, a function or None."""
    if not isinstance(policy, dict):
        ctx = resolve(where, policy)
        return {i: ctx for i in checkpointed}
    out = {i: None for i in checkpointed}
    for i, p in policy.items():
        if isinstance(i, bool) or not isinstance(i, int) or i not in out:
            raise ValueError(f"{where}: policy keys must be indices of checkpointed blocks {list(checkpointed)}, got {i!r}")
        out[i] = resolve(f"{where}: policy[{i}]", p)
    return out


# -- binding a checkpoint's context_fn to its session ------------------------------------------------
def bind(kwargs: dict, session, keep: bool) -> dict:
    """checkpoint keywords whose context_fn offloads through `session` (keep=True: on the device).

    torch's own create_selective_checkpoint_contexts and SelectiveOffload run under this module's
    modes. Any other context_fn runs as given; on a torch with respect_saved_tensors_hooks, an
    unchosen one becomes False (what torch does by default, without its FutureWarning).
    """
    kwargs = dict(kwargs)
    user = kwargs.get("context_fn", _tuc.noop_context_fn)
    respect = kwargs.get("respect_saved_tensors_hooks")
    if respect is not None and not isinstance(respect, bool):
        raise TypeError(f"checkpoint: respect_saved_tensors_hooks must be True, False or None, got {respect!r}")
    if HAS_RESPECT:
        kwargs["respect_saved_tensors_hooks"] = bool(respect)
    else:
        kwargs.pop("respect_saved_tensors_hooks", None)
    if user is _tuc.noop_context_fn:
        return kwargs

    def context_fn():
        if isinstance(user, SelectiveOffload):
            return _modes(user.policy_fn, user.allow_cache_entry_mutation, session, keep, bool(respect))
        fwd, bwd = user()
        if _TorchCaching is not None and type(fwd) is _TorchCaching and type(bwd) is _TorchCached:
            return _modes(fwd.policy_fn, getattr(bwd, "allow_cache_entry_mutation", False), session, keep, bool(respect))
        if respect and not HAS_RESPECT:
            raise ValueError(f"checkpoint: respect_saved_tensors_hooks=True needs torch>={TORCH_NEEDED} for a "
                             f"context_fn other than torch's create_selective_checkpoint_contexts")
        if _TorchCaching is not None and isinstance(fwd, _TorchCaching):
            # A subclass of torch's mode runs as given; it would recompute an offload policy's output silently.
            fwd.policy_fn = _refuse_offload(fwd.policy_fn)
        return fwd, bwd

    kwargs["context_fn"] = context_fn
    return kwargs


def _refuse_offload(policy_fn):
    @functools.wraps(policy_fn)
    def policy(ctx, op, *args, **kwargs):
        p = policy_fn(ctx, op, *args, **kwargs)
        if p in _OFFLOAD:
            raise ValueError(
                f"checkpoint: the policy marks {op} {p.name}, but context_fn returned a subclass of torch's "
                "selective-checkpoint mode, which would recompute it; use "
                "functools.partial(create_selective_checkpoint_contexts, policy_fn) or ckpt_offload's policy="
            )
        return p

    return policy


def _compiling() -> bool:
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _modes(policy_fn, allow_mutation, session, keep, offload_saves):
    if _compiling():
        # Under torch.compile the policy tags the traced graph: torch's own modes do that.
        return _tuc.create_selective_checkpoint_contexts(policy_fn, allow_mutation)
    storage: dict = {}
    send = None if session is None or keep else session
    caching = _Caching(policy_fn, storage, send, offload_saves, allow_mutation)
    return caching, _Cached(storage, session, allow_mutation)


# -- the dispatch modes ------------------------------------------------------------------------------
class _Kept:
    """A saved output on the device and its version when saved (the mutation check)."""

    __slots__ = ("val", "version")  # val: the name torch's own SAC storage entries use

    def __init__(self, t):
        self.val = t
        self.version = t._version


def _detached(t):
    # Below autograd ADInplaceOrView is excluded; with it on, the alias shares t's version counter
    # (so a later in-place write is caught) and carries no autograd metadata of its own.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _key(func, args):
    # A compiled region inside the checkpoint: one queue per compiled callable (torch's keying).
    if _storage_key is not None and isinstance(func, torch._ops.HigherOrderOperator):
        return _storage_key(func, args)
    return func


# Subclasses of torch's own SAC modes where this torch has them: code that asks whether SAC is
# active (isinstance on the current dispatch mode, as torch's own tests do) sees it is. Every
# method that matters is overridden, and the base initialisers are skipped on purpose.
_CachingBase = _TorchCaching if _TorchCaching is not None else TorchDispatchMode
_CachedBase = _TorchCached if _TorchCached is not None else TorchDispatchMode


class _Caching(_CachingBase):
    """Forward: runs each op, asks the policy, and records per op what the recompute returns:
    None (run it again), _Kept (saved on the device) or a session _Packed (on its way to the host)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __init__(self, policy_fn, storage, session, offload_saves, allow_mutation=False):
        TorchDispatchMode.__init__(self)
        self.allow_mutation = allow_mutation
        self.ac_graph_id = None  # what torch's checkpoint may read or set on its caching mode
        self.respect_saved_tensors_hooks = offload_saves
        self.policy_fn = policy_fn
        self.storage = storage
        self.session = session  # None: offload policies' outputs are kept on the device
        self.offload_saves = offload_saves  # respect_saved_tensors_hooks=True: *_SAVE go to the host too

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _IGNORED:
            return out
        ctx = _Context(is_recompute=False, op_output=out) if _CONTEXT_HAS_OUTPUT else _Context(is_recompute=False)
        policy = self.policy_fn(ctx, func, *args, **kwargs)
        if isinstance(policy, bool):
            policy = _Policy.MUST_SAVE if policy else _Policy.PREFER_RECOMPUTE
        if policy in _RECOMPUTE:
            entry = None
        elif (policy in _OFFLOAD or (self.offload_saves and policy in _SAVE)) and not _aliases_input(func):
            entry = tree_map(self._send, out)
        elif policy in _SAVE or policy in _OFFLOAD:
            entry = tree_map(_keep, out)
        else:
            raise TypeError(f"checkpoint: the selective-checkpoint policy returned {policy!r} for {func}; "
                            "return a torch.utils.checkpoint.CheckpointPolicy or a bool")
        self.storage.setdefault(_key(func, args), []).append(entry)
        return out

    def _send(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        t = _detached(x)
        if self.session is None or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES:
            return _Kept(t)
        packed = self.session.pack(t)  # the layer's group: prefetched with the layer's input
        if self.allow_mutation:
            # The output may be written later on (allowed): the producing stream waits for the copy
            # first, so that the copy is the value the op returned, never one half written.
            self.session.poll()
        return packed


@functools.lru_cache(maxsize=None)
def _aliases_input(func) -> bool:
    """Views and in-place ops return (part of) an input: a copy of it would free nothing and would
    not follow later writes to that input, so their marked outputs are saved on the device."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _keep(x):
    return _Kept(_detached(x)) if isinstance(x, torch.Tensor) else x


class _Cached(_CachedBase):
    """Recompute: each op returns what the forward recorded for its n-th call, fetching offloaded
    outputs from the engine, or runs again where the policy said recompute."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __init__(self, storage, session, allow_mutation):
        TorchDispatchMode.__init__(self)
        self.storage = storage
        self.session = session
        self.allow_mutation = allow_mutation
        self.calls: dict = {}

    def __enter__(self):
        self.calls = {}  # a second backward (retain_graph) finds consumed entries, not a stale index
        return TorchDispatchMode.__enter__(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        key = _key(func, args)
        i = self.calls.get(key, 0)
        self.calls[key] = i + 1
        entries = self.storage.get(key)
        if entries is None:
            raise RuntimeError(
                f"checkpoint: {func} encountered during backward but not found in storage: it ran in the "
                f"recompute but not in the forward. {_MISMATCH}"
            )
        if i >= len(entries):
            raise RuntimeError(
                f"checkpoint: {func} invocation index {i} encountered during backward but not found in storage: "
                f"the recompute ran it {i + 1} times, the forward {len(entries)}. {_MISMATCH}"
            )
        entry = entries[i]
        if entry is None:
            return func(*args, **kwargs)
        if entry is _CONSUMED:
            raise RuntimeError("Trying to backward an extra time. You are only allowed to backward once on any "
                               "region computed under selective activation checkpoint.")
        entries[i] = _CONSUMED  # the saved copy goes as soon as the recompute has used it
        return tree_map(self._restore, entry)

    def _restore(self, x):
        if isinstance(x, _Kept):
            if not self.allow_mutation and x.val._version != x.version:
                raise RuntimeError(
                    "Tensor cached during selective activation checkpoint has been mutated (modified in place "
                    "after the forward); clone it before writing, or pass allow_cache_entry_mutation=True"
                )
            return x.val
        if isinstance(x, (_Packed, _Shard)):  # a _Shard: a DTensor's shard on its way to the host
            if self.allow_mutation:
                # The mutation check is off, as torch's is for *_SAVE outputs with this flag: what
                # comes back is the copy, the value the op returned (torch's *_SAVE hands back the
                # tensor itself, writes included).
                x.version = x.current_version
            return self.session.unpack(x)
        return x
