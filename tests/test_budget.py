"""budget="auto" on the CPU test path: CKPT_OFFLOAD_TEST_DEVICE_BYTES stands in for the device's free
memory and a stand-in /proc/meminfo for the node's. The budgets are the stated arithmetic, the plan
made from them fits (its step measured with LiveBytes, the optimizer's states added), the host
pool's cap is the node's share, and past that cap tensors stay on the device with the gradients
unchanged."""
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ckpt_offload
from ckpt_offload.sizing import budget, hostmem
from ckpt_offload.sizing.recipe import Recipe
from ckpt_offload.testing import LiveBytes
from test_planner import measured_peak  # a steady-state step's peak, as the planner counts it
from tiny_gpt import grads, loss_of, make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu")

L, H, S, B = 5, 32, 64, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def param_bytes(model, trainable_only=False):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable_only)


def held_bytes(model):
    return param_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A stand-in node: /proc/meminfo with the MemAvailable given (in kB), no cgroup."""
    def make(available_kb, total_kb=64 << 20):
        meminfo = tmp_path / "meminfo"
        meminfo.write_text(f"MemTotal: {total_kb} kB\nMemFree: 1 kB\nMemAvailable: {available_kb} kB\n")
        monkeypatch.setattr(hostmem, "_MEMINFO", str(meminfo))
        monkeypatch.setattr(hostmem, "_SELF_CGROUP", str(tmp_path / "no-cgroup"))
        return available_kb * 1024

    yield make
    ckpt_offload.host_pool().set_capacity(0)


@pytest.fixture
def reset():
    ckpt_offload.reset_stats()
    yield
    ckpt_offload.host_pool().set_capacity(0)
    ckpt_offload.host_pool().empty_cache()


def test_optimizer_states_counted_before_they_exist():
    model = make_model(layers=2, hidden=H, heads=4, max_len=S)
    model.head.weight.requires_grad_(False)
    trainable = param_bytes(model, trainable_only=True)
    assert 0 < trainable < param_bytes(model)
    assert budget.optimizer_state_bytes(model, "adamw") == 2 * trainable
    assert budget.optimizer_state_bytes(model, "sgd") == 0  # transformers' "sgd": no momentum, no state
    assert budget.optimizer_state_bytes(model, Recipe(optim="sgd", momentum=0.9)) == trainable
    assert budget.optimizer_state_bytes(model, Recipe(optim="adamw", amsgrad=True)) == 3 * trainable
    assert budget.optimizer_state_bytes(model, None) == 0
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert budget.optimizer_state_bytes(model, opt) == 2 * trainable
    loss_of(model, make_batch(batch=B, seq=S)).backward()
    opt.step()  # the states now exist: nothing is still to come
    assert budget.optimizer_state_bytes(model, opt) == 0
    assert budget.optimizer_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1)) == 0
    assert budget.optimizer_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == trainable
    with pytest.raises(ValueError, match="optimizer must be one of"):
        budget.optimizer_state_bytes(model, "lion")


def test_auto_needs_a_device_or_the_stand_in(monkeypatch):
    monkeypatch.delenv(budget.TEST_DEVICE_ENV, raising=False)
    model = make_model(layers=2, hidden=H, heads=4, max_len=S)
    with pytest.raises(ValueError, match="CKPT_OFFLOAD_TEST_DEVICE_BYTES"):
        ckpt_offload.plan_memory(model, (make_batch(batch=B, seq=S),), "auto")
    monkeypatch.setenv(budget.TEST_DEVICE_ENV, "lots")
    with pytest.raises(ValueError, match="positive number of bytes, got 'lots'"):
        budget.auto_budget(model)
    monkeypatch.setenv(budget.TEST_DEVICE_ENV, "1000")
    with pytest.raises(ValueError, match="nothing is left for activations"):
        budget.auto_budget(model)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),  # as torch steps CUDA tensors by default
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
], ids=["adamw_foreach", "adamw_fused", "sgd_momentum"])
def test_the_optimizer_step_is_checked_to_fit_as_torch_allocates_it(make_opt, monkeypatch):
    # What the first step adds beyond the weights (gradients, states, the step's temporaries) is what
    # a live optimizer's budget counts: measured here through a real backward and step.
    model = make_model(layers=2, hidden=H, heads=4, max_len=S)
    opt = make_opt(list(model.parameters()))
    ids = make_batch(batch=1, seq=4)
    counted = budget.optimizer_step_bytes(model, opt)
    loss_of(model, ids).backward()
    params = list(model.parameters())
    grads_made = sum(p.grad.numel() * p.grad.element_size() for p in params)
    with LiveBytes() as live:
        live.add([*params, *(p.grad for p in params), *model.buffers()])
        held = live.current()
        opt.step()  # the first: its states are allocated, then its temporaries
    # Beyond states and temporaries, torch's CPU step keeps a 0-d step counter a parameter.
    assert counted == pytest.approx(grads_made + live.peak - held, abs=8 * len(params)), \
        (counted, grads_made, live.peak - held)
    # Gradients and states held now: the next step needs its temporaries only, measured again.
    with LiveBytes() as live:
        live.add([*params, *(p.grad for p in params), *model.buffers(),
                  *(t for st in opt.state.values() for t in st.values())])
        held = live.current()
        opt.step()
    assert budget.optimizer_step_bytes(model, opt) == pytest.approx(live.peak - held, abs=8 * len(params))
    # A device with room for the activations' budget as it was counted before (held + margin + the
    # states), but not for the step: refused, with the step named. A new model: nothing held yet.
    model = make_model(layers=2, hidden=H, heads=4, max_len=S)
    opt = make_opt(list(model.parameters()))
    assert budget.optimizer_step_bytes(model, opt) == counted
    margin_of = lambda free: int(0.05 * (held_bytes(model) + free))
    states = budget.optimizer_state_bytes(model, opt)
    free = next(f for f in range(counted, 0, -256) if f - margin_of(f) < counted)
    assert free - margin_of(free) > states  # what the budget checked before: the states alone
    monkeypatch.setenv(budget.TEST_DEVICE_ENV, str(free))
    with pytest.raises(ValueError, match="optimizer's step alone does not fit"):
        budget.auto_budget(model, optimizer=opt)
    monkeypatch.setenv(budget.TEST_DEVICE_ENV, str(4 * counted))
    a = budget.auto_budget(model, optimizer=opt)
    assert a.step_bytes == counted and "step needs" in a.describe()


def test_sharded_parameters_count_the_states_this_rank_allocates():
    # FSDP2 and tensor parallelism hold DTensor parameters: torch's AdamW allocates their states as
    # DTensors sharded alike, so a rank holds its shard's states, not the whole parameter's. Two ranks
    # of a fake process group in a child process; the states measured after a real step.
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch import nn
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from ckpt_offload.sizing import budget, recipe
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
        for m in model:
            m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
            m.bias = nn.Parameter(distribute_tensor(m.bias.detach(), mesh, [Shard(0)]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        counted = budget.optimizer_state_bytes(model, opt)
        counted_by_name = budget.optimizer_state_bytes(model, "adamw_torch")
        temps = recipe.pending_step_temp_bytes(opt)
        model(distribute_tensor(torch.randn(4, 64), mesh, [Replicate()])).to_local().sum().backward()
        opt.step()
        states = sum(t.to_local().nbytes for st in opt.state.values() for k, t in st.items() if k != "step")
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        print(counted, counted_by_name, temps, states, whole)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    counted, counted_by_name, temps, states, whole = map(int, out.stdout.split()[-5:])
    assert states == whole  # two states of half of each parameter: as many bytes as the whole weights
    assert counted == counted_by_name == states, (counted, counted_by_name, states)
    assert temps == states // 2  # foreach AdamW's one copy of the shard


def test_device_budget_is_held_plus_free_less_margin_and_optimizer(monkeypatch, node):
    available = node(8 << 20)  # 8 GiB available on the node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = make_model(layers=2, hidden=H, heads=4, max_len=S)
    free = 10 << 20
    monkeypatch.setenv(budget.TEST_DEVICE_ENV, str(free))
    a = budget.auto_budget(model, optimizer="adamw")
    held = held_bytes(model)
    assert a.allocated_bytes == held
    assert a.margin_bytes == int(0.05 * (held + free))
    assert a.optimizer_bytes == 2 * param_bytes(model)
    assert a.device_bytes == held + free - a.margin_bytes - a.optimizer_bytes
    assert a.host_bytes == int(available * 0.5) // 4
    assert a.local_world_size == 4
    line = a.describe()
    assert "4 rank(s)" in line and "margin" in line and "optimizer states" in line


def test_set_capacity_auto_is_the_nodes_share_per_rank(monkeypatch, node, reset):
    available = node(3 << 20)  # 3 GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    ckpt_offload.host_pool().set_capacity("auto")
    assert ckpt_offload.stats()["host_capacity_bytes"] == int(available * 0.5) // 8
    monkeypatch.setattr(hostmem, "_MEMINFO", "/nonexistent/meminfo")
    with pytest.raises(ValueError, match="cannot be read"):
        ckpt_offload.host_pool().set_capacity("auto")
    with pytest.raises(ValueError, match="set_capacity: bad size 'lots'"):
        ckpt_offload.host_pool().set_capacity("lots")


def test_past_the_host_budget_tensors_stay_on_the_device(monkeypatch, node, reset):
    """A node with almost nothing available: the auto cap refuses the pool's blocks, every
    offload stays on the device with one warning, and the gradients are those of plain checkpointing."""
    node(16)  # 16 kB available: a cap of 8 kB, below one block
    model = make_model(layers=L, hidden=H, heads=4, max_len=S)
    ids = make_batch(batch=B, seq=S)
    ckpt_offload.enable_checkpointing(model, offload=False)
    loss_of(model, ids).backward()
    want = grads(model)
    ckpt_offload.disable_checkpointing(model)
    model.zero_grad(set_to_none=True)

    ckpt_offload.host_pool().empty_cache()
    ckpt_offload.host_pool().set_capacity("auto")
    cap = ckpt_offload.stats()["host_capacity_bytes"]
    assert cap == 8 * 1024
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    ckpt_offload.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_of(model, ids).backward()
    ckpt_offload.synchronize()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 0
    assert s["tensors_kept_on_device"] >= L
    assert s["host_reserved_bytes"] <= cap
    assert any("refused" in str(w.message) for w in caught)
    # No layer offloaded anything: none is reported as offloaded.
    assert ckpt_offload.checkpointing_state(model) == (list(range(L)), [])
    got = grads(model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _offloaded_step(model, ids, want, empty_pool=False):
    """One training step with its warnings recorded, its gradients bitwise `want`: (stats(), warnings)."""
    model.zero_grad(set_to_none=True)
    if empty_pool:
        ckpt_offload.host_pool().empty_cache()
    ckpt_offload.reset_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_of(model, ids).backward()
    ckpt_offload.synchronize()
    got = grads(model)
    assert all(torch.equal(got[k], want[k]) for k in want)
    return ckpt_offload.stats(), caught


def test_the_auto_cap_follows_what_the_node_has_left(monkeypatch, node, reset, caplog):
    """set_capacity("auto") is a rule, not one reading: when other processes take the node's memory
    after the call, the pool pins at most this rank's share of what is left on top of what it holds
    (the rest of a longer step stays on the device, gradients unchanged); when the memory comes back
    the budget is offered again; a size in bytes ends the rule."""
    monkeypatch.setattr(ckpt_offload.engine, "FOLLOW_INTERVAL_S", 0.0)  # look at every forward
    monkeypatch.setattr(ckpt_offload.session, "_refusal_warned", False)  # the warning is once per process
    model = make_model(layers=L, hidden=H, heads=4, max_len=2 * S)
    short, long = make_batch(batch=B, seq=S), make_batch(batch=B, seq=2 * S)
    ckpt_offload.enable_checkpointing(model, offload=False)
    want = {}
    for name, ids in (("short", short), ("long", long)):
        model.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        want[name] = grads(model)
    ckpt_offload.disable_checkpointing(model)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)

    def step(ids, name):
        return _offloaded_step(model, ids, want[name])

    ckpt_offload.host_pool().empty_cache()
    budget_bytes = int(node(1 << 20) * 0.5)  # 1 GiB available, one rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ckpt_offload.host_pool().set_capacity("auto")
    s, _ = step(short, "short")
    assert s["host_capacity_bytes"] == budget_bytes
    assert s["tensors_offloaded"] >= L and s["tensors_kept_on_device"] == 0
    held = s["host_reserved_bytes"]
    assert held > 0

    node(16)  # others took the node: 16 kB left, a share of 8 kB
    with caplog.at_level(logging.INFO, logger="ckpt_offload"):
        s, caught = step(long, "long")  # twice the bytes of the short step
    assert s["host_capacity_bytes"] == held + 8 * 1024
    assert s["host_reserved_bytes"] <= held + 8 * 1024
    assert s["tensors_kept_on_device"] >= 1
    assert any("refused" in str(w.message) for w in caught)
    checkpointed, offloaded = ckpt_offload.checkpointing_state(model)
    assert checkpointed == list(range(L)) and len(offloaded) == L - s["tensors_kept_on_device"]
    assert any(f"host pool cap {budget_bytes} -> {held + 8 * 1024} bytes" in r.getMessage() for r in caplog.records)

    node(1 << 20)  # given back: the budget again, the whole long step on the host
    s, _ = step(long, "long")
    assert s["host_capacity_bytes"] == budget_bytes
    assert s["tensors_kept_on_device"] == 0 and s["tensors_offloaded"] >= L
    assert ckpt_offload.checkpointing_state(model) == (list(range(L)), list(range(L)))

    ckpt_offload.host_pool().set_capacity(budget_bytes // 2)  # bytes: the rule ends
    node(16)
    s, _ = step(long, "long")
    assert s["host_capacity_bytes"] == budget_bytes // 2


def test_the_pool_never_grows_into_the_nodes_last_memory(monkeypatch, node, reset):
    """With no cap at all, the process-wide pool refuses to grow when what the node has available,
    read at that moment, would fall below the reserve (5% of the node's memory, at least 1 GiB): the
    tensor stays on the device with the refusal warning, gradients unchanged, no layer reported as
    offloaded; once the memory is back the pool grows again. reserve() says why it cannot pin."""
    pool = ckpt_offload.host_pool()
    monkeypatch.setattr(ckpt_offload.session, "_refusal_warned", False)
    model = make_model(layers=L, hidden=H, heads=4, max_len=S)
    ids = make_batch(batch=B, seq=S)  # each block's input: 2 x 64 x 32 float32, 16 kB
    ckpt_offload.enable_checkpointing(model, offload=False)
    loss_of(model, ids).backward()
    want = grads(model)
    ckpt_offload.disable_checkpointing(model)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)

    def step():
        return _offloaded_step(model, ids, want, empty_pool=True)  # every block a new allocation, checked

    try:
        node(2 << 20, total_kb=16 << 20)  # 2 GiB available of 16 GiB
        pool.set_capacity(0)
        assert ckpt_offload.engine.guard_node(pool) == 1 << 30  # 5% of 16 GiB is less than 1 GiB
        assert pool.node_available() == 2 << 30
        s, _ = step()
        assert s["host_capacity_bytes"] == 0
        assert s["tensors_offloaded"] >= L and s["tensors_kept_on_device"] == 0 and s["host_node_refusals"] == 0

        node((1 << 20) + 8, total_kb=16 << 20)  # 8 kB above the reserve: no 16 kB block fits
        s, caught = step()
        assert s["tensors_offloaded"] == 0 and s["tensors_kept_on_device"] >= L
        assert s["host_node_refusals"] >= L and s["host_reserved_bytes"] == 0
        assert any("refused for the node's memory" in str(w.message) for w in caught)
        assert ckpt_offload.checkpointing_state(model) == (list(range(L)), [])
        own = ckpt_offload.HostPool(pinned=False)
        ckpt_offload.engine.guard_node(own)
        with pytest.raises(RuntimeError, match=r"the node has \d+ bytes available; pinning 16384 more would leave "
                                               r"less than 1073741824"):
            own.reserve([16384])

        node(2 << 20, total_kb=16 << 20)  # given back
        s, _ = step()
        assert s["tensors_kept_on_device"] == 0 and s["host_node_refusals"] == 0
        assert ckpt_offload.checkpointing_state(model) == (list(range(L)), list(range(L)))
    finally:
        monkeypatch.undo()
        ckpt_offload.engine.guard_node(pool)  # this machine's node again


def test_plan_memory_auto_fits_the_stand_in_device(monkeypatch, node, reset, caplog):
    node(8 << 20)
    model = make_model(layers=L, hidden=H, heads=4, max_len=S)
    ids = make_batch(batch=B, seq=S)
    loss_fn = lambda logits: torch.nn.functional.cross_entropy(  # noqa: E731
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    full = measured_peak(model, ids)
    model.zero_grad(set_to_none=True)
    held = held_bytes(model)
    opt = 2 * param_bytes(model)
    # A stand-in device whose budget lies below the unmodified step's peak: the plan must checkpoint.
    target = held + (full - held) * 3 // 4
    free = int((target + opt) / 0.95) - held
    monkeypatch.setenv(budget.TEST_DEVICE_ENV, str(free))
    with caplog.at_level(logging.INFO, logger="ckpt_offload"):
        plan = ckpt_offload.plan_memory(model, (ids,), "auto", loss_fn=loss_fn)
    assert plan.auto is not None and plan.budget_bytes == plan.auto.device_bytes
    assert plan.auto.device_bytes < full
    assert plan.predicted_peak_bytes <= plan.auto.device_bytes
    assert any(m != "none" for m in plan.modes)
    assert any("budget='auto'" in r.getMessage() and str(plan.modes) in r.getMessage() for r in caplog.records)
    plan.apply(model)
    assert ckpt_offload.stats()["host_capacity_bytes"] == plan.auto.host_bytes
    peak = measured_peak(model, ids)
    # The step plus the AdamW states still to come fit the stand-in device.
    assert peak + opt <= held + free, (peak, opt, held, free)


def test_trainer_callback_auto_stays_under_the_stand_in(tmp_path, monkeypatch, node, reset):
    transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
    from torch.utils.data import Dataset

    from ckpt_offload.integrations import hf

    node(8 << 20)
    seq, vocab = 48, 128

    def tiny():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        cfg._attn_implementation = "eager"
        return transformers.AutoModelForCausalLM.from_config(cfg)

    class Data(Dataset):
        # Short rows first and one of the full length: the plan must be for the longest.
        def __len__(self):
            return 8

        def __getitem__(self, i):
            n = seq if i == 5 else 16
            ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def peak_of_step(model, opt_bytes):
        ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(99))
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=False)
        ckpt_offload.synchronize()
        with LiveBytes() as live:
            live.add([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(), ids])
            model(input_ids=ids, labels=ids).loss.backward()
        return live.peak

    probe = tiny()
    probe.train()
    held = held_bytes(probe)
    full = peak_of_step(probe, 0)
    opt = 2 * param_bytes(probe)
    free = int((held + (full - held) * 3 // 4 + opt) / 0.95) - held
    monkeypatch.setenv(budget.TEST_DEVICE_ENV, str(free))

    callback = hf.OffloadCallback(budget="auto")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1, learning_rate=1e-3,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, logging_steps=1,
    )
    model = tiny()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[callback])
    trainer.train()
    plan = callback.plan
    assert plan is not None and plan.auto.source == budget.TEST_DEVICE_ENV
    # The Trainer's AdamW was counted before its first step made the states.
    assert plan.auto.optimizer_bytes == opt
    assert any(m != "none" for m in plan.modes), plan.modes  # the unmodified step would not fit
    assert callback.checkpointed == [i for i, m in enumerate(plan.modes) if m.startswith("checkpoint")]
    # The configured model's step at the longest length, plus the optimizer's states, fits the stand-in.
    peak = peak_of_step(model, opt)
    assert peak + opt <= held + free, (peak, opt, held, free)
    assert all(h["loss"] == h["loss"] for h in trainer.state.log_history if "loss" in h)


def test_callback_auto_plans_for_the_longest_batch_it_can_know(monkeypatch):
    # OffloadCallback(budget="auto") plans at the longest length of the run: its own max_length, then
    # the training arguments' max_length (TRL) or max_seq_length (older TRL), then the dataset's rows.
    pytest.importorskip("transformers", reason="transformers is an optional dependency")
    from types import SimpleNamespace

    from ckpt_offload.integrations.hf import OffloadCallback

    rows = SimpleNamespace(dataset=[{"input_ids": [1] * n} for n in (5, 17, 9)])
    assert OffloadCallback(budget="auto", max_length=300)._longest(SimpleNamespace(max_length=200), rows) == 300
    cb = OffloadCallback(budget="auto")
    assert cb._longest(SimpleNamespace(max_length=200, max_seq_length=100), rows) == 200
    assert cb._longest(SimpleNamespace(max_length=None, max_seq_length=100), rows) == 100
    assert cb._longest(SimpleNamespace(), rows) == 17
    with pytest.raises(ValueError, match=r"longest batch of the run is unknown.*max_length=N"):
        cb._longest(SimpleNamespace(), SimpleNamespace(dataset=[{"text": "no ids"}]))
    datasets = pytest.importorskip("datasets", reason="datasets comes with trl")
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (5, 40, 9, 12)]})
    assert cb._longest(SimpleNamespace(), SimpleNamespace(dataset=ds)) == 40  # off the Arrow table
    picked = ds.select([0, 2, 3])  # a selection of the table's rows: only those count
    assert cb._longest(SimpleNamespace(), SimpleNamespace(dataset=picked)) == 12
    from ckpt_offload.integrations.hf import _arrow_longest

    assert _arrow_longest(ds) == 40 and _arrow_longest(picked) is None  # the table read whole only when it is the rows


def test_callback_refuses_a_budget_in_bytes():
    from ckpt_offload.integrations import hf

    with pytest.raises(ValueError, match="budget must be None or 'auto'"):
        hf.OffloadCallback(budget=1 << 30)


def test_trl_route_auto_caps_the_pool_when_a_trainer_takes_it(monkeypatch, node, reset):
    pytest.importorskip("trl", reason="trl is an optional dependency")
    import trl.models

    from ckpt_offload.integrations import trl as ctrl

    available = node(6 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="budget must be None or 'auto'"):
        ctrl.install(budget="half")
    assert not ctrl.installed()
    ctrl.install(budget="auto")
    try:
        assert ckpt_offload.stats()["host_capacity_bytes"] == 0  # nothing until a trainer takes the route
        ctx = trl.models.get_act_offloading_ctx_manager(make_model(layers=2, hidden=H, heads=4, max_len=S),
                                                        warn_if_no_head=False)
        assert ckpt_offload.stats()["host_capacity_bytes"] == int(available * 0.5) // 2
        assert ctx is not None
    finally:
        ctrl.install()  # the default settings back for the tests that follow
        ctrl.uninstall()


def test_accelerate_route_auto_caps_the_pool_when_prepare_takes_it(monkeypatch, node, reset):
    transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
    pytest.importorskip("accelerate", reason="accelerate is an optional dependency")
    import types

    import accelerate.utils.fsdp_utils
    from accelerate import FullyShardedDataParallelPlugin

    from ckpt_offload.integrations import accelerate as cacc

    available = node(6 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="budget must be None or 'auto'"):
        cacc.install(budget=1 << 30)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            activation_checkpointing=True, activation_checkpointing_offload=True)
    plugin.set_auto_wrap_policy(model)
    cacc.install(budget="auto")
    try:
        accelerate.utils.fsdp_utils.fsdp2_apply_ac(types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)),
                                                   model)
        assert ckpt_offload.stats()["host_capacity_bytes"] == int(available * 0.5) // 4
        assert ckpt_offload.checkpointing_state(model)[1] == [0]  # keep_last=1 of 2 layers
    finally:
        ckpt_offload.disable_checkpointing(model)
        cacc.install()
        cacc.uninstall()
