"""The estimate's row for one exact configuration: the block modes come from the function the entry
points assign them with (selection.block_modes), and the row's peak and host bytes match a real CPU
step run with that configuration (LiveBytes, the engine's bytes offloaded); --training-args'
every_n_layers and offload size that configuration, not another row; what cannot be sized is refused."""
import json

import pytest
import torch

import ckpt_offload
from ckpt_offload.selection import block_modes
from ckpt_offload.sizing.estimate import estimate_memory
from test_estimate import steady_step
from tiny_gpt import make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")

CONFIGS = [dict(every_n_layers=2, offload=True, keep_last=1), dict(every_n_layers=3, offload=True, keep_last=0),
           dict(every_n_layers=4, offload=False), dict(every_n_layers=1, offload=True, keep_last=2)]


def loss_for(ids):
    return lambda logits: torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                            ids[:, 1:].reshape(-1))


def measured(model, ids, **config):
    """(peak live bytes, bytes offloaded, modes assigned) of a steady-state step of `model` configured
    by enable_checkpointing(**config): gradients and AdamW's states from a first step."""
    ckpt_offload.enable_checkpointing(model, **config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = loss_for(ids)

    def step():
        loss_fn(model(ids)).backward()

    peak, sent = steady_step(model, step, opt, list(model.parameters()), ids)
    checkpointed, offloaded = ckpt_offload.checkpointing_state(model)
    ckpt_offload.disable_checkpointing(model)
    n = len(ckpt_offload.find_repeated_blocks(model))
    modes = ["checkpoint+offload" if i in offloaded else "checkpoint" if i in checkpointed else "none" for i in range(n)]
    return peak, sent, modes


def test_each_configuration_row_matches_the_real_step_it_configures():
    ids = make_batch(batch=2, seq=128)
    with torch.device("meta"):
        meta = make_model(layers=6, hidden=64, heads=4, max_len=128, device="meta")
    est = estimate_memory(meta, (ids.to("meta"),), loss_fn=loss_for(ids.to("meta")), attention="flash")
    seen = []
    for config in CONFIGS:
        row = est.configuration(**config)
        peak, sent, modes = measured(make_model(layers=6, hidden=64, heads=4, max_len=128), ids, **config)
        assert row.modes == modes, (config, row.modes, modes)  # what the entry point assigned
        assert row.peak_bytes == pytest.approx(peak, rel=0.03), (config, row, peak)
        assert row.host_bytes == sent, (config, row, sent)
        seen.append(row.peak_bytes)
    assert row.label == "every_n_layers=1, offload, keep_last=2"
    assert len(set(seen)) == len(seen)  # the configurations differ
    # every_n_layers=2 with offload is neither "every_n=2" (nothing offloaded) nor "checkpoint+offload".
    two = est.configuration(every_n_layers=2, offload=True, keep_last=1)
    assert two.modes == ["checkpoint+offload", "none", "checkpoint+offload", "none", "checkpoint", "none"]
    assert two.peak_bytes not in (est.peak_bytes["every_n=2"], est.peak_bytes["checkpoint+offload"])


def test_hf_enable_assigns_the_modes_the_row_sizes():
    transformers = pytest.importorskip("transformers")
    from ckpt_offload.integrations import hf

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    for config in CONFIGS:
        hf.enable(model, **config)
        checkpointed, offloaded = ckpt_offload.checkpointing_state(model)
        hf.disable(model)
        ran = ["checkpoint+offload" if i in offloaded else "checkpoint" if i in checkpointed else "none"
               for i in range(7)]
        assert ran == block_modes(7, **config), config


def test_refusals_name_the_reason():
    with torch.device("meta"):
        meta = make_model(layers=4, hidden=32, heads=4, max_len=64, device="meta")
    ids = torch.empty(2, 64, dtype=torch.long, device="meta")
    est = estimate_memory(meta, (ids,), loss_fn=loss_for(ids))
    with pytest.raises(ValueError, match="keep_last=5 is larger than the 2 checkpointed layers"):
        est.configuration(every_n_layers=2, keep_last=5)
    with pytest.raises(ValueError, match="offload_all .* is not sized"):
        est.configuration(offload_all=True)
    with pytest.raises(ValueError, match="policy='attention' is not sized"):
        est.configuration(policy="attention")
    assert est.configuration(checkpointing=False).peak_bytes == est.peak_bytes["none"]


# -- the command: --training-args and the options --------------------------------------------------

SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
             intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096, torch_dtype="float32")


def run_json(capsys, *args):
    from ckpt_offload.sizing.cli import main

    rc = main([*args, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_training_args_every_n_layers_and_offload_size_that_configuration(tmp_path, capsys):
    """Finding: every_n_layers=2 with offload was sized as every layer checkpointed and offloaded,
    every_n_layers 3 or 4 as every layer checkpointed."""
    transformers = pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config))
    ids = torch.empty(1, 256, dtype=torch.long, device="meta")
    est = estimate_memory(model, {"input_ids": ids, "labels": ids})
    common = ("--config", str(config), "--seq", "256", "--device-memory", "4GiB", "--host-memory", "1TiB")
    for n, offload in ((2, True), (3, False), (4, True)):
        args = tmp_path / f"args{n}.json"
        args.write_text(json.dumps(dict(gradient_checkpointing=True, per_device_train_batch_size=1,
                                        gradient_accumulation_steps=2,
                                        gradient_checkpointing_kwargs={"every_n_layers": n, "offload": offload})))
        out = run_json(capsys, *common, "--training-args", str(args))
        row = est.configuration(every_n_layers=n, offload=offload, keep_last=1)
        mine = out["your_run"]
        assert mine["configuration"] == row.label and mine["source"] == "--training-args"
        assert (mine["device_peak_bytes"], mine["host_bytes_per_rank"]) == (row.peak_bytes, row.host_bytes)
        assert mine["device_peak_bytes"] not in (out["modes"]["checkpoint"]["device_peak_bytes"],
                                                 out["modes"]["checkpoint+offload"]["device_peak_bytes"])
    # The options size their own configuration, and win over the file's.
    out = run_json(capsys, *common, "--training-args", str(args), "--every-n-layers", "2", "--keep-last", "0")
    row = est.configuration(every_n_layers=2, offload=True, keep_last=0)
    assert out["your_run"]["device_peak_bytes"] == row.peak_bytes
    assert out["your_run"]["configuration"] == "every_n_layers=2, offload, keep_last=0"
    out = run_json(capsys, *common, "--every-n-layers", "3", "--no-offload")
    assert out["your_run"]["device_peak_bytes"] == est.configuration(every_n_layers=3, offload=False).peak_bytes


def test_the_command_refuses_what_it_cannot_size(tmp_path, capsys):
    from ckpt_offload.sizing.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    for flags, why in ((["--offload-all"], "offload_all (every saved activation offloaded) is not sized"),
                       (["--policy", "attention"], "policy='attention' is not sized"),
                       (["--every-n-layers", "4", "--keep-last", "3"], "keep_last=3 is larger than the 2")):
        rc = main(["--config", str(config), "--seq", "64", "--device-memory", "4GiB", *flags])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert rc == 2 and len(errors) == 1 and why in errors[0] and "Traceback" not in err, (flags, err)
