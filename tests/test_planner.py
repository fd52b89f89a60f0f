"""plan_memory on a small stack, CPU test path: plans across the feasible budgets fit, their predicted
peak is the measured one (LiveBytes, weights, gradients and inputs counted), gradients are unchanged,
and the search is never predicted slower than the best uniform configuration that fits."""
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_offload
from ckpt_offload.planner import CostModel, MemoryPlan, plan_from_cost, uniform_configs
from ckpt_offload.testing import LiveBytes
from conftest import requires_cuda
from tiny_gpt import grads, loss_of, make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu")

L, H, S, B = 5, 32, 64, 2


def loss_fn_for(ids):
    return lambda logits: torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def measured_peak(model, ids):
    """Peak live bytes of one step, weights, gradients, buffers and inputs counted (the budget's measure)."""
    loss_of(model, ids).backward()  # warm-up: gradients allocated, pool filled, midpoints learned
    model.zero_grad(set_to_none=False)
    ckpt_offload.synchronize()
    with LiveBytes() as live:
        live.add([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(), ids])
        loss_of(model, ids).backward()
    return live.peak


def step_grads(model, ids):
    model.zero_grad(set_to_none=False)
    loss_of(model, ids).backward()
    return grads(model)


@pytest.fixture(scope="module")
def profiled():
    """One plan_memory call with a budget above the unmodified peak (profiles every mode once)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
        model = make_model(layers=L, hidden=H, heads=4, max_len=S)
        ids = make_batch(batch=B, seq=S)
        full_peak = measured_peak(model, ids)
        reference = step_grads(model, ids)
        plan = ckpt_offload.plan_memory(model, (ids,), full_peak + 1, loss_fn=loss_fn_for(ids))
        yield model, ids, full_peak, reference, plan


def smallest_peak(cost):
    return min(cost.peak(list(m)) for m in __import__("itertools").product(cost.modes, repeat=cost.n))


def budgets(cost, full_peak, k=6):
    lo = smallest_peak(cost)
    return [int(lo + (full_peak - lo) * j / (k - 1)) for j in range(k)]


def test_a_budget_above_the_unmodified_peak_keeps_every_block(profiled):
    model, ids, full_peak, _, plan = profiled
    assert plan.modes == ["none"] * L
    assert plan.predicted_peak_bytes == pytest.approx(full_peak, rel=0.01)
    assert plan.predicted_host_bytes == 0
    assert ckpt_offload.checkpointing_state(model) is None  # profiling left the model as it was


def test_plans_across_the_feasible_range_fit_and_predict_the_measured_peak(profiled):
    model, ids, full_peak, reference, plan0 = profiled
    cost = plan0.cost_model
    seen = set()
    for budget in budgets(cost, full_peak):
        plan = plan_from_cost(cost, budget)
        seen.add(tuple(plan.modes))
        plan.apply(model)
        try:
            peak = measured_peak(model, ids)
            ckpt_offload.reset_stats()
            got = step_grads(model, ids)
            host = ckpt_offload.stats()["bytes_offloaded"]
        finally:
            ckpt_offload.disable_checkpointing(model)
        print(f"budget {budget} plan {plan.modes} predicted {plan.predicted_peak_bytes} measured {peak} "
              f"({(plan.predicted_peak_bytes - peak) / peak:+.2%})")
        assert abs(plan.predicted_peak_bytes - peak) <= 0.10 * peak, (budget, plan.modes)
        assert peak <= 1.05 * budget, (budget, plan.modes, peak)
        assert plan.predicted_peak_bytes <= budget
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference), plan.modes
        assert host == plan.predicted_host_bytes  # the last step sent exactly the predicted bytes
    assert len(seen) >= 4  # the range really spans different plans


def test_every_assignment_predicts_the_measured_peak_within_ten_percent(profiled):
    # Not only the chosen plans: mixed assignments whose reloads cross other blocks.
    model, ids, _, _, plan0 = profiled
    cost = plan0.cost_model
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        modes = [cost.modes[int(i)] for i in torch.randint(0, len(cost.modes), (L,), generator=g)]
        ckpt_offload.enable_block_modes(model, modes)
        try:
            peak = measured_peak(model, ids)
        finally:
            ckpt_offload.disable_checkpointing(model)
        assert abs(cost.peak(modes) - peak) <= 0.10 * peak, modes


def test_a_budget_below_the_minimum_names_it(profiled):
    _, _, _, _, plan0 = profiled
    cost = plan0.cost_model
    lo = smallest_peak(cost)
    with pytest.raises(ValueError, match=f"smallest feasible budget is {lo} bytes"):
        plan_from_cost(cost, lo - 1)
    assert plan_from_cost(cost, lo).predicted_peak_bytes == lo


def test_a_host_budget_limits_what_goes_to_the_host(profiled):
    _, _, full_peak, _, plan0 = profiled
    cost = plan0.cost_model
    lo = smallest_peak(cost)
    assert plan_from_cost(cost, lo).predicted_host_bytes > 0  # the smallest peak needs the host
    for budget in budgets(cost, full_peak)[1:]:
        unlimited = plan_from_cost(cost, budget)
        if unlimited.predicted_host_bytes == 0:
            continue
        cap = unlimited.predicted_host_bytes // 2
        capped = plan_from_cost(cost, budget, host_budget_bytes=cap)
        assert capped.predicted_host_bytes <= cap and capped.predicted_peak_bytes <= budget
        assert capped.predicted_step_ms >= unlimited.predicted_step_ms
    no_host = min(cost.peak(list(m)) for m in __import__("itertools").product(["none", "checkpoint"], repeat=cost.n))
    with pytest.raises(ValueError, match=f"smallest feasible budget is {no_host} bytes"):
        plan_from_cost(cost, lo, host_budget_bytes=1)


def test_plan_memory_itself_raises_below_the_minimum():
    model = make_model(layers=3, hidden=16, heads=2, max_len=16)
    ids = make_batch(batch=1, seq=16)
    with pytest.raises(ValueError, match=r"plan_memory: nothing fits budget_bytes=1000; the smallest feasible budget is \d+ bytes"):
        ckpt_offload.plan_memory(model, (ids,), 1000, modes=["none", "checkpoint"])
    assert ckpt_offload.checkpointing_state(model) is None


def test_never_predicted_slower_than_the_best_uniform_configuration_that_fits(profiled):
    _, _, full_peak, _, plan0 = profiled
    cost = plan0.cost_model
    _check_against_uniform(cost, budgets(cost, full_peak, k=9))


def test_the_local_search_on_many_blocks_is_never_slower_than_uniform(profiled):
    # 16 blocks: 4**16 assignments, past the exhaustive limit. The measured figures of block 1 (not
    # the first, whose input has no block below) repeated make a model of a deeper stack.
    cost = profiled[4].cost_model
    n = 16
    d = cost.to_dict()
    d["n"] = n
    for key in ("kept", "bwd_excess", "fwd_excess", "host", "fwd_ms", "bwd_ms"):
        d[key] = {m: [v[1]] * n for m, v in d[key].items()}
    o = dict(d["outside"])
    extra = (n - cost.n) * cost.kept["none"][1]
    o["kept_none"] += extra
    o["fwd_head_peak"] += extra
    o["bwd_head_peak"] += extra
    d["outside"] = o
    deep = CostModel(**d)
    full = deep.peak(["none"] * n)
    lo = min(deep.peak(v) for v in uniform_configs(n).values())
    _check_against_uniform(deep, [int(lo + (full - lo) * j / 6) for j in range(7)])


def fixed_times(fields):
    """A cost model's fields with its times replaced by fixed ones, different per block: forward
    0.4 + 0.1 i ms, backward 0.5 + 0.1 i, plus the forward again for a checkpointed block's
    recompute; copies at 0.01 GB/s, as slow as the compute here (the blocks' inputs are tens of KB)."""
    n = fields["n"]
    fwd = [0.4 + 0.1 * i for i in range(n)]
    bwd = [0.5 + 0.1 * i for i in range(n)]
    fields = dict(fields, d2h_gb_per_s=0.01, h2d_gb_per_s=0.01)
    fields["fwd_ms"] = {m: list(fwd) for m in fields["modes"]}
    fields["bwd_ms"] = {m: [b + (f if m.startswith("checkpoint") else 0.0) for f, b in zip(fwd, bwd)]
                        for m in fields["modes"]}
    fields["outside"] = {k: (0.3 if k.endswith("_ms") else v) for k, v in fields["outside"].items()}
    return fields


def test_the_local_search_finds_what_the_exhaustive_one_finds(profiled, monkeypatch):
    import ckpt_offload.planner as planner

    _, _, full_peak, _, plan0 = profiled
    # The measured bytes, with times of fixed values instead of measured ones: the local search is
    # a heuristic, and on a busy machine a profile can time one block at ten times the others.
    cost = CostModel(**fixed_times(plan0.cost_model.to_dict()))
    for budget in budgets(cost, full_peak, k=11):
        exact = plan_from_cost(cost, budget)
        monkeypatch.setattr(planner, "_EXHAUSTIVE_LIMIT", 0)
        local = plan_from_cost(cost, budget)
        monkeypatch.setattr(planner, "_EXHAUSTIVE_LIMIT", 1 << 14)
        assert local.predicted_step_ms == pytest.approx(exact.predicted_step_ms, rel=1e-12), (budget, exact.modes, local.modes)
        assert local.predicted_peak_bytes <= budget


def _check_against_uniform(cost, budget_list):
    compared = 0
    for budget in budget_list:
        plan = plan_from_cost(cost, budget)
        for name, modes in uniform_configs(cost.n).items():
            peak, ms, _ = cost.predict(modes)
            if peak <= budget:
                compared += 1
                assert plan.predicted_step_ms <= ms + 1e-9, (budget, name, plan.modes)
    assert compared >= len(budget_list)


def test_uniform_configurations_are_what_enable_checkpointing_sets(profiled):
    model, ids, _, _, _ = profiled
    for every, off in ((1, True), (2, False)):
        ckpt_offload.enable_checkpointing(model, every_n_layers=every, offload=off, keep_last=1)
        a = measured_peak(model, ids)
        ckpt_offload.disable_checkpointing(model)
        ckpt_offload.enable_block_modes(model, uniform_configs(L)[f"every{every}" + ("_offload" if off else "")])
        b = measured_peak(model, ids)
        ckpt_offload.disable_checkpointing(model)
        assert a == b


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_offload_mode_recomputes_nothing_and_sends_every_saved_activation():
    model = make_model(layers=4, hidden=32, heads=4, max_len=32)
    ids = make_batch(batch=2, seq=32)
    counts = {}
    for modes in (["none"] * 4, ["offload"] * 4, ["checkpoint"] * 4):
        ckpt_offload.enable_block_modes(model, modes)
        loss_of(model, ids).backward()
        ckpt_offload.reset_stats()
        with _CountMatmuls() as c:
            loss_of(model, ids).backward()
        counts[modes[0]] = c.n
        s = ckpt_offload.stats()
        ckpt_offload.disable_checkpointing(model)
        if modes[0] == "offload":
            # Every activation the blocks save goes (their inputs too), and comes back before use.
            assert s["tensors_offloaded"] >= 4 * 8 and s["bytes_offloaded"] > 4 * 2 * 32 * 32 * 4 * 8
            assert s["bytes_prefetched"] + s["reloads_on_demand"] > 0 and s["host_in_use_bytes"] == 0
    assert counts["offload"] == counts["none"] < counts["checkpoint"]


class _CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_the_attention_mode_offloads_attention_outputs_instead_of_recomputing_them():
    model = make_model(layers=4, hidden=32, heads=4, max_len=32)
    ids = make_batch(batch=2, seq=32)
    reference = step_grads(model, ids)
    seen = {}
    for mode in ("checkpoint+offload", "checkpoint+offload+attention"):
        ckpt_offload.enable_block_modes(model, [mode] * 4)
        loss_of(model, ids).backward()
        ckpt_offload.reset_stats()
        with _CountAttention() as c:
            got = step_grads(model, ids)
        seen[mode] = (c.n, ckpt_offload.stats()["bytes_offloaded"])
        ckpt_offload.disable_checkpointing(model)
        assert all(torch.equal(got[k], reference[k]) for k in reference), mode
    assert seen["checkpoint+offload"][0] == 8 and seen["checkpoint+offload+attention"][0] == 4  # 4 recomputed
    # Beside each block's input (2 x 32 x 32 fp32), its attention output and logsumexp went to the host.
    assert seen["checkpoint+offload"][1] == 4 * 2 * 32 * 32 * 4
    assert seen["checkpoint+offload+attention"][1] >= seen["checkpoint+offload"][1] + 4 * 2 * 32 * 32 * 4


def test_apply_is_undone_by_disable_checkpointing(profiled):
    model, _, _, _, plan0 = profiled
    plan = MemoryPlan(["offload", "checkpoint+offload", "checkpoint", "none", "checkpoint+offload+attention"], 1, 1.0, 1)
    assert plan.apply(model) == plan.modes
    assert ckpt_offload.checkpointing_state(model) == ([1, 2, 4], [0, 1, 4])
    assert all(ckpt_offload.attachment.SLOT in b.__dict__ for i, b in enumerate(model.blocks) if i != 3)
    ckpt_offload.disable_checkpointing(model)
    assert ckpt_offload.checkpointing_state(model) is None
    assert all(type(b) is ckpt_offload.attachment.base_class(type(b)) and ckpt_offload.attachment.SLOT not in b.__dict__ for b in model.blocks)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in model.blocks)


