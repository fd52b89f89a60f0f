"""The user-facing API: checkpoint(), enable_checkpointing(), offload_activations(), prefetch,
gradient accumulation. Gradients are compared with the unmodified model (allclose) and with
plain checkpointing (bitwise); every tensor really goes through the pool (test path on the CPU)."""
import gc

import pytest
import torch
import torch.utils.checkpoint as tuc

import ckpt_offload
from conftest import DEVICES, requires_cuda
from tiny_gpt import grads, loss_of, make_batch, make_model

pytestmark = pytest.mark.usefixtures("test_cpu")

B, S, H, L = 2, 16, 32, 6
INPUT_BYTES = B * S * H * 4  # one block input, float32


def reference_grads(device="cpu", every_n=None, ids=None):
    """Gradients of the unmodified model, or of plain torch checkpointing every n-th block."""
    model = make_model(device=device)
    ids = make_batch(device=device) if ids is None else ids
    if every_n is not None:
        ckpt_offload.enable_checkpointing(model, every_n_layers=every_n, offload=False)
    loss = loss_of(model, ids)
    loss.backward()
    return loss.detach(), grads(model)


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


# ---------------------------------------------------------------------------------------------
# checkpoint()


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_is_bitwise_torch_checkpoint(device):
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    y = torch.randn(8, 64, device=device, requires_grad=True)

    def fn(a, b):
        return lin(a * b).sum(0)

    ref = tuc.checkpoint(fn, x, y, use_reentrant=False)
    ref.sum().backward()
    ref_grads = [x.grad.clone(), y.grad.clone()] + [p.grad.clone() for p in lin.parameters()]
    for t in [x, y, *lin.parameters()]:
        t.grad = None

    session = ckpt_offload.OffloadSession()
    out = ckpt_offload.checkpoint(fn, x, y, session=session)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 2 and s["bytes_offloaded"] == 2 * 8 * 64 * 4  # the two inputs
    out.sum().backward()
    got = [x.grad, y.grad] + [p.grad for p in lin.parameters()]
    assert torch.equal(out, ref)
    for a, b in zip(got, ref_grads):
        assert torch.equal(a, b)
    s = ckpt_offload.stats()
    assert s["tensors_fetched"] == 2 and s["host_in_use_bytes"] == 0


def test_checkpoint_offload_false_moves_nothing():
    x = torch.randn(4, 4, requires_grad=True)
    ckpt_offload.checkpoint(torch.sin, x, offload=False).sum().backward()
    assert ckpt_offload.stats()["bytes_offloaded"] == 0
    assert torch.equal(x.grad, torch.cos(x))


def test_checkpoint_warns_once_for_keyword_tensors(monkeypatch):
    import ckpt_offload.checkpointing as ck

    monkeypatch.setattr(ck, "_kwarg_warned", False)
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="keyword 'w' requires grad but is not offloaded"):
        ckpt_offload.checkpoint(lambda a, w: a * w, x, w=w, session=ckpt_offload.OffloadSession()).sum().backward()
    assert torch.equal(w.grad, x.detach())  # closure/keyword gradients still flow
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt_offload.checkpoint(lambda a, w: a * w, x, w=w, session=ckpt_offload.OffloadSession())


def test_checkpoint_rejects_reentrant_and_bad_arguments():
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        ckpt_offload.checkpoint(torch.sin, torch.ones(1), use_reentrant=True)
    with pytest.raises(TypeError, match="function must be callable"):
        ckpt_offload.checkpoint(3, torch.ones(1))
    with pytest.raises(TypeError, match="offload must be True or False"):
        ckpt_offload.checkpoint(torch.sin, torch.ones(1), offload="yes")


# ---------------------------------------------------------------------------------------------
# enable_checkpointing()


@pytest.mark.parametrize("every_n,expected", [(1, [0, 1, 2, 3, 4, 5]), (2, [0, 2, 4]), (3, [0, 3])])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_enable_checkpointing_gradients(device, every_n, expected, offload):
    ids = make_batch(device=device)
    _, unmodified = reference_grads(device, ids=ids)
    _, plain = reference_grads(device, every_n=every_n, ids=ids)
    ckpt_offload.reset_stats()

    model = make_model(device=device)
    idx = ckpt_offload.enable_checkpointing(model, every_n_layers=every_n, offload=offload, keep_last=1)
    assert idx == expected
    loss_of(model, ids).backward()
    got = grads(model)
    assert_bitwise(got, plain)
    assert_close(got, unmodified)
    s = ckpt_offload.stats()
    offloaded = len(expected) - 1 if offload else 0  # keep_last=1 stays on the device
    assert s["tensors_offloaded"] == offloaded
    assert s["bytes_offloaded"] == offloaded * INPUT_BYTES
    assert s["bytes_prefetched"] == offloaded * INPUT_BYTES
    assert s["host_in_use_bytes"] == 0
    assert ckpt_offload.checkpointing_state(model) == (expected, expected[: len(expected) - 1] if offload else [])


