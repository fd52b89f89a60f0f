"""estimate_memory: the device and host memory of a training step, sized on the meta device.

The model and its inputs live on the meta device, so nothing is allocated: the step's forward and
backward run there once per measured mode ("none" and "checkpoint") under a dispatch mode that keeps
the live bytes of every storage, with marks at the repeated blocks' boundaries, exactly as
`plan_memory` profiles a real step. The result is a `planner.CostModel` (the bytes measured, times
from the operations' FLOPs at a nominal rate) and the peaks of the uniform configurations composed
from it; `"checkpoint+offload"` follows from `"checkpoint"` with each block's checkpointed inputs on
the host. Identical blocks are measured once: the first block, one more of each kind, the last; the
others take their figures.

`python -m ckpt_offload estimate` (ckpt_offload.sizing.cli) does the same for a transformers config.json.
"""
from __future__ import annotations

import contextlib
import json
import sys

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .. import planner as _planner
from . import recipe as _recipe
from ..testing import LiveBytes
from ..model import disable_checkpointing, enable_block_modes, find_repeated_blocks
from ..selection import block_modes
from ..training import training_mode

MODES = ("none", "checkpoint", "checkpoint+offload", "every_n=2")
ATTENTION = ("flash", "efficient", "math")
# Times in the cost model: FLOPs at a nominal rate, copies at a nominal PCIe rate. They rank plans;
# they are not a prediction of a step's time on any device.
_NOMINAL_FLOPS_PER_MS = 2e11  # 200 TFLOP/s
_NOMINAL_COPY_GB_PER_S = 25.0


def _nbytes(t):
    return t.untyped_storage().nbytes()


class _Live(LiveBytes):
    """LiveBytes for any device (meta included): after every op, the storages of its outputs join
    the live set until they are freed; `peak` is the most bytes live at once. Storages are keyed by
    their implementation, which meta storages (no data pointer) have too. Also counts the FLOPs of
    the matrix products and attention (torch's flop counter's formulas)."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self._flops = flop_registry
        self.flops = 0

    def _key(self, t):
        return t.untyped_storage()._cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            # A value read on the meta device (transformers asks whether a mask has padding, or whether
            # sequences are packed: `(...).all()`): true for a flag, zero for a number.
            return True if args[0].dtype == torch.bool else 0
        if func._overloadpacket is torch.ops.aten._grouped_mm and args[0].device.type == "meta" \
                and args[0].dtype not in (torch.bfloat16, torch.float16):
            out = _grouped_mm_shape(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        count = self._flops.get(func._overloadpacket)
        if count is not None:
            try:
                self.flops += int(count(*args, **kwargs, out_val=out))
            except (TypeError, ValueError, RuntimeError, AttributeError, AssertionError):
                # A formula that does not take this overload's arguments (torch 2.11's SDPA formula
                # asserts equal query and key heads, which grouped-query attention has not): no
                # FLOPs counted for it. FLOPs only order plans by time; the bytes are unaffected.
                pass
        self.add(tree_leaves(out))
        return out


def _grouped_mm_shape(func, args, kwargs):
    """The output of a meta `_grouped_mm` in a dtype its meta function refuses (fp32, which the CPU
    and GPU kernels run): its shape from the same operands in bf16, its dtype theirs."""
    dtype = kwargs.get("out_dtype") or args[0].dtype
    cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    shape = func(*cast, **{k: v for k, v in kwargs.items() if k != "out_dtype"}).shape
    return torch.empty(shape, dtype=dtype, device="meta")


def default_attention(dtype, head_dim, has_mask) -> str:
    """The SDPA backend torch picks on a recent NVIDIA GPU (sm80 and later), as far as memory goes:
    flash for fp16/bf16 without an explicit mask and a head dim of at most 256; memory-efficient
    otherwise (fp32, a mask, or a larger head dim) when the head dim is a multiple of 8 (flash and
    memory-efficient keep the output and the log-sum-exp, not the probabilities); math (the
    `[batch, heads, s, s]` probabilities saved) for what neither takes."""
    if dtype in (torch.float16, torch.bfloat16) and not has_mask and head_dim <= 256:
        return "flash"
    if head_dim % 8 == 0:
        return "efficient"
    return "math"


class _Attention:
    """Routes F.scaled_dot_product_attention to the backend counted while it is entered (on the meta
    device SDPA takes the math path), so that autograd saves what that backend's kernel saves. The
    function is looked up at each call by torch's modules and transformers', so it is replaced on
    torch.nn.functional for the estimate's steps (the recompute in backward included)."""

    def __init__(self, attention):
        self.attention = attention
        self.seen = set()
        # An explicit mask kept by a kernel that keeps no probabilities: its [s, s] grows with the
        # square of the length (a sliding window's, a padded batch's), so the fit takes three lengths.
        self.masked = False
        self._original = None
        self.autocast = None  # the _Autocast the step runs under, if any

    def __enter__(self):
        self._original = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._original

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if self.autocast is not None:  # SDPA is on autocast's lower-precision list
            query, key, value = (self.autocast.cast(t, self.autocast.dtype) for t in (query, key, value))
        q, k, v, mask = query, key, value, attn_mask
        backend = self.attention or default_attention(q.dtype, q.shape[-1], mask is not None)
        if backend == "flash" and mask is not None:
            backend = "efficient"  # flash takes no mask
        self.seen.add(backend)
        self.masked = self.masked or mask is not None
        if backend == "math" or q.device.type != "meta":
            return self._original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                  scale=scale, enable_gqa=enable_gqa)
        if k.shape[-3] != q.shape[-3] and backend == "efficient":
            # Grouped-query attention: the memory-efficient kernel takes as many key heads as query heads.
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        if backend == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)  # the additive bias torch makes of it
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, dropout_p, is_causal,
                                                                      scale=scale)[0]


# Attributes by which transformers' layers (or their attention modules) say which attention they run:
# sliding-window and full layers have the same weights but not the same mask.
_KIND_ATTRS = ("attention_type", "layer_type", "sliding_window", "is_sliding", "use_sliding_window")


class _Dropout:
    """Routes F.dropout on the meta device to the fused kernel a CUDA GPU runs, which keeps a 1-byte
    mask for the backward: the composite path that meta (and the CPU) take keeps a noise tensor of
    the input's dtype instead. Looked up at each call by torch's modules and transformers', as
    `_Attention` is."""

    def __enter__(self):
        self._original = torch.nn.functional.dropout
        torch.nn.functional.dropout = self
        return self

    def __exit__(self, *exc):
        torch.nn.functional.dropout = self._original

    def __call__(self, input, p=0.5, training=True, inplace=False):
        if input.device.type != "meta" or not training or inplace or not 0.0 < p < 1.0:
            return self._original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]


