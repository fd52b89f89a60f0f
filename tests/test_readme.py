"""Every Python example in the README runs as written."""
import os
import re
import sys
import types

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def examples():
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_has_examples():
    assert len(examples()) >= 4


@pytest.mark.parametrize("index", range(len(examples())))
def test_readme_example_runs(index, tmp_path, monkeypatch):
    code = examples()[index]
    if "transformers" in code:
        pytest.importorskip("transformers", reason="transformers is an optional dependency")
    monkeypatch.chdir(tmp_path)
    # A module registered in sys.modules, as a script's __main__ is: torch.compile (dynamo) looks up
    # the module of the code it compiles by name.
    module = types.ModuleType("__readme__")
    monkeypatch.setitem(sys.modules, "__readme__", module)
    exec(compile(code, f"README example {index}", "exec"), module.__dict__)
