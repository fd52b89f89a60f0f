"""ckpt_offload.policies: what a torch SAC policy marks *_CPU_OFFLOAD goes through the engine and is not
recomputed (a TorchDispatchMode counts), with gradients bitwise torch SAC's with MUST_SAVE and exactly
the marked bytes moved and freed; no FutureWarning; the "attention" policy on SDPA blocks and a Llama."""
import functools
import gc
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import ckpt_offload
from ckpt_offload import policies
from ckpt_offload.testing import LiveBytes
from conftest import DEVICES, requires_cuda
from tiny_gpt import grads, loss_of, make_batch, make_model

pytestmark = [
    pytest.mark.usefixtures("test_cpu"),
    # An older torch (the feature is checked, not the version) gets policies.require's error instead.
    pytest.mark.skipif(not policies.HAS_OFFLOAD_POLICY,
                       reason=f"torch {torch.__version__} has no CheckpointPolicy.MUST_CPU_OFFLOAD"),
]

N = 64
MARKED_BYTES = N * N * 4  # the output of the one marked op (sin), float32
SIN = torch.ops.aten.sin.default
TANH = torch.ops.aten.tanh.default


class OpCount(TorchDispatchMode):
    """How many times each op ran while active."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def fn(x, w):
    # sin's output is saved by the second matmul, tanh's by its own backward and the product.
    return torch.tanh(torch.sin(x @ w) @ w) * x


def policy_marking(sin_policy, tanh_policy=CheckpointPolicy.PREFER_RECOMPUTE):
    def policy(ctx, op, *args, **kwargs):
        if op is SIN:
            return sin_policy
        if op is TANH:
            return tanh_policy
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac(policy):
    return functools.partial(create_selective_checkpoint_contexts, policy)


def inputs(device):
    torch.manual_seed(0)
    x = torch.randn(N, N, device=device, requires_grad=True)
    w = torch.randn(N, N, device=device, requires_grad=True)
    return x, w


def backward_counting(out):
    with OpCount() as count:
        out.sum().backward()
    return count.calls


def run_torch(policy, device):
    x, w = inputs(device)
    out = tuc.checkpoint(fn, x, w, use_reentrant=False, context_fn=sac(policy))
    calls = backward_counting(out)
    return out.detach(), [x.grad, w.grad], calls


def run_ours(policy, device, **kw):
    x, w = inputs(device)
    ckpt_offload.reset_stats()
    out = ckpt_offload.checkpoint(fn, x, w, context_fn=sac(policy), session=ckpt_offload.OffloadSession(), **kw)
    forward = ckpt_offload.stats()
    calls = backward_counting(out)
    return out.detach(), [x.grad, w.grad], calls, forward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mark", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_offload_policy_output_is_saved_through_the_engine_not_recomputed(device, mark):
    """PITFALLS 17: an op a policy marks for offload is saved through the engine and does not run again in
    backward (counted with a dispatch mode). Fails where the marked op is silently recomputed."""
    offload = getattr(CheckpointPolicy, mark)
    out, got, calls, fwd = run_ours(policy_marking(offload), device)
    # The reference: torch SAC with MUST_SAVE in place of the offload policy.
    ref_out, ref, ref_calls, = run_torch(policy_marking(CheckpointPolicy.MUST_SAVE), device)
    assert torch.equal(out, ref_out)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert calls.get(SIN, 0) == 0 and ref_calls.get(SIN, 0) == 0
    # Inputs and the marked output went through the engine, and came back.
    assert fwd["tensors_offloaded"] == 3 and fwd["bytes_offloaded"] == 2 * MARKED_BYTES + MARKED_BYTES
    s = ckpt_offload.stats()
    assert s["tensors_fetched"] == 3 and s["host_in_use_bytes"] == 0


def test_torch_eager_recomputes_what_an_offload_policy_marks_and_we_do_not():
    """PITFALLS 17: torch's eager selective checkpoint recomputes an op marked MUST_CPU_OFFLOAD; ckpt_offload
    does not. Fails where the offload policy falls through to torch's recompute."""
    # What the counter catches: torch 2.14's own eager SAC runs sin again in backward.
    *_, torch_calls = run_torch(policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD), "cpu")
    assert torch_calls.get(SIN, 0) == 1
    *_, calls, _ = run_ours(policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD), "cpu")
    assert calls.get(SIN, 0) == 0


