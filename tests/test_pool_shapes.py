"""Step shapes that vary (dynamic padding): once the longest step has been seen, or reserved with
reserve_for, shorter steps make no host allocation and no free; growing lengths cost one allocation
per layer per new size class; reserved bytes stay within 1.15x of the most bytes in use at once."""
import random

import pytest
import torch

import ckpt_offload
from conftest import DEVICES, HAS_CUDA, requires_cuda
from tiny_gpt import grads, loss_of, make_batch, make_model

BOUND = 1.15
LAYERS = 31  # checkpointed inputs a step in the fine-tuning case


def ft_bytes(length):
    """One checkpointed input of the fine-tuning case: batch 1 x length x hidden 4096, bf16."""
    return length * 4096 * 2


def ft_length(rng):
    """Uniform in 2048..8192, padded to a multiple of 64."""
    return 2048 + 64 * rng.randrange((8192 - 2048) // 64 + 1)


def run_step(pool, sizes, bound=BOUND):
    """Every request held at once (forward), then released newest first (backward); the bound on
    the most bytes requested at once is checked after every acquire."""
    held = []
    for n in sizes:
        held.append(pool.acquire(n))
        s = pool.stats()
        assert s["reserved_bytes"] <= bound * s["high_water_bytes"], s
    while held:
        held.pop()


def test_fine_tuning_distribution_allocates_and_frees_nothing_after_the_longest_step():
    """PITFALLS 11: lengths drawn as fine-tuning does (2k-8k padded to 64): after the longest step, no host
    allocation and no free. Fails where the pool allocates and frees inside steps as shapes vary."""
    pool = ckpt_offload.HostPool(pinned=False)
    run_step(pool, [ft_bytes(8192)] * LAYERS)
    first = pool.stats()
    assert first["alloc_calls"] == LAYERS
    rng = random.Random(0)
    lengths = [ft_length(rng) for _ in range(200)]
    assert len({ckpt_offload.HostPool.round_size(ft_bytes(n)) for n in lengths}) > 25  # really varied
    for length in lengths:
        run_step(pool, [ft_bytes(length)] * LAYERS)
    s = pool.stats()
    assert s["alloc_calls"] == LAYERS and s["free_calls"] == 0
    assert s["hits"] == 200 * LAYERS
    assert s["reserved_bytes"] == LAYERS * ckpt_offload.HostPool.round_size(ft_bytes(8192))


def test_growing_lengths_cost_one_allocation_per_layer_per_new_size_class():
    pool = ckpt_offload.HostPool(pinned=False)
    classes, steps = set(), 0
    for length in range(2048, 8192 + 1, 64):
        classes.add(ckpt_offload.HostPool.round_size(ft_bytes(length)))
        run_step(pool, [ft_bytes(length)] * LAYERS)
        steps += 1
        assert pool.stats()["alloc_calls"] == LAYERS * len(classes)
    s = pool.stats()
    assert steps == 97 and len(classes) == 33  # 97 new maxima, 33 size classes among them
    assert s["alloc_calls"] == LAYERS * 33  # not one per layer per step (97 x 31)
    assert s["reserved_bytes"] <= BOUND * s["high_water_bytes"]


def test_alternating_short_and_long_steps_allocate_nothing_after_the_first_long_one():
    pool = ckpt_offload.HostPool(pinned=False)
    for step in range(40):
        run_step(pool, [ft_bytes(2048 if step % 2 == 0 else 8192)] * LAYERS)
        if step == 1:
            pool.reset_stats()
    s = pool.stats()
    assert s["alloc_calls"] == 0 and s["free_calls"] == 0 and s["hits"] == 38 * LAYERS


@pytest.mark.parametrize("pattern", ["random", "sawtooth", "up_then_down", "short_long"])
def test_reserve_bound_holds_for_adversarial_step_sequences(pattern):
    # k equal requests a step (a model's checkpointed inputs), sizes in adversarial orders: after
    # every acquire reserved <= 1.15 x the most bytes requested at once, and a step no larger than
    # the largest so far neither allocates nor frees.
    rng = random.Random(pattern)
    for trial in range(12):
        pool = ckpt_offload.HostPool(pinned=False)
        k = rng.randrange(1, 40)
        unit = rng.randrange(8 << 10, 256 << 10)
        largest = 0
        for step in range(60):
            mult = {"random": rng.randrange(1, 65), "sawtooth": 1 + (step % 9) * 8,
                    "up_then_down": 1 + step if step < 30 else 60 - step,
                    "short_long": 64 if step % 2 else rng.randrange(1, 9)}[pattern]
            n = unit * mult
            before = pool.stats()
            run_step(pool, [n] * k)
            after = pool.stats()
            if n <= largest:
                assert after["alloc_calls"] == before["alloc_calls"], (trial, step)
                assert after["free_calls"] == before["free_calls"], (trial, step)
            largest = max(largest, n)


def test_layers_of_different_sizes_share_the_longest_steps_blocks_in_any_order():
    # offload_activations: each layer saves tensors of several sizes. After the longest step, steps
    # at any shorter length, whatever order their requests arrive in, are served from its blocks.
    rng = random.Random(5)
    for _ in range(20):
        pool = ckpt_offload.HostPool(pinned=False)
        profile = [rng.randrange(1, 100) for _ in range(rng.randrange(2, 30))]
        longest = rng.randrange(64, 4096)
        run_step(pool, [p * longest * 64 for p in profile])
        allocs = pool.stats()["alloc_calls"]
        for _ in range(30):
            length = rng.randrange(1, longest + 1)
            sizes = [p * length * 64 for p in profile]
            rng.shuffle(sizes)
            run_step(pool, sizes)
        s = pool.stats()
        assert s["alloc_calls"] == allocs and s["free_calls"] == 0


def test_the_documented_limit_of_the_bound_for_arbitrary_sequences():
    # One request of S, then two of 0.6 S held at once: the first takes the S block (smallest fit),
    # the second needs a block of its own. Reserved is then 1.6 S for 1.2 S requested, above
    # 1.15 x the high water but equal to the working set: the general bound, and no more, holds.
    pool = ckpt_offload.HostPool(pinned=False)
    big = 16 << 20
    small = big // 10 * 6
    run_step(pool, [big])
    a, b = pool.acquire(small), pool.acquire(small)
    s = pool.stats()
    assert a.capacity == big
    assert s["reserved_bytes"] == big + ckpt_offload.HostPool.round_size(small) == s["working_set_bytes"]
    assert s["reserved_bytes"] > BOUND * s["high_water_bytes"]
    del a, b


# -- a model ----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("test_cpu")
def test_model_with_varying_lengths_allocates_nothing_after_its_longest_step():
    model = make_model(layers=6, hidden=32, heads=4, max_len=64)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    ckpt_offload.host_pool().empty_cache()
    rng = random.Random(3)
    loss_of(model, make_batch(seq=64)).backward()  # the longest step
    ckpt_offload.synchronize()
    ckpt_offload.reset_stats()
    lengths = [rng.randrange(8, 65) for _ in range(60)]
    for i, seq in enumerate(lengths):
        loss_of(model, make_batch(seed=i, seq=seq)).backward()
    ckpt_offload.synchronize()
    s = ckpt_offload.stats()
    assert len(set(lengths)) > 20
    assert s["tensors_offloaded"] == 60 * 5  # 6 layers, the last kept: the pool really was used
    assert s["host_alloc_calls"] == 0 and s["host_free_calls"] == 0
    assert s["host_hits"] == 60 * 5
    ckpt_offload.disable_checkpointing(model)


def xent(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# -- reserve_for ------------------------------------------------------------------------------------
@pytest.mark.usefixtures("test_cpu")
@pytest.mark.parametrize("device", DEVICES)
def test_reserve_for_pins_the_longest_batch_before_the_first_step(device):
    model = make_model(layers=6, hidden=32, heads=4, max_len=64, device=device)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    pool = ckpt_offload.host_pool()
    pool.empty_cache()
    longest = make_batch(seq=64, device=device)
    got = ckpt_offload.reserve_for(model, (longest,), loss_fn=lambda logits: logits.float().square().mean())
    input_bytes = 2 * 64 * 32 * 4
    assert got["requests"] == 5 and got["request_bytes"] == 5 * input_bytes
    assert got["alloc_calls"] == 5 and got["reserved_bytes"] >= got["block_bytes"] >= got["request_bytes"]
    assert all(p.grad is None for p in model.parameters())  # the step left no gradients behind
    ckpt_offload.reset_stats()
    for i, seq in enumerate([64, 17, 64, 40, 8, 63]):
        loss_of(model, make_batch(seed=i, seq=seq, device=device)).backward()
    ckpt_offload.synchronize()
    s = ckpt_offload.stats()
    assert s["host_alloc_calls"] == 0 and s["host_free_calls"] == 0 and s["tensors_offloaded"] == 6 * 5
    # A second reserve_for of the same batch pins nothing more.
    assert ckpt_offload.reserve_for(model, longest, loss_fn=lambda logits: logits.sum())["alloc_calls"] == 0
    ckpt_offload.disable_checkpointing(model)


@pytest.mark.usefixtures("test_cpu")
def test_reserve_for_runs_the_forward_in_the_training_loops_context():
    model = make_model(layers=3, hidden=32, heads=4, max_len=64)
    ckpt_offload.host_pool().empty_cache()
    ctx = lambda: ckpt_offload.offload_activations(min_bytes=0)  # noqa: E731
    longest = make_batch(seq=64)
    # The training loop's own loss: what it saves inside the context is offloaded too.
    got = ckpt_offload.reserve_for(model, longest, loss_fn=lambda logits: xent(logits, longest), context=ctx)
    assert got["requests"] > 20 and got["alloc_calls"] > 0  # every saved activation of the forward
    ckpt_offload.reset_stats()
    for i, seq in enumerate([64, 30, 9]):
        with ctx():
            loss = loss_of(model, make_batch(seed=i, seq=seq))
        loss.backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] > 60 and s["host_alloc_calls"] == 0 and s["host_free_calls"] == 0
    with pytest.raises(TypeError, match="context must be a callable"):
        ckpt_offload.reserve_for(model, make_batch(seq=8), context=ctx())


@pytest.mark.usefixtures("test_cpu")
def test_reserve_for_leaves_gradients_buffers_and_random_state_as_they_were():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 8))
    ckpt_offload.enable_checkpointing(model, layers=[model[0], model[3]], offload=True)
    x = torch.randn(16, 8)
    model(x).sum().backward()
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats_before = model[1].running_mean.clone()
    rng_before = torch.get_rng_state()
    ckpt_offload.reserve_for(model, x)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(model[1].running_mean, stats_before)
    assert all(torch.equal(p.grad, grads_before[n]) for n, p in model.named_parameters())
    ckpt_offload.disable_checkpointing(model)


