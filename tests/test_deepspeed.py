"""DeepSpeed ZeRO-2 and ZeRO-3 under the transformers Trainer, as fine-tunes run them: 2 gloo processes
on the CPU (CKPT_OFFLOAD_TEST_CPU=1, so CPU tensors go through the pool and engine), a tiny Llama
built from a config, LoRA on a frozen base and a full fine-tune, through hf.enable, OffloadCallback
and hf.install(). Each is compared with transformers' own gradient checkpointing in the same
processes: losses, every gradient DeepSpeed reduced (each rank's partition under ZeRO-3) and the
trained weights, bit for bit. One launch runs every case; the parent only compares.

DeepSpeed on the CPU, with the versions here, needs DS_ACCELERATOR=cpu, ACCELERATE_USE_DEEPSPEED=true
and accelerate's PartialState(backend="gloo") made before TrainingArguments(..., accelerator_config=
{"use_configured_state": True}); otherwise accelerate and DeepSpeed count different world sizes.
That belongs to this set-up, not to the library.
"""
import datetime
import gc
import importlib.util
import itertools
import os
import warnings

import pytest
import torch
import torch.distributed
import torch.multiprocessing as mp

from procs import free_port, join_ranks

MISSING = [m for m in ("deepspeed", "transformers", "peft", "accelerate") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs {', '.join(MISSING)} (the deepspeed extra: pip install 'deepspeed>=0.19.8' transformers peft "
        "accelerate)",
    ),
]

WORLD = 2
STEPS = 3
B, S, H, LAYERS = 2, 16, 32, 4
STAGES = (2, 3)
TUNES = ("lora", "full")
ROUTES = ("enable", "callback", "install")
# 16 Trainer runs a process: about 55 s of CPU time in all, 2 minutes on two busy cores. This
# bounds a hang, not a measurement.
TIMEOUT_S = 300


# -- in the children ---------------------------------------------------------------------------------
def _ds_config(stage):
    zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        # Every weight really partitioned (none kept whole for being small): the frozen base is
        # gathered for each layer's forward and its recompute, and freed in between.
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0, stage3_prefetch_bucket_size=0)
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def _model(tune):
    import peft
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg)  # under ZeRO-3: built partitioned (zero.Init)
    if tune == "lora":
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"))
        with torch.no_grad():  # LoRA's B starts at zero, which would make every A gradient zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    return model


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return WORLD * B * STEPS

    def __getitem__(self, i):
        x = torch.randint(0, 128, (S,), generator=torch.Generator().manual_seed(100 + i))
        return {"input_ids": x, "labels": x}


class _PackRecorder:
    """Wraps ckpt_offload's pushes of its saved-tensor hooks: each tensor the engine is handed, and
    whether it is a parameter or shares storage with one (the gathered data, or ZeRO-3's partition)."""

    def __init__(self):
        from ckpt_offload import checkpointing

        self.module, self.params, self.seen = checkpointing, [], []
        self.original = checkpointing._push_hooks

        def push(pack, unpack):
            def recording_pack(t):
                self.seen.append(self._describe(t))
                return pack(t)

            return self.original(recording_pack, unpack)

        checkpointing._push_hooks = push

    def _describe(self, t):
        storages = set()
        for p in self.params:
            for d in (p.data, getattr(p, "ds_tensor", None)):
                if d is not None and d.numel():
                    storages.add(d.untyped_storage().data_ptr())
        holds_weight = isinstance(t, torch.nn.Parameter) or any(t is p or t is p.data for p in self.params) or (
            t.numel() > 0 and t.untyped_storage().data_ptr() in storages)
        return tuple(t.shape), holds_weight

    def close(self):
        self.module._push_hooks = self.original


