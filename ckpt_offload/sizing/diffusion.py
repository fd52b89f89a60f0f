"""Sizing a diffusers model: its blocks as diffusers' own checkpointing wraps them, its inputs at a
video's frames and resolution, and `python -m ckpt_offload estimate --diffusers-config`.

The model is built on the meta device by diffusers' `from_config` (the class its config's
`_class_name` names), and measured by the same `estimate_memory` as a language model. The latent
shape is the pipeline's own: the pipeline class (a pipeline folder's `model_index.json`, else the
one diffusers pairs with the transformer) is constructed without weights, around the VAE built from
its config when one is given, and reports its VAE factors as diffusers computes them (its
published defaults without a VAE). The patch size is the transformer config's.
"""
from __future__ import annotations

import inspect
import json
import math
import os

import torch
from torch import nn

# The pipeline diffusers pairs with each transformer class that the command sizes, and how its
# inputs are laid out: "video" ([B, C, F, H, W] latents, patched by the transformer), "video-packed"
# (LTX-Video: the pipeline packs the latents into tokens by the transformer's patch sizes), "packed"
# (Flux, Qwen-Image: 2x2 latent patches packed into tokens by the pipeline), "image" (SD3: [B, C, H, W]
# latents, patched by the transformer).
FAMILIES = {
    "WanTransformer3DModel": ("WanPipeline", "video"),
    "HunyuanVideoTransformer3DModel": ("HunyuanVideoPipeline", "video"),
    "LTXVideoTransformer3DModel": ("LTXPipeline", "video-packed"),
    "FluxTransformer2DModel": ("FluxPipeline", "packed"),
    "QwenImageTransformer2DModel": ("QwenImagePipeline", "packed"),
    "SD3Transformer2DModel": ("StableDiffusion3Pipeline", "image"),
}
# Where a pipeline keeps its VAE's factors, as diffusers' pipelines name them (the first one it has).
SPATIAL_FACTOR = ("vae_scale_factor_spatial", "vae_spatial_compression_ratio", "vae_scale_factor")
TEMPORAL_FACTOR = ("vae_scale_factor_temporal", "vae_temporal_compression_ratio")
# Models the command does not size, and what to do instead.
REFUSED = {
    "UNet2DConditionModel": "a UNet's latents are not tokens of one sequence: pass the model (built on the meta "
                            "device) and its inputs (sample, timestep, encoder_hidden_states) to "
                            "ckpt_offload.estimate_memory(model, inputs)",
}
# LoRA targets of diffusers' LoRA training scripts (train_dreambooth_lora_flux.py and its siblings).
LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
# The longest frame count and the largest resolution are searched up to this multiple of those asked.
SEARCH_SCALE = 2


class DiffusionError(ValueError):
    """Bad input to the diffusion sizing: one line, naming the argument, file or field."""


# ---- the command's model, latents and inputs ------------------------------------------------------