# torch's CUDA autocast lists (the amp docs' "CUDA Ops that can autocast to float16" / "to float32"), by
# the functions through which models reach them: (module, name, dtype: None for the lower precision).
_AUTOCAST_FUNCS = (
    *((torch.nn.functional, n, None) for n in ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                                                  "conv_transpose2d", "conv_transpose3d", "prelu", "bilinear")),
    *((torch, n, None) for n in ("matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv", "mv", "einsum")),
    *((torch.nn.functional, n, torch.float32) for n in ("layer_norm", "group_norm", "softmax", "log_softmax",
                                                           "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div",
                                                           "binary_cross_entropy_with_logits")),
)


class _Autocast:
    """torch.autocast as it runs on a GPU, for a step on the meta device (which autocast skips): while
    entered, the functions on autocast's lists (`_AUTOCAST_FUNCS`, replaced on their modules, where
    models look them up at each call; SDPA through `_Attention`) get their floating-point arguments
    cast to `dtype`, or to fp32 for those autocast runs in fp32, above autograd as autocast's dispatch
    key is, so that autograd saves the casts as under autocast. Replaced on the modules, they also run
    so in a checkpoint's recompute, which restores autocast's state. Casts of weights that take
    gradients (leaves with requires_grad) are cached until `clear()`, as autocast keeps them until its
    region ends (the forward and the loss); in the backward (a recompute) each region is one block and
    they are not cached. `x @ w` (Tensor.__matmul__) is not reached."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.cache = {}
        self._saved = []

    def clear(self):
        self.cache = {}

    def cast(self, t, dtype):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype \
                or t.dtype == torch.float64:
            return t
        if t.is_leaf and t.requires_grad and dtype == self.dtype:
            from ..midpoints import _in_backward

            if not _in_backward():
                hit = self.cache.get(id(t))
                if hit is None or hit[0] is not t:
                    hit = self.cache[id(t)] = (t, t.to(dtype))
                return hit[1]
        return t.to(dtype)

    def _wrap(self, original, dtype):
        def run(*args, **kwargs):
            if dtype is not None and kwargs.get("dtype") is not None:
                return original(*args, **kwargs)
            target = dtype or self.dtype
            args = torch.utils._pytree.tree_map(lambda t: self.cast(t, target), args)
            kwargs = torch.utils._pytree.tree_map(lambda t: self.cast(t, target), kwargs)
            return original(*args, **kwargs)
        return run

    def __enter__(self):
        for module, name, dtype in _AUTOCAST_FUNCS:
            original = module.__dict__[name]
            self._saved.append((module, name, original))
            setattr(module, name, self._wrap(original, dtype))
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []


def _signature(block, position_kind=None):
    params = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in block.parameters())
    kind = tuple((name, a, repr(getattr(m, a))) for name, m in block.named_modules()
                 for a in _KIND_ATTRS if isinstance(getattr(m, a, None), (str, int, bool, type(None)))
                 and hasattr(m, a))
    return (type(block), params, kind, position_kind)


def _position_configs(model, n):
    """The configs (the model's and its sub-models') whose `layer_types` name each of the n blocks'
    attention by position: transformers' hybrid models pick a layer's mask as
    `config.layer_types[i]` for the i-th layer they run, not from the layer."""
    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        for c in (cfg, *(getattr(cfg, k, None) for k in ("text_config", "decoder"))):
            types = getattr(c, "__dict__", {}).get("layer_types")
            if isinstance(types, (list, tuple)) and len(types) == n and all(c is not o for o in out):
                out.append(c)
    return out


def _representatives(blocks, kinds=None):
    """The blocks measured (indices, in order) and, per block, the measured one it takes its figures
    from: the first and the last as themselves, the others from the first of their kind after block 0.
    kinds: per block, what else tells blocks of one class apart (the attention its position gets)."""
    n = len(blocks)
    kinds = kinds or [None] * n
    sigs = [_signature(b, k) for b, k in zip(blocks, kinds)]
    first = {}
    for i in range(1, n):
        first.setdefault(sigs[i], i)
    chosen = sorted({0, n - 1, *first.values()})
    source = [i if i in (0, n - 1) else first[sigs[i]] for i in range(n)]
    return chosen, source


@contextlib.contextmanager
def _positions(configs, chosen):
    """The configs' `layer_types` those of the blocks measured, in their order: the cut-down
    container numbers them 0..k-1, and each must get the mask of its own position."""
    saved = [c.__dict__.get("layer_types") for c in configs]
    try:
        for c, types in zip(configs, saved):
            c.__dict__["layer_types"] = type(types)(types[i] for i in chosen)
        yield
    finally:
        for c, types in zip(configs, saved):
            c.__dict__["layer_types"] = types


def _container_of(model, blocks):
    ids = {id(b) for b in blocks}
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and ids <= {id(c) for c in m._modules.values()}:
            return m
    return None


@contextlib.contextmanager
def _only(container, keep):
    """The container holds only the modules `keep` inside (the others come back after)."""
    saved = container._modules
    container._modules = type(saved)((str(i), b) for i, b in enumerate(keep))
    try:
        yield
    finally:
        container._modules = saved


def _static_bytes(model, params):
    seen, total = set(), 0
    for t in [*params, *model.buffers()]:
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


class _InputSaves:
    """Saved-tensor hooks around the step: what a checkpoint saves of its inputs (where torch saves
    them, under the hooks outside it: what an offload sends), given to the
    block whose forward ends next. Where transformers puts its checkpoint call does not matter: inside
    the layer's forward (after the block's hooks) or around its `__call__` (before them), the inputs are
    saved after the previous block's forward ended and before this one's does."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.saving = False
        self.pending = 0
        self.host = [0] * len(blocks)
        self.shared = [0] * len(blocks)  # of host[i]: what later blocks save too (sent once, with block i)
        self.handles = []

    def pack(self, t):
        if self.saving and not torch.jit.is_scripting():
            if type(t) is torch.Tensor and not (t.is_leaf and t.requires_grad) and not self._is_weight(t):
                self.pending += self._sent_bytes(t)
        return t

    def _sent_bytes(self, t):
        """The bytes the engine sends for this saved input, as it decides: none for a range of its
        storage that a block's checkpoint sent before (the engine shares that copy with every later
        block that saves it: a diffusion model's text embeddings and timestep projection, inputs to
        every block); for a view with gaps between its elements (one of two streams sliced from one
        tensor, as HunyuanVideo's single-stream blocks return them), the whole storage when it is
        at most 4 times the view's elements, then shared with the storage's other views, else the
        view's own elements, compacted and shared with none; otherwise the range the tensor spans
        (less than its elements for an expanded one)."""
        key, start, n = t.untyped_storage()._cdata, t.storage_offset(), t.numel()
        end = start + (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if n else 0)
        ranges = self.sent.setdefault(key, [])
        for r in ranges:
            if r[0] <= start and end <= r[1] and r[2] == t.dtype:
                if r[3] is not self.fresh:
                    r[4][0] = True  # a later block saves it too: shared
                return 0
        storage = t.untyped_storage().nbytes() // t.element_size()
        if end - start > n and storage <= 4 * n:
            ranges.append((0, storage, t.dtype, self.fresh, [False, storage * t.element_size()]))
            return storage * t.element_size()
        if end - start > n:
            return n * t.element_size()
        ranges.append((start, end, t.dtype, self.fresh, [False, (end - start) * t.element_size()]))
        return (end - start) * t.element_size()

    def _is_weight(self, t):
        base = t._base if t._base is not None else t
        return isinstance(base, nn.Parameter) or base.untyped_storage()._cdata in self.weights

    def __enter__(self):
        from torch.utils import checkpoint as tuc

        from ..midpoints import _in_backward

        self.weights = set()
        self.sent = {}
        self.fresh = {}  # the block the saves now pending go with, set when its forward ends
        for b in self.blocks:
            for p in [*b.parameters(), *b.buffers()]:
                self.weights.add(p.untyped_storage()._cdata)
        # Where torch saves a checkpoint's inputs: _CheckpointFrame.save_inputs (torch 2.14), or the
        # no-op Function whose save_for_backward holds them (2.11 to 2.13), packed when its apply
        # returns (after setup_context), so the whole apply is the span.
        if hasattr(tuc._CheckpointFrame, "save_inputs"):
            self._owner, self._name = tuc._CheckpointFrame, "save_inputs"
        else:
            self._owner, self._name = tuc._NoopSaveInputs, "apply"
        self._original = self._owner.__dict__.get(self._name)
        original = getattr(self._owner, self._name)
        saves = self

        def saving(*args):
            saves.saving = True
            try:
                return original(*args)
            finally:
                saves.saving = False

        if self._name == "apply":  # a classmethod, bound above: the owner's own attribute shadows it
            setattr(self._owner, self._name, staticmethod(saving))
        else:
            setattr(self._owner, self._name, saving)

        def post(i):
            def hook(module, args, out):
                if not _in_backward():
                    self.host[i] += self.pending
                    self.pending = 0
                    self.fresh["block"] = i
                    self.fresh = {}
            return hook

        for i, b in enumerate(self.blocks):
            self.handles.append(b.register_forward_hook(post(i)))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        for ranges in self.sent.values():
            for r in ranges:
                if r[4][0] and r[3].get("block") is not None:
                    self.shared[r[3]["block"]] += r[4][1]
        if self._original is None:
            delattr(self._owner, self._name)  # the inherited one again
        else:
            setattr(self._owner, self._name, self._original)
        for h in self.handles:
            h.remove()


