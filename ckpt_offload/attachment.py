"""The engine's one attachment to a model: a mode per repeated block (plain data), and the sessions
and hooks that carry the modes out. Every entry point (enable_checkpointing, enable_block_modes and
plans, integrations.hf) attaches through attach(); what a model runs is read off its blocks.

Nothing in it is a closure over a module: blocks find their settings through `self` at call time,
so copies of a model (copy.deepcopy, pickling, DataParallel replicas) run their own weights, and a
deep copy or an unpickled model gets sessions of its own (see OffloadSession.__getstate__).
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings

import torch
import torch.utils._pytree
from torch import nn

from .checkpointing import run_checkpoint, run_learned, warn_kwarg_tensors
from .compile import _current_callback, _eagerly, _under, compiled
from .session import OffloadSession, Refused, Unmovable, _warn_subclass
from ._args import warn_at_caller

ATTR = "_ckpt_offload"  # on the owner (see owner_of): the Attachment
SLOT = "_ckpt_offload_block"  # on a plain block: (Attachment, index)
OWN = "_ckpt_offload_own_forward"  # on a plain block that had a forward of its own (set on the instance)

MODES = ("none", "offload", "checkpoint", "checkpoint+offload", "checkpoint+offload+attention")
_MISSING = object()


def gc_layer_class():
    """transformers' GradientCheckpointingLayer, when transformers is already imported (a model
    built with it has imported it; importing it for a plain torch model costs seconds)."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def _pretrained_class():
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


