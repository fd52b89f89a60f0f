"""The host buffer pool: size classes, reuse without new allocations, the reserve bound, the cap,
empty_cache, concurrency and bad input. (Varying step shapes: test_pool_shapes.py.)"""
import random
import threading

import pytest

import ckpt_offload
from conftest import HAS_CUDA, requires_cuda

MiB = 1 << 20
BOUND = 1.15  # HostPool.kReserveBound


def within_general_bound(s):
    """reserved <= max(1.15 x high water, working set): the pool's promise for any sequence."""
    return s["reserved_bytes"] <= max(BOUND * s["high_water_bytes"], s["working_set_bytes"])


def test_round_size_classes_waste_little():
    """PITFALLS 47: size classes waste little over a request. Fails where requests are rounded up to a power
    of two."""
    assert ckpt_offload.HostPool.round_size(0) == 512
    assert ckpt_offload.HostPool.round_size(1) == 512
    assert ckpt_offload.HostPool.round_size(513) == 1024
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randrange(8 * 1024 + 1, 1 << 31)
        c = ckpt_offload.HostPool.round_size(n)
        assert n <= c <= n * 1.0625, (n, c)
    # Powers of two are their own class: no waste where activations usually land.
    for k in range(13, 31):
        assert ckpt_offload.HostPool.round_size(1 << k) == 1 << k


def test_reuse_makes_no_new_allocation():
    pool = ckpt_offload.HostPool(pinned=False)
    b = pool.acquire(3 * MiB)
    assert b.size == 3 * MiB and b.capacity >= 3 * MiB
    del b
    s = pool.stats()
    assert (s["alloc_calls"], s["misses"], s["in_use_bytes"]) == (1, 1, 0)
    for _ in range(10):
        b = pool.acquire(3 * MiB - 100)  # same class
        del b
    s = pool.stats()
    assert s["alloc_calls"] == 1 and s["hits"] == 10
    assert s["reserved_bytes"] == ckpt_offload.HostPool.round_size(3 * MiB)


def test_block_tensor_keeps_memory_until_dropped():
    pool = ckpt_offload.HostPool(pinned=False)
    b = pool.acquire(4096)
    t = b.tensor()
    t.fill_(7)
    del b
    assert pool.stats()["in_use_bytes"] == 4096  # the tensor still owns the block
    assert int(t.sum()) == 7 * 4096
    del t
    assert pool.stats()["in_use_bytes"] == 0


def test_reserve_bound_over_random_sequences():
    # Unstructured traffic: reserved host bytes stay within max(1.15 x high water, working set).
    for seed in range(5):
        rng = random.Random(seed)
        pool = ckpt_offload.HostPool(pinned=False)
        live = []
        for _ in range(400):
            if live and rng.random() < 0.45:
                live.pop(rng.randrange(len(live)))
            else:
                live.append(pool.acquire(rng.randrange(64 * 1024, 8 * MiB)))
            s = pool.stats()
            assert within_general_bound(s), (seed, s)
            assert s["in_use_block_bytes"] == sum(b.capacity for b in live)
        live.clear()
        assert pool.stats()["in_use_bytes"] == 0


def test_steady_state_sequence_allocates_once():
    pool = ckpt_offload.HostPool(pinned=False)
    sizes = [5 * MiB, 5 * MiB, 2 * MiB, 700 * 1024, 5 * MiB]
    for step in range(5):
        blocks = [pool.acquire(n) for n in sizes]
        if step == 0:
            first = pool.stats()["alloc_calls"]
        blocks.clear()
    assert pool.stats()["alloc_calls"] == first == len(sizes)


def test_cap_refuses_and_counts():
    pool = ckpt_offload.HostPool(pinned=False)
    pool.set_capacity(3 * MiB)
    a = pool.acquire(2 * MiB)
    assert a is not None
    assert pool.acquire(2 * MiB) is None
    s = pool.stats()
    assert s["cap_refusals"] == 1 and s["reserved_bytes"] <= 3 * MiB and s["capacity_bytes"] == 3 * MiB
    # A free block is evicted to make room under the cap rather than refusing.
    del a
    b = pool.acquire(2 * MiB + 4096)
    assert b is not None and pool.stats()["reserved_bytes"] <= 3 * MiB
    pool.set_capacity(0)
    assert pool.acquire(8 * MiB) is not None


