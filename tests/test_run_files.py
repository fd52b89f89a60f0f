"""The run's own files read by the libraries that read them in the run: TrainingArguments / SFTConfig
built by transformers' HfArgumentParser, the optimizer as the Trainer resolves it, peft's adapter
config by peft's loading; the checkpointing configuration derived from them and the row that sizes
it; every bad file one line and exit 2, never a traceback (a hypothesis property test)."""
import dataclasses
import json

import pytest
import torch

from ckpt_offload.sizing import budget, recipe, recipe_files
from ckpt_offload.sizing.recipe import Recipe
from test_estimate import SMALL, run_main, small_config  # noqa: F401  (small_config: a fixture)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")


def _ta(tmp_path, name="args.json", **fields):
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    return str(path)


def _read(tmp_path, ranks=8, node_ranks=4, **fields):
    return recipe_files.training_args(_ta(tmp_path, **fields), ranks=ranks, node_ranks=node_ranks)


def _json(capsys, *args):
    rc, out, err = run_main(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def _one_error_line(err):
    lines = [l for l in err.strip().splitlines() if not l.startswith("estimate: ")]
    return len(lines) == 1 and lines[0].startswith("python -m ckpt_offload estimate: error: ") and "Traceback" not in err


# -- finding 1 (reading), 10: the checkpointing the run uses, and its row --------------------------

@pytest.mark.parametrize("fields, keywords, row", [
    # every_n_layers 2 with offload: not the every-layer checkpoint+offload row
    (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2, "offload": True}),
     dict(every_n_layers=2, offload=True, keep_last=1), "every_n_layers=2, offload, keep_last=1"),
    # every_n_layers 3: not the every-layer checkpoint row
    (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 3}),
     dict(every_n_layers=3, offload=False, keep_last=0), "every_n_layers=3, no offload"),
    (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs='{"every_n_layers": 2}'),  # a JSON string
     dict(every_n_layers=2, offload=False, keep_last=0), "every_n_layers=2, no offload"),
    # transformers 5.25's own names only (finding 10)
    (dict(activation_checkpointing=True), dict(every_n_layers=1, offload=False, keep_last=0),
     "every_n_layers=1, no offload"),
    # FSDP's own checkpointing with transformers' off: every layer checkpointed
    (dict(gradient_checkpointing=False, fsdp=True, fsdp_config={"activation_checkpointing": True}),
     dict(every_n_layers=1, offload=False, keep_last=0), "every_n_layers=1, no offload"),
    # TRL's activation_offloading: every saved activation offloaded (SFTConfig checkpoints by default)
    (dict(max_length=64, activation_offloading=True),
     dict(every_n_layers=1, offload=False, keep_last=0, offload_all=True), None),
    (dict(gradient_checkpointing=False), None, "no checkpointing"),
])
def test_the_checkpointing_configuration_is_the_runs_and_no_row_stands_in_for_another(tmp_path, fields, keywords, row):
    pytest.importorskip("trl")
    if "activation_checkpointing" in fields and "activation_checkpointing" not in transformers.TrainingArguments.__dataclass_fields__:
        pytest.skip("this transformers predates the activation_checkpointing* names")
    from ckpt_offload.sizing.estimate import configuration_label, configuration_row

    got = _read(tmp_path, **fields)["configuration"]
    assert got == keywords
    sized = recipe_files.row_for_configuration(got)
    if row is None:  # no row sizes it: refused with the reason, never another row
        with pytest.raises(ValueError, match="not sized"):
            configuration_row(None, **sized)
    else:
        assert configuration_label(**sized) == row
        configuration_row(None, **sized)


def test_row_for_configuration_refuses_nested_fsdp_checkpointing():
    with pytest.raises(recipe_files.UnsizedConfiguration, match="nested"):
        recipe_files.row_for_configuration(dict(every_n_layers=1, offload=False, keep_last=0,
                                                fsdp_activation_checkpointing=True))


