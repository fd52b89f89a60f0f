"""`python -m ckpt_offload estimate --diffusers-config`: the row of the exact configuration a run
uses (--every-n-layers, --offload, --keep-last) against the same step run for real on the CPU test
path, the engine attached as a diffusers user attaches it (ckpt_offload.integrations.diffusers.enable);
the families the command sizes (LTX-Video, SD3, Qwen-Image: every mode against a real step) and the
models it refuses."""
import json

import pytest
import torch

import ckpt_offload
from test_estimate_diffusion import (FLUX, HW, MODES, WAN, check_rows, cli, flux, flux_inputs, lora, steady, wan,
                                     wan_inputs)

diffusers = pytest.importorskip("diffusers", reason="needs diffusers for the diffusion-model tests")
from ckpt_offload.integrations import diffusers as co_diffusers  # noqa: E402

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")


def enabled_step(model, inputs, **config):
    """(peak live bytes, bytes offloaded, (checkpointed, offloaded) block indices) of a steady-state
    step of `model` configured by `config` through ckpt_offload.integrations.diffusers.enable."""
    co_diffusers.enable(model, **config)
    peak, sent = steady(model, inputs)
    state = ckpt_offload.checkpointing_state(model)
    co_diffusers.disable(model)
    return peak, sent, state


def rows_of(report):
    """mode -> (peak, host bytes) of the command's --json report."""
    return {m: (report["modes"][m]["device_peak_bytes"], report["modes"][m]["host_bytes_per_rank"]) for m in MODES}


def write_config(tmp_path, cls_name, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(cfg, _class_name=cls_name)))
    return str(path)


# The tiny models' real inputs, and the command's sizes that give them: Wan's latent 3x16x16 is 9
# frames of 128x128 at WanPipeline's factors (temporal 4, spatial 8); Flux's 64 tokens are 128x128 at
# FluxPipeline's 8, packed 2x2.
YOUR_RUN = {
    "wan": (wan, wan_inputs, "WanTransformer3DModel", WAN, ("--frames", "9", "--height", "128", "--width", "128")),
    "flux": (flux, flux_inputs, "FluxTransformer2DModel", FLUX, ("--height", "128", "--width", "128")),
}


# The integration passes the tensors inside a tuple argument (Wan's and Flux's rotary tables) to the
# checkpoint one by one, and offloads them (once: every block shares them): the row counts them.
@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_your_run_row_is_the_real_step_of_that_configuration(tmp_path, capsys, kind):
    build, inputs, cls_name, cfg, size = YOUR_RUN[kind]
    path = write_config(tmp_path, cls_name, cfg)
    rc, out, err = cli(capsys, "--diffusers-config", path, *size, "--batch", "2", "--text-tokens", "8",
                       "--dtype", "fp32", "--attention", "flash", "--every-n-layers", "2", "--offload",
                       "--keep-last", "1", "--json", *HW)
    assert rc == 0, err
    r = json.loads(out)
    mine = r["your_run"]
    n = r["blocks"]
    assert n == (3 if kind == "wan" else 5)
    peak, sent, (checkpointed, offloaded) = enabled_step(build(), inputs(), every_n_layers=2, offload=True,
                                                        keep_last=1)
    # the blocks diffusers' checkpointing hands over, in forward order (Flux: double-, then single-stream)
    assert checkpointed == list(range(0, n, 2)) and offloaded == checkpointed[:-1]
    assert mine["configuration"] == "every_n_layers=2, offload, keep_last=1" and mine["source"] == "the options"
    assert mine["blocks"].startswith(f"{len(checkpointed)} of {n} blocks checkpointed") and \
        mine["blocks"].endswith(f"{len(offloaded)} of them offloaded")
    assert mine["device_peak_bytes"] == pytest.approx(peak, rel=0.03), (mine, peak)
    assert mine["host_bytes_per_rank"] == sent, (mine, sent)
    # a row of its own: between the uniform modes it mixes
    assert r["modes"]["checkpoint+offload"]["host_bytes_per_rank"] > sent > 0