def _run(stage, tune, route, out_dir, recorder):
    import deepspeed.utils as dsu
    import transformers

    import ckpt_offload
    from ckpt_offload.integrations import hf

    hf.uninstall()
    if route == "transformers":
        checkpointing = hf.install_checkpointing_args(offload=False, use_reentrant=False)
    elif route == "install":
        hf.install()
        checkpointing = hf.install_checkpointing_args(offload=True)
    elif route == "callback":
        checkpointing = hf.install_checkpointing_args(offload=True)
        hf.uninstall()  # the callback alone
    else:  # enable: the model configured by hand; the Trainer's own enable keeps it, with one warning
        checkpointing = hf.install_checkpointing_args(offload=False, use_reentrant=False)
    # TrainingArguments before the model: under ZeRO-3 from_config builds it partitioned.
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=B, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, log_level="error", data_seed=0, dataloader_num_workers=0, deepspeed=_ds_config(stage),
        accelerator_config={"use_configured_state": True}, disable_tqdm=True, **checkpointing,
    )
    model = _model(tune)
    if route == "enable":
        assert hf.enable(model, offload=True, keep_last=1) == list(range(LAYERS))
    record = {"loss": [], "grads": [], "stats": []}

    class Recorder(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            engine = trainer.model_wrapped
            step = engine.step
            recorder.params = list(engine.module.parameters())

            def recording_step(*a, **k):  # between DeepSpeed's backward (gradients reduced) and its step
                grads = {}
                for n, p in engine.module.named_parameters():
                    if p.requires_grad:
                        g = dsu.safe_get_local_grad(p) if stage == 3 else dsu.safe_get_full_grad(p)
                        grads[n] = g.detach().clone()
                record["grads"].append(grads)
                return step(*a, **k)

            engine.step = recording_step

        def on_step_begin(self, args, state, control, **kwargs):
            ckpt_offload.reset_stats()

        def on_step_end(self, args, state, control, **kwargs):
            ckpt_offload.synchronize()
            s = ckpt_offload.stats()
            record["stats"].append({k: s[k] for k in ("tensors_offloaded", "tensors_fetched", "host_in_use_bytes")})

    class Trainer(transformers.Trainer):
        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            record["loss"].append(loss.detach().clone())
            return loss

    callbacks = [hf.OffloadCallback(keep_last=1)] if route == "callback" else []
    trainer = Trainer(model=model, args=args, train_dataset=_Data(), callbacks=[*callbacks, Recorder()])
    recorder.seen.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    record["packs"] = list(recorder.seen)
    # The check itself, on what it must catch: a weight (under ZeRO-3 its partition, the data
    # being freed between layers) is seen as one.
    weight = next(w for w in (getattr(p, "ds_tensor", p) for p in recorder.params) if w.numel())
    record["weight_seen_as_weight"] = recorder._describe(weight)[1]
    record["state"] = ckpt_offload.checkpointing_state(trainer.model)
    weights = {}
    for n, p in trainer.model_wrapped.module.named_parameters():
        # ZeRO-3: this rank's partition of the fp32 master weights; ZeRO-2: the whole weight, which
        # every rank holds (the optimizer's partitions gathered back after each step).
        # A frozen weight has no fp32 master: its partition itself (ds_tensor).
        if stage == 3:
            w = dsu.safe_get_local_fp32_param(p) if p.requires_grad else p.ds_tensor
        else:
            w = p.data
        weights[n] = w.detach().clone()
    record["weights"] = weights
    trainer.accelerator.free_memory()
    hf.uninstall()
    # The next case's Trainer makes an Accelerator with another DeepSpeed plugin: accelerate allows
    # that only in a fresh state (the process group, PartialState's, stays).
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    return record


def _worker(rank, port, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD), GLOO_SOCKET_IFNAME="lo", CKPT_OFFLOAD_TEST_CPU="1",
        DS_ACCELERATOR="cpu", ACCELERATE_USE_DEEPSPEED="true",
    )
    torch.set_num_threads(1)
    from accelerate import PartialState

    # DeepSpeed's CPU backend compiles a shared-memory all-reduce when it starts (minutes on two
    # cores), used only by inference's all-reduce: training's collectives go through gloo.
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (deepspeed.comm.torch is torch)
    PartialState(backend="gloo", timeout=datetime.timedelta(seconds=120))  # initialises DeepSpeed's comm too
    import deepspeed  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from ckpt_offload.integrations import hf  # noqa: F401

    # accelerate and DeepSpeed call gc.collect() a few times per run, each a full walk of every
    # object these imports made (over a second each on two cores): set those aside.
    gc.freeze()
    recorder = _PackRecorder()
    results = {}
    try:
        for stage, tune in itertools.product(STAGES, TUNES):
            for route in ("transformers", *ROUTES):
                results[stage, tune, route] = _run(stage, tune, route, os.path.join(out_dir, f"run{rank}"), recorder)
        torch.distributed.barrier()
    finally:
        recorder.close()
        torch.distributed.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