def test_reserve_for_rejects_what_it_cannot_run():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="reserve_for: model"):
        ckpt_offload.reserve_for(lambda x: x, torch.randn(2, 4))
    with pytest.raises(TypeError, match="example_inputs"):
        ckpt_offload.reserve_for(model, "x")
    with pytest.raises(TypeError, match="loss_fn must return a scalar"):
        ckpt_offload.reserve_for(model, torch.randn(2, 4), loss_fn=lambda out: out)
    with pytest.raises(TypeError, match="cannot tell the loss"):
        ckpt_offload.reserve_for(_DictOut(), torch.randn(2, 4))
    with torch.no_grad(), pytest.raises(RuntimeError, match="gradients are disabled"):
        ckpt_offload.reserve_for(model, torch.randn(2, 4))


class _DictOut(torch.nn.Module):
    def forward(self, x):
        return {"y": x * 2}


@pytest.mark.usefixtures("test_cpu")
def test_gradients_are_unchanged_by_a_reserved_pool():
    torch.manual_seed(0)
    ref = make_model(layers=4, hidden=32, heads=4, max_len=64)
    model = make_model(layers=4, hidden=32, heads=4, max_len=64)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    ckpt_offload.reserve_for(model, make_batch(seq=64), loss_fn=lambda logits: logits.sum())
    for seq in (64, 23):  # a shorter batch reads blocks larger than its tensors
        ids = make_batch(seed=seq, seq=seq)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        loss_of(ref, ids).backward()
        loss_of(model, ids).backward()
        g_ref, g = grads(ref), grads(model)
        assert all(torch.equal(g_ref[n], g[n]) for n in g_ref)
    ckpt_offload.disable_checkpointing(model)


# -- GPU: where the pinned allocation happens ---------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
def test_reserve_from_a_thread_without_a_device_pins_through_the_existing_context():
    import threading

    pool = ckpt_offload.HostPool(pinned=True)
    torch.zeros(1, device="cuda")  # the context of the current device exists
    errors, blocks = [], []

    def work():  # a fresh thread: no current context until the pool makes one current
        try:
            pool.reserve(1 << 20, 2)
            blocks.append(pool.acquire(1 << 20))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert not errors
    assert blocks[0].tensor().is_pinned() and pool.stats()["alloc_calls"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_reserve_on_a_rank_creates_no_context_on_gpu_0():
    import subprocess
    import sys

    code = (
        "import threading, torch, ckpt_offload\n"
        "torch.cuda.set_device(1); torch.zeros(1, device='cuda:1')\n"
        "t = threading.Thread(target=lambda: ckpt_offload.host_pool().reserve(1 << 20, 4)); t.start(); t.join()\n"
        "ckpt_offload.host_pool().reserve(1 << 21)\n"
        "print(torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
