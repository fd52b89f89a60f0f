"""torch.compile with offload: every way of compiling keeps the checkpointed blocks' bodies compiled.

Graph breaks and graphs are counted with torch._dynamo.utils.counters and compared with plain
checkpointing compiled the same way; bytes offloaded equal eager offload's; gradients equal those of
plain checkpointing around the same compiled block bodies (bitwise where the kernels are the same).
Two sequence lengths, then a third: no recompile per length. Tiny models: compiling costs seconds.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import ckpt_offload

pytestmark = pytest.mark.usefixtures("test_cpu")

B, H, LAYERS = 2, 16, 4
LENGTHS = [8, 8, 8, 12, 16]  # three steps at one shape, then two more lengths
OFFLOADED = LAYERS - 1  # keep_last=1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(H, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make():
    torch.manual_seed(0)
    return Stack()


def batch(seq, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, seq, H, generator=g)


# Each way of compiling, given a model and a backend: returns what to call.
def _whole(model, backend, offload):
    ckpt_offload.enable_checkpointing(model, offload=offload)
    return torch.compile(model, backend=backend)


def _block_compile_before(model, backend, offload):
    for b in model.blocks:
        b.compile(backend=backend)
    ckpt_offload.enable_checkpointing(model, offload=offload)
    return model


def _block_compile_after(model, backend, offload):
    ckpt_offload.enable_checkpointing(model, offload=offload)
    for b in model.blocks:
        b.compile(backend=backend)
    return model


def _torch_compile_block_before(model, backend, offload):
    for i, b in enumerate(model.blocks):
        model.blocks[i] = torch.compile(b, backend=backend)
    ckpt_offload.enable_checkpointing(model, offload=offload)
    return model


def _torch_compile_block_after(model, backend, offload):
    ckpt_offload.enable_checkpointing(model, offload=offload)
    for i, b in enumerate(model.blocks):
        model.blocks[i] = torch.compile(b, backend=backend)
    return model


def _option(model, backend, offload):
    ckpt_offload.enable_checkpointing(model, offload=offload, compile={"backend": backend})
    return model


PATTERNS = {
    "whole": _whole,
    "block_compile_before": _block_compile_before,
    "block_compile_after": _block_compile_after,
    "torch_compile_block_before": _torch_compile_block_before,
    "torch_compile_block_after": _torch_compile_block_after,
    "compile_option": _option,
}


def _train(model, run):
    """Steps over LENGTHS: per step (graph breaks, unique graphs, bytes offloaded); the last grads."""
    seen = []
    for step, seq in enumerate(LENGTHS):
        model.zero_grad(set_to_none=True)
        ckpt_offload.reset_stats()
        x = batch(seq, step).requires_grad_()
        run(x).sum().backward()
        ckpt_offload.synchronize()
        s = ckpt_offload.stats()
        assert s["host_in_use_bytes"] == 0
        assert s["midpoint_misses"] == 0  # a compiled body has no midpoint: none is waited for
        seen.append((sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], s["bytes_offloaded"]))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads["x"] = x.grad.clone()
    return seen, grads


def _names(grads):
    # torch.compile(block) puts the block under `_orig_mod.`: compare by the original names.
    return {k.replace("._orig_mod", ""): v for k, v in grads.items()}


_reference = {}


def reference(backend):
    """Plain checkpointing (no offload) around block bodies compiled with `backend`: its counts
    and the gradients of the last step. Computed once per backend."""
    if backend not in _reference:
        torch._dynamo.reset()
        counters.clear()
        model = make()
        run = _option(model, backend, offload=False)
        _reference[backend] = _train(model, run)
    return _reference[backend]


_eager_bytes = []


def eager_bytes():
    if not _eager_bytes:
        model = make()
        ckpt_offload.enable_checkpointing(model, offload=True)
        seen, _ = _train(model, model)
        _eager_bytes.extend(b for _, _, b in seen)
    return _eager_bytes


def _boundary_breaks_only():
    """Every graph break is at one of ckpt_offload's eager boundaries: the checkpointed blocks'
    (eager_boundary) or the model's own pre/post hooks (ckpt_offload.attachment's)."""
    for reason in counters["graph_break"]:
        assert "eager_boundary" in reason or "attachment_before_forward" in reason or "attachment_after_forward" in reason, reason


def _check_pattern(pattern, backend):
    ref_seen, ref_grads = reference(backend)
    expected_bytes = eager_bytes()
    assert expected_bytes == [B * s * H * 4 * OFFLOADED for s in LENGTHS]  # the inputs of 3 blocks

    torch._dynamo.reset()
    counters.clear()
    model = make()
    run = PATTERNS[pattern](model, backend, offload=True)
    seen, grads = _train(model, run)

    breaks = [b for b, _, _ in seen]
    graphs = [g for _, g, _ in seen]
    _boundary_breaks_only()
    # At most 2 breaks per checkpointed block, counted over both compiles (static and dynamic).
    assert breaks[-1] <= 2 * 2 * LAYERS
    # The blocks' bodies compiled: as many graphs, step by step, as plain checkpointing around the
    # same compiled bodies (a block run eagerly would make none).
    assert graphs[0] >= 1
    assert graphs == [g for _, g, _ in ref_seen]
    # No recompilation after the second step at one shape; one for the second length (its shapes
    # become dynamic), none for the third.
    assert graphs[0] == graphs[1] == graphs[2]
    assert graphs[3] == graphs[4]
    assert [b for _, _, b in seen] == expected_bytes

    grads = _names(grads)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        if backend == "aot_eager" or pattern != "whole":
            # The same kernels as the reference: the block bodies are the same graphs, and the
            # rest runs eagerly in both (whole-model compile also compiles the input and head
            # layers, which inductor may fuse differently).
            assert torch.equal(grads[k], ref_grads[k]), k
        else:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6, msg=k)
    return seen


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_aot_eager_keeps_graphs(pattern):
    """PITFALLS 9, 16: whole-model torch.compile (aot_eager) with offload keeps its compiled graphs and
    offloads what eager offloads, gradients matching. Fails where hooks break every graph or are silently not
    applied in the compiled region."""
    seen = _check_pattern(pattern, "aot_eager")
    if pattern == "compile_option":
        assert seen[-1][0] == 0  # nothing compiled around the blocks: nothing to break


@pytest.mark.parametrize("pattern", ["compile_option", "whole", "block_compile_before"])
def test_inductor_keeps_graphs(pattern):
    """PITFALLS 16: as test_aot_eager_keeps_graphs under inductor. Fails where the hooks cost the compiled
    graphs or are silently dropped."""
    _check_pattern(pattern, "inductor")


def test_plain_checkpointing_counts_for_comparison():
    """What offload is measured against: plain checkpointing under whole-model compile traces
    torch's checkpoint itself (no break, one graph for everything); offload breaks exactly at the
    boundaries, and its block bodies share one graph."""
    torch._dynamo.reset()
    counters.clear()
    model = make()
    seen, plain_grads = _train(model, _whole(model, "aot_eager", offload=False))
    assert [b for b, _, _ in seen] == [0] * len(LENGTHS)
    assert seen[0][1] == 1

    torch._dynamo.reset()
    counters.clear()
    model = make()
    seen, grads = _train(model, _whole(model, "aot_eager", offload=True))
    _boundary_breaks_only()
    # One graph: the blocks' body, shared by all 4. The model's forward, whose loop over the blocks
    # breaks at each boundary, runs eagerly (torch skips a frame with a break inside a loop), and
    # its input and head layers are torch.nn modules, which torch.compile does not trace on their own.
    assert seen[0][1] == 1
    for k in grads:
        torch.testing.assert_close(grads[k], plain_grads[k], rtol=1e-5, atol=1e-6, msg=k)


def test_compile_option_is_checked():
    model = make()
    with pytest.raises(TypeError, match="enable_checkpointing: compile must be True, False or a dict"):
        ckpt_offload.enable_checkpointing(model, offload=True, compile="inductor")
    unknown = r"enable_checkpointing: compile has keys torch.compile does not take: \['backnd'\]"
    with pytest.raises(TypeError, match=unknown):
        ckpt_offload.enable_checkpointing(model, offload=True, compile={"backnd": "eager"})
    assert ckpt_offload.checkpointing_state(model) is None


def test_compile_true_and_disable_restores_forward():
    model = make()
    forwards = [b.forward for b in model.blocks]
    ckpt_offload.enable_checkpointing(model, offload=True, compile=True)
    assert all(b.forward != f for b, f in zip(model.blocks, forwards))
    ckpt_offload.disable_checkpointing(model)
    assert [b.forward for b in model.blocks] == forwards


# -- offload_activations around a compiled module -------------------------------------------------
def _saved_bytes(run, x):
    """Bytes of the plain tensors autograd saves in run(x): what offload_activations may move."""
    total = 0

    def pack(t):
        nonlocal total
        if type(t) is torch.Tensor:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(x)
    return y, total


def test_offload_activations_around_compiled_module():
    torch._dynamo.reset()
    counters.clear()
    model = make()
    run = torch.compile(model, backend="aot_eager")
    x0 = batch(8, 0).requires_grad_()
    y, saved = _saved_bytes(run, x0)  # compiles the graph
    y.sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_x = x0.grad.clone()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1 and not counters["graph_break"]

    for step in range(3):  # a new context each step: the same graph each time
        model.zero_grad(set_to_none=True)
        ckpt_offload.reset_stats()
        x = batch(8, 0).requires_grad_()
        with warnings.catch_warnings():
            # torch warns once that global module hooks fire for the compiled wrapper too.
            warnings.filterwarnings("ignore", message="Using `torch.compile\\(module\\)` when there are global hooks")
            with ckpt_offload.offload_activations(min_bytes=0):
                y = run(x)
        y.sum().backward()
        ckpt_offload.synchronize()
        s = ckpt_offload.stats()
        # Every plain tensor the compiled graph saves (its parameters reach it as Parameters).
        assert s["bytes_offloaded"] == saved > 0
        assert s["host_in_use_bytes"] == 0
        assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, ref[n]), n
        assert torch.equal(x.grad, ref_x)


# -- transformers -----------------------------------------------------------------------------------
def _tiny_llama(layers=4):
    transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def _hf_train(run, model, lengths=(8, 8, 8, 12, 16)):
    seen = []
    for seq in lengths:
        model.zero_grad(set_to_none=True)
        ckpt_offload.reset_stats()
        ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
        run(input_ids=ids, labels=ids).loss.backward()
        ckpt_offload.synchronize()
        seen.append((dict(counters["graph_break"]), counters["stats"]["unique_graphs"],
                     ckpt_offload.stats()["bytes_offloaded"]))
    return seen, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_hf_enable_then_whole_model_compile():
    from ckpt_offload.integrations import hf

    torch._dynamo.reset()
    counters.clear()
    model = _tiny_llama()
    hf.enable(model, offload=False)
    plain, plain_grads = _hf_train(torch.compile(model, backend="aot_eager"), model, lengths=(16,))

    model = _tiny_llama()
    hf.enable(model, offload=True)
    eager, _ = _hf_train(model, model)

    torch._dynamo.reset()
    counters.clear()
    model = _tiny_llama()
    hf.enable(model, offload=True)
    seen, grads = _hf_train(torch.compile(model, backend="aot_eager"), model)

    breaks, plain_breaks = seen[-1][0], plain[-1][0]
    ours = {k: v for k, v in breaks.items() if "eager_boundary" in k}
    # Offload adds at most its own breaks. Every other break is transformers' own: one the plain
    # compile of its checkpointing has too, or a call into one of its loggers, which dynamo reaches
    # in the offload run because the boundary replaces transformers' checkpoint call (since 5.25
    # that call mutates a context variable inside the checkpoint, and the plain run breaks there
    # first). Which breaks transformers causes changes from release to release, so the test does
    # not ask for equality with its list.
    added = {
        k for k in breaks
        if k not in ours and k not in plain_breaks and "<Logger transformers." not in k
    }
    assert not added, f"breaks offload added beyond its boundary: {added}"
    assert 1 <= sum(ours.values()) <= 2 * 2 * 4
    graphs = [g for _, g, _ in seen]
    assert graphs[0] >= 1 and graphs[0] == graphs[1] == graphs[2] and graphs[3] == graphs[4]
    assert [b for _, _, b in seen] == [b for _, _, b in eager] == [2 * s * 32 * 4 * 3 for s in (8, 8, 8, 12, 16)]
    for k in grads:  # the last step's length is plain's
        torch.testing.assert_close(grads[k], plain_grads[k], rtol=1e-5, atol=1e-6, msg=k)


def test_compile_option_on_transformers_layers():
    """enable_checkpointing(compile=...) on transformers layers (which checkpoint through their own
    forward wrapper): only the layers compile; one break each, at the boundary; eager's bytes."""
    model = _tiny_llama()
    ckpt_offload.enable_checkpointing(model, offload=True)
    eager, eager_grads = _hf_train(model, model)

    torch._dynamo.reset()
    counters.clear()
    model = _tiny_llama()
    ckpt_offload.enable_checkpointing(model, offload=True, compile={"backend": "aot_eager"})
    seen, grads = _hf_train(model, model)
    _boundary_breaks_only()
    graphs = [g for _, g, _ in seen]
    assert graphs[0] >= 1 and graphs[0] == graphs[1] == graphs[2] and graphs[3] == graphs[4]
    # torch 2.14 counts one break at each boundary here, torch 2.11 none: at most 2 per layer and compile.
    assert sum(seen[-1][0].values()) <= 2 * 2 * 4
    assert [b for _, _, b in seen] == [b for _, _, b in eager]
    for k in grads:
        torch.testing.assert_close(grads[k], eager_grads[k], rtol=1e-5, atol=1e-6, msg=k)