def test_json_round_trip_and_table(profiled):
    _, _, full_peak, _, plan0 = profiled
    plan = plan_from_cost(plan0.cost_model, budgets(plan0.cost_model, full_peak)[2])
    back = MemoryPlan.from_json(plan.to_json())
    assert (back.modes, back.predicted_peak_bytes, back.predicted_step_ms, back.predicted_host_bytes) == (
        plan.modes, plan.predicted_peak_bytes, plan.predicted_step_ms, plan.predicted_host_bytes)
    assert back.table() == plan.table()
    lines = plan.table().splitlines()
    assert len(lines) == L + 2 and all(m in line for m, line in zip(plan.modes, lines[1:]))
    bad = json.loads(plan.to_json())
    bad["modes"][0] = "fast"
    with pytest.raises(ValueError, match=r"MemoryPlan.from_json: modes\[0\] is 'fast'"):
        MemoryPlan.from_json(json.dumps(bad))


def test_argument_errors():
    model = make_model(layers=2, hidden=16, heads=2, max_len=16)
    ids = make_batch(batch=1, seq=16)
    with pytest.raises(TypeError, match="plan_memory: example_inputs must be a tuple"):
        ckpt_offload.plan_memory(model, ids, 1 << 20)
    with pytest.raises(TypeError, match="plan_memory: budget_bytes must be an int"):
        ckpt_offload.plan_memory(model, (ids,), True)
    with pytest.raises(ValueError, match="plan_memory: host_budget_bytes must be positive"):
        ckpt_offload.plan_memory(model, (ids,), 1 << 20, host_budget_bytes=0)
    with pytest.raises(ValueError, match="plan_memory: modes must be"):
        ckpt_offload.plan_memory(model, (ids,), 1 << 20, modes=["keep"])
    with pytest.raises(ValueError, match="enable_block_modes: 1 modes for 2 repeated blocks"):
        ckpt_offload.enable_block_modes(model, ["none"])
    with pytest.raises(ValueError, match=r"enable_block_modes: modes\[1\] is 'x'"):
        ckpt_offload.enable_block_modes(model, ["none", "x"])


