"""The job the estimate sizes a rank of: a sharded recipe divides by the job's ranks (--ranks, the
launcher's WORLD_SIZE, accelerate's config file) and is refused in one line where nothing says how
many; --cp N sizes each rank's 1/N of the sequence with FSDP across the job's ranks."""
import json

import pytest
import torch

from ckpt_offload.sizing import recipe as _recipe
from ckpt_offload.sizing.estimate import estimate_memory

transformers = pytest.importorskip("transformers")

SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
             intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096, torch_dtype="float32")
LAUNCH_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_TASKS_PER_NODE",
               "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


@pytest.fixture
def files(tmp_path, monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    args = tmp_path / "args.json"
    args.write_text(json.dumps(dict(fsdp="full_shard auto_wrap", per_device_train_batch_size=1,
                                    gradient_accumulation_steps=2)))
    return str(config), str(args), tmp_path


def run(capsys, *args):
    from ckpt_offload.sizing.cli import main

    rc = main([*args, "--device-memory", "4GiB", "--host-memory", "1TiB", "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


def estimate(config, seq, shard):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config))
    ids = torch.empty(1, seq, dtype=torch.long, device="meta")
    return estimate_memory(model, {"input_ids": ids, "labels": ids},
                           recipe=_recipe.Recipe(shard=shard, grads="kept"))


def test_a_sharded_file_without_its_ranks_is_refused(files, capsys):
    config, args, _ = files
    rc, _, err = run(capsys, "--config", config, "--training-args", args, "--seq", "256")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2 and len(errors) == 1 and "give --ranks N" in errors[0] and "(fsdp)" in errors[0], err


def test_the_ranks_come_from_the_option_or_the_launcher(files, capsys, monkeypatch):
    config, args, _ = files
    whole = estimate(config, 256, None).parts["weights_bytes"]
    rc, out, err = run(capsys, "--config", config, "--training-args", args, "--seq", "256", "--ranks", "8")
    assert rc == 0, err
    assert out["parts"]["weights_bytes"] == estimate(config, 256, "fsdp:8").parts["weights_bytes"] < whole / 7
    assert "sharded fsdp across 8 ranks" in out["recipe"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    rc, out, err = run(capsys, "--config", config, "--training-args", args, "--seq", "256")
    assert rc == 0 and "sharded fsdp across 4 ranks" in out["recipe"], err


def test_context_parallelism_sizes_a_rank_s_part_of_the_sequence(files, capsys):
    config, _, tmp_path = files
    rc, out, err = run(capsys, "--config", config, "--seq", "1024", "--cp", "4", "--ranks", "8")
    assert rc == 0, err
    per_rank = estimate(config, 256, "fsdp:8")  # 1024 tokens over 4 ranks, FSDP across all 8
    for mode in ("none", "checkpoint", "checkpoint+offload"):
        assert out["modes"][mode]["device_peak_bytes"] == per_rank.peak_bytes[mode], mode
    assert out["seq"] == 1024 and "context parallel across 4 ranks (256 tokens a rank)" in out["recipe"]
    # The same job from accelerate's config file, read by accelerate.
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_machines: 1\n"
                   "num_processes: 8\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"
                   "  parallelism_config_cp_size: 4\n  parallelism_config_dp_shard_size: 2\n")
    rc, from_file, err = run(capsys, "--config", config, "--seq", "1024", "--accelerate-config", str(acc))
    assert rc == 0, err
    assert from_file["parts"] == out["parts"] and from_file["recipe"] == out["recipe"]
    for mode, row in from_file["modes"].items():
        assert row["device_peak_bytes"] == out["modes"][mode]["device_peak_bytes"], mode
        # num_processes 8 on num_machines 1: eight ranks share the node's host memory.
        assert row["host_bytes_per_node"] == 8 * row["host_bytes_per_rank"] == 8 * out["modes"][mode]["host_bytes_per_rank"]
    rc, _, err = run(capsys, "--config", config, "--seq", "1024", "--cp", "3", "--ranks", "8")
    assert rc == 2 and "--cp 3 does not divide the job's 8 ranks" in err
