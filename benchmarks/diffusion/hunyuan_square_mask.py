"""HunyuanVideo 13B at 1280x720, 41 frames: the estimate with a square attention mask.

diffusers' `HunyuanVideoTransformer3DModel` masks the text padding over the keys only, a
`[1, 1, 1, N]` bool mask. musubi-tuner's own HunyuanVideo model (with `--sdpa`, without
`--split_attn`) makes a `[1, 1, N, N]` bool mask before the first block and hands it to every
block, and `scaled_dot_product_attention` turns it into a bf16 bias of the same shape in each
block's attention. This script sizes the recipe of docs/estimate.md's "Video fine-tuning beside
published figures" rows (the options below are that row's, as tests/test_estimate_diffusion.py's
HUNYUAN states them) twice, with the command's own functions: once as `python -m ckpt_offload
estimate --diffusers-config` does, once with every block handed one shared `[1, 1, N, N]` bool
mask in place of diffusers' key-only one (made in the model's forward, before the block is called,
so it is an input of each block as musubi-tuner's is). It prints the `checkpoint` and
`checkpoint+offload` peaks of both, in GB (10^9 bytes).

    python benchmarks/diffusion/hunyuan_square_mask.py

It takes minutes on a CPU (each estimate runs the 13B model's forward and backward on the meta device).
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ckpt_offload.sizing import cli, diffusion  # noqa: E402
from ckpt_offload.sizing.estimate import estimate_memory  # noqa: E402

OPTIONS = ["--diffusers-config", os.path.join(ROOT, "benchmarks", "diffusion", "hunyuanvideo"), "--frames", "41",
           "--height", "720", "--width", "1280", "--lora-rank", "32", "--lora-targets",
           "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,proj_mlp,ff.net.0.proj,ff.net.2,"
           "ff_context.net.0.proj,ff_context.net.2", "--adapter-dtype", "fp32", "--optim", "adamw_bnb_8bit",
           "--quantize", "fp8"]
MODES = ("checkpoint", "checkpoint+offload")
START = time.monotonic()


def say(text):
    print(f"[{time.monotonic() - START:6.0f} s] {text}", flush=True)


def model_and_inputs(args):
    """The model (meta device, LoRA attached), its recipe and one step's inputs, as the command builds them."""
    tcfg, vcfg, pipeline = diffusion.read_configs(args.diffusers_config)
    recipe, dtype, targets = diffusion._recipe_of(args, cli._DTYPES)
    cls, _ = diffusion.model_class(tcfg)
    model = diffusion.build_model(tcfg, dtype)
    pipe, text_tokens = diffusion.pipeline_of(cls.__name__, pipeline, vcfg)
    layout = diffusion.latent_layout(model, pipe, args.frames, args.height, args.width, vcfg is not None)
    adapter = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.adapter_dtype]
    diffusion.add_lora(model, args.lora_rank, targets, args.lora_dropout or 0.0, adapter)
    inputs = diffusion.inputs_for(model, layout, args.batch or 1, args.text_tokens or text_tokens, dtype, pipe)
    return model, recipe, inputs, layout["tokens"] + (args.text_tokens or text_tokens)


def square_masks(model):
    """Every block the model's checkpointing function is handed gets, in place of the key-only
    `[B, 1, 1, N]` mask (its fourth argument), one `[B, 1, N, N]` bool mask made from it once per
    forward and shared by all blocks: it wraps whatever function `enable_gradient_checkpointing` is
    given (the estimate gives its own)."""
    enable = model.enable_gradient_checkpointing

    def squared(func):
        def call(block, hidden, context, temb, mask, *rest):
            if mask is not None and mask.shape[-2] == 1:
                if getattr(mask, "square_mask", None) is None:  # kept as long as the key-only mask lives
                    mask.square_mask = mask.expand(-1, -1, mask.shape[-1], -1).contiguous()
                mask = mask.square_mask
            return func(block, hidden, context, temb, mask, *rest)
        return call

    def enable_squared(gradient_checkpointing_func=None):
        return enable(gradient_checkpointing_func=squared(gradient_checkpointing_func))

    model.enable_gradient_checkpointing = enable_squared


def peaks(model, recipe, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_memory(model, inputs, recipe=recipe)
    return {m: est.peak_bytes[m] / 1e9 for m in MODES}


def main():
    args = cli._parser().parse_args(OPTIONS)
    say("building HunyuanVideo 13B on the meta device")
    model, recipe, inputs, n = model_and_inputs(args)
    say(f"estimating with diffusers' key-only mask [1, 1, 1, {n}]")
    plain = peaks(model, recipe, inputs)
    say(f"estimating with one square mask [1, 1, {n}, {n}] ({n * n / 1e9:.2f} GB) handed to every block")
    square_masks(model)
    square = peaks(model, recipe, inputs)
    print(f"{'mode':<20} {'key-only mask GB':>16} {'square mask GB':>14}")
    for m in MODES:
        print(f"{m:<20} {plain[m]:>16.2f} {square[m]:>14.2f}")


if __name__ == "__main__":
    main()