def test_trainer_torch_compile_with_offload_callback(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is an optional dependency")
    from torch.utils.data import Dataset

    from ckpt_offload.integrations import hf

    class Data(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(100 + i))
            return {"input_ids": ids, "labels": ids}

    def train(compile_, callbacks, out):
        torch._dynamo.reset()
        counters.clear()
        ckpt_offload.reset_stats()
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
            torch_compile=compile_, torch_compile_backend="aot_eager" if compile_ else None,
            **hf.install_checkpointing_args(every_n_layers=1, offload=True),
        )
        trainer = transformers.Trainer(model=_tiny_llama(), args=args, train_dataset=Data(), callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    eager = train(False, [hf.OffloadCallback(keep_last=1)], tmp_path / "a")
    eager_bytes = ckpt_offload.stats()["bytes_offloaded"]
    callback = hf.OffloadCallback(keep_last=1)
    losses = train(True, [callback], tmp_path / "b")
    assert callback.checkpointed == [0, 1, 2, 3]
    # 3 steps, 3 offloaded layers, one (2, 16, 32) float32 input each
    assert ckpt_offload.stats()["bytes_offloaded"] == eager_bytes == 3 * 3 * 2 * 16 * 32 * 4
    assert counters["stats"]["unique_graphs"] >= 1
    assert 1 <= sum(v for k, v in counters["graph_break"].items() if "eager_boundary" in k) <= 2 * 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=1e-6)