def test_the_command_sizes_the_files_configuration_and_refuses_one_it_cannot(small_config, tmp_path, capsys):
    args = _ta(tmp_path, per_device_train_batch_size=1, gradient_checkpointing=True,
               gradient_checkpointing_kwargs={"every_n_layers": 2, "offload": True})
    out = _json(capsys, "--config", small_config, "--seq", "64", "--training-args", args, "--device-memory", "4GiB",
                "--host-memory", "1TiB")
    assert out["your_run"]["configuration"] == "every_n_layers=2, offload, keep_last=1"
    assert out["configuration_refused"] is None
    args = _ta(tmp_path, per_device_train_batch_size=1, max_length=64, activation_offloading=True)
    out = _json(capsys, "--config", small_config, "--seq", "64", "--training-args", args, "--device-memory", "4GiB",
                "--host-memory", "1TiB")
    assert out["your_run"] is None and "offload_all" in out["configuration_refused"]
    rc, table, _ = run_main(capsys, "--config", small_config, "--seq", "64", "--training-args", args,
                            "--device-memory", "4GiB", "--host-memory", "1TiB")
    assert rc == 0 and "your run" not in table.split("--training-args checkpointing")[0]
    assert "--training-args checkpointing: not sized" in table


# -- findings 4, 8: fsdp / deepspeed in every form transformers takes ------------------------------

@pytest.mark.parametrize("fields, shard", [
    (dict(fsdp="hybrid_shard_zero2 auto_wrap", fsdp_config={"version": 1}), "zero2:4"),  # within a node, ZeRO-2
    (dict(fsdp="hybrid_shard", fsdp_config={"version": 1}), "fsdp:4"),
    (dict(fsdp="full_shard auto_wrap"), "fsdp:8"),
    (dict(fsdp=True, fsdp_config={"reshard_after_forward": True}), "fsdp:8"),  # what 5.25 writes
    (dict(fsdp=True, fsdp_config={"reshard_after_forward": False}), "zero2:8"),
    (dict(fsdp=True, fsdp_config='{"reshard_after_forward": false}'), "zero2:8"),  # inline JSON string
    (dict(deepspeed='{"zero_optimization": {"stage": 3}}'), "zero3:8"),  # inline JSON string
    (dict(deepspeed={"zero_optimization": {"stage": 2}}), "zero2:8"),
])
def test_sharding_is_read_as_transformers_reads_it(tmp_path, fields, shard):
    assert _read(tmp_path, **fields)["shard"] == shard


def test_a_deepspeed_file_and_uncounted_settings_are_named(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                    "offload_optimizer": {"device": "nvme"}}}))
    out = _read(tmp_path, deepspeed=str(ds), torch_compile=True)
    assert out["shard"] == "zero3:8"
    notes = " | ".join(out["notes"])
    assert "offload_param to cpu: not counted" in notes and "offload_optimizer to nvme" in notes
    assert "torch_compile: not counted" in notes
    assert "FSDP cpu_offload" in " ".join(_read(tmp_path, fsdp="full_shard offload")["notes"])


def test_reading_leaves_no_deepspeed_config_or_process_group_behind(tmp_path):
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    _read(tmp_path, deepspeed={"zero_optimization": {"stage": 3}}, bf16=True)
    assert not is_deepspeed_zero3_enabled()  # a ZeRO-3 flag left set would make the meta model a ZeRO-3 one
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("fields, field", [
    (dict(fsdp=True, fsdp_config={"version": 2}, gradient_checkpointing="yes"), "gradient_checkpointing"),
    (dict(per_device_train_batch_size=None), "per_device_train_batch_size"),
    (dict(per_device_train_batch_size=0), "per_device_train_batch_size"),
    (dict(per_device_train_batch_size="8"), "per_device_train_batch_size"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (dict(gradient_accumulation_steps=None), "gradient_accumulation_steps"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(fp16=True, bf16=True), "fp16"),
    (dict(per_device_batch_size=1), "per_device_batch_size"),
    (dict(fsdp="hybrid_shard_zero2 auto_wrap"), "fsdp"),  # FSDP1 only: transformers refuses it under FSDP2
    (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": "2"}),
     "checkpointing_kwargs"),
    (dict(optim="adamw_foo"), "optim"),
])
def test_a_field_transformers_refuses_is_one_line_naming_the_file_and_the_field(small_config, tmp_path, capsys,
                                                                                 fields, field):
    args = _ta(tmp_path, **fields)
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "64", "--training-args", args)
    assert rc == 2 and _one_error_line(err), err
    assert f"--training-args {args!r}" in err and field in err, err


