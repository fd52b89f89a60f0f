"""The recipe of a training run as far as memory goes: optimizer, precision, loss, gradients, LoRA,
quantized base weights, sharding. The one place that says how many bytes each of them takes:
`estimate_memory`, `budget="auto"` and `python -m ckpt_offload estimate` all count through it."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

# Optimizers by transformers' `optim` names (and this package's older short names): how many states
# each allocates per element, and in which layout. "param": the parameter's dtype (torch's optimizers
# allocate `zeros_like(param)`); "fp32": always fp32; "8bit": bitsandbytes' blockwise 8-bit states
# (one byte an element and an fp32 absmax per 256-element block; tensors under 4096 elements keep
# fp32 states); "factored": Adafactor's row and column second moments, fp32.
_OPTIMS = {
    "adamw_torch": (2, "param"), "adamw_torch_fused": (2, "param"), "adamw_torch_npu_fused": (2, "param"),
    "adamw_apex_fused": (2, "fp32"), "adamw_anyprecision": (2, "fp32"),
    "adamw_bnb_8bit": (2, "8bit"), "adamw_8bit": (2, "8bit"), "paged_adamw_8bit": (2, "8bit"),
    "paged_adamw_32bit": (2, "fp32"), "paged_adamw": (2, "fp32"),
    "lion_8bit": (1, "8bit"), "paged_lion_8bit": (1, "8bit"), "lion_32bit": (1, "fp32"),
    "paged_lion_32bit": (1, "fp32"),
    "rmsprop_bnb": (1, "fp32"), "rmsprop_bnb_32bit": (1, "fp32"), "rmsprop_bnb_8bit": (1, "8bit"),
    "ademamix": (3, "fp32"), "paged_ademamix_32bit": (3, "fp32"), "ademamix_8bit": (3, "8bit"),
    "paged_ademamix_8bit": (3, "8bit"),
    "adafactor": (1, "factored"), "adagrad": (1, "param"), "rmsprop": (1, "param"),
    "sgd": (0, "param"), "none": (0, "param"),
}
_ALIASES = {"adamw": "adamw_torch", "adam": "adamw_torch"}
# The optimizer a Trainer builds when its TrainingArguments name none: `optim_name(DEFAULT_OPTIM)`.
DEFAULT_OPTIM = "default"
OPTIMS = tuple(sorted([*_OPTIMS, *_ALIASES, DEFAULT_OPTIM]))
BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit optimizer states
BNB_MIN_8BIT = 4096  # smaller tensors keep 32-bit states
NF4_BLOCK = 64  # bitsandbytes' 4-bit weights: one absmax per 64 elements
NF4_NESTED_BLOCK = 256  # double quantization: the absmaxes 8-bit, one fp32 scale per 256 of them
LOSSES = ("transformers", "fused")  # and "chunked:N"
GRADS = ("kept", "freed")
QUANTIZE = ("nf4", "int8", "fp8")
SHARDS = ("fsdp", "zero1", "zero2", "zero3")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def dtype_of(value, what="dtype"):
    """A torch dtype from a torch dtype or one of bf16/fp16/fp32 (and their long names)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"{what} must be bf16, fp16 or fp32, got {value!r}")
    return _DTYPES[key]


@functools.lru_cache(maxsize=None)
def default_optim() -> str:
    """The optimizer a transformers Trainer builds when its TrainingArguments name none: the default of
    the installed transformers' `TrainingArguments.optim` (`"adamw_torch_fused"` on torch >= 2.8),
    read off the dataclass; `"adamw_torch"` (torch's `AdamW(params)`) where transformers is absent."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return "adamw_torch"
    default = TrainingArguments.__dataclass_fields__["optim"].default
    return str(getattr(default, "value", default))


def optim_name(name) -> str:
    """transformers' `optim` name for a name this package takes (None: "none"; `"default"`: the
    Trainer's default, `default_optim()`)."""
    if name is None:
        return "none"
    key = str(getattr(name, "value", name)).lower()
    if key == DEFAULT_OPTIM:
        key = default_optim()
    key = _ALIASES.get(key, key)
    if key not in _OPTIMS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMS)} or None, got {name!r}")
    return key


def _blockwise_8bit(numel):
    return numel + 4 * math.ceil(numel / BNB_BLOCK)


