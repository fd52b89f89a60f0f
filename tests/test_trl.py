"""TRL's activation_offloading=True through the engine (integrations.trl): SFTTrainer runs on a tiny
Llama built from a config, with a character tokenizer built in code, on the CPU test path."""
import copy
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

import ckpt_offload  # noqa: E402
from ckpt_offload.integrations import hf  # noqa: E402
from ckpt_offload.integrations import trl as ctrl  # noqa: E402

pytestmark = pytest.mark.usefixtures("test_cpu")

_CHARS = "abcdefghijklmnopqrstuvwxyz .,"
_TEXT = "the quick brown fox jumps over the lazy dog, and then it sleeps."
_TRAINER_MODULES = ("sft_trainer", "dpo_trainer", "kto_trainer", "reward_trainer")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(_CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token a character
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


@pytest.fixture(scope="module")
def base_model(tokenizer):
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def dataset():
    # Lengths 12..57: batches of different shapes, as dynamic padding gives.
    return datasets.Dataset.from_dict({"text": [_TEXT[: 12 + 9 * (i % 6)] for i in range(12)]})


_baselines = {}
# transformers 5.x renamed gradient_checkpointing[_kwargs] to activation_checkpointing[_kwargs].
_GC = ("activation_checkpointing" if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
       else "gradient_checkpointing")


def _train(tmp_path, tokenizer, base_model, dataset, offload, gc=False, lora=False, packing=False, steps=4,
           extra=None):
    """Trains `steps` steps; per step: (loss, tokens in the batch, stats after the step), and the
    trainable parameters at the end."""
    torch.manual_seed(0)  # LoRA's initialisation
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, report_to=[], save_strategy="no",
        logging_steps=1, activation_offloading=offload, use_cpu=True, max_length=64,
        packing=packing, disable_tqdm=True, seed=0, **{_GC: gc}, **(extra or {}),
    )
    peft_config = None
    if lora:
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM")
    trainer = trl.SFTTrainer(model=copy.deepcopy(base_model), args=args, train_dataset=dataset,
                             processing_class=tokenizer, peft_config=peft_config)
    steps_seen = []
    own_step = trainer.training_step

    def step(model, inputs, *a, **k):
        loss = own_step(model, inputs, *a, **k)
        steps_seen.append((loss.item(), inputs["input_ids"].numel(), ckpt_offload.stats()))
        return loss

    trainer.training_step = step
    ckpt_offload.host_pool().empty_cache()  # no blocks left from before: the first step allocates
    ckpt_offload.reset_stats()
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return trainer, steps_seen, params


def _baseline(tmp_path, tokenizer, base_model, dataset, **config):
    key = tuple(sorted(config.items()))
    if key not in _baselines:
        _baselines[key] = _train(tmp_path, tokenizer, base_model, dataset, offload=False, **config)[1:]
    return _baselines[key]


def _check_steps(steps):
    """Offload really happened in every step, the pool is empty after each, and it allocated
    nothing after the longest batch (later batches reuse its blocks)."""
    before = 0
    for _, _, s in steps:
        assert s["tensors_offloaded"] > before
        before = s["tensors_offloaded"]
        assert s["host_in_use_bytes"] == 0
    longest = max(range(len(steps)), key=lambda i: steps[i][1])
    assert longest < len(steps) - 1, "the longest batch must not be the last step for this check"
    assert steps[-1][2]["host_alloc_calls"] == steps[longest][2]["host_alloc_calls"] > 0


