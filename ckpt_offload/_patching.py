"""Replacing a function that a framework's modules import by name, in each module that holds it, and
putting every reference back: the install()/uninstall() of the TRL and accelerate integrations."""
from __future__ import annotations

import sys


class NamePatch:
    """The function `name` of package `package`, replaced by ours in every loaded module of the
    package that holds it (and in `also`), while installed."""

    def __init__(self, package: str, name: str):
        self.package = package
        self.name = name
        self._installed = []  # [(the package's function, ours)] while installed

    def holders(self):
        """The package's modules loaded now (their __dict__ only: a lazy module is not imported)."""
        return [mod for key, mod in list(sys.modules.items())
                if mod is not None and (key == self.package or key.startswith(self.package + "."))]

    def install(self, original, routed, also=()):
        """Puts `routed` wherever `original` is held, and in each module of `also`."""
        for mod in [*also, *self.holders()]:
            if mod.__dict__.get(self.name) is original or any(mod is m for m in also):
                setattr(mod, self.name, routed)
        self._installed.append((original, routed))

    def uninstall(self) -> None:
        """The package's own function back wherever ours is held. No-op if not installed."""
        if not self._installed:
            return
        original, routed = self._installed.pop()
        for mod in self.holders():
            if mod.__dict__.get(self.name) is routed:
                setattr(mod, self.name, original)

    def installed(self) -> bool:
        return bool(self._installed)
