"""OffloadSession: the offload policy (what to offload, how far to prefetch) and the bookkeeping of
one model or context; its saved-tensor hooks send activations through the copy engine in
ckpt_offload._C and bring them back ahead of need in backward.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import engine as _engine
from ._args import check_bool as _check_bool
from ._args import check_int as _check_int
from ._args import check_prefetch as _check_prefetch
from ._args import warn_at_caller as _warn_at_caller

_TEST_CPU_ENV = "CKPT_OFFLOAD_TEST_CPU"
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def test_cpu_enabled() -> bool:
    """CKPT_OFFLOAD_TEST_CPU=1 (a testing aid) sends CPU tensors through the pool and engine too."""
    return os.environ.get(_TEST_CPU_ENV, "0") == "1"


# What autograd keeps for one saved tensor (a record of its host copy plus how to view it, or the
# tensor itself while it stays on the device): made by the session's pack hook, in C++.
Packed = _engine._C.Packed if _engine.load_error is None else type("Packed", (), {})  # none exists without the core


@functools.cache
def _autograd_strips_backward() -> bool:
    """Whether this torch's own in-place error names a node by its forward operation ("of Add", torch
    2.14) or by the node itself ("of AddBackward0", torch 2.11). Asked of autograd once, with a
    two-op graph that makes the mistake, on a thread of its own: saved-tensor hooks (which switch
    the check off), grad mode and dispatch modes are per thread, and that thread has none."""
    found = []

    def probe():
        x = torch.zeros(1, requires_grad=True)
        y = x + 1
        z = y * y
        y.add_(1)
        try:
            z.backward()
        except RuntimeError as err:
            found.append("AddBackward0" not in str(err))

    thread = threading.Thread(target=probe, name="ckpt_offload-probe")
    thread.start()
    thread.join()
    return found[0] if found else True


def _modified_error(packed, now):
    """autograd's own in-place error, word for word: saved-tensor hooks switch its check off, so
    unpack redoes it. An offloaded tensor is described by its copy (dtype, shape, device); the
    "which is output N of F" part needs the tensor itself, and is left out when it is gone."""
    t = packed.kept
    if t is not None:
        what = f"{t.type()} {list(t.shape)}"
        if packed.source is not None:  # kept detached: the tensor itself names its grad_fn, while it lives
            t = packed.source
    else:
        dtype, device, shape = packed.copy
        what = f"{torch.empty(0, dtype=dtype, device=device).type()} {list(shape)}"
        t = packed.source
    origin = ""
    if t is not None and t.grad_fn is not None:
        name = t.grad_fn.name()
        if _autograd_strips_backward():  # MulBackward0 -> Mul, MyFnBackward -> MyFn
            name = re.sub(r"Backward[0-9]*$", "", name)
        origin = f", which is output {t.output_nr} of {name},"
    if torch.is_anomaly_enabled():
        hint = ("Hint: the backtrace further above shows the operation that failed to compute its gradient. "
                "The variable in question was changed in there or anywhere later. Good luck!")
    else:
        hint = ("Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
                "with torch.autograd.set_detect_anomaly(True, check_nan=False).")
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{what}]{origin} is at version {now}; expected version {packed.version} instead. {hint}"
    )


def refuse_capture(what: str) -> None:
    """Raises where the current CUDA stream is capturing a graph: a replay would repeat the copies
    into host blocks the pool has since handed to other tensors, and reload into addresses the
    captured graph no longer owns, so its gradients would be garbage with nothing raised. Checked
    as each forward with offload starts; the engine refuses a copy queued during capture as well."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"ckpt_offload: {what} during CUDA graph capture is not supported; capture the region "
                           "with offload=False (or outside ckpt_offload), or run it eagerly")


