"""The declared floors against what is tested. `check`: every lower bound in pyproject.toml is either
pinned in constraints-floor.txt (scripts/test_floor.sh tests it) or equal to constraints.txt's pin
(the suite tests it), or named in UNTESTED_HERE with where it is tested. `verify`: the running
interpreter imports the floor releases, not the development venv's (the .pth overlay works).

Standard library only, but `packaging` (a dependency of ckpt_offload).
"""
import importlib.metadata
import os
import re
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dev_requirements import ROOT, dev_requirements, extra, load  # noqa: E402

# Floors too heavy for test_floor.sh's overlay (a second torch is several GB, and the extension is
# built against it): scripts/test_floor_torch.sh tests them, in a venv of its own, outside CI.
OWN_VENV = {"torch"}


def pins(name):
    out = {}
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
                if not m:
                    sys.exit(f"{name}: not a pin: {line!r}")
                out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def declared_floors():
    project = load()["project"]
    reqs = list(project["dependencies"])
    for name in project["optional-dependencies"]:
        if name != "dev":
            reqs += extra(project, name)
    floors = {}
    for text in reqs:
        req = Requirement(text)
        for spec in req.specifier:
            if spec.operator in (">=", "=="):
                floors[canonicalize_name(req.name)] = spec.version
    return floors


def check():
    floor, top = pins("constraints-floor.txt"), pins("constraints.txt")
    bad = []
    for name, version in declared_floors().items():
        if name in floor:
            if Version(floor[name]) != Version(version):
                bad.append(f"{name}: pyproject.toml's floor is {version}, constraints-floor.txt tests {floor[name]}")
            elif name in OWN_VENV:
                print(f"floors: {name}>={version} is tested by scripts/test_floor_torch.sh (not in CI)")
        elif name not in top or Version(top[name]) != Version(version):
            bad.append(f"{name}: pyproject.toml's floor {version} is tested nowhere (not in constraints-floor.txt, "
                       f"and constraints.txt pins {top.get(name)})")
    direct = {canonicalize_name(Requirement(r).name) for r in dev_requirements(load())}
    for name in floor:
        if name in direct and name not in declared_floors():
            bad.append(f"{name}: constraints-floor.txt pins it, but pyproject.toml declares no floor for it")
    if bad:
        sys.exit("floors:\n  " + "\n  ".join(bad))
    print("floors: pyproject.toml's floors are the tested ones")


def verify():
    want = {n: v for n, v in pins("constraints-floor.txt").items() if n not in OWN_VENV or "--all" in sys.argv}
    wrong = [f"{n}: {importlib.metadata.version(n)} imported, {v} wanted"
             for n, v in want.items() if Version(importlib.metadata.version(n).split("+")[0]) != Version(v)]
    if wrong:
        sys.exit("floors: this interpreter does not run the floor releases:\n  " + "\n  ".join(wrong))
    print("floors: running", ", ".join(f"{n} {v}" for n, v in want.items()))


if __name__ == "__main__":
    {"check": check, "verify": verify}[sys.argv[1]]()
