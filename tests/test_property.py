"""Property test: any strided tensor, of any dtype, round-trips exactly through the engine.

hypothesis is a test dependency (the test extra in pyproject.toml); a machine without it skips this file only.
"""
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ckpt_offload  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.int8, torch.float64]
_prop = {}


def _prop_engine():
    if not _prop:
        _prop["pool"] = ckpt_offload.HostPool(pinned=False)
        _prop["engine"] = ckpt_offload.CopyEngine("cpu", _prop["pool"])
    return _prop["engine"], _prop["pool"]


@st.composite
def strided_tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 7), min_size=0, max_size=4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def values(n):
        if dtype.is_floating_point:
            return torch.randn(n, generator=gen).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, (n,), generator=gen).bool()
        return torch.randint(-100, 100, (n,), generator=gen).to(dtype)

    def numel(sizes):
        n = 1
        for s in sizes:
            n *= s
        return n

    kind = draw(st.sampled_from(["contiguous", "permute", "slice", "expand", "as_strided"]))
    if kind == "contiguous":
        t = values(numel(shape)).reshape(shape)
    elif kind == "permute":
        perm = draw(st.permutations(range(len(shape))))
        base_shape = [0] * len(shape)
        for i, p in enumerate(perm):
            base_shape[p] = shape[i]  # so that base.permute(perm) has the drawn shape
        t = values(numel(shape)).reshape(base_shape).permute(perm)
    elif kind == "slice":
        steps = [draw(st.integers(1, 3)) for _ in shape]
        starts = [draw(st.integers(0, 2)) for _ in shape]
        extra = [draw(st.integers(0, 2)) for _ in shape]
        full = [a + s * k + e for a, s, k, e in zip(starts, shape, steps, extra)]
        base = values(numel(full)).reshape(full)
        t = base[tuple(slice(a, a + s * k, k) for a, s, k in zip(starts, shape, steps))]
    elif kind == "expand":
        broadcast = [draw(st.booleans()) for _ in shape]
        t = values(numel([1 if b else s for s, b in zip(shape, broadcast)]))
        t = t.reshape([1 if b else s for s, b in zip(shape, broadcast)]).expand(shape)
    else:
        strides = [draw(st.integers(0, 3)) for _ in shape]
        offset = draw(st.integers(0, 3))
        span = 1 + sum((s - 1) * k for s, k in zip(shape, strides)) if numel(shape) else 1
        t = values(offset + span).as_strided(shape, strides, offset)
    assert list(t.shape) == shape
    return t


@settings(deadline=None, max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=strided_tensors(), path=st.sampled_from(["fetch", "prefetch_then_fetch", "release"]))
def test_engine_round_trip_property(t, path):
    eng, pool = _prop_engine()
    expected = t.clone()
    h = eng.offload(t)
    assert h is not None
    assert h.dtype == t.dtype and tuple(h.shape) == tuple(t.shape)
    if path == "release":
        eng.release(h)
        assert h.state == "released"
        with pytest.raises(RuntimeError, match="released"):
            eng.fetch(h)
    else:
        if path == "prefetch_then_fetch":
            eng.prefetch(h)
        out = eng.fetch(h)
        assert h.state == "fetched"
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out, expected)
        if h.compacted:
            assert out.is_contiguous()
        else:
            assert out.stride() == t.stride()
        del out
    del h
    assert pool.stats()["in_use_bytes"] == 0


