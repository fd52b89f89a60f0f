"""The API reference (docs/reference/*.md, rendered by mkdocstrings) documents every public name:
each name in ckpt_offload.__all__ and each public function or class of the integrations has a
`::: dotted.path` directive that resolves to that very object. No network, no site build."""
import glob
import importlib
import inspect
import os
import pkgutil
import re
import sys

import pytest

import ckpt_offload
import ckpt_offload.integrations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def directives():
    """Every `::: dotted.path` of the reference pages."""
    paths = []
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "reference", "*.md"))):
        with open(page) as f:
            paths += re.findall(r"^::: ([\w.]+)\s*$", f.read(), flags=re.M)
    return paths


def resolve(path):
    """The object a dotted path names as mkdocstrings renders it: the longest importable module prefix,
    then attributes. A submodule wins over a package attribute of the same name (`ckpt_offload.timeline`
    is the module; its function is `ckpt_offload.timeline.timeline`)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def documented():
    """{id(object): path} of everything the reference documents."""
    return {id(resolve(p)): p for p in directives()}


def public_names(module):
    """A module's __all__, else the functions and classes it defines without a leading underscore."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n, o in vars(module).items()
            if not n.startswith("_") and (inspect.isfunction(o) or inspect.isclass(o))
            and o.__module__ == module.__name__]


def integration_modules():
    names = [m.name for m in pkgutil.iter_modules(ckpt_offload.integrations.__path__)]
    assert names, "no integration modules found"
    return names


def test_every_directive_resolves():
    # A typo in a directive would otherwise only show when the site is built.
    for path in directives():
        resolve(path)


def test_reference_documents_all_of_ckpt_offload():
    docs = documented()
    missing = [n for n in ckpt_offload.__all__ if id(getattr(ckpt_offload, n)) not in docs]
    assert missing == [], f"names of ckpt_offload.__all__ missing from docs/reference/: {missing}"


@pytest.mark.parametrize("name", integration_modules())
def test_reference_documents_every_integration(name):
    try:
        module = importlib.import_module(f"ckpt_offload.integrations.{name}")
    except ImportError as err:
        pytest.skip(f"ckpt_offload.integrations.{name} needs an optional dependency: {err}")
    names = public_names(module)
    assert names, f"ckpt_offload.integrations.{name} has no public functions"
    docs = documented()
    missing = [n for n in names if id(getattr(module, n)) not in docs]
    assert missing == [], f"public names of ckpt_offload.integrations.{name} missing from docs/reference/: {missing}"


def test_the_check_sees_a_missing_name(tmp_path, monkeypatch):
    # The check itself: a reference without one of the names reports exactly that name.
    pages = tmp_path / "docs" / "reference"
    pages.mkdir(parents=True)
    (pages / "index.md").write_text("::: ckpt_offload.stats\n\n::: ckpt_offload._C.HostPool\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    docs = documented()
    assert id(ckpt_offload.stats) in docs and id(ckpt_offload.HostPool) in docs
    assert id(ckpt_offload.reset_stats) not in docs
