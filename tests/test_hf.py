"""transformers integration on tiny models built from configs (no downloads): the same layers as
transformers' own every_n_layers, the same gradients as its save_on_cpu offload, a Trainer run, and
hf.install() routing transformers' own offload=True (model methods and Trainer) to the engine."""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")

import ckpt_offload  # noqa: E402
from ckpt_offload.integrations import hf  # noqa: E402
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("test_cpu")

B, S, H, LAYERS = 2, 16, 32, 6


def tiny(arch, seed=0):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )
    else:
        cfg = transformers.GPT2Config(
            vocab_size=128, n_embd=H, n_layer=LAYERS, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (B, S), generator=g)


def step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def marked(model):
    return [i for i, m in enumerate(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)) if m.gradient_checkpointing]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("every_n", [1, 2, 3])
def test_same_layers_as_transformers(arch, every_n):
    theirs = tiny(arch)
    hf.checkpointing_enable(theirs, every_n_layers=every_n)
    ours = tiny(arch)
    idx = hf.enable(ours, every_n_layers=every_n, offload=True)
    assert idx == marked(theirs) == marked(ours) == list(range(0, LAYERS, every_n))
    plain = tiny(arch)
    assert ckpt_offload.enable_checkpointing(plain, every_n_layers=every_n) == idx  # finds the same blocks


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("every_n", [1, 2])
def test_gradients_match_transformers_offload(arch, every_n):
    ids = batch()
    theirs = tiny(arch)
    hf.checkpointing_enable(theirs, every_n_layers=every_n, offload=True)
    ref_loss, ref = step(theirs, ids)
    ckpt_offload.reset_stats()

    ours = tiny(arch)
    idx = hf.enable(ours, every_n_layers=every_n, offload=True, keep_last=1)
    loss, got = step(ours, ids)
    assert torch.equal(loss, ref_loss)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    s = ckpt_offload.stats()
    hidden_bytes = (len(idx) - 1) * B * S * H * 4
    if arch == "llama":
        assert s["tensors_offloaded"] == len(idx) - 1
        assert s["bytes_offloaded"] == hidden_bytes
    else:
        # GPT-2 passes its (B, 1, S, S) float mask positionally: it moves once, later layers share it.
        assert s["tensors_offloaded"] == len(idx)
        assert s["bytes_offloaded"] == hidden_bytes + B * S * S * 4
        assert s["shared_views"] == len(idx) - 2
    assert s["host_in_use_bytes"] == 0
    assert hf.state(ours) == (idx, idx[:-1])


def test_enable_checkpointing_on_a_transformers_model():
    ids = batch()
    ref_loss, ref = step(tiny("llama"), ids)
    model = tiny("llama")
    ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True, keep_last=0)
    loss, got = step(model, ids)
    torch.testing.assert_close(loss, ref_loss)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    assert ckpt_offload.stats()["bytes_offloaded"] == 3 * B * S * H * 4


def test_enable_checkpointing_reconfigures_and_restores_a_transformers_model():
    model = tiny("gpt2")
    ids = batch()
    model.eval()
    before = model(input_ids=ids).logits
    model.train()
    assert ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True) == [0, 2, 4]
    assert marked(model) == [0, 2, 4] and model.transformer.gradient_checkpointing is True
    assert ckpt_offload.enable_checkpointing(model, every_n_layers=3) == [0, 3]
    assert marked(model) == [0, 3]
    step(model, ids)
    ckpt_offload.disable_checkpointing(model)
    assert marked(model) == [] and model.transformer.gradient_checkpointing is False
    assert not any("_gradient_checkpointing_func" in m.__dict__ for m in model.modules())
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, before)


def test_enable_refuses_double_checkpointing_and_bad_arguments():
    model = tiny("llama")
    hf.checkpointing_enable(model)
    with pytest.raises(ValueError, match="transformers' own gradient checkpointing is on"):
        ckpt_offload.enable_checkpointing(model)
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        hf.enable(model, use_reentrant=True)
    with pytest.raises(ValueError, match="keep_last=9 is larger"):
        hf.enable(model, keep_last=9)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.enable(torch.nn.Linear(2, 2))
    hf.disable(model)
    assert marked(model) == [] and hf.state(model) is None


