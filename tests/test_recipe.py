"""The recipe's counts against what torch really allocates (optimizer states per dtype and option, a
wrapped optimizer looked through), the estimate with gradients freed against a real step, the parts
of quantized, sharded and fp32-master recipes, the losses, and the estimate command's options and
refusals."""
import json

import pytest
import torch

import ckpt_offload
from ckpt_offload.sizing import budget, recipe
from ckpt_offload.sizing.estimate import estimate_memory
from ckpt_offload.sizing.recipe import Recipe
from ckpt_offload.testing import LiveBytes
from tiny_gpt import make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")


def _tensor_state_bytes(opt):
    """What an optimizer allocated for its states, less the 0-d step counters."""
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _stepped(model, opt):
    ids = make_batch(batch=2, seq=16)
    model(ids).float().mean().backward()
    opt.step()
    return opt


OPTIMIZERS = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3), Recipe(optim="adamw_torch")),
    "adamw amsgrad": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True), Recipe(optim="adamw", amsgrad=True)),
    "adamw foreach": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), Recipe(optim="adamw_torch_fused")),
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), Recipe(optim="sgd")),
    "sgd momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), Recipe(optim="sgd", momentum=0.9)),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.1), Recipe(optim="adagrad")),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=0.1), Recipe(optim="rmsprop")),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_bytes_are_what_torch_allocates(name, dtype):
    """PITFALLS 36: optimizer state bytes are what torch allocates, from the one recipe every count reads.
    Fails where two modules count one fact two ways."""
    make, r = OPTIMIZERS[name]
    model = make_model(layers=2, hidden=32, heads=4, max_len=16).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make(params)
    counted = budget.optimizer_state_bytes(model, r)
    assert counted == sum(recipe.state_bytes(p, r.optim, amsgrad=r.amsgrad, momentum=r.momentum) for p in params)
    # The object: what is still to come and what it already holds (Adagrad allocates in its constructor).
    assert budget.optimizer_state_bytes(model, opt) + _tensor_state_bytes(opt) == counted
    _stepped(model, opt)
    assert counted == _tensor_state_bytes(opt), name
    assert budget.optimizer_state_bytes(model, opt) == 0  # allocated now: nothing still to come
    # The estimate counts the same bytes for the same model on meta.
    with torch.device("meta"):
        meta = make_model(layers=2, hidden=32, heads=4, max_len=16, device="meta").to(dtype)
    ids = torch.empty(2, 16, dtype=torch.long, device="meta")
    est = estimate_memory(meta, (ids,), recipe=r, loss_fn=lambda out: out.float().mean())
    assert est.parts["optimizer_bytes"] == counted


# As torch steps on a GPU (foreach kernels, its default for CUDA tensors), forced here on the CPU.
STEPPERS = {
    "adamw_torch": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adamw amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True, foreach=True),
    "adamw_torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(STEPPERS))
def test_step_temporaries_are_what_torch_allocates(name, dtype):
    model = make_model(layers=2, hidden=32, heads=4, max_len=16).to(dtype)
    params = list(model.parameters())
    opt = _stepped(model, STEPPERS[name](params))  # the states exist: a steady-state step
    before = [*params, *(p.grad for p in params), *(t for s in opt.state.values() for t in s.values())]
    with LiveBytes() as live:
        live.add(before)
        held = live.current()
        opt.step()
    counted = sum(recipe.step_temp_bytes(p, name.split()[0]) for p in params)
    # Beyond the temporaries, torch's CPU step counters add a 0-d tensor or two.
    assert live.peak - held == pytest.approx(counted, abs=64), (name, live.peak - held, counted)