def _flop_marks(blocks, live):
    """Forward hooks that note the FLOPs of each block's forward (in the step without checkpointing)."""
    flops = [0] * len(blocks)
    start = {}
    handles = []
    for i, b in enumerate(blocks):
        def pre(module, args, i=i):
            start[i] = live.flops

        def post(module, args, out, i=i):
            flops[i] += live.flops - start.pop(i, live.flops)

        handles += [b.register_forward_pre_hook(pre), b.register_forward_hook(post)]
    return flops, handles


def _reached(loss):
    """The ids of the parameters a backward from `loss` gives a gradient: those of the
    AccumulateGrad nodes its graph reaches (a branch whose output the loss does not use, the last
    block's text stream in a two-stream model, gives none)."""
    out, seen, todo = set(), set(), [getattr(loss, "grad_fn", None)]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            out.add(id(variable))
        todo.extend(nxt for nxt, _ in node.next_functions)
    return out


def _checkpoint_all(model, blocks, diffusers):
    """Every block checkpointed, kept on the device, by the entry point that attaches the engine to
    this model: a diffusers model's through ckpt_offload.integrations.diffusers (the function its
    own checkpointing calls, which hands the checkpoint the tensors inside a tuple or dict argument
    one by one, so that they are saved and offloaded as the others); else enable_block_modes."""
    if diffusers:
        from ..integrations import diffusers as _diffusers

        _diffusers.enable(model, offload=False)
    else:
        enable_block_modes(model, ["checkpoint"] * len(blocks), layers=blocks)


def _measure(model, blocks, inputs, loss_fn, attention, head_loss=None, autocast=None, diffusers=False):
    """The CostModel pieces of the blocks measured (those the model runs now): planner probes for
    "none" and "checkpoint", the checkpoint inputs per block (and of them, what later blocks save
    too), the forward FLOPs per block, the logits bytes, the attention backends used, and the ids
    of the parameters the step without checkpointing gives a gradient (None where its loss has no
    graph). diffusers: the blocks are those a diffusers model's own checkpointing hands over,
    checkpointed through ckpt_offload's integration."""
    n = len(blocks)
    loss_fn = loss_fn or _planner._default_loss
    att = _Attention(attention)
    mixed = _Autocast(autocast) if autocast is not None else None
    att.autocast = mixed
    probes, host, shared, flops, logits = {}, None, None, None, [0]
    reached = [None, False]  # the parameters given a gradient; whether this probe notes them

    def loss_of(out):
        logits_t = getattr(out, "logits", None)
        if isinstance(logits_t, torch.Tensor):
            # transformers' loss upcasts the logits to fp32 first (a copy when they are not fp32).
            extra = logits_t.numel() * 4 if logits_t.dtype != torch.float32 and getattr(out, "loss", None) is not None else 0
            logits[0] = logits_t.numel() * logits_t.element_size() + extra
        elif isinstance(out, torch.Tensor):
            logits[0] = out.numel() * out.element_size()
        loss = loss_fn(out)
        if reached[1] and isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            reached[0] = _reached(loss)
        if mixed is not None:
            mixed.clear()  # autocast's region (the forward and the loss) ends: its cache goes
        return loss

    disable_checkpointing(model)
    with training_mode(model), att, _Dropout(), head_loss or contextlib.nullcontext(), \
            (mixed or contextlib.nullcontext()):
        for m in ("none", "checkpoint"):
            if m != "none":
                _checkpoint_all(model, blocks, diffusers)
            live = _Live()
            handles = []
            if m == "none":
                flops, handles = _flop_marks(blocks, live)
            saves = _InputSaves(blocks) if m == "checkpoint" else contextlib.nullcontext()
            reached[1] = m == "none"
            try:
                with saves:
                    probes[m] = _planner._measured_step(model, blocks, inputs, loss_of, torch.device("meta"), live=live)
            finally:
                for h in handles:
                    h.remove()
                disable_checkpointing(model)
            if m == "checkpoint":
                host, shared = saves.host, saves.shared
    if head_loss is not None and head_loss.recipe.loss != "transformers":
        logits[0] = head_loss.logits_bytes  # the head computed the loss: what its logits took
    return probes, host, shared, flops, logits[0], att, reached[0]