def test_cli_prints_your_run_row_with_its_label(tmp_path, capsys):
    from ckpt_offload.sizing.cli import _gib
    from ckpt_offload.sizing.diffusion import format_report

    path = write_config(tmp_path, "WanTransformer3DModel", WAN)
    base = ("--diffusers-config", path, "--frames", "5", "--height", "48", "--width", "64", "--text-tokens", "8",
            *HW)
    rc, out, err = cli(capsys, *base, "--every-n-layers", "2", "--no-offload")  # the text the command prints
    assert rc == 0, err
    lines = out.splitlines()
    assert ("your run: every_n_layers=2, no offload (from the options): 2 of 3 blocks checkpointed (0, 2), "
            "0 of them offloaded") in lines
    row = next(line for line in lines if line.startswith("your run "))
    assert row.split()[2:] == next(line for line in lines if line.startswith("every_n=2 ")).split()[1:]
    assert row.split()[-3:] == ["?", "?", "?"]  # no device memory: fits, longest, largest not judged
    rc, out, err = cli(capsys, *base, "--every-n-layers", "2", "--no-offload", "--device-memory", "2GiB",
                       "--margin", "0", "--json")
    assert rc == 0, err
    r = json.loads(out)
    mine = r["your_run"]
    assert mine["configuration"] == "every_n_layers=2, no offload" and mine["fits"] is True
    # blocks 0 and 2 checkpointed, nothing offloaded: the uniform every_n=2 row, searched the same
    same = dict(r["modes"]["every_n=2"])
    assert {k: mine[k] for k in same} == same and same["host_bytes_per_rank"] == 0
    lines = format_report(r, _gib).splitlines()
    row = next(line for line in lines if line.startswith("your run "))
    assert row.split()[2:] == next(line for line in lines if line.startswith("every_n=2 ")).split()[1:]
    assert ("your run: every_n_layers=2, no offload (from the options): 2 of 3 blocks checkpointed (0, 2), "
            "0 of them offloaded") in lines


@pytest.mark.parametrize("args,expected", [
    (("--policy", "attention"), "your run (the options): policy='attention' is not sized"),
    (("--offload-all",), "your run (the options): offload_all (every saved activation offloaded) is not sized"),
    (("--keep-last", "4"), "your run (the options): keep_last=4 is larger than the 3 checkpointed layers"),
])
def test_cli_refuses_what_the_row_cannot_size_in_one_line(tmp_path, capsys, args, expected):
    path = write_config(tmp_path, "WanTransformer3DModel", WAN)
    rc, out, err = cli(capsys, "--diffusers-config", path, "--frames", "9", "--height", "128", "--width", "128",
                       *args, *HW)
    assert rc == 2 and out == "" and expected in err and err.count("\n") == 1, err


# -- the families: LTX-Video -----------------------------------------------------------------------

LTX = dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
           cross_attention_dim=16, num_layers=3, caption_channels=16)


def ltx():
    torch.manual_seed(0)
    return diffusers.LTXVideoTransformer3DModel.from_config(LTX)


def ltx_inputs(batch=2, frames=3, size=8, text=8):
    # as LTXPipeline passes them: the latents packed into frames x size x size tokens, the text mask,
    # the latent grid, the rotary scale (its VAE's factors 8 and 32 over its 25 frames a second)
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(batch, frames * size * size, 8, generator=g),
                encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                timestep=torch.tensor([10.0, 500.0][:batch]), encoder_attention_mask=torch.ones(batch, text).bool(),
                num_frames=frames, height=size, width=size, rope_interpolation_scale=(8 / 25, 32, 32),
                return_dict=False)