def test_the_optimizer_step_is_a_peak_of_its_own():
    # Few activations beside fp32 weights, gradients and AdamW states: the step's temporaries (the
    # square roots of the second moments, a copy of the parameters) make the step's peak.
    model = make_model(layers=2, hidden=128, heads=4, max_len=16)
    ids = make_batch(batch=1, seq=4)
    loss = lambda out: out.float().mean()
    meta = make_model(layers=2, hidden=128, heads=4, max_len=16, device="meta")
    est = estimate_memory(meta, (ids.to("meta"),), loss_fn=loss, attention="flash", recipe=Recipe(optim="adamw_torch"))
    opt = _stepped(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    states = [t for s in opt.state.values() for t in s.values()]
    with LiveBytes() as live:
        live.add([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(), ids, *states])
        loss(model(ids)).backward()
        opt.step()
    assert est.step_peak_bytes == pytest.approx(live.peak, rel=0.03), (est.step_peak_bytes, live.peak)
    for mode in ("none", "checkpoint"):
        assert est.peak_bytes[mode] == pytest.approx(live.peak, rel=0.03), (mode, est.peak_bytes[mode], live.peak)


def test_transformers_adafactor_states():
    transformers = pytest.importorskip("transformers")
    model = make_model(layers=2, hidden=32, heads=4, max_len=16).to(torch.bfloat16)
    opt = transformers.optimization.Adafactor(model.parameters())
    counted = budget.optimizer_state_bytes(model, opt)
    assert counted == budget.optimizer_state_bytes(model, "adafactor")
    _stepped(model, opt)
    assert counted == _tensor_state_bytes(opt)


def test_an_accelerated_optimizer_is_looked_through():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    from accelerate.state import AcceleratorState, GradientState, PartialState

    accelerate.Accelerator(cpu=True)  # what a Trainer sets up before it wraps the optimizer
    try:
        model = make_model(layers=2, hidden=32, heads=4, max_len=16).to(torch.bfloat16)
        trainable = sum(p.numel() * p.element_size() for p in model.parameters())
        plain = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False)
        assert budget.optimizer_state_bytes(model, plain) == 0  # momentum 0: SGD allocates nothing
        ams = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), device_placement=False)
        assert budget.optimizer_state_bytes(model, ams) == 3 * trainable
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


def test_quantized_weights_at_bitsandbytes_layout():
    w = torch.empty(4096, 4096, device="meta")
    n = 4096 * 4096
    # nf4: packed two a byte; per 64 elements an 8-bit absmax, per 256 absmaxes an fp32 scale, one fp32
    # offset and the 256-entry fp32 code of the nested quantization; nf4's own 16-entry code.
    assert recipe.quantized_bytes(w, "nf4") == n // 2 + n // 64 + 4 * (n // 64 // 256) + 4 + 1024 + 64
    assert recipe.quantized_bytes(w, "nf4", double_quant=False) == n // 2 + 4 * (n // 64) + 64
    assert recipe.quantized_bytes(w, "int8") == n + 4 * 4096  # one byte an element, an fp32 scale per row


def _meta_tiny(dtype=torch.float32, layers=4):
    with torch.device("meta"):
        return make_model(layers=layers, hidden=64, heads=4, max_len=128, device="meta").to(dtype)


def _loss(out):
    return out.float().mean()


