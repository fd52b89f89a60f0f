"""Host work that a step must not do: no torch.compiler.disable wrapper (a dynamo frame switch) per
layer where nothing compiles, and once the midpoints are known, no forward hook on a block's other
children (each would send that module through torch's slow call path, in forward and recompute)."""
import copy
import os
import sys

import pytest
import torch
from torch import nn

import ckpt_offload

pytestmark = pytest.mark.usefixtures("test_cpu")

PACKAGE = os.path.dirname(os.path.abspath(ckpt_offload.__file__))
DYNAMO = os.path.dirname(os.path.abspath(torch._dynamo.__file__))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make(layers=4):
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(layers)])


def dynamo_entries_from_the_package(fn):
    """How many times code of torch._dynamo (its disable wrappers) is called directly from
    ckpt_offload's own code while fn runs."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(DYNAMO):
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
                count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("offload", [True, False])
def test_eager_steps_enter_no_compile_boundary(offload):
    model = make()
    ckpt_offload.enable_checkpointing(model, offload=offload, keep_last=1)
    x = torch.randn(2, 8, 32, requires_grad=True)

    def step():
        model(x).square().sum().backward()

    step()  # the first step: the boundary's disabled function is made on first use
    ckpt_offload.reset_stats()
    assert dynamo_entries_from_the_package(step) == 0
    assert ckpt_offload.stats()["tensors_offloaded"] == (3 if offload else 0)  # the step did offload


def test_gradients_through_the_eager_boundary_are_bitwise_torchs():
    model, ref = make(), make()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    x = torch.randn(2, 8, 32)
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad()
            m(x.clone().requires_grad_()).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_no_child_keeps_a_hook_once_the_midpoint_is_learned():
    # The first forward learns the order of the children (a hook on each); from then on the
    # midpoint's node is found from the block's output by the learned path, and no module hook
    # runs, in the forward or in the recompute.
    model = make()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    mid = model._ckpt_offload.midpoints
    x = torch.randn(2, 8, 32, requires_grad=True)
    hooked = lambda b: [name for name, c in b.named_children() if c._forward_hooks]  # noqa: E731
    assert all(hooked(b) == ["norm", "up", "down"] for b in model)  # learning the order
    ckpt_offload.reset_stats()
    model(x).square().sum().backward()
    assert all(hooked(b) == [] and not b._forward_hooks and not b._forward_pre_hooks for b in model)
    assert all(mid.mid[b] == "up" for b in model)  # the middle of norm, up, down
    assert ckpt_offload.stats()["midpoint_misses"] == 0
    # Later forwards: the path leads to the node of up's output in that forward, and autograd
    # reaches it (one flush a checkpointed layer), so the reloads still start from the midpoints.
    from ckpt_offload.engine import _C

    ups, outs = {}, {}
    probes = [b.up.register_forward_hook(lambda m, a, o, b=b: ups.__setitem__(b, o.grad_fn)) for b in model]
    probes += [b.register_forward_hook(lambda m, a, o: outs.__setitem__(m, o.grad_fn)) for b in model]
    core = model._ckpt_offload.session._core
    out = model(x)
    for p in probes:
        p.remove()
    assert all(_C.NodePath(mid.path[b]).follow(outs[b]) is ups[b] for b in model)
    fired = core.fired
    out.square().sum().backward()
    assert core.fired - fired == len(model)  # the midpoint hooks autograd reached
    assert ckpt_offload.stats()["midpoint_misses"] == 0 and model._ckpt_offload.session.defer_prefetch
    for _ in range(2):
        model(x).square().sum().backward()
    assert ckpt_offload.stats()["midpoint_misses"] == 0
    ckpt_offload.disable_checkpointing(model)
    assert not any(c._forward_hooks for b in model for c in b.children())


class Branchy(nn.Module):
    """Three children; with flip set (per step: a recompute must build its forward's graph) a sin
    follows the middle one, so the path from the output to the midpoint passes another node."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.flip = False

    def forward(self, x):
        h = self.b(self.a(x))
        return self.c(h.sin() if self.flip else h) + x


def branchy_stack():
    """Three Branchy blocks checkpointed with offload, an untouched copy, and the midpoints."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Branchy() for _ in range(3)))
    ref = copy.deepcopy(model)
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    return model, ref, model._ckpt_offload.midpoints


def test_a_forward_that_builds_another_graph_reloads_from_its_start_and_learns_again():
    # The learned path names each node it passes: a forward whose block takes another branch does
    # not match it. That forward's reloads start where each such block's backward starts (no
    # midpoint goes unfired, nothing is switched off), the next forward learns the new order and
    # path, and its midpoints fire again; gradients stay exact throughout.
    model, ref, mid = branchy_stack()
    core = model._ckpt_offload.session._core
    x = torch.randn(4, 8, requires_grad=True)
    ckpt_offload.reset_stats()
    model(x).sum().backward()
    first = dict(mid.path)
    assert len(first) == 3 and all(mid.mid[b] == "b" for b in model)
    for m in (*model, *ref):
        m.flip = True
    for step in range(3):
        model.zero_grad()
        ref.zero_grad()
        fired = core.fired
        model(x).sum().backward()
        ref(x).sum().backward()
        assert core.fired - fired == len(model)  # every checkpointed block's hook fired
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
        if step == 0:  # mismatched: hooked at each block's output, the order to be learned again
            assert not mid.path and all(mid.relearned[b] == 1 for b in model)
            assert all([n for n, c in b.named_children() if c._forward_hooks] == ["a", "b", "c"] for b in model)
        else:  # learned again: a path through the sin, no module hook left
            assert all(mid.path[b] != first[b] for b in model) and all(mid.relearned[b] == 1 for b in model)
            assert not any(c._forward_hooks for b in model for c in b.children())
    assert ckpt_offload.stats()["midpoint_misses"] == 0 and model._ckpt_offload.session.defer_prefetch


def test_a_block_whose_graph_keeps_changing_settles_on_reloading_from_its_start():
    # A graph that alternates every forward never keeps a path: after _RELEARN fresh learnings the
    # block's hook stays on its output's node (its reloads start where its backward starts), with no
    # module hook and no miss; the gradients stay exact.
    from ckpt_offload.midpoints import _RELEARN

    model, ref, mid = branchy_stack()
    x = torch.randn(4, 8, requires_grad=True)
    ckpt_offload.reset_stats()
    for step in range(2 * _RELEARN + 4):
        for m in (*model, *ref):
            m.flip = step % 2 == 1
        model.zero_grad()
        ref.zero_grad()
        model(x).sum().backward()
        ref(x).sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert all(mid.relearned[b] == _RELEARN + 1 and mid.path[b] == () for b in model)
    assert not any(c._forward_hooks for b in model for c in b.children())
    assert ckpt_offload.stats()["midpoint_misses"] == 0 and model._ckpt_offload.session.defer_prefetch


def test_the_model_tensors_excluded_are_those_of_parameters_and_buffers():
    # The walk before each forward (one pass over the modules) must find what model.parameters()
    # and model.buffers() hold: shared modules once, None buffers skipped, freed storages by their
    # identity, a tensor subclass with a local tensor (a DTensor) by that local tensor.
    from ckpt_offload.session import _storage_ref

    class Local(torch.Tensor):
        pass

    model = make(3)
    shared = nn.Linear(4, 4)
    model.add_module("a", shared)
    model.add_module("b", shared)
    model.add_module("norm", nn.BatchNorm1d(4))  # 2 parameters, 3 buffers (running stats, a counter)
    model.register_buffer("nothing", None)
    model.register_buffer("freed", torch.zeros(8))
    model.freed.untyped_storage().resize_(0)
    local = torch.randn(5)
    sub = local.as_subclass(Local)
    sub._local_tensor = local
    model.a.register_buffer("sharded", sub)
    expected = {r.cdata for r in map(_storage_ref, (*model.parameters(), *model.buffers())) if r is not None}
    assert local.untyped_storage()._cdata in expected and len(expected) == 3 * 6 + 2 + 5 + 2
    session = ckpt_offload.OffloadSession()
    session.exclude_module_tensors(model)
    assert set(session.root_storages()) == expected
    assert not session._is_candidate(model.norm.running_mean)  # a buffer passed on as an input


def test_model_tensors_are_gathered_only_for_a_tensor_that_could_be_one():
    # An op's fresh output (what a block's forward gets) needs no lookup: the walk over the modules
    # happens once a forward packs a leaf or a view, and then serves the rest of that forward.
    model = make(3)
    model.register_buffer("table", torch.randn(8, 4))
    session = ckpt_offload.OffloadSession()
    session.test_cpu = True  # candidates on the CPU, as under CKPT_OFFLOAD_TEST_CPU=1
    session.exclude_module_tensors(model)
    x = torch.randn(2, 4, requires_grad=True)
    hidden = x * 2
    assert session._is_candidate(hidden)
    assert session._root_ptrs is None  # not gathered
    weight = next(model.parameters())
    assert not session._is_candidate(weight.detach())  # a weight's storage, as a plain leaf
    assert session._root_ptrs is not None
    assert not session._is_candidate(model.table[2:])  # a view of a buffer
    assert not session._is_candidate(model.table)
    assert session._is_candidate(x) and session._is_candidate(hidden[1:])  # an input and a view of an activation
    session.exclude_module_tensors(model)  # the next forward gathers anew
    assert session._root_ptrs is None
    model.table = torch.randn(8, 4)  # replaced between forwards
    assert not session._is_candidate(model.table)


def test_node_path_follows_built_in_and_custom_function_nodes_and_refuses_another_graph():
    from ckpt_offload.engine import _C

    class Triple(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 3

        @staticmethod
        def backward(ctx, g):
            return g * 3

    x = torch.randn(3, requires_grad=True)
    y = x * 2
    z = Triple.apply(y.sin()).cos()
    path = ((0, "TripleBackward"), (0, "SinBackward0"), (0, "MulBackward0"))
    assert _C.NodePath(path).follow(z.grad_fn) is y.grad_fn
    assert _C.NodePath(path[:1]).follow(z.grad_fn) is z.grad_fn.next_functions[0][0]  # a custom Function's node
    assert _C.NodePath(path[1:]).follow(z.grad_fn.next_functions[0][0]) is y.grad_fn  # from one
    assert _C.NodePath(()).follow(z.grad_fn) is z.grad_fn
    assert _C.NodePath(((0, "SinBackward0"),)).follow(z.grad_fn) is None  # another node's name
    assert _C.NodePath(((3, "TripleBackward"),)).follow(z.grad_fn) is None  # no such input
    assert _C.NodePath(path).follow(None) is None and _C.NodePath(path).follow(x) is None  # no node
    leaf = _C.NodePath(path + ((0, "torch::autograd::AccumulateGrad"),)).follow(z.grad_fn)
    assert leaf is not None and leaf.variable is x  # down to the leaf's accumulator


def test_an_offloaded_storage_keeps_its_key_while_the_handle_lives():
    """PITFALLS 21: an offloaded storage's key stays its own while its handle lives, so no new storage at
    that address can match its record. Fails where storages are identified by address alone."""
    # Records are found by storage_key (the storage's address): the handle holds the storage weakly,
    # so no new storage takes that address while a record of the old one can match (PITFALLS 21: a
    # reused address must never share a stale copy). Once the handle goes, the address is free again.
    from ckpt_offload.engine import _C

    eng = ckpt_offload.engine_for("cpu")
    x = torch.randn(16)
    key = _C.storage_key(x)
    assert key == x.untyped_storage()._cdata
    handle = eng.offload(x)
    assert handle.value == x._version
    x.add_(1)
    assert handle.value == x._version == 1  # the source's counter, read now
    eng.synchronize()
    del x
    seen = set()
    for _ in range(2000):  # same-sized storages: the allocator would hand the freed one out first
        seen.add(_C.storage_key(torch.randn(16)))
    assert key not in seen
    del handle
    kept = [torch.randn(16) for _ in range(2000)]
    assert key in {_C.storage_key(t) for t in kept}  # free again: the weak reference was what held it


def test_replicas_made_each_step_do_not_outlive_their_step():
    # What torch.nn.parallel.replicate does, on the CPU: every module copied with
    # _replicate_for_data_parallel (hooks and the attachment's slots shared), its parameters replaced
    # by non-leaf copies. The session notes a replica's model and the midpoints learn from replica
    # children, so neither may hold them past their step.
    import gc
    import weakref

    def replicate(root):
        copies = {m: m._replicate_for_data_parallel() for m in root.modules()}
        for m, r in copies.items():
            r._modules = {k: copies[c] for k, c in m._modules.items()}
            for k, p in m._parameters.items():
                object.__setattr__(r, k, p * 1)  # Broadcast's output: a non-leaf copy
        return copies[root]

    model = make()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    ckpt_offload.reset_stats()
    alive = []
    for _ in range(3):
        rep = replicate(model)
        refs = [weakref.ref(m) for m in rep.modules()]
        rep(torch.randn(2, 8, 32, requires_grad=True)).square().sum().backward()
        del rep
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
    assert alive == [0, 0, 0]
    assert ckpt_offload.stats()["tensors_offloaded"] == 3 * 3 and ckpt_offload.stats()["midpoint_misses"] == 0


def test_whole_block_offload_never_copies_weights_registered_by_functional_call():
    # Mode "offload" sees what ops save inside the block, weights among them; under
    # torch.func.functional_call with computed (non-leaf) weights those are ops' outputs, still
    # the model's tensors: looked up, never copied. Only the activations move.
    from torch.func import functional_call

    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(32, 32)
            self.norm = nn.LayerNorm(32)
            self.scale = nn.Parameter(torch.ones(32))

        def forward(self, x):  # layer_norm first: it saves its weight before anything asks for a lookup
            return self.a(self.norm(x) * self.scale)

    torch.manual_seed(0)
    model = nn.Sequential(Normed(), Normed())
    ref = copy.deepcopy(model)
    ckpt_offload.enable_block_modes(model, ["offload", "offload"])
    x0 = torch.randn(16, 32)
    x = x0.requires_grad_() * 1.0  # an op's output too: nothing asks for a lookup first
    params = {k: v * 1.0 for k, v in model.named_parameters()}  # an inner step's weights: non-leaf
    weights = {v.untyped_storage()._cdata for v in params.values()}
    out = functional_call(model, params, (x,))
    # What went to the host, by storage (a record's handle holds its source's storage weakly).
    moved = [r.handle.storage_key for r in model._ckpt_offload.whole._core.live_records()]
    assert moved and not weights & set(moved)
    out.sum().backward()
    functional_call(ref, {k: v * 1.0 for k, v in ref.named_parameters()}, (x0 * 1.0,)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def _package_calls(fn):
    """The ckpt_offload functions (file, name) Python enters on this thread while fn runs."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.append((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_once_learned_no_python_of_the_package_runs_per_saved_tensor_or_in_backward():
    # The hooks autograd calls (pack, unpack), the reload points, the prefetch and the midpoint hooks
    # are the extension's (csrc/session_core.cpp): in backward no ckpt_offload Python runs at all,
    # and in the forward only the block's checkpoint call does, nothing of the session per tensor.
    model, ref = make(), make()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    x = torch.randn(2, 8, 32, requires_grad=True)
    model(x).square().sum().backward()  # learns the midpoints
    model.zero_grad()
    core = model._ckpt_offload.session._core
    ckpt_offload.reset_stats()
    out = []
    forward = _package_calls(lambda: out.append(model(x)))
    fired = core.fired
    backward = _package_calls(lambda: out[0].square().sum().backward())
    assert backward == []
    # The session's Python in the forward: the model's own once-per-forward work, nothing per tensor.
    per_forward = {"exclude_module_tensors", "refuse_capture", "_gather_root", "root_storages", "_storage_ref"}
    assert {name for file, name in forward if file == "session.py"} <= per_forward, forward
    layer_calls = [c for c in forward if c == ("attachment.py", "_block_forward")]
    assert len(layer_calls) == len(model)
    # Per layer: the block's forward, its checkpoint call and the one call into the core that pushes
    # the hooks, runs torch's checkpoint, pops them and hooks the midpoint (SessionCore.run_layer).
    per_layer = [name for file, name in forward
                 if file in ("attachment.py", "checkpointing.py", "midpoints.py") and name not in ("attachment_before_forward", "attachment_after_forward")]
    assert per_layer == ["_block_forward", "_run", "run_learned"] * len(model), (per_layer, forward)
    assert ckpt_offload.stats()["tensors_offloaded"] == len(model) - 1  # the last one kept on the device
    assert core.fired - fired == len(model)  # every midpoint hook ran, in C++
    assert ckpt_offload.stats()["reloads_on_demand"] == 0  # every reload was started ahead, from a midpoint
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_compiled_autograd_leaves_the_midpoint_hooks_out_and_reloads_from_each_start():
    # A C++ midpoint hook has no compiled form: compiled autograd's backward runs without it. The
    # first reload point after a missed midpoint counts the miss and the session reloads from the
    # start of each layer's backward from then on; gradients are exact either way.
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    model, ref = make(), make()
    ckpt_offload.enable_checkpointing(model, offload=True, keep_last=1)
    x = torch.randn(2, 8, 32, requires_grad=True)
    model(x).square().sum().backward()  # learns the midpoints
    model.zero_grad()
    ckpt_offload.reset_stats()
    out = model(x)
    with compiled_autograd._enable(lambda graph: graph):  # the traced backward runs as it is
        out.square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert ckpt_offload.stats()["midpoint_misses"] == 1
    assert model._ckpt_offload.session.defer_prefetch is False
    assert ckpt_offload.stats()["tensors_fetched"] == len(model) - 1
