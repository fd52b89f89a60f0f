"""`python -m ckpt_offload estimate --diffusers-config`: the row of the exact configuration a run
uses (--every-n-layers, --offload, --keep-last) against the same step run for real on the CPU test
path under ckpt_offload's diffusers integration; and the families the command sizes, each a tiny
config of diffusers' own class, every mode against a real step."""
import json

import pytest
import torch

import ckpt_offload
from test_estimate import steady_step
from test_estimate_diffusion import FLUX, HW, WAN, blocks_of, cli, flux, flux_inputs, loss, wan, wan_inputs

diffusers = pytest.importorskip("diffusers", reason="needs diffusers for the diffusion-model tests")
from ckpt_offload.integrations import diffusers as co_diffusers  # noqa: E402

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")


def enabled_step(model, inputs, integration, **config):
    """(peak live bytes, bytes offloaded, (checkpointed, offloaded) block indices) of a steady-state
    step of `model` configured by `config`: through ckpt_offload.integrations.diffusers.enable
    (integration), else enable_checkpointing on the blocks diffusers' checkpointing hands over
    (called through a function that only calls them)."""
    if integration:
        co_diffusers.enable(model, **config)
    else:
        model.enable_gradient_checkpointing(gradient_checkpointing_func=lambda block, *args: block(*args))
        ckpt_offload.enable_checkpointing(model, layers=blocks_of(model), **config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step():
        out = model(**inputs)
        value = loss(out)
        del out
        value.backward()

    top = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    peak, sent = steady_step(model, step, opt, params, top)
    state = ckpt_offload.checkpointing_state(model)
    co_diffusers.disable(model)
    return peak, sent, state


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
# checkpoint one by one, and offloads them; the estimate measures the blocks checkpointed as
# enable_checkpointing runs them, which keeps those tensors on the device. Measured on the tiny Wan:
# the integration sends 77,312 bytes, the row counts 52,736 (the 24,576 bytes of the cos and sin
# tables); the peaks within 3%. Open until the estimate measures a diffusers model on the
# integration's path.
TUPLE_GAP = pytest.mark.xfail(strict=True, reason="the rotary tables the integration offloads are not counted")


@pytest.mark.parametrize("integration", [False, pytest.param(True, marks=TUPLE_GAP)],
                         ids=["enable_checkpointing", "integrations.diffusers"])
@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_your_run_row_is_the_real_step_of_that_configuration(tmp_path, capsys, kind, integration):
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
    peak, sent, (checkpointed, offloaded) = enabled_step(build(), inputs(), integration, every_n_layers=2,
                                                        offload=True, keep_last=1)
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
    base = ("--diffusers-config", path, "--frames", "9", "--height", "128", "--width", "128", "--text-tokens", "8",
            *HW)
    rc, out, err = cli(capsys, *base, "--json")
    assert rc == 0, err
    assert json.loads(out)["your_run"] is None
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
    same = {k: v for k, v in r["modes"]["every_n=2"].items()}
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
