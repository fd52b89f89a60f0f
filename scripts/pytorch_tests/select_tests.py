"""Select the checkpoint tests by a text search of each test function's source.

literal : the test method's own source makes a call with the keyword use_reentrant=False
indirect: it does not, but it reaches non-reentrant checkpoint through a helper method of its
          class that makes such a call (self._helper / self.checkpoint, followed transitively),
          or it runs checkpoint/checkpoint_sequential with use_reentrant=use_reentrant over
          [True, False] (a loop or @parametrize).
Run in the folder of the test files. Prints the pytest node ids, literal ones first (parametrizations
expanded), and how many of each kind to standard error.
"""
import ast
import os
import re
import subprocess
import sys

FILES = [f for f in ("test_autograd.py", "test_utils.py") if os.path.exists(f)]
LIT = "use_reentrant=False"


def has_lit(node):
    for c in ast.walk(node):
        if isinstance(c, ast.Call):
            for kw in c.keywords:
                if kw.arg == "use_reentrant" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                    return True
    return False


def classify(path):
    """({(class, test): kind} of the selected tests, {(class, test)} of every test method)."""
    src = open(path).read()
    tree = ast.parse(src)
    out, every = {}, set()
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        methods = {m.name: ast.get_source_segment(src, m, padded=False) for m in cls.body
                   if isinstance(m, ast.FunctionDef)}
        deco_src = {m.name: "\n".join(ast.get_source_segment(src, d) for d in m.decorator_list)
                    for m in cls.body if isinstance(m, ast.FunctionDef)}
        nodes = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef)}
        helpers = {n for n in methods if not n.startswith("test") and has_lit(nodes[n])}
        while True:  # helpers that call helpers
            more = {n for n, s in methods.items() if not n.startswith("test") and n not in helpers
                    and any(re.search(r"self\.%s\b" % re.escape(h), s) for h in helpers)}
            if not more:
                break
            helpers |= more
        for name, s in methods.items():
            if not name.startswith("test"):
                continue
            every.add((cls.name, name))
            if has_lit(nodes[name]):
                out[(cls.name, name)] = "literal"
                continue
            uses_helper = any(re.search(r"self\.%s\b" % re.escape(h), s) for h in helpers)
            over_flag = ("use_reentrant=use_reentrant" in s and
                         ("for use_reentrant in [True, False]" in s or
                          'parametrize("use_reentrant"' in deco_src[name]))
            if uses_helper or over_flag:
                out[(cls.name, name)] = "indirect"
    return out, every


def main():
    if not FILES:
        raise SystemExit("select_tests.py: no test_autograd.py or test_utils.py in this folder")
    kinds, every = {}, set()
    for f in FILES:
        selected, methods = classify(f)
        kinds.update({(f, c, n): k for (c, n), k in selected.items()})
        every.update((f, c, n) for c, n in methods)
    ids = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *FILES],
                         capture_output=True, text=True).stdout.split()
    ids = [i for i in ids if "::" in i]
    sel = {"literal": [], "indirect": []}
    for nid in ids:
        f, c, t = nid.split("::")
        # The method a collected id comes from: the longest test name it is or parametrizes (among
        # every method of its class, so that test_foo_bar is never taken for a case of test_foo).
        names = [n for (ff, cc, n) in every if ff == f and cc == c and (t == n or t.startswith(n + "_"))]
        if not names:
            continue
        kind = kinds.get((f, c, max(names, key=len)))
        if kind is not None:
            sel[kind].append(nid)
    print("\n".join(sel["literal"] + sel["indirect"]))
    print(f"selected: {len(sel['literal'])} literal, {len(sel['indirect'])} indirect", file=sys.stderr)


if __name__ == "__main__":
    main()