def test_save_stays_on_the_device_and_recompute_runs_again():
    _, _, calls, fwd = run_ours(policy_marking(CheckpointPolicy.MUST_SAVE), "cpu")
    assert calls.get(SIN, 0) == 0 and fwd["bytes_offloaded"] == 2 * MARKED_BYTES  # the inputs only
    _, _, calls, fwd = run_ours(policy_marking(CheckpointPolicy.PREFER_RECOMPUTE), "cpu")
    assert calls.get(SIN, 0) == 1 and fwd["bytes_offloaded"] == 2 * MARKED_BYTES
    # Both kinds in one region: only the offload policy's output moves.
    out, got, calls, fwd = run_ours(
        policy_marking(CheckpointPolicy.MUST_SAVE, tanh_policy=CheckpointPolicy.PREFER_CPU_OFFLOAD), "cpu")
    assert calls.get(SIN, 0) == 0 and calls.get(TANH, 0) == 0
    assert fwd["bytes_offloaded"] == 3 * MARKED_BYTES  # inputs + tanh's output
    ref_out, ref, _ = run_torch(policy_marking(CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_SAVE), "cpu")
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_marked_views_are_saved_on_the_device():
    # A view returns its input's memory: a copy would free nothing. (In-place ops alias too; like
    # torch's MUST_SAVE, saving one is an error at backward, since autograd bumps its version after.)
    def viewing(x, w):
        return torch.sin(x @ w).t() @ w

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.t.default:
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.PREFER_RECOMPUTE

    x, w = inputs("cpu")
    out = ckpt_offload.checkpoint(viewing, x, w, context_fn=sac(policy), session=ckpt_offload.OffloadSession())
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * MARKED_BYTES  # the inputs only
    out.sum().backward()
    got = [x.grad, w.grad]
    x, w = inputs("cpu")
    tuc.checkpoint(viewing, x, w, use_reentrant=False, context_fn=sac(lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
                   ).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


def live_after_forward(policy):
    x, w = inputs("cpu")
    with LiveBytes() as live:
        live.add([x, w])
        base = live.current()
        out = ckpt_offload.checkpoint(fn, x, w, context_fn=sac(policy), session=ckpt_offload.OffloadSession())
        ckpt_offload.synchronize()  # copies done, sources dropped
        held = live.current() - base
    out.sum().backward()
    return held


def test_device_bytes_after_forward_drop_by_exactly_the_offloaded_outputs():
    saved = live_after_forward(policy_marking(CheckpointPolicy.MUST_SAVE))
    offloaded = live_after_forward(policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD))
    recomputed = live_after_forward(policy_marking(CheckpointPolicy.PREFER_RECOMPUTE))
    assert saved - offloaded == MARKED_BYTES
    assert offloaded == recomputed == MARKED_BYTES  # only the output itself is left


def test_no_future_warning_and_no_silent_bypass():
    x, w = inputs("cpu")
    policy = policy_marking(CheckpointPolicy.MUST_SAVE)
    if policies.HAS_RESPECT:
        # What a user saw before: torch 2.14 warns when SAC runs under ckpt_offload's hooks.
        with ckpt_offload.OffloadSession().hooks(), pytest.warns(FutureWarning, match="saved_tensors_hooks"):
            tuc.checkpoint(fn, x, w, use_reentrant=False, context_fn=sac(policy))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ckpt_offload.checkpoint(fn, x, w, context_fn=sac(policy))
        out.sum().backward()
        # A context_fn that is not selective checkpointing runs as given, without the warning too.
        ckpt_offload.checkpoint(fn, x, w, context_fn=lambda: (OpCount(), OpCount())).sum().backward()


