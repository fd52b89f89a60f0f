"""Fine-tuning as people run it: peft LoRA models, Trainer and SFTTrainer flows that enable
transformers' checkpointing again, copies of configured models (deepcopy, pickling, DataParallel
replicas, save_pretrained), profiling from eval mode, and rejected calls that change nothing.
Tiny models built from configs; nothing comes from a hub."""
import copy
import functools
import io
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
peft = pytest.importorskip("peft", reason="peft is an optional dependency")

import ckpt_offload  # noqa: E402
from ckpt_offload.integrations import hf  # noqa: E402
from tiny_gpt import grads, loss_of, make_batch, make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("test_cpu")

B, S, H, LAYERS = 2, 16, 32, 4
INPUT_BYTES = B * S * H * 4  # one layer input, float32


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          task_type="CAUSAL_LM")
    torch.manual_seed(1)  # LoRA's own initialisation: the same in every model of a comparison
    model = peft.get_peft_model(model, cfg)
    # LoRA's B starts at zero, which would make every LoRA A gradient zero: give it values.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    return model


def ids(seed=1, seq=S):
    return torch.randint(0, 128, (B, seq), generator=torch.Generator().manual_seed(seed))


def step(model, x):
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- PEFT ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["enable_then_peft", "peft_then_enable"])
def test_lora_gradients_bitwise_transformers_own_checkpointing(order):
    x = ids()
    theirs = lora(tiny())
    hf.checkpointing_enable(theirs.get_base_model())
    ref_loss, ref = step(theirs, x)
    ckpt_offload.reset_stats()

    if order == "enable_then_peft":
        base = tiny()
        assert hf.enable(base, offload=True, keep_last=1) == [0, 1, 2, 3]
        ours = lora(base)
    else:
        ours = lora(tiny())
        assert hf.enable(ours, offload=True, keep_last=1) == [0, 1, 2, 3]
    assert ckpt_offload.checkpointing_state(ours) == ([0, 1, 2, 3], [0, 1, 2])
    loss, got = step(ours, x)
    assert torch.equal(loss, ref_loss)
    assert_bitwise(got, ref)
    assert got and all("lora_" in n for n in got)  # the base weights get no gradient
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 and s["bytes_offloaded"] == 3 * INPUT_BYTES
    assert s["host_in_use_bytes"] == 0


def test_every_entry_point_takes_a_peft_model():
    """PITFALLS 20: every entry point accepts a PeftModel and finds the layers inside. Fails where the
    wrapper is refused or its inner model missed."""
    model = lora(tiny())
    assert ckpt_offload.enable_checkpointing(model, offload=True, every_n_layers=2) == [0, 2]
    assert ckpt_offload.checkpointing_state(model) == ([0, 2], [0])
    assert ckpt_offload.checkpointing_state(model.get_base_model()) == ([0, 2], [0])  # one truth, found from both
    step(model, ids())
    assert ckpt_offload.stats()["bytes_offloaded"] == INPUT_BYTES
    ckpt_offload.disable_checkpointing(model)
    assert ckpt_offload.checkpointing_state(model) is None
    report = ckpt_offload.reserve_for(_configured(lora(tiny())), (ids(),), loss_fn=lambda out: out.logits.float().mean())
    assert report["requests"] == 3 and report["request_bytes"] == 3 * INPUT_BYTES


def test_offload_callback_with_a_peft_model(tmp_path):
    """PITFALLS 20: OffloadCallback with a LoRA model trains and offloads. Fails where the wrapper raises or
    nothing is offloaded."""
    from torch.utils.data import Dataset

    class Data(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            x = ids(100 + i, seq=8 + 4 * (i % 3))[0]
            return {"input_ids": x, "labels": x}

    def collate(rows):
        n = max(len(r["input_ids"]) for r in rows)
        pad = [torch.nn.functional.pad(r["input_ids"], (0, n - len(r["input_ids"]))) for r in rows]
        return {"input_ids": torch.stack(pad), "labels": torch.stack(pad)}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        **hf.install_checkpointing_args(every_n_layers=1, offload=True),
    )
    hf.uninstall()  # the callback alone
    callback = hf.OffloadCallback(keep_last=1)
    trainer = transformers.Trainer(model=lora(tiny()), args=args, train_dataset=Data(), data_collator=collate,
                                   callbacks=[callback])
    trainer.train()
    assert callback.checkpointed == [0, 1, 2, 3]
    assert ckpt_offload.checkpointing_state(trainer.model) == ([0, 1, 2, 3], [0, 1, 2])
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 * 3 and s["host_in_use_bytes"] == 0