def _trainer_losses(tmp_path, callbacks, every_n=2, checkpointing=None, model=None):
    """Losses of a 3-step Trainer run; checkpointing: the TrainingArguments keywords (default
    hf.install_checkpointing_args(every_n_layers=every_n, offload=True)); model: default tiny("llama")."""
    from torch.utils.data import Dataset

    class Data(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            ids = batch(seed=100 + i)[0]
            return {"input_ids": ids, "labels": ids}

    if checkpointing is None:
        checkpointing = hf.install_checkpointing_args(every_n_layers=every_n, offload=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        **checkpointing,
    )
    trainer = transformers.Trainer(model=model if model is not None else tiny("llama"), args=args, train_dataset=Data(), callbacks=callbacks)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def _own_keywords(every_n=2, **extra):
    """The TrainingArguments keywords of transformers' own checkpointing, without going through hf."""
    fields = transformers.TrainingArguments.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"every_n_layers": every_n, "offload": True, **extra}}


def test_trainer_same_losses_with_and_without_the_callback(tmp_path):
    base, _ = _trainer_losses(tmp_path / "a", [], checkpointing=_own_keywords())
    assert ckpt_offload.stats()["bytes_offloaded"] == 0  # transformers' own save_on_cpu: not ours
    assert not hf.installed()
    per_step = 2 * (B * S * H * 4)  # layers 0, 2, 4 checkpointed; 0 and 2 offloaded, 4 kept
    # install_checkpointing_args(offload=True) installs the routing: no callback needed.
    plain, trainer = _trainer_losses(tmp_path / "b", [])
    assert hf.installed()
    assert ckpt_offload.checkpointing_state(trainer.model) == ([0, 2, 4], [0, 2])
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 * 2 and s["bytes_offloaded"] == 3 * per_step
    assert s["host_in_use_bytes"] == 0
    ckpt_offload.reset_stats()
    callback = hf.OffloadCallback(keep_last=1)
    ours, trainer = _trainer_losses(tmp_path / "c", [callback])
    assert len(base) == len(ours) == len(plain) == 3
    assert ours == base and plain == base
    assert callback.checkpointed == [0, 2, 4]
    assert ckpt_offload.checkpointing_state(trainer.model) == ([0, 2, 4], [0, 2])
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == 3 * per_step  # 3 steps x 2 offloaded layers
    assert s["host_in_use_bytes"] == 0


def test_trainer_with_transformers_own_keywords_after_install(tmp_path):
    base, _ = _trainer_losses(tmp_path / "a", [], checkpointing=_own_keywords())
    hf.install()
    ours, trainer = _trainer_losses(tmp_path / "b", [], checkpointing=_own_keywords())
    assert ours == base
    assert ckpt_offload.stats()["tensors_offloaded"] == 3 * 2
    assert hf.state(trainer.model) == ([0, 2, 4], [0, 2])


