"""OffloadSession: the offload policy (what to offload, how far to prefetch) and the bookkeeping of
one model or context; its saved-tensor hooks send activations through the copy engine in
ckpt_offload._C and bring them back ahead of need in backward.
"""
from __future__ import annotations

import functools
import os
import re
import threading
import warnings
import weakref
from bisect import bisect_left, bisect_right

import torch
import torch.autograd.profiler as _autograd_profiler
from torch.multiprocessing.reductions import StorageWeakRef

from . import engine as _engine
from . import timeline as _timeline
from ._args import check_bool as _check_bool
from ._args import check_int as _check_int
from ._args import check_prefetch as _check_prefetch
from .midpoints import _graph_task_id

_TEST_CPU_ENV = "CKPT_OFFLOAD_TEST_CPU"
_POOL = _engine.host_pool()  # the process-wide pool (the one engine_for's engines share) and its disk tier
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_storage_key = _engine._C.storage_key  # a storage's address, as UntypedStorage._cdata and StorageWeakRef.cdata
_storage_span = _engine._C.storage_span  # (storage_key, first element, one past the last, elements)
_offload_size = _engine._C.offload_size


def test_cpu_enabled() -> bool:
    """CKPT_OFFLOAD_TEST_CPU=1 (a testing aid) sends CPU tensors through the pool and engine too."""
    return os.environ.get(_TEST_CPU_ENV, "0") == "1"


class _Record:
    """One offloaded byte range of a storage: the engine handle (the host copy, for as long as the
    record lives), and the tensor once back while views sharing it are still to be unpacked."""

    __slots__ = (
        "handle", "engine", "nbytes", "seq", "group", "prefetched", "read_ahead", "tensor", "storage_offset",
        "version", "users", "left", "task", "__weakref__",
    )

    def __init__(self, handle, engine, seq, group, storage_offset, version):
        self.handle = handle
        self.engine = engine
        self.nbytes = handle.nbytes
        self.seq = seq  # the last pack that uses this copy: where backward needs it first
        self.group = group  # the checkpoint call (layer) of that pack
        self.prefetched = False  # a reload is on its way (started ahead of the fetch)
        self.read_ahead = False  # a read from the disk tier was asked for (it does nothing on host)
        self.tensor = None
        self.storage_offset = storage_offset
        self.version = version  # the source's version when offloaded (handle.value reads it now)
        self.users = 0  # the packs attached to this copy (views of one range share it)
        self.left = 0  # of those, how many this backward has still to unpack while tensor is held
        self.task = None  # the backward (graph task) that fetched it last: not prefetched again there


class _Packed:
    """What autograd keeps for one saved tensor: a record plus how to view it, or the tensor itself
    while it stays on the device (kept, or waiting in the keep-last queue)."""

    __slots__ = ("record", "kept", "view", "seq", "group", "version", "counter", "stream", "source")

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
        self.source = None  # weakref to the tensor once offloaded: names its grad_fn in _modified_error


