"""mkdocs hook (mkdocs.yml `hooks:`): the site's name carries the release, read from
ckpt_offload/_version.py, the one place it is written. The file is run, not imported: the docs build
needs no compiled core for this."""
import os
import runpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def version() -> str:
    return runpy.run_path(os.path.join(ROOT, "ckpt_offload", "_version.py"))["__version__"]


def on_config(config):
    config["site_name"] = f"ckpt_offload {version()}"
    return config