def _read_json(path, what):
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise DiffusionError(f"{what} {path!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise DiffusionError(f"{what} {path!r} is not a JSON file: {e}") from None
    if not isinstance(raw, dict):
        raise DiffusionError(f"{what} {path!r}: expected a JSON object")
    return raw


def read_configs(path):
    """(transformer config, VAE config or None, pipeline class name or None) from a transformer
    config.json, its folder, or a pipeline folder (model_index.json, transformer/, vae/)."""
    what = "--diffusers-config"
    if os.path.isdir(path):
        index = os.path.join(path, "model_index.json")
        if os.path.isfile(index):
            raw = _read_json(index, what)
            tcfg = os.path.join(path, "transformer", "config.json")
            if not os.path.isfile(tcfg):
                raise DiffusionError(f"{what} {path!r}: a pipeline folder (model_index.json) without "
                                     f"transformer/config.json")
            vcfg = os.path.join(path, "vae", "config.json")
            vae = _read_json(vcfg, what) if os.path.isfile(vcfg) else None
            return _read_json(tcfg, what), vae, raw.get("_class_name")
        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            raise DiffusionError(f"{what} {path!r}: no config.json or model_index.json in this folder")
        return _read_json(cfg, what), None, None
    if not os.path.isfile(path):
        raise DiffusionError(f"{what} {path!r}: no such file or folder")
    return _read_json(path, what), None, None


def _diffusers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import diffusers
    except ImportError as e:
        raise DiffusionError(f"--diffusers-config needs diffusers installed ({e})") from None
    diffusers.utils.logging.set_verbosity_error()
    return diffusers


def model_class(cfg):
    """The diffusers class the config's `_class_name` names, and its family (FAMILIES)."""
    diffusers = _diffusers()
    name = cfg.get("_class_name")
    if not isinstance(name, str) or not name:
        raise DiffusionError("--diffusers-config: the config has no _class_name (a diffusers model's config.json "
                             "names its class there)")
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise DiffusionError(f"--diffusers-config: _class_name {name!r} is not a diffusers model class")
    if name in REFUSED:
        raise DiffusionError(f"--diffusers-config: _class_name {name!r} is not sized by the command: {REFUSED[name]}")
    if name not in FAMILIES:
        raise DiffusionError(f"--diffusers-config: _class_name {name!r}: the command sizes "
                             f"{', '.join(sorted(FAMILIES))}; for another model pass its inputs to "
                             f"ckpt_offload.estimate_memory")
    return cls, FAMILIES[name]


def build_model(cfg, dtype):
    """The model on the meta device from its config (diffusers' from_config), in `dtype` but for the
    modules the class keeps in fp32 (`_keep_in_fp32_modules`, as from_pretrained loads them)."""
    cls, _ = model_class(cfg)
    init = {k: v for k, v in cfg.items() if not k.startswith("_")}
    with torch.device("meta"):
        try:
            model = cls.from_config(init)
        except (TypeError, ValueError) as e:
            raise DiffusionError(f"--diffusers-config: {cls.__name__}.from_config refused the config: {e}") from None
    keep = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    for name, p in model.named_parameters():
        if p.is_floating_point():
            keep_fp32 = dtype != torch.float32 and any(k in name.split(".") for k in keep)
            p.data = p.data.to(torch.float32 if keep_fp32 else dtype)
    for name, b in model.named_buffers():
        if b.is_floating_point() and not any(k in name.split(".") for k in keep):
            b.data = b.data.to(dtype)
    return model


def pipeline_of(cls_name, pipeline_name, vae_cfg):
    """The pipeline object diffusers builds around the VAE (from its config, on the meta device) or
    none: what it says of the latents, its factors computed by its own __init__."""
    diffusers = _diffusers()
    name = pipeline_name or FAMILIES[cls_name][0]
    pcls = getattr(diffusers, name, None)
    if pcls is None:
        raise DiffusionError(f"--diffusers-config: model_index.json names the pipeline {name!r}, which diffusers "
                             f"does not have")
    vae = None
    if vae_cfg is not None:
        vcls = getattr(diffusers, str(vae_cfg.get("_class_name")), None)
        if not isinstance(vcls, type):
            raise DiffusionError(f"--diffusers-config: vae/config.json's _class_name {vae_cfg.get('_class_name')!r} "
                                 f"is not a diffusers class")
        with torch.device("meta"):
            vae = vcls.from_config({k: v for k, v in vae_cfg.items() if not k.startswith("_")})
    params = inspect.signature(pcls.__init__).parameters
    kw = {k: None for k, p in params.items() if k != "self" and p.default is inspect.Parameter.empty}
    kw["vae"] = vae
    pipe = pcls(**kw)
    tokens = inspect.signature(pcls.__call__).parameters.get("max_sequence_length")
    tokens = tokens.default if tokens is not None else None
    if tokens is not None and cls_name == "SD3Transformer2DModel":
        # StableDiffusion3Pipeline.encode_prompt: the CLIP encoders' tokens, then T5's
        tokens += pipe.tokenizer_max_length
    return pipe, tokens


def _factor(pipe, names):
    return next((getattr(pipe, n) for n in names if getattr(pipe, n, None)), None)


def latent_layout(model, pipe, frames, height, width, vae_given):
    """The latent grid (frames, height, width) and tokens a step at this size gives, or a
    DiffusionError naming the argument that does not divide."""
    cfg = model.config
    name = type(model).__name__
    kind = FAMILIES[name][1]
    video = kind.startswith("video")
    spatial = _factor(pipe, SPATIAL_FACTOR)
    temporal = _factor(pipe, TEMPORAL_FACTOR) if video else None
    if kind == "packed":
        ph = pw = 2  # the pipeline packs 2x2 latent patches into a token
        pt = 1
    else:
        patch = cfg.get("patch_size")
        if isinstance(patch, (list, tuple)):
            pt, ph, pw = patch
        else:
            pt, ph, pw = cfg.get("patch_size_t", 1) or 1, patch, patch
    if video:
        if frames is None:
            raise DiffusionError(f"--frames is required: {name} is a video model")
        if (frames - 1) % temporal:
            lo = (frames - 1) // temporal * temporal + 1
            raise DiffusionError(f"--frames {frames}: a video's frames must be 1 more than a multiple of the VAE's "
                                 f"temporal factor {temporal} ({lo} or {lo + temporal})")
        lf = (frames - 1) // temporal + 1
        if lf % pt:
            raise DiffusionError(f"--frames {frames}: {lf} latent frames do not divide by the temporal patch {pt}")
    else:
        if frames not in (None, 1):
            raise DiffusionError(f"--frames {frames}: {name} makes images; leave --frames out")
        lf = 1
    unit = spatial * ph
    for arg, v in (("--height", height), ("--width", width)):
        if v % unit:
            raise DiffusionError(f"{arg} {v}: not divisible by {unit} (the VAE's factor {spatial} x the patch {ph}); "
                                 f"{v // unit * unit} or {(v // unit + 1) * unit}")
    lh, lw = height // spatial, width // spatial
    cap = cfg.get("pos_embed_max_size")  # SD3's position table, in patches along each side
    for arg, v, n in (("--height", height, lh // ph), ("--width", width, lw // pw)):
        if cap and n > cap:
            raise DiffusionError(f"{arg} {v}: {n} patches along it, more than the transformer's pos_embed_max_size "
                                 f"{cap} (at most {cap * unit})")
    tokens = (lf // pt) * (lh // ph) * (lw // pw)
    return dict(latent=(lf, lh, lw), patch=(pt, ph, pw), factors=(temporal, spatial), tokens=tokens,
                vae=("the VAE's config" if vae_given else f"{type(pipe).__name__}'s defaults (no VAE config given)"))


def inputs_for(model, layout, batch, text_tokens, dtype, pipe):
    """The transformer's keyword arguments for one training step at this layout, meta tensors, as
    its pipeline passes them (return_dict=False; pipe: the pipeline object, for what its call adds)."""
    cfg = model.config
    name = type(model).__name__
    kind = FAMILIES[name][1]
    lf, lh, lw = layout["latent"]
    meta = dict(device="meta")
    t = text_tokens
    ts = torch.empty(batch, dtype=torch.float32, **meta)
    if name == "WanTransformer3DModel":
        out = dict(hidden_states=torch.empty(batch, cfg.in_channels, lf, lh, lw, dtype=dtype, **meta), timestep=ts,
                   encoder_hidden_states=torch.empty(batch, t, cfg.text_dim, dtype=dtype, **meta))
        if cfg.get("image_dim"):
            # Wan 2.1 I2V: the CLIP image embedding's 257 tokens
            out["encoder_hidden_states_image"] = torch.empty(batch, 257, cfg.image_dim, dtype=dtype, **meta)
    elif name == "HunyuanVideoTransformer3DModel":
        out = dict(hidden_states=torch.empty(batch, cfg.in_channels, lf, lh, lw, dtype=dtype, **meta), timestep=ts,
                   encoder_hidden_states=torch.empty(batch, t, cfg.text_embed_dim, dtype=dtype, **meta),
                   encoder_attention_mask=torch.empty(batch, t, dtype=torch.bool, **meta),
                   pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype, **meta))
        if cfg.get("guidance_embeds"):
            out["guidance"] = torch.empty(batch, dtype=torch.float32, **meta)
    elif name == "FluxTransformer2DModel":
        n = layout["tokens"]
        out = dict(hidden_states=torch.empty(batch, n, cfg.in_channels, dtype=dtype, **meta),
                   encoder_hidden_states=torch.empty(batch, t, cfg.joint_attention_dim, dtype=dtype, **meta),
                   pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype, **meta),
                   timestep=ts, img_ids=torch.empty(n, 3, dtype=dtype, **meta),
                   txt_ids=torch.empty(t, 3, dtype=dtype, **meta))
        if cfg.get("guidance_embeds"):
            out["guidance"] = torch.empty(batch, dtype=torch.float32, **meta)
    elif name == "QwenImageTransformer2DModel":
        # QwenImagePipeline: the packed latents, the latent grid after the 2x2 packing per sample, and
        # no text mask when every text token is active
        n = layout["tokens"]
        out = dict(hidden_states=torch.empty(batch, n, cfg.in_channels, dtype=dtype, **meta),
                   encoder_hidden_states=torch.empty(batch, t, cfg.joint_attention_dim, dtype=dtype, **meta),
                   encoder_hidden_states_mask=None, timestep=ts, img_shapes=[[(1, lh // 2, lw // 2)]] * batch)
        if cfg.get("guidance_embeds"):
            out["guidance"] = torch.empty(batch, dtype=torch.float32, **meta)
    elif name == "SD3Transformer2DModel":
        out = dict(hidden_states=torch.empty(batch, cfg.in_channels, lh, lw, dtype=dtype, **meta),
                   encoder_hidden_states=torch.empty(batch, t, cfg.joint_attention_dim, dtype=dtype, **meta),
                   pooled_projections=torch.empty(batch, cfg.pooled_projection_dim, dtype=dtype, **meta),
                   timestep=ts)
    elif name == "LTXVideoTransformer3DModel":
        # LTXPipeline: the packed latents, the text mask, the latent grid and the rotary scale it
        # derives from its VAE's factors and its call's frame rate
        temporal, spatial = layout["factors"]
        rate = inspect.signature(type(pipe).__call__).parameters["frame_rate"].default
        out = dict(hidden_states=torch.empty(batch, layout["tokens"], cfg.in_channels, dtype=dtype, **meta),
                   encoder_hidden_states=torch.empty(batch, t, cfg.caption_channels, dtype=dtype, **meta),
                   timestep=ts, encoder_attention_mask=torch.empty(batch, t, dtype=torch.bool, **meta),
                   num_frames=lf, height=lh, width=lw, rope_interpolation_scale=(temporal / rate, spatial, spatial))
    assert kind in ("video", "video-packed", "packed", "image")
    out["return_dict"] = False
    return out


def add_lora(model, rank, targets=None, dropout=0.0, adapter_dtype=None):
    """LoRA as diffusers' LoRA training scripts attach it: the base frozen, `add_adapter` with a
    peft LoraConfig on `to_q`/`to_k`/`to_v`/`to_out.0` by default, the adapters in the base
    weights' dtype (or adapter_dtype)."""
    import peft

    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                      target_modules=list(targets or LORA_TARGETS), lora_dropout=dropout or 0.0))
    if adapter_dtype is not None:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(adapter_dtype)
    if not any(p.requires_grad for p in model.parameters()):
        raise DiffusionError(f"--lora-targets {','.join(targets or LORA_TARGETS)}: no module of the model matches")
    return model


# ---- python -m ckpt_offload estimate --diffusers-config ------------------------------------------


def _recipe_of(args, _DTYPES):
    """(Recipe, the dtype the model is built in, LoRA targets or None) from the command's options
    (_DTYPES: the command's dtype names)."""
    from . import recipe as _recipe

    if args.quantize and not args.lora_rank:
        raise DiffusionError("--quantize freezes the base weights: give LoRA adapters too (--lora-rank)")
    weights = _DTYPES[args.dtype] if args.dtype else "bfloat16"
    autocast = args.autocast if weights == "float32" else None
    try:
        recipe = _recipe.Recipe(optim=args.optim or args.optimizer or "adamw_torch",
                                dtype="fp32" if autocast else None, autocast=autocast,
                                grads=args.grads or "kept", quantize=args.quantize, shard=args.shard)
    except ValueError as e:
        raise DiffusionError(str(e)) from None
    build = getattr(torch, _DTYPES[autocast] if autocast else weights)
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()] if args.lora_targets else None
    return recipe, build, targets


class _Sizer:
    """Estimates of one model and recipe at several latent sizes, each made once."""

    def __init__(self, model, recipe, attention, batch, text_tokens, dtype, pipe, vae_given):
        self.model, self.recipe, self.attention = model, recipe, attention
        self.batch, self.text_tokens, self.dtype, self.pipe, self.vae_given = batch, text_tokens, dtype, pipe, vae_given
        self.cache = {}

    def at(self, frames, height, width):
        key = (frames, height, width)
        if key not in self.cache:
            from .estimate import estimate_memory

            layout = latent_layout(self.model, self.pipe, frames, height, width, self.vae_given)
            inputs = inputs_for(self.model, layout, self.batch, self.text_tokens, self.dtype, self.pipe)
            self.cache[key] = (estimate_memory(self.model, inputs, attention=self.attention, recipe=self.recipe),
                               layout)
        return self.cache[key][0]


def _bytes(est, mode):
    """(peak, host bytes) of a uniform mode (a name) or of one mode per block (a list: a configuration's)."""
    if isinstance(mode, str):
        return est.peak_bytes[mode], est.host_bytes[mode]
    return est.peak_of(mode), est.cost_model.host_bytes(mode)


def _fits(est, mode, usable, host):
    peak, hb = _bytes(est, mode)
    return peak <= usable and (host is None or hb <= host)


def _largest(sizer, sizes, usable, host, mode):
    """The largest of `sizes` (ascending, each a (frames, height, width, tokens)) that fits `mode` (a
    uniform mode's name, or one mode per block):
    read off a line through two estimates' peaks against the tokens (attention that keeps no
    probabilities: every term linear in the tokens), then confirmed by an estimate there, and the
    next smaller until one fits. None when not even the smallest fits."""
    if not sizes:
        return None
    top = sizes[-1]
    low = sizes[max(0, len(sizes) // 2 - 1)]
    pts = [(s[3], sizer.at(*s[:3])) for s in {top, low}]
    if len(pts) == 2:
        (t1, e1), (t2, e2) = sorted(pts, key=lambda p: p[0])

        def line(a, b):
            return lambda t: a + (b - a) * (t - t1) / (t2 - t1)

        (p1, h1), (p2, h2) = _bytes(e1, mode), _bytes(e2, mode)
        peak, hb = line(p1, p2), line(h1, h2)
        start = max((i for i, s in enumerate(sizes) if peak(s[3]) <= usable and (host is None or hb(s[3]) <= host)),
                    default=0)
    else:
        start = len(sizes) - 1
    for i in range(start, -1, -1):
        if _fits(sizer.at(*sizes[i][:3]), mode, usable, host):
            return sizes[i]
    return None


def _within_positions(model, layout, lf, lh, lw):
    """Whether a latent grid is within the positions the model's position table takes (Wan's
    `rope_max_seq_len`, SD3's `pos_embed_max_size`, along each axis, after the patch)."""
    cap = model.config.get("rope_max_seq_len") or model.config.get("pos_embed_max_size")
    if not cap:
        return True
    pt, ph, pw = layout["patch"]
    return lf // pt <= cap and lh // ph <= cap and lw // pw <= cap


def run(args, progress, cli):
    """The report as a dict (the --json schema). cli: the `estimate` command's module, whose
    readings of the device, the node and the margin this shares."""
    from . import launch

    _runs, _sources = cli._runs, cli._sources
    try:
        job = launch.job(args.ranks, args.ranks_per_node, args.cp, args.accelerate_config)
    except launch.LaunchError as e:
        raise DiffusionError(str(e)) from None
    if job["cp"] > 1:
        raise DiffusionError(f"--cp {job['cp']}: context parallelism is not sized for diffusion models")

    run_config, source = cli.configuration(args)
    if run_config is not None:
        from .estimate import configuration_row

        try:  # what the row cannot size (a policy, offload_all) said before anything is built
            configuration_row(None, **run_config, where=f"your run ({source})")
        except ValueError as e:
            raise DiffusionError(str(e)) from None
    tcfg, vcfg, pipeline = read_configs(args.diffusers_config)
    recipe, dtype, targets = _recipe_of(args, cli._DTYPES)
    cls, (_, kind) = model_class(tcfg)
    progress("building the model on the meta device")
    model = build_model(tcfg, dtype)
    pipe, default_text = pipeline_of(cls.__name__, pipeline, vcfg)
    text_tokens = args.text_tokens or default_text or 512
    layout = latent_layout(model, pipe, args.frames, args.height, args.width, vcfg is not None)
    if args.lora_rank:
        adapter = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.adapter_dtype)
        add_lora(model, args.lora_rank, targets, args.lora_dropout or 0.0, adapter)
    attention = None if args.attention in ("auto", "eager") else args.attention
    sizer = _Sizer(model, recipe, attention, args.batch or 1, text_tokens, dtype, pipe, vcfg is not None)
    progress(f"estimating {layout['tokens']} latent tokens")
    est = sizer.at(args.frames, args.height, args.width)
    row = None
    if run_config is not None:
        try:  # the blocks diffusers' checkpointing wraps, in forward order (Flux: double, then single-stream)
            row = configuration_row(est, **run_config, where=f"your run ({source})")
        except ValueError as e:
            raise DiffusionError(str(e)) from None
    device, host, ranks, host_rank, margin, usable = cli.budgets(args, job)
    temporal, spatial = layout["factors"]
    pt, ph, _ = layout["patch"]
    unit = spatial * ph
    frame_sizes, res_sizes = [], []
    if device is not None:
        progress("fitting the longest frame count and the largest resolution")
        lf, lh, lw = layout["latent"]
        if kind.startswith("video"):
            # up to twice the frames asked for (the longest is at least that where the top fits)
            frame_sizes = [((f - 1) * temporal + 1, args.height, args.width, f // pt * layout["tokens"] // (lf // pt))
                           for f in range(pt, SEARCH_SCALE * lf + 1, pt) if _within_positions(model, layout, f, lh, lw)]
        g = math.gcd(args.height // unit, args.width // unit)
        a, b = args.height // unit // g, args.width // unit // g
        res_sizes = [(args.frames, k * a * unit, k * b * unit, k * k * a * b * (lf // pt))
                     for k in range(1, SEARCH_SCALE * g + 1)
                     if _within_positions(model, layout, lf, k * a * unit // spatial, k * b * unit // spatial)]
    modes = {}
    from .estimate import MODES

    for m in MODES:
        fits = None if device is None else _fits(est, m, usable, host_rank)
        longest = _largest(sizer, frame_sizes, usable, host_rank, m) if frame_sizes else None
        largest = _largest(sizer, res_sizes, usable, host_rank, m) if res_sizes else None
        modes[m] = dict(device_peak_bytes=int(est.peak_bytes[m]), host_bytes_per_rank=int(est.host_bytes[m]),
                        host_bytes_per_node=int(est.host_bytes[m] * ranks), fits=fits,
                        longest_frames=None if longest is None else longest[0],
                        longest_frames_capped=bool(frame_sizes) and longest == frame_sizes[-1],
                        largest_resolution=None if largest is None else f"{largest[2]}x{largest[1]}",
                        largest_resolution_capped=bool(res_sizes) and largest == res_sizes[-1])
    your_run = None
    if row is not None:
        longest = _largest(sizer, frame_sizes, usable, host_rank, row.modes) if frame_sizes else None
        largest = _largest(sizer, res_sizes, usable, host_rank, row.modes) if res_sizes else None
        your_run = dict(configuration=row.label, source=source, device_peak_bytes=row.peak_bytes,
                        host_bytes_per_rank=row.host_bytes, host_bytes_per_node=row.host_bytes * ranks,
                        fits=None if device is None else _fits(est, row.modes, usable, host_rank),
                        longest_frames=None if longest is None else longest[0],
                        longest_frames_capped=bool(frame_sizes) and longest == frame_sizes[-1],
                        largest_resolution=None if largest is None else f"{largest[2]}x{largest[1]}",
                        largest_resolution_capped=bool(res_sizes) and largest == res_sizes[-1],
                        blocks=cli._counts(row.modes))
    modes["plan"] = None
    if device is not None:
        try:
            plan = est.plan(usable, host_rank)
            modes["plan"] = dict(device_peak_bytes=plan.predicted_peak_bytes, host_bytes_per_rank=plan.predicted_host_bytes,
                                 host_bytes_per_node=plan.predicted_host_bytes * ranks, fits=True,
                                 blocks=_runs(plan.modes))
        except ValueError:
            low = min(MODES, key=lambda m: est.peak_bytes[m])
            modes["plan"] = dict(device_peak_bytes=est.peak_bytes[low], host_bytes_per_rank=est.host_bytes[low],
                                 host_bytes_per_node=est.host_bytes[low] * ranks, fits=False,
                                 blocks=_runs(est.modes[low]))
    described = recipe.describe(dtype).replace("; loss transformers' (whole logits + fp32 copy)",
                                               "; loss the mean square of the prediction in fp32")
    if args.lora_rank:
        described += f"; LoRA r={args.lora_rank} on {','.join(targets or LORA_TARGETS)}"
    lf, lh, lw = layout["latent"]
    return {"model": cls.__name__, "batch": args.batch or 1, "frames": args.frames, "height": args.height,
            "width": args.width, "latent": [lf, lh, lw], "patch": list(layout["patch"]),
            "vae_factors": {"temporal": temporal, "spatial": spatial}, "vae_source": layout["vae"],
            "tokens": layout["tokens"], "text_tokens": text_tokens, "blocks": est.cost_model.n,
            "dtype": str(dtype).replace("torch.", ""), "attention": est.attention, "recipe": described,
            "device_memory_bytes": device, "device_margin_bytes": margin, "host_memory_bytes": host,
            "host_share_bytes": host_rank, "ranks_per_node": ranks, "sources": _sources(args), "modes": modes,
            "your_run": your_run, "parts": est.parts, "optimizer_step_peak_bytes": est.step_peak_bytes}


def format_report(r, _gib) -> str:
    """The report as the command prints it (_gib: the command's GiB format)."""

    video = r["frames"] is not None
    size = (f"{r['frames']} frames of {r['width']}x{r['height']}" if video else f"{r['width']}x{r['height']}")
    lat = "x".join(str(v) for v in r["latent"] if v) if video else f"{r['latent'][1]}x{r['latent'][2]}"
    dev = ("device unknown (no --device-memory and no GPU here: fits, longest and largest not judged)"
           if r["device_memory_bytes"] is None else
           f"device {_gib(r['device_memory_bytes'])} GiB ({r['sources']['device']}, "
           f"{_gib(r['device_margin_bytes'])} GiB of it left unplanned)")
    host = ("host unknown" if r["host_memory_bytes"] is None else
            f"host {_gib(r['host_memory_bytes'])} GiB per node, {_gib(r['host_share_bytes'])} GiB a rank may pin")
    factors = r["vae_factors"]
    lines = [f"{r['model']}: batch {r['batch']} x {size}; latent {lat} "
             f"(VAE factors{' temporal ' + str(factors['temporal']) + ',' if video else ''} spatial {factors['spatial']}, "
             f"from {r['vae_source']}), patch {'x'.join(map(str, r['patch']))}: {r['tokens']} tokens + "
             f"{r['text_tokens']} text tokens; {r['blocks']} blocks; {r['dtype']}, attention "
             f"{'/'.join(r['attention']) or 'eager'}",
             f"{dev}; {host}; {r['ranks_per_node']} rank{'s' if r['ranks_per_node'] != 1 else ''} per node",
             f"recipe: {r['recipe']}",
             f"{'mode':<20} {'device GiB':>10} {'host GiB/rank':>13} {'host GiB/node':>13} {'fits':>5} "
             f"{'longest frames':>14} {'largest WxH':>12}"]
    mine = r.get("your_run")
    for m, row in [*r["modes"].items(), *([("your run", mine)] if mine is not None else [])]:
        if row is None or m == "plan":
            continue
        fits = "?" if row["fits"] is None else "yes" if row["fits"] else "no"
        longest = "-" if not video else "?" if r["device_memory_bytes"] is None else \
            (">=" if row["longest_frames_capped"] else "") + str(row["longest_frames"] or 0)
        largest = "?" if r["device_memory_bytes"] is None else \
            (">=" if row["largest_resolution_capped"] else "") + (row["largest_resolution"] or "none")
        lines.append(f"{m:<20} {_gib(row['device_peak_bytes']):>10} {_gib(row['host_bytes_per_rank']):>13} "
                     f"{_gib(row['host_bytes_per_node']):>13} {fits:>5} {longest:>14} {largest:>12}")
    if mine is not None:
        lines.append(f"your run: {mine['configuration']} (from {mine['source']}): {mine['blocks']}")
    plan = r["modes"].get("plan")
    if plan is not None:
        lines.append(f"plan: {plan['blocks']}, {_gib(plan['device_peak_bytes'])} GiB"
                     + ("" if plan["fits"] else " (the smallest peak; nothing fits)"))
    parts = {k: v for k, v in r["parts"].items() if k != "logits_bytes" and (k != "in_flight_bytes" or v)}
    lines.append("parts: " + ", ".join(f"{k.replace('_bytes', '').replace('_', ' ')} {_gib(v)} GiB"
                                       for k, v in parts.items())
                 + f"; while the optimizer steps {_gib(r['optimizer_step_peak_bytes'])} GiB")
    return "\n".join(lines)


def main(args, cli) -> int:
    """The command for parsed options with --diffusers-config (cli: the `estimate` command's module,
    which calls this): 0, or 2 with one line on stderr."""
    import warnings

    _Progress, _fail, _MarginError = cli._Progress, cli._fail, cli._MarginError

    for opt, value in (("--config", args.config), ("--seq", args.seq), ("--training-args", args.training_args),
                       ("--peft-config", args.peft_config), ("--loss", args.loss)):
        if value is not None:
            return _fail(f"{opt} does not apply with --diffusers-config")
    for opt, value in (("--height", args.height), ("--width", args.width)):
        if value is None:
            return _fail(f"{opt} is required with --diffusers-config")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = run(args, _Progress(quiet=args.json), cli)
    except (DiffusionError, _MarginError) as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report, cli._gib))
    return 0
