"""Writes the API reference (docs/reference/*.md) from the docstrings, as markdown that reads the same on
GitHub, where pyproject.toml's Documentation URL points, and on the mkdocs site. Each page names what
it documents in marker lines; what lies between a marker and `<!-- /::: -->` is this script's output:

    <!-- ::: ckpt_offload.checkpoint -->
    <!-- /::: -->
    <!-- ::: ckpt_offload.integrations.hf members=false -->   (a module's docstring alone)
    <!-- /::: -->

    python scripts/api_reference.py           # rewrites the pages
    python scripts/api_reference.py --check   # exits 1, naming the pages, when one is not current

It imports ckpt_offload, so the compiled core must be built (the core's classes are documented from
their bindings). tests/test_api_reference.py runs the check.
"""
import argparse
import glob
import importlib
import inspect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = os.path.join(ROOT, "docs", "reference")
BLOCK = re.compile(r"^(<!-- ::: ([\w.]+)((?: \w+=\w+)*) -->\n)(.*?)^(<!-- /::: -->)$", re.M | re.S)
SECTIONS = {"Args", "Arguments", "Attributes", "Raises", "Returns", "Yields", "Example", "Examples", "Note", "Notes"}
LISTED = {"Args", "Arguments", "Attributes", "Raises"}  # sections whose entries are `name: text`
FENCE = "py"  # signatures: highlighted as Python, but not "python", the blocks tests/test_docs.py runs


def resolve(path):
    """The object a dotted path names: the longest importable module prefix, then attributes (a
    submodule wins over a package attribute of the same name)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"api_reference: nothing importable in {path}")


def docstring(text):
    """A Google-style docstring as markdown: prose as written, each section a bold title, and the
    entries of Args, Attributes and Raises as a list."""
    out, section, entry = [], None, None
    for line in (text or "").splitlines():
        title = re.fullmatch(r"(\w+):", line.strip())
        if not line.startswith(" ") and title and title.group(1) in SECTIONS:
            section = title.group(1)
            out += ["", f"**{section}:**", ""]
            continue
        if section is None or not line.startswith("    ") and line.strip():
            section = None if line.strip() else section
            out.append(line)
            continue
        body = line[4:]
        head = re.fullmatch(r"(\*{0,2}[\w.]+)(?: \(([^)]*)\))?: (.*)", body)
        if section in LISTED and head and not body.startswith(" "):
            name, kind, rest = head.groups()
            entry = f"- `{name}`" + (f" ({kind})" if kind else "") + f": {rest}"
            out.append(entry)
        elif section in LISTED and body.startswith(" "):
            out.append("  " + body.strip())  # the entry's next line
        else:
            out.append(body)
    return "\n".join(out).strip()


def unquoted(text):
    """Annotations as written in the source (they are strings under `from __future__ import annotations`)."""
    return re.sub(r"(: |-> )'([^'\n]*)'", r"\1\2", text)


def signature(name, obj):
    """The call's signature as Python shows it, one parameter a line when long, or a compiled
    function's from its first docstring line."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        line = unquoted(f"{name}{sig}")
        if len(line) <= 100:
            return line
        shown = str(sig.replace(parameters=[]))  # "()" or "() -> R"
        params, star = [], False
        for p in sig.parameters.values():
            if p.kind is p.KEYWORD_ONLY and not star:
                params.append("*")
            star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
            params.append(str(p))
        return unquoted(f"{name}(\n" + "".join(f"    {p},\n" for p in params) + shown[1:])
    # pybind11 writes each overload's signature into the docstring; `self` says nothing here.
    lines = [re.sub(r"^\d+\. ", "", line) for line in (obj.__doc__ or "").splitlines()
             if re.match(rf"(\d+\. )?{re.escape(obj.__name__)}\(", line)]
    lines = [line for line in lines if not line.endswith("(*args, **kwargs)")] or lines  # an overload set's own
    return "\n".join(re.sub(r"\(self: [\w.]+(, )?", "(", line) for line in lines) or None


def compiled_doc(obj):
    """A pybind11 docstring without the signature lines pybind11 puts first (or per overload)."""
    lines = (obj.__doc__ or "").splitlines()
    name = obj.__name__
    return "\n".join(line for line in lines if not re.match(rf"(\d+\. )?{re.escape(name)}\(", line)
                     and line != "Overloaded function.").strip()


def is_compiled(obj):
    return type(obj).__name__ in ("builtin_function_or_method", "instancemethod", "pybind11_type") or (
        inspect.isclass(obj) and type(obj).__name__.startswith("pybind11"))


def member_block(cls, name, member):
    """One method or property of a class, as a list item under the class."""
    if isinstance(member, property):
        doc = inspect.getdoc(member) or ""
        return f"#### `{name}` (property)\n\n{docstring(doc)}".rstrip()
    func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    sig = signature(name, func)
    sig = sig and re.sub(r"^(\w+\()(?:self|cls)(?:, |,\n    |(?=\)))", r"\1", sig)
    doc = compiled_doc(func) if is_compiled(func) else docstring(inspect.getdoc(func))
    return "\n\n".join(p for p in (f"#### `{name}`", f"```{FENCE}\n{sig}\n```" if sig else "", doc) if p)


def members(cls):
    """The public methods and properties a class defines itself, in source order."""
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (property, staticmethod, classmethod)) or inspect.isfunction(member) or (
                is_compiled(cls) and callable(member)):
            out.append((name, member))
        elif type(member).__name__ == "property" or hasattr(member, "fget"):
            out.append((name, member))
    return out


def render(path, options):
    obj = resolve(path)
    parts = [f"### `{path}`"]
    if inspect.ismodule(obj):
        parts.append(docstring(inspect.getdoc(obj)))
        return "\n\n".join(parts)
    short = path.rsplit(".", 1)[-1]
    compiled = is_compiled(obj)
    if inspect.isclass(obj):
        if not compiled:
            sig = signature(short, obj)
            if sig:
                parts.append(f"```{FENCE}\nclass {sig}\n```")
        parts.append(compiled_doc(obj) if compiled else docstring(inspect.getdoc(obj)))
        if options.get("members", "true") != "false":
            parts += [member_block(obj, n, m) for n, m in members(obj)]
    else:
        sig = signature(short, obj)
        if sig:
            parts.append(f"```{FENCE}\n{sig}\n```")
        parts.append(compiled_doc(obj) if compiled else docstring(inspect.getdoc(obj)))
    return re.sub(r"\n{3,}", "\n\n", "\n\n".join(p for p in parts if p))


def page(text):
    def one(m):
        options = dict(o.split("=") for o in m.group(3).split())
        return f"{m.group(1)}\n{render(m.group(2), options)}\n\n{m.group(5)}"
    return BLOCK.sub(one, text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is not current")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    stale = []
    for path in sorted(glob.glob(os.path.join(PAGES, "*.md"))):
        with open(path) as f:
            before = f.read()
        after = page(before)
        if after != before:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(after)
    if args.check and stale:
        print(f"not current: {', '.join(stale)}; run: python scripts/api_reference.py", file=sys.stderr)
        return 1
    print(("rewrote: " + ", ".join(stale)) if stale and not args.check else "the API reference is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
