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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT_INFO = 'text title="Output"'
# Output with timings in it: each time (a decimal number that ends a line or comes before " ms", with
# the padding before it) is left out of the comparison; everything else must match.
TIMED_OUTPUT_INFO = 'text title="Output (times vary)"'
OUTPUTS = (OUTPUT_INFO, TIMED_OUTPUT_INFO)
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
        if info != "python" or body.startswith(ILLUSTRATIVE):
            continue
        follows = blocks[k + 1] if k + 1 < len(blocks) else None
        runs.append((body, follows if follows and follows[0] in OUTPUTS else None))
    return runs


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
    runs = examples(page)
    for name in OPTIONAL:
        if any(re.search(rf"^\s*(import|from) {name}\b", code, flags=re.M) for code, _ in runs):
            pytest.importorskip(name, reason=f"{name} is an optional dependency")
    # The CPU test path: CPU tensors go through the pool and the engine, so that what the examples
    # print (bytes offloaded, layers offloaded) is what a GPU prints.
    monkeypatch.setenv("CKPT_OFFLOAD_TEST_CPU", "1")
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