def _enable_names(model):
    """transformers' own switches this release has: the new name and the deprecated one."""
    return [n for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable") if hasattr(model, n)]


def _own_enable(model, name, checkpoint_kwargs=None, **kwargs):
    prefix = name[: -len("_enable")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name says so
        getattr(model, name)(**{f"{prefix}_kwargs": checkpoint_kwargs}, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_install_routes_transformers_own_offload_under_every_name(arch):
    ids = batch()
    theirs = tiny(arch)
    hf.checkpointing_enable(theirs, every_n_layers=2, offload=True)  # transformers' save_on_cpu
    ref_loss, ref = step(theirs, ids)
    assert ckpt_offload.stats()["tensors_offloaded"] == 0
    hf.install()
    hf.install()  # idempotent
    assert hf.installed()
    for name in _enable_names(theirs):
        ckpt_offload.reset_stats()
        ours = tiny(arch)
        _own_enable(ours, name, every_n_layers=2, offload=True)
        assert marked(ours) == [0, 2, 4]
        assert ckpt_offload.checkpointing_state(ours) == ([0, 2, 4], [0, 2])
        loss, got = step(ours, ids)
        assert torch.equal(loss, ref_loss), name
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), (name, k)
        s = ckpt_offload.stats()
        assert s["tensors_offloaded"] >= 2 and s["bytes_offloaded"] >= 2 * B * S * H * 4
        assert s["host_in_use_bytes"] == 0
        # offload=False afterwards: transformers' own checkpointing, and our hooks are gone.
        _own_enable(ours, name, every_n_layers=3, offload=False)
        assert marked(ours) == [0, 3] and hf.state(ours) is None
        ckpt_offload.reset_stats()
        step(ours, ids)
        assert ckpt_offload.stats()["tensors_offloaded"] == 0
    hf.uninstall()
    hf.uninstall()  # idempotent
    assert not hf.installed()
    again = tiny(arch)
    hf.checkpointing_enable(again, every_n_layers=2, offload=True)
    ckpt_offload.reset_stats()
    loss, _ = step(again, ids)
    assert torch.equal(loss, ref_loss)
    assert ckpt_offload.stats()["tensors_offloaded"] == 0 and hf.state(again) is None  # save_on_cpu again


def test_install_replaces_enable_and_disable_and_uninstall_restores_them():
    owner = transformers.PreTrainedModel
    before = dict(owner.__dict__)
    hf.install()
    changed = sorted(k for k in owner.__dict__ if owner.__dict__[k] is not before.get(k))
    assert changed in (
        ["_activation_checkpointing_disable", "_activation_checkpointing_enable"],
        ["gradient_checkpointing_disable", "gradient_checkpointing_enable"],
    )
    hf.uninstall()
    assert dict(owner.__dict__) == before and all(owner.__dict__[k] is before[k] for k in before)


def test_transformers_own_disable_drops_the_engine_under_install():
    hf.install()
    model = tiny("llama")
    name = _enable_names(model)[0]
    _own_enable(model, name, every_n_layers=2, offload=True)
    assert ckpt_offload.checkpointing_state(model) == ([0, 2, 4], [0, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, name.replace("enable", "disable"))()
    assert marked(model) == [] and ckpt_offload.checkpointing_state(model) is None
    assert model._forward_hooks == {} and model._forward_pre_hooks == {}  # the session's hooks are gone
    step(model, batch())
    assert ckpt_offload.stats()["tensors_offloaded"] == 0


def test_install_checks_the_arguments_transformers_passes():
    hf.install()
    model = tiny("llama")
    name = _enable_names(model)[0]
    with pytest.raises(TypeError, match=r"under hf.install\(\): offload must be True or False, got 'yes'"):
        _own_enable(model, name, offload="yes")
    with pytest.raises(ValueError, match=r"under hf.install\(\): use_reentrant=True is not supported"):
        _own_enable(model, name, offload=True, checkpoint_kwargs={"use_reentrant": True})
    _own_enable(model, name, offload=True, checkpoint_kwargs={"use_reentrant": False, "preserve_rng_state": False})
    assert hf.state(model) == ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4])


def test_arguments_are_checked_where_they_are_given():
    model = tiny("llama")
    with pytest.raises(TypeError, match="hf.enable: offload must be True or False, got 'yes'"):
        hf.enable(model, offload="yes")
    with pytest.raises(TypeError, match="hf.install_checkpointing_args: offload must be True or False, got 'no'"):
        hf.install_checkpointing_args(offload="no")
    with pytest.raises(ValueError, match="hf.install_checkpointing_args: use_reentrant=True is not supported"):
        hf.install_checkpointing_args(every_n_layers=2, offload=True, use_reentrant=True)
    with pytest.raises(ValueError, match="hf.install_checkpointing_args: every_n_layers must be an int >= 1, got 0"):
        hf.install_checkpointing_args(every_n_layers=0)
    with pytest.raises(TypeError, match="hf.checkpointing_enable: offload must be True or False"):
        hf.checkpointing_enable(model, offload=1)
    with pytest.raises(TypeError, match="hf.enable: prefetch_bytes must be an int >= 1"):
        hf.enable(model, prefetch_bytes=1.5)
    with pytest.raises(TypeError, match="OffloadCallback: prefetch_bytes must be an int >= 1"):
        hf.OffloadCallback(prefetch_bytes="1G")
    assert not hf.installed()  # nothing was installed by the rejected calls
    assert hf.install_checkpointing_args(every_n_layers=2, offload=False, use_reentrant=False)
    assert not hf.installed()


@pytest.mark.parametrize(
    "bad,error,match",
    [
        ({"offload": "no"}, TypeError, r"OffloadCallback .*offload must be True or False, got 'no'"),
        ({"use_reentrant": True}, ValueError, r"OffloadCallback .*use_reentrant=True is not supported"),
    ],
)
def test_callback_checks_the_training_arguments(tmp_path, bad, error, match):
    with pytest.raises(error, match=match):
        _trainer_losses(tmp_path, [hf.OffloadCallback()], checkpointing=_own_keywords(**bad))


def test_checkpointing_state_of_hf_enable():
    model = tiny("llama")
    assert ckpt_offload.checkpointing_state(model) is None
    assert hf.enable(model, every_n_layers=2, offload=True) == [0, 2, 4]
    assert ckpt_offload.checkpointing_state(model) == ([0, 2, 4], [0, 2])
    hf.enable(model, every_n_layers=3, offload=False)
    assert ckpt_offload.checkpointing_state(model) == ([0, 3], [])
    hf.disable(model)
    assert ckpt_offload.checkpointing_state(model) is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reloads_start_mid_layer_and_are_all_ahead_of_need(arch):
    model = tiny(arch)
    idx = hf.enable(model, every_n_layers=1, offload=True, keep_last=1)
    step(model, batch())
    ckpt_offload.reset_stats()
    step(model, batch())
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] >= len(idx) - 1
    assert s["reloads_on_demand"] == 0 and s["tensors_prefetched"] == s["tensors_offloaded"]
    (midpoints,) = [h for h in model._ckpt_offload.handles if isinstance(h, ckpt_offload.midpoints.Midpoints)]
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    attention = "self_attn" if arch == "llama" else "attn"
    assert all(midpoints.mid[layer] == attention for layer in layers)