class MemoryEstimate:
    """What `estimate_memory` found: per mode the peak device bytes of a training step and the bytes
    it sends to the host, the parts around the blocks, and the cost model behind them.

    Attributes:
        peak_bytes (dict[str, int]): per mode (`"none"`, `"checkpoint"`, `"checkpoint+offload"`
            with every block's input on the host, `"every_n=2"`: blocks 0, 2, 4, ... checkpointed),
            the peak device bytes of a step: weights, gradients (kept allocated), optimizer states,
            inputs, activations, logits and loss, the backward's transient.
        host_bytes (dict[str, int]): per mode, the bytes a step sends to the host.
        parts (dict[str, int]): per rank, as the recipe holds them: `weights_bytes`, `grads_bytes`,
            `optimizer_bytes`, `logits_bytes` (the logits, and their fp32 copy where transformers'
            loss makes one; what the chunked or fused loss holds of them), `checkpoint_input_bytes`
            (what every block's checkpoint keeps: its inputs) and `in_flight_bytes` (sharded blocks
            gathered, a quantized weight dequantized).
        step_peak_bytes (int): the device bytes while the optimizer steps, after the backward: the
            weights, every gradient, the states, the buffers and the step's own temporaries (a
            foreach AdamW's copy of the second moments' square roots). Each mode's peak is at least this.
        activation_peak_bytes (dict[str, int]): per mode, the peak of the forward and the backward
            alone; `peak_bytes` is the larger of it and `step_peak_bytes`.
        recipe (recipe.Recipe): what was counted.
        modes (dict[str, list[str]]): per mode, the mode of each block (as `enable_block_modes`
            takes them).
        cost_model (planner.CostModel): per block and mode, the bytes measured on the meta device
            and times from FLOPs at a nominal rate; `plan()` searches it.
        seq (int | None): the sequence length of the inputs (dimension 1 of the first input).
        batch (int | None): their batch size (dimension 0).
        attention (list[str]): the SDPA backends counted (empty for a model without SDPA calls).
        max_seq (int | None): the most positions the model takes (its config's
            `max_position_embeddings` or `n_positions`), which caps `longest_fitting`; None when it
            names none.
    """

    def __init__(self, cost_model, extra_bytes, parts, seq=None, batch=None, attention=(), resize=None,
                 quadratic=False, max_seq=None, recipe=None, step_peak_bytes=0):
        self.cost_model = cost_model
        self.step_peak_bytes = int(step_peak_bytes)
        # Through the whole step: the optimizer's states, and the recipe's static parts less those the
        # measured step held (fp32 master weights, quantized or sharded ones; negative where smaller).
        self.extra_bytes = int(extra_bytes)
        self.recipe = recipe
        self.parts = dict(parts)
        self.seq = seq
        self.batch = batch
        self.attention = sorted(attention)
        self._resize = resize  # seq -> MemoryEstimate, for longest_fitting
        self._quadratic = quadratic  # a kernel kept an explicit [s, s] mask
        self.max_seq = max_seq
        n = cost_model.n
        self.modes = {
            "none": ["none"] * n,
            "checkpoint": ["checkpoint"] * n,
            "checkpoint+offload": ["checkpoint+offload"] * n,
            "every_n=2": block_modes(n, 2, False),
        }
        # The forward and backward's peaks, which grow with the length (the step's does not).
        self.activation_peak_bytes = {m: self._activation_peak(v) for m, v in self.modes.items()}
        self.peak_bytes = {m: self.peak_of(v) for m, v in self.modes.items()}
        self.host_bytes = {m: cost_model.host_bytes(v) for m, v in self.modes.items()}

    def peak_of(self, modes) -> int:
        """The peak device bytes of a step with one mode per block (from `"none"`, `"checkpoint"`,
        `"checkpoint+offload"`).

        Args:
            modes: one mode per repeated block, in forward order.

        Returns:
            int: the predicted peak, optimizer states included: the larger of the forward and
            backward's and the optimizer step's.
        """
        return max(self._activation_peak(modes), self.step_peak_bytes)

    def _activation_peak(self, modes) -> int:
        # The forward and backward's peak: the measured blocks' and the static parts beside them.
        return int(self.cost_model.peak(list(modes)) + self.extra_bytes)

    def configuration(self, every_n_layers=1, offload=True, keep_last=1, policy=None, offload_all=False,
                      checkpointing=True) -> ConfigurationRow:
        """The row of one exact configuration: the block modes that `enable_checkpointing`,
        `integrations.hf.enable`, `OffloadCallback`, `hf.install` and accelerate's FSDP2 offload assign for
        these keywords (`selection.block_modes`, the function they assign them with), and that
        assignment's peak and host bytes.

        Args:
            every_n_layers, offload, keep_last: as `enable_checkpointing` takes them (defaults its own).
            policy: None; `"attention"` is refused (the estimate measures blocks checkpointed whole).
            offload_all: every saved activation offloaded, as `offload_activations` and TRL's
                `activation_offloading` do: refused (the estimate measures no block in that mode).
            checkpointing: False for no block checkpointed (TrainingArguments'
                `gradient_checkpointing=False`); the other keywords then say nothing.

        Returns:
            ConfigurationRow: `label` (which configuration, in words), `modes`, `peak_bytes`, `host_bytes`.

        Raises:
            ValueError: a configuration the estimate cannot size, or keywords no entry point takes
                (keep_last past the checkpointed blocks), with the reason.
        """
        return configuration_row(self, every_n_layers=every_n_layers, offload=offload, keep_last=keep_last,
                                 policy=policy, offload_all=offload_all, checkpointing=checkpointing)

    def plan(self, device_bytes: int, host_bytes=None):
        """The fastest per-block plan predicted to fit, from the estimate (no profiling).

        Args:
            device_bytes: the peak device memory a step may reach, optimizer states included.
            host_bytes: the most bytes a step may send to the host (None: no cap).

        Returns:
            MemoryPlan: its `predicted_peak_bytes` includes the optimizer states.

        Raises:
            ValueError: nothing fits.
        """
        budget = int(device_bytes) - self.extra_bytes
        if budget <= 0:
            raise ValueError(f"MemoryEstimate.plan: the optimizer states and the recipe's other static parts "
                             f"({self.extra_bytes} bytes) take the device's {device_bytes} bytes")
        if self.step_peak_bytes > device_bytes:
            raise ValueError(f"MemoryEstimate.plan: the optimizer step ({self.step_peak_bytes} bytes: weights, "
                             f"gradients, states and its temporaries) takes more than the device's {device_bytes} bytes")
        cost = self.cost_model
        if len(cost.modes) ** cost.n <= _planner._EXHAUSTIVE_LIMIT:
            plan = _planner.plan_from_cost(cost, budget, None if host_bytes is None else int(host_bytes))
        else:
            plan = self._structured_plan(budget, host_bytes)
        plan.predicted_peak_bytes = max(plan.predicted_peak_bytes + self.extra_bytes, self.step_peak_bytes)
        plan.budget_bytes = int(device_bytes)
        if plan.smallest_peak_bytes is not None:
            plan.smallest_peak_bytes = max(plan.smallest_peak_bytes + self.extra_bytes, self.step_peak_bytes)
        return plan

    def _structured_plan(self, budget, host_budget):
        """Many blocks: every assignment with the offloaded blocks at the bottom, the checkpointed
        ones above them and the kept ones at the top (or the kept ones interleaved every other
        block), the fastest predicted to fit; O(n^2) predictions."""
        cost = self.cost_model
        n = cost.n
        best, smallest = None, None
        for off in range(n + 1):
            for ck in range(n - off + 1):
                keep = n - off - ck
                for assign in (["checkpoint+offload"] * off + ["checkpoint"] * ck + ["none"] * keep,):
                    peak, ms, hb = cost.predict(assign)
                    if host_budget is not None and hb > host_budget:
                        continue
                    if smallest is None or peak < smallest[0]:
                        smallest = (peak, assign)
                    if peak <= budget and (best is None or ms < best[1]):
                        best = (assign, ms, peak, hb)
        if best is None:
            low = "none" if smallest is None else f"{smallest[0] + self.extra_bytes} bytes"
            raise ValueError(f"MemoryEstimate.plan: nothing fits {budget + self.extra_bytes} device bytes; the smallest "
                             f"peak is {low}")
        assign, ms, peak, hb = best
        rows = [dict(mode=m, device_bytes=int(cost.kept[m][i]), host_bytes=int(cost.host[m][i]),
                     ms=cost.fwd_ms[m][i] + cost.bwd_ms[m][i]) for i, m in enumerate(assign)]
        return _planner.MemoryPlan(assign, peak, ms, hb, budget, rows, cost, smallest_peak_bytes=smallest[0])

    def table(self) -> str:
        """The estimate as a table: per mode the peak device GiB and the host GiB; then the parts.

        Returns:
            str: one row per mode, then one line per part.
        """
        gib = 2 ** 30
        lines = [f"{'mode':<20} {'device GiB':>11} {'host GiB':>10}"]
        for m in MODES:
            lines.append(f"{m:<20} {self.peak_bytes[m] / gib:>11.3f} {self.host_bytes[m] / gib:>10.3f}")
        lines += [f"{k:<24} {v / gib:>10.3f} GiB" for k, v in self.parts.items() if v or k != "in_flight_bytes"]
        return "\n".join(lines)

    def to_json(self) -> str:
        """The estimate as JSON.

        Returns:
            str: `seq`, `batch`, `attention`, `peak_bytes`, `host_bytes` (per mode), `parts` and
            `step_peak_bytes`.
        """
        return json.dumps(dict(seq=self.seq, batch=self.batch, attention=self.attention, peak_bytes=self.peak_bytes,
                               host_bytes=self.host_bytes, parts=self.parts, step_peak_bytes=self.step_peak_bytes))

    def longest_fitting(self, device_bytes, host_bytes=None, rows=None) -> dict:
        """Per mode, the longest sequence that fits for this estimate's batch.

        Three estimates (this one, at half and at a quarter of its length) fit each mode's peak and
        host bytes as `a + b*s + c*s^2` (the quadratic term from attention that keeps its
        probabilities: math SDPA, eager attention; or an explicit `[s, s]` mask that the
        memory-efficient kernel keeps: a sliding window's); two, and a line, where the attention
        counted is flash, or memory-efficient without a mask. The longest `s` within both budgets is read off the fit, and
        made consistent with this estimate at its own length (it fits there exactly when the
        longest is at least this length). No longer than `max_seq`, the positions the model takes.

        Args:
            device_bytes: the device memory a step may reach.
            host_bytes: the host memory the step's offloads may take (None: no cap).
            rows: {name: one mode per block} of further assignments to fit (a configuration's
                `ConfigurationRow.modes`), answered under their names too.

        Returns:
            dict[str, int | None]: per mode (and `"plan"`, the best per-block plan at each length),
                the longest sequence, or 0 when not even length 1 fits; None where the inputs cannot
                be resized (an estimate made without `estimate_memory`'s own inputs).
        """
        assign = {**self.modes, **(rows or {})}
        names = [*MODES, *(rows or {})]
        if self._resize is None or not self.seq:
            return {m: None for m in names}
        if self.step_peak_bytes > device_bytes:
            return {m: 0 for m in names}  # the optimizer's step alone does not fit, at any length
        s0 = self.seq
        lengths = {s0, max(1, s0 // 2), max(1, s0 // 4)}
        if self.attention and "math" not in self.attention and not self._quadratic:
            # Attention that keeps no probabilities and no mask: every term is linear in the length;
            # two suffice.
            lengths = {s0, max(1, s0 // 2)}
        lengths = sorted(lengths)
        ests = {s: (self if s == s0 else self._resize(s)) for s in lengths}

        cap = self.max_seq or 1 << 40

        def within(fit_peak, fit_host):
            return _largest(lambda x: fit_peak(x) <= device_bytes and (host_bytes is None or fit_host(x) <= host_bytes),
                            limit=cap)

        def act(e, m):
            return e._activation_peak(assign[m])

        def sent(e, m):
            return e.cost_model.host_bytes(assign[m])

        def fits(m, x):
            if x not in ests:
                ests[x] = self._resize(x)
            e = ests[x]
            return e.peak_of(assign[m]) <= device_bytes and (host_bytes is None or sent(e, m) <= host_bytes)

        out = {}
        for m in names:
            s = within(_fit([(x, act(ests[x], m)) for x in lengths]),
                       _fit([(x, sent(ests[x], m)) for x in lengths]))
            if len(lengths) == 3:
                # Quadratic terms: the peak is the largest of several phases' (the forward's, the
                # backward's, the loss's), each a quadratic of its own, so a fit far from the lengths
                # measured can miss. Estimates at the lengths the fit points to settle it.
                out[m] = _settled(s, ests, lambda x, m=m: fits(m, x), lambda pts, m=m: within(
                    _fit([(x, act(ests[x], m)) for x in pts]), _fit([(x, sent(ests[x], m)) for x in pts])),
                    cap)
                continue
            out[m] = max(s, s0) if fits(m, s0) else min(s, s0 - 1)
        if self.max_seq:
            out = {m: min(s, self.max_seq) for m, s in out.items()}
        return out


class ConfigurationRow:
    """One configuration's row of an estimate: `label` (the configuration in words, e.g.
    "every_n_layers=2, offload, keep_last=1"), `modes` (one per block), `peak_bytes` and `host_bytes`
    (the bytes a step sends to the host)."""

    def __init__(self, label, modes, peak_bytes, host_bytes):
        self.label, self.modes = label, list(modes)
        self.peak_bytes, self.host_bytes = int(peak_bytes), int(host_bytes)

    def __repr__(self):
        return (f"ConfigurationRow({self.label!r}, peak_bytes={self.peak_bytes}, host_bytes={self.host_bytes})")


def configuration_label(every_n_layers=1, offload=True, keep_last=1, policy=None, offload_all=False,
                        checkpointing=True) -> str:
    """The configuration in words, as the rows name it: "every_n_layers=2, offload, keep_last=1"."""
    if offload_all:
        return "offload_all (every saved activation offloaded)"
    if not checkpointing:
        return "no checkpointing"
    words = [f"every_n_layers={every_n_layers}", f"offload, keep_last={keep_last}" if offload else "no offload"]
    if policy is not None:
        words.append(f"policy={policy!r}")
    return ", ".join(words)


def configuration_row(estimate, *, every_n_layers=1, offload=True, keep_last=1, policy=None, offload_all=False,
                      checkpointing=True, where="MemoryEstimate.configuration") -> ConfigurationRow:
    """`MemoryEstimate.configuration`: the row of one exact configuration (see there); errors start with
    `where`. estimate None: only checks that the configuration can be sized (the modes are not built)."""
    from .._args import check_bool, check_int

    check_int(where, "every_n_layers", every_n_layers, 1)
    check_int(where, "keep_last", keep_last, 0)
    check_bool(where, "offload", offload)
    check_bool(where, "offload_all", offload_all)
    check_bool(where, "checkpointing", checkpointing)
    label = configuration_label(every_n_layers, offload, keep_last, policy, offload_all, checkpointing)
    if offload_all:
        raise ValueError(f"{where}: {label} is not sized: the estimate measures each block kept or "
                         f"checkpointed whole, not with every tensor it saves on the host")
    if policy is not None:
        raise ValueError(f"{where}: policy={policy!r} is not sized: the estimate measures blocks checkpointed "
                         f"whole, not with a selective-checkpointing policy's saved outputs")
    if estimate is None:
        return None
    n = estimate.cost_model.n
    modes = block_modes(n, every_n_layers, offload, keep_last, where=where) if checkpointing else ["none"] * n
    return ConfigurationRow(label, modes, estimate.peak_of(modes), estimate.cost_model.host_bytes(modes))


def _settled(guess, ests, fits, refit, cap, steps=12):
    """The longest length that fits, checked by estimates: lo (fits) and hi (does not) close in
    from the lengths already estimated (ests), each next length read off the quadratic through the
    three estimated nearest to it (refit), else halfway, until hi is within 1% of lo or lo reaches
    cap. Returns lo, which an estimate found to fit (0: not even length 1)."""
    lo = max((x for x in ests if fits(x)), default=0)
    hi = min((x for x in ests if not fits(x)), default=None)
    s = guess
    for _ in range(steps):
        if lo >= cap or hi is not None and hi - lo <= max(1, lo // 100):
            break
        if s <= lo or (hi is not None and s >= hi):
            s = (lo + hi) // 2 if hi is not None else 2 * max(lo, 1)
        s = min(s, cap)
        if fits(s):
            lo = s
        else:
            hi = s
        s = refit(sorted(ests, key=lambda x: abs(x - s))[:3])
    return lo


def _fit(points):
    """The quadratic (or lower) through up to three (s, y) points, as a function."""
    pts = sorted(points)
    if len(pts) == 1:
        (s, y), = pts
        return lambda x: y * x / s
    if len(pts) == 2:
        (s1, y1), (s2, y2) = pts
        b = (y2 - y1) / (s2 - s1)
        return lambda x: y1 + b * (x - s1)
    (s1, y1), (s2, y2), (s3, y3) = pts
    d1 = (y2 - y1) / (s2 - s1)
    d2 = (y3 - y2) / (s3 - s2)
    c = max(0.0, (d2 - d1) / (s3 - s1))
    b = d1 - c * (s1 + s2)
    a = y1 - b * s1 - c * s1 * s1
    return lambda x: a + b * x + c * x * x


def _largest(ok, limit=1 << 40):
    """The largest integer s >= 1 with ok(s) (ok monotone: true then false), 0 when ok(1) is false."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and ok(hi):
        lo, hi = hi, hi * 2
    if hi >= limit:
        if ok(limit):
            return limit
        hi = limit  # doubling passed the limit: ok(lo) holds, ok(limit) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _seq_of(inputs):
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return t.shape[0], t.shape[1]
    return None, None


def _resized(inputs, seq, new):
    """The inputs with every dimension after the first that equals seq set to new (meta tensors)."""
    def one(t):
        if not isinstance(t, torch.Tensor):
            return t
        shape = [new if d > 0 and s == seq else s for d, s in enumerate(t.shape)]
        return torch.empty(shape, dtype=t.dtype, device="meta")
    return torch.utils._pytree.tree_map(one, inputs)


def estimate_memory(model: nn.Module, example_inputs, *, optimizer="default", loss_fn=None, attention=None,
                    recipe=None) -> MemoryEstimate:
    """The memory of one training step of `model` on `example_inputs`, sized on the meta device.

    Build the model under `torch.device("meta")` (or transformers' `from_config` there): nothing
    is allocated. The step's forward and backward run on meta twice, without checkpointing and
    with every repeated block (`find_repeated_blocks`) checkpointed, counting the live bytes of
    every storage at each block boundary, as `plan_memory` measures a real step. The other modes
    are composed from those. The docs' "Sizing a step before it runs" page explains the model.

    Args:
        model: the model, its parameters and buffers on the meta device; the trainable parameters
            (`requires_grad`) get gradients and optimizer states.
        example_inputs: the model's positional arguments (a tuple) or keyword arguments (a dict),
            meta tensors; dimension 0 is the batch, dimension 1 the sequence.
        optimizer: a transformers `optim` name (the default, `"default"`, is the Trainer's default for
            the installed transformers and torch, `recipe.default_optim()`; `"adamw"` is
            `"adamw_torch"`: two states per trainable element in the parameter's dtype), or None;
            the recipe's, when `recipe` is given.
        loss_fn: `output -> scalar` (default: `output.loss` when there is one, else the mean of the
            squared output). A transformers model that takes `labels` and is given none is sized
            with `labels=input_ids`: its own causal-LM loss, as `python -m ckpt_offload estimate`
            counts it.
        attention: the SDPA backend counted: `"flash"`, `"efficient"` (both keep the output and
            the log-sum-exp), `"math"` (the probabilities), or None for what torch picks on a GPU
            (see `default_attention`). Models in eager attention are counted as they run.
        recipe: a `ckpt_offload.sizing.recipe.Recipe`: optimizer, precision, loss, gradients kept or freed,
            quantized base weights, sharding (default: `Recipe(optim=optimizer)`, transformers' loss,
            gradients kept, the weights in the model's dtype, one rank). Build the model in the dtype
            the step computes in (`recipe.compute_dtype`); `recipe.dtype` counts the weights. For fp32
            master weights under `recipe.autocast` without `recipe.shard`, build it in fp32: the step
            then runs as autocast runs it on a GPU (sharded, FSDP's and DeepSpeed's mixed precision
            gather the weights in the compute dtype: build it in that).

    Returns:
        MemoryEstimate: per mode the peak and host bytes, the parts, `table()`, `to_json()`,
            `longest_fitting()` and `plan()`.

    Raises:
        TypeError: `model` is not a module, or `example_inputs` neither a tuple nor a dict.
        ValueError: the model is not on the meta device, has no repeated blocks, or an argument
            is not one of those above.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"estimate_memory: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (tuple, dict)):
        raise TypeError(f"estimate_memory: example_inputs must be a tuple (positional) or a dict (keyword "
                        f"arguments), got {type(example_inputs).__name__}")
    if recipe is None:
        try:
            recipe = _recipe.Recipe(optim=optimizer)
        except ValueError as e:
            raise ValueError(f"estimate_memory: {e}") from None
    elif not isinstance(recipe, _recipe.Recipe):
        raise TypeError(f"estimate_memory: recipe must be a ckpt_offload.sizing.recipe.Recipe, got {type(recipe).__name__}")
    elif optimizer != _recipe.DEFAULT_OPTIM and _recipe.optim_name(optimizer) != recipe.optim:
        raise ValueError(f"estimate_memory: optimizer={optimizer!r} and recipe.optim={recipe.optim!r} disagree; "
                         f"give the optimizer in the recipe")
    if recipe.loss != "transformers" and loss_fn is not None:
        raise ValueError(f"estimate_memory: loss_fn and recipe.loss={recipe.loss!r} both say how the loss is "
                         f"computed; give one")
    if attention is not None and attention not in ATTENTION:
        raise ValueError(f"estimate_memory: attention must be one of {ATTENTION} or None, got {attention!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"estimate_memory: loss_fn must be callable, got {type(loss_fn).__name__}")
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in tree_leaves(example_inputs) if isinstance(t, torch.Tensor))]
    off_meta = sorted({str(t.device) for t in tensors if t.device.type != "meta"})
    if off_meta:
        raise ValueError(f"estimate_memory: the model and its inputs must be on the meta device (build the model "
                         f"under torch.device('meta')); found tensors on {off_meta}")
    diffusers_blocks = _diffusers_blocks(model, example_inputs)
    blocks = diffusers_blocks or find_repeated_blocks(model)
    if not blocks:
        raise ValueError(f"estimate_memory: no repeated blocks found in {type(model).__name__}")
    if loss_fn is None:
        example_inputs = _with_labels(model, example_inputs)
    if diffusers_blocks is None and _container_of(model, blocks) is None:
        blocks = _blocks_that_run(model, blocks, example_inputs)
    # A diffusers model calls its blocks through its own checkpointing function, positionally (by
    # keyword without it): measured on that path, passed through, as the blocks run under
    # ckpt_offload's diffusers integration.
    with _noting_checkpointed(model, []) if diffusers_blocks is not None else contextlib.nullcontext():
        est = _estimate(model, blocks, example_inputs, recipe, loss_fn, attention, diffusers_blocks is not None)
    if diffusers_blocks is not None:
        # Dimension 1 of a diffusion model's first input is its latent channels, not a length:
        # `ckpt_offload.sizing.diffusion` searches the frames and the resolution instead.
        est.seq, est._resize = None, None
    return est


def _is_diffusers_model(model):
    mod = sys.modules.get("diffusers")
    if mod is None:  # not imported: not a diffusers model
        return False
    from diffusers.models.modeling_utils import ModelMixin

    return isinstance(model, ModelMixin)


@contextlib.contextmanager
def _noting_checkpointed(model, seen):
    """diffusers' own checkpointing switched on with a `gradient_checkpointing_func` that notes the
    module it is given and calls it; each module's previous setting back after."""
    saved = [(m, m.__dict__.get("gradient_checkpointing"), m.__dict__.get("_gradient_checkpointing_func"))
             for m in model.modules() if "gradient_checkpointing" in m.__dict__]

    def note(module, *args, **kwargs):
        seen.append(module)
        return module(*args, **kwargs)

    try:
        model.enable_gradient_checkpointing(gradient_checkpointing_func=note)
        yield
    finally:
        for m, flag, func in saved:
            m.gradient_checkpointing = flag
            if func is None:
                m.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                m._gradient_checkpointing_func = func


def _diffusers_blocks(model, inputs):
    """The modules diffusers' own checkpointing wraps on these inputs, in the order the forward
    calls them (Flux's double-stream blocks, then its single-stream ones; a UNet's resnets and
    attentions); None for a model that is not a diffusers model supporting gradient checkpointing.
    One forward on the meta device, with a `gradient_checkpointing_func` that notes each module it
    is handed, finds them."""
    if not _is_diffusers_model(model) or not getattr(model, "_supports_gradient_checkpointing", False):
        return None
    seen = []
    with _noting_checkpointed(model, seen), training_mode(model), _Live():
        _call(model, inputs)
    out, ids = [], set()
    for m in seen:
        if id(m) not in ids:
            ids.add(id(m))
            out.append(m)
    return out or None


def _with_labels(model, inputs):
    """A transformers model that takes `labels`, given none: the inputs with labels=input_ids, so
    that the loss counted is the model's own (its causal-LM cross-entropy over fp32 logits), as
    `python -m ckpt_offload estimate` counts it, not the mean of the squared logits."""
    import inspect

    if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
        return inputs
    try:
        params = inspect.signature(model.forward).parameters
        bound = inspect.signature(model.forward).bind_partial(*inputs) if isinstance(inputs, tuple) else None
    except (TypeError, ValueError):
        return inputs
    if "labels" not in params:
        return inputs
    kwargs = dict(bound.arguments) if bound is not None else dict(inputs)
    ids = kwargs.get("input_ids")
    if kwargs.get("labels") is not None or not isinstance(ids, torch.Tensor) or ids.is_floating_point():
        return inputs
    return {**kwargs, "labels": ids}


def _blocks_that_run(model, blocks, inputs):
    """The blocks a forward on these inputs runs, when they lie in several containers: a
    vision-language model's vision layers do not run on text alone, and a block that does not run
    has no hidden states to measure. One forward on meta, without gradients, finds them."""
    ran = set()
    handles = [b.register_forward_pre_hook(lambda m, args: ran.add(id(m))) for b in blocks]
    try:
        with torch.no_grad(), training_mode(model), _Live():
            _call(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return [b for b in blocks if id(b) in ran] or blocks


def _estimate(model, blocks, inputs, recipe, loss_fn, attention, diffusers=False):
    n = len(blocks)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in trainable:
        if p.grad is None:
            p.grad = torch.empty_like(p)  # kept allocated, as in a steady-state step
    # fp32 master weights under autocast, unsharded: the model built in fp32, the step run as autocast runs
    # it. (Sharded, FSDP's and DeepSpeed's mixed precision gather the weights in the compute dtype, in
    # which the model is then built.)
    mixed = recipe.autocast if recipe.autocast is not None and recipe.shard is None \
        and _floating_dtype(params) == torch.float32 else None
    head_loss = _recipe.loss_on_head(model, recipe)
    measured_inputs = _recipe.inputs_for(inputs, recipe)
    if recipe.loss != "transformers":
        loss_fn = head_loss.loss_fn  # the head computes the loss itself
    grads_of = [sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad) for b in blocks]
    configs = _position_configs(model, n)
    kinds = [tuple(c.layer_types[i] for c in configs) for i in range(n)] if configs else None
    chosen, source = _representatives(blocks, kinds)
    container = _container_of(model, blocks) if len(chosen) < n else None
    if container is None:
        chosen, source = list(range(n)), list(range(n))
    subset = [blocks[i] for i in chosen]
    try:
        full_static = _static_bytes(model, [*params, *(p.grad for p in trainable)])
        try:
            with (_only(container, subset) if container is not None else contextlib.nullcontext()), \
                    _positions(configs if container is not None else [], chosen):
                sub_params = list(model.parameters())
                sub_static = _static_bytes(model, [*sub_params, *(p.grad for p in sub_params if p.grad is not None)])
                probes, host_sub, shared_sub, flops_sub, logits_bytes, att, reached = _measure(
                    model, subset, measured_inputs, loss_fn, attention, head_loss, mixed, diffusers)
        except (IndexError, KeyError):
            if container is None:
                raise
            # A model that indexes its blocks by number (not by iterating them): all of them, then.
            container, chosen, source, subset = None, list(range(n)), list(range(n)), list(blocks)
            sub_static, sub_params = full_static, params
            probes, host_sub, shared_sub, flops_sub, logits_bytes, att, reached = _measure(
                model, subset, measured_inputs, loss_fn, attention, head_loss, mixed, diffusers)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    k = len(subset)
    cost_sub = _planner._compose(probes, probes, k, [], torch.device("meta"))
    pos = {b: j for j, b in enumerate(chosen)}
    where = [pos[source[i]] for i in range(n)]

    def widen(per_block):
        return [per_block[where[i]] for i in range(n)]

    kept = {m: widen(v) for m, v in cost_sub.kept.items()}
    bwd_excess = {m: widen(v) for m, v in cost_sub.bwd_excess.items()}
    fwd_excess = {m: widen(v) for m, v in cost_sub.fwd_excess.items()}
    host_in = widen(host_sub)
    host = {"none": [0] * n, "checkpoint": [0] * n, "checkpoint+offload": host_in}
    # A checkpointed block whose input waits on the host keeps nothing else; its forward and its
    # backward's recompute (the input reloaded) rise as the plain checkpoint's.
    # What it sends that later blocks share (the rotary tables, the text embeddings) the model's
    # forward holds, and the first backward that needs it reloads: kept but for the head's backward.
    shared = widen(shared_sub)
    kept["checkpoint+offload"] = [a - h + s for a, h, s in zip(kept["checkpoint"], host_in, shared)]
    bwd_excess["checkpoint+offload"] = list(bwd_excess["checkpoint"])
    fwd_excess["checkpoint+offload"] = list(fwd_excess["checkpoint"])
    flops = widen(flops_sub)
    fwd_ms = [f / _NOMINAL_FLOPS_PER_MS for f in flops]
    bwd = [2 * f for f in fwd_ms]
    fwd_ms_d = {m: list(fwd_ms) for m in host}
    bwd_ms_d = {"none": bwd, "checkpoint": [b + f for b, f in zip(bwd, fwd_ms)]}
    bwd_ms_d["checkpoint+offload"] = list(bwd_ms_d["checkpoint"])
    o = dict(cost_sub.outside)
    o["shared_host"] = shared
    shift = full_static - sub_static
    full_kept_none = sum(kept["none"])
    for key in ("fwd_pre_peak", "fwd_level", "bwd_level", "bwd_pre_peak"):
        o[key] += shift
    if recipe.grads == "freed" and recipe.ranks == 1:
        # Measured with the gradients kept; freed ones do not exist before the backward that makes
        # them (sharded ones are counted kept: a shard each).
        o["freed_block_grads"] = list(grads_of)
        o["freed_outside_grads"] = sum(p.numel() * p.element_size() for p in trainable) - sum(grads_of)
    for key in ("fwd_head_peak", "bwd_head_peak"):
        o[key] += shift + full_kept_none - o["kept_none"]
    # What a block leaves until the end of the forward but not into the backward (transformers' KV
    # cache of a step without checkpointing): in the forward's levels, not in what the block keeps.
    f = [probes["none"].marks[f"f{j}"][0] for j in range(k + 1)]
    residue = [f[j + 1] - f[j] - cost_sub.kept["none"][j] for j in range(k)]
    o["fwd_head_peak"] += sum(widen(residue)) - sum(residue)
    o["kept_none"] = full_kept_none
    for key in ("fwd_pre_ms", "fwd_head_ms", "bwd_head_ms", "bwd_pre_ms"):
        o[key] = 0.0
    cost = _planner.CostModel(n=n, modes=["none", "checkpoint", "checkpoint+offload"], kept=kept,
                              bwd_excess=bwd_excess, fwd_excess=fwd_excess, host=host, fwd_ms=fwd_ms_d,
                              bwd_ms=bwd_ms_d, outside=o, d2h_gb_per_s=_NOMINAL_COPY_GB_PER_S,
                              h2d_gb_per_s=_NOMINAL_COPY_GB_PER_S, synchronous_copies=False)
    # The static parts as the recipe holds them, against those the step above measured (the model's
    # weights and gradients as built): the difference is carried through the whole step.
    measured_weights = _static_bytes(model, params) - _static_bytes(model, [])
    measured_grads = sum(p.numel() * p.element_size() for p in trainable)
    # Trainable parameters no gradient reaches (in the blocks measured and around them) get none in
    # a real step, nor optimizer states: not counted.
    untrained = set() if reached is None else \
        {id(p) for p in sub_params if p.requires_grad and id(p) not in reached}
    static = _recipe.static_parts(model, recipe, blocks, untrained=untrained)
    extra = (static["weights_bytes"] - measured_weights + static["grads_bytes"] - measured_grads
             + static["optimizer_bytes"] + static["in_flight_bytes"])
    parts = dict(weights_bytes=static["weights_bytes"], grads_bytes=static["grads_bytes"],
                 optimizer_bytes=static["optimizer_bytes"], logits_bytes=int(logits_bytes),
                 checkpoint_input_bytes=int(sum(host_in)), in_flight_bytes=static["in_flight_bytes"])
    # The optimizer's step, after the backward: every gradient exists (freed ones too), nothing is in
    # flight, and the step's temporaries come on top.
    step_peak = (static["weights_bytes"] + static["grads_bytes"] + static["optimizer_bytes"]
                 + static["step_temp_bytes"] + _static_bytes(model, []))
    batch, seq = _seq_of(inputs)

    def resize(new_seq):
        return _estimate(model, blocks, _resized(inputs, seq, new_seq), recipe, loss_fn, attention, diffusers)

    return MemoryEstimate(cost, extra, parts, seq=seq, batch=batch, attention=att.seen,
                          resize=resize if seq else None, quadratic=att.masked, max_seq=_max_positions(model),
                          recipe=recipe, step_peak_bytes=step_peak)


def _floating_dtype(params):
    """The dtype of most of the floating-point parameters' elements (the model's, as built)."""
    count = {}
    for p in params:
        if p.is_floating_point():
            count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    return max(count, key=count.get) if count else None


def _max_positions(model):
    """The most positions the model takes, from its config (or its text model's), or None."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        for c in (cfg, getattr(cfg, "text_config", None)):
            for key in ("max_position_embeddings", "n_positions"):
                v = getattr(c, key, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return None
