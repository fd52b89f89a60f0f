"""The package's import graph, read from the source with `ast` (imports at module level and inside
functions, relative and absolute): arrows point down, so no module reaches back to one that imports
it, the planner never reaches the estimate, and the engine's budget readings pull in nothing above it."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ckpt_offload")


def modules():
    """{dotted name: (path, is a package)} of every module under ckpt_offload/, and the two the build
    makes (the compiled core and its build record), which import nothing of the package."""
    out = {"ckpt_offload._C": (None, False), "ckpt_offload._build_info": (None, False)}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                package = parts[-1] == "__init__"
                out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def graph():
    """{module: set of the package's modules its import statements run}. `from a.b import c` runs a.b,
    and a.b.c when c is a module; importing a.b.c runs the packages a and a.b first. A package that
    encloses the importer runs before it whoever imports it, so it counts only where it is imported
    for its names (`from .. import enable_checkpointing`, `import ckpt_offload`)."""
    mods = modules()
    edges = {}
    for name, (path, package) in mods.items():
        edges[name] = set()
        if path is None:
            continue
        here = name if package else name.rpartition(".")[0]  # the package relative imports start from
        targets = set()

        def add(target, for_names=True):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                m = ".".join(parts[:i])
                encloses = (name + ".").startswith(m + ".")
                if m in mods and m != name and (not encloses or for_names and i == len(parts)):
                    targets.add(m)

        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "ckpt_offload":
                        add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "ckpt_offload":
                    continue
                submodules = [a.name for a in node.names if f"{base}.{a.name}" in mods]
                add(base, for_names=len(submodules) < len(node.names))
                for sub in submodules:
                    add(f"{base}.{sub}")
        edges[name] = targets
    return edges


def reach(edges, start):
    seen, todo = set(), [start]
    while todo:
        for m in edges[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    edges = graph()
    # `from .. import planner as _planner` at the top of sizing/estimate.py, and the command's
    # `from .estimate import estimate_memory` inside a function.
    assert "ckpt_offload.planner" in edges["ckpt_offload.sizing.estimate"]
    assert "ckpt_offload.sizing.estimate" in edges["ckpt_offload.sizing.cli"]
    assert "ckpt_offload.sizing.hostmem" in edges["ckpt_offload.engine"]  # inside a function
    assert "ckpt_offload.sizing" in edges["ckpt_offload.engine"]  # the subpackage's __init__ runs first


def test_the_planner_does_not_reach_the_estimate():
    edges = graph()
    assert "ckpt_offload.sizing.estimate" in edges, "the estimate lives in ckpt_offload/sizing/estimate.py"
    assert "ckpt_offload.sizing.estimate" not in reach(edges, "ckpt_offload.planner")
    # Nor does anything below the planner, whatever route it takes.
    for below in ("ckpt_offload.engine", "ckpt_offload.session", "ckpt_offload.midpoints",
                  "ckpt_offload.checkpointing", "ckpt_offload.model", "ckpt_offload.policies"):
        assert "ckpt_offload.sizing.estimate" not in reach(edges, below), below


def test_no_import_cycle_among_the_modules():
    assert cycles(graph()) == []


def test_the_budget_readings_pull_in_nothing_above_the_engine():
    """In a fresh interpreter, ckpt_offload.sizing.budget and ckpt_offload.engine import only what lies
    beneath them. The package's __init__ imports every public name (plan_memory and estimate_memory
    among them) whichever submodule is imported, so it is left out here: the package is registered
    bare, with its folder as its path, and each module then runs its own imports alone."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('ckpt_offload'); pkg.__path__ = [{PACKAGE!r}]; sys.modules['ckpt_offload'] = pkg\n"
        "import importlib\n"
        "importlib.import_module(sys.argv[1])\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('ckpt_offload.'))))\n"
    )
    above = {"ckpt_offload.planner", "ckpt_offload.sizing.estimate", "ckpt_offload.sizing.cli",
             "ckpt_offload.session", "ckpt_offload.model", "ckpt_offload.checkpointing", "ckpt_offload.policies"}
    for module in ("ckpt_offload.sizing.budget", "ckpt_offload.sizing.hostmem", "ckpt_offload.engine"):
        p = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        loaded = set(p.stdout.split())
        assert module in loaded  # the module ran, from this package
        assert not loaded & above, f"importing {module} imported {sorted(loaded & above)}"