# -- unknown keywords are refused, not passed on -----------------------------------------------------
def test_unknown_keywords_are_refused_with_the_close_match():
    """PITFALLS 39: A misspelt or foreign keyword used to travel on to the decoder layer's **kwargs, where it was
    ignored: offlaod=False offloaded, every_n=2 checkpointed every layer."""
    model = tiny("llama")
    with pytest.raises(TypeError, match=r"hf.enable: unexpected keyword 'offlaod'; did you mean 'offload'\?"):
        hf.enable(model, offlaod=False)
    with pytest.raises(TypeError, match=r"hf.enable: unexpected keyword 'every_n'; did you mean 'every_n_layers'\?"):
        hf.enable(model, every_n=2)
    with pytest.raises(TypeError, match=r"hf.enable: unexpected keyword 'example_input'; did you mean 'example_inputs'"):
        hf.enable(model, budget_bytes="auto", example_input=(batch(),))
    assert hf.state(model) is None and marked(model) == []  # the refused calls left the model as it was
    with pytest.raises(TypeError, match=r"hf.install_checkpointing_args: unexpected keyword 'every_n'; did you mean 'every_n_layers'"):
        hf.install_checkpointing_args(every_n=2)
    assert not hf.installed()
    # torch's checkpoint keywords still pass, and are used.
    assert hf.enable(model, every_n_layers=2, preserve_rng_state=False) == [0, 2, 4]
    args = hf.install_checkpointing_args(every_n_layers=2, offload=False, use_reentrant=False, determinism_check="none")
    assert next(v for k, v in args.items() if k.endswith("_kwargs")) == {
        "every_n_layers": 2, "offload": False, "use_reentrant": False, "determinism_check": "none"}
    for f in (hf.enable, hf.install_checkpointing_args):
        assert "preserve_rng_state" in f.__doc__ and "TypeError" in f.__doc__


def test_install_refuses_unknown_checkpointing_keywords():
    hf.install()
    model = tiny("llama")
    name = _enable_names(model)[0]
    with pytest.raises(TypeError, match=r"under hf.install\(\): unexpected keyword 'preserve_rng'; did you mean "
                                        r"'preserve_rng_state'"):
        _own_enable(model, name, offload=True, checkpoint_kwargs={"preserve_rng": False})
    assert hf.state(model) is None