# -- findings 2, 6: the optimizer as the Trainer builds it ------------------------------------------

def test_the_default_optimizer_is_the_trainers_everywhere(small_config, capsys):
    from transformers import TrainingArguments

    default = TrainingArguments.__dataclass_fields__["optim"].default
    default = str(getattr(default, "value", default))
    assert recipe.default_optim() == default == "adamw_torch_fused"  # torch >= 2.8
    assert Recipe().optim == default
    out = _json(capsys, "--config", small_config, "--seq", "64")
    assert f"optimizer {default};" in out["recipe"]
    assert any("the Trainer's default" in n for n in out["not_counted"])
    import inspect

    from ckpt_offload.integrations import hf
    from ckpt_offload.sizing.estimate import estimate_memory
    from ckpt_offload.sizing.plan import plan_memory

    for fn in (estimate_memory, plan_memory, budget.auto_budget, budget.optimizer_state_bytes, hf.enable):
        assert inspect.signature(fn).parameters["optimizer"].default == recipe.DEFAULT_OPTIM, fn


@pytest.mark.parametrize("optim, optim_args, want", [
    ("adamw_torch_fused", None, dict(optim="adamw_torch_fused", amsgrad=False)),
    ("adamw_torch", None, dict(optim="adamw_torch", amsgrad=False)),
    ("rmsprop", "centered=True", dict(optim="rmsprop", momentum=0.0, centered=True)),
    ("rmsprop", "centered=True,momentum=0.9", dict(optim="rmsprop", momentum=0.9, centered=True)),
    ("sgd", "momentum=0.9", dict(optim="sgd", momentum=0.9)),
    ("adafactor", None, dict(optim="adafactor")),
])
def test_the_optimizer_is_the_class_and_arguments_the_trainer_builds(optim, optim_args, want):
    got, _ = recipe_files.optimizer_of(optim, optim_args)
    assert got == want


def test_rmsprop_centered_counts_the_states_torch_allocates():
    model = torch.nn.Linear(64, 64)
    fields, _ = recipe_files.optimizer_of("rmsprop", "centered=True")
    opt = torch.optim.RMSprop(model.parameters(), lr=0.1, centered=True)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    allocated = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    assert sum(recipe.state_bytes(p, **fields) for p in model.parameters()) == allocated


def test_optim_args_the_trainer_does_not_pass_are_refused_or_named(small_config, tmp_path, capsys):
    # The Trainer passes no optim_args to AdamW: amsgrad=True creates no third state in the run.
    out = _read(tmp_path, optim="adamw_torch", optim_args="amsgrad=True")
    assert out["optim"] == "adamw_torch" and out["amsgrad"] is False
    assert any("amsgrad=True" in n and "ignores it" in n for n in out["notes"])
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "64", "--optim", "adamw_torch",
                          "--optim-args", "momentum=0.9")
    assert rc == 2 and _one_error_line(err) and "--optim-args 'momentum=0.9'" in err and "AdamW" in err, err
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "64", "--optim", "sgd", "--optim-args", "momentum")
    assert rc == 2 and _one_error_line(err) and "--optim-args 'momentum'" in err, err


def test_every_optim_name_transformers_accepts_is_sized_or_refused_naming_it():
    from transformers.training_args import OptimizerNames

    for name in OptimizerNames:
        try:
            fields, _ = recipe_files.optimizer_of(name.value)
        except recipe_files.RecipeFileError as e:
            assert name.value in str(e) and "\n" not in str(e)
        else:
            model = torch.nn.Linear(8, 8)
            assert recipe.state_bytes(model.weight, **fields) >= 0 and fields["optim"] in recipe.OPTIMS


# -- finding 7: one count of optimizer states ------------------------------------------------------