class OffloadSession:
    """Offload policy and bookkeeping shared by every pack/unpack of one model or context.

    min_bytes: smaller tensors stay on the device. keep_last: the last N candidates of a context
    stay on the device (backward needs them first). prefetch / prefetch_bytes: how many offloaded
    layers (prefetch_unit="layer": hooks() contexts, one per checkpoint call, with every tensor it
    saved) or tensors (prefetch_unit="tensor"), or bytes, to have on their way back ahead of need.
    sees_weights: the hooks see what ops save inside a block, not only a checkpoint's inputs, so
    every candidate is looked up among the model's parameters and buffers (whole-block offload).
    """

    def __init__(self, *, min_bytes=0, keep_last=0, prefetch=1, prefetch_bytes=None, track_modules=False,
                 prefetch_unit="layer", sees_weights=False):
        _check_int("OffloadSession", "min_bytes", min_bytes, 0)
        _check_prefetch("OffloadSession", prefetch, prefetch_bytes, keep_last)
        _check_bool("OffloadSession", "track_modules", track_modules)
        _check_bool("OffloadSession", "sees_weights", sees_weights)
        if prefetch_unit not in ("layer", "tensor"):
            raise ValueError(f"OffloadSession: prefetch_unit must be 'layer' or 'tensor', got {prefetch_unit!r}")
        # The records, the reload points and the hooks themselves live in C++ (csrc/session_core.cpp);
        # this object holds the policy's checks, the model's tensors and the contexts.
        core = self._core = _engine._C.SessionCore()
        core.min_bytes = min_bytes
        core.keep_last = keep_last
        core.prefetch = prefetch
        core.prefetch_bytes = prefetch_bytes
        # "layer": prefetch counts hooks() contexts (one per checkpoint call), however many tensors
        # each saved; "tensor": it counts tensors (offload_activations, one context per forward).
        core.by_layer = prefetch_unit == "layer"
        # Around a whole forward (offload_activations) a leaf that needs grad is a weight: not offloaded.
        core.track_modules = track_modules
        # Its hooks see what ops save inside a block (whole-block offload), weights among them: every
        # candidate is looked up among the model's tensors, also an op's output (torch.func's
        # functional_call registers computed weights), not only leaves and views.
        core.sees_weights = sees_weights
        core.test_cpu = test_cpu_enabled()
        core.owner = weakref.ref(self)  # asked for the model's tensors (_gather_root), weakly
        # The hooks: pack(tensor) -> Packed, pack_kept (kept on the device but still a reload point),
        # unpack(Packed) -> tensor; autograd calls them, without Python in between.
        self.pack = core.hook(0)
        self.pack_kept = core.hook(1)
        self.unpack = core.hook(2)
        # The storages of module weights and buffers, by identity: {storage address: StorageWeakRef}.
        # The weak reference keeps the storage object's address from going to another storage; a
        # data pointer would not (FSDP2 frees unsharded weights, and activations get the memory).
        self._module_ptrs: dict = {}  # the modules noted while tracking (offload_activations)
        self._root = None  # weakref to the model whose forward this is (exclude_module_tensors)
        self._root_ptrs = None  # its tensors' storages, the same mapping, once looked up in this forward
        self._tracking = False  # noting the modules that run (offload_activations): see _track
        # hooks()'s two contexts, made once: entering one pushes its hooks, leaving pops them.
        self._layer_hooks = (_LayerHooks(core, self.pack, self.unpack), _LayerHooks(core, self.pack_kept, self.unpack))
        # What core.run_layer needs for a layer's checkpoint in one call, offloading and kept: made by
        # checkpointing.run_learned when it first runs one.
        self._layer_specs = None
        self.next_layer = core.next_layer  # what is packed from now on belongs to a new layer (the unit prefetch counts by)
        # poll(): the forward (or layer) is over: every source goes back to the allocator now, those
        # whose copy to the host is still running ordered after it on their stream (no host wait).
        # Held longer, they would count as allocated into backward while the host runs ahead of the GPU.
        self.poll = core.poll
        # Saved tensors of a subclass the engine cannot take, kept on the device: None, the pack path
        # warns once per type; a list (an Attachment's sessions), their types are noted there, and the
        # attachment reads them after each layer (it names the layer; checkpointing_state).
        self.kept_types = None

    # The policy, read and written through the core.
    min_bytes = property(lambda self: self._core.min_bytes, lambda self, v: setattr(self._core, "min_bytes", v))
    keep_last = property(lambda self: self._core.keep_last, lambda self, v: setattr(self._core, "keep_last", v))
    prefetch = property(lambda self: self._core.prefetch, lambda self, v: setattr(self._core, "prefetch", v))
    prefetch_bytes = property(lambda self: self._core.prefetch_bytes,
                              lambda self, v: setattr(self._core, "prefetch_bytes", v))
    prefetch_unit = property(lambda self: "layer" if self._core.by_layer else "tensor")
    sees_weights = property(lambda self: self._core.sees_weights)
    test_cpu = property(lambda self: self._core.test_cpu, lambda self, v: setattr(self._core, "test_cpu", v))
    _track_modules = property(lambda self: self._core.track_modules)
    # With midpoints installed (see Midpoints), the reloads a layer's backward starts are held back
    # and started from the middle of that backward, not from its start.
    defer_prefetch = property(lambda self: self._core.defer, lambda self, v: setattr(self._core, "defer", v))
    midpoint_misses = property(lambda self: self._core.misses)

    def moves(self, device) -> bool:
        """Whether the engine takes a saved tensor on `device` (a torch.device or its type): a CUDA
        tensor; a CPU tensor only on the test path (CKPT_OFFLOAD_TEST_CPU=1, as this session was made).
        The pack hook's rule (csrc/session_core.cpp, and _pack_subclass here), asked before anything runs."""
        kind = device if isinstance(device, str) else device.type
        return kind == "cuda" or (kind == "cpu" and self.test_cpu)

    # -- copies --------------------------------------------------------------------------------
    def __getstate__(self):
        """A copy (copy.deepcopy of a configured model, pickling) gets a session of its own with the
        same settings and nothing in flight: records, engines and hooks belong to this one."""
        return {"min_bytes": self.min_bytes, "keep_last": self.keep_last, "prefetch": self.prefetch,
                "prefetch_bytes": self.prefetch_bytes, "track_modules": self._track_modules,
                "prefetch_unit": self.prefetch_unit, "sees_weights": self.sees_weights,
                "defer_prefetch": self.defer_prefetch}

    def __setstate__(self, state):
        state = dict(state)
        defer = state.pop("defer_prefetch")
        self.__init__(**state)
        self.defer_prefetch = defer

    # -- the hooks -----------------------------------------------------------------------------
    def hooks(self, keep=False):
        """Hooks that offload; with keep=True they keep tensors on the device but still mark the
        point where backward reaches them, so the reloads of earlier tensors start there. When the
        context ends (the layer's forward is over), its sources go back to the allocator."""
        self._core.next_layer()
        return self._layer_hooks[1 if keep else 0]

    def new_forward(self):
        """What is packed from now on belongs to a new forward (graph): a backward prefetches only
        records of its own forward, never those of another graph still alive. Raises RuntimeError
        while the current CUDA stream captures a graph."""
        refuse_capture("a forward with offload")
        if _engine._forward_hook is not None:  # the node guard, once; a host cap that follows the node
            _engine._forward_hook()
        self._core.new_forward()

    def _is_candidate(self, t) -> bool:
        """Whether pack would offload t: a plain dense tensor on a CUDA device (or the CPU under the
        test switch) of at least min_bytes, not a parameter, a view of one, or a model's tensor."""
        return self._core.is_candidate(t)

    def arm(self, node) -> bool:
        """Hooks a grad_fn: autograd reaching it starts the reloads held back (see Midpoints)."""
        return self._core.arm(node)

    # -- context -------------------------------------------------------------------------------
    def begin(self):
        self.new_forward()
        if self._track_modules:
            _track(self)
            self._tracking = True

    def end(self):
        """Closes a forward: the keep-last queue stays on the device, finished copies free sources."""
        if self._tracking:
            _untrack(self)
            self._tracking = False
        self._module_ptrs = {}
        self._core.end()

    def exclude_module_tensors(self, model):
        """Never offload model's parameters and buffers (by storage), until the next call. Called
        before each forward of the model: it also starts a new forward (see new_forward). The
        storages are gathered when that forward first needs them (root_storages)."""
        refuse_capture("a forward with offload")
        if _engine._forward_hook is not None:  # as new_forward, without its frame: this runs every forward
            _engine._forward_hook()
        self._core.new_forward()
        self._root = weakref.ref(model)  # weakly: a DataParallel replica runs this hook too, and must go with its step
        self._root_ptrs = None
        self._core.set_root(True)

    def _gather_root(self):
        # The core's request, once per forward that needs it: the keys of root_storages().
        return list(self.root_storages())

    def root_storages(self) -> dict:
        """{storage address: StorageWeakRef} of the parameters and buffers of the model given to
        exclude_module_tensors, gathered once per forward (.to() or FSDP may have moved them)."""
        refs = self._root_ptrs
        if refs is not None:
            return refs
        refs = {}
        # model.parameters() and model.buffers() in one walk over the modules (model.modules()
        # re-yields each module through every generator above it: thousands of calls a step).
        todo, seen = [self._root()], set()
        while todo:
            m = todo.pop()
            if m is None or id(m) in seen:
                continue
            seen.add(id(m))
            for tensors in (m._parameters, m._buffers):
                for t in tensors.values():
                    ref = _storage_ref(t)
                    if ref is not None:
                        refs[ref.cdata] = ref
            todo.extend(m._modules.values())
        self._root_ptrs = refs
        return refs

    def _note_module(self, module):
        inner = module._modules.get("_orig_mod")
        if inner is not None and type(module).__name__ == "OptimizedModule":
            # torch.compile(module): inside it this hook is compiled away, so note everything here.
            tensors = (*inner.parameters(), *inner.buffers())
        else:
            tensors = (*module._parameters.values(), *module._buffers.values())
        keys = []
        for t in tensors:
            ref = _storage_ref(t)
            if ref is not None:
                self._module_ptrs[ref.cdata] = ref
                keys.append(ref.cdata)
        self._core.add_module_keys(keys)