CONFIGS = [
    pytest.param({}, id="plain"),
    pytest.param({"gc": True}, id="checkpointing"),
    pytest.param({"lora": True}, id="lora"),
    pytest.param({"lora": True, "gc": True}, id="lora-checkpointing"),
    # BFD packing: padding-free batches (one row, documents told apart by position_ids).
    pytest.param({"packing": True}, id="packing-padding-free"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_sft_offloads_through_the_engine_with_the_same_losses(tmp_path, tokenizer, base_model, dataset, config):
    ref_steps, ref_params = _baseline(tmp_path, tokenizer, base_model, dataset, **config)
    # With checkpointing only the layers' inputs and the loss's tensors are saved: TRL's stash of 5
    # would keep everything of this 3-layer model on the device.
    keep_last = 1 if config.get("gc") else None
    ctrl.install(keep_last=keep_last)
    trainer, steps, params = _train(tmp_path, tokenizer, base_model, dataset, offload=True, **config)
    ctx = trainer.maybe_activation_offload_context
    assert isinstance(ctx, ckpt_offload.offload_activations)
    assert trainer.padding_free == bool(config.get("packing"))
    # The CPU test path moves the same bits back: every loss and every trained weight is the same.
    assert [s[0] for s in steps] == [s[0] for s in ref_steps]
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert torch.equal(p, ref_params[name]), name
    _check_steps(steps)
    # TRL's choices: 1 KiB and up, the output head on the device, prefetch by decoder layer.
    inner = trainer.model.get_base_model() if config.get("lora") else trainer.model
    assert ctx.session.min_bytes == 1024
    assert ctx.exclude == [inner.lm_head]
    assert ctx.layers == list(inner.model.layers) and ctx.session.prefetch_unit == "layer"
    assert ctx.session.keep_last == (5 if keep_last is None else keep_last)  # 5: TRL's max_fwd_stash_size


def test_checkpointed_layers_inputs_are_what_is_offloaded(tmp_path, tokenizer, base_model, dataset):
    """PITFALLS 14: With gradient checkpointing each checkpointed layer saves only its input through TRL's context:
    with nothing kept (keep_last=0), fewer tensors move than without checkpointing, at least one per
    layer and step."""
    ctrl.install(keep_last=0)
    _, plain, _ = _train(tmp_path, tokenizer, base_model, dataset, offload=True, steps=2)
    ckpt_offload.reset_stats()
    trainer, ckpt, _ = _train(tmp_path, tokenizer, base_model, dataset, offload=True, gc=True, steps=2)
    assert trainer.maybe_activation_offload_context.session.keep_last == 0
    layers = trainer.model.config.num_hidden_layers
    assert layers * 2 <= ckpt[-1][2]["tensors_offloaded"] < plain[-1][2]["tensors_offloaded"]


def test_without_install_trl_needs_a_gpu(tmp_path, tokenizer, base_model, dataset):
    if torch.cuda.is_available():
        pytest.skip("TRL's own offloader runs where a GPU is present")
    with pytest.raises(RuntimeError):
        _train(tmp_path, tokenizer, base_model, dataset, offload=True, steps=1)


def _references():
    import importlib

    for name in _TRAINER_MODULES:
        importlib.import_module(f"trl.trainer.{name}")
    mods = [sys.modules["trl.models.activation_offloading"], sys.modules["trl.models"],
            *(sys.modules[f"trl.trainer.{n}"] for n in _TRAINER_MODULES)]
    return {m.__name__: m.__dict__.get("get_act_offloading_ctx_manager") for m in mods}


def test_install_patches_every_trl_reference_and_uninstall_restores_them():
    original = trl.models.activation_offloading.get_act_offloading_ctx_manager
    before = _references()
    assert set(before.values()) == {original}
    ctrl.install()
    assert ctrl.installed()
    during = _references()
    routed = during["trl.trainer.sft_trainer"]
    assert routed is not original and set(during.values()) == {routed}
    # A TRL module that imports the name after install() gets ours, and gets TRL's back on uninstall().
    late = types.ModuleType("trl._late_import_probe")
    exec("from trl.models import get_act_offloading_ctx_manager", late.__dict__)
    sys.modules[late.__name__] = late
    try:
        assert late.get_act_offloading_ctx_manager is routed
        ctrl.uninstall()
        assert not ctrl.installed()
        assert _references() == before
        assert late.get_act_offloading_ctx_manager is original
    finally:
        del sys.modules[late.__name__]
    ctrl.uninstall()  # a second call does nothing
    assert _references() == before


def _hf_methods():
    own = transformers.PreTrainedModel.__dict__
    return {n: own.get(n) for n in own if "checkpointing_enable" in n or "checkpointing_disable" in n}


@pytest.mark.parametrize("install_order", ["hf-first", "trl-first"])
@pytest.mark.parametrize("uninstall_order", ["hf-first", "trl-first"])
def test_hf_and_trl_install_coexist(tmp_path, tokenizer, base_model, dataset, install_order, uninstall_order):
    trl_before, hf_before = _references(), _hf_methods()
    first, second = (hf, ctrl) if install_order == "hf-first" else (ctrl, hf)
    first.install()
    second.install()
    assert hf.installed() and ctrl.installed()
    if install_order == uninstall_order:  # one training run covers the routing of both
        # transformers' offload=True goes to hf's session (the checkpointed layers' inputs), the rest
        # of the forward to TRL's context.
        ref_steps, ref_params = _baseline(tmp_path, tokenizer, base_model, dataset, gc=True)
        extra = {f"{_GC}_kwargs": {"offload": True}}
        trainer, steps, params = _train(tmp_path, tokenizer, base_model, dataset, offload=True, gc=True, extra=extra)
        assert ckpt_offload.checkpointing_state(trainer.model) is not None  # hf's routing took the layers
        assert [s[0] for s in steps] == [s[0] for s in ref_steps]
        for name, p in params.items():
            assert torch.equal(p, ref_params[name]), name
        _check_steps(steps)
    first, second = (hf, ctrl) if uninstall_order == "hf-first" else (ctrl, hf)
    first.uninstall()
    assert not first.installed() and second.installed()
    second.uninstall()
    assert _references() == trl_before and _hf_methods() == hf_before


def test_knobs_that_do_not_map(base_model):
    ctrl.install()
    make = trl.models.get_act_offloading_ctx_manager
    ctx = make(base_model, use_streams=False, min_offload_size=4096)
    assert ctx.session.keep_last == 0 and ctx.session.min_bytes == 4096  # no stream, no stash
    assert make(base_model, max_fwd_stash_size=2).session.keep_last == 2
    with pytest.warns(UserWarning, match="use_pin_memory=False is ignored"):
        make(base_model, use_pin_memory=False)
    with pytest.raises(ValueError, match=r"get_act_offloading_ctx_manager .*max_fwd_stash_size must be an int >= 1"):
        make(base_model, max_fwd_stash_size=0)
    with pytest.raises(TypeError, match=r"get_act_offloading_ctx_manager .*model must be a torch.nn.Module"):
        make("model")
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="no output head found"):
        assert make(body).exclude == []
    ctrl.install(keep_last=1, prefetch=3)  # new settings, for contexts made from now on
    ctx = make(base_model)
    assert ctx.session.keep_last == 1 and ctx.session.prefetch == 3
    with pytest.raises(ValueError, match=r"trl.install: prefetch must be an int >= 0, got -1"):
        ctrl.install(prefetch=-1)


def _reward_run(tmp_path, tokenizer, base_model, offload):
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(base_model.config.__class__(
        **{**base_model.config.to_dict(), "num_labels": 1}))
    model.model.load_state_dict(base_model.model.state_dict())
    data = datasets.Dataset.from_dict({"chosen": [_TEXT[: 20 + 7 * i] for i in range(8)],
                                       "rejected": [_TEXT[::-1][: 15 + 5 * i] for i in range(8)]})
    args = trl.RewardConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to=[],
                            save_strategy="no", use_cpu=True, activation_offloading=offload, disable_tqdm=True,
                            seed=0, max_length=64, **{_GC: False})
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    losses = []
    own_step = trainer.training_step

    def step(model, inputs, *a, **k):
        loss = own_step(model, inputs, *a, **k)
        losses.append((loss.item(), ckpt_offload.stats()))
        return loss

    trainer.training_step = step
    ckpt_offload.reset_stats()
    trainer.train()
    return trainer, losses


def test_reward_trainer_offloads_through_the_engine(tmp_path, tokenizer, base_model):
    """Another of the trainers that share the flag: a sequence-classification model (its `score` head is
    none of the names TRL looks for, so TRL and ckpt_offload both warn and offload it too)."""
    _, ref = _reward_run(tmp_path, tokenizer, base_model, offload=False)
    ctrl.install()
    with pytest.warns(UserWarning, match="no output head found"):
        trainer, steps = _reward_run(tmp_path, tokenizer, base_model, offload=True)
    assert isinstance(trainer.maybe_activation_offload_context, ckpt_offload.offload_activations)
    assert [s[0] for s in steps] == [s[0] for s in ref]
    assert all(s["host_in_use_bytes"] == 0 for _, s in steps)
    assert steps[0][1]["tensors_offloaded"] > 0