def test_budget_and_estimate_count_an_fp32_adapter_on_a_bf16_model_alike():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, dtype=torch.bfloat16), torch.nn.Linear(16, 16))
    model[0].requires_grad_(False)  # the frozen bf16 base; model[1]: an fp32 adapter
    r = Recipe(optim="adamw_torch", dtype="bf16")
    parts = recipe.static_parts(model, r)
    assert parts["optimizer_bytes"] == 2 * 4 * (16 * 16 + 16)  # fp32 states, as torch allocates them
    assert budget.optimizer_state_bytes(model, r) == parts["optimizer_bytes"]
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert budget.optimizer_step_bytes(model, r) == grads + parts["optimizer_bytes"] + parts["step_temp_bytes"]


# -- findings 6, 9: the adapter as peft builds it --------------------------------------------------

def _adapter(tmp_path, **fields):
    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", task_type="CAUSAL_LM", **fields)))
    return str(folder)


def _meta_peft(config_path, **lora):
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config_path))
        return peft.get_peft_model(base, peft.LoraConfig(**lora))


def test_the_adapter_folder_save_pretrained_writes_is_read(small_config, tmp_path, capsys):
    folder = _adapter(tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    out = _json(capsys, "--config", small_config, "--seq", "64", "--peft-config", folder)
    want = _meta_peft(small_config, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    assert out["parts"]["grads_bytes"] == sum(4 * p.numel() for p in want.parameters() if p.requires_grad)


def test_a_lora_target_that_matches_no_module_is_refused_with_the_close_names(small_config, capsys):
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "64", "--lora-rank", "4", "--lora-targets",
                          "q_prj,v_proj")
    assert rc == 2 and _one_error_line(err) and "'q_prj'" in err and "q_proj" in err, err


def test_modules_to_save_head_is_not_quantized_and_takes_the_fused_loss(small_config, tmp_path, capsys):
    folder = _adapter(tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    base = ("--config", small_config, "--seq", "64", "--peft-config", folder)
    quantized = _json(capsys, *base, "--quantize", "nf4")["parts"]
    plain = _json(capsys, *base)["parts"]
    head = SMALL["vocab_size"] * SMALL["hidden_size"] * 4  # fp32 config: the frozen original head, 4 bytes
    full = sum(p.numel() for n, p in _meta_peft(small_config, r=4, target_modules=["q_proj", "v_proj"],
                                                 modules_to_save=["lm_head"]).named_parameters()
               if not p.requires_grad and "lm_head" in n) * 4
    assert full == head
    # the head (original and trained copy) is kept whole: only the blocks' frozen linear weights shrink,
    # each to bitsandbytes' nf4 layout
    built = _meta_peft(small_config, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    blocks = [m.weight for n, m in built.named_modules()
              if isinstance(m, torch.nn.Linear) and ".layers." in n and not m.weight.requires_grad]
    assert len(blocks) == 7 * SMALL["num_hidden_layers"]
    saved = sum(4 * w.numel() - recipe.quantized_bytes(w, "nf4") for w in blocks)
    assert plain["weights_bytes"] - quantized["weights_bytes"] == saved
    fused = _json(capsys, *base, "--loss", "fused")
    assert fused["parts"]["logits_bytes"] < plain["logits_bytes"]


def test_target_parameters_with_no_target_modules_is_built_as_peft_builds_it(tmp_path, capsys):
    folder = _adapter(tmp_path, r=4, lora_alpha=8, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    config, _ = recipe_files.peft_config(folder)
    assert isinstance(config, peft.LoraConfig) and list(config.target_parameters) == ["mlp.experts.gate_up_proj"]
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps(dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=256,
                                   hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                   max_position_embeddings=512, torch_dtype="float32")))
    # peft builds it (no targets replaced by every linear projection): the adapters on the experts'
    # parameters are the trainable ones. Where peft's forward runs under torch.autocast (peft 0.21),
    # torch refuses that on the meta device: one line that says so.
    rc, out, err = run_main(capsys, "--config", str(moe), "--seq", "32", "--peft-config", folder, "--json")
    if rc == 0:
        built = _meta_peft(str(moe), r=4, lora_alpha=8, target_modules=[],
                           target_parameters=["mlp.experts.gate_up_proj"])
        trainable = [n for n, p in built.named_parameters() if p.requires_grad]
        assert trainable and all("experts" in n for n in trainable)
        assert json.loads(out)["parts"]["grads_bytes"] == sum(4 * p.numel() for p in built.parameters()
                                                                 if p.requires_grad)
    else:
        assert rc == 2 and _one_error_line(err) and "target_parameters" in err and "meta device" in err, err


@pytest.mark.parametrize("fields, field", [
    (dict(r="8"), "r"),
    (dict(r=8, target_modules=5), "target_modules"),
    (dict(r=8, lora_dropout="0.1"), "lora_dropout"),
])
def test_an_adapter_field_of_the_wrong_type_is_one_line(small_config, tmp_path, capsys, fields, field):
    folder = _adapter(tmp_path, **fields)
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "64", "--peft-config", folder)
    assert rc == 2 and _one_error_line(err) and "--peft-config" in err and f": {field}: " in err, err


def test_runtime_config_in_an_adapter_config_is_dropped_as_peft_drops_it(tmp_path):
    config, _ = recipe_files.peft_config(_adapter(tmp_path, r=4, runtime_config={"ephemeral_gpu_offload": True}))
    assert config.r == 4


# -- finding 8: never a traceback ------------------------------------------------------------------

def test_strict_config_validation_and_torch_overflow_are_one_line(small_config, tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(dict(SMALL, max_position_embeddings="4096")))
    rc, _, err = run_main(capsys, "--config", str(bad), "--seq", "64")
    assert rc == 2 and _one_error_line(err) and "max_position_embeddings" in err, err
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "1000000000000000")
    assert rc == 2 and _one_error_line(err) and "--seq 1000000000000000" in err, err