# The sessions that note the modules run inside them (offload_activations contexts), served by one
# global module pre-hook. torch.compile guards on that hook's key, so it goes back under the same
# key each time: a compiled module called in one context reuses its graphs in the next.
_trackers: list = []
_trackers_lock = threading.Lock()
_tracker_hook = None


def _note_modules(module, args):
    if torch.compiler.is_compiling():
        # Traced into a compiled region: nothing to note at run time (the region's parameters
        # reach its saved tensors as Parameters, which are never offloaded).
        return
    for session in _trackers:
        session._note_module(module)


def _track(session):
    global _tracker_hook
    with _trackers_lock:
        _trackers.append(session)
        if len(_trackers) > 1:
            return
        if _tracker_hook is None:
            _tracker_hook = torch.nn.modules.module.register_module_forward_pre_hook(_note_modules)
        else:
            _tracker_hook.hooks_dict_ref()[_tracker_hook.id] = _note_modules


def _untrack(session):
    with _trackers_lock:
        _trackers.remove(session)
        if not _trackers:
            _tracker_hook.remove()


class _LayerHooks(torch.autograd.graph.saved_tensors_hooks):
    """saved_tensors_hooks that hand the layer's sources back when its forward ends: their copies
    have had the whole layer to finish, so the compute stream seldom waits for them, and the last
    layer's inputs are not held into backward."""

    def __init__(self, core, pack, unpack):
        super().__init__(pack, unpack)
        self._poll = core.poll

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._poll()


