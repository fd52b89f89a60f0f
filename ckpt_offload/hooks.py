"""Saved-tensor hooks that send activations through the copy engine and prefetch them in backward.

An OffloadSession holds the policy (what to offload, how far to prefetch) and the order in which
tensors were packed; the engine in ckpt_offload._C does the copies.
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from bisect import bisect_left

import torch
import torch.utils._pytree
from torch.multiprocessing.reductions import StorageWeakRef

from . import engine as _engine

_TEST_CPU_ENV = "CKPT_OFFLOAD_TEST_CPU"
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def test_cpu_enabled() -> bool:
    """CKPT_OFFLOAD_TEST_CPU=1 (a testing aid) sends CPU tensors through the pool and engine too."""
    return os.environ.get(_TEST_CPU_ENV, "0") == "1"


class _Record:
    """One offloaded byte range of a storage: the engine handle while away, the tensor once back."""

    __slots__ = (
        "handle", "engine", "nbytes", "seq", "group", "prefetched", "tensor", "storage_offset", "counter",
        "version", "__weakref__",
    )

    def __init__(self, handle, engine, seq, group, storage_offset, counter, version):
        self.handle = handle
        self.engine = engine
        self.nbytes = handle.nbytes
        self.seq = seq  # the last pack that uses this copy: where backward needs it first
        self.group = group  # the checkpoint call (layer) of that pack
        self.prefetched = False
        self.tensor = None
        self.storage_offset = storage_offset
        self.counter = counter  # the source's version counter, and its value when offloaded
        self.version = version


class _Packed:
    """What autograd keeps for one saved tensor: a record plus how to view it, or the tensor itself
    while it stays on the device (kept, or waiting in the keep-last queue)."""

    __slots__ = ("record", "kept", "view", "seq", "group", "version", "counter", "stream")

    def __init__(self, kept, seq, group=0):
        self.record = None
        self.kept = kept
        self.view = None  # None: the record's own tensor; else (size, stride, element offset delta)
        self.seq = seq  # pack position: a kept tensor's reload point for what was packed before it
        self.group = group  # which hooks() context (checkpoint call) packed it
        # Saved-tensor hooks switch autograd's in-place check off; unpack redoes it with these.
        self.version = kept._version
        self.counter = None  # the version counter, once the tensor itself is no longer held
        self.stream = None  # the producer's stream, for a send deferred by the keep-last queue


def _attach(packed, rec, counter, view):
    """Points packed at rec's copy (as a view of it when view is True) and lets go of the tensor."""
    t = packed.kept
    if view:
        packed.view = (tuple(t.shape), tuple(t.stride()), t.storage_offset() - rec.storage_offset)
    packed.record = rec
    packed.counter = counter
    packed.kept = None


def _modified_error(packed, now):
    t = packed.kept
    what = f"{t.type()} {list(t.shape)}" if t is not None else "an offloaded tensor"
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{what}] is at version {now}; expected version {packed.version} instead. (ckpt_offload checks this "
        "itself: saved-tensor hooks switch off autograd's own check.)"
    )


