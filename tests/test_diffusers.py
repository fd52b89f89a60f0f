"""diffusers integration on tiny configs of the real diffusers classes (no downloads): the blocks
diffusers' own checkpointing wraps, checkpointed and offloaded through its gradient_checkpointing_func
hook; gradients bitwise those of diffusers' own checkpointing, synchronous and with copies in flight;
the bytes offloaded those of the blocks' inputs, shared ones once; LoRA through peft as diffusers'
LoRA scripts attach it; training steps shaped like those scripts; regional compilation; buckets."""
import copy
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is an optional dependency")

import ckpt_offload  # noqa: E402
from ckpt_offload.integrations import diffusers as cod  # noqa: E402

pytestmark = pytest.mark.usefixtures("test_cpu", "one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# Each: (model, keyword inputs of one batch); frames / height / width in latent units.
def wan(frames=2, h=8, w=8):
    m = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)
    return m, wan_inputs(frames, h, w)


def wan_inputs(frames, h, w, seed=1):
    return dict(hidden_states=rnd(1, 4, frames, h, w, seed=seed), timestep=torch.tensor([500]),
                encoder_hidden_states=rnd(1, 6, 16, seed=seed + 1))


def flux(h=4, w=4):
    m = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    n, t = h * w, 5
    return m, dict(hidden_states=rnd(1, n, 8, seed=1), encoder_hidden_states=rnd(1, t, 16, seed=2),
                   pooled_projections=rnd(1, 16, seed=3), timestep=torch.tensor([0.5]),
                   img_ids=torch.zeros(n, 3), txt_ids=torch.zeros(t, 3))


def hunyuan(frames=2, h=4, w=4):
    m = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2, num_single_layers=2,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4))
    return m, dict(hidden_states=rnd(1, 4, frames, h, w, seed=1), timestep=torch.tensor([500]),
                   encoder_hidden_states=rnd(1, 5, 16, seed=2), encoder_attention_mask=torch.ones(1, 5),
                   pooled_projections=rnd(1, 8, seed=3), guidance=torch.tensor([3000.0]))


def ltx(frames=2, h=4, w=4):
    m = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=16)
    return m, dict(hidden_states=rnd(1, frames * h * w, 8, seed=1), encoder_hidden_states=rnd(1, 5, 16, seed=2),
                   timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 5),
                   num_frames=frames, height=h, width=w)


def qwen(h=4, w=4):
    m = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
    t = 5
    inputs = dict(hidden_states=rnd(1, h * w, 16, seed=1), encoder_hidden_states=rnd(1, t, 16, seed=2),
                  encoder_hidden_states_mask=torch.ones(1, t), timestep=torch.tensor([0.5]), img_shapes=[(1, h, w)])
    if "txt_seq_lens" in inspect.signature(type(m).forward).parameters:  # diffusers before 0.40 asks for it
        inputs["txt_seq_lens"] = [t]
    return m, inputs


def sd3(h=8, w=8):
    m = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        caption_projection_dim=16, joint_attention_dim=16, pooled_projection_dim=16, out_channels=4)
    return m, dict(hidden_states=rnd(1, 4, h, w, seed=1), encoder_hidden_states=rnd(1, 5, 16, seed=2),
                   pooled_projections=rnd(1, 16, seed=3), timestep=torch.tensor([500]))


def unet(h=8, w=8):
    m = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        norm_num_groups=4, cross_attention_dim=16, attention_head_dim=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    return m, dict(sample=rnd(1, 4, h, w, seed=1), timestep=torch.tensor([500]),
                   encoder_hidden_states=rnd(1, 5, 16, seed=2))


def cogvideox(frames=2, h=4, w=4):
    m = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=2, sample_width=w, sample_height=h, sample_frames=frames * 4 - 3,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=5)
    return m, dict(hidden_states=rnd(1, frames, 4, h, w, seed=1), encoder_hidden_states=rnd(1, 5, 16, seed=2),
                   timestep=torch.tensor([500]))


MODELS = {"wan": wan, "flux": flux, "hunyuan": hunyuan, "ltx": ltx, "qwen": qwen, "sd3": sd3, "unet": unet,
          "cogvideox": cogvideox}