def test_ltx_every_mode_within_3_percent_and_host_bytes_exact(tmp_path, capsys):
    # 17 frames of 256x256 at LTXPipeline's factors (temporal 8, spatial 32, no VAE config): the
    # latent 3x8x8, 192 tokens after the 1x1x1 patch
    path = write_config(tmp_path, "LTXVideoTransformer3DModel", LTX)
    rc, out, err = cli(capsys, "--diffusers-config", path, "--frames", "17", "--height", "256", "--width", "256",
                       "--batch", "2", "--text-tokens", "8", "--dtype", "fp32", "--attention", "flash", "--json", *HW)
    assert rc == 0, err
    r = json.loads(out)
    assert r["latent"] == [3, 8, 8] and r["tokens"] == 192 and r["blocks"] == 3
    assert r["vae_factors"] == {"temporal": 8, "spatial": 32}
    assert r["your_run"] is None  # no configuration asked for: no row
    check_rows(rows_of(r), ltx, ltx_inputs)


LTX_VAE = {"_class_name": "AutoencoderKLLTXVideo", "in_channels": 3, "out_channels": 3, "latent_channels": 8,
           "block_out_channels": [8, 8, 8, 8], "decoder_block_out_channels": [8, 8, 8, 8],
           "layers_per_block": [1, 1, 1, 1, 1], "decoder_layers_per_block": [1, 1, 1, 1, 1],
           "spatio_temporal_scaling": [True, True, False, False],
           "decoder_spatio_temporal_scaling": [True, True, False, False], "patch_size": 2, "patch_size_t": 1}


def test_cli_ltx_pipeline_folder_takes_the_vaes_factors(tmp_path, capsys):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "vae").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "LTXPipeline"}))
    transformer = dict(LTX, _class_name="LTXVideoTransformer3DModel")
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(transformer))
    (tmp_path / "vae" / "config.json").write_text(json.dumps(LTX_VAE))
    # diffusers' AutoencoderKLLTXVideo: spatial patch 2 x two 2x scalings, temporal 1 x the same two
    vae = diffusers.AutoencoderKLLTXVideo.from_config({k: v for k, v in LTX_VAE.items() if k != "_class_name"})
    assert (vae.temporal_compression_ratio, vae.spatial_compression_ratio) == (4, 8)
    rc, out, err = cli(capsys, "--diffusers-config", str(tmp_path), "--frames", "9", "--height", "64", "--width",
                       "128", *HW)
    assert rc == 0, err
    assert ("latent 3x8x16 (VAE factors temporal 4, spatial 8, from the VAE's config), patch 1x1x1: 384 tokens "
            "+ 128 text tokens; 3 blocks") in out  # 128: LTXPipeline's max_sequence_length
    rc, out, err = cli(capsys, "--diffusers-config", str(tmp_path), "--frames", "8", "--height", "64", "--width",
                       "128", *HW)
    assert rc == 2 and "--frames 8: a video's frames must be 1 more than a multiple of the VAE's temporal factor 4 " \
        "(5 or 9)" in err and err.count("\n") == 1, err
    rc, out, err = cli(capsys, "--diffusers-config", str(tmp_path / "transformer"), "--frames", "5", "--height", "64",
                       "--width", "128", *HW)
    assert rc == 2 and "--frames 5: a video's frames must be 1 more than a multiple of the VAE's temporal factor 8 " \
        "(1 or 9)" in err, err  # without the VAE: LTXPipeline's own factors


# -- what the command does not size ---------------------------------------------------------------

def test_cli_refuses_a_unet_naming_what_to_do_instead(tmp_path, capsys):
    path = write_config(tmp_path, "UNet2DConditionModel", {"sample_size": 8})
    rc, out, err = cli(capsys, "--diffusers-config", path, "--height", "64", "--width", "64", *HW)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "_class_name 'UNet2DConditionModel' is not sized by the command" in err
    assert "ckpt_offload.estimate_memory(model, inputs)" in err and "sample, timestep, encoder_hidden_states" in err


# -- the families: SD3 and Qwen-Image (two-stream image models) -------------------------------------

SD3 = dict(sample_size=32, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
           joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=24, out_channels=4,
           pos_embed_max_size=32)
QWEN = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def sd3():
    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel.from_config(SD3)


def qwen():
    torch.manual_seed(0)
    return diffusers.QwenImageTransformer2DModel.from_config(QWEN)


