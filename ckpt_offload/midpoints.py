"""Midpoints: start a checkpointed layer's reloads of earlier layers from the middle of its backward."""
from __future__ import annotations

import collections
import functools
import threading

import torch
import torch.utils._pytree

from . import engine as _engine

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (a checkpoint's recompute, say)."""
    return _graph_task_id is not None and _graph_task_id() != -1


class Midpoints:
    """Moves where a checkpointed layer's backward starts the reloads of earlier layers: from its
    start to its middle.

    At its start the layer recomputes its forward, and its backward's largest tensors (the MLP's)
    come first: reloads started there sit on the device at that layer's memory peak, so each layer
    in flight costs its full input at the peak. From the middle, they arrive while the rest of the
    backward (attention, for a transformer block) still hides the copy, after the peak.

    The middle: the first forward records the order in which each block's direct children run;
    the midpoint is the child nearest the halfway point whose output has a gradient. In every
    forward (not in the recompute) a hook goes on the autograd node of the midpoint's output;
    autograd calls it halfway through the block's backward. A block without such a child, or a
    hook that does not fire, turns the session back to reloading from the start of each backward.
    """

    def __init__(self, session, blocks, start=True):
        self.session = session
        # Reload points wait for the midpoints from now on; start=False: from the next start() on (a
        # backward of a forward that ran before these hooks existed has no midpoint to wait for).
        self.waiting = not start
        if start:
            session.defer_prefetch = True
        # block -> the name of its midpoint child, once a forward has shown the order: names, not
        # modules, so DataParallel's replica children (which share these hooks) are not kept alive.
        self.mid = {}
        self.path = {}  # block -> how its midpoint's node is reached from its output's (see _path_to)
        self.walks = {}  # block -> its path as a _C.NodePath, which follows it in one call
        self.relearned = {}  # block -> how often a forward's graph did not match its path
        self._tls = threading.local()  # .calls: {block: [(name, node)]}; .armed: set of blocks
        self.handles = []
        self._child_hooks = {}  # block -> [(name, handle)]: all while learning, then none (or the midpoint's)
        for b in blocks:
            self._hook_children(b)

    def _hook_children(self, block):
        hooks = self._child_hooks[block] = []
        for name, c in block.named_children():
            hooks.append((name, c.register_forward_hook(functools.partial(self._child_post, block, name))))
            self.handles.append(hooks[-1][1])

    def start(self):
        """The reload points wait for the midpoints from here on (a Midpoints made with start=False)."""
        self.waiting = False
        self.session.defer_prefetch = True

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_tls"]  # this thread's forward in progress: not a copy's
        del state["walks"]  # made again from path
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tls = threading.local()
        self.walks = {}

    @staticmethod
    def usable(blocks) -> bool:
        """Every block has at least two children to find a middle between (and this torch tells
        a backward's recompute from a forward)."""
        return _graph_task_id is not None and all(len(list(b.children())) >= 2 for b in blocks)

    def remove(self):
        """Removes every hook this object installed (when the session detaches from the model)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def _state(self):
        tls = self._tls
        if not hasattr(tls, "calls"):
            tls.calls, tls.armed = {}, set()
        return tls

    # The block's own forward calls enter() and leave() around its checkpoint (the attachment runs
    # it): module hooks on the block would put every call of it on torch's slow call path.
    def enter(self, block):
        """A forward of block starts (not its recompute: that runs the body, not the block)."""
        if block in self.path or _off(self.session) or _in_backward():
            return  # learned, with a path: leave() finds the midpoint's node by itself
        tls = self._state()
        if block in self.mid:
            tls.armed.add(block)
        else:
            tls.calls[block] = []

    def _child_post(self, block, name, child, args, out):
        if _off(self.session) or _in_backward() or not torch.is_grad_enabled():
            return
        tls = self._state()
        if block in tls.calls:  # this thread's forward is learning the order
            tls.calls[block].append((name, _grad_node(out)))
        elif block in self.mid:
            # The midpoint's first call only: a child called twice (one dropout module for both
            # branches) would otherwise also fire at the start of the backward.
            if name == self.mid[block] and block in tls.armed:
                tls.armed.discard(block)
                node = _grad_node(out)
                if node is not None:
                    self.session.arm(node)

    def leave(self, block, out):
        """block's forward ended with out (None: it raised), the checkpoint around it included."""
        path = self.path.get(block)
        if path is not None:
            # The midpoint's node, found from the block's output by the path a forward learned:
            # no module hook runs, in the forward or in the recompute. (Called from the block's
            # eager checkpoint call only: never traced.)
            core = self.session._core
            if out is None or not core.defer or not torch.is_grad_enabled() or _graph_task_id() != -1:
                return  # the forward raised, midpoints are off, or this runs without a graph or in a backward
            walk = self.walks.get(block)
            if walk is None:
                walk = self.walks[block] = _engine._C.NodePath(path)
            armed = core.arm_path(walk, out)  # follows the path and hooks its node, in C++
            if armed != 1:
                self.rearm(block, out, armed)
            return
        if _off(self.session) or _in_backward():
            return
        tls = self._state()
        tls.armed.discard(block)
        calls = tls.calls.pop(block, None)
        if not calls or out is None:  # nothing learned, or the forward raised
            return
        order = list(dict.fromkeys(c for c, _ in calls))
        nodes = {}
        for c, node in calls:
            nodes.setdefault(c, node)  # the first call of each child
        middle = (len(order) - 1) / 2
        with_grad = [i for i, c in enumerate(order) if nodes[c] is not None]
        if not with_grad:
            # Nothing in this block carries a gradient to hook: reload from the start instead.
            self.session.defer_prefetch = False
            return
        i = min(with_grad, key=lambda j: (abs(j - middle), j))
        self.mid[block] = order[i]
        target = nodes[order[i]]
        self.session.arm(target)  # this forward's midpoint too
        path = _path_to(_grad_node(out), target)
        if path is not None:
            self.path[block] = path
            self.walks[block] = _engine._C.NodePath(path)
        # From now on the midpoint's node is found by its path from the output, or else through
        # the midpoint child's hook: the other children's hooks go, once per block (a module with
        # no hooks runs torch's fast call path, in the forward and in the recompute).
        for name, handle in self._child_hooks.pop(block, ()):
            if path is not None or name != order[i]:
                handle.remove()

    def rearm(self, block, out, armed):
        """A learned block's path did not lead to a node from out (SessionCore.arm_path's armed: 0, this
        graph does not match; -1, out is no plain tensor with a grad_fn)."""
        start = _grad_node(out)
        node = self.walks[block].follow(start) if armed == -1 else None
        if node is None:
            node = self._mismatch(block, start)
        if node is not None:
            self.session.arm(node)

    def _mismatch(self, block, start):
        """This forward's graph does not match block's path (another branch taken, autocast switched
        on): its reloads start where its backward starts (the hook goes on its output's node, so
        no reload point goes unflushed), and the next forward learns the order and the path anew,
        up to _RELEARN times a block; after that the block keeps reloading from its start."""
        n = self.relearned[block] = self.relearned.get(block, 0) + 1
        if n <= _RELEARN:
            del self.path[block], self.mid[block]
            self.walks.pop(block, None)
            self._hook_children(block)
        else:
            self.path[block] = ()  # its own output's node from now on
            self.walks.pop(block, None)
        return start


def _off(session) -> bool:
    # Traced by torch.compile (a compiled block body is one autograd node: no middle to hook), or
    # switched off for this session: the hooks do nothing, and tracing them breaks no graph.
    return torch.compiler.is_compiling() or not session.defer_prefetch


def _grad_node(out):
    """The autograd node of the first tensor in out that carries a gradient, else None."""
    if type(out) is torch.Tensor:  # the common case, without flattening a pytree
        return out.grad_fn if out.requires_grad else None
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
            return t.grad_fn
    return None


_SEARCH = 4096  # nodes a path search looks at, at most (once per block)
_RELEARN = 2  # forwards whose graph did not match a block's path, that send it back to learning


def _path_to(start, target):
    """How target is reached from start in the autograd graph: ((input index, node name), ...),
    each step the next_functions entry taken and the name of the node it leads to; the shortest
    such path (the graph between a block's output and its midpoint lies inside the block). None
    when target is not found within _SEARCH nodes."""
    if start is None:
        return None
    if start is target:
        return ()
    parents = {start: None}
    todo = collections.deque([start])
    while todo and len(parents) < _SEARCH:
        node = todo.popleft()
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None or nxt in parents:
                continue
            parents[nxt] = (node, k)
            if nxt is target:
                steps = []
                while parents[nxt] is not None:
                    prev, k = parents[nxt]
                    steps.append((k, nxt.name()))
                    nxt = prev
                return tuple(reversed(steps))
            todo.append(nxt)
    return None