def test_sharded_parts_divide_and_count_what_is_gathered():
    model = _meta_tiny(torch.bfloat16)
    ids = torch.empty(2, 128, dtype=torch.long, device="meta")
    one = estimate_memory(model, (ids,), recipe=Recipe(), loss_fn=_loss)
    z2 = estimate_memory(model, (ids,), recipe=Recipe(shard="zero2:4"), loss_fn=_loss)
    f4 = estimate_memory(model, (ids,), recipe=Recipe(shard="fsdp:4"), loss_fn=_loss)
    p = one.parts
    assert z2.parts["weights_bytes"] == p["weights_bytes"]
    assert z2.parts["grads_bytes"] == -(-p["grads_bytes"] // 4) and z2.parts["optimizer_bytes"] == -(-p["optimizer_bytes"] // 4)
    assert f4.parts["weights_bytes"] == -(-p["weights_bytes"] // 4)
    assert f4.parts["in_flight_bytes"] > 0
    for mode in one.peak_bytes:
        saved = sum(p[k] for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")) - \
            sum(f4.parts[k] for k in ("weights_bytes", "grads_bytes", "optimizer_bytes", "in_flight_bytes"))
        assert one.peak_bytes[mode] - f4.peak_bytes[mode] == saved
        assert one.peak_bytes[mode] - z2.peak_bytes[mode] == \
            p["grads_bytes"] - z2.parts["grads_bytes"] + p["optimizer_bytes"] - z2.parts["optimizer_bytes"]


def test_fp32_master_weights_under_autocast_count_fp32_weights_gradients_and_states():
    model = _meta_tiny(torch.bfloat16)  # built in the dtype the step computes in
    ids = torch.empty(2, 128, dtype=torch.long, device="meta")
    pure = estimate_memory(model, (ids,), recipe=Recipe(optim="adamw_torch"), loss_fn=_loss)
    master = estimate_memory(model, (ids,), recipe=Recipe(optim="adamw_torch", dtype="fp32", autocast="bf16"),
                             loss_fn=_loss)
    n = sum(p.numel() for p in model.parameters())
    assert pure.parts["weights_bytes"] == 2 * n and pure.parts["optimizer_bytes"] == 4 * n
    assert master.parts["weights_bytes"] == 4 * n and master.parts["grads_bytes"] == 4 * n
    assert master.parts["optimizer_bytes"] == 8 * n
    for mode in pure.peak_bytes:
        assert master.activation_peak_bytes[mode] - pure.activation_peak_bytes[mode] == 2 * n + 2 * n + 4 * n
    # The optimizer's step: the same, and its temporary (a copy of the parameters) in fp32 too.
    assert master.step_peak_bytes - pure.step_peak_bytes == 2 * n + 2 * n + 4 * n + 2 * n


@pytest.mark.parametrize("mode", ["none", "checkpoint", "checkpoint+offload", "every_n=2"])
def test_freed_gradients_within_3_percent_of_a_real_step(mode):
    # zero_grad(set_to_none=True) between steps: the gradients grow through the backward.
    from test_estimate import configure

    ids = make_batch(batch=2, seq=128)
    loss = lambda out: torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]),
                                                        ids[:, 1:].reshape(-1))
    meta_loss = lambda out: torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]),
                                                             ids.to("meta")[:, 1:].reshape(-1))
    meta = make_model(layers=6, hidden=64, heads=4, max_len=128, device="meta")
    est = estimate_memory(meta, (ids.to("meta"),), loss_fn=meta_loss, attention="flash", recipe=Recipe(grads="freed"))
    kept = estimate_memory(meta, (ids.to("meta"),), loss_fn=meta_loss, attention="flash")
    model = make_model(layers=6, hidden=64, heads=4, max_len=128)
    configure(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss(model(ids)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ckpt_offload.synchronize()
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with LiveBytes() as live:
        live.add([*model.parameters(), *model.buffers(), ids, *states])
        loss(model(ids)).backward()
    ckpt_offload.synchronize()
    ckpt_offload.disable_checkpointing(model)
    assert est.peak_bytes[mode] == pytest.approx(live.peak, rel=0.03), (est.peak_bytes[mode], live.peak)
    assert est.peak_bytes[mode] < kept.peak_bytes[mode]


def test_fused_and_chunked_losses_hold_less_than_the_whole_logits():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ids = torch.empty(1, 1024, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids}
    whole = estimate_memory(model, inputs, attention="flash")
    chunked = estimate_memory(model, inputs, attention="flash", recipe=Recipe(loss="chunked:8"))
    fused = estimate_memory(model, inputs, attention="flash", recipe=Recipe(loss="fused"))
    logits = 1024 * 4096
    assert whole.parts["logits_bytes"] == logits * (2 + 4)
    assert chunked.parts["logits_bytes"] == logits * 4
    assert fused.parts["logits_bytes"] < logits * 2 // 8
    for mode in ("none", "checkpoint"):
        # whole: bf16 logits, their fp32 copy and log-softmax; chunked: the fp32 log-softmax of every chunk.
        assert whole.peak_bytes[mode] - chunked.peak_bytes[mode] >= logits * 2
        assert chunked.peak_bytes[mode] - fused.peak_bytes[mode] >= logits * 3


def test_recipe_refuses_what_it_cannot_count():
    for bad in (dict(optim="lion"), dict(loss="chunked:0"), dict(loss="liger"), dict(grads="some"),
                dict(quantize="nf3"), dict(shard="fsdp"), dict(shard="ddp:8"), dict(dtype="bf16", autocast="fp16")):
        with pytest.raises(ValueError):
            Recipe(**bad)


# -- the estimate command ---------------------------------------------------------------------------

from test_estimate import SMALL, run_main, small_config  # noqa: E402,F401  (small_config: a fixture)


def _json(capsys, *args):
    rc, out, err = run_main(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_cli_fits_only_within_the_ranks_share_budget_auto_takes(small_config, capsys):
    """PITFALLS 36: the estimate command and budget='auto' agree on what fits. Fails where they count
    optimizer states differently."""
    # budget="auto" lets the node's ranks pin half of its available memory: a plan needing more is one
    # the run would refuse, so the command must not call it fitting.
    base = ("--config", small_config, "--seq", "1024", "--batch", "4", "--device-memory", "4GiB", "--ranks-per-node", "1")
    first = _json(capsys, *base, "--host-memory", "1TiB")
    need = first["modes"]["checkpoint+offload"]["host_bytes_per_node"]
    assert need > 0  # the checkpoint inputs are counted on every declared transformers
    host = max(need * 3 // 2, 2 ** 20)
    assert need < host < 2 * need
    out = _json(capsys, *base, "--host-memory", str(host))
    assert out["host_share_bytes"] == host // 2
    assert out["modes"]["checkpoint+offload"]["fits"] is False
    assert _json(capsys, *base, "--host-memory", str(2 * need))["modes"]["checkpoint+offload"]["fits"] is True


@pytest.mark.parametrize("change, cause", [
    (dict(hidden_size=60, num_attention_heads=8), "not divisible by num_attention_heads"),
    (dict(hidden_size="64"), "hidden_size must be a whole number"),
    (dict(num_attention_heads=0), "num_attention_heads must be at least 1"),
    (dict(vocab_size=-1), "vocab_size must be at least 1"),
    (dict(num_key_value_heads=3), "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (dict(torch_dtype="float8_e4m3fn"), "dtype 'float8_e4m3fn' is not one a step trains in"),
])
def test_cli_refuses_a_config_no_model_can_come_from(tmp_path, capsys, change, cause):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, **change}))
    rc, out, err = run_main(capsys, "--config", str(path), "--seq", "64")
    assert rc == 2 and cause in err and len(err.strip().splitlines()) == 1, err


def test_cli_refuses_sizes_that_cannot_be_meant(small_config, tmp_path, capsys):
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", str(10 ** 12), "--batch", str(10 ** 9))
    assert rc == 2 and "past what a tensor can hold" in err and "Traceback" not in err, err
    rc, _, err = run_main(capsys, "--config", str(tmp_path), "--seq", "64")
    assert rc == 2 and "is a directory" in err, err
    rc, _, err = run_main(capsys, "--config", small_config, "--seq", "64", "--device-memory", "80")
    assert rc == 2 and "missing unit" in err, err


def test_cli_reads_training_args_and_peft_config(small_config, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    args = tmp_path / "args.json"
    args.write_text(json.dumps(dict(per_device_train_batch_size=2, max_length=128, bf16=True, optim="adamw_bnb_8bit",
                                    gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": True},
                                    use_liger_kernel=True, gradient_accumulation_steps=1)))
    adapter = tmp_path / "adapter_config.json"
    adapter.write_text(json.dumps(dict(peft_type="LORA", r=4, lora_alpha=8, lora_dropout=0.1,
                                       target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")))
    out = _json(capsys, "--config", small_config, "--training-args", str(args), "--peft-config", str(adapter),
                "--device-memory", "4GiB", "--host-memory", "1TiB")
    assert (out["batch"], out["seq"]) == (2, 128)
    assert out["your_run"]["configuration"] == "every_n_layers=1, offload, keep_last=1"
    assert out["configuration_refused"] is None
    assert "fused" in out["recipe"] and "adamw_bnb_8bit" in out["recipe"] and "gradients freed" in out["recipe"]
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(small_config))
        lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert out["parts"]["grads_bytes"] == 4 * sum(p.numel() for p in trainable)  # fp32 adapters, q and v only
    assert out["parts"]["optimizer_bytes"] == sum(recipe.state_bytes(p, "adamw_bnb_8bit") for p in trainable)
    args.write_text(json.dumps(dict(json.loads(args.read_text()), gradient_checkpointing_kwargs={})))
    rc, table, err = run_main(capsys, "--config", small_config, "--training-args", str(args), "--device-memory", "4GiB",
                              "--host-memory", "1TiB")
    assert rc == 0 and "your run: every_n_layers=1, no offload (from --training-args)" in table
    # The options win over the file.
    assert _json(capsys, "--config", small_config, "--training-args", str(args), "--seq", "64", "--grads", "kept",
                 "--device-memory", "4GiB", "--host-memory", "1TiB")["seq"] == 64


@pytest.mark.parametrize("name", ["activation_checkpointing", "gradient_checkpointing"])
def test_training_args_read_checkpointing_under_either_name(tmp_path, name):
    """transformers 5.25 writes activation_checkpointing[_kwargs] (gradient_checkpointing* are its
    deprecated aliases, the only names in 5.17): either selects the mode; the new name wins."""
    import transformers

    from ckpt_offload.sizing import recipe_files

    if "activation_checkpointing" not in transformers.TrainingArguments.__dataclass_fields__:
        pytest.skip("this transformers predates the activation_checkpointing* names (5.17 has only the old ones)")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({name: True, f"{name}_kwargs": {"offload": True}}))
    assert recipe_files.training_args(str(args))["configuration"] == {"every_n_layers": 1, "offload": True,
                                                                       "keep_last": 1}
    args.write_text(json.dumps({"activation_checkpointing": False, "gradient_checkpointing": True}))
    assert recipe_files.training_args(str(args))["configuration"] is None


def test_cli_says_why_nothing_fits(small_config, capsys):
    rc, out, err = run_main(capsys, "--config", small_config, "--seq", "64", "--device-memory", "2MiB",
                            "--margin", "0", "--host-memory", "1TiB", "--ranks-per-node", "1")
    assert rc == 0, err
    assert "nothing fits: the weights, gradients and optimizer states alone take" in out
    assert "1 rank per node" in out and "recipe: pure float32" in out and "(--host-memory)" in out


# -- published measurements (docs/estimate.md, "Against published measurements") ---------------------

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-05, torch_dtype="bfloat16",
                 tie_word_embeddings=False)
LLAMA2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                 max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-05, torch_dtype="float16",
                 tie_word_embeddings=False)
LLAMA32_3B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=3072, num_hidden_layers=28,
                  num_attention_heads=24, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                  vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-05,
                  rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                    original_max_position_embeddings=8192, rope_type="llama3"),
                  torch_dtype="bfloat16", tie_word_embeddings=True)