def test_respect_saved_tensors_hooks_sends_saved_outputs_to_the_host_too():
    _, got, calls, fwd = run_ours(policy_marking(CheckpointPolicy.MUST_SAVE), "cpu", respect_saved_tensors_hooks=True)
    assert calls.get(SIN, 0) == 0 and fwd["bytes_offloaded"] == 3 * MARKED_BYTES
    _, ref, _ = run_torch(policy_marking(CheckpointPolicy.MUST_SAVE), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks must be True, False or None"):
        ckpt_offload.checkpoint(fn, *inputs("cpu"), respect_saved_tensors_hooks="yes")


def test_a_subclass_of_torch_mode_refuses_offload_instead_of_recomputing():
    class Caching(tuc._CachingTorchDispatchMode):
        pass

    def context_fn():
        fwd, bwd = create_selective_checkpoint_contexts(policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD))
        return Caching(fwd.policy_fn, fwd.storage), bwd

    with pytest.raises(ValueError, match="would recompute it"):
        ckpt_offload.checkpoint(fn, *inputs("cpu"), context_fn=context_fn)


def test_offload_false_keeps_the_marked_output_saved_on_the_device():
    x, w = inputs("cpu")
    out = ckpt_offload.checkpoint(fn, x, w, offload=False, context_fn=sac(policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD)))
    assert backward_counting(out).get(SIN, 0) == 0
    assert ckpt_offload.stats()["bytes_offloaded"] == 0


def test_gradient_accumulation_matches_torch_sac():
    def accumulate(run):
        x, w = inputs("cpu")
        for k in range(3):
            run(x * (k + 1), w).sum().backward()  # a non-leaf input, offloaded like any other
        return x.grad, w.grad

    policy = policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD)
    session = ckpt_offload.OffloadSession()
    got = accumulate(lambda a, b: ckpt_offload.checkpoint(fn, a, b, context_fn=sac(policy), session=session))
    ref = accumulate(lambda a, b: tuc.checkpoint(fn, a, b, use_reentrant=False,
                                                 context_fn=sac(policy_marking(CheckpointPolicy.MUST_SAVE))))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == 3 * 3 * MARKED_BYTES and s["host_in_use_bytes"] == 0


def test_hundred_steps_no_leak_and_forward_without_backward_frees_the_host():
    """PITFALLS 22: a hundred steps under a policy leak nothing, and a forward without backward frees its
    host blocks. Fails on per-step growth."""
    pool = ckpt_offload.host_pool()
    policy = policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD)
    session = ckpt_offload.OffloadSession()
    x, w = inputs("cpu")
    after_first = None
    for step in range(100):
        out = ckpt_offload.checkpoint(fn, x, w, context_fn=sac(policy), session=session)
        if step % 10 == 9:
            del out  # the graph dies without backward: its host blocks go back
        else:
            out.sum().backward()
            del out
        assert pool.stats()["in_use_bytes"] == 0, step
        if step == 0:
            gc.collect()
            after_first = (pool.stats()["reserved_bytes"], pool.stats()["alloc_calls"], len(gc.get_objects()))
    gc.collect()
    reserved, allocs, objects = pool.stats()["reserved_bytes"], pool.stats()["alloc_calls"], len(gc.get_objects())
    assert (reserved, allocs) == after_first[:2]  # no host allocation after the first step
    assert objects - after_first[2] < 500


def test_modified_saved_output_and_second_backward_are_errors():
    x, w = inputs("cpu")

    def writes_after(a, b):
        y = torch.sin(a @ b)
        out = y @ b
        y.mul_(2)  # the saved output changes after the policy saved it
        return out

    # Saved on the device: torch SAC's own wording; offloaded: autograd's in-place error, as unpack redoes it.
    for mark, message in ((CheckpointPolicy.MUST_SAVE, "has been mutated"),
                          (CheckpointPolicy.MUST_CPU_OFFLOAD, "modified by an inplace operation")):
        out = ckpt_offload.checkpoint(writes_after, x, w, context_fn=sac(policy_marking(mark)))
        with pytest.raises(RuntimeError, match=message):
            out.sum().backward()
    out = ckpt_offload.checkpoint(fn, x, w, context_fn=sac(policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD)))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="Trying to backward an extra time"):
        out.sum().backward()