def test_errors_name_the_option_that_gave_the_file(small_config, tmp_path, capsys):
    folder = _adapter(tmp_path, r=4, lora_alpha=8, target_modules=["nope_proj"])
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "64", "--peft-config",
                          folder + "/adapter_config.json")
    assert rc == 2 and _one_error_line(err) and "--peft-config" in err and "--config" not in err, err


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.just(0), st.just("8"), st.just("true"),
                    st.text(max_size=4), st.lists(st.integers(0, 2), max_size=2),
                    st.dictionaries(st.sampled_from(["every_n_layers", "offload", "stage", "x"]),
                                    st.one_of(st.integers(-1, 3), st.booleans(), st.just("2")), max_size=2))
_TA_FIELDS = ["per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "optim", "optim_args",
              "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
              "activation_checkpointing_kwargs", "fsdp", "fsdp_config", "deepspeed", "use_liger_kernel",
              "max_length", "torch_compile", "learning_rate", "activation_offloading", "no_such_field"]
_LORA_FIELDS = ["r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "use_dora", "bias",
                "target_parameters", "layers_to_transform", "runtime_config", "unknown_key"]


def _ends_well(capsys, argv, path):
    rc, out, err = run_main(capsys, *argv)
    if rc == 0:
        return "device GiB" in out
    return rc == 2 and _one_error_line(err) and repr(path) in err


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.dictionaries(st.sampled_from(_TA_FIELDS), _VALUES, min_size=1, max_size=3))
def test_any_training_args_file_ends_in_a_table_or_one_line(small_config, tmp_path_factory, capsys, fields):
    path = str(tmp_path_factory.mktemp("ta") / "args.json")
    with open(path, "w") as f:
        json.dump(fields, f)
    assert _ends_well(capsys, ["--config", small_config, "--seq", "32", "--training-args", path], path), fields


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.dictionaries(st.sampled_from(_LORA_FIELDS), _VALUES, min_size=1, max_size=3))
def test_any_adapter_config_ends_in_a_table_or_one_line(small_config, tmp_path_factory, capsys, fields):
    folder = tmp_path_factory.mktemp("adapter")
    path = str(folder / "adapter_config.json")
    with open(path, "w") as f:
        json.dump({"peft_type": "LORA", **fields}, f)
    assert _ends_well(capsys, ["--config", small_config, "--seq", "32", "--peft-config", path], path), fields


def test_an_adapter_peft_cannot_apply_is_one_line_naming_the_file(small_config, tmp_path, capsys):
    """r=0 passes peft's config loading and fails only when peft applies it: the line still names the file."""
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "r": 0, "target_modules": ["q_proj"]}))
    assert _ends_well(capsys, ["--config", small_config, "--seq", "32", "--peft-config", str(path)], str(path))