class OffloadSession:
    """Offload policy and bookkeeping shared by every pack/unpack of one model or context.

    min_bytes: smaller tensors stay on the device. keep_last: the last N candidates of a context
    stay on the device (backward needs them first). prefetch / prefetch_bytes: how many offloaded
    layers (prefetch_unit="layer": hooks() contexts, one per checkpoint call, with every tensor it
    saved) or tensors (prefetch_unit="tensor"), or bytes, to have on their way back ahead of need.
    """

    def __init__(self, *, min_bytes=0, keep_last=0, prefetch=1, prefetch_bytes=None, track_modules=False,
                 prefetch_unit="layer"):
        _check_int("OffloadSession", "min_bytes", min_bytes, 0)
        _check_int("OffloadSession", "keep_last", keep_last, 0)
        _check_int("OffloadSession", "prefetch", prefetch, 0)
        if prefetch_bytes is not None:
            _check_int("OffloadSession", "prefetch_bytes", prefetch_bytes, 1)
        if prefetch_unit not in ("layer", "tensor"):
            raise ValueError(f"OffloadSession: prefetch_unit must be 'layer' or 'tensor', got {prefetch_unit!r}")
        # "layer": prefetch counts hooks() contexts (one per checkpoint call), however many tensors
        # each saved; "tensor": it counts tensors (offload_activations, one context per forward).
        self.prefetch_unit = prefetch_unit
        self._group = 0
        self.min_bytes = min_bytes
        self.keep_last = keep_last
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes
        self.test_cpu = test_cpu_enabled()
        self._lock = threading.Lock()
        self._seqs: list[int] = []  # pack order of live records, ascending
        self._refs: list = []  # weakrefs to the records, aligned with _seqs
        self._next_seq = 0
        self._compact_at = 64
        self._by_storage: dict = {}  # StorageWeakRef -> [(weakref(record), start, end, dtype)]
        self._deferred: list = []  # keep-last queue of _Packed still holding their tensor
        self._engines = {}
        self._module_ptrs: set = set()
        self._module_hook = None
        self._track_modules = track_modules
        # With midpoints installed (see Midpoints), the reloads a layer's backward starts are held
        # here and started from the middle of that backward, not from its start.
        self.defer_prefetch = False
        # .pending: (seq, group, graph task) held by this thread's backward (autograd runs a
        # device's backward on one thread, the same for a layer's reload point and its midpoint).
        self._tls = threading.local()
        self.midpoint_misses = 0

    # -- the hooks -----------------------------------------------------------------------------
    def hooks(self, keep=False):
        """Hooks that offload; with keep=True they keep tensors on the device but still mark the
        point where backward reaches them, so the reloads of earlier tensors start there."""
        self.next_layer()
        return torch.autograd.graph.saved_tensors_hooks(self.pack_kept if keep else self.pack, self.unpack)

    def next_layer(self):
        """What is packed from now on belongs to a new layer (the unit prefetch counts by)."""
        with self._lock:
            self._group += 1

    def _is_candidate(self, t) -> bool:
        # Parameters, buffers, tensor subclasses (fake, functional, DTensor), meta and CPU tensors
        # are never offloaded: nothing is freed by copying them, or there is no data to copy.
        if type(t) is not torch.Tensor:
            return False
        if self._track_modules and t.is_leaf and t.requires_grad:
            # Around a whole forward, a leaf that needs grad is a weight held elsewhere: copying it
            # frees nothing. A checkpoint's own positional inputs are always offloaded.
            return False
        dev = t.device.type
        if dev != "cuda" and not (dev == "cpu" and self.test_cpu):
            return False
        if t.layout != torch.strided or t.is_nested or t.is_quantized or t.is_conj() or t.is_neg():
            return False
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or nbytes < self.min_bytes:
            return False
        if self._module_ptrs and t.untyped_storage().data_ptr() in self._module_ptrs:
            return False
        return True

    def _number(self, t):
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        return _Packed(t, seq, self._group)

    def pack(self, t):
        if not self._is_candidate(t):
            return _Packed(t, self._next_seq, self._group)
        packed = self._number(t)
        if self.keep_last > 0:
            # The newest keep_last candidates wait on the device; the oldest of them goes now.
            if t.is_cuda:
                packed.stream = torch.cuda.current_stream(t.device)
            self._deferred.append(packed)
            if len(self._deferred) > self.keep_last:
                self._send(self._deferred.pop(0))
        else:
            self._send(packed)
        return packed

    def pack_kept(self, t):
        return self._number(t) if self._is_candidate(t) else _Packed(t, self._next_seq, self._group)

    def unpack(self, packed):
        if packed.kept is not None:
            if packed.kept._version != packed.version:
                raise _modified_error(packed, packed.kept._version)
            self._reload_point(packed.seq, packed.group)
            return packed.kept
        if packed.counter.value != packed.version:
            raise _modified_error(packed, packed.counter.value)
        base = self._load(packed.record, packed)
        if packed.view is None:
            return base
        size, stride, delta = packed.view
        return base.as_strided(size, stride, base.storage_offset() + delta)

    # -- offload -------------------------------------------------------------------------------
    def _engine_for(self, device):
        eng = self._engines.get(device)
        if eng is None:
            eng = self._engines[device] = _engine.engine_for(device)
        return eng

    def _send(self, packed):
        t = packed.kept
        ref = StorageWeakRef(t.untyped_storage())
        start = t.storage_offset()
        end = start + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        version = packed.version
        counter = _engine._C.VersionCounter(t)
        with self._lock:
            # A view of a range already on its way: share that copy instead of moving it twice,
            # unless either side was written since (the copy would be stale).
            for rec_ref, r_start, r_end, r_dtype in self._by_storage.get(ref, ()):
                rec = rec_ref()
                if (
                    rec is not None
                    and r_dtype == t.dtype
                    and rec.version == version
                    and rec.counter.value == rec.version
                    and r_start <= start
                    and end <= r_end
                ):
                    _engine.count("shared_views")
                    _attach(packed, rec, counter, view=True)
                    self._move_locked(rec, packed.seq, packed.group)
                    return
        src = t
        if end - start > t.numel():
            # Gaps between elements (q, k, v split from one projection): when the whole storage is
            # not much larger, move it once and view every slice from it, instead of compacting
            # each slice on the device first.
            storage_elems = t.untyped_storage().nbytes() // t.element_size()
            if storage_elems * t.element_size() <= 4 * t.numel() * t.element_size():
                src = t.detach().as_strided((storage_elems,), (1,), 0)
                start, end = 0, storage_elems
        eng = self._engine_for(t.device)
        stream = packed.stream
        if stream is not None and stream != torch.cuda.current_stream(t.device):
            with torch.cuda.stream(stream):  # order the copy after the producer, not today's stream
                handle = eng.offload(src)
        else:
            handle = eng.offload(src)
        if handle is None:
            _engine.count("tensors_kept_on_device")
            _warn_refused(eng)
            return  # stays on the device
        with self._lock:
            seq = packed.seq
            rec = _Record(handle, eng, seq, packed.group, start, counter, version)
            self._seqs.append(seq)
            self._refs.append(weakref.ref(rec))
            if len(self._refs) >= self._compact_at:
                self._compact()
            if not handle.compacted:
                entries = self._by_storage.setdefault(ref, [])
                # A storage that outlives its graphs (an input fed every step) keeps one list.
                entries[:] = [e for e in entries if e[0]() is not None]
                entries.append((weakref.ref(rec), start, end, t.dtype))
                if len(self._by_storage) > max(256, 2 * len(self._refs)):
                    self._prune_storages()
        _attach(packed, rec, counter, view=src is not t)

    def _move_locked(self, rec, seq, group):
        """A later pack shares rec's copy: backward needs it first there, so it is reloaded with
        that pack's layer. Caller holds the lock."""
        for j in range(len(self._refs) - 1, -1, -1):
            if self._refs[j]() is rec:
                del self._seqs[j], self._refs[j]
                break
        else:
            return
        rec.seq, rec.group = seq, group
        j = bisect_left(self._seqs, seq)
        self._seqs.insert(j, seq)
        self._refs.insert(j, weakref.ref(rec))

    def _compact(self):
        # Records of graphs that died without backward leave dead entries; drop them with a
        # doubling threshold so the cost stays constant per pack. Caller holds the lock.
        live = [(q, x) for q, x in zip(self._seqs, self._refs) if x() is not None]
        self._seqs = [q for q, _ in live]
        self._refs = [x for _, x in live]
        self._prune_storages()
        self._compact_at = max(64, 2 * len(self._refs))

    def _prune_storages(self):
        for key in [k for k in self._by_storage if k.expired()]:
            del self._by_storage[key]

    # -- reload --------------------------------------------------------------------------------
    def _load(self, rec, packed):
        if rec.tensor is None:
            rec.tensor = rec.engine.fetch(rec.handle)  # first: the copy needed now goes first
            rec.handle = None  # fetched: the host block is back in the pool
            # The pack being unpacked, not the record's: a copy shared with a later graph's pack
            # sits among that graph's entries, and this backward must not reload those.
            self._reload_point(packed.seq, packed.group)
        return rec.tensor

    def _reload_point(self, seq, group):
        """Backward reached the tensor packed at seq: start the reloads of what was packed before
        it, now, or with midpoints at the middle of this layer's backward (flush_prefetch)."""
        if not self.defer_prefetch:
            self._prefetch_before(seq)
            return
        task = _graph_task_id()
        held = getattr(self._tls, "pending", None)
        if held is not None and held[2] != task:
            held = None  # left by an earlier backward (one that stopped partway): stale
        if held is not None and held[1] != group:
            # The previous layer's midpoint never fired (its hooked output got no gradient): start
            # its reloads now and reload from the start of each backward from here on.
            self.midpoint_misses += 1
            _engine.count("midpoint_misses")
            self.defer_prefetch = False
            self._tls.pending = None
            self._prefetch_before(min(held[0], seq))
            return
        # Several inputs of one layer: the earliest.
        self._tls.pending = (seq if held is None else min(held[0], seq), group, task)

    def flush_prefetch(self):
        """Starts the reloads held by _reload_point (called from the middle of a layer's backward)."""
        held = getattr(self._tls, "pending", None)
        self._tls.pending = None
        if held is not None and held[2] == _graph_task_id():  # else left by an earlier backward
            self._prefetch_before(held[0])

    def _prefetch_before(self, seq):
        """Start the reloads backward needs next: records packed before position seq, nearest first."""
        if self.prefetch <= 0:
            return
        with self._lock:
            seqs, refs = self._seqs, self._refs
            # Drop finished entries at the tail: backward consumes the newest first.
            while refs:
                last = refs[-1]()
                if last is not None and last.handle is not None:
                    break
                seqs.pop()
                refs.pop()
            i = bisect_left(seqs, seq) - 1
            queued = queued_bytes = 0
            group = None
            by_layer = self.prefetch_unit == "layer"
            todo = []
            while i >= 0:
                r = refs[i]()
                i -= 1
                if r is None or r.handle is None:
                    continue
                if not by_layer or r.group != group:  # a new unit: a layer's tensors go together
                    if queued >= self.prefetch:
                        break
                    if self.prefetch_bytes is not None and queued > 0 and queued_bytes + r.nbytes > self.prefetch_bytes:
                        break
                    queued += 1
                    group = r.group
                queued_bytes += r.nbytes
                if not r.prefetched:
                    r.prefetched = True
                    todo.append(r)
        for r in todo:
            handle = r.handle
            if handle is not None:
                r.engine.prefetch(handle)

    # -- context -------------------------------------------------------------------------------
    def begin(self):
        if self._track_modules:
            self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._note_module)

    def end(self):
        """Closes a forward: the keep-last queue stays on the device, finished copies free sources."""
        if self._module_hook is not None:
            self._module_hook.remove()
            self._module_hook = None
        self._module_ptrs = set()
        self._deferred = []
        self.poll()

    def attach(self, model, blocks) -> list:
        """The hooks a checkpointed model needs around this session; returns their handles.

        Before each forward, the model's own weights and buffers, which a block may receive
        positionally, are excluded from offload (looked up anew: .to() or FSDP may move them).
        After each forward, sources go back to the allocator. Reloads start mid-backward in each
        of `blocks` when they allow it (see Midpoints).
        """
        handles = [
            model.register_forward_pre_hook(lambda module, args: self.exclude_module_tensors(module)),
            model.register_forward_hook(lambda *_: self.poll()),
        ]
        if Midpoints.usable(blocks):
            handles.append(Midpoints(self, blocks))
        return handles

    def exclude_module_tensors(self, model):
        """Never offload model's parameters and buffers (by storage), until the next call."""
        ptrs = set()
        for t in (*model.parameters(), *model.buffers()):
            ptr = _storage_ptr(t)
            if ptr:
                ptrs.add(ptr)
        self._module_ptrs = ptrs

    def _note_module(self, module, args):
        for t in (*module._parameters.values(), *module._buffers.values()):
            ptr = _storage_ptr(t)
            if ptr:
                self._module_ptrs.add(ptr)

    def poll(self):
        """The forward is over: every source goes back to the allocator now, those whose copy to
        the host is still running ordered after it on their stream (no host wait). Held longer,
        they would count as allocated into backward while the host runs ahead of the GPU."""
        for eng in self._engines.values():
            eng.release_sources(0)


