"""The copy engine: exact round trips for every dtype and layout, handle states, bad input, and on a
GPU the stream-ordering guarantees (sources kept until copied, blocks reused only after reads)."""
import gc

import pytest
import torch

import ckpt_offload
from conftest import DEVICES, requires_cuda

MiB = 1 << 20
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.float64, torch.int8]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def make(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 10).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return t.to(device)


def same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.element_size() == 1 and a.dtype.is_floating_point:  # fp8 has no equality kernels everywhere
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


def engine(device):
    if device == "cpu":
        return ckpt_offload.CopyEngine("cpu", ckpt_offload.HostPool(pinned=False))
    return ckpt_offload.engine_for(device)


def roundtrip(eng, t):
    h = eng.offload(t)
    assert h is not None
    out = eng.fetch(h)
    assert same(out, t)
    if not h.compacted:
        assert out.stride() == t.stride()
    return h, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_dtypes(device, dtype):
    eng = engine(device)
    for shape in [(0,), (1,), (3, 0, 2), (7, 5, 3), (1000,)]:
        t = make(shape, dtype, device)
        h, _ = roundtrip(eng, t)
        assert h.nbytes == t.numel() * t.element_size()
        assert h.state == "fetched"
    assert eng.pool.stats()["in_use_bytes"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_roundtrip_layouts(device):
    eng = engine(device)
    base = make((6, 8, 10), torch.float32, device)
    cases = {
        "transpose": base.transpose(0, 2),
        "offset_slice": base[2:5],
        "gapped_slice": base[:, 1:7:2],
        "expand": make((6, 1), torch.float32, device).expand(6, 100),
        "as_strided": base.as_strided((4, 4), (3, 1), 5),
        "permute": base.permute(2, 0, 1),
        "scalar": base[1, 2, 3],
    }
    for name, t in cases.items():
        h, out = roundtrip(eng, t)
        if name == "expand":
            assert h.nbytes == 6 * 4  # the stride-0 span, not 600 elements
            assert out.stride() == (1, 0)
        if name == "gapped_slice":
            assert h.compacted and out.is_contiguous()
        else:
            assert not h.compacted, name


@pytest.mark.parametrize("device", DEVICES)
def test_a_dense_tensor_comes_back_in_its_own_shape_and_any_other_as_a_view_of_its_span(device):
    # A reload of a tensor laid out as at::empty lays out its shape is allocated in that shape (no view
    # over a span for autograd to track); any other layout, a size-1 dimension's odd stride included,
    # comes back as a view with its own strides.
    eng = engine(device)
    base = make((6, 8, 10), torch.float32, device)
    for t in (base, base[2:5], make((6, 1), torch.float32, device)):
        _, out = roundtrip(eng, t)
        assert not out._is_view() and out.stride() == t.stride()
    for t in (base.transpose(0, 2), make((6, 1), torch.float32, device).as_strided((6, 1), (1, 0))):
        _, out = roundtrip(eng, t)
        assert out._is_view() and out.stride() == t.stride()


def test_roundtrip_large_tensor():
    eng = engine("cpu")
    t = torch.arange(64 * MiB, dtype=torch.float32)  # 256 MiB
    h = eng.offload(t)
    assert h.nbytes == 256 * MiB
    assert torch.equal(eng.fetch(h), t)


@pytest.mark.parametrize("device", DEVICES)
def test_handle_states_and_idempotent_prefetch(device):
    eng = engine(device)
    t = make((128,), torch.float32, device)
    h = eng.offload(t)
    assert h.state in ("offloading", "on_host")
    eng.synchronize()
    assert h.state == "on_host"
    assert h.host_bytes() is not None and h.host_bytes().numel() == 512
    eng.prefetch(h)
    eng.prefetch(h)  # idempotent
    assert h.state == "prefetching"
    assert eng.stats()["tensors_prefetched"] == 1
    assert same(eng.fetch(h), t)
    assert h.state == "fetched" and h.host_bytes() is None
    with pytest.raises(RuntimeError, match="already fetched"):
        eng.fetch(h)


@pytest.mark.parametrize("device", DEVICES)
def test_fetch_keeping_the_host_copy_reloads_again(device):
    # A graph kept for another backward (retain_graph): the host copy stays, each fetch reloads it.
    eng = engine(device)
    t = make((256,), torch.float32, device)
    h = eng.offload(t)
    for i in range(3):
        if i == 1:
            eng.prefetch(h)
            assert h.state == "prefetching"
        out = eng.fetch(h, keep_host=True)
        assert same(out, t) and h.state == "on_host" and h.host_bytes() is not None
        assert eng.pool.stats()["in_use_bytes"] == 1024
        out.zero_()  # the device copy is the caller's: writing it leaves the host copy alone
    s = eng.stats()
    assert s["tensors_fetched"] == 3 and s["tensors_prefetched"] == 3 and s["reloads_on_demand"] == 2
    assert same(eng.fetch(h), t) and h.state == "fetched"  # the last one gives the block back
    assert eng.pool.stats()["in_use_bytes"] == 0
    h2 = eng.offload(t)
    eng.fetch(h2, keep_host=True)
    del h2  # dropped on the host after a fetch: back to the pool, and not counted as released unfetched
    gc.collect()
    eng.synchronize()
    assert eng.pool.stats()["in_use_bytes"] == 0 and eng.stats()["tensors_released"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_release_without_fetch_returns_everything(device):
    eng = engine(device)
    if device == "cuda":
        # The process-wide engine: handles of earlier tests' dead graphs that only the collection
        # below would release must not be counted here.
        gc.collect()
        eng.synchronize()
        eng.reset_stats()
    hs = [eng.offload(make((1024,), torch.float32, device, i)) for i in range(4)]
    eng.prefetch(hs[1])
    eng.release(hs[0])
    eng.release(hs[0])  # idempotent
    eng.release(hs[1])
    assert hs[0].state == "released"
    with pytest.raises(RuntimeError, match="released"):
        eng.fetch(hs[0])
    with pytest.raises(RuntimeError, match="released"):
        eng.prefetch(hs[1])
    del hs  # dropping a handle releases it too
    gc.collect()
    eng.synchronize()
    assert eng.pool.stats()["in_use_bytes"] == 0
    assert eng.stats()["tensors_released"] == 4
    assert eng.stats()["pending_sources"] == 0


def test_statistics_count_bytes_each_way():
    eng = engine("cpu")
    a, b = torch.ones(100), torch.ones(50, dtype=torch.float64)
    ha, hb = eng.offload(a), eng.offload(b)
    eng.fetch(ha)
    s = eng.stats()
    assert s["tensors_offloaded"] == 2 and s["bytes_offloaded"] == 400 + 400
    assert s["tensors_prefetched"] == 1 and s["bytes_prefetched"] == 400
    del hb


def test_bad_input_is_a_clear_error():
    eng = engine("cpu")
    with pytest.raises(ValueError, match="strided"):
        eng.offload(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="meta"):
        eng.offload(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="nested"):
        eng.offload(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged))
    with pytest.raises(TypeError):
        eng.offload([1, 2, 3])
    with pytest.raises(ValueError, match="handle is None"):
        eng.fetch(None)
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        ckpt_offload.CopyEngine("meta")
    other = engine("cpu")
    h = other.offload(torch.ones(3))
    with pytest.raises(ValueError, match="another engine"):
        eng.fetch(h)


def test_cap_refusal_returns_none():
    pool = ckpt_offload.HostPool(pinned=False)
    pool.set_capacity(MiB)
    eng = ckpt_offload.CopyEngine("cpu", pool)
    assert eng.offload(torch.ones(MiB)) is None  # 4 MiB > cap
    assert eng.stats()["offloads_refused"] == 1 and pool.stats()["cap_refusals"] == 1


# ---------------------------------------------------------------------------------------------
# GPU: ordering guarantees that only real streams can break.


@pytest.mark.gpu
@requires_cuda
def test_source_dropped_while_compute_busy_still_roundtrips():
    """PITFALLS 1: the source's last reference dropped while the compute stream is busy: the data that comes
    back is the data that went out. Fails where the source's memory is reused before its device-to-host copy
    read it."""
    eng = ckpt_offload.engine_for("cuda")
    n = 4 * MiB
    for rep in range(30):
        handles, expected = [], []
        for i in range(4):
            torch.cuda._sleep(2_000_000)  # the tensor is produced late on the compute stream
            x = torch.arange(n, device="cuda", dtype=torch.float32).add_(rep * 10 + i)
            handles.append(eng.offload(x))
            expected.append(rep * 10 + i)
            del x
            # Memory freed too early would be handed to this allocation and overwritten.
            torch.empty(n, device="cuda").fill_(-1.0)
        for h, offset in zip(handles, expected):
            out = eng.fetch(h)
            ref = torch.arange(n, device="cuda", dtype=torch.float32).add_(offset)
            assert torch.equal(out, ref), (rep, offset)
    torch.cuda.synchronize()


@pytest.mark.gpu
@requires_cuda
def test_reused_block_waits_for_pending_reload():
    """PITFALLS 15: a block whose reload is still pending is handed to the next offload: the new copy waits
    for that reload, both tensors come back intact. Fails where the block is overwritten while its last copy
    still reads it."""
    eng = ckpt_offload.engine_for("cuda")
    n = 8 * MiB
    x1 = torch.full((n,), 1.0, device="cuda")
    h1 = eng.offload(x1)
    eng.synchronize()
    torch.cuda._sleep(50_000_000)  # delays the reload: it waits for the allocation point
    out1 = eng.fetch(h1)  # the block returns to the pool while its reload may still be queued
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # an idle stream: this offload is ready at once
        x2 = torch.full((n,), 2.0, device="cuda")
        h2 = eng.offload(x2)  # same size class: gets the block the reload still reads
    torch.cuda.synchronize()
    assert torch.equal(out1, torch.full_like(out1, 1.0))
    assert torch.equal(eng.fetch(h2), torch.full_like(x2, 2.0))


@pytest.mark.gpu
@requires_cuda
def test_no_host_allocation_after_warmup():
    eng = ckpt_offload.engine_for("cuda")
    sizes = [3 * MiB, 3 * MiB, 5 * MiB, MiB]
    for step in range(10):
        hs = [eng.offload(torch.randn(n // 4, device="cuda")) for n in sizes]
        for h in reversed(hs):
            eng.fetch(h)
        if step == 0:
            torch.cuda.synchronize()
            allocs = eng.pool.stats()["alloc_calls"]
    torch.cuda.synchronize()
    assert eng.pool.stats()["alloc_calls"] == allocs


@pytest.mark.gpu
@requires_cuda
def test_second_device_uses_its_own_engine():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x = torch.randn(1000, device="cuda:1")
    eng1 = ckpt_offload.engine_for("cuda:1")
    with torch.cuda.device(0):
        h = eng1.offload(x)
        out = eng1.fetch(h)
    assert out.device == torch.device("cuda:1") and torch.equal(out, x)
    with pytest.raises(ValueError, match="given to the engine of"):
        ckpt_offload.engine_for("cuda:0").offload(x)


@pytest.mark.parametrize("device", DEVICES)
def test_profiling_times_every_copy_and_only_then(device):
    # With profiling on, every copy each way is timed with the bytes it moved, so bytes / time is
    # the copies' own throughput; with it off, nothing is timed.
    eng = engine(device)
    eng.reset_stats()
    tensors = [make((256, 1024), torch.float32, device, seed=i) for i in range(3)]
    for t in tensors:  # profiling off
        roundtrip(eng, t)
    eng.synchronize()
    s = eng.stats()
    assert s["d2h_copies_timed"] == s["h2d_copies_timed"] == 0 and s["d2h_copy_ms"] == s["h2d_copy_ms"] == 0
    eng.reset_stats()
    ckpt_offload.profile(True)
    handles = [eng.offload(t) for t in tensors]
    outs = [eng.fetch(h) for h in handles]
    eng.synchronize()
    if device == "cuda":
        torch.cuda.synchronize()
    s = eng.stats()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    assert all(same(o, t) for o, t in zip(outs, tensors))
    assert s["d2h_copies_timed"] == s["h2d_copies_timed"] == 3
    assert s["d2h_bytes_timed"] == s["bytes_offloaded"] == nbytes
    assert s["h2d_bytes_timed"] == s["bytes_prefetched"] == nbytes
    assert s["d2h_copy_ms"] > 0 and s["h2d_copy_ms"] > 0
    if eng is ckpt_offload.engine_for(device):
        top = ckpt_offload.stats()
        assert top["d2h_gb_per_s"] == pytest.approx(nbytes / top["d2h_copy_ms"] / 1e6)


@requires_cuda
@pytest.mark.gpu
def test_source_made_on_a_side_stream_is_not_reused_before_its_copy():
    """PITFALLS 12: a source made on a side stream is not reused before its copy: the side stream is recorded
    as a user. Fails where the copy is ordered after the compute stream only, which inside a side-stream
    context orders it after nothing."""
    # The source is allocated on a side stream but offloaded while the (busy) main stream is
    # current, and handed back before its copy has run. The side stream allocates at once: without
    # the engine recording the main stream as a user, it would get the same memory and overwrite it
    # before the copy read it.
    n = 1 << 22
    eng = ckpt_offload.engine_for("cuda")
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    for _ in range(5):
        with torch.cuda.stream(side):
            x = torch.full((n,), 3.0, device="cuda")
        main.wait_stream(side)
        torch.cuda._sleep(200_000_000)  # main busy: the copy, ordered after it, cannot start yet
        h = eng.offload(x)
        del x
        assert eng.release_sources(0) == 0
        with torch.cuda.stream(side):
            y = torch.full((n,), float("nan"), device="cuda")
        out = eng.fetch(h)
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 3.0))
        del y, out


_ASYNC_BACKEND_SCRIPT = r"""
import torch, ckpt_offload
assert torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync"
eng = ckpt_offload.engine_for("cuda")
side, main = torch.cuda.Stream(), torch.cuda.current_stream()
n = 1 << 22
for on_side in (False, True):
    for _ in range(5):
        if on_side:  # allocated on a side stream: the producer is recorded as a user
            with torch.cuda.stream(side):
                x = torch.full((n,), 3.0, device="cuda")
            main.wait_stream(side)
        else:
            x = torch.full((n,), 3.0, device="cuda")
        torch.cuda._sleep(200_000_000)  # the copy, ordered after this, cannot have run yet
        h = eng.offload(x)
        del x
        held = eng.release_sources(0)
        assert held == 0, held  # handed back in stream order, not held until the host sees the copy
        # Freed memory is reused at once on either stream, in stream order: after the copy read it.
        y = torch.full((n,), float("nan"), device="cuda")
        with torch.cuda.stream(side):
            z = torch.full((n,), float("nan"), device="cuda")
        out = eng.fetch(h)
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 3.0))
        del y, z, out
print("ok")
"""


@requires_cuda
@pytest.mark.gpu
def test_cuda_malloc_async_backend_hands_sources_back_in_stream_order():
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    p = subprocess.run([sys.executable, "-c", _ASYNC_BACKEND_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ok" in p.stdout, p.stdout
    assert "record_stream" not in p.stderr, p.stderr  # the allocator's same-stream warning stays muted