def _storage_ref(t):
    """A weak reference to a plain tensor's storage, or to a DTensor's local tensor's (to_local()
    hands out plain views of it); None for other subclasses (fake tensors), never offload
    candidates anyway. A storage freed by resize_(0) (FSDP2's reshard) keeps its identity: its
    refilled data is the same weight's."""
    if t is not None and type(t) not in _PLAIN_TYPES:
        t = getattr(t, "_local_tensor", None)
    if t is None or type(t) not in _PLAIN_TYPES:
        return None
    try:
        return StorageWeakRef(t.untyped_storage())
    except RuntimeError:
        return None


_refusal_warned = False


class Refused:
    """Noted in an OffloadSession's kept_types when the host pool refused one of its tensors (the
    cap, the node's memory, a failed host allocation): the block it came from kept it on the device,
    and checkpointing_state() does not count that block as offloaded while it happens."""


def _warn_refused(eng, session=None):
    if session is not None and session.kept_types is not None:
        session.kept_types.append(Refused)
    global _refusal_warned
    if not _refusal_warned:
        _refusal_warned = True
        s = eng.pool.stats()
        spill = eng.pool.spill_stats()
        if spill["failed"]:
            disk = " The disk tier stopped after a write error (stats()['disk_write_errors']; the error was printed)."
        elif spill["io_mode"] is not None:
            disk = " The disk tier had no room either (its max_bytes, or no block of a fitting size to spill)."
        else:
            disk = ""
        if s["alloc_failures"]:
            from .sizing import hostmem

            disk += (f" The system refused a host allocation of {s['failed_alloc_bytes']} bytes "
                     f"(stats()['host_alloc_failures']). {hostmem.pinning_advice()}")
        available = eng.pool.node_available()  # -1: the node guard is off, or reads nothing
        node = f"{available} bytes available on the node" if available >= 0 else "node guard off, the node's memory not read"
        _warn_at_caller(
            "ckpt_offload: the host pool refused a block (capacity cap "
            f"{s['capacity_bytes']} bytes, {s['reserved_bytes']} reserved, {s['alloc_failures']} failed host "
            f"allocations, {s['node_refusals']} refused for the node's memory, {node}); "
            f"tensors that do not fit stay on the device. Gradients are unaffected.{disk} "
            "checkpointing_state() does not count a layer as offloaded while it happens. This warning is shown "
            "once; ckpt_offload.stats()['tensors_kept_on_device'] counts them.",
            RuntimeWarning,
        )