def test_keep_last_zero_offloads_every_checkpointed_layer():
    """PITFALLS 14: keep_last=0 offloads every checkpointed layer's input, and the bytes offloaded are what
    those layers saved. Fails where layer and group indices are mixed up (a layer skipped or offloaded
    twice)."""
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=0)
    loss_of(model, make_batch()).backward()
    assert ckpt_offload.stats()["bytes_offloaded"] == L * INPUT_BYTES


def test_forward_releases_sources_and_host_holds_the_inputs():
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    loss = loss_of(model, make_batch())
    s = ckpt_offload.stats()
    assert s["host_in_use_bytes"] == (L - 1) * INPUT_BYTES
    assert s["pending_sources"] == 0  # host copies are synchronous: nothing left to poll
    loss.backward()
    assert ckpt_offload.stats()["host_in_use_bytes"] == 0


def test_gradient_accumulation_matches():
    ids = [make_batch(seed=s) for s in (1, 2, 3)]
    ref = make_model()
    ckpt_offload.enable_checkpointing(ref, every_n_layers=2, offload=False)
    for x in ids:
        loss_of(ref, x).backward()
    model = make_model()
    ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True, keep_last=1)
    for x in ids:  # one backward per micro-batch, accumulated
        loss_of(model, x).backward()
    assert_bitwise(grads(model), grads(ref))

    # Several forwards, then one backward.
    ref2, model2 = make_model(), make_model()
    ckpt_offload.enable_checkpointing(ref2, every_n_layers=2, offload=False)
    ckpt_offload.enable_checkpointing(model2, every_n_layers=2, offload=True, keep_last=1)
    sum(loss_of(ref2, x) for x in ids).backward()
    sum(loss_of(model2, x) for x in ids).backward()
    assert_bitwise(grads(model2), grads(ref2))
    assert ckpt_offload.stats()["host_in_use_bytes"] == 0


def test_retain_graph_second_backward():
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    loss = loss_of(model, make_batch())
    loss.backward(retain_graph=True)
    first = grads(model)
    loss.backward()
    for k, g in grads(model).items():
        torch.testing.assert_close(g, 2 * first[k])


def test_no_grad_and_inference_mode_are_noops():
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=True)
    with torch.no_grad():
        a = model(make_batch())
    with torch.inference_mode():
        b = model(make_batch())
    assert torch.equal(a, b)
    assert ckpt_offload.stats()["tensors_offloaded"] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_matches_plain_checkpointing(dtype):
    ids = make_batch()
    out = {}
    for offload in (False, True):
        model = make_model()
        ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=offload, keep_last=1)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_of(model, ids)
        loss.backward()
        out[offload] = grads(model)
    assert_bitwise(out[True], out[False])
    assert ckpt_offload.stats()["bytes_offloaded"] > 0


def test_disable_restores_the_model_exactly():
    model = make_model()
    ids = make_batch()
    before = model(ids)
    forwards = [type(b).forward for b in model.blocks]
    ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True)
    assert all(ckpt_offload.attachment.SLOT in b.__dict__ for b in model.blocks[::2])
    ckpt_offload.disable_checkpointing(model)
    assert not any(ckpt_offload.attachment.SLOT in b.__dict__ or type(b) is not ckpt_offload.attachment.base_class(type(b)) for b in model.blocks)
    assert not model._forward_hooks and ckpt_offload.checkpointing_state(model) is None
    assert [type(b).forward for b in model.blocks] == forwards
    assert torch.equal(model(ids), before)
    ckpt_offload.disable_checkpointing(model)  # no-op when not enabled


def test_enable_twice_reconfigures():
    model = make_model()
    assert ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True) == [0, 2, 4]
    assert ckpt_offload.enable_checkpointing(model, every_n_layers=3, offload=False) == [0, 3]
    assert [(ckpt_offload.attachment.SLOT in b.__dict__) for b in model.blocks] == [True, False, False, True, False, False]
    loss_of(model, make_batch()).backward()
    assert ckpt_offload.stats()["bytes_offloaded"] == 0  # the second call has offload off
    assert len(model._forward_hooks) == 0


