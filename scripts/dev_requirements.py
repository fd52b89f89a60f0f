"""Prints, one a line, what scripts/setup.sh installs into the development venv, all read from
pyproject.toml so that nothing is listed twice: the build requirements, the dependencies and the
`dev` extra, with the extras it names (ckpt_offload[hf,test,...]) expanded.

Standard library only (tomllib: Python 3.11+; on 3.10 it needs tomli).
"""
import os
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        sys.exit("scripts/dev_requirements.py: Python 3.10 needs tomli to read pyproject.toml (pip install tomli)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path=os.path.join(ROOT, "pyproject.toml")):
    with open(path, "rb") as f:
        return tomllib.load(f)


def extra(project, name, seen=()):
    """The requirements of one extra, those of the project's own extras it names expanded in place."""
    if name in seen:
        raise ValueError(f"pyproject.toml: extra {name!r} names itself")
    out = []
    for req in project["optional-dependencies"][name]:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*\[([^\]]+)\]\s*", req)
        if m and re.sub(r"[-_.]+", "-", m.group(1)).lower() == re.sub(r"[-_.]+", "-", project["name"]).lower():
            for inner in m.group(2).split(","):
                out += extra(project, inner.strip(), (*seen, name))
        else:
            out.append(req)
    return out


def dev_requirements(config):
    reqs = list(config["build-system"]["requires"]) + list(config["project"]["dependencies"])
    reqs += extra(config["project"], "dev")
    return list(dict.fromkeys(reqs))  # in order, each once


if __name__ == "__main__":
    print("\n".join(dev_requirements(load())))
