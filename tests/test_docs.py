"""Every Python example in README.md and docs/ runs as written, and the output a page shows is the
output its code prints. A page's blocks run in order in one namespace; a block whose first line is
`# illustrative` is skipped; a ```text title="Output" block right after a python block is compared
with what that block printed."""
import contextlib
import glob
import io
import os
import re
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT_INFO = 'text title="Output"'
# Output with timings in it: each time (a decimal number that ends a line or comes before " ms", with
# the padding before it) is left out of the comparison; everything else must match.
TIMED_OUTPUT_INFO = 'text title="Output (times vary)"'
OUTPUTS = (OUTPUT_INFO, TIMED_OUTPUT_INFO)
# What the block before prints on a CPU without the test path (no GPU, CKPT_OFFLOAD_TEST_CPU unset),
# where it differs from the Output block before it: nothing is moved, and the page says so.
PLAIN_CPU_INFO = 'text title="Output on a plain CPU"'
ILLUSTRATIVE = "# illustrative"
OPTIONAL = ("transformers", "accelerate", "peft", "trl", "diffusers")  # a page that imports one is skipped without it


def pages():
    found = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                                recursive=True))
    return found


def fences(text):
    """[(info, body)] of every fenced block at the start of a line, in order."""
    out = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i].rstrip("\n"))
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        body = []
        i += 1
        while i < len(lines) and lines[i].rstrip("\n") != fence:
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"unclosed {fence} fence ({info!r})")
        out.append((info, "".join(body)))
        i += 1
    return out


def examples(page):
    """[(code, (output info, expected output) or None)] of a page's python blocks that run."""
    with open(os.path.join(ROOT, page)) as f:
        blocks = fences(f.read())
    runs = []
    for k, (info, body) in enumerate(blocks):
        if info in OUTPUTS:
            assert k > 0 and blocks[k - 1][0] == "python", f"{page}: an Output block must follow a python block"
            assert not blocks[k - 1][1].startswith(ILLUSTRATIVE), f"{page}: an Output block after an illustrative one"
        if info == PLAIN_CPU_INFO:
            assert k > 1 and blocks[k - 1][0] == OUTPUT_INFO, f"{page}: a plain-CPU Output block must follow an Output block"
        if info != "python" or body.startswith(ILLUSTRATIVE):
            continue
        follows = blocks[k + 1] if k + 1 < len(blocks) else None
        runs.append((body, follows if follows and follows[0] in OUTPUTS else None))
    return runs


def plain_cpu_outputs(page):
    """{index of a python block among examples(page): what a plain-CPU Output block shows for it}."""
    with open(os.path.join(ROOT, page)) as f:
        blocks = fences(f.read())
    out, index = {}, -1
    for k, (info, body) in enumerate(blocks):
        if info == "python" and not body.startswith(ILLUSTRATIVE):
            index += 1
        elif info == PLAIN_CPU_INFO:
            out[index] = body
    return out


def test_pages_have_examples():
    assert len(examples("README.md")) >= 2
    assert sum(len(examples(p)) for p in pages()) >= 20


def test_fence_parser_sees_output_blocks():
    # The checker itself: an Output block is tied to the python block before it; illustrative blocks are skipped.
    text = "```python\nprint(1)\n```\n\n```text title=\"Output\"\n1\n```\n```python\n# illustrative\nboom\n```\n"
    assert fences(text) == [("python", "print(1)\n"), (OUTPUT_INFO, "1\n"), ("python", "# illustrative\nboom\n")]
    # Times are masked only where the block says they vary, and nothing else is.
    shown = "0  none  0.63  1.27\nstep 22.66 ms, host 1.25 MiB"
    printed = "0  none  0.63  9.18\nstep 3.10 ms, host 1.25 MiB"
    assert comparable(shown, TIMED_OUTPUT_INFO) == comparable(printed, TIMED_OUTPUT_INFO)
    assert comparable(shown, OUTPUT_INFO) != comparable(printed, OUTPUT_INFO)
    assert comparable(shown, TIMED_OUTPUT_INFO) != comparable(shown.replace("0.63", "0.64"), TIMED_OUTPUT_INFO)