@pytest.mark.parametrize("key, match", [("ofload", "offload"), ("preserve_rng", "preserve_rng_state")])
def test_install_refuses_a_misspelt_trainer_key_before_the_first_forward(tmp_path, key, match):
    """hf.install() and no callback: a misspelt key in the TrainingArguments' checkpointing kwargs
    (with it, "offload" is missing, so transformers takes its own offload=False path) is refused with
    the close match when the Trainer turns checkpointing on, before any forward runs; not by torch's
    checkpoint at the first forward."""
    hf.install()
    model = tiny("llama")
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    checkpointing = _own_keywords()
    kwargs = next(v for k, v in checkpointing.items() if k.endswith("_kwargs"))
    del kwargs["offload"]
    kwargs[key] = True
    with pytest.raises(TypeError, match=rf"under hf.install\(\): unexpected keyword '{key}'; did you mean '{match}'"):
        _trainer_losses(tmp_path, [], checkpointing=checkpointing, model=model)
    assert forwards == []


def test_callback_refuses_unknown_training_argument_keywords(tmp_path):
    with pytest.raises(TypeError, match=r"OffloadCallback .*unexpected keyword 'evry_n_layers'; did you mean "
                                        r"'every_n_layers'"):
        _trainer_losses(tmp_path, [hf.OffloadCallback()], checkpointing=_own_keywords(evry_n_layers=3))


# -- OffloadCallback alone is enough -----------------------------------------------------------------
def test_callback_alone_checkpoints_and_offloads(tmp_path, caplog):
    """callbacks=[hf.OffloadCallback()] with TrainingArguments that do not turn checkpointing on:
    every layer checkpointed, all but the last offloaded, the same losses as the run without."""
    import logging

    base, _ = _trainer_losses(tmp_path / "a", [], checkpointing={})
    assert ckpt_offload.stats()["tensors_offloaded"] == 0
    callback = hf.OffloadCallback()
    with caplog.at_level(logging.INFO, logger="ckpt_offload"):
        ours, trainer = _trainer_losses(tmp_path / "b", [callback], checkpointing={})
    assert ours == base
    assert callback.checkpointed == list(range(LAYERS))
    assert ckpt_offload.checkpointing_state(trainer.model) == (list(range(LAYERS)), list(range(LAYERS - 1)))
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 * (LAYERS - 1) and s["bytes_offloaded"] == 3 * (LAYERS - 1) * B * S * H * 4
    assert s["host_in_use_bytes"] == 0
    lines = [r.getMessage() for r in caplog.records if "OffloadCallback" in r.getMessage()]
    assert len(lines) == 1 and "checkpointing is off in the TrainingArguments" in lines[0]
    assert f"every_n_layers=1 ({LAYERS} layers checkpointed), offload=True, keep_last=1" in lines[0]


def test_callback_alone_keeps_a_configuration_made_before_the_trainer(tmp_path, caplog):
    import logging

    model = tiny("llama")
    hf.enable(model, every_n_layers=3, keep_last=0)
    callback = hf.OffloadCallback()
    with caplog.at_level(logging.INFO, logger="ckpt_offload"):
        _, trainer = _trainer_losses(tmp_path, [callback], checkpointing={}, model=model)
    assert callback.checkpointed == [0, 3]
    assert ckpt_offload.checkpointing_state(trainer.model) == ([0, 3], [0, 3])
    assert ckpt_offload.stats()["tensors_offloaded"] == 3 * 2
    assert any("the model keeps the configuration" in r.getMessage() for r in caplog.records)


def test_callback_offloads_when_the_training_arguments_do_not_say():
    """Checkpointing on in TrainingArguments without an 'offload' key: the callback's rule, offload."""
    import pathlib
    import tempfile

    fields = transformers.TrainingArguments.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    callback = hf.OffloadCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "runs without offload" warning
        with tempfile.TemporaryDirectory() as d:
            _, trainer = _trainer_losses(pathlib.Path(d), [callback],
                                         checkpointing={name: True, f"{name}_kwargs": {"every_n_layers": 2}})
    assert ckpt_offload.checkpointing_state(trainer.model) == ([0, 2, 4], [0, 2])
    assert ckpt_offload.stats()["tensors_offloaded"] == 3 * 2


