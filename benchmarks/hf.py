"""The transformers path: a LlamaForCausalLM with random weights, transformers' own checkpointing and
offload beside ckpt_offload.integrations.hf.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .measure import measure, run_checks
from .model import make_ids
from .timing import interleaved_timing, run_guarded


HF_MODES = ["hf_none", "hf_gc", "hf_gc_sync_offload", "hf_gc_async_offload"]
HF_BITWISE = {"hf_gc_sync_offload": "hf_gc", "hf_gc_async_offload": "hf_gc"}


def hf_support():
    """(transformers, integrations.hf, parameters of transformers' checkpointing switch) or
    (None, reason)."""
    try:
        import inspect

        import transformers
        from ckpt_offload.integrations import hf
    except ImportError as err:
        return None, f"transformers comparison skipped: {err}"
    switch = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
    switch = switch or transformers.PreTrainedModel.gradient_checkpointing_enable
    return (transformers, hf, set(inspect.signature(switch).parameters)), ""


def build_hf_model(transformers, a, device, dtype):
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=max(a.seq_list),
        attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def apply_hf_mode(model, mode, a, hf, params):
    """Returns an error string when this transformers lacks what the mode needs."""
    hf.disable(model)
    if mode == "hf_none":
        return ""
    if "every_n_layers" not in params:
        return "this transformers' checkpointing switch has no every_n_layers"
    kw = dict(checkpoint_kwargs={"use_reentrant": False}, every_n_layers=a.hf_every)
    if mode == "hf_gc":
        hf.checkpointing_enable(model, **kw)
    elif mode == "hf_gc_sync_offload":
        if "offload" not in params:
            return "this transformers' checkpointing switch has no offload"
        hf.checkpointing_enable(model, **kw, offload=True)
    else:
        hf.enable(model, every_n_layers=a.hf_every, offload=True, keep_last=a.keep_last, prefetch=a.prefetch)
    return ""


class HFLoss(nn.Module):
    """Gives the transformers model this script's (ids -> loss) call."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def run_hf(a, device, cuda, bar, result, write):
    support, note = hf_support()
    if support is None:
        print(note)
        return [], [note]
    transformers, hf, params = support
    model = build_hf_model(transformers, a, device, a.torch_dtype)
    wrapped = HFLoss(model)
    rows, problems = [], []
    for seq in a.seq_list:
        ids = make_ids(a, seq, device)
        refs, skipped = {}, {}
        for mode in HF_MODES:  # which modes this transformers can run
            try:
                err = apply_hf_mode(model, mode, a, hf, params)
            except Exception as exc:  # a transformers version this script does not know: say so, go on
                err = f"{type(exc).__name__}: {exc}"
            if err:
                print(f"{mode}: skipped: {err}")
                skipped[mode] = err
        modes = [m for m in HF_MODES if m not in skipped]

        def prepare(mode):
            apply_hf_mode(model, mode, a, hf, params)
            return wrapped, ids, contextlib.nullcontext

        bar.set_description(f"timed steps, seq={seq}")
        timed, failed = interleaved_timing(modes, prepare, a, cuda, seq)
        for mode in HF_MODES:
            bar.set_description(f"{mode} seq={seq}")
            if mode in skipped:
                rows.append(dict(mode=mode, seq=seq, skipped=skipped[mode]))
            elif mode in failed:
                rows.append(failed[mode])
            else:
                prepare(mode)
                row, refs[mode] = run_guarded(
                    lambda: measure(wrapped, ids, mode, contextlib.nullcontext, a, cuda, timed[mode]), mode, seq)
                rows.append(row)
            bar.update(1)
            result.update(rows=rows)
            write()  # partial results survive a timeout
        hf.disable(model)
        refs = {m: r for m, r in refs.items() if r is not None}
        problems += run_checks([r for r in rows if r["seq"] == seq], refs, "hf_gc", HF_BITWISE, cuda, True)
    return rows, problems