def test_hf_enable_with_a_budget_plans_applies_and_keeps_gradients():
    transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
    from ckpt_offload.integrations import hf

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    ids = make_batch(batch=2, seq=32, vocab=128)

    def hf_peak():
        model(ids).logits.float().square().mean().backward()
        model.zero_grad(set_to_none=False)
        with LiveBytes() as live:
            live.add([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(), ids])
            model(ids).logits.float().square().mean().backward()
        return live.peak

    full = hf_peak()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    roomy = ckpt_offload.plan_memory(model, (ids,), full + 1)  # default loss: the mean of the squared logits
    assert roomy.modes == ["none"] * 4
    budget = (roomy.predicted_peak_bytes + roomy.smallest_peak_bytes) // 2
    plan = hf.enable(model, budget_bytes=budget, example_inputs=(ids,))
    assert isinstance(plan, ckpt_offload.MemoryPlan) and plan.modes != ["none"] * 4
    assert ckpt_offload.attachment.ATTR in model.__dict__
    peak = hf_peak()
    assert abs(plan.predicted_peak_bytes - peak) <= 0.10 * peak and peak <= 1.05 * budget, (plan.modes, peak)
    assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters()), plan.modes
    hf.disable(model)
    layers = ckpt_offload.find_repeated_blocks(model)
    assert ckpt_offload.checkpointing_state(model) is None
    assert all("gradient_checkpointing" not in m.__dict__ or not m.gradient_checkpointing for m in layers)
    with pytest.raises(TypeError, match="hf.enable: budget_bytes needs example_inputs"):
        hf.enable(model, budget_bytes=budget)


