"""Midpoints: start a checkpointed layer's reloads of earlier layers from the middle of its backward."""
from __future__ import annotations

import functools
import threading

import torch
import torch.utils._pytree

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

    def __init__(self, session, blocks):
        self.session = session
        session.defer_prefetch = True  # reload points wait for the midpoints from now on
        self.mid = {}  # block -> its midpoint child, once the first forward has shown the order
        self._tls = threading.local()  # .calls: {block: [(child, node)]}; .armed: set of blocks
        self.handles = []
        self._child_hooks = {}  # block -> [(child, handle)]: all until the midpoint is known, then its own
        for b in blocks:
            kids = list(b.children())
            self.handles.append(b.register_forward_pre_hook(self._block_pre))
            # always_call: a forward that raises still ends the learning, so the nodes it kept go.
            self.handles.append(b.register_forward_hook(self._block_post, always_call=True))
            hooks = self._child_hooks[b] = []
            for c in kids:
                hooks.append((c, c.register_forward_hook(functools.partial(self._child_post, b))))
                self.handles.append(hooks[-1][1])

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_tls"]  # this thread's forward in progress: not a copy's
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tls = threading.local()

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

    def _block_pre(self, block, args):
        if _off(self.session) or _in_backward():
            return
        tls = self._state()
        if block in self.mid:
            tls.armed.add(block)
        else:
            tls.calls[block] = []

    def _child_post(self, block, child, args, out):
        if _off(self.session) or _in_backward() or not torch.is_grad_enabled():
            return
        tls = self._state()
        if block in tls.calls:  # this thread's forward is learning the order (first forward)
            tls.calls[block].append((child, _grad_node(out)))
        elif block in self.mid:
            # The midpoint's first call only: a child called twice (one dropout module for both
            # branches) would otherwise also fire at the start of the backward.
            if child is self.mid[block] and block in tls.armed:
                tls.armed.discard(block)
                node = _grad_node(out)
                if node is not None:
                    node.register_prehook(self._fire)

    def _block_post(self, block, args, out):
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
        nodes[order[i]].register_prehook(self._fire)  # this forward's midpoint too
        # Only the midpoint's hook is needed from now on: the other children's go, once per block
        # (a module with no hooks runs torch's fast call path, in the forward and in the recompute).
        for child, handle in self._child_hooks.pop(block, ()):
            if child is not order[i]:
                handle.remove()

    def _fire(self, grad_outputs):
        # Autograd reached the midpoint's node: start the reloads this layer's backward deferred.
        self.session.flush_prefetch()


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
