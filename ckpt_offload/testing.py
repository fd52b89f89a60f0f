"""Testing aids. LiveBytes: the peak bytes of live CPU storages over a region, the CPU counterpart
of torch.cuda.max_memory_allocated for the host-only test path (tests and the CPU benchmark)."""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """After every op, the storages of its outputs join the live set until they are freed; `peak`
    is the most bytes live at once. Storages that existed before are brought in with `add`.

    A storage leaves the set as it is freed: torch keeps a storage's Python object as long as the
    storage lives (however many tensors, views or saved tensors of autograd hold it), so a weak
    reference to that object is called back at the moment the storage goes. Each op costs the
    storages it makes, not the ones alive (a large model's thousands of weights)."""

    def __init__(self):
        super().__init__()
        self._live = {}  # key (data pointer) -> (weak reference to the storage object, bytes)
        self.now = 0
        self.peak = 0

    def _freed(self, key, ref):
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self.now -= entry[1]

    def _key(self, t):
        """The key a tensor's storage is counted under, or None where it is not counted: CPU
        storages, by address."""
        if t.device.type != "cpu":
            return None
        return t.untyped_storage().data_ptr() or None

    def add(self, tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter):
                key = self._key(t)
                if key is not None and key not in self._live:
                    s = t.untyped_storage()
                    ref = weakref.ref(s, lambda r, key=key: self._freed(key, r))
                    self._live[key] = (ref, s.nbytes())
                    self.now += s.nbytes()
        self.peak = max(self.peak, self.now)

    def current(self):
        return self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(tree_leaves(out))
        return out