@requires_cuda
@pytest.mark.gpu
def test_cuda_plans_fit_and_predict_the_measured_peak():
    dev = "cuda"
    model = make_model(layers=6, hidden=256, heads=4, max_len=512, device=dev)
    ids = make_batch(batch=4, seq=512, device=dev)
    loss_fn = loss_fn_for(ids)

    def cuda_peak():
        loss_of(model, ids).backward()
        model.zero_grad(set_to_none=False)
        ckpt_offload.synchronize()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss_of(model, ids).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    full = cuda_peak()
    reference = [p.grad.clone() for p in model.parameters()]
    roomy = ckpt_offload.plan_memory(model, (ids,), full + (1 << 20), loss_fn=loss_fn)
    assert roomy.modes == ["none"] * 6
    lo = roomy.smallest_peak_bytes
    for budget in [int(lo + (full - lo) * j / 4) for j in range(5)]:
        plan = roomy.replan(budget)
        plan.apply(model)
        try:
            peak = cuda_peak()
        finally:
            ckpt_offload.disable_checkpointing(model)
        print(f"cuda budget {budget} plan {plan.modes} predicted {plan.predicted_peak_bytes} measured {peak}")
        assert abs(plan.predicted_peak_bytes - peak) <= 0.10 * peak, (budget, plan.modes, peak)
        assert peak <= 1.05 * budget, (budget, plan.modes, peak)
        assert all(torch.allclose(p.grad, r, rtol=1e-5, atol=1e-6) for p, r in zip(model.parameters(), reference))