# -- never silently off -------------------------------------------------------------------------------
def test_trainer_reenable_keeps_the_engine_with_one_warning(tmp_path):
    """PITFALLS 19: the Trainer re-enabling checkpointing after hf.enable keeps the engine on (bytes really
    offloaded), with one warning. Fails where a later enable by the host framework switches offload off while
    the state still says on."""
    model = tiny()
    hf.enable(model, offload=True, keep_last=1)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            x = ids(200 + i)[0]
            return {"input_ids": x, "labels": x}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        **{("activation_checkpointing" if hasattr(transformers.TrainingArguments, "activation_checkpointing")
            else "gradient_checkpointing"): True},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformers.Trainer(model=model, args=args, train_dataset=Data()).train()
    ours = [str(w.message) for w in caught if "ckpt_offload" in str(w.message)]
    assert len(ours) == 1, ours
    assert ours[0].startswith("ckpt_offload: transformers' checkpointing was enabled again on LlamaForCausalLM")
    assert "configuration stays in force: checkpointed [0, 1, 2, 3], offloaded [0, 1, 2]" in ours[0]
    assert "hf.disable(model)" in ours[0]
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2, 3], [0, 1, 2])
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 3 * 3 and s["bytes_offloaded"] == 3 * 3 * INPUT_BYTES


def test_transformers_own_disable_removes_the_engine_with_a_warning():
    model = tiny()
    hf.enable(model, offload=True)
    with pytest.warns(UserWarning, match="transformers' checkpointing was disabled on LlamaForCausalLM"):
        hf.checkpointing_disable(model)
    assert ckpt_offload.checkpointing_state(model) is None
    assert not any(m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing"))
    step(model, ids())
    assert ckpt_offload.stats()["tensors_offloaded"] == 0
    assert not model._forward_pre_hooks and not model._forward_hooks  # nothing of ours left
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.enable(model, offload=True)
        hf.disable(model)  # our own disable says nothing


def test_state_is_read_off_what_the_layers_run():
    """PITFALLS 19: checkpointing_state is derived from what the layers run. Fails where a stored state
    claims offload that no longer happens."""
    model = tiny()
    hf.enable(model, offload=True, keep_last=1)
    layers = [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]
    layers[1]._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2, 3], [0, 2])
    layers[2].gradient_checkpointing = False
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 3], [0])
    step(model, ids())
    assert ckpt_offload.stats()["tensors_offloaded"] == 1  # what the state says, not what was configured


# -- rejected calls change nothing --------------------------------------------------------------------
def test_rejected_calls_leave_the_configuration_as_it_was():
    model = tiny()
    hf.enable(model, offload=True, keep_last=1)
    before = ckpt_offload.checkpointing_state(model)
    with pytest.raises(ValueError, match="keep_last=5 is larger than the 2 checkpointed layers"):
        hf.enable(model, every_n_layers=2, keep_last=5)
    with pytest.raises(ValueError, match="policy keys"):
        hf.enable(model, policy={7: "attention"})
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        hf.enable(model, budget_bytes="1GB", example_inputs=(ids(),))
    with pytest.raises(ValueError, match="modes\\[1\\] is 'bogus'"):
        ckpt_offload.enable_block_modes(model, ["checkpoint", "bogus", "none", "none"])
    assert ckpt_offload.checkpointing_state(model) == before == ([0, 1, 2, 3], [0, 1, 2])
    step(model, ids())
    assert ckpt_offload.stats()["tensors_offloaded"] == 3


# -- copies -------------------------------------------------------------------------------------------
def _zero_(model):
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


