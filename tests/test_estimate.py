"""estimate_memory on the meta device against the same step run for real on the CPU test path: each
uniform mode's peak within 3% of the one LiveBytes measures (the steady-state step: gradients and
AdamW's states kept from a previous step, weights and inputs counted), the host bytes exactly those
the engine offloads; the checkpoint inputs of Qwen3-8B's shape at 128k; the CLI's JSON."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt_offload
from ckpt_offload.estimate import estimate_memory
from ckpt_offload.testing import LiveBytes
from tiny_gpt import make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configure(model, mode):
    if mode == "checkpoint":
        ckpt_offload.enable_checkpointing(model)
    elif mode == "checkpoint+offload":
        ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    elif mode == "every_n=2":
        ckpt_offload.enable_checkpointing(model, every_n_layers=2)


def measured(model, inputs, loss_fn, mode, optimizer=True):
    """(peak live bytes, bytes offloaded) of a steady-state step: a first step (and an AdamW step)
    allocates the gradients and the states, the second is measured."""
    configure(model, mode)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3) if optimizer else None

    def step():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss = loss_fn(out)
        del out  # as a trainer does: the outputs (logits, a cache) go before the backward
        loss.backward()

    step()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=False)
    ckpt_offload.synchronize()
    ckpt_offload.reset_stats()
    states = [t for s in (opt.state.values() if opt else ()) for t in s.values() if isinstance(t, torch.Tensor)]
    tensors = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    with LiveBytes() as live:
        live.add([*model.parameters(), *(p.grad for p in params), *model.buffers(), *tensors, *states])
        step()
    ckpt_offload.synchronize()
    sent = ckpt_offload.stats()["bytes_offloaded"]
    ckpt_offload.disable_checkpointing(model)
    return live.peak, sent


def check_all_modes(build, inputs, loss_fn, attention, optimizer="adamw"):
    """build(device) -> model; every uniform mode measured and compared with the estimate."""
    with torch.device("meta"):
        meta_model = build("meta")
    meta_inputs = torch.utils._pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, inputs)
    est = estimate_memory(meta_model, meta_inputs, loss_fn=loss_fn and loss_fn("meta"), attention=attention,
                          optimizer=optimizer)
    seen = {}
    for mode in ("none", "checkpoint", "checkpoint+offload", "every_n=2"):
        model = build("cpu")
        peak, sent = measured(model, inputs, loss_fn("cpu") if loss_fn else _hf_loss, mode, optimizer is not None)
        seen[mode] = (est.peak_bytes[mode], peak, est.host_bytes[mode], sent)
    for mode, (est_peak, peak, est_host, sent) in seen.items():
        assert est_peak == pytest.approx(peak, rel=0.03), (mode, seen)
        assert est_host == sent, (mode, seen)
    assert seen["none"][1] > seen["checkpoint"][1] > seen["checkpoint+offload"][1]  # the modes differ
    return est


def _hf_loss(out):
    return out.loss


# -- the test model (plain torch, SDPA: on the CPU its flash kernel, which keeps the output and the
# log-sum-exp as the GPU's does) --------------------------------------------------------------------


def tiny_loss(ids):
    def make(device):
        target = ids.to(device)
        return lambda logits: torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))
    return make


def test_tiny_gpt_every_mode_within_3_percent_and_host_bytes_exact():
    ids = make_batch(batch=2, seq=128)
    est = check_all_modes(lambda d: make_model(layers=6, hidden=64, heads=4, max_len=128, device=d),
                          (ids,), tiny_loss(ids), attention="flash")
    assert est.attention == ["flash"]
    n = 6
    assert est.parts["checkpoint_input_bytes"] == n * 2 * 128 * 64 * 4
    assert est.parts["optimizer_bytes"] == 8 * sum(p.numel() for p in make_model(layers=6, hidden=64, heads=4,
                                                                                 max_len=128).parameters())


def test_math_attention_counts_the_probabilities():
    # The quadratic term: math keeps [batch, heads, s, s] per block, flash does not.
    ids = make_batch(batch=2, seq=128)
    with torch.device("meta"):
        model = make_model(layers=4, hidden=64, heads=4, max_len=128, device="meta")
    loss = tiny_loss(ids)("meta")
    flash = estimate_memory(model, (ids.to("meta"),), loss_fn=loss, attention="flash")
    math_ = estimate_memory(model, (ids.to("meta"),), loss_fn=loss, attention="math")
    probs = 4 * 2 * 4 * 128 * 128 * 4  # blocks x batch x heads x s x s x fp32
    # less what flash keeps instead: the log-sum-exp (fp32) and its random state, under 1%
    assert math_.peak_bytes["none"] - flash.peak_bytes["none"] >= 0.99 * probs
    assert math_.host_bytes == flash.host_bytes


# -- transformers' models from configs, eager and SDPA attention --------------------------------------

transformers = pytest.importorskip("transformers", reason="needs transformers for the model-config tests")


def _config(kind, attn):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
    else:
        cfg = transformers.GemmaConfig(head_dim=16, **common)
    cfg._attn_implementation = attn
    return cfg


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma"])
def test_transformers_models_every_mode_within_3_percent(kind, attn):
    cfg = _config(kind, attn)
    ids = make_batch(batch=2, seq=96, vocab=256)

    def build(device):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg)

    est = check_all_modes(build, {"input_ids": ids, "labels": ids}, None,
                          attention="flash" if attn == "sdpa" else None)
    assert est.parts["logits_bytes"] == 2 * 96 * 256 * 4  # fp32 logits: no upcast copy
    assert est.attention == (["flash"] if attn == "sdpa" else [])


def test_lora_trains_only_its_adapters():
    peft = pytest.importorskip("peft", reason="needs peft for the LoRA test")
    cfg = _config("llama", "sdpa")
    ids = make_batch(batch=2, seq=96, vocab=256)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def build(device):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(cfg)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets))

    est = check_all_modes(build, {"input_ids": ids, "labels": ids}, None, attention="flash")
    with torch.device("meta"):
        trainable = sum(p.numel() for p in build("meta").parameters() if p.requires_grad)
    assert est.parts["grads_bytes"] == 4 * trainable
    assert est.parts["optimizer_bytes"] == 8 * trainable
    assert est.parts["grads_bytes"] < est.parts["weights_bytes"] / 4


def test_qwen3_8b_at_128k_checkpoint_inputs_are_36_gib():
    cfg = transformers.Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                                   vocab_size=151936, max_position_embeddings=131072)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ids = torch.empty(1, 131072, dtype=torch.long, device="meta")
    est = estimate_memory(model, {"input_ids": ids, "labels": ids})
    assert est.parts["checkpoint_input_bytes"] == 36 * 131072 * 4096 * 2
    assert est.host_bytes["checkpoint+offload"] == 36 * 131072 * 4096 * 2
    assert est.attention == ["flash"]  # bf16, head dim 128: what torch picks on a GPU
    # bf16 logits and transformers' fp32 copy of them for the loss
    assert est.parts["logits_bytes"] == 131072 * 151936 * (2 + 4)
    assert est.peak_bytes["none"] > est.peak_bytes["every_n=2"] > est.peak_bytes["checkpoint"] > \
        est.peak_bytes["checkpoint+offload"]