def test_a_recompute_that_runs_other_ops_than_the_forward_is_an_error_in_torch_words():
    # torch's SAC says "not found in storage" (its own tests match on it); ours says which op, which
    # call of it, and how often each pass ran it. Both under ckpt_offload's modes and offloading.
    x, w = inputs("cpu")
    policy = policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD)
    for extra, message in ((torch.exp, "aten.exp.default encountered during backward but not found in storage: "
                                       "it ran in the recompute but not in the forward"),
                           (torch.sin, "aten.sin.default invocation index 1 encountered during backward but not "
                                       "found in storage: the recompute ran it 2 times, the forward 1")):
        calls = [0]

        def changes(a, b):
            calls[0] += 1
            y = torch.sin(a @ b)
            if calls[0] > 1:  # the recompute only
                y = extra(y)
            return y @ b

        out = ckpt_offload.checkpoint(changes, x, w, context_fn=sac(policy))
        with pytest.raises(RuntimeError, match=message):
            out.sum().backward()
        if hasattr(tuc, "_SAC_MISMATCH_MSG"):  # torch's own, for comparison (2.14 checks both cases)
            calls[0] = 0
            torch_out = tuc.checkpoint(changes, x, w, use_reentrant=False, context_fn=sac(policy))
            with pytest.raises(RuntimeError, match="not found in storage"):
                torch_out.sum().backward()


def test_policy_argument_errors_and_the_torch_version_gate(monkeypatch):
    model = make_model(layers=3)
    with pytest.raises(ValueError, match="policy must be one of \\['attention'\\]"):
        ckpt_offload.enable_checkpointing(model, policy="attn")
    with pytest.raises(TypeError, match="policy must be a name"):
        ckpt_offload.enable_checkpointing(model, policy=3)
    with pytest.raises(ValueError, match="policy keys must be indices of checkpointed blocks"):
        ckpt_offload.enable_checkpointing(model, every_n_layers=2, policy={1: "attention"})
    monkeypatch.setattr(policies, "HAS_OFFLOAD_POLICY", False)
    with pytest.raises(RuntimeError, match=f"lacks; install torch>={policies.TORCH_NEEDED}"):
        ckpt_offload.enable_checkpointing(model, policy="attention")


# -- the named policy ----------------------------------------------------------------------------------
B, S, H, L, HEADS = 2, 32, 32, 4, 4
SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
# Per layer: the attention output (b, heads, s, h/heads) and its logsumexp (b, heads, s), float32.
ATTN_BYTES = B * S * H * 4 + B * HEADS * S * 4
INPUT_BYTES = B * S * H * 4


def tiny_gpt_run(**enable):
    model = make_model(layers=L, hidden=H, heads=HEADS, max_len=S)
    if enable:
        ckpt_offload.enable_checkpointing(model, **enable)
    ids = make_batch(batch=B, seq=S)
    ckpt_offload.reset_stats()
    loss = loss_of(model, ids)
    fwd = ckpt_offload.stats()
    with OpCount() as count:
        loss.backward()
    return grads(model), fwd, count.calls.get(SDPA_CPU, 0)


def test_attention_policy_on_a_plain_sdpa_block():
    ref, _, ref_sdpa = tiny_gpt_run(offload=False)  # plain checkpointing: attention runs again
    assert ref_sdpa == L
    got, fwd, sdpa = tiny_gpt_run(offload=True, keep_last=1, policy="attention")
    assert sdpa == 0  # neither the offloaded layers nor the kept one run attention again
    # keep_last=1: three layers send their input and their attention outputs; the last keeps both.
    assert fwd["bytes_offloaded"] == (L - 1) * (INPUT_BYTES + ATTN_BYTES)
    assert fwd["tensors_offloaded"] == (L - 1) * 3
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    s = ckpt_offload.stats()
    # Each layer's attention outputs came back with its input, ahead of need.
    assert s["tensors_prefetched"] == (L - 1) * 3 and s["reloads_on_demand"] == 0
    assert s["host_in_use_bytes"] == 0
    # A dict chooses the blocks: only block 0 avoids the recompute of its attention.
    _, fwd, sdpa = tiny_gpt_run(offload=True, keep_last=0, policy={0: "attention"})
    assert sdpa == L - 1 and fwd["bytes_offloaded"] == L * INPUT_BYTES + ATTN_BYTES