def sd3_inputs(batch=2, size=16, text=8):
    # as StableDiffusion3Pipeline passes them: [B, C, H, W] latents, the prompt embeddings and the
    # pooled projections
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(batch, 4, size, size, generator=g),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
                pooled_projections=torch.randn(batch, 24, generator=g), timestep=torch.tensor([10.0, 500.0][:batch]),
                return_dict=False)


def qwen_inputs(batch=2, size=16, text=8):
    # as QwenImagePipeline passes them: the latents packed 2x2 into tokens (4 channels x 4), the
    # latent grid after the packing per sample, no text mask (every text token active)
    g = torch.Generator().manual_seed(0)
    n = size // 2
    return dict(hidden_states=torch.randn(batch, n * n, 16, generator=g),
                encoder_hidden_states=torch.randn(batch, text, 32, generator=g), encoder_hidden_states_mask=None,
                timestep=torch.tensor([0.01, 0.5][:batch]), img_shapes=[[(1, n, n)]] * batch, return_dict=False)


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kind", ["sd3", "qwen"])
def test_two_stream_image_models_every_mode_within_3_percent_and_host_bytes_exact(tmp_path, capsys, kind, adapters):
    build, inputs, cls_name, cfg = dict(sd3=(sd3, sd3_inputs, "SD3Transformer2DModel", SD3),
                                        qwen=(qwen, qwen_inputs, "QwenImageTransformer2DModel", QWEN))[kind]
    # 128x128 at the pipelines' factor 8 (no VAE config): a 16x16 latent, 64 tokens after the 2x2 patch
    path = write_config(tmp_path, cls_name, cfg)
    rc, out, err = cli(capsys, "--diffusers-config", path, "--height", "128", "--width", "128", "--batch", "2",
                       "--text-tokens", "8", "--dtype", "fp32", "--attention", "flash", "--json", *HW,
                       *(("--lora-rank", "4") if adapters else ()))
    assert rc == 0, err
    r = json.loads(out)
    assert r["latent"] == [1, 16, 16] and r["tokens"] == 64 and r["blocks"] == 3
    check_rows(rows_of(r), (lambda: lora(build())) if adapters else build, inputs)


def test_cli_sd3_and_qwen_text_tokens_as_their_pipelines_encode_the_prompt(tmp_path, capsys):
    for cls_name, cfg, text in (("SD3Transformer2DModel", SD3, 77 + 256), ("QwenImageTransformer2DModel", QWEN, 512)):
        # SD3: the CLIP encoders' 77 tokens, then T5's max_sequence_length (256); Qwen-Image: its 512
        path = write_config(tmp_path, cls_name, cfg)
        rc, out, err = cli(capsys, "--diffusers-config", path, "--height", "64", "--width", "128", "--json", *HW)
        assert rc == 0, err
        r = json.loads(out)
        assert r["text_tokens"] == text and r["latent"] == [1, 8, 16] and r["tokens"] == 32, (cls_name, r)
        rc, out, err = cli(capsys, "--diffusers-config", path, "--height", "72", "--width", "128", *HW)
        assert rc == 2 and "--height 72: not divisible by 16" in err and err.count("\n") == 1, err
    # SD3's position table: pos_embed_max_size patches a side (32 here: 512 pixels at 8 x the patch 2)
    path = write_config(tmp_path, "SD3Transformer2DModel", SD3)
    rc, out, err = cli(capsys, "--diffusers-config", path, "--height", "512", "--width", "528", *HW)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "--width 528: 33 patches along it, more than the transformer's pos_embed_max_size 32 (at most 512)" in err


def test_cli_refuses_another_model_naming_those_it_sizes(tmp_path, capsys):
    path = write_config(tmp_path, "PixArtTransformer2DModel", {})
    rc, out, err = cli(capsys, "--diffusers-config", path, "--height", "64", "--width", "64", *HW)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "_class_name 'PixArtTransformer2DModel': the command sizes FluxTransformer2DModel, " \
        "HunyuanVideoTransformer3DModel, LTXVideoTransformer3DModel, QwenImageTransformer2DModel, " \
        "SD3Transformer2DModel, WanTransformer3DModel; for another model" in err