# -- budget="auto" with a dataset whose rows a transform makes ---------------------------------------
def test_callback_auto_refuses_a_transformed_dataset_with_its_own_message():
    datasets = pytest.importorskip("datasets", reason="datasets is an optional dependency")
    from types import SimpleNamespace

    text = datasets.Dataset.from_dict({"text": ["a b c", "a b"]})
    tokenized = text.with_transform(lambda b: {"input_ids": [[1] * len(t.split()) for t in b["text"]]})
    cb = hf.OffloadCallback(budget="auto")
    with pytest.raises(ValueError, match=r"longest batch of the run is unknown.*transform.*max_length=N"):
        cb._longest(SimpleNamespace(), SimpleNamespace(dataset=tokenized))
    # A transform that changes the rows' lengths: the Arrow table's lengths are not the rows'.
    ids = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [1]]})
    doubled = ids.with_transform(lambda b: {"input_ids": [x * 2 for x in b["input_ids"]]})
    with pytest.raises(ValueError, match=r"longest batch of the run is unknown.*transform"):
        cb._longest(SimpleNamespace(), SimpleNamespace(dataset=doubled))
    assert cb._longest(SimpleNamespace(), SimpleNamespace(dataset=ids.with_format("torch"))) == 3


def test_enable_that_offloads_nothing_says_so_as_enable_checkpointing_does():
    """every_n_layers equal to the layer count checkpoints layer 0 alone, which keep_last=1 keeps on
    the device: hf.enable warns as enable_checkpointing does, at the caller's line, and the state
    reports no offloaded layer."""
    model = tiny("llama")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        assert hf.enable(model, every_n_layers=LAYERS, offload=True) == [0]
    (w,) = [r for r in records if "offloads nothing" in str(r.message)]
    assert w.category is RuntimeWarning and str(w.message).startswith("hf.enable: offload=True offloads nothing")
    assert w.filename == __file__
    assert ckpt_offload.checkpointing_state(model) == ([0], [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.enable(model, every_n_layers=LAYERS // 2, offload=True)  # layers 0 and 3: layer 0 offloads
    assert ckpt_offload.checkpointing_state(model) == ([0, 3], [0])
    hf.disable(model)


def test_checkpointing_args_is_a_deprecated_alias_that_says_it_installs():
    """install_checkpointing_args names its process-wide effect; the old name still works, warns
    (FutureWarning, at the caller's line) and does the same: the keywords, and the install."""
    assert not hf.installed()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        old = hf.checkpointing_args(every_n_layers=2, offload=True)
    (w,) = [r for r in records if issubclass(r.category, FutureWarning)]
    assert "hf.install_checkpointing_args" in str(w.message) and w.filename == __file__
    assert hf.installed()
    hf.uninstall()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hf.install_checkpointing_args(every_n_layers=2, offload=True) == old
    assert hf.installed()
    hf.uninstall()
    assert hf.install_checkpointing_args(offload=False)  # checkpointing only: nothing installed
    assert not hf.installed()
    assert "install()" in hf.install_checkpointing_args.__doc__.split("\n\n")[0]


def test_callback_auto_shows_its_plan_and_what_it_replaced(tmp_path, monkeypatch, capsys):
    """budget='auto' with room for everything: the plan checkpoints nothing, which replaces the
    checkpointing the TrainingArguments turned on: a warning says so, the plan is printed where a
    Trainer user sees it, and the profiling steps do not count in stats() (nothing is offloaded by
    the run's steps, and stats() says none)."""
    from ckpt_offload.sizing import budget

    monkeypatch.setenv(budget.TEST_DEVICE_ENV, str(64 << 30))
    callback = hf.OffloadCallback(budget="auto")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        _trainer_losses(tmp_path, [callback], checkpointing=_own_keywords(every_n=1))
    assert callback.plan.modes == ["none"] * LAYERS
    replaced = [r for r in records if "the plan replaces that" in str(r.message)]
    assert len(replaced) == 1 and f"layers {list(range(LAYERS))}" in str(replaced[0].message)
    assert replaced[0].filename == __file__  # the user's line (trainer.train()), not the Trainer's loop
    out = capsys.readouterr().out
    assert f"OffloadCallback(budget='auto'): planned for batch 2 x {S} tokens: blocks 0-{LAYERS - 1} none" in out
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 0 and s["bytes_offloaded"] == 0


def test_callback_alone_prints_that_it_turned_checkpointing_on(tmp_path, capsys):
    callback = hf.OffloadCallback(keep_last=1)
    _, trainer = _trainer_losses(tmp_path, [callback], checkpointing={})
    out = capsys.readouterr().out
    assert "OffloadCallback: checkpointing is off in the TrainingArguments; the callback turns it on" in out
    assert f"checkpointed {list(range(LAYERS))}, offloaded {list(range(LAYERS - 1))}" in out