def test_empty_cache_frees_unused_blocks():
    pool = ckpt_offload.HostPool(pinned=False)
    keep = pool.acquire(MiB)
    tmp = [pool.acquire(2 * MiB) for _ in range(3)]
    tmp.clear()
    freed = pool.empty_cache()
    s = pool.stats()
    assert freed == 3 * 2 * MiB
    assert s["reserved_bytes"] == MiB and s["free_calls"] == 3 and s["blocks_reserved"] == 1
    del keep


def test_reserve_preallocates():
    pool = ckpt_offload.HostPool(pinned=False)
    pool.reserve(4 * MiB, count=2)
    s = pool.stats()
    assert s["alloc_calls"] == 2 and s["reserved_bytes"] == 8 * MiB
    a, b = pool.acquire(4 * MiB), pool.acquire(4 * MiB)
    assert pool.stats()["alloc_calls"] == 2 and pool.stats()["hits"] == 2
    pool.set_capacity(8 * MiB)
    with pytest.raises(RuntimeError, match="capacity"):
        pool.reserve(MiB)
    del a, b


def test_injected_allocation_failure_is_soft():
    pool = ckpt_offload.HostPool(pinned=False)
    pool.inject_alloc_failures(1)
    assert pool.acquire(MiB) is None
    assert pool.stats()["alloc_failures"] == 1
    assert pool.acquire(MiB) is not None  # the next one works


def test_threads_keep_statistics_exact():
    pool = ckpt_offload.HostPool(pinned=False)
    n_threads, n_iter = 4, 300
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            held = []
            for _ in range(n_iter):
                held.append(pool.acquire(rng.choice([64 * 1024, 256 * 1024, MiB])))
                if len(held) > 3:
                    held.pop(0)
            held.clear()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    s = pool.stats()
    assert s["in_use_bytes"] == 0 and s["blocks_in_use"] == 0
    assert s["hits"] + s["misses"] == n_threads * n_iter
    assert s["blocks_reserved"] == s["alloc_calls"] - s["free_calls"]


@pytest.mark.parametrize("bad", [-1, -(1 << 40)])
def test_negative_sizes_are_value_errors(bad):
    pool = ckpt_offload.HostPool(pinned=False)
    for call in (pool.acquire, pool.reserve, pool.set_capacity, ckpt_offload.HostPool.round_size):
        # The C++ calls say "non-negative"; set_capacity, which reads sizes with units in Python first,
        # says "an int >= 0" as every Python entry point does.
        with pytest.raises(ValueError, match="non-negative|must be an int >= 0"):
            call(bad)


def test_non_integer_size_is_type_error():
    pool = ckpt_offload.HostPool(pinned=False)
    with pytest.raises(TypeError):
        pool.acquire("1024")


def test_pinned_pool_needs_cuda_and_says_why():
    if HAS_CUDA:
        assert ckpt_offload.HostPool(pinned=True).pinned
        assert ckpt_offload.host_pool().pinned is True
    else:
        with pytest.raises(ValueError, match=r"pinned=True\) needs a CUDA build"):
            ckpt_offload.HostPool(pinned=True)
        assert ckpt_offload.host_pool().pinned is False


@pytest.mark.gpu
@requires_cuda
def test_global_pool_is_pinned_on_gpu():
    import torch

    pool = ckpt_offload.host_pool()
    assert pool.pinned
    b = pool.acquire(MiB)
    assert b.tensor().is_pinned()
    del b
    assert torch.cuda.is_available()


def test_shapes_that_alternate_share_blocks():
    # Dynamic padding: two shapes 10% apart, alternating step by step. After the larger one has
    # been seen, the smaller one reuses its blocks: no allocation, no free, every step.
    pool = ckpt_offload.HostPool(pinned=False)
    small, large = 10 * MiB, 11 * MiB
    for step in range(12):
        held = [pool.acquire(small if step % 2 == 0 else large) for _ in range(8)]
        held.clear()
        if step == 1:
            s1 = pool.stats()
    s = pool.stats()
    assert s["alloc_calls"] == s1["alloc_calls"] and s["free_calls"] == s1["free_calls"]
    assert s["reserved_bytes"] <= BOUND * s["high_water_bytes"]