@pytest.mark.parametrize("page", [p for p in pages() if examples(p)])
def test_page_examples_run(page, tmp_path, monkeypatch):
    # The CPU test path: CPU tensors go through the pool and the engine, so that what the examples
    # print (bytes offloaded, layers offloaded) is what a GPU prints.
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
    run_page(page, tmp_path, monkeypatch, {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a plain CPU's output: this machine has a GPU")
@pytest.mark.parametrize("page", [p for p in pages() if plain_cpu_outputs(p)])
def test_page_examples_on_a_plain_cpu(page, tmp_path, monkeypatch):
    """The pages' plain-CPU Output blocks: the blocks run again without the test path (a new user's
    CPU), and what each such block shows is what its code prints there."""
    monkeypatch.delenv("CKPT_OFFLOAD_TEST_CPU", raising=False)
    run_page(page, tmp_path, monkeypatch, plain_cpu_outputs(page))


def run_page(page, tmp_path, monkeypatch, plain_cpu):
    """Runs a page's blocks in order; compares what each prints with its Output block, or with its
    plain-CPU Output block where `plain_cpu` ({block index: shown}) has one (and only those then)."""
    runs = examples(page)
    for name in OPTIONAL:
        if any(re.search(rf"^\s*(import|from) {name}\b", code, flags=re.M) for code, _ in runs):
            pytest.importorskip(name, reason=f"{name} is an optional dependency")
    if plain_cpu:
        runs = [(code, (OUTPUT_INFO, plain_cpu[i]) if i in plain_cpu else None) for i, (code, _) in enumerate(runs)]
    monkeypatch.chdir(tmp_path)
    # A module registered in sys.modules, as a script's __main__ is: torch.compile (dynamo) looks up
    # the module of the code it compiles by name.
    module = types.ModuleType("__docs__")
    monkeypatch.setitem(sys.modules, "__docs__", module)
    for index, (code, expected) in enumerate(runs):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{page}, python block {index}", "exec"), module.__dict__)
        if expected is not None:
            info, shown = expected
            assert comparable(printed.getvalue(), info) == comparable(shown, info), (
                f"{page}, python block {index}: the output shown differs from what it printed:\n{printed.getvalue()}")


def comparable(text, info):
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    if info == TIMED_OUTPUT_INFO:
        lines = [re.sub(r"\s*\d+\.\d+(?= ms|$)", " <time>", line) for line in lines]
    return lines


def _slug(heading):
    # GitHub's and MkDocs' anchor of a heading: lower case, punctuation dropped, spaces as hyphens.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    # mkdocs --strict checks the links inside docs/; the README's, which GitHub renders, are checked here.
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = os.path.join(ROOT, path)
        assert os.path.isfile(target), f"README.md links to {link}: no such file"
        if anchor:
            with open(target) as f:
                anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", f.read(), flags=re.M)}
            assert anchor in anchors, f"README.md links to {link}: no heading with that anchor"


# Pages with an "| argument | default | meaning |" table, and the function whose parameters it lists.
ARGUMENT_TABLES = {"docs/quickstart.md": "ckpt_offload.enable_checkpointing"}
TABLE_HEADER = "| argument | default | meaning |"


def argument_rows(text):
    """[(argument names, default cell)] of the argument table in `text` (a page or a docstring)."""
    lines = [line.strip() for line in text.splitlines()]
    start = lines.index(TABLE_HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names, default = [c.strip().replace("`", "") for c in line.strip("|").split("|")][:2]
        rows.append((names, default))
    return rows


def documented_defaults(function, text):
    """[(parameter, shown default, signature default)] of each row with a default: a cell that is a
    Python literal must be the signature's default; one in words describes a default of None."""
    import ast
    import inspect

    params = inspect.signature(function).parameters
    out = []
    for names, default in argument_rows(text):
        if names.startswith("**"):
            continue
        shown = [d.strip() for d in default.split(",")] if "," in names else [default]
        for name, cell in zip([n.strip() for n in names.split(",")], shown):
            assert name in params, f"{function.__qualname__}: the table lists {name!r}, which is not a parameter"
            try:
                value = ast.literal_eval(cell)
            except (ValueError, SyntaxError):
                value = None  # "all repeated blocks": what None stands for
            out.append((name, cell, params[name].default, value))
    return out


def test_argument_tables_show_the_signatures_defaults():
    """The defaults that the docs' and docstrings' argument tables show are the functions' own:
    docs/quickstart.md once said enable_checkpointing's offload defaulted to False (it is True)."""
    import importlib

    import ckpt_offload
    from ckpt_offload.integrations import hf

    with_tables = [p for p in pages() if not p.startswith("docs/reference/")
                   and TABLE_HEADER in open(os.path.join(ROOT, p)).read()]
    assert sorted(with_tables) == sorted(ARGUMENT_TABLES), "a page with an argument table: add it to ARGUMENT_TABLES"
    checked = []
    for page, name in ARGUMENT_TABLES.items():
        module, _, attr = name.rpartition(".")
        function = getattr(importlib.import_module(module), attr)
        with open(os.path.join(ROOT, page)) as f:
            checked += [(page, *row) for row in documented_defaults(function, f.read())]
    for module in (ckpt_offload, hf):
        for attr in dir(module):
            function = getattr(module, attr)
            if callable(function) and TABLE_HEADER in (getattr(function, "__doc__", None) or ""):
                checked += [(f"{module.__name__}.{attr}", *row) for row in documented_defaults(function, function.__doc__)]
    assert any(where == "docs/quickstart.md" and name == "offload" for where, name, *_ in checked)
    wrong = [f"{where}: {name} shown as {cell}, the signature's default is {default!r}"
             for where, name, cell, default, value in checked if value != default or type(value) is not type(default)]
    assert not wrong, "\n".join(wrong)


def test_examples_use_the_newest_checkpointing_names():
    """transformers 5.25 warns (FutureWarning) for gradient_checkpointing[_kwargs] in TrainingArguments,
    renamed activation_checkpointing[_kwargs]; 5.17, the floor, has only the old names. The examples
    and the docs' code take the names from hf.install_checkpointing_args (the installed release's),
    and never spell the old ones as arguments or keys."""
    old = re.compile(r"""\bgradient_checkpointing(_kwargs)?\s*=(?!=)|["']gradient_checkpointing(_kwargs)?["']\s*:""")
    sources = {p: "".join(code for code, _ in examples(p)) for p in pages()}
    for path in glob.glob(os.path.join(ROOT, "examples", "*.py")):
        with open(path) as f:
            sources[os.path.relpath(path, ROOT)] = f.read()
    for page in pages():  # illustrative blocks too: a reader copies them
        with open(os.path.join(ROOT, page)) as f:
            sources[page + " (all blocks)"] = "".join(body for info, body in fences(f.read()) if info == "python")
    found = [f"{where}: {m.group(0)}" for where, text in sources.items() for m in old.finditer(text)]
    assert not found, found