def test_a_user_instance_forward_is_kept():
    model = make_model()
    block = model.blocks[0]
    calls = []
    original = block.forward

    def traced(x):
        calls.append(1)
        return original(x)

    block.forward = traced
    ckpt_offload.enable_checkpointing(model, offload=True)
    loss_of(model, make_batch()).backward()
    assert len(calls) == 2  # forward and recompute
    ckpt_offload.disable_checkpointing(model)
    assert block.forward is traced


def test_explicit_layers_and_errors():
    model = make_model()
    assert ckpt_offload.enable_checkpointing(model, layers=[model.blocks[1], model.blocks[4]], offload=True, keep_last=0) == [0, 1]
    loss_of(model, make_batch()).backward()
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * INPUT_BYTES
    with pytest.raises(ValueError, match=r"no repeated blocks found in Linear: searched for transformers"):
        ckpt_offload.enable_checkpointing(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ckpt_offload.enable_checkpointing("model")
    with pytest.raises(TypeError, match=r"layers\[1\] is a int: layers must be all nn.Module blocks or all int"):
        ckpt_offload.enable_checkpointing(model, layers=[model.blocks[0], 3])
    with pytest.raises(ValueError, match="every_n_layers must be an int >= 1, got 0"):
        ckpt_offload.enable_checkpointing(model, every_n_layers=0)
    with pytest.raises(TypeError, match="every_n_layers must be an int >= 1"):
        ckpt_offload.enable_checkpointing(model, every_n_layers=2.0)
    with pytest.raises(ValueError, match="keep_last=4 is larger than the 3 checkpointed layers"):
        ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=True, keep_last=4)


def test_find_repeated_blocks_picks_longest_run():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            self.body = torch.nn.ModuleList([torch.nn.ReLU(), *[torch.nn.Linear(2, 2) for _ in range(3)], torch.nn.Tanh()])

    m = M()
    assert ckpt_offload.find_repeated_blocks(m) == list(m.body[1:4])
    assert ckpt_offload.find_repeated_blocks(torch.nn.Linear(2, 2)) == []


# ---------------------------------------------------------------------------------------------
# offload_activations() and prefetch


@pytest.mark.parametrize("device", DEVICES)
def test_offload_activations_context(device):
    ids = make_batch(device=device)
    _, unmodified = reference_grads(device, ids=ids)
    ckpt_offload.reset_stats()
    model = make_model(device=device)
    with ckpt_offload.offload_activations(min_bytes=1024):
        loss = loss_of(model, ids)
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] > 10 and s["host_in_use_bytes"] == s["bytes_offloaded"]
    loss.backward()
    assert_bitwise(grads(model), unmodified)
    s = ckpt_offload.stats()
    assert s["host_in_use_bytes"] == 0 and s["tensors_fetched"] == s["tensors_offloaded"]


def test_offload_activations_never_moves_parameters_or_small_tensors():
    lin = torch.nn.Linear(256, 256)  # weight: 256 KiB, well above min_bytes
    leaf = torch.randn(4, 256, requires_grad=True)
    x = leaf * 1  # an activation; the leaf itself is held by the caller and never moved
    with ckpt_offload.offload_activations(min_bytes=1024):
        y = lin(x)
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == 4 * 256 * 4  # only x (the saved input); not the weight
    y.sum().backward()
    with ckpt_offload.offload_activations(min_bytes=1 << 30):
        lin(leaf * 1).sum().backward()
    assert ckpt_offload.stats()["tensors_offloaded"] == 1