def test_bench_step_budget_runs_the_plan_beside_the_uniform_configurations(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("CKPT_OFFLOAD_TEST_CPU", None)  # the script sets it itself on the CPU

    def run(out, *args):
        p = subprocess.run([sys.executable, "benchmarks/bench_step.py", "--config", "small", "--out", str(tmp_path / out),
                            *args], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p, json.load(open(tmp_path / out / "bench_step.json"))

    def peak(r):
        return r["live_peak_bytes"] + r["base_bytes"]

    _, first = run("uniform", "--modes", "async_offload,every2", "--lengths", "off")
    by = {r["mode"]: r for r in first["rows"]}
    budget = (peak(by["async_offload"]) + peak(by["every2"])) // 2  # as scripts/gpu_check.sh chooses it
    p, result = run("planned", "--modes", "none,full,every2,every4,async_offload,every2_async", "--budget", str(budget),
                    "--lengths", "off")
    assert result["problems"] == []
    planned = next(r for r in result["rows"] if r["mode"] == "planned")
    assert len(planned["plan_modes"]) == 4 and planned["predicted_peak_bytes"] <= budget
    assert abs(planned["predicted_peak_bytes"] - peak(planned)) <= 0.10 * peak(planned)
    assert peak(planned) <= 1.05 * budget
    (entry,) = result["budget"]
    fitting = {r["mode"]: r["step_ms_median"] for r in result["rows"] if r["mode"] != "planned" and peak(r) <= budget}
    assert entry["fastest_uniform"] == min(fitting, key=fitting.get) and "every2" not in fitting
    assert entry["met"] is None and entry["note"] == "CPU run: judged on a GPU"
    assert "--budget: the planned configuration" in p.stdout and "plan for" in p.stdout