def state_bytes(param: torch.Tensor, optim="adamw_torch", *, amsgrad=False, momentum=0.0, centered=False,
                dtype=None) -> int:
    """The bytes of the optimizer's states for one parameter, as the optimizer allocates them.

    Args:
        param: the parameter (any device, meta included); only its shape and dtype are read.
        optim: a transformers `optim` name (`recipe.OPTIMS`).
        amsgrad: AdamW's third state (the running maximum of the second moment).
        momentum: SGD's and RMSprop's momentum; above 0 one more state.
        centered: RMSprop's running mean of the gradients, one more state.
        dtype: the parameter's dtype as the run holds it (default: `param.dtype`).
    """
    name = optim_name(optim)
    count, layout = _OPTIMS[name]
    dtype = dtype or param.dtype
    numel = param.numel()
    if name.startswith("adamw") or name == "paged_adamw_8bit" or name == "paged_adamw_32bit":
        count += 1 if amsgrad else 0
    if name in ("sgd", "rmsprop") and momentum:
        count += 1
    if name == "rmsprop" and centered:
        count += 1
    if count == 0:
        return 0
    if layout == "param":
        return count * numel * torch.empty((), dtype=dtype, device="meta").element_size()
    if layout == "fp32":
        return count * numel * 4
    if layout == "8bit":
        return count * (_blockwise_8bit(numel) if numel >= BNB_MIN_8BIT else 4 * numel)
    # Adafactor (transformers'): a matrix keeps a row and a column of second moments, a vector all of them.
    shape = tuple(param.shape)
    if len(shape) >= 2:
        rows = math.prod(shape[:-1])
        cols = math.prod(shape[:-2]) * shape[-1]
        return 4 * (rows + cols)
    return 4 * numel


# The optimizer step's temporaries, as torch's foreach implementation (its default for CUDA tensors)
# allocates them for a parameter group at once: copies of the states in their dtype. AdamW and RMSprop
# take the square root of the second moment into a new list; Adagrad that and the scaled gradients.
# Fused kernels (`adamw_torch_fused`, apex, bitsandbytes) update in place; SGD without Nesterov too.
_STEP_COPIES = {"adamw_torch": 1, "rmsprop": 1, "adagrad": 2}


def step_temp_bytes(param: torch.Tensor, optim="adamw_torch", *, dtype=None) -> int:
    """The bytes the optimizer's step allocates for one parameter while it runs (freed when it
    returns), as torch's foreach AdamW, RMSprop and Adagrad do on a GPU; 0 for the fused and 8-bit
    optimizers. The for-loop optimizers (Adafactor, AnyPrecision) hold one tensor's temporaries at a
    time, not counted.

    Args:
        param: the parameter; only its size and dtype are read.
        optim: a transformers `optim` name (`recipe.OPTIMS`).
        dtype: the parameter's dtype as the run holds it (default: `param.dtype`).
    """
    copies = _STEP_COPIES.get(optim_name(optim), 0)
    return copies * param.numel() * torch.empty((), dtype=dtype or param.dtype, device="meta").element_size()


