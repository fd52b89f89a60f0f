"""Loads the compiled core, ckpt_offload._C, and checks it was built for the torch that is running."""
import importlib
import json
import os
import sys
from importlib import machinery, metadata

from packaging.version import Version

from ._floor import torch_message, torch_too_old

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def source_checkout():
    """The source folder this package runs from (a checkout or an unpacked sdist: setup.py and csrc/
    beside the package), or None for a package installed elsewhere (site-packages, --target)."""
    root = os.path.dirname(_PACKAGE_DIR)
    if os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc")):
        return root
    return None


def _installed_from():
    """What pip installed this package from, as pip takes it again (its direct_url.json record), or None
    when unknown or when that was a built wheel (reinstalling it would give back the same build)."""
    try:
        dist = metadata.distribution("ckpt_offload")
        # The record must be this copy's: another install may sit elsewhere on sys.path.
        mine = os.path.realpath(str(dist.locate_file("ckpt_offload/__init__.py"))) == os.path.join(
            os.path.realpath(_PACKAGE_DIR), "__init__.py")
        text = dist.read_text("direct_url.json") if mine else None
        record = json.loads(text) if text else None
    except (metadata.PackageNotFoundError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("url"), str):
        return None
    url = record["url"]
    vcs = record.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs"):
        # The commit that was installed: a branch, or no revision at all, names a newer one by now.
        rev = vcs.get("commit_id") or vcs.get("requested_revision")
        return f"{vcs['vcs']}+{url}" + (f"@{rev}" if rev else "")
    if url.endswith(".whl"):
        return None
    return url[len("file://"):] if url.startswith("file://") else url


def rebuild_command():
    """The command that rebuilds the core against the running torch: in a source folder the in-place
    build, for an installed package pip's reinstall from its source (`--no-deps`: torch stays)."""
    root = source_checkout()
    if root is not None:
        return f"pip install --no-build-isolation -e .   (in {root})"
    source = _installed_from() or "<the sdist or git URL ckpt_offload was installed from>"
    return f"pip install --no-build-isolation --no-deps --force-reinstall {source}"


def shadowed_install():
    """Where an installed ckpt_offload lies that this import did not reach, or None: this copy is a
    source folder without a build of its own, first on sys.path because Python was started in the
    folder's root (or PYTHONPATH names it), and another copy is installed further down the path."""
    root = source_checkout()
    if root is None or any(f.startswith("_C.") and f.endswith(tuple(machinery.EXTENSION_SUFFIXES))
                           for f in os.listdir(_PACKAGE_DIR)):
        return None
    real_root = os.path.realpath(root)
    rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != real_root]
    spec = machinery.PathFinder.find_spec("ckpt_offload", rest)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


def _record():
    try:
        from . import _build_info
    except ImportError:
        return None
    return _build_info


def _release(version):
    # 2.14.1+cu130 and 2.14.1 are the same release; a local tag alone does not change the ABI
    # of the headers the extension compiled against, the public version does.
    return Version(version).public


def load():
    import torch  # here, not above: the env report imports this module to report a torch that fails to import

    record = _record()
    installed = torch.__version__
    if torch_too_old(installed):
        raise ImportError(torch_message("ckpt_offload", installed))
    if record is not None and _release(record.TORCH_VERSION) != _release(installed):
        raise ImportError(
            f"ckpt_offload._C was built for torch {record.TORCH_VERSION} but torch {installed} is installed; "
            f"rebuild it: {rebuild_command()}"
        )
    try:
        # By its full name: `from . import _C` inside the package's own import reports a missing module
        # as a "partially initialized module (most likely due to a circular import)".
        _C = importlib.import_module(f"{__package__}._C")
    except ImportError as err:
        installed_copy = shadowed_install()
        if installed_copy is not None:
            raise ImportError(
                f"ckpt_offload was imported from the source folder {source_checkout()}, which has no build of "
                f"ckpt_offload._C, and not from the copy installed at {installed_copy}: Python puts the current "
                "directory (or PYTHONPATH) first on sys.path. To use the installed copy, run from another "
                "directory; to work on this folder's sources, build them in place: pip install "
                "--no-build-isolation -e ."
            ) from err
        raise ImportError(load_failure(err, record, installed)) from err
    return _C


def load_failure(err, record, installed) -> str:
    """Why the core did not load, in one message: not built at all (no compiled file in the package),
    or a file that does not load, with its error; the torch versions only where they differ (equal
    ones say nothing about the cause); and the command that builds it."""
    missing = isinstance(err, ModuleNotFoundError) and err.name == f"{__package__}._C"
    if missing:
        cause = (f"ckpt_offload._C is not built: no compiled extension in {_PACKAGE_DIR} "
                 f"(sizing, `python -m ckpt_offload estimate`, works without it)")
    else:
        cause = f"ckpt_offload._C could not be loaded ({err})"
    if record is not None and record.TORCH_VERSION != installed:
        cause += f"; built for torch {record.TORCH_VERSION}, torch {installed} is installed"
    return f"{cause}. Build it with: {rebuild_command()}"
