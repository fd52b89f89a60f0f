"""The API reference (docs/reference/*.md, written from the docstrings by scripts/api_reference.py)
documents every public name: each name in ckpt_offload.__all__ and each public function or class of
the integrations has a `<!-- ::: dotted.path -->` marker that resolves to that very object, and what
the pages say is what the docstrings say now. No network, no site build."""
import glob
import importlib
import importlib.util
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
    """Every `<!-- ::: dotted.path -->` marker of the reference pages."""
    paths = []
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "reference", "*.md"))):
        with open(page) as f:
            paths += re.findall(r"^<!-- ::: ([\w.]+)(?: \w+=\w+)* -->$", f.read(), flags=re.M)
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
    (pages / "index.md").write_text("<!-- ::: ckpt_offload.stats -->\n<!-- /::: -->\n\n"
                                    "<!-- ::: ckpt_offload._C.HostPool -->\n<!-- /::: -->\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    docs = documented()
    assert id(ckpt_offload.stats) in docs and id(ckpt_offload.HostPool) in docs
    assert id(ckpt_offload.reset_stats) not in docs


def api_reference():
    spec = importlib.util.spec_from_file_location("api_reference", os.path.join(ROOT, "scripts", "api_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pages_say_what_the_docstrings_say():
    # GitHub shows the pages as committed: they must be the script's output for today's docstrings.
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "reference", "*.md"))):
        with open(path) as f:
            text = f.read()
        assert api_reference().page(text) == text, (
            f"{os.path.relpath(path, ROOT)} is not current: run python scripts/api_reference.py")


def test_a_changed_docstring_makes_the_page_stale(monkeypatch):
    ref = api_reference()
    with open(os.path.join(ROOT, "docs", "reference", "index.md")) as f:
        text = f.read()
    assert "Everything below here is new." not in text
    monkeypatch.setattr(ckpt_offload.reset_stats, "__doc__", "Everything below here is new.")
    rendered = ref.page(text)
    assert rendered != text and "Everything below here is new." in rendered
    # Only the block of the changed function moved.
    block = re.compile(r"<!-- ::: ckpt_offload.reset_stats -->.*?<!-- /::: -->", re.S)
    assert block.sub("", rendered) == block.sub("", text)