def test_attention_policy_on_a_tiny_llama():
    transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
    from ckpt_offload.integrations import hf

    heads, layers, seq = 4, 4, 64

    def build():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                                       num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=seq)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()

    def run(enable, **kw):
        model = build()
        enable(model, **kw)
        ids = torch.randint(0, 128, (B, seq), generator=torch.Generator().manual_seed(1))
        ckpt_offload.reset_stats()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        fwd = ckpt_offload.stats()
        with OpCount() as count:
            loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}, fwd, count.calls.get(SDPA_CPU, 0)

    attn = B * seq * H * 4 + B * heads * seq * 4
    ref, ref_fwd, ref_sdpa = run(hf.enable, offload=True, keep_last=1)
    assert ref_sdpa == layers
    for enable in (hf.enable, ckpt_offload.enable_checkpointing):
        got, fwd, sdpa = run(enable, offload=True, keep_last=1, policy="attention")
        assert sdpa == 0
        assert fwd["bytes_offloaded"] - ref_fwd["bytes_offloaded"] == (layers - 1) * attn
        assert all(torch.equal(ref[n], got[n]) for n in ref), enable.__name__
        assert ckpt_offload.stats()["host_in_use_bytes"] == 0
    # Without offload the attention outputs are saved on the device: still no recompute.
    _, fwd, sdpa = run(hf.enable, offload=False, policy="attention")
    assert sdpa == 0 and fwd["bytes_offloaded"] == 0
    # Wrong policies are refused before the model is touched.
    model = build()
    with pytest.raises(ValueError, match="hf.enable: policy must be one of"):
        hf.enable(model, policy="flash")
    with pytest.raises(ValueError, match="pass policy= or a context_fn, not both"):
        hf.enable(model, policy="attention", context_fn=policies.SelectiveOffload(lambda *a, **k: False))
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_selective_offload_is_a_context_fn_for_torch_checkpoint_too():
    # Without a session (torch's own checkpoint, transformers without offload) the marked outputs
    # are saved on the device.
    x, w = inputs("cpu")
    ctx = policies.SelectiveOffload(policy_marking(CheckpointPolicy.MUST_CPU_OFFLOAD))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tuc.checkpoint(fn, x, w, use_reentrant=False, context_fn=ctx)
    assert backward_counting(out).get(SIN, 0) == 0


@pytest.mark.gpu
@requires_cuda
def test_gpu_attention_outputs_live_on_the_host_and_attention_is_not_recomputed():
    from test_checkpoint import _forward_device_bytes

    b, s, h, heads, layers = 4, 1024, 256, 4, 4
    ids = make_batch(device="cuda", batch=b, seq=s)
    used, moved, forward_sdpa = {}, {}, {}
    for policy in (None, "attention"):
        model = make_model(device="cuda", layers=layers, hidden=h, heads=heads, max_len=s).to(torch.bfloat16)
        ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0, policy=policy)
        loss, used[policy], moved[policy] = _forward_device_bytes(model, ids)
        with OpCount() as count:
            loss.backward()
        forward_sdpa[policy] = sum(n for op, n in count.calls.items()
                                   if "scaled_dot_product" in str(op) and "backward" not in str(op))
        del loss, model
    assert forward_sdpa[None] == layers and forward_sdpa["attention"] == 0
    # Every layer's attention output (bf16) and logsumexp (fp32) went to the host ...
    attn = layers * (b * s * h * 2 + b * heads * s * 4)
    assert attn <= moved["attention"] - moved[None] <= attn + layers * 1024
    # ... and the device holds what plain offloaded checkpointing holds (outputs under 1 KiB stay).
    assert abs(used["attention"] - used[None]) <= layers * 4 * 1024