def _unwrap(optimizer):
    """The optimizer itself, out of accelerate's AcceleratedOptimizer (what a Trainer hands its
    callbacks) or any wrapper that keeps it as `.optimizer`."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def optim_of_class(cls, kwargs=None):
    """The recipe's optimizer fields (`optim`, `amsgrad`, `momentum`, `centered`) for an optimizer
    class and the keyword arguments it is built with (as `Trainer.get_optimizer_cls_and_kwargs`
    returns them, or a live optimizer's defaults), or None for a class whose states this module does
    not know. torch's AdamW/Adam (fused: no step temporaries), SGD, Adagrad, RMSprop, transformers'
    Adafactor and bitsandbytes' AdamW, Lion, RMSprop and AdEMAMix (8-bit or 32-bit by `optim_bits`)."""
    kw = dict(kwargs or {})
    name, module = cls.__name__.lower(), cls.__module__
    if module.startswith("bitsandbytes"):
        bits = kw.get("optim_bits", 8 if "8bit" in name else 32)
        eight = bits == 8
        if "ademamix" in name:
            return dict(optim="ademamix_8bit" if eight else "ademamix")
        if "lion" in name:
            return dict(optim="lion_8bit" if eight else "lion_32bit")
        if "rmsprop" in name:
            return dict(optim="rmsprop_bnb_8bit" if eight else "rmsprop_bnb_32bit")
        if "adam" in name:
            return dict(optim="adamw_bnb_8bit" if eight else "paged_adamw_32bit")
        return None
    if not isinstance(cls, type):
        return None
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        return dict(optim="adamw_torch_fused" if kw.get("fused") else "adamw_torch",
                    amsgrad=bool(kw.get("amsgrad", False)))
    if issubclass(cls, torch.optim.SGD):
        return dict(optim="sgd", momentum=float(kw.get("momentum", 0) or 0))
    if issubclass(cls, torch.optim.Adagrad):
        return dict(optim="adagrad")
    if issubclass(cls, torch.optim.RMSprop):
        return dict(optim="rmsprop", momentum=float(kw.get("momentum", 0) or 0), centered=bool(kw.get("centered")))
    if name == "adafactor" and module.startswith("transformers"):
        return dict(optim="adafactor")
    return None


def _optim_of(optimizer):
    """(transformers' optim name, whether it is a guess) for a live optimizer object."""
    known = optim_of_class(type(optimizer), getattr(optimizer, "defaults", None))
    if known is None:
        return "adamw_torch", True  # two states in the parameter's dtype: an upper bound for most
    # A fused AdamW is told by its groups (pending_step_temp_bytes): its states are AdamW's.
    return ("adamw_torch" if known["optim"] == "adamw_torch_fused" else known["optim"]), False


def local_part(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `param`: a DTensor's local shard (FSDP2, tensor parallelism), whose
    states and gradients torch allocates sharded alike; any other tensor itself."""
    return param.to_local() if hasattr(param, "to_local") and hasattr(param, "placements") else param


def pending_state_bytes(optimizer) -> int:
    """The bytes a live optimizer's states will take that it has not allocated yet: its parameters
    (with `requires_grad`) whose state is still empty, each counted by `state_bytes` with its group's
    amsgrad and momentum. Wrappers (accelerate's AcceleratedOptimizer) are looked through."""
    optimizer = _unwrap(optimizer)
    name, _ = _optim_of(optimizer)
    total = 0
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.requires_grad and not optimizer.state.get(p):
                total += state_bytes(local_part(p), name, amsgrad=bool(g.get("amsgrad", False)),
                                     momentum=g.get("momentum", 0) or 0, centered=bool(g.get("centered", False)))
    return total


def pending_step_temp_bytes(optimizer) -> int:
    """The bytes a live optimizer's next step allocates while it runs (`step_temp_bytes` for each of
    its parameters with `requires_grad`): none for a group made with `fused=True`, nor with
    `foreach=False` (a for-loop step holds one tensor's temporaries at a time, not counted).
    Wrappers (accelerate's AcceleratedOptimizer) are looked through."""
    optimizer = _unwrap(optimizer)
    name, _ = _optim_of(optimizer)
    total = 0
    for g in optimizer.param_groups:
        if g.get("fused") or g.get("foreach") is False:
            continue
        total += sum(step_temp_bytes(local_part(p), name) for p in g["params"] if p.requires_grad)
    return total


def quantized_bytes(weight: torch.Tensor, quantize: str, double_quant: bool = True) -> int:
    """The bytes of a linear layer's weight as bitsandbytes stores it.

    nf4: two elements a byte, an fp32 absmax per 64-element block (double quantization: the absmaxes
    as 8-bit codes, an fp32 scale per 256 of them and one fp32 offset, plus the 256-entry code table),
    and nf4's 16-entry table. int8 (LLM.int8): one byte an element and an fp32 scale per output row.
    fp8 (weight-only, as video trainers hold the frozen base): one byte an element, scales not counted.
    """
    numel = weight.numel()
    if quantize == "nf4":
        blocks = math.ceil(numel / NF4_BLOCK)
        absmax = blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 4 + 256 * 4 if double_quant else 4 * blocks
        return math.ceil(numel / 2) + absmax + 16 * 4
    if quantize == "int8":
        return numel + 4 * weight.shape[0]
    if quantize == "fp8":
        return numel  # weight-only fp8 (float8_e4m3fn): one byte an element
    raise ValueError(f"quantize must be one of {QUANTIZE} or None, got {quantize!r}")


def _parse_shard(shard):
    if shard is None:
        return None, 1
    m = re.fullmatch(r"(fsdp|zero1|zero2|zero3):([0-9]+)", str(shard))
    if m is None or int(m.group(2)) < 1:
        raise ValueError(f"shard must be fsdp:N, zero1:N, zero2:N or zero3:N with N ranks (N >= 1), got {shard!r}")
    return m.group(1), int(m.group(2))


def _parse_loss(loss):
    if loss in LOSSES:
        return loss, None
    m = re.fullmatch(r"chunked:([0-9]+)", str(loss))
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"loss must be 'transformers', 'chunked:N' (N >= 1 chunks) or 'fused', got {loss!r}")
    return "chunked", int(m.group(1))


@dataclass(frozen=True)
class Recipe:
    """How a step is trained, as far as its memory goes.

    Attributes:
        optim: transformers' `optim` name (`"adamw_torch"`, `"adamw_torch_fused"`, `"adamw_bnb_8bit"`,
            `"paged_adamw_8bit"`, `"adafactor"`, `"sgd"`, ...; `recipe.OPTIMS`) or `"none"`; the default,
            `"default"`, is the Trainer's default for the installed transformers and torch
            (`default_optim()`: `"adamw_torch_fused"` on torch >= 2.8).
        amsgrad: AdamW keeps a third state.
        momentum: SGD's and RMSprop's momentum (above 0: one state; transformers' `"sgd"` has none).
        centered: RMSprop keeps the gradients' running mean, one more state.
        dtype: the weights' dtype (None: as the model is built). With `autocast`, `torch.float32`:
            fp32 master weights, gradients and states, the step computed in `autocast`.
        autocast: the dtype the step computes in under torch.autocast, or None (pure `dtype`).
        loss: `"transformers"` (the whole logits and their fp32 copy), `"chunked:N"` (the logits
            projected and upcast N token chunks at a time, torchtune's chunked cross-entropy), or
            `"fused"` (a fused linear cross-entropy, Liger's: one chunk of logits at a time, the
            hidden states' and the head's gradients computed in the forward).
        grads: `"kept"` between steps (gradient accumulation) or `"freed"` (`zero_grad(set_to_none=True)`,
            what a Trainer does without accumulation): they then grow through the backward.
        quantize: `"nf4"` (QLoRA) or `"int8"`: the frozen linear weights (not the output head) as
            bitsandbytes stores them.
        double_quant: nf4's absmaxes quantized too (bnb_4bit_use_double_quant).
        shard: `"fsdp:N"` / `"zero3:N"` (weights, gradients and states divided among N ranks, the
            gathered blocks in flight counted), `"zero2:N"` (gradients and states divided) or
            `"zero1:N"` (states divided).
    """

    optim: str = DEFAULT_OPTIM
    amsgrad: bool = False
    momentum: float = 0.0
    centered: bool = False
    dtype: torch.dtype | None = None
    autocast: torch.dtype | None = None
    loss: str = "transformers"
    grads: str = "kept"
    quantize: str | None = None
    double_quant: bool = True
    shard: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "optim", optim_name(self.optim))
        object.__setattr__(self, "dtype", dtype_of(self.dtype, "Recipe.dtype"))
        object.__setattr__(self, "autocast", dtype_of(self.autocast, "Recipe.autocast"))
        _parse_loss(self.loss)
        _parse_shard(self.shard)
        if self.grads not in GRADS:
            raise ValueError(f"grads must be one of {GRADS}, got {self.grads!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE} or None, got {self.quantize!r}")
        if self.autocast is not None and self.dtype not in (None, torch.float32):
            raise ValueError(f"autocast computes from fp32 master weights: dtype must be fp32 with autocast, "
                             f"got {self.dtype}")
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)) or self.momentum < 0:
            raise ValueError(f"momentum must be a number >= 0, got {self.momentum!r}")

    def replace(self, **kw) -> "Recipe":
        return dataclasses.replace(self, **kw)

    @property
    def shard_kind(self):
        return _parse_shard(self.shard)[0]

    @property
    def ranks(self) -> int:
        """The ranks the static parts are divided among (1 without sharding)."""
        return _parse_shard(self.shard)[1]

    @property
    def loss_kind(self):
        return _parse_loss(self.loss)

    @property
    def compute_dtype(self):
        """The dtype the activations take: autocast's, else the weights'."""
        return self.autocast or self.dtype

    def describe(self, model_dtype=None) -> str:
        """One line: precision, optimizer, loss, gradients, quantization, sharding."""
        def name(d):
            return str(d).replace("torch.", "") if d is not None else "?"

        w = self.dtype or model_dtype
        if self.autocast is not None:
            precision = f"fp32 master weights, autocast {name(self.autocast)}"
        else:
            precision = f"pure {name(w)} (weights, gradients and states)"
        opt = self.optim + (" amsgrad" if self.amsgrad else "") + (f" momentum {self.momentum}" if self.momentum else "") \
            + (" centered" if self.centered else "")
        loss = {"transformers": "transformers' (whole logits + fp32 copy)", "fused": "fused linear cross-entropy",
                }.get(self.loss, f"chunked cross-entropy, {self.loss_kind[1]} chunks")
        parts = [precision, f"optimizer {opt}", f"loss {loss}", f"gradients {self.grads}"]
        if self.quantize:
            parts.append(f"base weights {self.quantize}" + (" (double quant)" if self.quantize == "nf4"
                                                             and self.double_quant else ""))
        kind, n = _parse_shard(self.shard)
        parts.append(f"sharded {kind} across {n} rank{'s' if n != 1 else ''}" if kind else "1 rank, not sharded")
        return "; ".join(parts)