def _attach(packed, rec, counter, view):
    """Points packed at rec's copy (as a view of it when view is True) and lets go of the tensor."""
    t = packed.kept
    if view:
        packed.view = (tuple(t.shape), tuple(t.stride()), t.storage_offset() - rec.storage_offset)
    packed.record = rec
    rec.users += 1
    packed.counter = counter
    packed.source = weakref.ref(t)
    packed.kept = None


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
    else:
        rec = packed.record
        like = rec.tensor if rec.tensor is not None else rec.handle
        shape = packed.view[0] if packed.view is not None else like.shape
        what = f"{torch.empty(0, dtype=like.dtype, device=like.device).type()} {list(shape)}"
        t = packed.source() if packed.source is not None else None
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
        # Its hooks see what ops save inside a block (whole-block offload), weights among them: every
        # candidate is looked up among the model's tensors, also an op's output (torch.func's
        # functional_call registers computed weights), not only leaves and views.
        self.sees_weights = sees_weights
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
        # storage_key -> [(weakref(record), start, end, dtype)]: a live record's handle holds its
        # storage weakly, so no other storage takes that key while an entry can match.
        self._by_storage: dict = {}
        self._prune_at = 256
        self._forward_starts: list[int] = []  # pack position where each forward began, ascending
        self._deferred: list = []  # keep-last queue of _Packed still holding their tensor
        self._engines = {}
        # The storages of module weights and buffers, by identity: {storage address: StorageWeakRef}.
        # The weak reference keeps the storage object's address from going to another storage; a
        # data pointer would not (FSDP2 frees unsharded weights, and activations get the memory).
        self._module_ptrs: dict = {}  # the modules noted while tracking (offload_activations)
        self._root = None  # weakref to the model whose forward this is (exclude_module_tensors)
        self._root_ptrs = None  # its tensors' storages, the same mapping, once looked up in this forward
        self._tracking = False  # noting the modules that run (offload_activations): see _track
        self._track_modules = track_modules
        # With midpoints installed (see Midpoints), the reloads a layer's backward starts are held
        # here and started from the middle of that backward, not from its start.
        self.defer_prefetch = False
        # .pending: (seq, group, graph task) held by this thread's backward (autograd runs a
        # device's backward on one thread, the same for a layer's reload point and its midpoint).
        self._tls = threading.local()
        self.midpoint_misses = 0
        # hooks()'s two contexts, made once: entering one pushes its hooks, leaving pops them.
        self._layer_hooks = (_LayerHooks(self, self.pack, self.unpack), _LayerHooks(self, self.pack_kept, self.unpack))
        self._ahead = (None, 0)  # (graph task, the disk tier's read-ahead then): read once a backward

    # -- copies --------------------------------------------------------------------------------
    def __getstate__(self):
        """A copy (copy.deepcopy of a configured model, pickling) gets a session of its own with the
        same settings and nothing in flight: records, engines and locks belong to this one."""
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
        with self._lock:  # next_layer()
            self._group += 1
        return self._layer_hooks[1 if keep else 0]

    def new_forward(self):
        """What is packed from now on belongs to a new forward (graph): a backward prefetches only
        records of its own forward, never those of another graph still alive."""
        with self._lock:
            starts, seq = self._forward_starts, self._next_seq
            if not starts or starts[-1] != seq:
                starts.append(seq)
            # Only starts at or after the oldest live record still delimit anything.
            oldest = self._seqs[0] if self._seqs else seq
            while len(starts) > 1 and starts[1] <= oldest:
                starts.pop(0)

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
        # A dense strided tensor with data on a CUDA device (or the CPU under the test switch), not
        # nested, quantized or a lazy conjugate or negative view: its bytes; else -1.
        nbytes = _offload_size(t, self.test_cpu)
        if nbytes <= 0 or nbytes < self.min_bytes:
            return False
        base = t._base
        if base is not None and (isinstance(base, torch.nn.Parameter) or type(base) is not torch.Tensor):
            # A view of a parameter (F.linear saves weight.t()): copying it frees nothing, and under
            # FSDP2 the unsharded parameter's storage is freed (resize_(0)) after the forward, possibly
            # while the copy still reads it. Looked up per view: FSDP2 registers its unsharded
            # parameters after the module hooks have noted the sharded ones.
            return False
        if self._module_ptrs and _storage_key(t) in self._module_ptrs:
            return False
        if self._root is not None and (base is not None or t.grad_fn is None or self.sees_weights
                                       or self._root_ptrs is not None):
            # A module's weight or buffer given positionally (a buffer, a detach()ed weight, a view of
            # either). An op's fresh output (a grad_fn, no base: the hidden states a block gets) has a
            # storage of its own and needs no lookup, so the model's tensors are gathered only when
            # a forward first packs something else.
            if _storage_key(t) in self.root_storages():
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
    def _engine_for(self, t):
        index = t.get_device()  # -1: the CPU
        eng = self._engines.get(index)
        if eng is None:
            eng = self._engines[index] = _engine.engine_for(t.device)
        return eng

    def _send(self, packed):
        t = packed.kept
        # The storage's identity while a record of it lives (its handle holds it), and the element
        # range the tensor covers in it.
        key, start, end, numel = _storage_span(t)
        version = packed.version
        entries = self._by_storage.get(key)
        # One dead entry: the address of a storage whose records are gone, now another's (the
        # allocator reuses addresses at once): nothing to share.
        if entries and (len(entries) > 1 or entries[0][0]() is not None):
            with self._lock:
                # A view of a range already on its way: share that copy instead of moving it twice,
                # unless either side was written since (the copy would be stale).
                for rec_ref, r_start, r_end, r_dtype in entries:
                    rec = rec_ref()
                    if (
                        rec is not None
                        and r_dtype == t.dtype
                        and rec.version == version
                        and rec.handle.value == rec.version
                        and r_start <= start
                        and end <= r_end
                    ):
                        _engine.count("shared_views")
                        # Its own counter: a tensor sharing the storage need not share the version.
                        _attach(packed, rec, _engine._C.VersionCounter(t), view=True)
                        self._move_locked(rec, packed.seq, packed.group)
                        return
        src = t
        if end - start > numel:
            # Gaps between elements (q, k, v split from one projection): when the whole storage is
            # not much larger, move it once and view every slice from it, instead of compacting
            # each slice on the device first.
            storage_elems = t.untyped_storage().nbytes() // t.element_size()
            if storage_elems * t.element_size() <= 4 * t.numel() * t.element_size():
                src = t.detach().as_strided((storage_elems,), (1,), 0)
                start, end = 0, storage_elems
        eng = sender = self._engine_for(t)
        if _timeline.enabled or _autograd_profiler._is_profiler_enabled:  # named for a profiler or a timeline
            sender = _timeline.NamedEngine(eng, self, packed.group)
        stream = packed.stream
        if stream is not None and stream != torch.cuda.current_stream(t.device):
            with torch.cuda.stream(stream):  # order the copy after the producer, not today's stream
                handle = sender.offload(src)
        else:
            handle = sender.offload(src)
        if handle is None:
            _engine.count("tensors_kept_on_device")
            _warn_refused(eng)
            return  # stays on the device
        seq = packed.seq
        rec = _Record(handle, eng, seq, packed.group, start, version)
        rec_ref = weakref.ref(rec)
        with self._lock:
            self._seqs.append(seq)
            self._refs.append(rec_ref)
            if len(self._refs) >= self._compact_at:
                self._compact()
            if not handle.compacted:
                entries = self._by_storage.get(key)
                if entries is None or (len(entries) == 1 and entries[0][0]() is None):
                    self._by_storage[key] = [(rec_ref, start, end, t.dtype)]
                    if entries is None and len(self._by_storage) > self._prune_at:
                        self._prune_storages()
                else:  # a storage that outlives its graphs (an input fed every step) keeps one list
                    entries[:] = [e for e in entries if e[0]() is not None]
                    entries.append((rec_ref, start, end, t.dtype))
        _attach(packed, rec, handle, view=src is not t)

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
        # A key whose records are all gone: its storage's address may belong to another by now.
        by = self._by_storage
        for key in [k for k, entries in by.items() if all(e[0]() is None for e in entries)]:
            del by[key]
        self._prune_at = max(256, 2 * len(by))

    # -- reload --------------------------------------------------------------------------------
    def _load(self, rec, packed):
        t = rec.tensor
        if t is not None:  # a view sharing the copy, unpacked before: the last one lets it go
            rec.left -= 1
            if rec.left <= 0:
                rec.tensor = None
            return t
        # The host copy stays until the record dies: autograd does not tell unpack hooks whether
        # this backward retains the graph, and a retained graph must be reloaded (with prefetch)
        # by the next one. The device copy is not held here: autograd holds it as long as a node
        # needs it, and then it goes, retained graph or not. Without retain_graph the record dies
        # when its node is released, so the block returns to the pool a node later than at the
        # fetch, long after the pool's peak (the end of the forward), and nothing is copied twice.
        eng = rec.engine
        if _timeline.enabled or _autograd_profiler._is_profiler_enabled:
            eng = _timeline.NamedEngine(eng, self, rec.group, rec.prefetched)
        t = eng.fetch(rec.handle, True)  # first: the copy needed now goes first
        rec.prefetched = False
        rec.task = _graph_task_id() if _graph_task_id is not None else -1
        if rec.users > 1:
            rec.tensor, rec.left = t, rec.users - 1
        # The pack being unpacked, not the record's: a copy shared with a later graph's pack
        # sits among that graph's entries, and this backward must not reload those.
        self._reload_point(packed.seq, packed.group)
        return t

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
        """Start the reloads backward needs next: records packed before position seq in the same
        forward (see new_forward), nearest first. With a disk tier, the `spill_read_ahead` units
        after those start their reads from disk into host memory, so the reload finds them there."""
        if self.prefetch <= 0 or not self._refs:  # nothing offloaded
            return
        task = _graph_task_id() if _graph_task_id is not None else -1
        ahead = self._ahead[1]
        if task == -1 or self._ahead[0] != task:
            ahead = _POOL.spill_read_ahead  # 0 without a disk tier
            self._ahead = (task, ahead)
        with self._lock:
            seqs, refs = self._seqs, self._refs
            # Drop dead entries at the tail: backward consumes the newest first. A record fetched
            # but alive (a retained graph) stays: the next backward reloads it.
            while refs and refs[-1]() is None:
                seqs.pop()
                refs.pop()
            i = bisect_left(seqs, seq) - 1
            # Records packed before the forward that packed seq belong to other graphs (kept alive
            # without backward, or micro-batches whose backward comes later): not this backward's.
            starts = self._forward_starts
            j = bisect_right(starts, seq) - 1
            lowest = starts[j] if j >= 0 else -1
            queued = queued_bytes = 0
            limit = self.prefetch + ahead
            group = None
            by_layer = self.prefetch_unit == "layer"
            todo = []
            reads = []
            while i >= 0 and seqs[i] >= lowest:
                r = refs[i]()
                i -= 1
                if r is None or r.task == task:  # fetched by this backward already
                    continue
                if not by_layer or r.group != group:  # a new unit: a layer's tensors go together
                    if queued >= limit:
                        break
                    if (queued < self.prefetch and self.prefetch_bytes is not None and queued > 0
                            and queued_bytes + r.nbytes > self.prefetch_bytes):
                        if not ahead:
                            break
                        queued = self.prefetch  # the byte budget ends the reloads; the reads go on
                    queued += 1
                    group = r.group
                if queued > self.prefetch:
                    if not r.prefetched and not r.read_ahead:
                        r.read_ahead = True
                        reads.append(r)
                    continue
                queued_bytes += r.nbytes
                if not r.prefetched:
                    r.prefetched = True
                    todo.append(r)
        named = _timeline.enabled or _autograd_profiler._is_profiler_enabled
        for r in todo:
            (_timeline.NamedEngine(r.engine, self, r.group) if named else r.engine).prefetch(r.handle)
        for r in reads:
            if not r.engine.read_ahead(r.handle):
                r.read_ahead = False  # no host block free yet: asked again at the next reload point

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
        self._deferred = []
        self.poll()

    def exclude_module_tensors(self, model):
        """Never offload model's parameters and buffers (by storage), until the next call. Called
        before each forward of the model: it also starts a new forward (see new_forward). The
        storages are gathered when that forward first needs them (root_storages)."""
        self.new_forward()
        self._root = weakref.ref(model)  # weakly: a DataParallel replica runs this hook too, and must go with its step
        self._root_ptrs = None

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
        for t in tensors:
            ref = _storage_ref(t)
            if ref is not None:
                self._module_ptrs[ref.cdata] = ref

    def poll(self):
        """The forward is over: every source goes back to the allocator now, those whose copy to
        the host is still running ordered after it on their stream (no host wait). Held longer,
        they would count as allocated into backward while the host runs ahead of the GPU."""
        for eng in self._engines.values():
            eng.release_sources(0)


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

    def __init__(self, session, pack, unpack):
        super().__init__(pack, unpack)
        self._session = session

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._session.poll()


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


def _warn_refused(eng):
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
        warnings.warn(
            "ckpt_offload: the host pool refused a block (capacity cap "
            f"{s['capacity_bytes']} bytes, {s['reserved_bytes']} reserved, {s['alloc_failures']} failed host "
            f"allocations); tensors that do not fit stay on the device. Gradients are unaffected.{disk} "
            "This warning is shown once; ckpt_offload.stats()['tensors_kept_on_device'] counts them.",
            RuntimeWarning,
            stacklevel=3,
        )