# The Trainer of 2024 (transformers 4.4x) built torch's foreach AdamW by default (adamw_torch).
LIGER = ("--seq", "512", "--batch", "32", "--dtype", "fp32", "--autocast", "bf16", "--shard", "fsdp:4",
         "--grads", "freed", "--optim", "adamw_torch")
# The shapes of the published configs of the models Liger-Kernel's examples fine-tuned (the files on the
# Hugging Face Hub).
QWEN2_7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                max_position_embeddings=32768, max_window_layers=28, num_attention_heads=28, num_hidden_layers=28,
                num_key_value_heads=4, rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=None,
                tie_word_embeddings=False, torch_dtype="bfloat16", use_sliding_window=False, vocab_size=152064)
MISTRAL_7B = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
                  max_position_embeddings=32768, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
                  rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False,
                  torch_dtype="bfloat16", vocab_size=32000)
GEMMA_7B = dict(architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=256, hidden_act="gelu",
                hidden_size=3072, intermediate_size=24576, max_position_embeddings=8192, num_attention_heads=16,
                num_hidden_layers=28, num_key_value_heads=16, rms_norm_eps=1e-06, rope_theta=10000.0,
                torch_dtype="bfloat16", vocab_size=256000)
FSDP_LORA = ("--batch", "1", "--dtype", "bf16", "--lora-rank", "64", "--lora-targets",
             "k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj", "--lora-dropout", "0.1", "--adapter-dtype", "bf16",
             "--shard", "fsdp:2", "--grads", "freed")