def test_reset_stats_does_not_shrink_the_steady_state():
    pool = ckpt_offload.HostPool(pinned=False)
    sizes = [4 * MiB, 3 * MiB, 2 * MiB]
    for _ in range(2):
        held = [pool.acquire(n) for n in sizes]
        held.clear()
    allocs = pool.stats()["alloc_calls"]
    for _ in range(5):
        pool.reset_stats()  # per-step resets, as a training loop might do
        held = [pool.acquire(n) for n in sizes]
        held.clear()
        s = pool.stats()
        assert s["alloc_calls"] == 0 and s["free_calls"] == 0 and s["hits"] == len(sizes)
    assert allocs == len(sizes)


def test_reserved_blocks_serve_smaller_requests():
    pool = ckpt_offload.HostPool(pinned=False)
    pool.reserve(8 * MiB, count=4)
    b = pool.acquire(MiB)  # a smaller request takes a reserved block: no allocation
    assert b.capacity == 8 * MiB
    held = [pool.acquire(8 * MiB) for _ in range(3)]
    s = pool.stats()
    assert (s["alloc_calls"], s["free_calls"], s["hits"]) == (4, 0, 4)
    del b, held
    pool.reserve(8 * MiB, count=4)  # already there: nothing new
    assert pool.stats()["alloc_calls"] == 4
    assert pool.empty_cache() == 4 * 8 * MiB


def test_reserve_takes_the_sizes_of_one_step():
    pool = ckpt_offload.HostPool(pinned=False)
    step = [3 * MiB, MiB, 2 * MiB, MiB]
    pool.reserve(step)
    s = pool.stats()
    assert (s["alloc_calls"], s["high_water_bytes"], s["working_set_bytes"]) == (4, 7 * MiB, 7 * MiB)
    pool.reserve(step)
    pool.reserve([MiB // 2, 3 * MiB - 1, MiB, 2 * MiB])  # a shorter step: its blocks are there
    held = [pool.acquire(n) for n in reversed(step)]
    assert pool.stats()["alloc_calls"] == 4 and pool.stats()["free_calls"] == 0
    del held
    with pytest.raises(ValueError, match="non-negative"):
        pool.reserve([MiB, -1])


def test_exact_class_preferred_over_a_larger_free_block():
    pool = ckpt_offload.HostPool(pinned=False)
    big, exact = pool.acquire(11 * MiB), pool.acquire(10 * MiB)
    del big, exact  # both free now
    b = pool.acquire(10 * MiB)
    assert b.capacity == ckpt_offload.HostPool.round_size(10 * MiB)
    c = pool.acquire(10 * MiB)  # the exact class is taken: the 10% larger block serves
    assert c.capacity == ckpt_offload.HostPool.round_size(11 * MiB)
    assert pool.stats()["alloc_calls"] == 2


def test_a_free_block_serves_any_smaller_request_smallest_first():
    pool = ckpt_offload.HostPool(pinned=False)
    blocks = [pool.acquire(n) for n in (64 * MiB, 4 * MiB, 16 * MiB)]
    del blocks  # free: 4, 16 and 64 MiB
    small = pool.acquire(MiB)
    assert small.capacity == 4 * MiB  # the smallest that fits, however much larger than the request
    mid = pool.acquire(5 * MiB)
    assert mid.capacity == 16 * MiB
    s = pool.stats()
    assert (s["alloc_calls"], s["free_calls"], s["hits"]) == (3, 0, 2)
    assert s["in_use_bytes"] == 6 * MiB and s["in_use_block_bytes"] == 20 * MiB


def test_reserve_bound_with_blocks_that_serve_smaller_requests():
    # The hard case for the bound: sizes a few percent to several times apart, blocks held in any
    # order, so small requests keep taking larger free blocks. The general bound holds throughout.
    worst = 0.0
    for seed in range(120):
        rng = random.Random(seed)
        pool = ckpt_offload.HostPool(pinned=False)
        base = rng.randrange(MiB, 16 * MiB)
        spread = rng.choice([1.05, 1.1, 1.5, 4.0])
        drop = rng.choice([0.3, 0.5, 0.7])
        live = []
        for _ in range(200):
            if live and rng.random() < drop:
                live.pop(rng.randrange(len(live)))
            else:
                live.append(pool.acquire(int(base * rng.uniform(1.0, spread))))
            s = pool.stats()
            assert within_general_bound(s), (seed, s)
            worst = max(worst, s["reserved_bytes"] / max(BOUND * s["high_water_bytes"], s["working_set_bytes"]))
    assert worst > 0.95  # the sequences did push against the bound