# The blocks diffusers' own checkpointing hands over, in forward order (class names).
SEQUENCES = {
    "wan": ["WanTransformerBlock"] * 3,
    "flux": ["FluxTransformerBlock"] * 2 + ["FluxSingleTransformerBlock"] * 2,
    "hunyuan": ["HunyuanVideoTransformerBlock"] * 2 + ["HunyuanVideoSingleTransformerBlock"] * 2,
    "ltx": ["LTXVideoTransformerBlock"] * 2,
    "qwen": ["QwenImageTransformerBlock"] * 2,
    "sd3": ["JointTransformerBlock"] * 2,
    "cogvideox": ["CogVideoXBlock"] * 2,
}


_built = {}


def make(name, **shape):
    """A fresh copy of the tiny model (built once: construction is the slow part) and its inputs."""
    key = (name, tuple(sorted(shape.items())))
    if key not in _built:
        torch.manual_seed(0)
        _built[key] = MODELS[name](**shape)
    model, inputs = _built[key]
    model = copy.deepcopy(model)
    model.train()
    return model, inputs


def output(model, inputs):
    out = model(**inputs, return_dict=False)[0]
    return out.float().square().mean()


def grads(model, inputs):
    model.zero_grad(set_to_none=True)
    output(model, inputs).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class Recorder:
    """A gradient_checkpointing_func for diffusers' own hook: torch's checkpoint, as diffusers' default,
    noting each block it is handed and the tensors in its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, block, *args):
        leaves = torch.utils._pytree.tree_leaves(args)
        self.calls.append((block, [t for t in leaves if isinstance(t, torch.Tensor)]))
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)


def diffusers_own(name, **shape):
    """Gradients (two steps) under diffusers' own checkpointing, and the blocks it handed over (by
    their names in the model, with the tensors of their arguments)."""
    model, inputs = make(name, **shape)
    rec = Recorder()
    model.enable_gradient_checkpointing(gradient_checkpointing_func=rec)
    ref = grads(model, inputs)
    calls = list(rec.calls)
    model.enable_gradient_checkpointing()  # diffusers' default function, for the same gradients
    default = grads(model, inputs)
    assert default.keys() == ref.keys() and all(torch.equal(v, default[k]) for k, v in ref.items())
    return ref, [(names(model)[id(b)], ts) for b, ts in calls]


def names(model):
    return {id(m): n for n, m in model.named_modules()}


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_bitwise_diffusers_own(name):
    ref, calls = diffusers_own(name)
    model, inputs = make(name)
    assert cod.enable(model) is None
    assert ckpt_offload.checkpointing_state(model) == ([], [])  # no block has run yet
    for step in range(3):  # the first forward learns the sequence (and offloads every block)
        g = grads(model, inputs)
        assert g.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(v, g[k]), (step, k)
        ckpt_offload.synchronize()
    blocks = [b for b, _ in calls]
    att = ckpt_offload.attachment.find(model)
    assert [names(model)[id(b)] for b in att.blocks] == blocks  # diffusers' blocks, in its forward order
    if name in SEQUENCES:
        assert [type(b).__name__ for b in att.blocks] == SEQUENCES[name]
    n = len(blocks)
    assert ckpt_offload.checkpointing_state(model) == (list(range(n)), list(range(n - 1)))
    assert ckpt_offload.stats()["bytes_offloaded"] > 0
    cod.disable(model)
    assert ckpt_offload.checkpointing_state(model) is None and not model.is_gradient_checkpointing


def test_unet_sequence_interleaves_resnets_and_transformer_blocks():
    # A UNet's resnets are checkpointed by their down/up block, its transformer blocks by their
    # Transformer2DModel: one sequence, in the order the forward runs them (not registration order).
    _, calls = diffusers_own("unet")
    model, inputs = make("unet")
    cod.enable(model)
    grads(model, inputs)
    blocks = ckpt_offload.attachment.find(model).blocks
    assert [names(model)[id(b)] for b in blocks] == [n for n, _ in calls]
    classes = [type(b).__name__ for b in blocks]
    assert classes[:2] == ["ResnetBlock2D", "BasicTransformerBlock"]
    assert set(classes) == {"ResnetBlock2D", "BasicTransformerBlock"}
    registered = [n for n, _ in model.named_modules() if n in {c for c, _ in calls}]
    assert registered != [n for n, _ in calls]  # registration order would be wrong


def test_gradients_bitwise_with_copies_in_flight():
    # The same comparison on the simulated asynchronous runtime (copies really in flight): engines
    # read the switch when they are created, so in a process of its own.
    env = dict(os.environ, CKPT_OFFLOAD_TEST_CPU="1", CKPT_OFFLOAD_TEST_ASYNC="1", CKPT_OFFLOAD_TEST_SEED="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import ckpt_offload, sys; assert ckpt_offload.build_info()['test_path'] == 'async-sim'; "
            "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-x', "
            f"{os.path.join(ROOT, 'tests', 'test_diffusers.py')!r}, '-k', 'test_gradients_bitwise_diffusers_own or lora or bytes']))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "failed" not in r.stdout


def _unique_bytes(tensors, exclude):
    """Bytes of distinct tensors (a view of another's range counts once), the model's own left out."""
    seen, total = set(), 0
    for t in tensors:
        if t.untyped_storage().data_ptr() in exclude:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("name", ["wan", "flux", "hunyuan", "unet"])
def test_bytes_offloaded_are_the_blocks_inputs_shared_ones_once(name):
    model, inputs = make(name)
    rec = Recorder()
    model.enable_gradient_checkpointing(gradient_checkpointing_func=rec)
    grads(model, inputs)
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    offloaded = rec.calls[:-1]  # keep_last=1: the last block's inputs stay on the device
    expected = _unique_bytes([t for _, ts in offloaded for t in ts], own)
    per_block = sum(_unique_bytes(ts, own) for _, ts in offloaded)
    assert per_block > expected  # the blocks share inputs (temb, text embeddings, rotary tables)

    cod.enable(model)
    grads(model, inputs)  # learns the sequence
    ckpt_offload.synchronize()
    ckpt_offload.reset_stats()
    grads(model, inputs)
    ckpt_offload.synchronize()
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == expected, (s["bytes_offloaded"], expected, per_block)
    assert s["tensors_kept_on_device"] == 0 and s["host_in_use_bytes"] == 0


@pytest.mark.parametrize("name", ["wan", "flux"])
def test_reloads_start_from_the_midpoints_once_the_sequence_is_known(name):
    # The first forward learns the blocks; its backward reloads from each block's start (it armed no
    # midpoint), the next forward learns the midpoints, and from then on each block's backward
    # starts the reload of the block below from its middle, past its recompute's peak: no midpoint
    # waited for in vain, none turned off.
    model, inputs = make(name)
    cod.enable(model, keep_last=0)
    ckpt_offload.reset_stats()
    for _ in range(3):
        grads(model, inputs)
        ckpt_offload.synchronize()
    att = model._ckpt_offload
    assert ckpt_offload.stats()["midpoint_misses"] == 0 and att.session.defer_prefetch
    assert set(att.midpoints.mid) == set(att.blocks) and len(att.blocks) == (3 if name == "wan" else 4)


def test_every_n_layers_and_keep_last_count_one_sequence():
    model, inputs = make("flux")
    cod.enable(model, every_n_layers=2, keep_last=0)
    grads(model, inputs)
    assert ckpt_offload.checkpointing_state(model) == ([0, 2], [0, 2])  # double block 0, single block 0
    cod.enable(model, keep_last=2)
    grads(model, inputs)
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2, 3], [0, 1])
    cod.enable(model, offload=False)
    grads(model, inputs)
    assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2, 3], [])


class Unsupported(diffusers.ModelMixin):
    def __init__(self):
        super().__init__()
        self.gradient_checkpointing = False


def test_arguments_checked_before_the_model_changes():
    model, _ = make("sd3")
    with pytest.raises(TypeError, match="unexpected keyword 'offlaod'; did you mean 'offload'"):
        cod.enable(model, offlaod=True)
    with pytest.raises(TypeError, match="every_n_layers must be an int"):
        cod.enable(model, every_n_layers="2")
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        cod.enable(model, use_reentrant=True)
    with pytest.raises(TypeError, match="must be a diffusers ModelMixin"):
        cod.enable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        cod.enable(Unsupported())
    assert ckpt_offload.checkpointing_state(model) is None and not model.is_gradient_checkpointing


def test_install_routes_enable_gradient_checkpointing():
    model, inputs = make("wan")
    cod.install()
    try:
        model.enable_gradient_checkpointing()  # as the training scripts call it
        grads(model, inputs)
        assert ckpt_offload.checkpointing_state(model) == ([0, 1, 2], [0, 1])
        model.disable_gradient_checkpointing()
        assert ckpt_offload.checkpointing_state(model) is None and not model.is_gradient_checkpointing
        rec = Recorder()
        model.enable_gradient_checkpointing(gradient_checkpointing_func=rec)  # a function of one's own: diffusers' path
        grads(model, inputs)
        assert len(rec.calls) == 3 and ckpt_offload.checkpointing_state(model) is None
    finally:
        cod.uninstall()
    assert not cod.installed() and "enable_gradient_checkpointing" in diffusers.ModelMixin.__dict__
    assert diffusers.ModelMixin.enable_gradient_checkpointing.__module__.startswith("diffusers")


def lora(model):
    """As diffusers' LoRA training scripts attach it: the base frozen, add_adapter on the attention projections."""
    from peft import LoraConfig

    model.requires_grad_(False)
    torch.manual_seed(0)  # the adapters' initialisation
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return model


@pytest.mark.parametrize("name", ["wan", "flux", "qwen"])
def test_lora_adapter_gradients_bitwise(name):
    pytest.importorskip("peft")
    model, inputs = make(name)
    lora(model)
    model.enable_gradient_checkpointing()
    ref = grads(model, inputs)
    assert ref and all("lora" in k for k in ref)
    model.disable_gradient_checkpointing()
    cod.enable(model)
    for _ in range(2):
        ckpt_offload.reset_stats()
        g = grads(model, inputs)
        assert g.keys() == ref.keys() and all(torch.equal(v, g[k]) for k, v in ref.items())
    assert ckpt_offload.stats()["bytes_offloaded"] > 0


def train(name, install, steps=4, accumulation=2):
    """Steps shaped like diffusers' LoRA scripts (train_dreambooth_lora_flux.py, the Wan LoRA
    scripts): the base frozen, LoRA through add_adapter, --gradient_checkpointing as
    model.enable_gradient_checkpointing(), accelerate's prepare with bf16 mixed precision (its
    autocast around the forward) and gradient accumulation, AdamW on the adapters, grad clipping."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=accumulation)
    model, inputs = make(name)
    lora(model)
    if install:
        cod.install()
    try:
        model.enable_gradient_checkpointing()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        key = "hidden_states" if "hidden_states" in inputs else "sample"
        losses = []
        for step in range(steps):
            with accelerator.accumulate(model):
                noise = rnd(*inputs[key].shape, seed=100 + step)
                batch = dict(inputs, **{key: inputs[key] + noise})
                pred = model(**batch, return_dict=False)[0]
                loss = torch.nn.functional.mse_loss(pred.float(), noise[..., : pred.shape[-1]].float()
                                                    if pred.shape == noise.shape else pred.float().detach() * 0.5)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach().clone())
        state = ckpt_offload.checkpointing_state(model)
        weights = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}
        return losses, weights, state
    finally:
        cod.uninstall()
        AcceleratorState._reset_state(True)


@pytest.mark.parametrize("name", ["flux", "wan"])
def test_lora_training_steps_equal_without_offload(name):
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")
    losses, weights, state = train(name, install=False)
    assert state is None
    ckpt_offload.reset_stats()
    losses2, weights2, state2 = train(name, install=True)
    n = len(SEQUENCES[name])
    assert state2 == (list(range(n)), list(range(n - 1)))
    assert ckpt_offload.stats()["bytes_offloaded"] > 0
    assert [float(x) for x in losses] == [float(x) for x in losses2]
    assert torch.equal(torch.stack(losses), torch.stack(losses2))
    assert weights.keys() == weights2.keys() and all(torch.equal(v, weights2[k]) for k, v in weights.items())


def test_compile_repeated_blocks_keeps_its_graphs():
    from torch._dynamo.utils import counters

    def run(offload):
        torch._dynamo.reset()
        counters.clear()
        model, inputs = make("flux")
        model.compile_repeated_blocks(backend="aot_eager")  # regional compilation: diffusers' _repeated_blocks
        if offload:
            cod.enable(model)
        else:
            model.enable_gradient_checkpointing()
        ckpt_offload.reset_stats()
        for _ in range(3):
            g = grads(model, inputs)
        ckpt_offload.synchronize()
        return g, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], ckpt_offload.stats()

    ref, breaks, graphs, _ = run(False)
    assert graphs >= 2  # one per block class (double- and single-stream)
    g, breaks2, graphs2, s = run(True)
    assert (breaks2, graphs2) == (breaks, graphs)  # no break added, no graph recompiled
    assert s["bytes_offloaded"] > 0
    assert g.keys() == ref.keys() and all(torch.equal(v, g[k]) for k, v in ref.items())


def test_buckets_no_pinned_allocation_after_the_largest():
    # Datasets bucket video by frame count and aspect: once the largest bucket has run, the others
    # reuse the pool's blocks.
    model, _ = make("wan")
    cod.enable(model)
    buckets = [(1, 4, 4), (3, 8, 8), (2, 8, 4), (1, 4, 8), (3, 4, 8), (2, 8, 8), (3, 8, 8)]  # frames, height, width

    def step(shape, seed):
        grads(model, wan_inputs(*shape, seed=seed))
        ckpt_offload.synchronize()
        return ckpt_offload.stats()

    ckpt_offload.synchronize()
    ckpt_offload.host_pool().empty_cache()  # the blocks earlier tests left in the pool go back
    step(buckets[0], 0)
    grew = step(buckets[1], 1)["host_alloc_calls"]
    assert grew > 0  # a larger bucket than any before: the pool grows (the counter is live)
    ckpt_offload.reset_stats()
    for i, shape in enumerate(buckets[2:]):
        s = step(shape, 2 + i)
    assert s["tensors_offloaded"] > 0 and s["bytes_offloaded"] > 0
    assert s["host_alloc_calls"] == 0 and s["host_free_calls"] == 0


def test_a_copy_of_a_configured_model_runs_its_own_blocks():
    ref, _ = diffusers_own("ltx")
    model, inputs = make("ltx")
    cod.enable(model)
    grads(model, inputs)  # the sequence learnt
    twin = copy.deepcopy(model)
    att, att2 = ckpt_offload.attachment.find(model), ckpt_offload.attachment.find(twin)
    assert att2 is not att and att2.session is not att.session
    assert all(any(b is m for m in twin.modules()) for b in att2.blocks)  # the copy's own blocks
    ckpt_offload.reset_stats()
    g = grads(twin, inputs)
    assert ckpt_offload.stats()["bytes_offloaded"] > 0
    assert ckpt_offload.checkpointing_state(twin) == ([0, 1], [0])
    assert g.keys() == ref.keys() and all(torch.equal(v, g[k]) for k, v in ref.items())


@pytest.mark.parametrize("name", ["wan", "hunyuan", "ltx", "flux"])
def test_budget_auto_plans_diffusers_models(name, monkeypatch):
    # plan_memory profiles the repeated blocks diffusers' forward calls when its own checkpointing
    # is off (find_repeated_blocks); "auto" reads the device's budget (a stand-in on the CPU test
    # path). The tightest budget it can meet offloads.
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_DEVICE_BYTES", str(1 << 30))
    model, inputs = make(name)
    ref = grads(model, inputs)
    args = tuple(inputs[p] for p in inspect.signature(type(model).forward).parameters if p in inputs)
    assert len(args) == len(inputs)  # every input is positional, in the forward's order

    def loss_fn(out):
        return out.sample.float().square().mean()

    plan = ckpt_offload.plan_memory(model, args, "auto", loss_fn=loss_fn)
    blocks = ckpt_offload.find_repeated_blocks(model)
    # The planner takes one list of repeated blocks: HunyuanVideo's and Flux's double-stream list
    # (the larger of their two in these tiny configs, or the first), Wan's and LTX-Video's only list.
    # LTX-Video hands its blocks the hidden states by keyword: planned, that input stays on the device
    # (a warning says so) and the blocks' other inputs are offloaded.
    assert len(plan.modes) == len(blocks) == len(SEQUENCES[name]) // (2 if name in ("hunyuan", "flux") else 1)
    assert plan.auto is not None and plan.auto.device_bytes > 0
    tight = plan.replan(plan.smallest_peak_bytes)
    assert any("offload" in m for m in tight.modes), tight.modes
    tight.apply(model)
    for _ in range(2):
        ckpt_offload.reset_stats()
        g = grads(model, inputs)
        assert g.keys() == ref.keys() and all(torch.equal(v, g[k]) for k, v in ref.items())
    assert ckpt_offload.stats()["bytes_offloaded"] > 0