_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (a checkpoint's recompute, say)."""
    return _graph_task_id is not None and _graph_task_id() != -1


class Midpoints:
    """Moves where a checkpointed layer's backward starts the reloads of earlier layers: from its
    start to its middle.

    At its start the layer recomputes its forward, and its backward's largest tensors (the MLP's)
    come first: reloads started there sit on the device at that layer's memory peak, so each layer
    in flight costs its full input at the peak. From the middle, they arrive while the rest of the
    backward (attention, for a transformer block) still hides the copy, after the peak.

    The middle: the first forward records the order in which each block's direct children run;
    the midpoint is the child nearest the halfway point whose output has a gradient. In every
    forward (not in the recompute) a hook goes on the autograd node of the midpoint's output;
    autograd calls it halfway through the block's backward. A block without such a child, or a
    hook that does not fire, turns the session back to reloading from the start of each backward.
    """

    def __init__(self, session, blocks):
        self.session = session
        session.defer_prefetch = True  # reload points wait for the midpoints from now on
        self.mid = {}  # block -> its midpoint child, once the first forward has shown the order
        self._tls = threading.local()  # .calls: {block: [(child, node)]}; .armed: set of blocks
        self.handles = []
        for b in blocks:
            kids = list(b.children())
            self.handles.append(b.register_forward_pre_hook(self._block_pre))
            # always_call: a forward that raises still ends the learning, so the nodes it kept go.
            self.handles.append(b.register_forward_hook(self._block_post, always_call=True))
            for c in kids:
                self.handles.append(c.register_forward_hook(functools.partial(self._child_post, b)))

    @staticmethod
    def usable(blocks) -> bool:
        """Every block has at least two children to find a middle between (and this torch tells
        a backward's recompute from a forward)."""
        return _graph_task_id is not None and all(len(list(b.children())) >= 2 for b in blocks)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _state(self):
        tls = self._tls
        if not hasattr(tls, "calls"):
            tls.calls, tls.armed = {}, set()
        return tls

    def _block_pre(self, block, args):
        if _in_backward():
            return
        tls = self._state()
        if block in self.mid:
            tls.armed.add(block)
        else:
            tls.calls[block] = []

    def _child_post(self, block, child, args, out):
        if _in_backward() or not torch.is_grad_enabled():
            return
        tls = self._state()
        if block in tls.calls:  # this thread's forward is learning the order (first forward)
            tls.calls[block].append((child, _grad_node(out)))
        elif block in self.mid:
            # The midpoint's first call only: a child called twice (one dropout module for both
            # branches) would otherwise also fire at the start of the backward.
            if child is self.mid[block] and block in tls.armed:
                tls.armed.discard(block)
                node = _grad_node(out)
                if node is not None:
                    node.register_prehook(self._fire)

    def _block_post(self, block, args, out):
        if _in_backward():
            return
        tls = self._state()
        tls.armed.discard(block)
        calls = tls.calls.pop(block, None)
        if not calls or out is None:  # nothing learned, or the forward raised
            return
        order = list(dict.fromkeys(c for c, _ in calls))
        nodes = {}
        for c, node in calls:
            nodes.setdefault(c, node)  # the first call of each child
        middle = (len(order) - 1) / 2
        with_grad = [i for i, c in enumerate(order) if nodes[c] is not None]
        if not with_grad:
            # Nothing in this block carries a gradient to hook: reload from the start instead.
            self.session.defer_prefetch = False
            return
        i = min(with_grad, key=lambda j: (abs(j - middle), j))
        self.mid[block] = order[i]
        nodes[order[i]].register_prehook(self._fire)  # this forward's midpoint too

    def _fire(self, grad_outputs):
        self.session.flush_prefetch()


def _grad_node(out):
    """The autograd node of the first tensor in out that carries a gradient, else None."""
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
            return t.grad_fn
    return None


def _storage_ptr(t):
    """Data pointer of a plain tensor's storage; None for subclasses (DTensor under FSDP2, fake
    tensors) and freed storages, which are never offload candidates anyway."""
    if t is None or type(t) not in _PLAIN_TYPES:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


_refusal_warned = False


def _warn_refused(eng):
    global _refusal_warned
    if not _refusal_warned:
        _refusal_warned = True
        s = eng.pool.stats()
        warnings.warn(
            "ckpt_offload: the host pool refused a block (capacity cap "
            f"{s['capacity_bytes']} bytes, {s['reserved_bytes']} reserved, {s['alloc_failures']} failed host "
            "allocations); tensors that do not fit stay on the device. Gradients are unaffected. "
            "This warning is shown once; ckpt_offload.stats()['tensors_kept_on_device'] counts them.",
            RuntimeWarning,
            stacklevel=3,
        )


class offload_activations:
    """Context manager: every activation saved for backward inside it, of at least min_bytes, is
    copied asynchronously to pinned host memory and prefetched back in backward.

    Parameters, buffers, CPU, meta and subclass tensors stay where they are; views of one storage
    range move once. keep_last: the last N saved tensors stay on the device. prefetch: how many
    saved tensors are on their way back ahead of need (prefetch_bytes caps it by bytes).
    """

    def __init__(self, min_bytes: int = 1 << 20, keep_last: int = 0, prefetch: int = 4, prefetch_bytes=None):
        _check_int("offload_activations", "min_bytes", min_bytes, 0)
        _check_int("offload_activations", "keep_last", keep_last, 0)
        _check_int("offload_activations", "prefetch", prefetch, 0)
        if prefetch_bytes is not None:
            _check_int("offload_activations", "prefetch_bytes", prefetch_bytes, 1)
        self.session = OffloadSession(
            min_bytes=min_bytes,
            keep_last=keep_last,
            prefetch=prefetch,
            prefetch_bytes=prefetch_bytes,
            track_modules=True,
            prefetch_unit="tensor",
        )
        self._hooks = None

    def __enter__(self):
        if self._hooks is not None:
            raise RuntimeError("offload_activations: this context is already active; create a new one to nest")
        self.session.begin()
        self._hooks = self.session.hooks()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._hooks = None
            self.session.end()
        return False


def _check_int(where, name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value}")