def owner_of(model: nn.Module) -> nn.Module:
    """The module an attachment lives on: the model inside the wrappers people train
    (peft's PeftModel and its tuner, torch.compile's OptimizedModule, DataParallel and
    DistributedDataParallel); the model itself otherwise."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = model._modules.get("_orig_mod") if type(model).__name__ == "OptimizedModule" else None
        if inner is None and isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = model.module
        if inner is None and callable(getattr(type(model), "get_base_model", None)):
            inner = model.get_base_model()  # peft: PeftModel -> the transformers model
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner
    return model


def find(model: nn.Module):
    """The Attachment configuring `model` (on it, inside its wrappers, or on a submodule), or None."""
    owner = owner_of(model)
    att = owner.__dict__.get(ATTR)
    if att is not None:
        return att
    for m in model.modules():
        att = m.__dict__.get(ATTR)
        if att is not None:
            return att
    return None


# -- plain blocks: a subclass whose forward finds its settings on `self` --------------------------------
_CLASSES: dict = {}  # original class -> its checkpointed subclass


def _class_name(cls) -> str:
    # The name pickle records: importable through this module's __getattr__ (no dots allowed).
    return f"Checkpointed[{cls.__module__.replace('.', '|')}:{cls.__qualname__.replace('.', '|')}]"


def checkpointed_class(cls):
    """The subclass of `cls` whose forward checkpoints (or offloads) as its block's attachment says.
    Copies keep the class, and so run through their own `self`; pickling finds it by name."""
    if getattr(cls, "_ckpt_offload_base", None) is not None:
        return cls
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "forward": _block_forward, "_ckpt_offload_base": cls, "__module__": __name__,
            "__qualname__": _class_name(cls),
        })
        _CLASSES[cls] = sub
    return sub


def base_class(cls):
    """The class a block had before ckpt_offload (its own class when untouched)."""
    return getattr(cls, "_ckpt_offload_base", None) or cls


def __getattr__(name):
    # Unpickling a model with checkpointed blocks: rebuild the subclass of the class it names.
    if name.startswith("Checkpointed[") and name.endswith("]") and ":" in name:
        module, qualname = name[len("Checkpointed["):-1].split(":", 1)
        obj = __import__(module.replace("|", "."), fromlist=["_"])
        for part in qualname.split("|"):
            obj = getattr(obj, part)
        return checkpointed_class(obj)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _block_forward(self, *args, **kwargs):
    slot = self.__dict__.get(SLOT)
    if slot is None:  # detached, or a subclass of ours put on by someone else: the block's own forward
        return type(self)._ckpt_offload_base.forward(self, *args, **kwargs)
    att, i = slot
    if att.session is not None:
        if torch.compiler.is_compiling() or _current_callback() is not None:
            # Under torch.compile: one eager boundary, the same function for every block, so the graph
            # breaks here once and the block's body compiles as a frame of its own.
            return _EAGER[1](self, args, kwargs)
        if att.options is None and att.modes[i] != "offload":  # eager code, eager body: _block_run's own path
            own = self.__dict__.get(OWN)
            body = own if own is not None else functools.partial(type(self)._ckpt_offload_base.forward, self)
            return att._run(i, body, args, kwargs)
    return _block_run(self, None, args, kwargs)


def _block_body(block):
    att = block.__dict__[SLOT][0]
    own = block.__dict__.get(OWN)
    if own is not None:
        return att.body(own)
    return functools.partial(att.body(type(block)._ckpt_offload_base.forward), block)


def _block_run(block, callback, args, kwargs):
    att, i = block.__dict__[SLOT]
    body = _block_body(block)
    if att.session is None or att.modes[i] == "offload":
        if callback is not None:
            body = functools.partial(_under, callback, body)
        return att.call_block(i, body, args, kwargs)
    if callback is None and att.options is None:  # eager code, eager body: what _eagerly would run
        return att._run(i, body, args, kwargs)
    return _eagerly(functools.partial(att._run, i), att.session, callback, att.options is not None, body, args, kwargs)


def block_eager_boundary(block, args, kwargs):
    # Not traced (recursive=False keeps the caller's torch.compile callback installed, to read it
    # here); what it calls runs eagerly (_block_run, itself torch.compiler.disable'd).
    return _EAGER[2](block, _current_callback(), args, kwargs)


# -- transformers layers: the function their own checkpointing calls --------------------------------
class LayerFunction:
    """A transformers layer's `_gradient_checkpointing_func`: the layer passes its own forward bound
    to itself (functools.partial(forward, self, ...)), so a copy runs its own weights."""

    __slots__ = ("attachment", "index")

    def __init__(self, attachment, index):
        self.attachment = attachment
        self.index = index

    def __call__(self, function, *args, **kwargs):
        return self.attachment.call_layer(self.index, function, args, kwargs)

    def __getstate__(self):
        return self.attachment, self.index

    def __setstate__(self, state):
        self.attachment, self.index = state


def _layer_run(func, callback, function, args, kwargs):
    att, i = func.attachment, func.index
    if callback is None and att.options is None:  # eager code, eager body: what _eagerly would run
        return att._run(i, function, args, kwargs)
    run = functools.partial(att._run, i)
    return _eagerly(run, att.session, callback, att.options is not None, att.layer_body(i, function), args, kwargs)


def layer_eager_boundary(func, function, args, kwargs):
    # As block_eager_boundary, for transformers layers.
    return _EAGER[4](func, _current_callback(), function, args, kwargs)


class EagerLayerFunction(LayerFunction):
    """A LayerFunction that offloads: under torch.compile the call is one eager boundary (the same
    function for every layer), one graph break, and the layer's body compiles as a frame of its own;
    in eager code no dynamo wrapper is entered."""

    __slots__ = ()

    def __call__(self, function, *args, **kwargs):
        if torch.compiler.is_compiling() or _current_callback() is not None:
            return _EAGER[3](self, function, args, kwargs)
        return _layer_run(self, None, function, args, kwargs)


# -- diffusers models: the function their own checkpointing calls with the block ------------------------
class BlockFunction:
    """The `_gradient_checkpointing_func` of a diffusers model's modules: its forward calls
    func(block, *args) for each block it checkpoints. The block is looked up in the attachment's
    sequence (numbered in forward order, learnt as the blocks first run, see Attachment.block_index)
    and runs as its mode says. Tensors inside a tuple or dict argument (rotary tables) are passed
    to the checkpoint one by one, so that they are offloaded too."""

    __slots__ = ("attachment",)

    def __init__(self, attachment):
        self.attachment = attachment

    def __call__(self, block, *args):
        if torch.compiler.is_compiling() or _current_callback() is not None:
            return _EAGER[5](self, block, args)
        return _diffusers_run(self, block, args)

    def __getstate__(self):
        return self.attachment

    def __setstate__(self, state):
        self.attachment = state


def _flat_call(function, spec, *leaves):
    return function(*torch.utils._pytree.tree_unflatten(list(leaves), spec))


def _diffusers_run(func, block, args):
    att = func.attachment
    function = block.__call__ if isinstance(block, nn.Module) else block
    i = att.block_index(block) if isinstance(block, nn.Module) else None
    if not torch.is_grad_enabled() or (i is not None and att.modes[i] == "none"):
        return function(*args)
    if i is not None and att.modes[i] == "offload":
        return att._run_whole(i, function, args, {})
    if any(isinstance(a, (list, tuple, dict)) for a in args):
        leaves, spec = torch.utils._pytree.tree_flatten(args)
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            function, args = functools.partial(_flat_call, function, spec), tuple(leaves)
    return att._run(i, function, args, {})


class _Reenabled:
    """A PreTrainedModel's `_set_gradient_checkpointing` while attached, which every transformers
    enable and disable ends in (the Trainer's and SFTTrainer's, peft's, the deprecated names). An
    enable runs transformers' own and then puts the attachment back: the explicit configuration
    wins, with one warning that says so. A disable detaches, with a warning: nothing stays on
    silently, and nothing is silently off."""

    __slots__ = ("attachment", "model")

    def __init__(self, attachment, model):
        self.attachment = attachment
        self.model = model

    def __call__(self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
        att, model = self.attachment, self.model
        original = type(model)._set_gradient_checkpointing
        kwargs = {"enable": enable, "every_n_layers": every_n_layers}
        if gradient_checkpointing_func is not None:
            kwargs["gradient_checkpointing_func"] = gradient_checkpointing_func
        if not enable:
            att.detach()
            warnings.warn(
                f"ckpt_offload: transformers' checkpointing was disabled on {type(model).__name__}, which "
                "ckpt_offload had configured; ckpt_offload's checkpointing and offload are off too "
                "(checkpointing_state(model) is None)",
                UserWarning, stacklevel=4,
            )
            return original(model, **kwargs)
        att.restore()
        try:
            return original(model, **kwargs)
        finally:
            att.install()
            if not att.warned_reenable:
                att.warned_reenable = True
                warnings.warn(
                    f"ckpt_offload: transformers' checkpointing was enabled again on {type(model).__name__} "
                    f"(every_n_layers={every_n_layers}), which ckpt_offload had configured (a Trainer or "
                    "SFTTrainer does this when gradient_checkpointing is on); ckpt_offload's configuration stays "
                    f"in force: checkpointed {att.state()[0]}, offloaded {att.state()[1]}. To use transformers' "
                    "own instead, call ckpt_offload.integrations.hf.disable(model) first. Shown once per model.",
                    UserWarning, stacklevel=4,
                )

    def __getstate__(self):
        return self.attachment, self.model

    def __setstate__(self, state):
        self.attachment, self.model = state


# -- hooks on the owner -----------------------------------------------------------------------------
def attachment_before_forward(hook, module, args):
    mid = hook.attachment.midpoints
    if mid is not None and mid.waiting:
        mid.start()  # made after the forward before this one ended: from this forward on
    for s in (hook.attachment.session, hook.attachment.whole):
        if s is not None:
            s.exclude_module_tensors(module)


def attachment_after_forward(hook, module, args, output):
    att = hook.attachment
    if att.schedule is not None and not att.learned and att.blocks:
        att.learnt()
    for s in (hook.attachment.session, hook.attachment.whole):
        if s is not None:
            s.poll()


class _BeforeForward:
    """The owner's forward pre-hook: the model's own weights never offload (looked up anew each
    forward), and a new forward starts. Its __call__ becomes torch.compiler.disable'd at the first
    attach (importing dynamo costs seconds): under torch.compile it runs eagerly, at one break."""

    __slots__ = ("attachment",)
    __call__ = attachment_before_forward

    def __init__(self, attachment):
        self.attachment = attachment

    def __getstate__(self):
        return self.attachment

    def __setstate__(self, state):
        self.attachment = state


class _AfterForward(_BeforeForward):
    """The owner's forward hook: the forward's sources go back to the allocator."""

    __slots__ = ()
    __call__ = attachment_after_forward


_EAGER: list = []  # the torch.compiler.disable'd boundaries, made at the first attach (dynamo costs seconds)


def _eager_hooks():
    if not _EAGER:
        _BeforeForward.__call__ = torch.compiler.disable(attachment_before_forward)
        _AfterForward.__call__ = torch.compiler.disable(attachment_after_forward)
        _EAGER.extend([
            None,
            torch.compiler.disable(block_eager_boundary, recursive=False),
            torch.compiler.disable(_block_run),
            torch.compiler.disable(layer_eager_boundary, recursive=False),
            torch.compiler.disable(_layer_run),
            torch.compiler.disable(_diffusers_run),
        ])


_COMPILED: dict = {}  # (forward function, compile options) -> the compiled function


def offloaded_of(where, modes, offload, keep_last, every_n_layers):
    """The blocks that offload under `modes` (as selection.block_modes assigned them). offload=True
    that offloads nothing (keep_last keeps every checkpointed block) is said in a warning at the
    caller's line, whichever entry point configured the model."""
    offloaded = [i for i, m in enumerate(modes) if m == "checkpoint+offload"]
    if offload and not offloaded:
        checkpointed = sum(m != "none" for m in modes)
        warn_at_caller(
            f"{where}: offload=True offloads nothing: keep_last={keep_last} keeps all "
            f"{checkpointed} checkpointed layer(s) of {len(modes)} (every_n_layers={every_n_layers}) on the "
            "device. Lower keep_last or every_n_layers to offload; checkpointing_state() reports no offloaded layer.",
            RuntimeWarning,
        )
    return offloaded


class Attachment:
    """One model's configuration: blocks[i] runs modes[i] (see MODES); sessions and hooks follow.

    owner: the module it lives on; hf: the blocks are transformers layers (checkpointed through
    their own gradient_checkpointing switch and _gradient_checkpointing_func); contexts: {index:
    selective-checkpoint context_fn}; options: torch.compile keywords for the checkpointed bodies,
    or None; checkpoint_kwargs: torch checkpoint keywords; numbering: the index each block is
    reported under (checkpointing_state); prefetch, prefetch_bytes: as OffloadSession's.
    schedule: a diffusers model (see Schedule): blocks and modes start empty and grow as the model's
    own checkpointing hands its blocks to BlockFunction, in forward order.
    """

    def __init__(self, owner, blocks, modes, *, hf=False, contexts=None, options=None, checkpoint_kwargs=None,
                 numbering=None, prefetch=1, prefetch_bytes=None, schedule=None):
        self.owner = owner
        self.blocks = list(blocks)
        self.modes = list(modes)
        self.hf = hf
        self.contexts = dict(contexts or {})
        self.options = options
        self.checkpoint_kwargs = dict(checkpoint_kwargs or {})
        self.numbering = list(numbering) if numbering is not None else list(range(len(self.blocks)))
        self.schedule = schedule
        self.positions = {b: i for i, b in enumerate(self.blocks)}  # block -> its index (BlockFunction)
        self.learned = schedule is None  # a schedule's sequence is complete after the first forward that ran blocks
        offloads = any(m.startswith("checkpoint+offload") for m in self.modes) or (
            schedule is not None and schedule.offload)
        self.session = OffloadSession(prefetch=prefetch, prefetch_bytes=prefetch_bytes) if offloads else None
        # "offload" blocks: their tensors come back when their own backward starts (no midpoints).
        self.whole = OffloadSession(prefetch=1, sees_weights=True) if "offload" in self.modes else None
        self.saved = []  # [(module, name, value before)]: what install() changed, for restore()
        self.handles = []  # hook handles and Midpoints
        self.midpoints = None  # the Midpoints among handles: the blocks' forwards tell it where they are
        self.warned_reenable = False
        # The blocks whose last run kept a saved tensor on the device for its type (a tensor subclass
        # the engine cannot take): not offloaded, whatever their mode (state()).
        self.kept_blocks = set()
        self.warned_kept = set()  # (block index, type) said once
        self._runtime()

    # -- copies ------------------------------------------------------------------------------------
    # Everything here is plain data, modules and sessions: copy.deepcopy and pickle copy it as it is
    # (a session copies as a fresh one with the same settings).

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._runtime()  # an unpickled model in a new process: the boundaries exist there too

    def _runtime(self):
        _eager_hooks()
        self.__dict__.setdefault("kept_blocks", set())  # pickled before they existed
        self.__dict__.setdefault("warned_kept", set())
        self.__dict__.setdefault("schedule", None)
        self.__dict__.setdefault("learned", True)
        self.__dict__.setdefault("positions", {b: i for i, b in enumerate(self.blocks)})
        for session in (self.session, self.whole):
            if session is not None and session.kept_types is None:
                session.kept_types = []  # noted for this attachment (a copy's sessions are new ones)

    def _ran(self, i, session):
        """Block i ran through session: whether a saved tensor stayed on the device for its type, said
        once per block and type."""
        kept = session.kept_types
        if kept:
            for cls in set(kept):
                if cls is Refused or cls is Unmovable:  # warned about once, by the session
                    continue
                if (i, cls) not in self.warned_kept:
                    self.warned_kept.add((i, cls))
                    _warn_subclass(cls, self._layer_name(i))
            kept.clear()
            if i is not None:
                self.kept_blocks.add(i)
        elif self.kept_blocks and i is not None:
            self.kept_blocks.discard(i)

    def _layer_name(self, i):
        if i is None:
            return "(a module above the layers)"
        for name, m in self.owner.named_modules():
            if m is self.blocks[i]:
                return f"{name!r} ({self.numbering[i]})"
        return str(self.numbering[i])

    # -- a diffusers model's sequence, learnt as it runs --------------------------------------------
    def block_index(self, block):
        """The index of a block a diffusers model's checkpointing hands over: the order in which
        the blocks first ran; a block not seen before joins the sequence with the schedule's mode."""
        i = self.positions.get(block)
        if i is None:
            i = self.positions[block] = len(self.blocks)
            self.blocks.append(block)
            self.numbering.append(i)
            self.modes.append(self.schedule.mode(i, None))
        return i

    def learnt(self):
        """The first forward that ran blocks is over: the sequence is known, so keep_last can keep
        the last checkpointed blocks on the device from the next forward on (that first forward
        offloaded them too), and the midpoints are learnt from the next forward."""
        from .midpoints import Midpoints

        self.learned = True
        self.modes = [self.schedule.mode(i, len(self.blocks)) for i in range(len(self.blocks))]
        if self.schedule.offload and not any(m.startswith("checkpoint+offload") for m in self.modes):
            warnings.warn(
                f"ckpt_offload: offload=True offloads nothing from the next forward on: {type(self.owner).__name__} "
                f"checkpoints {sum(m != 'none' for m in self.modes)} block(s) (every_n_layers="
                f"{self.schedule.every_n_layers}) and keep_last={self.schedule.keep_last} keeps them all on the "
                "device. Lower keep_last or every_n_layers to offload.", RuntimeWarning, stacklevel=2)
        checkpointed = [self.blocks[i] for i, m in enumerate(self.modes) if m.startswith("checkpoint")]
        if self.session is not None and self.options is None and checkpointed and Midpoints.usable(checkpointed):
            # Not yet for the backward of the forward that just ended: it armed no midpoint, and a
            # reload point that waits for one would turn midpoints off for good.
            self.midpoints = Midpoints(self.session, checkpointed, start=False)
            self.handles.append(self.midpoints)

    # -- what the blocks run -----------------------------------------------------------------------
    def _checkpoint_kwargs(self, i, extra=None):
        if not extra and not self.checkpoint_kwargs and (i is None or self.contexts.get(i) is None):
            return {}
        kwargs = dict(self.checkpoint_kwargs)
        if extra:
            kwargs.update(extra)
        if i is not None and self.contexts.get(i) is not None:
            kwargs["context_fn"] = self.contexts[i]
        return kwargs

    def _run(self, i, fn, args, kwargs):
        """Block i's checkpoint of fn(*args, **kwargs), through the session unless it is kept."""
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        keep = i is not None and self.modes[i] == "checkpoint"
        if self.hf:  # kwargs: checkpoint keywords a layer passed (older model code)
            kwargs = self._checkpoint_kwargs(i, kwargs)
        else:
            if kwargs:
                warn_kwarg_tensors(kwargs)
                # Keywords travel in a closure, so torch's checkpoint sees only the positional inputs.
                fn = functools.partial(fn, **kwargs)
            kwargs = {} if not self.checkpoint_kwargs and self.contexts.get(i) is None else self._checkpoint_kwargs(i)
        mid = self.midpoints
        if mid is None or i is None:
            out = run_checkpoint(self.session, fn, args, kwargs, keep)
        else:
            block = self.blocks[i]
            walk = mid.walks.get(block)
            if walk is not None and not kwargs:  # learned: the checkpoint and its midpoint in one call
                out, armed = run_learned(self.session, fn, args, keep, walk)
                if armed is None:
                    mid.leave(block, out)
                elif armed < 1:
                    mid.rearm(block, out, armed)
            else:
                if block not in mid.path:  # else learned: nothing to do before the forward
                    mid.enter(block)
                out = None
                try:
                    out = run_checkpoint(self.session, fn, args, kwargs, keep)
                finally:
                    mid.leave(block, out)  # out None: the forward raised, and what it learned goes
        session = self.session
        if session is not None and (session.kept_types or self.kept_blocks):
            self._ran(i, session)  # an input stayed on the device for its type, or did in an earlier run
        return out

    def _run_whole(self, i, function, args, kwargs):
        """Block i in mode "offload": every tensor it saves through the whole-block session."""
        with self.whole.hooks():
            out = function(*args, **kwargs)
        if self.whole.kept_types or self.kept_blocks:
            self._ran(i, self.whole)
        return out

    def body(self, forward):
        """forward, compiled with this attachment's torch.compile options (once per function)."""
        if self.options is None:
            return forward
        key = (forward, repr(sorted(self.options.items())))
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = compiled(forward, self.options)
        return fn

    def call_block(self, i, body, args, kwargs):
        mode = self.modes[i]
        if mode == "offload":
            if not torch.is_grad_enabled():
                return body(*args, **kwargs)
            return self._run_whole(i, body, args, kwargs)
        # No session (a session's blocks go through their boundary in _block_forward): torch.compile
        # traces torch's checkpoint itself.
        return self._run(i, body, args, kwargs)

    def layer_body(self, i, function):
        if self.options is not None and isinstance(function, functools.partial):
            # The layer's own forward, bound to the layer: its body compiled, the checkpoint eager.
            function = functools.partial(self.body(function.func), *function.args, **function.keywords)
        return function

    def call_layer(self, i, function, args, kwargs):
        """A transformers layer's checkpoint without a session (EagerLayerFunction has its own path)."""
        if i is not None and self.modes[i] == "offload":
            return self._run_whole(i, function, args, {})
        return self._run(i, self.layer_body(i, function), args, kwargs)

    # -- attaching ---------------------------------------------------------------------------------
    def _set(self, module, name, value):
        self.saved.append((module, name, module.__dict__.get(name, _MISSING)))
        setattr(module, name, value)

    def _set_raw(self, module, name, value):
        # In the instance dict itself: a torch.compile OptimizedModule hands setattr on to its inner module.
        self.saved.append((module, "raw:" + name, module.__dict__.get(name, _MISSING)))
        if value is _MISSING:
            del module.__dict__[name]
        else:
            module.__dict__[name] = value

    def install(self):
        """Puts the modes on the blocks (and the re-enable guard on transformers models)."""
        self.saved = []
        gc_cls = gc_layer_class()
        active = [i for i, m in enumerate(self.modes) if m != "none"]
        if self.hf:
            if active:
                # transformers layers turn the KV cache off themselves under checkpointing; the modules
                # above them stop passing caches down once their own gradient_checkpointing is on.
                for m in self.owner.modules():
                    if isinstance(getattr(m, "gradient_checkpointing", None), bool) and not isinstance(m, gc_cls):
                        self._set(m, "gradient_checkpointing", True)
                        if self.session is not None:
                            # Older model code checkpoints its children from the parent: offload there too.
                            self._set(m, "_gradient_checkpointing_func", self._layer_function(None))
            for i, b in enumerate(self.blocks):
                self._set(b, "gradient_checkpointing", self.modes[i] != "none")
                if self.modes[i] != "none":
                    self._set(b, "_gradient_checkpointing_func", self._layer_function(i))
        else:
            for i in active:
                b = self.blocks[i]
                self._set_raw(b, SLOT, (self, i))
                own = b.__dict__.get("forward")
                if own is not None:  # a forward set on the instance (torch.compile's) runs inside the checkpoint
                    self._set_raw(b, OWN, own)
                    self._set_raw(b, "forward", _MISSING)
                self.saved.append((b, "__class__", type(b)))
                object.__setattr__(b, "__class__", checkpointed_class(type(b)))
        if self.schedule is not None:
            # diffusers' own switch turns checkpointing on in every module that has one, with our function.
            for m in self.owner.modules():
                if hasattr(m, "gradient_checkpointing"):
                    for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
                        self.saved.append((m, name, m.__dict__.get(name, _MISSING)))
            self.schedule.switch(self.owner, BlockFunction(self))
        pretrained = _pretrained_class()
        if pretrained is not None:
            for m in self.owner.modules():
                if isinstance(m, pretrained) and _new_format(m):
                    self._set(m, "_set_gradient_checkpointing", _Reenabled(self, m))

    def _layer_function(self, i):
        if self.session is None or (i is not None and not self.modes[i].startswith("checkpoint")):
            return LayerFunction(self, i)  # no offload: torch.compile traces torch's checkpoint itself
        return EagerLayerFunction(self, i)

    def restore(self):
        """Puts back what install() changed, newest first."""
        for module, name, previous in reversed(self.saved):
            if name == "__class__":
                if type(module) is checkpointed_class(previous):  # else someone subclassed on top: leave it
                    object.__setattr__(module, "__class__", previous)
            elif name.startswith("raw:"):
                if previous is _MISSING:
                    module.__dict__.pop(name[4:], None)
                else:
                    module.__dict__[name[4:]] = previous
            elif previous is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, previous)
        self.saved = []

    def attach(self):
        """install(), the owner's hooks, the midpoints; then the owner carries it."""
        from .midpoints import Midpoints

        previous = find(self.owner)
        if previous is not None:
            previous.detach()
        self.install()
        if self.session is not None or self.whole is not None:
            self.handles = [
                self.owner.register_forward_pre_hook(_BeforeForward(self)),
                self.owner.register_forward_hook(_AfterForward(self)),
            ]
        checkpointed = [self.blocks[i] for i, m in enumerate(self.modes) if m.startswith("checkpoint")]
        if self.session is not None and self.options is None and checkpointed and Midpoints.usable(checkpointed):
            # Compiled bodies are one autograd node each: no middle to start reloads from.
            self.midpoints = Midpoints(self.session, checkpointed)
            self.handles.append(self.midpoints)
        self.owner.__dict__[ATTR] = self
        return self

    def detach(self):
        """Undoes attach(): the blocks' own behaviour back, no hooks left."""
        if self.owner.__dict__.get(ATTR) is self:
            del self.owner.__dict__[ATTR]
        self.restore()
        for h in self.handles:
            h.remove()
        self.handles = []
        self.midpoints = None

    # -- what runs, read off the blocks -----------------------------------------------------------
    def running_mode(self, i) -> str:
        """The mode block i runs now: this attachment's when its hooks are in place; "checkpoint"
        when something else (transformers' own) checkpoints it; "none" otherwise."""
        b = self.blocks[i]
        if self.schedule is not None:
            # One function on every module that checkpoints blocks: ours on all of them, or not ours.
            switches = [m for m in self.owner.modules() if hasattr(m, "gradient_checkpointing")]
            if not any(m.gradient_checkpointing for m in switches):
                return "none"
            if all(m.gradient_checkpointing and isinstance(m.__dict__.get("_gradient_checkpointing_func"), BlockFunction)
                   and m.__dict__["_gradient_checkpointing_func"].attachment is self for m in switches):
                return self.modes[i]
            return "checkpoint"
        if self.hf:
            func = b.__dict__.get("_gradient_checkpointing_func")
            if not getattr(b, "gradient_checkpointing", False):
                return "none"
            if isinstance(func, LayerFunction) and func.attachment is self and func.index == i:
                return self.modes[i]
            return "checkpoint"
        slot = b.__dict__.get(SLOT)
        if slot is not None and slot[0] is self and slot[1] == i and isinstance(b, checkpointed_class(base_class(type(b)))):
            return self.modes[i]
        return "none"

    def state(self):
        """(checkpointed indices, offloaded indices), numbered as the entry point returned them. A
        block is offloaded when its mode offloads and its session's engine can move what it saves:
        not when its weights sit on a device the engine does not take (a CPU outside the test path,
        before any step as after one), nor when its last run kept a saved tensor on the device for
        its type."""
        checkpointed, offloaded = [], []
        for i in range(len(self.blocks)):
            mode = self.running_mode(i)
            if mode.startswith("checkpoint"):
                checkpointed.append(self.numbering[i])
            if i in self.kept_blocks:
                continue
            session = self.whole if mode == "offload" else self.session if mode.startswith("checkpoint+offload") else None
            if session is not None and self._movable(i, session):
                offloaded.append(self.numbering[i])
        return checkpointed, offloaded

    def _movable(self, i, session) -> bool:
        """Whether `session` moves what block i saves, read off the device of the block's weights (a
        block without any: yes, its last run says otherwise through kept_blocks)."""
        b = self.blocks[i]
        first = next(b.parameters(), None)
        if first is None:
            first = next(b.buffers(), None)
        return first is None or session.moves(first.device)


def _new_format(model) -> bool:
    """transformers' current _set_gradient_checkpointing(enable, gradient_checkpointing_func, ...),
    not the pre-4.35 (module, value) one some hub code still overrides."""
    try:
        return "value" not in inspect.signature(type(model)._set_gradient_checkpointing).parameters
    except (TypeError, ValueError, AttributeError):
        return False