class Unmovable:
    """Noted in an OffloadSession's kept_types when a tensor it would offload stayed where it was
    because the engine cannot take it (a CPU tensor outside the test path, a lazy conjugate or
    negative view): checkpointing_state() does not count that block as offloaded while it happens."""


_unmovable_warned = False


def _warn_unmovable(device, on_cpu, session=None):
    """The pack hook's call for each such tensor: noted for the session's attachment, said once.
    on_cpu: it stayed for being on the CPU outside the test path (else for its layout)."""
    if session is not None and session.kept_types is not None:
        session.kept_types.append(Unmovable)
    global _unmovable_warned
    if not _unmovable_warned:
        _unmovable_warned = True
        if on_cpu:
            why = ("it is on the CPU: the engine copies CUDA tensors to pinned host memory (CPU tensors only "
                   f"under {_TEST_CPU_ENV}=1, a testing aid), so nothing is offloaded on a machine without a GPU")
        else:
            why = "the engine takes dense tensors, not a lazy conjugate or negative view"
        _warn_at_caller(
            f"ckpt_offload: a saved tensor that offloading would move stays on {device}: {why}. Gradients are "
            "unaffected; the memory is not saved. checkpointing_state() does not count a layer as offloaded "
            "while it happens. This warning is shown once; ckpt_offload.stats()['unmovable_tensors_kept'] "
            "counts such tensors.",
            RuntimeWarning,
        )


# -- tensor subclasses: a DTensor's local shard goes through the engine --------------------------
# The pack hook (csrc/session_core.cpp) hands every saved tensor of a subclass to _pack_subclass,
# and what it returns back to _unpack_subclass: once per saved tensor, off the plain tensors' path.

