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

    def _key(self, t):
        """The key a tensor's storage is counted under, or None where it is not counted: CPU
        storages, by address."""
        if t.device.type != "cpu":
            return None
        return t.untyped_storage().data_ptr() or None

    def add(self, tensors):
        self._drop_dead()
        for t in tensors:
            if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter):
                key = self._key(t)
                if key is not None and key not in self._live:
                    s = t.untyped_storage()
                    self._live[key] = (StorageWeakRef(s), s.nbytes())
                    self.now += s.nbytes()
        self.peak = max(self.peak, self.now)

    def current(self):
        self._drop_dead()
        return self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(tree_leaves(out))
        return out