def head_modules(model) -> set:
    """The output head's modules: the head itself and, where peft wraps it (`modules_to_save`), the
    frozen original and the trained copy inside. bitsandbytes quantizes none of them."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return set(head.modules()) if isinstance(head, nn.Module) else set()


def head_linear(head):
    """The nn.Linear that computes the output head: the head, or the trained copy peft's
    `modules_to_save` wrapper runs (its active adapter's); None for another head."""
    if isinstance(head, nn.Linear):
        return head
    copies = getattr(head, "modules_to_save", None)
    active = getattr(head, "active_adapters", None) or [getattr(head, "active_adapter", None)]
    if isinstance(copies, nn.ModuleDict) and active and active[0] in copies and isinstance(copies[active[0]], nn.Linear):
        return copies[active[0]]
    return None


def _is_quantized(model, module, param_name):
    """bitsandbytes replaces every nn.Linear but the output head; LoRA's own layers come after it."""
    if param_name != "weight" or not isinstance(module, nn.Linear):
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return module is not head and not module.weight.requires_grad


def held_dtype(param, recipe: Recipe, built=None):
    """The dtype the run holds `param` in under `recipe`: the recipe's `dtype` for the parameters
    built in the model's own dtype (`built`), their own dtype for the rest (adapters peft upcast to fp32)."""
    if recipe.dtype is not None and (built is None or param.dtype == built):
        return recipe.dtype
    return param.dtype


def optimizer_bytes(param, recipe: Recipe, built=None):
    """(state bytes, step temporary bytes) of one trainable parameter under `recipe`, in the dtype
    the run holds it (`held_dtype`): the one count behind the estimate's `static_parts` and
    `budget="auto"`."""
    dtype = held_dtype(param, recipe, built)
    return (state_bytes(param, recipe.optim, amsgrad=recipe.amsgrad, momentum=recipe.momentum,
                        centered=recipe.centered, dtype=dtype),
            step_temp_bytes(param, recipe.optim, dtype=dtype))


def _blocks_params(blocks):
    return [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]


def static_parts(model: nn.Module, recipe: Recipe, blocks=(), untrained=frozenset()) -> dict:
    """Per rank, the bytes of the run's weights, gradients and optimizer states for `model` (as
    built, meta or real: its shapes, which parameters train, and their built dtypes) under `recipe`,
    and what is in flight beside them (sharded blocks gathered, a quantized weight dequantized), and
    the optimizer step's temporaries (`step_temp_bytes`, sharded as the states are).

    The recipe's `dtype` replaces the built dtype of the parameters that have the model's own dtype
    (adapters peft upcast to fp32 keep theirs); gradients take their parameter's dtype.
    untrained: ids of trainable parameters that no gradient reaches: unsharded, they get neither a
    gradient nor optimizer states (torch's optimizers skip a parameter whose grad is None);
    sharded, the flat buffers of ZeRO and FSDP hold them all, so they count.
    """
    built = _model_dtype(model)
    kind, n = _parse_shard(recipe.shard)
    if kind is not None:
        untrained = frozenset()
    weights = grads = states = step = 0
    dequant = 0
    head = head_modules(model)
    seen = set()
    for mod in model.modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            dtype = held_dtype(p, recipe, built)
            size = torch.empty((), dtype=dtype, device="meta").element_size()
            if recipe.quantize and pname == "weight" and isinstance(mod, nn.Linear) and mod not in head \
                    and not p.requires_grad:
                weights += quantized_bytes(p, recipe.quantize, recipe.double_quant)
                dequant = max(dequant, p.numel() * (recipe.compute_dtype or built).itemsize)
                continue
            weights += p.numel() * size
            if p.requires_grad and id(p) not in untrained:
                grads += p.numel() * size
                s, t = optimizer_bytes(p, recipe, built)
                states += s
                step += t
    in_flight = dequant
    if kind in ("fsdp", "zero3"):
        # Each block's weights are gathered for its forward and again for its backward, the next
        # block's prefetched meanwhile (two at once), and its full gradients wait for their
        # reduce-scatter; the parameters outside the blocks (embeddings, head, norm) are the root's,
        # gathered through the step.
        per_block = _blocks_params(blocks)
        biggest = max(per_block, default=0)
        outside = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(per_block)
        train_block = max((sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad)
                           for b in blocks), default=0)
        in_flight += (2 * biggest + train_block + outside) if n > 1 else 0
        weights, grads, states, step = -(-weights // n), -(-grads // n), -(-states // n), -(-step // n)
    elif kind == "zero2":
        grads, states, step = -(-grads // n), -(-states // n), -(-step // n)
    elif kind == "zero1":
        states, step = -(-states // n), -(-step // n)
    return dict(weights_bytes=int(weights), grads_bytes=int(grads), optimizer_bytes=int(states),
                in_flight_bytes=int(in_flight), step_temp_bytes=int(step))


def _model_dtype(model):
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


# ---- losses on the meta device ------------------------------------------------------------------

class _FusedLinearCE(torch.autograd.Function):
    """Liger's fused linear cross-entropy, as far as memory goes: the logits one chunk of tokens at a
    time, the hidden states' gradient (and the head's, when it trains) computed in the forward and
    kept for the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, chunk):
        grad_in = torch.empty_like(hidden)
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        logits = torch.empty(chunk, weight.shape[0], dtype=hidden.dtype, device=hidden.device)
        del logits
        ctx.save_for_backward(grad_in, grad_w)
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        grad_in, grad_w = ctx.saved_tensors
        return grad_in, grad_w, None


def fused_chunk_rows(tokens, hidden, vocab):
    """Liger's chunk: the tokens split so that a chunk of logits is about the hidden states' size."""
    inc = math.ceil(vocab / hidden)
    return 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / inc)))))


class loss_on_head:
    """While entered, the model's output head computes the recipe's loss (chunked or fused) from the
    hidden states it receives and returns empty logits; `loss` holds it, `logits_bytes` what its
    logits took. For `"transformers"` it does nothing."""

    def __init__(self, model, recipe):
        self.model, self.recipe = model, recipe
        self.loss = None
        self.logits_bytes = 0
        self.head = None

    def __enter__(self):
        kind, chunks = self.recipe.loss_kind
        if kind == "transformers":
            return self
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        linear = head_linear(head)
        if linear is None:
            raise ValueError(f"loss={self.recipe.loss!r} needs a model whose get_output_embeddings() is an nn.Linear "
                             f"(or peft's modules_to_save copy of one)")
        self.head = head

        def forward(hidden):
            h = hidden.reshape(-1, hidden.shape[-1])
            labels = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
            vocab = linear.weight.shape[0]
            if kind == "fused":
                rows = min(h.shape[0], fused_chunk_rows(h.shape[0], h.shape[1], vocab))
                self.logits_bytes = rows * vocab * h.element_size()
                self.loss = _FusedLinearCE.apply(h, linear.weight, rows)
            else:
                total, self.logits_bytes = None, 0
                for part, lab in zip(h.chunk(chunks), labels.chunk(chunks)):
                    logits = nn.functional.linear(part, linear.weight, linear.bias).float()
                    self.logits_bytes += logits.numel() * 4
                    one = nn.functional.cross_entropy(logits, lab, reduction="sum")
                    total = one if total is None else total + one
                self.loss = total / h.shape[0]
            return hidden.new_empty((*hidden.shape[:-1], 0))

        head.forward = forward
        return self

    def __exit__(self, *exc):
        if self.head is not None:
            del self.head.forward
        self.head = None

    def loss_fn(self, out):
        return self.loss


def inputs_for(inputs, recipe):
    """The step's inputs for the recipe's loss: without `labels` where the head computes the loss."""
    if recipe.loss_kind[0] != "transformers" and isinstance(inputs, dict) and "labels" in inputs:
        return {k: v for k, v in inputs.items() if k != "labels"}
    return inputs