# -- in the parent -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    ctx = mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    return join_ranks(ctx, WORLD, out, TIMEOUT_S, "DeepSpeed: the ranks")


def _assert_bitwise(ours, theirs, where):
    assert ours.keys() == theirs.keys(), where
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), f"{where}: {name} differs"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tune", TUNES)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_bitwise_equal_to_transformers_checkpointing(ranks, stage, tune, route):
    for rank, results in enumerate(ranks):
        ref, ours = results[stage, tune, "transformers"], results[stage, tune, route]
        where = f"ZeRO-{stage} {tune} {route} rank {rank}"
        assert len(ref["loss"]) == len(ours["loss"]) == STEPS, where
        for step, (a, b) in enumerate(zip(ours["loss"], ref["loss"])):
            assert torch.equal(a, b), f"{where} step {step}: loss {a.item()} != {b.item()}"
        assert len(ours["grads"]) == len(ref["grads"]) == STEPS, where
        for step, (a, b) in enumerate(zip(ours["grads"], ref["grads"])):
            assert a, where
            _assert_bitwise(a, b, f"{where} step {step} gradient")
        _assert_bitwise(ours["weights"], ref["weights"], f"{where} trained weight")
        if tune == "lora":
            assert all("lora_" in n for n in ours["grads"][0]), where  # the base stays frozen
    # Each rank trained on its own batches, and under ZeRO-3 holds its own partition.
    assert not torch.equal(ranks[0][stage, tune, route]["loss"][0], ranks[1][stage, tune, route]["loss"][0])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tune", TUNES)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_offloaded_on_every_rank_and_host_memory_back_each_step(ranks, stage, tune, route):
    for rank, results in enumerate(ranks):
        where = f"ZeRO-{stage} {tune} {route} rank {rank}"
        ours, ref = results[stage, tune, route], results[stage, tune, "transformers"]
        assert ours["state"] == (list(range(LAYERS)), list(range(LAYERS - 1))), where
        assert len(ours["stats"]) == STEPS, where
        for step, s in enumerate(ours["stats"]):
            # The inputs of layers 0..2 (keep_last=1) went to the host and came back; none left there.
            assert s["tensors_offloaded"] == s["tensors_fetched"] == LAYERS - 1, f"{where} step {step}: {s}"
            assert s["host_in_use_bytes"] == 0, f"{where} step {step}: {s}"
        assert all(s["tensors_offloaded"] == 0 for s in ref["stats"]), where


@pytest.mark.parametrize("tune", TUNES)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_the_hooks_hold_no_weight(ranks, stage, tune):
    """PITFALLS 32: ZeRO-3 gathers each layer's weights for its forward and for its recompute and frees them in
    between (param.data = torch.empty(0)): a saved-tensor hook holding one would hold memory that
    is gone, or gathered again. What the engine is handed is each checkpointed layer's input, the
    hidden states, and nothing that is, or shares storage with, a parameter."""
    for rank, results in enumerate(ranks):
        for route in ROUTES:
            packs = results[stage, tune, route]["packs"]
            where = f"ZeRO-{stage} {tune} {route} rank {rank}"
            assert results[stage, tune, route]["weight_seen_as_weight"], where
            assert len(packs) == STEPS * LAYERS, f"{where}: {packs}"  # each layer's input, every step
            assert all(shape == (B, S, H) and not holds for shape, holds in packs), f"{where}: {packs}"
        assert results[stage, tune, "transformers"]["packs"] == [], where  # transformers' own: not ours
