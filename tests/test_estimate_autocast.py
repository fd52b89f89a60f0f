"""fp32 master weights under bf16 autocast: the estimate of a model built in fp32, its step run as
autocast runs it (block inputs and the residual stream fp32, matmul outputs bf16, autocast's cache
of bf16 weight copies through the forward), against the same step run for real on the CPU under
torch.autocast("cpu", dtype=torch.bfloat16), each mode's peak within 3% and the host bytes exact."""
import pytest
import torch

import ckpt_offload
from ckpt_offload.sizing.estimate import estimate_memory
from ckpt_offload.sizing.recipe import Recipe
from test_estimate import steady_step
from tiny_gpt import make_batch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")

MODES = {"none": None, "checkpoint": dict(offload=False), "checkpoint+offload": dict(offload=True, keep_last=0)}


def build():
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def measured(ids, config):
    """(peak live bytes, bytes offloaded) of a steady-state step: forward and loss under CPU autocast,
    the backward outside it, AdamW's states and the gradients from a first step."""
    model = build()
    if config is not None:
        ckpt_offload.enable_checkpointing(model, **config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return steady_step(model, step, opt, list(model.parameters()), ids)


def test_fp32_master_weights_under_bf16_autocast_match_a_real_step():
    ids = make_batch(batch=2, seq=128, vocab=256)
    with torch.device("meta"):
        meta = build()
    meta_ids = ids.to("meta")
    est = estimate_memory(meta, {"input_ids": meta_ids, "labels": meta_ids}, attention="flash",
                          recipe=Recipe(dtype="fp32", autocast="bf16"))
    # The checkpointed blocks' inputs are the fp32 residual stream.
    assert est.parts["checkpoint_input_bytes"] == 4 * 2 * 128 * 64 * 4
    seen = {}
    for mode, config in MODES.items():
        peak, sent = measured(ids, config)
        seen[mode] = (est.peak_bytes[mode], peak, est.host_bytes[mode], sent)
    for mode, (est_peak, peak, est_host, sent) in seen.items():
        assert est_peak == pytest.approx(peak, rel=0.03), (mode, seen)
        assert est_host == sent, (mode, seen)


def test_the_command_builds_fp32_master_weights_in_fp32(tmp_path, capsys):
    """Finding: `--dtype fp32 --autocast bf16` built the model in bf16, so the checkpointed inputs (the
    fp32 residual stream under autocast) were counted at half their size."""
    import json

    from ckpt_offload.sizing.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
                                      hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      torch_dtype="bfloat16")))
    rc = main(["--config", str(config), "--seq", "128", "--batch", "2", "--dtype", "fp32", "--autocast", "bf16",
               "--device-memory", "4GiB", "--host-memory", "1TiB", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    r = json.loads(out.out)
    assert r["parts"]["checkpoint_input_bytes"] == 4 * 2 * 128 * 64 * 4
    assert r["recipe"].startswith("fp32 master weights, autocast bfloat16")
