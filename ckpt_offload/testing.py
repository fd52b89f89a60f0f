"""Testing aids. LiveBytes: the peak bytes of live CPU storages over a region, the CPU counterpart
of torch.cuda.max_memory_allocated for the host-only test path (tests and the CPU benchmark)."""
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """After every op, the storages of its outputs join the live set until they are freed; `peak`
    is the most bytes live at once. Storages that existed before are brought in with `add`."""

    def __init__(self):
        super().__init__()
        self._live = {}  # data pointer -> (weak reference, bytes)
        self.now = 0
        self.peak = 0

    def _drop_dead(self):
        for ptr in [p for p, (ref, _) in self._live.items() if ref.expired()]:
            self.now -= self._live.pop(ptr)[1]

    def add(self, tensors):
        self._drop_dead()
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter):
                s = t.untyped_storage()
                if s.data_ptr() and s.data_ptr() not in self._live:
                    self._live[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
                    self.now += s.nbytes()
        self.peak = max(self.peak, self.now)

    def current(self):
        self._drop_dead()
        return self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(tree_leaves(out))
        return out
