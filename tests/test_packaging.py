"""The packaging metadata, checked without building: pyproject.toml's dependencies are what
`import ckpt_offload` needs and no more, every third-party import of the tests and benchmarks is in
an extra, `dev` is every extra, the version is written once, and the sdist's manifest carries every
header of csrc/ (scripts/check_dist.sh builds and installs the real thing)."""
import ast
import glob
import os
import re
import runpy
import sys

import pytest

import ckpt_offload
from ckpt_offload import _floor, _version

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import dev_requirements  # noqa: E402

sys.path.pop(0)

# An import name that differs from the distribution that provides it.
PROVIDED_BY = {"tokenizers": "transformers", "yaml": "pyyaml"}


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def name_of(requirement):
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def module_level_imports(path):
    """Top-level names imported by a file outside any function or class (inside if/try blocks too)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return names


def all_imports(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value.split(".")[0])
    return names


def test_dependencies_are_torch_at_the_floor_and_packaging():
    assert sorted(pyproject()["project"]["dependencies"]) == ["packaging", f"torch>={_floor.TORCH_MIN}"]


def test_the_package_imports_only_its_dependencies_at_module_level():
    allowed = {name_of(r) for r in pyproject()["project"]["dependencies"]} | {"ckpt_offload"}
    found = {}
    for path in glob.glob(os.path.join(ROOT, "ckpt_offload", "*.py")):
        for name in module_level_imports(path) - set(sys.stdlib_module_names) - allowed:
            found.setdefault(name, []).append(os.path.basename(path))
    assert found == {}, f"imported at module level but neither stdlib nor a dependency: {found}"


def test_tests_and_benchmarks_import_only_what_the_extras_provide():
    project = pyproject()["project"]
    # The build requirements count: the development venv has them (scripts/setup.sh installs them).
    provided = {name_of(r) for r in project["dependencies"] + pyproject()["build-system"]["requires"]}
    for extra in project["optional-dependencies"]:
        provided |= {name_of(r) for r in dev_requirements.extra(project, extra)}
    local = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "*", "*.py"))}
    local |= {"ckpt_offload", "benchmarks", "tests", "scripts"}
    missing = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        for name in all_imports(path) - set(sys.stdlib_module_names) - local:
            if PROVIDED_BY.get(name, name).lower().replace("_", "-") not in provided:
                missing.setdefault(name, []).append(os.path.relpath(path, ROOT))
    assert missing == {}, f"imported but in no extra of pyproject.toml: {missing}"


def test_dev_is_every_other_extra():
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    others = [r for name in extras if name != "dev" for r in extras[name]]
    assert sorted(set(dev_requirements.extra(project, "dev"))) == sorted(set(others))
    # What scripts/setup.sh installs: the build requirements, the dependencies and dev.
    reqs = dev_requirements.dev_requirements(pyproject())
    assert set(reqs) == set(pyproject()["build-system"]["requires"]) | set(project["dependencies"]) | set(others)
    assert "torch" not in {name_of(r) for r in pyproject()["build-system"]["requires"]}  # the installed one


def test_the_version_is_written_once():
    config = pyproject()
    assert "version" in config["project"]["dynamic"] and "version" not in config["project"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ckpt_offload._version.__version__"}
    assert ckpt_offload.__version__ is _version.__version__
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert not re.search(r"\bversion\s*=", f.read())
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        first = re.search(r"^## (\S+)", f.read(), flags=re.M).group(1)
    assert first == _version.__version__, "CHANGELOG.md's newest entry is not the package's version"
    # The docs site reads it too, through its hook.
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        assert re.search(r"^hooks:\n  - scripts/docs_version_hook\.py", f.read(), flags=re.M)
    hook = runpy.run_path(os.path.join(ROOT, "scripts", "docs_version_hook.py"))
    assert hook["on_config"]({"site_name": "ckpt_offload"})["site_name"] == f"ckpt_offload {_version.__version__}"


def test_license_is_apache_2_in_file_and_metadata():
    config = pyproject()["project"]
    assert config["license"] == "Apache-2.0" and config["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_console_script_is_the_dispatcher():
    assert pyproject()["project"]["scripts"] == {"ckpt-offload": "ckpt_offload.__main__:main"}


def test_the_manifest_carries_every_header_and_what_setup_py_imports(monkeypatch):
    from setuptools._distutils.filelist import FileList

    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "site", "build-cmake")]
        files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names]
    monkeypatch.chdir(ROOT)
    manifest = FileList()
    manifest.set_allfiles(files)
    with open(os.path.join(ROOT, "MANIFEST.in")) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                manifest.process_template_line(line)
    shipped = set(manifest.files)
    headers = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)}
    assert headers and headers <= shipped, sorted(headers - shipped)
    with open(os.path.join(ROOT, "setup.py")) as f:
        imported = re.findall(r"^from (_\w+) import", f.read(), flags=re.M)
    assert imported and {f"ckpt_offload/{m}.py" for m in imported} <= shipped
    assert {"LICENSE", "README.md", "CHANGELOG.md", "CMakeLists.txt", "ckpt_offload/_version.py",
            "csrc/tests/test_host_pool.cpp"} <= shipped
    assert not any(f.endswith((".so", "_build_info.py")) for f in shipped)