def test_offload_activations_keep_last_and_shared_storage():
    x = torch.randn(64, 64, requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0, keep_last=1):  # x is a leaf: never moved
        a = x.exp()  # saves its result
        b = a * a  # saves a twice: one copy
        c = b.sin()  # saves b: the last one, kept on the device
    s = ckpt_offload.stats()
    assert s["bytes_offloaded"] == 64 * 64 * 4 and s["shared_views"] == 2
    c.sum().backward()
    expected = torch.autograd.grad((x.exp() ** 2).sin().sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_offload_activations_argument_errors():
    with pytest.raises(ValueError, match="min_bytes must be an int >= 0, got -1"):
        ckpt_offload.offload_activations(min_bytes=-1)
    with pytest.raises(TypeError, match="keep_last must be an int"):
        ckpt_offload.offload_activations(keep_last="2")
    ctx = ckpt_offload.offload_activations()
    with ctx:
        with pytest.raises(RuntimeError, match="already active"):
            ctx.__enter__()


def _packed_session(n, prefetch, prefetch_bytes=None):
    session = ckpt_offload.OffloadSession(prefetch=prefetch, prefetch_bytes=prefetch_bytes)
    xs = [torch.full((256,), float(i)) * 1 for i in range(n)]  # non-leaf, 1 KiB each
    packed = []
    for x in xs:
        session.next_layer()  # one layer each, as one checkpoint call each would be
        packed.append(session.pack(x))
    return session, xs, packed


def test_what_pack_returns_is_a_packed_with_its_copy_and_versions():
    session = ckpt_offload.OffloadSession()
    x = torch.randn(16, 64) * 1
    session.next_layer()
    p = session.pack(x)
    assert type(p) is ckpt_offload._C.Packed and repr(p) == f"<ckpt_offload Packed seq=0 group={p.group} offloaded>"
    assert p.copy == (torch.float32, x.device, [16, 64]) and p.kept is None and p.record.nbytes == 16 * 64 * 4
    assert p.source is x and p.version == p.current_version == x._version
    packed_value = x.clone()
    session.poll()  # the producer waits for the copy before writing x (what allow_cache_entry_mutation does)
    x.add_(1)
    assert p.current_version == p.version + 1  # the version counter of x, followed after the copy
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        session.unpack(p)
    p.version = p.current_version  # what allow_cache_entry_mutation does (policies)
    assert torch.equal(session.unpack(p), packed_value)  # the copy: the value packed
    with pytest.raises(TypeError, match="an int is needed, got str"):
        p.version = "1"
    with pytest.raises(TypeError, match="an int is needed, got bool"):
        p.version = True
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del p.version
    with pytest.raises(AttributeError):
        p.seq = 3
    with pytest.raises(TypeError, match="cannot create"):
        type(p)()
    with pytest.raises(TypeError):
        type("Sub", (type(p),), {})
    kept = session.pack_kept(x)
    assert kept.kept is x and kept.record is None and kept.copy is None and "on the device" in repr(kept)
    assert session.unpack(kept) is x
    with pytest.raises(TypeError, match="expected a Packed, got int"):
        session.unpack(3)
    with pytest.raises(TypeError, match="expected a tensor"):
        session.pack(3)


def test_prefetch_depth_in_layers():
    session, xs, packed = _packed_session(6, prefetch=2)
    assert ckpt_offload.stats()["tensors_offloaded"] == 6
    out = session.unpack(packed[5])  # backward starts with the newest
    assert torch.equal(out, xs[5])
    states = [p.record.handle.state for p in packed]
    # The fetched one keeps its host copy (on_host) until its record dies: a retained graph reloads it.
    assert states == ["on_host", "on_host", "on_host", "prefetching", "prefetching", "on_host"]
    session.unpack(packed[4])  # keeps two in flight: 3 (already) and 2 (new)
    assert ckpt_offload.stats()["tensors_prefetched"] == 4
    for i in (3, 2, 1, 0):
        assert torch.equal(session.unpack(packed[i]), xs[i])
    assert ckpt_offload.stats()["tensors_prefetched"] == 6


def test_kept_tensor_starts_the_reloads_before_it():
    # keep_last layers stay on the device, but backward reaching them starts the earlier reloads.
    session, xs, packed = _packed_session(4, prefetch=2)
    last = torch.full((256,), 9.0) * 1
    kept = session.pack_kept(last)
    assert ckpt_offload.stats()["tensors_offloaded"] == 4
    assert session.unpack(kept) is last
    states = [p.record.handle.state for p in packed]
    # Not yet reloaded: on the host, or still on its way there under an asynchronous runtime.
    assert all(st in ("offloading", "on_host") for st in states[:2])
    assert states[2:] == ["prefetching", "prefetching"]


def test_model_keep_last_layer_prefetches_during_its_backward():
    """PITFALLS 10: the last layer stays on the device (keep_last) and its backward starts the reload of the
    layer before. Fails where the last layer is offloaded and reloaded at once, or no prefetch overlaps its
    backward."""
    model = make_model()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1, prefetch=2)
    seen = []
    # When backward reaches block 4, block 5 (kept) has unpacked its input: the reloads of blocks
    # 4 and 3 are already on their way, before block 4 needs its own.
    model.blocks[-2].register_full_backward_pre_hook(lambda *_: seen.append(ckpt_offload.stats()["tensors_prefetched"]))
    loss_of(model, make_batch()).backward()
    assert seen == [2]