PUBLISHED = [  # (config, options, mode, published MiB, the page's estimate MiB, the page's "off")
    (LLAMA3_8B, (*LIGER, "--loss", "fused"), "checkpoint", 38308, 42144, "+10.0%"),
    (LLAMA3_8B, (*LIGER, "--loss", "transformers"), "checkpoint", 43281, 62542, "+44.5%"),
    (LLAMA2_7B, ("--seq", "512", *FSDP_LORA), "checkpoint", 8479, 8594, "+1.4%"),  # 8.28 GiB
    (LLAMA2_7B, ("--seq", "2048", *FSDP_LORA), "checkpoint", 9380, 9565, "+2.0%"),  # 9.16 GiB
    (LLAMA32_3B, ("--seq", "4096", "--batch", "2", "--dtype", "bf16", "--optim", "adamw_torch", "--loss", "chunked:1",
                  "--grads", "freed"), "none", 61440, 60048, "-2.3%"),  # 60.0 GiB
    # Liger's runs of three more models: the peak is the optimizer's step (the same at every step,
    # whatever the batch's length), compared with the estimate's step.
    (QWEN2_7B, (*LIGER, "--loss", "fused"), "step", 36854, 36314, "-1.5%"),
    (MISTRAL_7B, (*LIGER, "--loss", "fused"), "step", 34548, 34531, "-0.0%"),
    (GEMMA_7B, (*LIGER, "--loss", "fused"), "step", 40729, 40711, "-0.0%"),
]


def test_published_measurements(tmp_path, capsys):
    import os

    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "estimate.md")).read()
    table = page[page.index("## Against published measurements"):]
    within = 0
    for i, (cfg, options, mode, published, shown, off) in enumerate(PUBLISHED):
        path = tmp_path / f"config{i}.json"
        path.write_text(json.dumps(cfg))
        out = _json(capsys, "--config", str(path), *options)
        peak = out["optimizer_step_peak_bytes"] if mode == "step" else out["modes"][mode]["device_peak_bytes"]
        ours = round(peak / 2 ** 20)
        assert ours == shown, (options, ours)
        ratio = f"{(ours / published - 1) * 100:+.1f}%"
        verdict = "yes" if abs(ours / published - 1) <= 0.10 else "no"
        within += verdict == "yes"
        assert ratio == off and f"| {published:,} MiB | {shown:,} MiB | {off} | {verdict} |" in table, (ratio, off)
    # The page's count of the rows within 10% must stay true.
    assert f"{within} of the {len(PUBLISHED)} rows are within 10%" in table