@pytest.mark.parametrize("configure", [
    lambda m: ckpt_offload.enable_checkpointing(m, offload=False),
    lambda m: ckpt_offload.enable_checkpointing(m, offload=True, every_n_layers=2, keep_last=1),
    lambda m: ckpt_offload.enable_block_modes(m, ["checkpoint+offload", "offload", "none", "checkpoint+offload",
                                                  "checkpoint", "none"]),
], ids=["no_offload", "offload", "block_modes"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_runs_its_own_weights_and_session(configure, how):
    """PITFALLS 18: a deep copy of a model after enable_checkpointing runs its own weights: zeroing the
    copy's changes its output, its gradients land in its own parameters. Fails where the wrapped forward is
    bound to the original module."""
    x = make_batch()
    model = make_model()
    configure(model)
    state = ckpt_offload.checkpointing_state(model)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert ckpt_offload.checkpointing_state(twin) == state
    assert twin.state_dict().keys() == model.state_dict().keys()
    att, twin_att = model._ckpt_offload, twin._ckpt_offload
    assert twin_att is not att and twin_att.owner is twin and all(a is not b for a, b in zip(att.blocks, twin_att.blocks))
    if att.session is not None:
        assert twin_att.session is not att.session

    ref = make_model()
    ref_loss = loss_of(ref, x)
    ref_loss.backward()
    ckpt_offload.reset_stats()
    loss = loss_of(twin, x)
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert_bitwise(grads(twin), grads(ref))
    assert not grads(model)  # the original got none
    twin_offloaded = ckpt_offload.stats()["tensors_offloaded"]
    ckpt_offload.reset_stats()
    loss_of(model, x).backward()
    assert twin_offloaded == ckpt_offload.stats()["tensors_offloaded"]  # the copy offloads as the original does
    assert (twin_offloaded > 0) == bool(state[1])

    _zero_(twin)
    assert not torch.equal(twin(x), model(x))  # the copy's weights, not the original's
    assert torch.equal(twin(x), torch.zeros_like(twin(x)))


def test_deepcopy_of_a_transformers_model_after_hf_enable():
    """PITFALLS 18: a transformers model after hf.enable deep-copies and runs its own weights. Fails where
    the copy runs the original's forward or cannot be copied."""
    x = ids()
    model = lora(tiny())
    hf.enable(model, offload=True)
    twin = copy.deepcopy(model)
    assert ckpt_offload.checkpointing_state(twin) == ([0, 1, 2, 3], [0, 1, 2])
    ref_loss, ref = step(model, x)
    ckpt_offload.reset_stats()
    loss, got = step(twin, x)
    assert torch.equal(loss, ref_loss)
    assert_bitwise(got, ref)
    assert ckpt_offload.stats()["tensors_offloaded"] == 3
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        if a.grad is not None:
            assert a.grad is not b.grad and torch.equal(a.grad, b.grad), n
    _zero_(twin)
    assert not torch.equal(twin(input_ids=x).logits, model(input_ids=x).logits)
    # transformers' re-enable on the copy keeps the copy's configuration, not the original's.
    with pytest.warns(UserWarning, match="enabled again"):
        hf.checkpointing_enable(twin.get_base_model())
    assert twin.get_base_model()._ckpt_offload is not model.get_base_model()._ckpt_offload


def _replicate(module):
    """What nn.DataParallel's replicate() makes of a module tree on another device (which needs
    GPUs): shallow module replicas, new parameter tensors; here zeros."""
    replica = module._replicate_for_data_parallel()
    for name, child in module._modules.items():
        replica._modules[name] = _replicate(child)
    for name, p in module._parameters.items():
        replica._parameters[name] = torch.nn.Parameter(torch.zeros_like(p))
    return replica


def test_a_data_parallel_replica_runs_its_own_weights():
    """PITFALLS 18: DataParallel replicas run their own weights. Fails where a replica runs the original
    module's closure."""
    x = make_batch()
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=True)
    ref = loss_of(make_model(), x)
    replica = _replicate(model)
    loss = loss_of(replica, x)
    torch.testing.assert_close(loss.detach(), torch.log(torch.tensor(97.0)))  # zero weights: uniform logits
    loss.backward()
    assert all(p.grad is not None for p in replica.head.parameters())
    assert not grads(model)  # nothing reached the original
    assert torch.equal(loss_of(model, x), ref)


def test_save_pretrained_round_trip(tmp_path):
    model = tiny()
    hf.enable(model, offload=True)
    keys = tiny().state_dict().keys()
    assert model.state_dict().keys() == keys
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    loaded.train()
    hf.enable(loaded, offload=True)
    x = ids()
    assert torch.equal(step(loaded, x)[0], step(model, x)[0])


# -- profiling in training mode -----------------------------------------------------------------------
def test_plan_and_reserve_profile_in_training_mode_and_restore_eval():
    """PITFALLS 23: plan_memory and reserve_for profile in training mode and put eval mode back. Fails where
    profiling runs in eval mode (transformers' layers then checkpoint nothing and it measures nothing)."""
    x = {"input_ids": ids(), "labels": ids()}
    trained = tiny()
    expected = ckpt_offload.reserve_for(_configured(trained), x)
    assert expected["requests"] == 3

    model = _configured(tiny())
    model.eval()  # as from_pretrained returns it
    report = ckpt_offload.reserve_for(model, x)
    assert report["requests"] == expected["requests"] and report["request_bytes"] == expected["request_bytes"]
    assert not any(m.training for m in model.modules())  # eval mode restored, every module

    x = (ids(),)
    loss = lambda out: out.logits.float().square().mean()  # noqa: E731
    train_cost = ckpt_offload.planner.profile(tiny(), x, loss_fn=loss, modes=["none", "checkpoint"])
    model = tiny()
    model.eval()
    model.lm_head.train()  # a mixed state comes back exactly as it was
    eval_cost = ckpt_offload.planner.profile(model, x, loss_fn=loss, modes=["none", "checkpoint"])
    assert [m.training for m in model.modules()] == [m is model.lm_head for m in model.modules()]
    # The checkpointing modes saved less than "none" in both: the layers really checkpointed.
    for cost in (train_cost, eval_cost):
        assert cost.peak(["checkpoint"] * LAYERS) < cost.peak(["none"] * LAYERS)
    assert eval_cost.peak(["checkpoint"] * LAYERS) == train_cost.peak(["checkpoint"] * LAYERS)


def _configured(model):
    hf.enable(model, offload=True)
    return model