def test_prefetch_depth_in_bytes():
    session, xs, packed = _packed_session(6, prefetch=10, prefetch_bytes=2048)
    session.unpack(packed[5])
    assert ckpt_offload.stats()["tensors_prefetched"] == 3  # itself + 2 KiB ahead
    session2, _, packed2 = _packed_session(3, prefetch=0)
    session2.unpack(packed2[2])
    assert ckpt_offload.stats()["tensors_prefetched"] == 4  # prefetch=0: only on demand


# ---------------------------------------------------------------------------------------------
# GPU


def _gpu_model(layers=4, hidden=256):
    return make_model(device="cuda", hidden=hidden, heads=4, layers=layers, max_len=512)


def _deterministic_attention():
    """For bitwise comparisons of two GPU runs: SDPA's memory-efficient backward (the fp32 choice
    on CUDA) splits the keys over thread blocks beyond 64 keys and adds their partial dq with
    atomics, so two identical runs differ in the last bits at these sequence lengths. The math
    backend is deterministic. Forward and backward must both run inside (checkpoint recomputes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _requested_device_bytes():
    """Bytes the live device tensors asked for. memory_allocated() counts allocator blocks, and a
    reused cached block can be up to 1 MiB larger than the request, differently in each run."""
    stats = torch.cuda.memory_stats()
    return stats.get("requested_bytes.all.current", torch.cuda.memory_allocated())


def _forward_device_bytes(model, ids):
    """A warm-up step, then one forward of model on ids: (its loss, the device bytes the forward
    added once its copies are done and sources dropped, the bytes it offloaded)."""
    loss_of(model, ids).backward()  # warm-up: cuBLAS workspaces exist before the baseline
    model.zero_grad(set_to_none=True)
    # A previous model (its wrapped forwards form reference cycles) must go now, not in an
    # automatic collection between the two measurements.
    gc.collect()
    torch.cuda.synchronize()
    ckpt_offload.synchronize()
    base = _requested_device_bytes()
    ckpt_offload.reset_stats()
    loss = loss_of(model, ids)
    ckpt_offload.synchronize()  # copies done, sources dropped
    gc.collect()
    return loss, _requested_device_bytes() - base, ckpt_offload.stats()["bytes_offloaded"]


@pytest.mark.gpu
@requires_cuda
def test_gpu_memory_after_forward_drops_by_offloaded_bytes():
    ids = make_batch(device="cuda", batch=4, seq=512)
    used = {}
    for offload in (False, True):
        model = _gpu_model(layers=6)
        ckpt_offload.enable_checkpointing(model, offload=offload, keep_last=1)
        loss, used[offload], moved = _forward_device_bytes(model, ids)
        loss.backward()
        del loss, model
    assert moved == 5 * 4 * 512 * 256 * 4
    assert used[False] - used[True] == moved


def _gpu_reference_and_offloaded(ids):
    """Gradients of plain checkpointing on ids, and a fresh same-weights model with offload on."""
    ref = _gpu_model()
    ckpt_offload.enable_checkpointing(ref, offload=False)
    loss_of(ref, ids).backward()
    model = _gpu_model()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    return grads(ref), model


@pytest.mark.gpu
@requires_cuda
def test_gpu_bitwise_over_many_steps_with_busy_stream():
    ids = make_batch(device="cuda", batch=4, seq=256)
    with _deterministic_attention():
        expected, model = _gpu_reference_and_offloaded(ids)
        for step in range(50):
            model.zero_grad(set_to_none=True)
            torch.cuda._sleep(1_000_000)  # the compute stream lags far behind the host
            loss = loss_of(model, ids)
            torch.cuda._sleep(1_000_000)
            loss.backward()
            got = grads(model)
            for k in expected:
                assert torch.equal(got[k], expected[k]), (step, k)


@pytest.mark.gpu
@requires_cuda
def test_gpu_forward_under_user_stream():
    """PITFALLS 3, 12: forward under a user stream: the copies order after that stream, looked up at each
    pack and unpack. Fails where the stream is cached at start-up or the copy ordered after the default
    stream only."""
    ids = make_batch(device="cuda", batch=2, seq=128)
    with _deterministic_attention():
        expected, model = _gpu_reference_and_offloaded(ids)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            loss = loss_of(model, ids)
            loss.backward()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
    got = grads(model)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


@pytest.mark.gpu
@requires_cuda
def test_gpu_steady_state_step_has_no_host_sync():
    """PITFALLS 8: a steady-state step under torch.cuda.set_sync_debug_mode('error'). Fails on any hidden
    host synchronisation."""
    ids = make_batch(device="cuda", batch=2, seq=128)
    model = _gpu_model()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    for _ in range(3):
        loss_of(model, ids).backward()
    torch.cuda.synchronize()
    allocs = ckpt_offload.stats()["host_alloc_calls"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(ids).float().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert ckpt_offload.stats()["host_alloc_calls"] == allocs


def test_torch_compile_matches_compiled_plain_checkpointing():
    # Either compiled offload works and matches, or it must fail loudly; it must never be silently
    # wrong or silently skip the offload.
    ids = make_batch()
    out = {}
    for offload in (False, True):
        torch._dynamo.reset()
        model = make_model()
        ckpt_offload.enable_checkpointing(model, every_n_layers=2, offload=offload, keep_last=1)
        loss_of(torch.compile(model, backend="aot_eager"), ids).backward()
        out[offload] = grads(model)
    assert_bitwise(out[True], out[False])
    assert ckpt_offload.stats()["bytes_offloaded"] == 2 * INPUT_BYTES


def test_conjugate_and_negative_views_stay_on_device_and_stay_right():
    x = torch.randn(32, 32, dtype=torch.complex64, requires_grad=True)
    y = torch.randn(32, 32, requires_grad=True)
    with ckpt_offload.offload_activations(min_bytes=0):
        a = (x * 1).conj()  # lazy conjugate: offloading raw bytes would lose it
        b = torch._neg_view(y * 1)
        out = (a * a).real.sum() + (b * b).sum()
    out.backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    a = (x * 1).conj()
    b = torch._neg_view(y * 1)
    ((a * a).real.sum() + (b * b).sum()).backward()
    assert torch.equal(gx, x.grad) and torch.equal(gy, y.grad)
    with pytest.raises(ValueError, match="conjugate or negative bit"):
        ckpt_offload.CopyEngine("cpu", ckpt_offload.HostPool(pinned=False)).offload(torch.randn(3, dtype=torch.complex64).conj())


def test_keep_last_context_prefetches_the_first_tensor_backward_needs():
    xs = [torch.full((256,), float(i)) * 1 for i in range(4)]
    session = ckpt_offload.OffloadSession(keep_last=1, prefetch=1, prefetch_unit="tensor")
    packed = [session.pack(x) for x in xs]  # 0, 1, 2 offloaded; 3 waits on the device
    assert [p.kept is None for p in packed] == [True, True, True, False]
    assert session.unpack(packed[3]) is xs[3]
    # Reaching the kept tensor starts the reload of the newest offloaded one, not an older one.
    states = [p.record.handle.state for p in packed[:3]]
    assert all(st in ("offloading", "on_host") for st in states[:2]) and states[2] == "prefetching"


class _MaskedBlock(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.a = torch.nn.Linear(h, h)
        self.b = torch.nn.Linear(h, h)

    def forward(self, x, mask):
        return x + self.b(torch.tanh(self.a(x)) * mask)


class _MaskedStack(torch.nn.Module):
    def __init__(self, n=5, h=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(_MaskedBlock(h) for _ in range(n))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_prefetch_counts_layers_and_a_shared_input_comes_back_with_its_last_user(test_cpu):
    """PITFALLS 25: an input shared by two layers is unpacked out of pack order: it comes back with its last
    user, and prefetch counts layers. Fails where prefetch assumes reverse pack order."""
    # Two positional inputs per layer, one of them (a mask) the same tensor in every layer: it is
    # copied once and reloaded ahead of the last layer that uses it, so no reload waits.
    torch.manual_seed(0)
    model = _MaskedStack()
    ref = _MaskedStack()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 16, requires_grad=True)
    mask = (torch.rand(4, 16) > 0.5).float() * 1
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1, prefetch=1)
    ckpt_offload.reset_stats()
    model(x, mask).square().sum().backward()
    s = ckpt_offload.stats()
    assert s["tensors_offloaded"] == 4 + 1 and s["shared_views"] == 3  # 4 inputs, the mask once
    assert s["reloads_on_demand"] == 0 and s["tensors_prefetched"] == 5
    gx = x.grad.clone()
    x.grad = None
    ref(x, mask).square().sum().backward()
    assert torch.equal(gx, x.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