class _Shard:
    """What autograd keeps for a saved DTensor: its local shard's Packed and the layout to rewrap it."""

    __slots__ = ("packed", "mesh", "placements", "shape", "stride")

    def __init__(self, packed, mesh, placements, shape, stride):
        self.packed = packed
        self.mesh = mesh
        self.placements = placements
        self.shape = shape
        self.stride = stride

    # Read and written as a Packed's (policies: allow_cache_entry_mutation).
    version = property(lambda self: self.packed.version, lambda self, v: setattr(self.packed, "version", v))
    current_version = property(lambda self: self.packed.current_version)


def _dtensor_class():
    # Not imported here: without torch.distributed.tensor loaded no tensor is a DTensor.
    api = sys.modules.get("torch.distributed.tensor._api")
    return None if api is None else api.DTensor


def _async_collective_class():
    # The result of a functional collective (a DTensor's redistribute), waited for on first use.
    fc = sys.modules.get("torch.distributed._functional_collectives")
    return None if fc is None else fc.AsyncCollectiveTensor


def _pack_subclass(hook, t, owner):
    """The pack hook's call for a tensor subclass: a DTensor's local shard packed through hook (a
    _Shard), a functional collective's result packed as its plain tensor, or None: t is packed as
    it is, on the device. A subclass the engine cannot take that
    pack would otherwise offload is counted (stats()['subclass_tensors_kept']) and reported."""
    session = owner() if owner is not None else None
    if session is None or isinstance(t, torch.nn.Parameter) or torch.compiler.is_compiling():
        return None
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(t, dtensor):
        # A weight is an nn.Parameter (above) or a module's tensor, found by its shard's storage when
        # packed; another leaf that needs grad (a first layer's input) is an activation.
        local = t._local_tensor
        if local.requires_grad:  # from_local's view of a leaf: not a weight, whatever the flag says
            local = local.detach()
        spec = t._spec
        return _Shard(hook(local), spec.mesh, spec.placements, t.shape, t.stride())
    waits = _async_collective_class()
    if waits is not None and isinstance(t, waits):
        # Its plain result, waited for as the next op would (on a GPU the wait orders streams, the
        # host does not block): the copy to the host is ordered after the collective.
        return hook(t.trigger_wait())
    if hook is session.pack_kept or isinstance(t, _traced_types()):
        return None  # kept anyway, or a tracer's tensor (no data)
    if not session.moves(t.device) or t.numel() * t.element_size() < session.min_bytes:
        return None
    if session._track_modules and t.is_leaf and t.requires_grad:
        return None
    _engine.python_counters["subclass_tensors_kept"] += 1
    if session.kept_types is not None:
        session.kept_types.append(type(t))
    elif type(t) not in _subclass_warned:
        _subclass_warned.add(type(t))
        _warn_subclass(type(t), None)
    return None


def _unpack_subclass(hook, packed):
    """The unpack hook's call for what _pack_subclass made: the shard back, as a DTensor of the same
    mesh, placements, shape and stride."""
    if type(packed) is not _Shard:
        raise TypeError(f"OffloadSession.unpack: expected a Packed, got {type(packed).__name__}")
    return _dtensor_class().from_local(hook(packed.packed), packed.mesh, packed.placements, run_check=False,
                                       shape=packed.shape, stride=packed.stride)


@functools.cache
def _traced_types():
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return FakeTensor, FunctionalTensor


_subclass_warned: set = set()  # the types warned of by sessions outside an Attachment


def _warn_subclass(cls, layer):
    """A saved tensor of this subclass stays on the device (the callers say it once per layer and type)."""
    where = f"layer {layer}" if layer is not None else "a saved tensor"
    _warn_at_caller(
        f"ckpt_offload: {where}: a tensor of type {cls.__module__}.{cls.__qualname__} stays on the device: "
        "the engine takes plain tensors and DTensors (their local shard), not other tensor subclasses. "
        + ("checkpointing_state() does not count this layer as offloaded while it happens. " if layer is not None else "")
        + "Gradients are unaffected. stats()['subclass_tensors_kept'] counts such tensors; shown once per "
        + ("layer and type." if layer is not None else "type."),
        RuntimeWarning,
    )
